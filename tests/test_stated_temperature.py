"""A temperature the layer states, beside the scale it declares (transformers 5.25's MuseSpark text attention: q and k
RMS-normalised, q then multiplied by `self.qk_scale_factor` = 5.473, and the kernel given `scaling` = 1/sqrt(d)).

The model audit declares the module's `scaling`; q·k reached the softmax multiplied by 5.47x that, and
`softmax_saturation` failed the correct model, "5.47x too sharp". A number the layer holds and applies to its normalised
q (or to q and k each, its square root) is its own temperature: the cosine bounds judge the logits it reaches. The
twins, each failing on the same inputs: the same factor written as a literal (nothing states it), and the declared
scale applied a second time (a number the layer holds, but the declared scale itself).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # unit RMS over each head's width


class NormedWithTemperature(nn.Module):
    """Pre-softmax q and k RMS-normalised per head, q multiplied by a temperature; `how`: "stated" (an attribute),
    "literal" (the same number, written in the code), "twice" (the declared scale again instead of the temperature)."""

    def __init__(self, how="stated", d_model=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scaling = self.head_dim ** -0.5
        if how == "stated":
            self.qk_scale_factor = 5.4730064863875  # the literal twin holds no such number
        self.how = how
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = _rms(q), _rms(k)  # (B, H, T, d) each
        if self.how == "stated":
            q = q * self.qk_scale_factor
        elif self.how == "literal":
            q = q * 5.4730064863875
        else:
            q = q * self.scaling
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


def _saturation(how, dtype):
    torch.manual_seed(0)
    layer = NormedWithTemperature(how).to(dtype)
    return diagnostics.audit(layer, scale=layer.scaling, detectors=["softmax_saturation"]).result(
        "softmax_saturation")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_temperature_the_layer_states_is_its_own_and_its_twins_still_fail(dtype):
    stated, literal, twice = (_saturation(how, dtype) for how in ("stated", "literal", "twice"))
    assert stated.verdict == "pass", stated.evidence
    assert "NormedWithTemperature.qk_scale_factor" in stated.evidence
    assert literal.verdict == "fail" and "too sharp" in literal.message, literal.evidence
    assert twice.verdict == "fail" and "too flat" in twice.message, twice.evidence


class GainOnQ(nn.Module):
    """Unnormalised q multiplied by a gain before the kernel is given the declared scale (transformers 5.25's
    LongCat-Flash MLA: q times `mla_scale_q_lora` = sqrt(hidden_size / q_lora_rank), which failed the correct model
    "1.41x too sharp"); `how`: "stated" (an attribute), "literal" (the same number, written in the code), "missing"
    (stated and applied, but the kernel given scale 1: the missing 1/sqrt(d_k))."""

    def __init__(self, how="stated", d_model=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scaling = self.head_dim ** -0.5
        if how != "literal":
            self.mla_scale_q_lora = 2.0 ** 0.5  # the literal twin holds no such number
        self.how = how
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q = q * (2.0 ** 0.5 if self.how == "literal" else self.mla_scale_q_lora)  # (B, H, T, d)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.how == "missing" else self.scaling)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_gain_the_layer_states_on_unnormalised_q_is_its_own_and_its_twins_still_fail(dtype):
    torch.manual_seed(0)
    results = {}
    for how in ("stated", "literal", "missing"):
        torch.manual_seed(0)  # the three share their weights
        layer = GainOnQ(how).to(dtype)
        results[how] = diagnostics.audit(layer, scale=layer.scaling, detectors=["softmax_saturation"]).result(
            "softmax_saturation")
    assert results["stated"].verdict == "pass", results["stated"].evidence  # failed before: 1.41x too sharp
    assert "GainOnQ.mla_scale_q_lora" in results["stated"].evidence
    assert results["literal"].verdict == "fail" and "1.41x too sharp" in results["literal"].message
    missing = results["missing"]
    assert missing.verdict == "fail" and "too sharp" in missing.message, missing.message
