"""`relative_positions` on layers that fold their heads into the batch, (B*H, T, d), as BLOOM does
(`baddbmm(alibi, q, k^T)` on (B*H, T, T)), fairseq's MultiheadAttention (bsz * num_heads, tgt_len, head_dim) and many
hand-written layers calling `F.scaled_dot_product_attention` on (B*H, T, d) (issue 34).

An ALiBi bias with its sign flipped (far keys rewarded) is still relative, so the shift cannot see it; it is read from
the scores of identical tokens, which were read only where the scores' batch was the stacked call's batch: a folded
layer's flipped sign passed the whole audit. Each layer here is causal ALiBi (slope_h * (j - i), <= 0 for the past
keys, BLOOM's bias up to a constant per row) in one of three forms, the bias as SDPA's (B*H, T, T) float mask on 3-D
tensors (torch's math path: a softmax) or with a head axis of 1 (a fused call), or added by `torch.baddbmm` before a
softmax, and its twins on the same seed and inputs: the slope's sign flipped, and the distance taken as i - j (the
same numbers on a causal layer's keys, another line to point at).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics._guard import seed_rng

DET = "relative_positions"


class FoldedAlibi(nn.Module):
    """Self-attention on (B, T, D), heads folded into the batch: `fold` "batch" (B*H rows, each sequence's heads
    together, as `reshape(B * H, T, d)` lays them out) or "heads" (H*B rows, `torch.cat(x.split(d, -1), 0)`). `op`:
    "sdpa" (the bias as SDPA's additive mask; on 3-D tensors torch runs its math path, a softmax), "sdpa_4d" (the
    same with a head axis of 1: a fused call) or "baddbmm" (scores = bias + q k^T / sqrt(d), then softmax). `bias`:
    "alibi" (slope_h * (j - i), ALiBi for a causal layer) or None. `bug`: "sign" (slopes negated) or "index" (the
    distance as i - j). mask: bool (B, 1, T, T), True = may attend."""

    def __init__(self, d_model=16, num_heads=2, op="sdpa", bias="alibi", bug=None, fold="batch"):
        super().__init__()
        self.d_model, self.num_heads, self.op, self.bias, self.bug, self.fold = d_model, num_heads, op, bias, bug, fold
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def folded(self, x):
        """(B, H, ...) -> (B*H, ...) or (H*B, ...), as `fold` says."""
        return x.flatten(0, 1) if self.fold == "batch" else x.transpose(0, 1).flatten(0, 1)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        H, d = self.num_heads, D // self.num_heads
        q, k, v = (self.folded(t.view(B, T, H, d).transpose(1, 2)) for t in self.qkv(x).chunk(3, -1))  # (B*H, T, d)
        bias = torch.zeros(B * H, T, T, dtype=x.dtype)  # as torch's SDPA reference starts its attn_bias
        if self.bias == "alibi":
            i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)  # (T, 1) queries, (T,) keys
            slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)  # (H,)
            if self.bug == "sign":
                alibi = -slopes.view(H, 1, 1) * (j - i)  # BUG sign: far keys rewarded
            elif self.bug == "index":
                alibi = slopes.view(H, 1, 1) * (i - j)  # BUG index: the distance as i - j, far keys rewarded
            else:
                alibi = slopes.view(H, 1, 1) * (j - i)  # (H, T, T), <= 0 for the past keys
            bias = bias + self.folded(alibi.to(x.dtype).expand(B, H, T, T))  # (B*H, T, T), folded as q, k and v
        if mask is not None:
            bias = bias.masked_fill(~self.folded(mask.expand(B, H, T, T)), float("-inf"))
        if self.op == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (B*H, T, d)
        elif self.op == "sdpa_4d":  # a head axis of 1, as fused kernels take (N, H, T, d) only
            y = F.scaled_dot_product_attention(*(t.unsqueeze(1) for t in (q, k, v, bias))).squeeze(1)  # (B*H, T, d)
        else:
            # (B*H,T,d) x (B*H,d,T) -> (B*H,T,T), plus the bias: BLOOM's form
            scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=1 / math.sqrt(d))
            y = scores.softmax(-1) @ v  # (B*H, T, d)
        y = y.view(B, H, T, d) if self.fold == "batch" else y.view(H, B, T, d).transpose(0, 1)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


def build(dtype=torch.float32, init="gpt2", seed=0, **kw) -> FoldedAlibi:
    seed_rng(seed)
    layer = FoldedAlibi(**kw)
    if init == "gpt2":
        gpt2_init_(layer, seed=seed)  # std 0.02: the scale people train at, attention nearly uniform
    return layer.to(dtype)


def ids(x):
    return str(x).replace("torch.", "")


def audited(**kw):
    return diagnostics.audit(build(**kw), causal=True, detectors=[DET]).result(DET)


def marker(tag: str) -> int:
    return next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1) if f"# BUG {tag}:" in line)


CASES = [pytest.param(op, heads, dtype, id=f"{op}-{heads}heads-{ids(dtype)}")
         for op in ("sdpa", "sdpa_4d", "baddbmm") for heads in (1, 2) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("bug", ["sign", "index"])
@pytest.mark.parametrize("op, heads, dtype", CASES)
def test_a_folded_alibi_that_rewards_distance_fails(op, heads, dtype, bug):
    """Read per head: as many slopes as heads, the largest the first head's 2^(-8/H), at the line that flips it.
    One head: folded and unfolded are the same (B, T, T)."""
    result = audited(dtype=dtype, op=op, num_heads=heads, bug=bug)
    assert result.verdict == "fail" and "rewards distance" in result.message, result
    slopes = result.evidence.split("slopes per head: ")[1].split(")")[0].split(", ")
    assert len(slopes) == heads and result.value == pytest.approx(2.0 ** (-8.0 / heads), rel=1e-3), result.evidence
    lines = [site.line for site in result.where if site.file == __file__]
    assert lines == [marker(bug)], [site.describe() for site in result.where]  # not the zeros it starts from


@pytest.mark.parametrize("op, heads, dtype", CASES)
def test_its_correct_twin_passes(op, heads, dtype):
    """The same class, seed and inputs, the bias penalising distance."""
    result = audited(dtype=dtype, op=op, num_heads=heads)
    assert result.verdict == "pass" and not result.where, result


@pytest.mark.parametrize("dtype, init", [(torch.float32, "default"), (torch.bfloat16, "gpt2")], ids=ids)
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize("op", ["baddbmm", "sdpa_4d"])
@pytest.mark.parametrize("bug", [None, "sign"], ids=["correct", "sign flipped"])
def test_heads_folded_heads_first_are_read_too(bug, op, heads, dtype, init):
    """(H*B, T, d), as `torch.cat(x.split(d, -1), 0)` folds them: the flipped sign fails, its twin passes."""
    result = audited(dtype=dtype, init=init, op=op, num_heads=heads, bug=bug, fold="heads")
    assert result.verdict == ("fail" if bug else "pass"), result
    if bug:  # head 0's slope, read as head 0's
        assert result.value == pytest.approx(2.0 ** (-8.0 / heads), rel=1e-3) and "in head 0 " in result.evidence, \
            result.evidence


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("op", ["sdpa", "baddbmm"])
def test_a_folded_layer_without_a_distance_bias_is_not_blamed(op, causal):
    report = diagnostics.audit(build(op=op, bias=None), causal=causal)
    result = report.result(DET)
    assert result.verdict == "skip" and result.message.startswith("not applicable: the layer has no positional"), result
    assert report.passed, str(report)


@pytest.mark.parametrize("bug", [None, "sign"], ids=["correct", "sign flipped"])
def test_the_whole_audit_of_a_folded_alibi_blames_its_bias_alone(bug):
    """Before issue 34 the flipped layer passed every detector."""
    report = diagnostics.audit(build(op="baddbmm", bug=bug), causal=True)
    failed = {r.detector for r in report.results if r.verdict in ("fail", "error")}
    assert failed == ({DET} if bug else set()), str(report)


class FoldedMask(FoldedAlibi):
    """No positions; its mask taken as (B*H, T, T), bool, True = may attend, handed to SDPA as it comes, or dropped."""

    def __init__(self, drop=False):
        super().__init__(bias=None)
        self.drop = drop

    def forward(self, x, mask=None):
        B, T, D = x.shape
        H, d = self.num_heads, D // self.num_heads
        q, k, v = (self.folded(t.view(B, T, H, d).transpose(1, 2)) for t in self.qkv(x).chunk(3, -1))  # (B*H, T, d)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if self.drop else mask)  # (B*H, T, d)
        return self.out(y.view(B, H, T, d).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("drop", [False, True], ids=["mask applied", "mask dropped"])
def test_a_mask_taken_with_heads_folded_is_read_by_the_mask_detectors(drop):
    """mask_honoured and future_leakage compare outputs only: a (B*H, T, T) mask, declared, needs nothing of them."""
    seed_rng(0)
    report = diagnostics.audit(FoldedMask(drop), mask="allowed:B*H,Tq,Tk", num_heads=2, causal=True,
                               detectors=["mask_honoured", "future_leakage"])
    verdicts = {r.detector: r.verdict for r in report.results}
    assert verdicts == dict.fromkeys(("mask_honoured", "future_leakage"), "fail" if drop else "pass"), str(report)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_fused_call_with_the_folded_batch_behind_a_leading_axis_of_one_is_read(sign):
    """torch 2.14 hands SDPA's 3-D (B*H, T, d) call to its kernel as (1, B*H, T, d): the flipped ALiBi of the "sdpa"
    layers above passed under the real extra's torch (CI, 2026-12-05) while torch 2.13 runs them through a softmax.
    The reading, given that fused call directly: a line in the distance, judged only where the slope is flipped."""
    from types import SimpleNamespace

    from diagnostics.detectors.positions import distance_reward

    B, H, T, d = 2, 2, 6, 4
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)  # (H,)
    bias = (sign * slopes.view(H, 1, 1) * (j - i)).masked_fill(j > i, float("-inf"))  # (H, T, T)
    q = torch.ones(1, B * H, T, d)  # identical tokens: q·k is the same for every key
    fused = SimpleNamespace(q=q, k=q, scale=d ** -0.5, attn_mask=bias.repeat(B, 1, 1).unsqueeze(0), is_causal=False)
    record = SimpleNamespace(softmaxes=[], fused=[fused])
    rewarded = distance_reward(record, 1, B, T, torch.float32)
    assert (rewarded is not None) is (sign < 0), rewarded
