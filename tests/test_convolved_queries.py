"""Queries convolved along the sequence by design (issue 34 "Code nobody here wrote", cause 1).

Primer's multi-DConv-head attention (So et al. 2021; labml-nn's `MultiDConvHeadAttention`) runs a depthwise
convolution of kernel 3 along the sequence over each head's queries, keys and values after their projections, so
output row i reads queries i - 2 .. i. `query_locality` ("each output row depends only on its own query") failed the
correct layer: the rows the convolution mixes a query into moved. It now reads the convolutions on the queries' path
from the standard call's trace (one along the T tokens, kernel K > 1: reach (K - 1) x dilation, summed) and holds every
row beyond that reach. Twins on the same inputs: the same layer with its heads merged without their transpose (rows
far from the changed query move) fails; so does it without the convolution.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics

D, HEADS, KERNEL = 32, 4, 3


class ConvolvedHeads(nn.Module):
    """q, k and v each projected, split into heads and convolved along the sequence per channel (causal: padded on
    the left; `same`: padded on both sides by the convolution itself), then attention. `bug`: "no transpose" (heads
    merged by a reshape of (B, H, T, d) straight to (B, T, D)), "shifted" (each row given the previous token's
    query, an off-by-one). `conv`: False leaves the convolution out; `kernel`: its size; `sliced`: the causal
    convolution written by hand as a sum of shifted slices, as labml-nn's Primer `efficient` writes it."""

    def __init__(self, bug: str = "", conv: bool = True, same: bool = False, kernel: int = KERNEL,
                 sliced: bool = False):
        super().__init__()
        self.bug, self.conv, self.same, self.kernel, self.d_model, self.num_heads = bug, conv, same, kernel, D, HEADS
        self.sliced = sliced
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        d_k = D // HEADS
        self.taps = nn.ModuleList(nn.Conv1d(d_k, d_k, kernel, groups=d_k, padding=(kernel - 1) // 2 if same else 0)
                                  for _ in range(3))

    def heads(self, x, i):  # (B, T, D) -> (B, H, T, d_k), convolved along T
        B, T, _ = x.shape
        if self.sliced:  # the same causal convolution written by hand: row t gets w[j] x token t - j, j < kernel
            x = x.view(B, T, HEADS, -1).transpose(1, 2)  # (B, H, T, d_k)
            w = self.taps[i].weight[:, 0].flip(-1).T.reshape(self.kernel, 1, 1, -1)  # (kernel, 1, 1, d_k): w[j] x t - j
            out = x * w[0]
            for j in range(1, self.kernel):
                out[:, :, j:] += x[:, :, :-j] * w[j]
            return out
        x = x.view(B, T, HEADS, -1).permute(0, 2, 3, 1).reshape(B * HEADS, -1, T)  # (B*H, d_k, T)
        if self.conv:  # causal: token t reads t - 2 .. t; same: t - 1 .. t + 1
            x = self.taps[i](x if self.same else F.pad(x, (self.kernel - 1, 0)))
        return x.view(B, HEADS, -1, T).transpose(-2, -1)

    def forward(self, query, key, value, mask=None):
        B, T, _ = query.shape
        q = self.heads(self.q_proj(query), 0)
        if self.bug == "shifted":
            q = F.pad(q, (0, 0, 1, 0))[:, :, :T]  # row t gets the query of token t - 1
        k, v = self.heads(self.k_proj(key), 1), self.heads(self.v_proj(value), 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1) @ v  # (B, H, T, d_k)
        merged = out.reshape(B, T, D) if self.bug == "no transpose" else out.transpose(1, 2).reshape(B, T, D)
        return self.o_proj(merged)


@pytest.mark.parametrize("sliced", [False, True], ids=["nn.Conv1d", "shifted slices"])
@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_queries_convolved_along_the_sequence_are_held_beyond_its_reach(dtype, init, sliced, std_002):
    """The convolution as nn.Conv1d, or written as labml-nn's Primer `efficient` writes it, `res = x * w[0]`, then
    `res[i:] += x[:-i] * w[i]`: the same reach, +0 to +2, read from its geometry or from the slices the sums add. Its
    twins on the same inputs fail: heads merged without their transpose, and (written as slices) the queries shifted
    by one row on top of the convolution (rows +3 move)."""
    def built(bug=""):
        torch.manual_seed(0)
        layer = ConvolvedHeads(bug, sliced=sliced)
        return (std_002(layer) if init == "std 0.02" else layer).to(dtype)

    right = diagnostics.audit(built()).result("query_locality")
    assert right.verdict == "pass" and "(rows +0 to +2 of the query)" in right.message, right
    assert "convolved along the sequence" in right.evidence, right
    merged = diagnostics.audit(built("no transpose")).result("query_locality")
    assert merged.verdict == "fail" and "(outside rows +0 to +2 of the query)" in merged.message, merged
    if sliced:
        shifted = diagnostics.audit(built("shifted")).result("query_locality")
        assert shifted.verdict == "fail" and shifted.message == "an output row depends on other queries than its own", \
            shifted  # a pad and a slice after the convolution: the queries' path is read no further, nothing excused


def test_without_the_convolution_nothing_is_excused():
    torch.manual_seed(0)
    assert diagnostics.audit(ConvolvedHeads(conv=False)).result("query_locality").verdict == "pass"
    torch.manual_seed(0)
    plain = diagnostics.audit(ConvolvedHeads("no transpose", conv=False)).result("query_locality")
    assert plain.verdict == "fail" and plain.message == "an output row depends on other queries than its own", plain


def test_the_rows_excused_are_the_convolutions_own_and_none_past_them():
    """A convolution padded on both sides carries a query one row either side; the same layer with its queries
    shifted by one row (an off-by-one that stays within a symmetric reach of 2) fails: the rows excused are read from
    the padding, not a radius. A kernel as long as the probe leaves no row to hold: not measured, never passed."""
    torch.manual_seed(0)
    same = diagnostics.audit(ConvolvedHeads(same=True)).result("query_locality")
    assert same.verdict == "pass" and "(rows -1 to +1 of the query)" in same.message, same
    torch.manual_seed(0)
    shifted = diagnostics.audit(ConvolvedHeads("shifted", same=True)).result("query_locality")
    assert shifted.verdict == "fail" and shifted.message == "an output row depends on other queries than its own", \
        shifted  # the shift after the convolution stops the reading: nothing is excused
    torch.manual_seed(0)
    whole = diagnostics.audit(ConvolvedHeads("no transpose", same=True, kernel=17)).result("query_locality")
    assert whole.verdict == "skip" and "leaves no row of 16 to hold" in whole.message, whole


class ShiftedQueries(ConvolvedHeads):
    """Each head's queries replaced by the previous token's, as a shift by slices, `q[:, :, 1:] = q[:, :, :-1]` on a
    copy (no sum with the unshifted queries: an off-by-one, not a convolution); or, `summed`, the previous token's
    query added to each row's own (a convolution of kernel 2, written by hand)."""

    def __init__(self, summed: bool = False):
        super().__init__(conv=False)
        self.summed = summed

    def heads(self, x, i):
        x = super().heads(x, i)
        if i:
            return x
        out = x.clone()
        if self.summed:
            out[:, :, 1:] += x[:, :, :-1]
        else:
            out[:, :, 1:] = x[:, :, :-1]
        return out


def test_a_shift_alone_is_no_convolution():
    """The queries moved one row on by slices fail query_locality as before (nothing excused: no sum with the query's
    own row); the same slices added to the queries are a convolution, excused over rows +0 to +1 only."""
    torch.manual_seed(0)
    shifted = diagnostics.audit(ShiftedQueries()).result("query_locality")
    assert shifted.verdict == "fail" and shifted.message == "an output row depends on other queries than its own", \
        shifted
    torch.manual_seed(0)
    summed = diagnostics.audit(ShiftedQueries(summed=True)).result("query_locality")
    assert summed.verdict == "pass" and "(rows +0 to +1 of the query)" in summed.message, summed


class Transformed(nn.Module):
    """Attention whose queries, (B, H, T, d), pass through `transform` before q·k (keys and values as they are)."""

    def __init__(self, transform, d_model: int = D):
        super().__init__()
        self.transform, self.d_model, self.num_heads = transform, d_model, HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, query, key, value, mask=None):
        B, T, W = query.shape
        split = lambda t: t.view(B, T, HEADS, -1).transpose(1, 2)
        q, k, v = self.transform(split(self.q_proj(query))), split(self.k_proj(key)), split(self.v_proj(value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, W))


