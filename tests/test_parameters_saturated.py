"""`parameters_used` at the gradient checks' gain: a softmax saturated to one-hot is no unused projection.

Found by a local Hypothesis draw (2026-12-05): the windowed reference of `window_on_both_sides` at one head of width 1,
two tokens, bfloat16, torch's default init and seed 608 failed `parameters_used` ("the output does not depend on
qkv.weight (on rows 0-1 of 3)"). Its standard probe's logits are flat to bfloat16's rounding, so the gain read there
(`logit_gain`, 64.9) scaled the gradient checks' own tokens, on which the float64 copy's logits then lay thousands
apart, every softmax row one-hot to the last bit, and the query and key rows got a gradient of exactly 0 and moved
nothing. The gradient checks now read their gain on their own tokens, in float64 (`gradient_gain`: 2.15 here), where
the median row is neither uniform nor one-hot. Twin on the same weights, inputs and audit: the same layer with one step
changed, its scores replaced by zeros (q and k computed, then dropped), still fails.
"""

from __future__ import annotations

import pytest
import torch

import diagnostics
from buggy_variants import VARIANTS
from diagnostics._guard import seed_rng
from diagnostics._observe import Observer
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._common import float64_copy_or_skip, gradient_probe, logit_gain, pack

DRAW = dict(d_model=1, heads=1, seq_len=2, seed=608, dtype=torch.bfloat16)  # torch's default init


def built(drops_scores: bool):
    """The catalog's windowed reference as the property tests build it at the draw; with `drops_scores`, its `score`
    step returns zeros (uniform weights over the window: q and k reach nothing)."""
    variant = VARIANTS["window_on_both_sides"]
    seed_rng(DRAW["seed"])
    layer = variant.reference(DRAW["d_model"], DRAW["heads"]).to(DRAW["dtype"])
    if drops_scores:
        reference = type(layer)

        class ScoresDropped(reference):
            def score(self, q, k):
                return torch.zeros_like(reference.score(self, q, k))

        layer.__class__ = ScoresDropped
    return layer, variant.audit_kwargs(layer)


def audited(drops_scores: bool):
    layer, declared = built(drops_scores)
    return diagnostics.audit(layer, seq_len=DRAW["seq_len"], seed=DRAW["seed"], detectors=["parameters_used"],
                             **declared).result("parameters_used")


def test_a_softmax_saturated_by_the_standard_probes_gain_leaves_q_and_k_used():
    found = audited(drops_scores=False)
    assert found.verdict == "pass", found
    # one forward and backward, its tokens' gain read first: nothing asked again
    labels = [p.label for p in found.probes if p.label.startswith("float64 copy")]
    assert labels == ["float64 copy, the gradient checks' tokens at their plain size, for their gain (B=2, T=2)",
                      "float64 copy, forward and backward (B=2, T=2)"], labels


def softmax_rows(gain_of: str):
    """The float64 copy's softmax rows on the gradient checks' tokens scaled by the gain they use (`gradient_gain`)
    or by the standard probe's (`logit_gain`), and that gain."""
    layer, declared = built(drops_scores=False)
    subject = make_subject(layer, dtype=DRAW["dtype"])
    probe = Probe(subject, causal=declared["causal"], scale=None, seq_len=DRAW["seq_len"], seed=DRAW["seed"],
                  pattern=declared["pattern"])
    probe.detector = "parameters_used"
    sub = float64_copy_or_skip(probe, "parameters_used")
    made = gradient_probe(probe, sub)
    gain = made.gain if gain_of == "own tokens" else logit_gain(probe)
    tokens = tuple(x.detach() / made.gain * gain for x in made.inputs)
    observer = Observer()
    with torch.enable_grad(), observer:
        sub(*pack(tokens), made.allowed)
    return observer.record.softmaxes[-1].output.reshape(-1, 2), gain


@pytest.mark.parametrize("gain_of", ["own tokens", "standard probe"])
def test_the_gain_read_on_the_gradient_checks_own_tokens_keeps_a_softmax_row_off_one_hot(gain_of):
    """The cause, both sides: at the standard probe's gain (64.9) every row of the float64 softmax is one-hot to the
    last bit (q and k get no gradient); at the gain read on these tokens (2.15) a row that weighs two keys has both
    off 0 and 1, as the median row does."""
    rows, gain = softmax_rows(gain_of)
    two_keys = rows[(rows > 0).sum(-1) == 2] if gain_of == "own tokens" else rows
    one_hot = bool(((rows == 0) | (rows == 1)).all())
    assert one_hot == (gain_of == "standard probe"), (gain, rows)
    assert gain == pytest.approx(2.147, abs=1e-3) if gain_of == "own tokens" else gain == pytest.approx(64.87, abs=1e-2)
    if gain_of == "own tokens":
        assert len(two_keys) >= 2 and bool(((two_keys > 1e-3) & (two_keys < 1 - 1e-3)).all()), rows


def test_q_and_k_computed_and_dropped_fail_at_the_same_draw():
    found = audited(drops_scores=True)
    assert found.verdict == "fail", found
    assert "qkv.weight" in found.message and "rows 0-1" in found.message, found.message


@pytest.mark.parametrize("drops_scores", [False, True])
def test_the_layer_is_left_as_it_was(drops_scores):
    layer, declared = built(drops_scores)
    before = {n: p.detach().clone() for n, p in layer.state_dict().items()}
    diagnostics.audit(layer, seq_len=DRAW["seq_len"], seed=DRAW["seed"], detectors=["parameters_used"], **declared)
    assert all(torch.equal(before[n], p) for n, p in layer.state_dict().items())
