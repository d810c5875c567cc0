"""Decomposed relative positions: scores plus a term of each key's row and one of its column (issue 33, timm's MViTv2).

MViTv2 (and SAM's and ViTDet's image encoders written out) add q·R_h[i_h - j_h] and q·R_w[i_w - j_w] to q·k before
the softmax, each a product with the query. The temperature's fit of the softmax's input against q·k allows a bias
the same in both batch halves, which those terms are not, so `softmax_saturation` measured nothing and every MViTv2
model (8) was inconclusive. Centred over each row and each column of the key grid (whose side is the last axis of
those products), per query, both terms vanish exactly and the fit holds (`_observe._fit_decomposed`). Twins on the
same inputs: q·k left unscaled fails, a softmax over the queries fails; the correct layer passes, in float32 and in
bfloat16 at GPT-2's initialisation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, GRID = 16, 2, 4


class RelativePositionAttention(nn.Module):
    """Self-attention over a GRID x GRID map of tokens with MViTv2's decomposed relative positions; `cls`: a class
    token ahead of the grid, whose row and column get no position term (MViTv2's `_cls` models)."""

    def __init__(self, bug: str | None = None, cls: bool = False):
        super().__init__()
        self.bug, self.num_heads, self.cls = bug, HEADS, int(cls)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        d = D // HEADS
        self.rel_h, self.rel_w = nn.Parameter(torch.randn(2 * GRID - 1, d)), nn.Parameter(torch.randn(2 * GRID - 1, d))

    def forward(self, x):
        B, T, C = x.shape  # batch, GRID * GRID tokens (after a class token, if any), width
        d = C // HEADS
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = (q * (1.0 if self.bug == "unscaled" else d ** -0.5)) @ k.transpose(-2, -1)  # (B, H, T, T)
        apart = torch.arange(GRID)[:, None] - torch.arange(GRID)[None, :] + GRID - 1  # i - j, from 0
        c = self.cls
        grid_q = q[:, :, c:].reshape(B, HEADS, GRID, GRID, d)
        rows = torch.einsum("bhyxc,ykc->bhyxk", grid_q, self.rel_h[apart])  # q·R_h[i_h - j_h]: (B, H, y, x, key row)
        cols = torch.einsum("bhyxc,xkc->bhyxk", grid_q, self.rel_w[apart])  # q·R_w[i_w - j_w]
        terms = (rows[..., :, None] + cols[..., None, :]).reshape(B, HEADS, T - c, T - c)
        scores = torch.cat([scores[:, :, :c], torch.cat([scores[:, :, c:, :c], scores[:, :, c:, c:] + terms], -1)], 2)
        out = scores.softmax(-2 if self.bug == "queries axis" else -1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, T, C))


class GridModel(nn.Module):
    def __init__(self, bug: str | None = None, cls: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.patch, self.attn, self.head = nn.Conv2d(3, D, 2, 2), RelativePositionAttention(bug, cls), nn.Linear(D, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, D)) if cls else None

    def forward(self, pixels):
        tokens = self.patch(pixels).flatten(2).transpose(1, 2)  # (B, GRID * GRID, D)
        if self.cls is not None:
            tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], 1)
        return self.head((tokens + self.attn(tokens)).mean(1))


@pytest.mark.parametrize("cls", [False, True], ids=["grid", "class token and grid"])
@pytest.mark.parametrize("bug, status, fired", [(None, "passed", None), ("unscaled", "failed", "softmax_saturation"),
                                                ("queries axis", "failed", "weight_row_sums")])
def test_a_temperature_beside_decomposed_relative_positions_is_measured(bug, status, fired, cls):
    report = diagnostics.audit_model(GridModel(bug, cls).eval(), example=torch.randn(2, 3, 2 * GRID, 2 * GRID))
    layer = report.layers["attn"]
    temperature = layer.result("softmax_saturation")
    assert temperature.measured and "decomposed relative positions" in temperature.message + temperature.evidence, \
        temperature
    assert report.status == status and layer.status == status, report
    if fired:
        assert fired in layer.fired(), layer


@pytest.mark.parametrize("bug, status", [(None, "passed"), ("unscaled", "failed")])
def test_decomposed_relative_positions_in_bfloat16_at_gpt2_initialisation(bug, status, std_002):
    """Projections drawn with std 0.02 (the position tables too: a trained model's are small), in bfloat16."""
    model = GridModel(bug)
    std_002(model)
    nn.init.normal_(model.attn.rel_h, std=0.02), nn.init.normal_(model.attn.rel_w, std=0.02)
    report = diagnostics.audit_model(model.to(torch.bfloat16).eval(),
                                     example=torch.randn(2, 3, 2 * GRID, 2 * GRID, dtype=torch.bfloat16))
    assert report.layers["attn"].result("softmax_saturation").measured, report
    assert report.status == status, report
