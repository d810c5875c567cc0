"""Efficient attention (Shen et al.; linear-attention-transformer's `linear_attn`): q normalised over its features and
k over the tokens by two softmaxes, the values summed through them (out = softmax_d(q) (softmax_n(k)^T v)): every row
of the kernel sums to 1. k's softmax output, (.., T, d), has the shape of weights over d keys pooled from the tokens,
and the product of q's feature map with the context summed d of them: `pooled_keys` took it for the weights, and the
correct layer FAILED `weight_row_sums` (its "rows" over the features do not sum to 1), with a fix to normalise over
the last axis. Now a product counts only where its operand holds the softmax's own values (`_observe._same_values`).
The twin scales q after its softmax (linear-attention-transformer 0.19's `q = q * dim ** -0.5`): each row then sums
to 1/sqrt(d), a true finding, pointed at that line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import correct
import diagnostics


class EfficientAttention(nn.Module):
    def __init__(self, dim=32, heads=4, scaled_after=False):
        super().__init__()
        self.heads, self.scaled_after = heads, scaled_after
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        q = q.softmax(dim=-1)  # over the features
        k = k.softmax(dim=-2)  # over the tokens
        if self.scaled_after:
            q = q * q.shape[-1] ** -0.5
        context = k.transpose(-1, -2) @ v  # (B, H, d, d)
        out = q @ context  # (B, H, T, d)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16-std0.02")]


def _audit(dtype, **kw):
    torch.manual_seed(0)
    layer = EfficientAttention(**kw)
    if dtype != torch.float32:  # training's scale: GPT-2's initialisation, in the low precision
        correct.gpt2_init_(layer)
    return diagnostics.audit(layer.to(dtype), progress=False, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_of_two_feature_maps_is_read_as_the_weights_and_its_rows_sum_to_one(dtype):
    result = _audit(dtype).result("weight_row_sums")
    assert result.verdict == "pass", result


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_scale_after_the_softmax_fails_at_its_line(dtype):
    result = _audit(dtype, scaled_after=True).result("weight_row_sums")
    assert result.verdict == "fail" and "sums to 0.35" in result.evidence, result
    where = result.where[0]
    assert where.code.strip() == "q = q * q.shape[-1] ** -0.5", where
    assert "multiplies by 0.3536 after a softmax" in where.note, where


class ScaledAfterBy(EfficientAttention):
    """q's feature map multiplied or divided after its softmax (`how`), and k's scores multiplied before its own by the
    same number (a decoy: a scale before a softmax is no scale of the weights), q multiplied by a tensor of ones first
    (no constant at all)."""

    def __init__(self, how, factor):
        super().__init__()
        self.how, self.factor = how, factor

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        k = k * self.factor
        q, k = q.softmax(dim=-1), k.softmax(dim=-2)
        q = q * torch.ones_like(q)  # a product with a tensor after the softmax: no constant, read past
        q = q * self.factor if self.how == "mul" else q / (1 / self.factor)
        out = q @ (k.transpose(-1, -2) @ v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("how, factor, line", [("mul", 2.0, "q = q * self.factor if self.how"),
                                               ("div", 0.25, "q = q * self.factor if self.how")])
def test_the_op_that_scaled_the_weights_is_named_whichever_way_and_not_the_scale_before_a_softmax(how, factor, line):
    """Rows summing to 2 (above 1) or to 0.25 (a division by 4): the op after the softmax is named, not the decoy
    that multiplied k's scores by the same number before k's softmax."""
    torch.manual_seed(0)
    result = diagnostics.audit(ScaledAfterBy(how, factor), progress=False).result("weight_row_sums")
    assert result.verdict == "fail" and f"sums to {factor:g}" in result.evidence, result
    assert result.where and result.where[0].code.strip().startswith(line), result.where
