"""Models made of towers: CLIP's causal text tower beside its vision tower (issue 33, transformers 5.25).

- Given an example with both its inputs (`{'input_ids': ..., 'pixel_values': ...}`, as the inconclusive asked),
  CLIPModel's correct vision layers failed `future_leakage` and `gradients` in place: the model is causal (its text
  tower's mask), and every self-attention was audited as causal, though the vision layers read the same pixels
  whatever the tokens. A layer whose length stays when the sequence is one token shorter reads another stream, and is
  audited as not causal. Twin: a text layer that drops its causal mask is still caught, in place, with that example.
- Zero-config, the audit builds token ids only and CLIPModel raises on them: the inconclusive now names the models it
  is made of (model.text_model, model.vision_model), and each of them, audited as named, passes.
"""

from __future__ import annotations

import pytest
import torch

import diagnostics

pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")


def _clip(attn_implementation: str = "sdpa"):
    """A tiny CLIP (std-0.02 initialisation, its default): 2 layers a tower, width 32, 4 heads, 32 px images."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(text_config=dict(vocab_size=99, max_position_embeddings=32, **tower),
                        vision_config=dict(image_size=32, patch_size=8, **tower), projection_dim=16)
    config._attn_implementation = attn_implementation
    return CLIPModel(config).eval()


def _both_inputs(model) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, 90, (2, 12), generator=gen),
            "pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}


def _drops_text_mask(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """SDPA's attention function, except in the module marked `_test_drops_mask`: its causal mask is dropped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "_test_drops_mask", False):
        attention_mask, is_causal = None, False
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kw)


@pytest.mark.parametrize("causal", [None, True], ids=["inferred", "declared"])
def test_with_both_inputs_the_vision_tower_is_not_audited_as_causal(causal):
    model = _clip()
    report = diagnostics.audit_model(model, example=_both_inputs(model), causal=causal)
    assert report.causal, report  # the text tower's causal mask, inferred or declared
    vision = [p for p in report.layers if p.startswith("vision_model.")]
    text = [p for p in report.layers if p.startswith("text_model.")]
    assert len(vision) == 2 and len(text) == 2, list(report.layers)
    assert report.status != "failed", report
    for p in vision:  # before: future_leakage and gradients failed at both
        assert report.layers[p].status == "passed", (p, report.layers[p])
        assert report.layers[p].result("future_leakage").verdict == "skip"
    for p in text:
        assert report.layers[p].result("future_leakage").verdict == "pass", (p, report.layers[p])


def test_with_both_inputs_a_text_layer_that_drops_its_causal_mask_is_caught_in_place():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("test_drops_text_mask", _drops_text_mask)
    AttentionMaskInterface.register("test_drops_text_mask", sdpa_mask)
    model = _clip("test_drops_text_mask")
    model.text_model.encoder.layers[1].self_attn._test_drops_mask = True
    # declared: inferred from the model's behaviour, a model whose text tower leaks is not causal (its twin above)
    report = diagnostics.audit_model(model, example=_both_inputs(model), causal=True)
    assert report.status == "failed", report
    broken = report.layers["text_model.encoder.layers.1.self_attn"]
    assert broken.result("future_leakage").verdict == "fail", broken
    assert {p for p, r in report.layers.items() if r.status == "failed"} == {
        "text_model.encoder.layers.1.self_attn"}, report


def test_zero_config_the_inconclusive_names_the_towers_and_each_passes_as_named():
    model = _clip()
    report = diagnostics.audit_model(model)
    assert report.status == "inconclusive", report
    assert "or audit the models it is made of one by one (model.text_model, model.vision_model)" in \
        report.status_reason, report.status_reason
    for tower in (model.text_model, model.vision_model):
        assert diagnostics.audit_model(tower).status == "passed"
