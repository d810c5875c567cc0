"""A softmax that pools keys beside the attention is not the attention's weights (issue 33, GLM-5-Next's indexer).

GLM-5-Next's sparse-attention indexer pools its keys in pools of 16 tokens by a softmax over each pool's tokens,
(B, P, 16, d) normalised over axis 2, per channel; its attention is a fused SDPA call. At the audit's 16 tokens and
d = 16 the pooling softmax's last two axes are (16, 16), (Tq, Tk) by coincidence, and weight_row_sums read it as the
attention weights ("rows sum to 11.34"), and softmax_saturation fitted it against the pooling projection ("2.83x too
sharp"). A softmax over another axis than the keys is read as the weights, or fitted for a scale, only where no fused
call was observed; twin: the same layer whose attention is eager with its softmax over the queries (the catalog's
softmax_wrong_dim) still fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diagnostics import audit
from diagnostics._guard import seed_rng


class PooledIndexAttention(nn.Module):
    """Self-attention whose keys are chosen pool by pool by an indexer that pools its own keys (B, P, pool, 16) with a
    softmax over each pool's tokens (GLM-5-Next's `get_pooled_states`); `fused`: the attention is SDPA's, else eager
    with its softmax over the queries (a real bug, for the twin)."""

    def __init__(self, fused: bool = True, d_model: int = 32, num_heads: int = 2, pool: int = 16):
        super().__init__()
        seed_rng(0)
        self.d_model, self.num_heads, self.pool, self.fused = d_model, num_heads, pool, fused
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.wk, self.wq = nn.Linear(d_model, 16), nn.Linear(d_model, 16)
        self.gate = nn.Linear(d_model, 16, bias=False)  # as GLM-5-Next's F.linear: a product the observer sees

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, width
        H, d = self.num_heads, D // self.num_heads
        P = -(-T // self.pool)  # pools, the last one padded
        pad = P * self.pool - T
        keys = F.pad(self.wk(x), (0, 0, 0, pad)).view(B, P, self.pool, 16)
        logits = F.pad(self.gate(x), (0, 0, 0, pad), value=-1e4).view(B, P, self.pool, 16)
        pooled = (logits.softmax(dim=2) * keys).sum(2)  # (B, P, 16): each pool's weighted mean, per channel
        chosen = (self.wq(x) @ pooled.transpose(1, 2)).argmax(-1, keepdim=True)  # (B, T, 1): a pool per query
        allowed = ((torch.arange(T) // self.pool)[None, None, :] == chosen)[:, None]  # (B, 1, T, T)
        q, k, v = self.qkv(x).view(B, T, 3, H, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        if self.fused:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        else:
            scores = (q @ k.transpose(-1, -2) / d ** 0.5).masked_fill(~allowed, float("-inf"))  # (B, H, T, T)
            o = scores.softmax(dim=-2) @ v  # BUG: normalised over the queries
        return self.out(o.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("fused", [True, False])
def test_a_pooling_softmax_beside_a_fused_call_is_not_read_as_the_weights_and_a_wrong_axis_still_fails(fused):
    report = audit(PooledIndexAttention(fused), seq_len=16)
    rows = report.result("weight_row_sums")
    if not fused:  # no fused call: the softmax over the queries is the attention's, and its rows do not sum to 1
        assert rows.verdict == "fail" and "dim=" in rows.message, rows
        return
    # was: "observed softmax output (dim=2)", 32 / 32 rows not summing to 1 (the indexer's pooling softmax); and
    # softmax_saturation "5.66x too sharp", the pooling softmax of a projection fitted as q·k multiplied by 1
    assert rows.verdict == "pass" and "fused attention call" in rows.message, rows
    saturation = report.result("softmax_saturation")
    assert saturation.verdict == "pass" and "ratio 1.0000" in saturation.message, saturation
