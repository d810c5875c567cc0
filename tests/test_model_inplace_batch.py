"""A layer whose calls fold another axis into the batch, with arguments of one row per row it is called with (issue 33:
LightGlue, transformers 5.25, runs its attention over both images of a pair stacked, (B x 2, N, D), with rotary
tables (cos, sin) of one row per image, (B x 2, N, d)).

Captured at the model's batch 1, the layer's batch is 2 and so is its tables'; at the model's batch 2 both are 4. Read
as the batch folded with another axis (BLOOM's ALiBi, (B x H, 1, T), at one row of hidden states), the tables were
repeated to each probe's batch, (2 x 2, N, d) for a probe of 2 rows, and every probe raised: a false `runs` FAIL on
the correct model. A table of as many rows as the hidden states has one per row: a probe's row b is given row b's
(`_per_row`). Twin: the same model with the scale left out of its attention still fails.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import diagnostics

D, HEADS, PATCH = 16, 2, 2
d = D // HEADS  # head width


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), dim=-1)


class PairAttention(nn.Module):
    """Self-attention over (rows, N, D) with rotary tables of one row per row; `scaled=False`: no 1/sqrt(d), the bug."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.num_heads, self.scaled = HEADS, scaled
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, position_embeddings):
        R, N, _ = hidden_states.shape  # rows (images), tokens, width
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)  # (R, 1, N, d): one table per row
        q, k, v = (p(hidden_states).view(R, N, HEADS, d).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (R, H, N, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-2, -1)  # (R,H,N,d) x (R,H,d,N) -> (R,H,N,N)
        if self.scaled:
            scores = scores / math.sqrt(d)
        out = torch.softmax(scores, dim=-1) @ v  # (R, H, N, d)
        return self.o_proj(out.transpose(1, 2).reshape(R, N, D))


class PairMatcher(nn.Module):
    """A LightGlue-like model: a pair of images (B, 2, 3, 8, 8), each cut into 16 patches of 2 x 2 pixels, the two
    images stacked along the batch, (B x 2, 16, D), with rotary angles from each image's own patches (one table per
    image, as LightGlue's from its keypoints); two attention blocks, then the pair's tokens pooled to logits."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.embed = nn.Linear(3 * PATCH * PATCH, D)
        self.angles = nn.Linear(3 * PATCH * PATCH, d // 2)
        self.blocks = nn.ModuleList([nn.Module() for _ in range(2)])
        for block in self.blocks:
            block.attn = PairAttention(scaled)
        self.head = nn.Linear(D, 5)

    def forward(self, pixel_values):
        B = pixel_values.shape[0]  # pairs
        # (B, 2, 3, 8, 8) -> (B x 2, 16, 12): both images of a pair along the batch, a patch's pixels one token
        p = pixel_values.flatten(0, 1).unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # (2B, 3, 4, 4, 2, 2)
        p = p.permute(0, 2, 3, 1, 4, 5).reshape(2 * B, 16, 3 * PATCH * PATCH)
        a = self.angles(p).repeat(1, 1, 2)  # (2B, 16, d): each image's own rotary angles
        cos, sin = a.cos(), a.sin()
        x = self.embed(p)
        for block in self.blocks:
            x = x + block.attn(x, position_embeddings=(cos, sin))
        return self.head(x.view(B, 2 * 16, D).mean(1))  # (B, 5)


def _audit(scaled: bool):
    torch.manual_seed(0)
    model = PairMatcher(scaled).eval()
    pixels = torch.randn(2, 2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return diagnostics.audit_model(model, pixels)


def test_tables_of_one_row_per_row_of_the_layer_are_given_per_row_not_repeated_to_the_batch():
    report = _audit(scaled=True)
    layer = report.layers["blocks.1.attn"]
    assert layer.result("runs").verdict == "pass", str(layer)  # failed before: every probe raised (4 rows vs 2)
    assert report.status == "passed", str(report)


def test_the_same_model_without_its_scale_still_fails_at_the_layer():
    report = _audit(scaled=False)
    assert report.status == "failed", str(report)
    found = {(f.layer, f.detector) for f in report.findings}
    assert ("blocks.1.attn", "softmax_saturation") in found, str(report)  # the unscaled scores, measured per row
    assert ("blocks.1.attn", "runs") not in found, str(report)
