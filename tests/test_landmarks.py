"""Queries and keys read through landmarks, as Nyström attention does (nystrom-attention's `NystromAttention`): the
scaled queries summed over each segment of tokens and divided by its length, a mean. A sum keeps the factor its
input carries, and a division by how many values it adds keeps it too (`_observe`'s `_REDUCE`, `_counts`): before,
the sum's output was read as of factor 1, and the correct layer FAILED `softmax_saturation` ("2.83x too sharp" at
d_k = 8). Its twin with q·k unscaled fails on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import correct
import diagnostics


class LandmarkAttention(nn.Module):
    """The queries attend the keys' landmarks, and the queries' landmarks attend the keys; the two weights compose
    (out = softmax(q k_l^T) softmax(q_l k^T) v): each landmark the mean of `segment` tokens. `scaled=False`: the bug,
    q·k not divided by sqrt(d_k)."""

    def __init__(self, dim=32, heads=4, segment=4, scaled=True):
        super().__init__()
        self.heads, self.segment, self.scaled = heads, segment, scaled
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        h, d, n = self.heads, D // self.heads, self.segment
        q, k, v = (f(x).view(B, T, h, d).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        if self.scaled:
            q = q * d ** -0.5
        q_landmarks = q.reshape(B, h, T // n, n, d).sum(-2) / n  # each segment's mean
        k_landmarks = k.reshape(B, h, T // n, n, d).sum(-2) / n
        to_landmarks = (q @ k_landmarks.transpose(-1, -2)).softmax(-1)  # (B, h, T, T / n)
        from_landmarks = (q_landmarks @ k.transpose(-1, -2)).softmax(-1)  # (B, h, T / n, T)
        out = to_landmarks @ (from_landmarks @ v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="float32"),
                                   pytest.param(torch.bfloat16, id="bfloat16-std0.02")])
@pytest.mark.parametrize("segment", [1, 4])
@pytest.mark.parametrize("scaled", [True, False], ids=["correct", "unscaled"])
def test_the_temperature_is_read_through_landmarks_made_by_a_sum(scaled, segment, dtype):
    torch.manual_seed(0)
    layer = LandmarkAttention(segment=segment, scaled=scaled)
    if dtype != torch.float32:  # training's scale: GPT-2's initialisation, in the low precision
        correct.gpt2_init_(layer)
    result = diagnostics.audit(layer.to(dtype), progress=False, dtype=dtype,
                               detectors=["softmax_saturation"]).result("softmax_saturation")
    assert result.verdict == ("pass" if scaled else "fail"), result
