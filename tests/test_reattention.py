"""Re-attention (DeepViT, Zhou et al. 2021: Norm(Theta^T softmax(q k^T / sqrt(d))) V): the softmax's weights mixed
across heads by a learned (H, H) matrix and normalised over the heads before they weigh the values.

Found by the vit-pytorch population sweep (`python benchmarks/sweep.py vit_pytorch`): vit-pytorch 1.26.14's DeepViT
failed `softmax_saturation` (the temperature fitted on the mixed weights, not on the softmax's) and `output_variance`
(the mixed, normalised weights are no convex combination, by the paper's design). Written here in this file's own
words: the correct layer passes, its twins with one step broken fail on the same inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics

D, H = 32, 4


class ReAttention(nn.Module):
    """`bug`: "unscaled" (no 1/sqrt(d)), "softmax over queries", "mask after softmax" (the mask applied to the mixed
    weights, after the softmax), or None."""

    def __init__(self, bug=None, norm=True, heads=H):
        super().__init__()
        self.bug, self.h, self.d = bug, heads, D // heads
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)
        self.theta = nn.Parameter(torch.randn(heads, heads))
        self.norm = nn.LayerNorm(heads) if norm else nn.Identity()

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1)
        if self.bug != "unscaled":
            scores = scores / math.sqrt(self.d)
        if mask is not None and self.bug != "mask after softmax":
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-2 if self.bug == "softmax over queries" else -1)
        mixed = torch.einsum("bhij,hg->bgij", weights, self.theta)  # every head a mix of all heads' weights
        mixed = self.norm(mixed.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # normalised over the heads
        if mask is not None and self.bug == "mask after softmax":
            mixed = mixed.masked_fill(~mask, 0.0)
        return self.out((mixed @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["normalised", "linear mix"])
def test_re_attention_passes_and_says_why_its_weights_are_not_convex(norm, dtype, init, std_002):
    torch.manual_seed(0)
    layer = ReAttention(norm=norm)
    report = diagnostics.audit((std_002(layer) if init == "std 0.02" else layer).to(dtype))
    assert report.passed, str(report)
    assert report.result("softmax_saturation").verdict == "pass", report.result("softmax_saturation")
    variance = report.result("output_variance")
    if norm:  # the mixed weights normalised over the heads: their rows no longer sum to a constant
        assert variance.verdict == "skip" and "mixed across heads by the layer's (4, 4) matrix theta" in \
            variance.message, variance
    else:  # a linear mix keeps every row's sum a constant: the one-token comparison still holds
        assert variance.verdict == "pass", variance


def test_two_heads_mixed_are_re_attention_too():
    """The smallest mix of heads, (2, 2): the same reading as at 4 heads."""
    torch.manual_seed(0)
    variance = diagnostics.audit(ReAttention(heads=2), detectors=["output_variance"]).result("output_variance")
    assert variance.verdict == "skip" and "(2, 2) matrix theta" in variance.message, variance


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bug, detector", [("unscaled", "softmax_saturation"),
                                           ("softmax over queries", "weight_row_sums"),
                                           ("mask after softmax", "mask_honoured")])
def test_re_attention_with_one_step_broken_still_fails(bug, detector, dtype, init, std_002):
    torch.manual_seed(0)
    layer = ReAttention(bug=bug)
    report = diagnostics.audit((std_002(layer) if init == "std 0.02" else layer).to(dtype))
    assert report.result(detector).verdict == "fail", str(report)


def test_a_second_softmax_of_the_weights_is_still_judged_by_their_temperature():
    """The head-mix rule reads only a product with an (H, H) matrix between the softmax and the values: a layer that
    softmaxes its weights again (no mix) is judged on the weights it uses, too flat."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)

        def forward(self, x, mask=None):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-2, -1) / math.sqrt(D // H)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = F.softmax(F.softmax(scores, -1), -1)
            return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))

    torch.manual_seed(0)
    found = diagnostics.audit(Twice()).result("softmax_saturation")
    assert found.verdict == "fail" and "too flat" in found.message, found
