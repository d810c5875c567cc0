"""Scores normalised a part of the batch at a time (issue 34 "Code nobody here wrote", third-party layers).

labml-nn's Stable Diffusion `CrossAttention` saves memory by normalising its scores in place, half of the batch at a
time: `attn[half:] = attn[half:].softmax(dim=-1)`, then `attn[:half] = ...`. The correct layer was inconclusive:
each softmax's input was recorded as a view of `attn`, which the layer then overwrote with the weights, and no q·k
product had the size of half the scores, so `softmax_saturation` read no temperature. The observer now keeps a
softmax's input that is a slice of a larger tensor as it was, and a softmax over one of n equal consecutive parts of
a product's elements is fitted against that part; the weights read are the whole tensor the values meet, of which
each softmax wrote a part. Twins on the same inputs: the layer without its 1/sqrt(d_k) fails `softmax_saturation`
(it was inconclusive too); one that normalises one half over the queries fails `weight_row_sums` (it was
inconclusive), and so does one that forgets to normalise a half (it failed `output_variance` alone).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS = 32, 4


class HalvesAttention(nn.Module):
    """Self- or cross-attention on (B, T, D) tokens whose softmax runs in place over each half of the batch, as
    labml-nn's Stable Diffusion U-Net writes it. `bug`: "unscaled" (no 1/sqrt(d_k)), "queries axis" (the first half
    normalised over the queries), "one half" (the second half's softmax left out), "zeroed after" (the half normalised
    last has its future keys zeroed after its softmax: that part no longer equals the softmax's output, the other
    part's does)."""

    def __init__(self, bug: str = ""):
        super().__init__()
        self.bug, self.d_head = bug, D // HEADS
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.to_out = nn.Linear(D, D)

    def forward(self, x, cond=None):
        cond = x if cond is None else cond
        q, k, v = (f(t).view(*t.shape[:2], HEADS, -1) for f, t in ((self.to_q, x), (self.to_k, cond),
                                                                   (self.to_v, cond)))
        attn = torch.einsum("bihd,bjhd->bhij", q, k)
        if self.bug != "unscaled":
            attn = attn * self.d_head ** -0.5
        half = attn.shape[0] // 2
        attn[half:] = attn[half:].softmax(dim=-2 if self.bug == "queries axis" else -1)
        if self.bug != "one half":
            attn[:half] = attn[:half].softmax(dim=-1)
        if self.bug == "zeroed after":  # the half normalised last, its future keys zeroed after the softmax
            T = attn.shape[-1]
            attn[:half] = attn[:half].masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
        out = torch.einsum("bhij,bjhd->bihd", attn, v)
        return self.to_out(out.reshape(*out.shape[:2], -1))


def _audit(bug="", dtype=torch.float32, init="default", std_002=None):
    torch.manual_seed(0)
    layer = HalvesAttention(bug)
    layer = (std_002(layer) if init == "std 0.02" else layer).to(dtype)
    return diagnostics.audit(layer)


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scores_normalised_half_a_batch_at_a_time_are_read(dtype, init, std_002):
    right = _audit(dtype=dtype, init=init, std_002=std_002)
    assert right.status == "passed", right
    temperature = right.result("softmax_saturation")
    assert temperature.verdict == "pass" and "of 2 of the q·k matmul" in temperature.evidence, temperature
    unscaled = _audit("unscaled", dtype, init, std_002).result("softmax_saturation")
    assert unscaled.verdict == "fail", unscaled


@pytest.mark.parametrize("bug", ["queries axis", "one half", "zeroed after"])
def test_a_half_normalised_wrong_fails(bug):
    failed = [r.detector for r in _audit(bug).results if r.verdict == "fail"]
    assert "weight_row_sums" in failed, failed


class TwoStages(nn.Module):
    """Two attentions one after the other: the first runs two branches in one product, `cat([wa, wb]) @ cat([va, vb])`
    (weights of the second's shape, two of them in one operand), the second normalises its scores over `dim`."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim, self.d_model, self.num_heads = dim, D, 1
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        wa = (q @ k.transpose(-2, -1) * D ** -0.5).softmax(-1)
        wb = (k @ q.transpose(-2, -1) * D ** -0.5).softmax(-1)
        x = x + (torch.cat([wa, wb]) @ torch.cat([v, v]))[: x.shape[0]]
        return (q @ x.transpose(-2, -1) * D ** -0.5).softmax(self.dim) @ x


def test_another_attentions_softmax_is_no_part():
    """The second attention's softmax over the queries is read as itself, never as a part of the first's product,
    whose operand holds a softmax of its shape (review C: the wrong axis passed `weight_row_sums` so)."""
    torch.manual_seed(0)
    found = diagnostics.audit(TwoStages(dim=-2)).result("weight_row_sums")
    assert found.verdict == "fail", found
