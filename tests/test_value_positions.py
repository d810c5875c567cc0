"""Positions that reach the values, not the scores (RoPER: rotary value embeddings). labml-nn 0.4.136 rotates the
values by their positions twice and back once, so the output keeps their absolute positions (its issue 251; the
pypi_bugs case `labml_rope_values_rotated_twice`): `relative_positions` fails it, but no op over (query, key) pairs
moves with the shift, and the finding pointed nowhere. It now points at the values' positions: the first op after
the attention weights whose real tokens' entries move, and, where the values the weighted sum reads were made by a
later op that moves too and is fed by that one, that later op first: the second rotation, the line labml's fix removed
(the first rotation, which a correct RoPER keeps too, is 4 lines above it, outside pypi_bugs' 2). The correct RoPER
(rotated once, back once) passes on the same inputs. Written here in a few lines, batch first, no labml needed.
"""

from __future__ import annotations

import linecache

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS = 16, 2


def rotate(x: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Rotate (B, H, T, d) by each position's angles (half-split pairs), by -angles for sign -1."""
    T, d = x.shape[-2], x.shape[-1]
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = sign * torch.arange(T, dtype=torch.float32)[:, None] * freqs[None, :]  # (T, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class RoPER(nn.Module):
    """Attention whose values carry relative positions: v rotated by its position, the weighted sum rotated back by
    the query's. `twice`: the values rotated a second time inside the weighted sum (the bug)."""

    def __init__(self, twice: bool = False):
        super().__init__()
        self.twice = twice
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mask=None):
        B, T, _ = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) * (D // HEADS) ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        v = rotate(v)
        out = weights @ (rotate(v) if self.twice else v)
        out = rotate(out, -1.0)  # back by each query's position: what is left is j - i
        return self.out(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_values_rotated_twice_fail_and_are_located_at_the_values(twice):
    torch.manual_seed(0)
    found = diagnostics.audit(RoPER(twice), detectors=["relative_positions"], progress=False).result(
        "relative_positions")
    assert found.verdict == ("fail" if twice else "pass"), found
    if twice:
        assert found.where and "absolute positions reach the values" in found.where[0].note, found.where
        assert found.where[0].function == "rotate", found.where  # the values' rotation, called from forward
        file, line, _ = found.where[0].callers[0]
        assert "rotate(v) if self.twice" in linecache.getline(file, line), found.where  # the second one
        assert "applied to the values twice" in found.where[0].note, found.where
