"""The example audit_model builds from what a Hugging Face model declares (issue 33, "the example the audit builds"):
the inputs its forward requires beside the main one (a patch grid's spatial_shapes), the pixels a model that pairs
text with images needs, a backbone that returns feature maps only. Each fixed case is judged (no longer "raised on the
example"); its twin shows a real failure is still one, and that what cannot be built is a usage error naming it."""

from __future__ import annotations

import pytest

import diagnostics

tf = pytest.importorskip("transformers")

LAYER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def siglip2(**kw):
    return tf.Siglip2VisionModel(tf.Siglip2VisionConfig(**{**LAYER, "num_patches": 16, "patch_size": 4, **kw})).eval()


def raise_in(model) -> str:
    """The model's first attention raises (a bug inside it); its name."""
    name, module = next((n, m) for n, m in model.named_modules() if n.endswith("self_attn"))

    def broken(*args, **kwargs):
        raise RuntimeError("a bug inside the attention")
    module.forward = broken
    return name


def test_a_patch_grid_model_gets_its_spatial_shapes_and_runs():
    report = diagnostics.audit_model(siglip2())
    runs = report.result("model_runs")
    assert runs.verdict == "pass", str(report)


def test_a_patch_grid_model_that_raises_in_its_attention_still_fails_there():
    model = siglip2()
    name = raise_in(model)
    runs = diagnostics.audit_model(model).result("model_runs")
    assert runs.verdict == "fail" and f"inside {name}" in runs.message, runs


def test_a_patch_grid_nothing_declares_is_a_usage_error_naming_what_to_pass():
    model = siglip2()
    object.__setattr__(model.config, "num_patches", None)  # a config that declares no grid (past its validator)
    with pytest.raises(diagnostics.AuditUsageError, match=r"spatial_shapes.*pass example="):
        diagnostics.audit_model(model)


def test_first_tensor_reads_a_backbones_feature_maps():
    from diagnostics.model._runner import first_tensor

    import torch
    maps = (torch.zeros(1, 2, 4, 4), torch.ones(1, 4, 2, 2))
    assert first_tensor(tf.modeling_outputs.BackboneOutput(feature_maps=maps)) is maps[0]
    assert first_tensor(tf.modeling_outputs.BackboneOutput()) is None  # nothing in it: still none
