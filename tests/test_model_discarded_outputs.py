"""A parameter that moves only outputs the model discards gets no gradient by design (issue 33: MViTv2's `*_cls`
models, whose last block adds relative positions to the patch tokens' queries only, and whose head reads the class
token alone): gradient_flow does not judge it, and says so; a parameter cut from the graph (.detach()) that moves
the outputs the model reads still fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng


class PatchBiasAttention(nn.Module):
    """Self-attention over a class token and T - 1 patch tokens, a learned bias per key added to the patch tokens'
    scores only (MViTv2's relative positions skip the class token); `detach`: the bias added to every query row,
    detached (a real bug: it moves the class token's output, yet never learns)."""

    def __init__(self, d_model: int = 16, num_heads: int = 2, tokens: int = 9, detach: bool = False):
        super().__init__()
        self.num_heads, self.detach = num_heads, detach
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.bias = nn.Parameter(torch.randn(tokens) * 0.5)

    def forward(self, x):
        B, T, D = x.shape  # batch, tokens (class token + patches), width
        H = self.num_heads
        q, k, v = self.qkv(x).reshape(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        if self.detach:
            scores = scores + self.bias[:T].detach()
        else:
            scores = torch.cat([scores[:, :, :1], scores[:, :, 1:] + self.bias[:T]], dim=2)  # patch rows only
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class ClassHead(nn.Module):
    """(B, 3, 6, 6) pixels -> 2x2 patches -> a class token and 9 patch tokens -> two blocks -> the class token's
    logits."""

    def __init__(self, detach: bool = False):
        super().__init__()
        seed_rng(0)
        self.patch = nn.Conv2d(3, 16, 2, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.1)
        self.first = PatchBiasAttention(tokens=10)
        self.last = PatchBiasAttention(tokens=10, detach=detach)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 9, D)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], 1)  # (B, 10, D)
        x = x + self.first(x)
        x = x + self.last(x)
        return self.head(x[:, 0])


PIXELS = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("detach", [False, True])
def test_a_parameter_that_moves_only_discarded_outputs_is_not_judged_and_a_detached_one_still_fails(detach):
    result = diagnostics.audit_model(ClassHead(detach), example=PIXELS, detectors=["gradient_flow"]).result(
        "gradient_flow")
    if detach:  # the bias moves the class token's output, which the head reads, and gets no gradient
        assert result.verdict == "fail" and "last.bias" in result.evidence, result
        return
    # was: failed, "last.bias" getting no gradient (MViTv2's *_cls in the timm sweep)
    assert result.verdict == "pass" and "not judged" in result.message and "last" in result.message, result
