"""Parameters a model uses only with an input the audit did not pass (issue 33: Longformer's and LED's global
attention projections, used only for the tokens `global_attention_mask` marks) are "not exercised", a warning that
names the input, never "unused"; a layer whose parameters stay unused with that input too still fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng


class GlobalAttention(nn.Module):
    """Self-attention where the tokens `global_attention_mask` marks are queried through projections of their own
    (Longformer's query_global, key_global, value_global); `bug`: the marked tokens get the local projections
    again, their own never used (a real bug: what the global projections learn is thrown away)."""

    def __init__(self, d_model: int = 16, num_heads: int = 2, bug: bool = False):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.qkv_global = nn.Linear(d_model, 3 * d_model)

    def _attend(self, qkv: torch.Tensor) -> torch.Tensor:
        B, T, D3 = qkv.shape  # batch, sequence length, 3 x width
        H, D = self.num_heads, D3 // 3
        q, k, v = qkv.reshape(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        w = (q @ k.transpose(-1, -2) / (D // H) ** 0.5).softmax(-1)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        return (w @ v).transpose(1, 2).reshape(B, T, D)

    def forward(self, x, global_attention_mask=None):
        out = self._attend(self.qkv(x))  # (B, T, D)
        if global_attention_mask is not None:
            marked = global_attention_mask.bool()[..., None]  # (B, T, 1)
            own = self._attend((self.qkv if self.bug else self.qkv_global)(x))
            out = torch.where(marked, own, out)
        return self.proj(out)


class GlobalLM(nn.Module):
    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.attn, self.head = nn.Embedding(32, 16), GlobalAttention(bug=bug), nn.Linear(16, 32)

    def forward(self, input_ids, global_attention_mask=None):
        x = self.emb(input_ids)
        return self.head(x + self.attn(x, global_attention_mask))


IDS = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bug", [False, True])
def test_parameters_used_only_with_an_input_not_passed_are_not_exercised_and_unused_ones_still_fail(bug):
    report = diagnostics.audit_model(GlobalLM(bug), example=IDS)
    flow = report.result("gradient_flow")
    if bug:  # the global projections get no gradient with the mask either
        assert flow.verdict == "fail" and "attn.qkv_global.weight" in flow.evidence, flow
        assert report.status == "failed", report
        return
    # was: gradient_flow and the layer's parameters_used failed on attn.qkv_global (issue 33's LED and Longformer)
    assert flow.verdict == "warn" and "with global_attention_mask" in flow.message, flow
    assert "global_attention_mask" in flow.fix and "example=" in flow.fix, flow.fix
    assert report.status == "passed", report


class SegmentAttention(GlobalAttention):
    """Self-attention with a per-head segment bias read only when `token_type_ids` is given (XLNet's `seg_embed` and
    `r_s_bias` in every attention layer); `bug`: the segment table is looked up and then dropped."""

    def __init__(self, bug: bool = False):
        super().__init__(bug=bug)
        del self.qkv_global  # no global tokens here
        self.segment = nn.Embedding(2, 16)

    def forward(self, x, token_type_ids=None):
        if token_type_ids is not None:
            bias = self.segment(token_type_ids)  # (B, T, D)
            x = x if self.bug else x + bias  # BUG: the segment bias computed and never added
        return self.proj(self._attend(self.qkv(x)))


class SegmentLM(GlobalLM):
    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.attn = SegmentAttention(bug=bug)

    def forward(self, input_ids, token_type_ids=None):
        x = self.emb(input_ids)
        return self.head(x + self.attn(x, token_type_ids))


@pytest.mark.parametrize("bug", [False, True])
def test_parameters_used_only_with_segment_ids_not_passed_are_not_exercised_and_unused_ones_still_fail(bug):
    """XLNet's segment embeddings: read only when `token_type_ids` is given, which the audit does not pass; they failed
    gradient_flow on the correct model. Tried as all ones, like an optional mask: used, "not exercised"."""
    report = diagnostics.audit_model(SegmentLM(bug), example=IDS)
    flow = report.result("gradient_flow")
    if bug:
        assert flow.verdict == "fail" and "attn.segment.weight" in flow.evidence, flow
        return
    assert flow.verdict == "warn" and "with token_type_ids" in flow.message, flow
