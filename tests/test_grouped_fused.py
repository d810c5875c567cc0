"""Grouped key/value heads handed to a fused attention call as they are (torch's `enable_gqa=True`: H_kv heads for H
query heads, each serving H / H_kv consecutive ones), as ZAYA's attention does (issue 33): `output_variance` paired the
values' (B x H_kv) rows with the output's (B x H) and crashed, and `parameters_used` multiplied q by k the same way;
both are internal errors, and the correct layer (and the ZAYA model around it) went inconclusive. The fused call's keys
and values are now read per query head (`_observe.per_query_head`), as `fused_weights` already read them.

Twins on one layer of that shape whose values also read the previous token (ZAYA's delayed values: identical tokens
then give different outputs, so output_variance judges its weighted sum inside): correct, it passes; with q·k left
unscaled (`scale=1.0`) it fails softmax_saturation, and output_variance still measures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics._subject import make_subject
from diagnostics.detectors.parameters import _scores

D, H, G = 32, 4, 2  # width, query heads, key/value heads


class GroupedFused(nn.Module):
    """Causal self-attention with G key/value heads for H query heads, passed to SDPA with enable_gqa=True; its
    values add a projection of the previous token's input (ZAYA's delayed values)."""

    scale = None  # SDPA's own 1/sqrt(d)

    def __init__(self):
        super().__init__()
        self.d_model, self.num_heads = D, H
        self.q, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v, self.v_delayed = (nn.Linear(D, G * D // H) for _ in range(3))

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, width
        q = self.q(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
        previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # (B, T, D): the token before
        k = self.k(x).view(B, T, G, D // H).transpose(1, 2)  # (B, G, T, d)
        v = (self.v(x) + self.v_delayed(previous)).view(B, T, G, D // H).transpose(1, 2)  # (B, G, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class Unscaled(GroupedFused):
    scale = 1.0  # BUG: q·k reaches the softmax without its 1/sqrt(d)


def audit(cls):
    torch.manual_seed(0)
    return diagnostics.audit(cls(), causal=True)


def test_grouped_heads_in_a_fused_call_are_measured_and_the_correct_layer_passes():
    report = audit(GroupedFused)
    variance = report.result("output_variance")
    assert variance.verdict == "pass", variance  # was: error (8 query-head rows against 4 value-head rows)
    assert report.status == "passed", str(report)


def test_the_same_layer_unscaled_still_fails_and_its_values_are_still_judged():
    report = audit(Unscaled)
    assert report.result("softmax_saturation").verdict == "fail", str(report)
    assert report.result("output_variance").verdict != "error", report.result("output_variance")


def test_the_scores_of_a_grouped_fused_call_pair_each_query_head_with_its_key_head():
    torch.manual_seed(0)
    layer = GroupedFused()
    subject = make_subject(layer)
    x = torch.randn(2, 6, D)
    scores = _scores(subject, (x, x, x), None)  # was: RuntimeError (4 query heads against 2 key heads)
    assert len(scores) == 1 and scores[0].shape == (2, H, 6, 6)
    q = layer.q(x).view(2, 6, H, D // H).transpose(1, 2).double()
    k = layer.k(x).view(2, 6, G, D // H).transpose(1, 2).double()
    head_3 = q[:, 3] @ k[:, 1].transpose(-2, -1) / (D // H) ** 0.5  # query head 3 is served by key head 1
    assert torch.allclose(scores[0][:, 3], head_3, atol=1e-5)
