"""Where heads merged without their transpose are named, when the attention is torch's fused SDPA kernel.

Found by `python benchmarks/real_bugs.py` under torch 2.14.1 (QAnet's `stacked_heads_viewed`: localised under 2.13,
not under 2.14.1): torch 2.14's CPU SDPA runs its fused flash kernel where 2.13's ran the math path (a softmax and a
matmul the trace sees), and `output_variance`'s localiser looked for the matmul after a softmax only, so it named no
line. The fused call's output is the weights·values product itself, and the search for the op that mixes positions
with heads now starts there. Twin on the same weights and inputs: the heads merged with their transpose pass.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


class FusedHeads(nn.Module):
    """Self-attention through F.scaled_dot_product_attention on (B, H, T, d); `transposed`: its heads merged as
    (B, T, H * d) after the transpose that puts T before H (else viewed straight: the bug)."""

    def __init__(self, transposed: bool, d_model: int = 16, num_heads: int = 4):
        super().__init__()
        self.transposed, self.num_heads = transposed, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, d)
        merged = y.transpose(1, 2).reshape(B, T, D) if self.transposed else y.reshape(B, T, D)  # MERGE
        return self.out(merged)


MERGE_LINE = next(i for i, line in enumerate(inspect.getsourcelines(FusedHeads.forward)[0])
                  if "# MERGE" in line) + inspect.getsourcelines(FusedHeads.forward)[1]


@pytest.mark.parametrize("transposed", [True, False], ids=["merged with the transpose", "viewed straight"])
def test_heads_viewed_straight_after_a_fused_call_are_named_at_the_merge(transposed):
    torch.manual_seed(0)
    found = diagnostics.audit(FusedHeads(transposed), detectors=["output_variance"]).result("output_variance")
    if transposed:
        assert found.verdict == "pass", found
        return
    assert found.verdict == "fail", found
    assert any(site.line == MERGE_LINE for site in found.where), list(found.where)
