"""Attention within mask units whose queries are pooled from each unit's tokens (issue 33, timm's Hiera and HieraDet).

Hiera's stage-changing blocks attend within each mask unit of m tokens with n = m / stride queries max-pooled from
them, and return the n queries' rows: weights (B, H, units, n, m), a layer with units x n queries of its own over
units x m keys. Square blocks (NesT's) were read as the block-diagonal (Tq, Tk) weights they are; these were not
("the attention itself was not measured": 8 Hiera and 5 HieraDet / SAM 2 timm models inconclusive). Now blocks
whose queries are fewer than their keys are laid out whole too (`_probe.block_diagonal`), where they tile the
layer's own queries and its keys. Twins on the same inputs: q·k left unscaled fails (softmax_saturation), a softmax
over the queries fails (weight_row_sums); the correct layer passes, in float32 and in bfloat16 at GPT-2's
initialisation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, UNITS, STRIDE = 16, 2, 4, 4


class MaskUnitAttention(nn.Module):
    """Attention within UNITS units of the tokens, each unit's queries max-pooled by STRIDE (Hiera's `q_stride`)."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug, self.num_heads = bug, HEADS
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.shape  # batch, tokens (UNITS units of T / UNITS), width
        d = C // HEADS
        q, k, v = self.qkv(x).reshape(B, UNITS, T // UNITS, 3, HEADS, d).permute(3, 0, 4, 1, 2, 5)  # (B, H, U, m, d)
        q = q.view(B, HEADS, UNITS, STRIDE, -1, d).amax(dim=3)  # (B, H, U, n, d): n = m / STRIDE pooled queries
        scores = q @ k.transpose(-2, -1) * (1.0 if self.bug == "unscaled" else d ** -0.5)  # (B, H, U, n, m)
        out = scores.softmax(-2 if self.bug == "queries axis" else -1) @ v  # (B, H, U, n, d)
        return self.proj(out.permute(0, 2, 3, 1, 4).reshape(B, -1, C))  # (B, T / STRIDE, C)


class UnitModel(nn.Module):
    """(B, 3, 16, 16) pixels -> 2 x 2 patches, 64 tokens -> mask-unit attention, 16 tokens out -> logits."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.patch, self.attn, self.head = nn.Conv2d(3, D, 2, 2), MaskUnitAttention(bug), nn.Linear(D, 4)

    def forward(self, pixels):
        return self.head(self.attn(self.patch(pixels).flatten(2).transpose(1, 2)).mean(1))


@pytest.mark.parametrize("bug, status, fired", [(None, "passed", None), ("unscaled", "failed", "softmax_saturation"),
                                                ("queries axis", "failed", "weight_row_sums")])
def test_attention_within_units_with_pooled_queries_is_read_as_block_diagonal_weights(bug, status, fired):
    report = diagnostics.audit_model(UnitModel(bug).eval(), example=torch.randn(2, 3, 16, 16))
    layer = report.layers["attn"]
    rows = layer.result("weight_row_sums")
    assert rows.measured and "over 4 blocks of 4 queries over 16 keys" in rows.message, rows
    assert report.status == status and layer.status == status, report
    if fired:
        assert fired in layer.fired(), layer


@pytest.mark.parametrize("bug, status", [(None, "passed"), ("unscaled", "failed"), ("queries axis", "failed")])
def test_mask_unit_attention_in_bfloat16_at_gpt2_initialisation(bug, status, std_002):
    model = std_002(UnitModel(bug)).to(torch.bfloat16).eval()
    report = diagnostics.audit_model(model, example=torch.randn(2, 3, 16, 16, dtype=torch.bfloat16))
    assert report.layers["attn"].result("weight_row_sums").measured, report
    assert report.status == status, report
