"""`parameters_used` and a layer whose own projections another module replaces with a copy it holds (diffusers'
Custom Diffusion processors: `to_q_custom_diffusion` beside the Attention's `to_q`, loaded from it by the training
script): the layer's own, unused, are kept copies of the used ones, a warning that says where their values live.

Twins on the same layer: `Replaced` computes q, k and v through its adapter's copies of its own projections (a
warning, the audit passes); `retrained` gives the adapter's value projection values of its own, so the layer's
`v_proj` is no copy of anything used: the output does not depend on it (a failure, named). The rule stays the one
of tests/test_kept_copies.py, whole parameters now beside blocks of rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics.detectors.parameters import kept_copy


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
