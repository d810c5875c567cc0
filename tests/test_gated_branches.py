"""A layer whose output mixes several weighted sums, none over the (Tq, Tk) tokens: native sparse attention's style
(native-sparse-attention-pytorch's SparseAttention: compressed blocks, selected blocks and local windows, each attended
apart and summed under sigmoid gates that need not sum to 1). Identical tokens do not come out unchanged, by design;
`output_variance` failed the correct layer. The property belongs to each weights @ values inside: each is judged, and
the correct layer passes, while its twin that merges heads without their transpose, and its twin with a branch whose
weights are not normalised, still fail on the same inputs. The package's own class is swept by
`python benchmarks/sweep.py native_sparse_attention_pytorch`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, H, BLOCK = 32, 4, 4  # width, heads, tokens per block and per window


class GatedBranches(nn.Module):
    """Two branches: every query attends a learned slot and the mean of each block of BLOCK keys (and values), and
    the keys of its own window of BLOCK tokens; their outputs summed under a sigmoid gate per head and branch. `bug`:
    None, "merged" (the heads merged by a reshape without their transpose), "unnormalised" (the window branch's
    weights exp(scores) divided by nothing)."""

    def __init__(self, bug: str | None = None, block: int = BLOCK):
        super().__init__()
        self.bug, self.block = bug, block
        self.qkv, self.gate, self.out = nn.Linear(D, 3 * D), nn.Linear(D, 2 * H), nn.Linear(D, D)
        self.slot_k, self.slot_v = (nn.Parameter(torch.zeros(H, 1, D // H)) for _ in range(2))  # a learned block

    def forward(self, x):
        B, T, _ = x.shape  # batch, tokens, width
        assert T % self.block == 0, f"sequence length {T} must be divisible by the block size {self.block}"
        d, n, BLOCK = D // H, T // self.block, self.block  # head width, blocks, tokens in each
        q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, d)
        ck, cv = (torch.cat([slot.expand(B, H, 1, d), t.unflatten(2, (n, BLOCK)).mean(3)], 2)
                  for slot, t in ((self.slot_k, k), (self.slot_v, v)))  # (B, H, 1 + n, d): a slot, a key per block
        pooled = ((q @ ck.transpose(-2, -1)) * d ** -0.5).softmax(-1) @ cv  # (B, H, T, d)
        bq, bk, bv = (t.unflatten(2, (n, BLOCK)) for t in (q, k, v))  # (B, H, n, BLOCK, d)
        scores = (bq @ bk.transpose(-2, -1)) * d ** -0.5  # (B, H, n, BLOCK, BLOCK)
        weights = scores.exp() if self.bug == "unnormalised" else scores.softmax(-1)
        local = (weights @ bv).flatten(2, 3)  # (B, H, T, d)
        g = torch.sigmoid(self.gate(x)).view(B, T, H, 2).permute(0, 2, 1, 3)  # (B, H, T, 2)
        mixed = g[..., :1] * pooled + g[..., 1:] * local  # (B, H, T, d)
        merged = mixed.reshape(B, T, D) if self.bug == "merged" else mixed.transpose(1, 2).reshape(B, T, D)
        return self.out(merged)


def _audit(bug=None, dtype=torch.float32, block=BLOCK):
    torch.manual_seed(0)
    layer = GatedBranches(bug, block).to(dtype)
    with torch.no_grad():  # std 0.02, as models are initialised
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return diagnostics.audit(layer, progress=False, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weighted_sum_is_judged_and_the_twins_fail(dtype):
    correct = _audit(dtype=dtype)
    variance = correct.result("output_variance")
    assert variance.verdict == "pass" and "mixes 2 weighted sums" in variance.message, correct
    assert correct.passed, correct
    for bug in ("merged", "unnormalised"):
        twin = _audit(bug, dtype=dtype)
        assert twin.result("output_variance").verdict == "fail", (bug, twin)


def test_blocks_of_two_are_compared_with_two_copies_of_the_token():
    """The fewest tokens its own check takes is the reference's length: 2 here, as 4 above."""
    correct = _audit(block=2)
    assert correct.result("output_variance").verdict == "pass", correct
    assert _audit("merged", block=2).result("output_variance").verdict == "fail"


class Plain(nn.Module):
    """One softmax attention over the tokens, no gate, any length: judged on its output, its one token the reference."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.out((((q @ k.transpose(-2, -1)) * (D // H) ** -0.5).softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def test_a_layer_that_takes_one_token_is_judged_on_its_output():
    torch.manual_seed(0)
    result = diagnostics.audit(Plain(), progress=False).result("output_variance")
    assert result.verdict == "pass" and result.message == "identical value rows come out unchanged", result
