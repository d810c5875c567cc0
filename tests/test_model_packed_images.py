"""Images of a batch packed into one sequence stay one sequence in place (issue 33: Pixtral, transformers 5.25).

PixtralVisionModel puts every image's patches into one sequence, (1, n_1 + n_2 + ..., D), kept apart by a
block-diagonal mask. Captured at the model's batch 1 as (1, n, D) and at batch 2 as (1, 2n, D), its time dimension is
the one that doubles. The rule for a batch folded with pixels (tests/test_model_folded_batch.py: MobileViT's (n, 1, D)
whose n doubles is n rows of one token) read Pixtral's doubled time as its batch: every probe then put tokens along
the batch, the layer raised on its mask, and `runs` failed the correct model (whole sweep at 7ee48c8: passed ->
failed). Only a capture of (n, 1, D) is read so now. Twin: the same model whose attention ignores the block-diagonal
mask, so that one image attends another's patches, still fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, PATCH = 16, 2, 4  # width, heads, patch size in pixels


class PackedAttention(nn.Module):
    """Self-attention over (1, T, D) with an additive (1, 1, T, T) mask; `ignores_mask`: the bug."""

    def __init__(self, ignores_mask: bool):
        super().__init__()
        self.qkv, self.proj, self.ignores_mask = nn.Linear(D, 3 * D), nn.Linear(D, D), ignores_mask

    def forward(self, hidden_states, attention_mask):
        B, T, _ = hidden_states.shape  # 1, tokens of every image, width
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in self.qkv(hidden_states).chunk(3, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)  # (B, H, T, T)
        w = torch.softmax(scores if self.ignores_mask else scores + attention_mask, dim=-1)
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class PackedImages(nn.Module):
    """A Pixtral-like encoder: 4 x 4 patches of each image, all images' patches in one sequence, a block-diagonal
    mask that keeps each image to its own, two attention blocks, and the sequence split back per image."""

    def __init__(self, ignores_mask: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, D, kernel_size=PATCH, stride=PATCH)
        self.layers = nn.ModuleList([nn.Module() for _ in range(2)])
        for i, layer in enumerate(self.layers):
            layer.attention = PackedAttention(ignores_mask and i == 1)

    def forward(self, pixel_values):
        B = pixel_values.shape[0]
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)  # (B, n, D)
        n = x.shape[1]
        image = torch.arange(B).repeat_interleave(n)  # (B x n,): which image each packed token is of
        mask = torch.zeros(B * n, B * n).masked_fill(image[:, None] != image[None, :], float("-inf"))
        h = x.reshape(1, B * n, D)  # every image's patches in one sequence
        for layer in self.layers:
            h = h + layer.attention(h, attention_mask=mask[None, None])
        return h.view(B, n, D)  # (B, n, D)


@pytest.mark.parametrize("ignores_mask", [False, True], ids=["correct", "mask_ignored"])
def test_images_packed_into_one_sequence_are_audited_along_that_sequence(ignores_mask):
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    report = diagnostics.audit_model(PackedImages(ignores_mask).eval(), pixels)
    if not ignores_mask:
        assert report.status == "passed", str(report)  # failed before: runs raised on the mask at both layers
        assert report.layers["layers.1.attention"].result("runs").verdict == "pass"
        return
    assert report.status == "failed", str(report)
    assert {f.detector for f in report.findings} == {"batch_invariance"}, str(report)  # one image reads another
