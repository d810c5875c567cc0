"""Attention over keys the layer makes of its own from the tokens, fewer than the tokens (issue 33, timm's PVT v2).

A spatial-reduction attention (PVT's, Twins', SegFormer's) takes its keys and values from a pooling or a strided
convolution of the tokens: its weights are (B, H, Tq, m), m < Tk, and were read nowhere, so every PVT v2 model was
inconclusive ("the attention itself was not measured"). `weight_row_sums` now reads rows over those m keys (the last
softmax whose weights a later product sums with m values, or a fused call with m keys), where no mask is given.
Twins on the same inputs: the scores left unscaled fail (softmax_saturation), and the softmax over the queries fails
weight_row_sums (before, that bug was inconclusive: SegFormer's, injected by the sweep); a softmax over experts (a
router's, no product with values after it) is not read as attention weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, KEYS = 16, 2, 4


class PooledKeyAttention(nn.Module):
    """Self-attention whose keys and values come from the tokens pooled to KEYS positions (PVT v2's linear mode)."""

    def __init__(self, bug: str | None = None, fused: bool = False):
        super().__init__()
        self.bug, self.fused, self.num_heads = bug, fused, HEADS
        self.q, self.kv, self.proj = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)
        self.pool = nn.AdaptiveAvgPool1d(KEYS)

    def forward(self, x):
        B, T, C = x.shape  # batch, tokens, width
        d = C // HEADS
        q = self.q(x).view(B, T, HEADS, d).transpose(1, 2)  # (B, H, T, d)
        reduced = self.pool(x.transpose(1, 2)).transpose(1, 2)  # (B, KEYS, C): keys of the layer's own making
        k, v = self.kv(reduced).view(B, KEYS, 2, HEADS, d).permute(2, 0, 3, 1, 4)  # (B, H, KEYS, d) each
        if self.fused:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug else None)
        else:
            scores = q @ k.transpose(-2, -1) * (1.0 if self.bug == "unscaled" else d ** -0.5)  # (B, H, T, KEYS)
            out = scores.softmax(-2 if self.bug == "queries axis" else -1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, T, C))


# (a fused call's softmax is always over the keys: the queries-axis bug is written out only)
@pytest.mark.parametrize("bug, status, fired, fused", [
    (None, "passed", None, False), ("unscaled", "failed", "softmax_saturation", False),
    ("queries axis", "failed", "weight_row_sums", False),
    (None, "passed", None, True), ("unscaled", "failed", "softmax_saturation", True)])
def test_attention_over_pooled_keys_is_measured_over_them(bug, status, fired, fused):
    torch.manual_seed(0)
    report = diagnostics.audit(PooledKeyAttention(bug, fused), seq_len=16)
    rows = report.result("weight_row_sums")
    assert rows.measured and f"over the {KEYS} keys the layer makes of its own" in rows.message, rows
    assert report.status == status, report
    if fired:
        assert fired in report.fired(), report


class Router(nn.Module):
    """Not attention: each token's distribution over experts, softmax(x W) over (B, T, E), E < T, no values after."""

    def __init__(self):
        super().__init__()
        self.gate, self.experts = nn.Linear(D, KEYS), nn.Linear(D, D * KEYS)

    def forward(self, x):
        B, T, C = x.shape
        share = self.gate(x).softmax(-1)  # (B, T, E)
        return (self.experts(x).view(B, T, KEYS, C) * share[..., None]).sum(2)


def test_a_routers_softmax_over_experts_is_not_read_as_attention_over_pooled_keys():
    torch.manual_seed(0)
    report = diagnostics.audit(Router(), seq_len=16)
    rows = report.result("weight_row_sums")
    assert "keys the layer makes of its own" not in rows.message, rows
    assert report.status != "passed", report


class MaskedPooledKeyAttention(PooledKeyAttention):
    """The same layer taking a mask over the tokens, which its pooled keys cannot carry (it ignores it)."""

    def forward(self, x, mask=None):
        return super().forward(x)


def test_pooled_keys_are_read_only_where_no_mask_is_given():
    """A padding mask blocks tokens, not the keys the layer pools from them: its rows over m keys say nothing of what
    the mask blocked, so weight_row_sums' padded call reads no pooled keys (it is not measured there; mask_honoured
    judges the ignored mask)."""
    torch.manual_seed(0)
    report = diagnostics.audit(MaskedPooledKeyAttention(), seq_len=16)
    rows = report.result("weight_row_sums")
    assert "keys the layer makes of its own" not in rows.message and not rows.measured, rows


@pytest.mark.parametrize("fused", [False, True], ids=["softmax", "fused"])
@pytest.mark.parametrize("bug, status", [(None, "passed"), ("unscaled", "failed")])
def test_pooled_keys_are_read_in_bfloat16_at_gpt2_initialisation(bug, status, fused, std_002):
    """At the scales people train at: projections drawn with std 0.02, the layer in bfloat16, 64 tokens."""
    torch.manual_seed(0)
    report = diagnostics.audit(std_002(PooledKeyAttention(bug, fused)).to(torch.bfloat16), seq_len=64)
    assert f"over the {KEYS} keys the layer makes of its own" in report.result("weight_row_sums").message, report
    assert report.status == status, report
    if bug:
        assert "softmax_saturation" in report.fired(), report


def test_a_softmax_over_the_queries_of_pooled_keys_is_pointed_at_its_line():
    """The finding's site: the softmax over the queries of the (Tq, m) scores, with the fix to normalise over the
    keys (before, no site: the localiser looked for (Tq, Tk) weights only). Twin: the correct layer has no finding."""
    torch.manual_seed(0)
    rows = diagnostics.audit(PooledKeyAttention("queries axis"), seq_len=16).result("weight_row_sums")
    sites = list(rows.where)
    assert sites and "softmax(-2" in sites[0].code and "softmax(dim=-1)" in sites[0].fix, sites
    torch.manual_seed(0)
    assert diagnostics.audit(PooledKeyAttention(), seq_len=16).result("weight_row_sums").verdict == "pass"
