"""An encoder-decoder's encoder is padded too (issue 33: T5Gemma's injected encoder mask bugs, 2026-12-04).

`padding_invariance` pads the varying input, an encoder-decoder's decoder ids, and the encoder's ids stayed as they
were: T5Gemma passes its encoder layers no mask at all where nothing is padded, so an encoder layer that ignores its
mask passed every check (the whole passing population with bugs: 806 of 808 caught, its two mask bugs missed). The
encoder's ids are now right-padded as well (the decoder's inputs unchanged), the decoder's outputs must not move, and
a change is localised to the first layer it shows in (`padding._encoder_padding`). Checked through the sweep: the
correct model passes with that scenario in its evidence, and both mask bugs in its encoder layer are caught there.
"""

from __future__ import annotations

import pytest

import diagnostics


@pytest.mark.slow  # builds and audits T5Gemma six times through the sweep (about 35 s on 2 cores)
def test_an_encoder_layer_that_ignores_its_mask_is_found_by_padding_the_encoder(sweep_benchmark):
    """Through the sweep: the correct T5Gemma passes, with the encoder's padding in its evidence, and each bug injected
    into its encoder layer 1 (the sweep's second audited layer) is caught there: the two mask bugs were missed."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    sweep = sweep_benchmark
    row = sweep.run_transformers("t5gemma", bugs=True)
    assert row.verdict == "passed", row
    assert row.bugs == dict.fromkeys(sweep.BUGS, "caught"), row.bugs
    model = sweep.build("t5gemma")
    padding = diagnostics.audit_model(model, detectors=["padding_invariance"]).result("padding_invariance")
    assert padding.verdict == "pass" and "the encoder's ids right-padded by 4 (12 real)" in padding.evidence, padding