def shifted(q, by=1):  # row t gets the query of token t - by (an off-by-one)
    return F.pad(q, (0, 0, by, 0))[:, :, :q.shape[2]]


def summed(q, kernel=3):  # a causal convolution of `kernel` taps as a sum of shifted slices, written in place
    out = q * 0.5
    for j in range(1, kernel):
        out[:, :, j:] += q[:, :, :-j] * 0.25
    return out


def clone_per_tap(q, kernel=3):  # the same, a copy per tap (a way around autograd's in-place errors)
    out = q * 0.5
    for j in range(1, kernel):
        out = out.clone()
        out[:, :, j:] += q[:, :, :-j] * 0.25
    return out


def channels_smoothed(q):  # each token's channels smoothed by shifted sums along its 16 channels: no token mixed
    flat = q.reshape(-1, q.shape[-1])
    out = flat * 0.5
    out[:, 1:] += flat[:, :-1] * 0.25
    return out.view(q.shape)


def viewed_summed(q):  # (B, H, T, d) laid out as (B, H, d, T) by a view, not a transpose: shifted sums over channels
    B, H, T, d = q.shape
    return summed(q.reshape(B, H, d, T)).reshape(B, H, T, d)


CASES = {  # name -> (transform, the model width, whether the correct layer's rows +0 to +2 are excused)
    "scaled after the convolution": (lambda q: summed(q) * 0.5 + 0.1, D, True),
    "a view for a transpose, one head shifted": (lambda q: torch.cat([viewed_summed(q)[:, :1],
                                                                      shifted(viewed_summed(q)[:, 1:])], 1), D, False),
    "clone per tap": (clone_per_tap, D, True),
    "clone per tap, shifted": (lambda q: shifted(clone_per_tap(q)), D, False),
    "one head group convolved, the other shifted": (lambda q: torch.cat([summed(q[:, :2]), shifted(q[:, 2:])], 1), D,
                                                    False),
    "two head groups, one shifted by two": (lambda q: torch.cat([summed(q[:, :2]), shifted(summed(q[:, 2:]), 2)], 1),
                                            D, False),
    "shifted, gated by a convolution": (lambda q: shifted(q) * torch.sigmoid(summed(q)), D, False),
    "channels smoothed, one head shifted": (lambda q: torch.cat([channels_smoothed(q)[:, :1],
                                                                 shifted(channels_smoothed(q)[:, 1:])], 1), 64, False),
}


@pytest.mark.parametrize("setting", ["float32", "bfloat16 at std 0.02"])
@pytest.mark.parametrize("case", list(CASES))
def test_only_a_convolution_the_queries_pass_through_whole_is_read(case, setting, std_002):
    """The reach is read walking back from q·k's queries through ops that only lay them out: a convolution (or a sum
    of shifted slices) on that path counts, and a clone per tap is one convolution; one beside the queries (a head
    group of several, a gate) or a shift after it stops the reading, and an axis that is no token axis (heads of 16
    channels at T = 16, a view laying channels out as T) is found so by changing one query alone. Each of these bugs
    passed in a version of this reading (reviews A and C, 2026-12-07)."""
    transform, width, excused = CASES[case]
    torch.manual_seed(0)
    layer = Transformed(transform, width)
    if setting != "float32":  # the scales people train at
        layer = std_002(layer).to(torch.bfloat16)
    found = diagnostics.audit(layer).result("query_locality")
    if excused:
        assert found.verdict == "pass" and "(rows +0 to +2 of the query)" in found.message, found
    else:
        assert found.verdict == "fail", found
