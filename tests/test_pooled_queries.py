"""Attention among tokens the layer pools of its own, queries and keys both, then spread back (issue 33, timm's
CPUBone and LowFormer).

CPUBone's `ConvAttention` pools the feature map with a strided depthwise convolution, attends among the n pooled
pixels (queries, keys and values all made from them) and upsamples the result back to the map with a transposed
convolution. Its weights are (B, H, n, n), n < T: neither the tokens' (T, T) nor pooled keys' (T, m), so the 12 such
timm models with a strided stage were inconclusive ("the attention itself was not measured"). `weight_row_sums` now
reads rows over the m pooled keys for n <= Tq queries of the layer's own making too (`_observe.pooled_keys`: a softmax
over (n, m) scores whose weights a later product sums with m values, or a fused call), where no mask is given. Twins on
the same inputs: the scores left unscaled fail (softmax_saturation), the softmax over the queries fails
weight_row_sums and is pointed at; the correct layer passes, in float32 and in bfloat16 at GPT-2's initialisation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, STRIDE = 16, 2, 4


class PooledAttention(nn.Module):
    """Self-attention among the tokens average-pooled by STRIDE, each pooled token's output spread back over the
    STRIDE tokens it was pooled from (CPUBone's attention, on a sequence; a last window shorter than STRIDE pooled as
    it is, and the spread cropped to the tokens, as CPUBone pads and crops its map)."""

    def __init__(self, bug: str | None = None, fused: bool = False):
        super().__init__()
        self.bug, self.fused, self.num_heads = bug, fused, HEADS
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.pool = nn.AvgPool1d(STRIDE, STRIDE, ceil_mode=True)

    def forward(self, x):
        B, T, C = x.shape  # batch, tokens, width
        d, n = C // HEADS, -(-T // STRIDE)  # n pooled tokens: the layer's own queries and keys
        pooled = self.pool(x.transpose(1, 2)).transpose(1, 2)  # (B, n, C)
        q, k, v = self.qkv(pooled).view(B, n, 3, HEADS, d).permute(2, 0, 3, 1, 4)  # (B, H, n, d) each
        if self.fused:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug else None)
        else:
            scores = q @ k.transpose(-2, -1) * (1.0 if self.bug == "unscaled" else d ** -0.5)  # (B, H, n, n)
            out = scores.softmax(-2 if self.bug == "queries axis" else -1) @ v
        out = out.transpose(1, 2).reshape(B, n, C).repeat_interleave(STRIDE, dim=1)[:, :T]  # back to the T tokens
        return self.proj(out)


# (a fused call's softmax is always over the keys: the queries-axis bug is written out only)
@pytest.mark.parametrize("bug, status, fired, fused", [
    (None, "passed", None, False), ("unscaled", "failed", "softmax_saturation", False),
    ("queries axis", "failed", "weight_row_sums", False),
    (None, "passed", None, True), ("unscaled", "failed", "softmax_saturation", True)])
def test_attention_among_pooled_tokens_is_measured_over_them(bug, status, fired, fused):
    torch.manual_seed(0)
    report = diagnostics.audit(PooledAttention(bug, fused), seq_len=16)
    rows = report.result("weight_row_sums")
    assert rows.measured and "for 4 queries of its own making" in rows.message, rows
    assert report.status == status, report
    if fired:
        assert fired in report.fired(), report


@pytest.mark.parametrize("bug, status, fired", [
    (None, "passed", None), ("unscaled", "failed", "softmax_saturation"),
    ("queries axis", "failed", "weight_row_sums")])
def test_attention_among_pooled_tokens_is_read_in_bfloat16_at_gpt2_initialisation(bug, status, fired, std_002):
    """At the scales people train at: projections drawn with std 0.02, the layer in bfloat16, 64 tokens (16 pooled).
    The softmax over the queries is then nearly uniform both ways: it fails on its scores recomputed in float64."""
    torch.manual_seed(0)
    report = diagnostics.audit(std_002(PooledAttention(bug)).to(torch.bfloat16), seq_len=64)
    assert "for 16 queries of its own making" in report.result("weight_row_sums").message, report
    assert report.status == status, report
    if fired:
        assert fired in report.fired(), report


def test_a_softmax_over_the_pooled_queries_is_pointed_at_its_line():
    """The finding's site: the softmax over the queries of the (n, n) scores, with the fix to normalise over the keys.
    Twin: the correct layer has no finding."""
    torch.manual_seed(0)
    rows = diagnostics.audit(PooledAttention("queries axis"), seq_len=16).result("weight_row_sums")
    sites = list(rows.where)
    assert sites and "softmax(-2" in sites[0].code and "softmax(dim=-1)" in sites[0].fix, sites
    torch.manual_seed(0)
    assert diagnostics.audit(PooledAttention(), seq_len=16).result("weight_row_sums").verdict == "pass"


class ConvPooledAttention(nn.Module):
    """CPUBone's ConvAttention, reduced: a (B, C, H, W) map pooled by a strided depthwise convolution, attention among
    the pooled pixels (queries, keys and values all from them, (B, H, n, n) weights), spread back by a transposed
    convolution and cropped to the map. `bug`: "unscaled" leaves q·k unscaled; "queries axis" takes the softmax over the
    queries."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.num_heads = bug, HEADS
        self.pool = nn.Conv2d(D, D, 2, stride=2, groups=D)
        self.qkv, self.proj = nn.Conv2d(D, 3 * D, 1), nn.Conv2d(D, D, 1)
        self.up = nn.ConvTranspose2d(D, D, 2, stride=2, groups=D)

    def forward(self, x):
        B, C, H, W = x.shape  # batch, channels, height, width
        pooled = self.qkv(self.pool(x))  # (B, 3C, h, w): h x w = n pixels
        h, w = pooled.shape[-2:]
        q, k, v = pooled.reshape(B, 3, HEADS, C // HEADS, h * w).transpose(-2, -1).unbind(1)  # (B, H, n, d) each
        scores = q @ k.transpose(-2, -1) * (1.0 if self.bug == "unscaled" else (C // HEADS) ** -0.5)  # (B, H, n, n)
        out = scores.softmax(-2 if self.bug == "queries axis" else -1) @ v  # (B, H, n, d)
        out = self.proj(out.transpose(-2, -1).reshape(B, C, h, w))
        return self.up(out)[..., :H, :W]


class ConvPooledModel(nn.Module):
    def __init__(self, bug: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.patch, self.attn, self.head = nn.Conv2d(3, D, 2, 2), ConvPooledAttention(bug), nn.Linear(D, 4)

    def forward(self, pixels):
        x = self.patch(pixels)  # (B, D, H, W)
        return self.head((x + self.attn(x)).mean((2, 3)))


@pytest.mark.parametrize("bug, status, fired", [(None, "passed", None), ("unscaled", "failed", "softmax_saturation"),
                                                ("queries axis", "failed", "weight_row_sums")])
def test_a_feature_map_layer_attending_among_its_pooled_pixels_is_measured_in_place(bug, status, fired):
    """The model audit, as on timm's cpubone_nano: the layer held in place on its 6 x 6 map, attending among 9 pooled
    pixels. Before, its stage was inconclusive ('the attention itself was not measured')."""
    report = diagnostics.audit_model(ConvPooledModel(bug).eval(), example=torch.randn(2, 3, 12, 12))
    layer = report.layers["attn"]
    rows = layer.result("weight_row_sums")
    assert rows.measured and "for 9 queries of its own making" in rows.message, rows
    assert report.status == status and layer.status == status, report
    if fired:
        assert fired in layer.fired(), layer
