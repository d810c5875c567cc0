"""Every variant is caught wherever it is observable, and correct layers pass, over drawn configurations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

import correct
import diagnostics
from buggy_variants import VARIANTS, Setting

IDS = sorted(VARIANTS)


@st.composite
def audit_configs(draw):
    """Sizes the audit probes at: heads, head width (1 and odd included), probe length, seed."""
    return dict(heads=draw(st.integers(1, 4)), head_dim=draw(st.integers(1, 6)), seq_len=draw(st.integers(2, 10)),
                seed=draw(st.integers(0, 2**16)))


def probe_setting(variant, cfg) -> Setting:
    """The union of what the audit's probes show a layer: a cross-attention call, a cached-decoding call
    (Tq = T // 2 queries over T keys), a padding mask and a query row with no key (see diagnostics._detectors)."""
    T = cfg["seq_len"]
    t_q = max(1, T // 2)
    mask = torch.arange(T) < max(1, T - 1)  # padding: the last key blocked
    mask = mask.expand(t_q, T).clone()
    mask[0] = False  # one query that may attend nothing
    layer_kw = variant.layer_kwargs
    return Setting(cfg["heads"] * cfg["head_dim"], cfg["heads"], t_q, T, mask=mask, self_attention=False,
                   causal=layer_kw.get("causal", False), dropout=layer_kw.get("dropout", 0.0))


def _audit(layer, cfg, **kw):
    return diagnostics.audit(layer, seq_len=cfg["seq_len"], seed=cfg["seed"], **kw)


@pytest.mark.parametrize("vid", IDS)
@given(cfg=audit_configs())
def test_audit_catches_each_variant_where_observable(vid, cfg):
    variant = VARIANTS[vid]
    assume(variant.detectable_when(probe_setting(variant, cfg)))
    torch.manual_seed(cfg["seed"])
    layer = variant.build(cfg["heads"] * cfg["head_dim"], cfg["heads"])
    report = _audit(layer, cfg, causal=layer.causal)
    fired = report.fired()
    missing = [d for d in variant.expected_detectors if d not in fired]
    assert not missing, f"{vid}: {missing} did not fire\n{report}"
    assert report.passed == (variant.expected_severity == "warn"), str(report)


@pytest.mark.parametrize("vid", IDS)
@given(cfg=audit_configs())
def test_reference_passes_every_detector_on_the_same_configurations(vid, cfg):
    """The twin: the correct layer, built and audited exactly like the variant above."""
    variant = VARIANTS[vid]
    torch.manual_seed(cfg["seed"])
    layer = variant.reference(cfg["heads"] * cfg["head_dim"], cfg["heads"])
    report = _audit(layer, cfg, causal=layer.causal)
    assert report.passed, str(report)
    assert not report.findings, str(report)


def _correct_layer(kind: str, cfg, dtype, device):
    d_model = cfg["heads"] * cfg["head_dim"]
    if kind == "torch_sdpa":
        return F.scaled_dot_product_attention, dict(num_heads=cfg["heads"], d_model=d_model, dtype=dtype,
                                                    device=device)
    if kind == "torch_mha":
        layer = torch.nn.MultiheadAttention(d_model, cfg["heads"], batch_first=bool(cfg["seed"] % 2))
        return layer.to(device=device, dtype=dtype), {}
    return correct.MultiHeadAttention(d_model, cfg["heads"], causal=cfg["causal"]).to(device=device, dtype=dtype), {}


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kind", ["reference", "torch_sdpa", "torch_mha"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(cfg=audit_configs(), causal=st.booleans())
def test_correct_layers_fail_no_detector(kind, dtype, cfg, causal, device):
    """The reference, torch's SDPA and nn.MultiheadAttention over drawn sizes, seeds, causality, dtypes and
    devices (the audit draws its masks from the seed: padding, causal, a row with no key)."""
    cfg = {**cfg, "causal": causal}
    torch.manual_seed(cfg["seed"])
    layer, kw = _correct_layer(kind, cfg, dtype, device)
    report = _audit(layer, cfg, causal=causal, **kw)
    assert report.passed, str(report)
    allowed_warnings = {"fully_masked_rows"} if kind == "torch_mha" else set()  # its NaN rows, by design
    assert set(report.fired()) <= allowed_warnings, str(report)
