"""`parameters_used` and projections fused with their originals kept (diffusers' `fuse_projections`): the kept
copies are a warning that says where their values live, and a projection left out beside them still fails.

Twins on the same weights: `Fused` computes q, k and v from one fused weight made of its own q, k and v projections,
which it keeps (a warning, the audit passes); `broken` makes the fused weight of q, k and k again (the value rows are
the key's), so `v_proj` is no copy of anything used: the output does not depend on it (a failure, named).

The same rule for a layer whose own projections another module replaces with whole copies it holds (diffusers'
Custom Diffusion processors: `to_q_custom_diffusion` beside the Attention's `to_q`, loaded from it by the training
script): `Replaced` computes q, k and v through its adapter's copies (a warning, the audit passes); `retrained` gives
the adapter's value projection values of its own, so the layer's `v_proj` is no copy of anything used (a failure).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics.detectors.parameters import kept_copy


class Fused(nn.Module):
    def __init__(self, d_model=16, num_heads=2, broken=False):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        third = self.k_proj if broken else self.v_proj  # broken: the value rows copied from the key projection
        self.qkv = nn.Linear(d_model, 3 * d_model)
        with torch.no_grad():  # fused from the separate projections, which stay (to unfuse later)
            self.qkv.weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, third.weight]))
            self.qkv.bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, third.bias]))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("broken", [False, True], ids=["kept copies", "value projection left out"])
def test_kept_copies_warn_and_a_projection_left_out_beside_them_fails(broken):
    torch.manual_seed(0)
    report = diagnostics.audit(Fused(broken=broken), detectors=["parameters_used"], progress=False)
    result = report.result("parameters_used")
    if broken:
        assert result.verdict == "fail" and "v_proj.weight" in result.message, result
        assert "v_proj.weight is a copy" not in result.evidence, result.evidence
        assert "q_proj.weight is a copy of rows 0-15 of qkv.weight" in result.evidence, result.evidence
    else:
        assert result.verdict == "warn", result
        for name, rows in (("q_proj", "0-15"), ("k_proj", "16-31"), ("v_proj", "32-47")):
            assert f"{name}.weight is a copy of rows {rows} of qkv.weight" in result.message, result.message
            assert f"{name}.bias is a copy of rows {rows} of qkv.bias" in result.message, result.message
        assert report.status == "passed", str(report)


def test_a_copy_is_found_only_in_a_used_parameter_and_only_as_a_whole_block():
    w = torch.arange(12.0).reshape(6, 2)
    params = {"fused": w, "a": w[:2].clone(), "b": w[1:3].clone(), "c": w[2:4].clone()}
    assert kept_copy("a", params, {"a"}) == "rows 0-1 of fused"
    assert kept_copy("c", params, {"c"}) == "rows 2-3 of fused"
    assert kept_copy("b", params, {"b"}) == ""  # rows 1-2 straddle two blocks: no projection's rows
    assert kept_copy("a", params, {"a", "fused"}) == ""  # the fused one unused too: nothing holds the values in use
    assert kept_copy("a", {"fused": w + 1, "a": w[:2].clone()}, {"a"}) == ""  # another value: not a copy


# ---- whole copies: projections replaced by an adapter's copies of them ----------------------------------------


class Adapter(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.q_proj_adapted, self.k_proj_adapted, self.v_proj_adapted = (nn.Linear(d_model, d_model)
                                                                         for _ in range(3))


class Replaced(nn.Module):
    def __init__(self, d_model=16, num_heads=2, retrained=False):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)
        self.adapter = Adapter(d_model)
        with torch.no_grad():  # loaded from the layer's own, as an adapter's training starts
            for name in ("q_proj", "k_proj", "v_proj"):
                if not (retrained and name == "v_proj"):
                    getattr(self.adapter, f"{name}_adapted").load_state_dict(getattr(self, name).state_dict())

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, tokens, width
        a = self.adapter
        q, k, v = (f(x).view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2)
                   for f in (a.q_proj_adapted, a.k_proj_adapted, a.v_proj_adapted))  # (B, H, T, d)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("retrained", [False, True], ids=["copies", "value projection of its own"])
def test_projections_replaced_by_copies_warn_and_one_that_is_no_copy_fails(retrained):
    torch.manual_seed(0)
    report = diagnostics.audit(Replaced(retrained=retrained), detectors=["parameters_used"], progress=False)
    result = report.result("parameters_used")
    if retrained:
        assert result.verdict == "fail" and "v_proj.weight" in result.message, result
        assert "q_proj.weight is a copy of adapter.q_proj_adapted.weight" in result.evidence, result.evidence
    else:
        assert result.verdict == "warn", result
        for name in ("q_proj", "k_proj", "v_proj"):
            assert f"{name}.weight is a copy of adapter.{name}_adapted.weight" in result.message, result.message
        assert report.status == "passed", str(report)


def test_a_whole_copy_is_found_only_in_a_used_parameter_of_the_same_values():
    w = torch.arange(6.0).reshape(3, 2)
    assert kept_copy("a", {"used": w, "a": w.clone()}, {"a"}) == "used"
    assert kept_copy("a", {"used": w, "a": w.clone()}, {"a", "used"}) == ""  # nothing used holds the values
    assert kept_copy("a", {"used": w + 1, "a": w.clone()}, {"a"}) == ""  # another value: not a copy


@pytest.mark.parametrize("values", ["constant", "drawn"])
def test_a_constant_parameter_is_no_copy_of_a_constant_block(values):
    """A norm's weight of ones (or a bias of zeros), as initialised, equals every constant block of another
    parameter: that shows no copying, so an unused LayerNorm beside a used one is unused (a failure), never a kept
    copy. The same shapes with values drawn are a copy where the values are the used one's."""
    used = torch.ones(16) if values == "constant" else torch.randn(16, generator=torch.Generator().manual_seed(0))
    params = {"norm_a.weight": nn.Parameter(used.clone()), "norm_b.weight": nn.Parameter(used.clone())}
    assert kept_copy("norm_b.weight", params, {"norm_b.weight"}) == ("" if values == "constant" else "norm_a.weight")
