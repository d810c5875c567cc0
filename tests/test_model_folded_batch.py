"""A layer whose batch is the model's batch folded with something else, at one token per row (issue 33: MobileViT,
transformers 5.25, whose transformer blocks take each patch's pixels as rows of the batch, (B x pixels, patches, D);
in its last stage a feature map of 2 x 2 is one patch: (4B, 1, D)).

Captured at the model's batch 1 as (4, 1, D), the in-place wrapper read it as one sequence of 4 tokens, time first:
its probes then put other sequences along the layer's real sequence axis, and `batch_independence` failed the correct
model ("a sequence's output depends on another sequence of the batch"). The model's call at batch 2 says which
dimension is the batch (the one that doubles): (8, 1, D). Twin: the same model whose attention runs over every row of
the batch at once (a layer that mixes the batch) still fails there.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import diagnostics

D, HEADS, PATCH = 16, 2, 2


class PatchAttention(nn.Module):
    """Self-attention over (rows, tokens, D); `across_rows`: over every row of the batch as one sequence, the bug."""

    def __init__(self, across_rows: bool = False):
        super().__init__()
        self.num_heads, self.across_rows = HEADS, across_rows
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, hidden_states):
        x = hidden_states.reshape(1, -1, D) if self.across_rows else hidden_states  # (R, N, D), or (1, R x N, D)
        R, N, _ = x.shape  # rows, tokens per row, width
        q, k, v = (t.view(R, N, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # (R, H, N, d)
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // HEADS), dim=-1)  # (R, H, N, N)
        out = (w @ v).transpose(1, 2).reshape(R, N, D)
        return self.proj(out).reshape(hidden_states.shape)


class Stage(nn.Module):
    def __init__(self, across_rows: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module() for _ in range(2)])
        for i, block in enumerate(self.blocks):
            block.attn = PatchAttention(across_rows and i == 1)

    def forward(self, f):
        B, C, Hh, Ww = f.shape  # (B, D, H, W)
        # (B, D, nH, P, nW, P) -> (B, P, P, nH, nW, D) -> (B x P x P, patches, D): the pixels of a patch into the batch
        x = f.view(B, C, Hh // PATCH, PATCH, Ww // PATCH, PATCH).permute(0, 3, 5, 2, 4, 1)
        x = x.reshape(B * PATCH * PATCH, -1, C)
        for block in self.blocks:
            x = x + block.attn(x)
        x = x.view(B, PATCH, PATCH, Hh // PATCH, Ww // PATCH, C).permute(0, 5, 3, 1, 4, 2)
        return x.reshape(B, C, Hh, Ww)


class FoldedPatches(nn.Module):
    """A MobileViT-like model: a convolution to a 4 x 4 map, a stage of two attention blocks over its 4 patches of
    2 x 2 pixels (each pixel of a patch a row of the batch: (B x 4, 4 patches, D)), a strided convolution to a 2 x 2
    map and a second stage over its one patch, (B x 4, 1, D), then pooled to logits. `across_rows`: the second
    stage's second block attends over every row of its batch."""

    def __init__(self, across_rows: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(3, D, kernel_size=2, stride=2)  # (B, 3, 8, 8) -> (B, D, 4, 4)
        self.down = nn.Conv2d(D, D, kernel_size=2, stride=2)  # (B, D, 4, 4) -> (B, D, 2, 2)
        self.stages = nn.ModuleList([Stage(), Stage(across_rows)])
        self.head = nn.Linear(D, 5)

    def forward(self, pixels):
        f = self.stages[1](self.down(self.stages[0](self.stem(pixels))))  # (B, D, 2, 2)
        return self.head(f.flatten(2).mean(-1))  # (B, 5)


def _audit(across_rows: bool):
    torch.manual_seed(0)
    model = FoldedPatches(across_rows).eval()
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return diagnostics.audit_model(model, pixels)


def test_rows_of_one_token_folded_into_the_batch_are_read_as_the_batch():
    report = _audit(across_rows=False)
    assert report.status == "passed", str(report)  # failed before: batch_independence at both blocks
    layer = report.layers["stages.1.blocks.1.attn"]
    assert layer.result("batch_independence").verdict == "pass", str(layer)


def test_a_layer_that_mixes_the_rows_of_its_batch_still_fails_there():
    report = _audit(across_rows=True)
    assert report.status == "failed", str(report)
    found = {(f.layer, f.detector) for f in report.findings}
    assert ("stages.1.blocks.1.attn", "batch_independence") in found, str(report)
