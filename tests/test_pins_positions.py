"""Pins for relative_positions' numbers (issue 37): SHIFT_MOVES and DISTANCE_LINEAR per dtype, SHIFT_TOKENS and
POSITION_TOKENS, each with a case just inside and one just outside (see tests/test_pins.py), on one small function:
attention with a bias of the distance |i - j| (ALiBi's, a slope per position), plus the absolute-position term each
test chooses. The constants are quoted as literals on purpose.
"""

from __future__ import annotations

import math

import pytest
import torch

import diagnostics

DET = "relative_positions"
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INSIDE, OUTSIDE = 0.25, 4.0  # tenfold either way crosses one of the twins
SHIFT_MOVES = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 4e-2, torch.bfloat16: 0.3}
DISTANCE_LINEAR = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 0.3}
T = 12  # POSITION_TOKENS: the real tokens of the shifted call at the audit's seq_len 16


def verdict(layer, **kw):
    return diagnostics.audit(layer, detectors=[DET], **kw).result(DET)


def biased(slope=-0.5, curve=0.0, *, rounding_only=False, drift=0.0, period=None):
    """Attention over (B, H, Tq, d) with the distance bias slope x |i - j| + curve x |i - j|^2 added to the scores
    (ALiBi's for slope < 0 and curve 0: relative), where `rounding_only` adds the curve only below float64 (as
    rounding bends a line: the float64 copy stays one); outputs of the query at index t (of the call) moved by
    `drift` x t, or by cos(2 pi t / `period`) (absolute positions)."""

    def layer(q, k, v, mask=None):
        t_q, t_k = q.shape[-2], k.shape[-2]
        d = (torch.arange(t_q).view(-1, 1) - torch.arange(t_k).view(1, -1)).abs().double()  # (Tq, Tk)
        curved = curve if not rounding_only or q.dtype != torch.float64 else 0.0
        bias = (slope * d + curved * d * d).to(q.dtype)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        out = weights @ v  # (B, H, Tq, d)
        t = torch.arange(t_q, dtype=torch.float64).view(-1, 1)
        moved = drift * t if period is None else torch.cos(2 * math.pi * t / period)
        return (out.double() + moved).to(out.dtype) if drift or period else out, weights

    return layer


# ---- SHIFT_MOVES per dtype ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_shift_that_moves_the_outputs_by_a_quarter_of_shift_moves_passes_and_by_four_times_it_fails(dtype):
    """Outputs moved by `drift` x their index in the call: shifting every position by P moves each real output by
    drift x P, a reading linear in the drift, measured at a large one (float64) and placed at INSIDE and OUTSIDE x
    SHIFT_MOVES."""
    tol = SHIFT_MOVES[dtype]
    calibration = verdict(biased(drift=1e-3), dtype=torch.float64)
    assert calibration.verdict == "fail", calibration
    per_unit = calibration.value / 1e-3
    inside = verdict(biased(drift=INSIDE * tol / per_unit), dtype=dtype)
    outside = verdict(biased(drift=OUTSIDE * tol / per_unit), dtype=dtype)
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail" and outside.threshold == pytest.approx(tol), outside
    assert outside.message.startswith("the outputs depend on absolute positions"), outside


# ---- SHIFT_TOKENS, POSITION_TOKENS ------------------------------------------------------------------------------


def test_the_shift_is_5_positions_so_a_rule_of_period_10_moves():
    """SHIFT_TOKENS = 5, odd and not a power of two: an absolute rule of period 10 moves the outputs by half a period
    (a shift of 50 would be whole periods, one of 0 nothing); its twin without the rule passes."""
    periodic = verdict(biased(period=10))
    assert periodic.verdict == "fail" and "shifting every position by 5 moves them" in periodic.message, periodic
    relative = verdict(biased())
    assert relative.verdict == "pass", relative
    assert relative.message.startswith("shifting every position by 5 (padding)"), relative


def test_the_shift_measures_12_real_tokens_at_the_audits_16():
    """POSITION_TOKENS = 12: the shifted call holds 5 + 12 tokens whatever seq_len, so its cost does not grow with
    it: 2 sequences x 2 heads x 12 tokens read (16 tokens would read 64)."""
    result = verdict(biased(drift=1e-3), seq_len=16)
    assert result.verdict == "fail" and "48 / 48 outputs of the real tokens changed" in result.evidence, result


# ---- DISTANCE_LINEAR per dtype --------------------------------------------------------------------------------


def bend(curve: float, slope: float) -> float:
    """The residual of a straight-line fit over the largest centred score, as distance_reward reads it, for the bias
    slope x d + curve x d^2 on T identical tokens, every key seen (one head: the bias is the same in each)."""
    d = (torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)).abs().double()  # (T, T)
    s = slope * d + curve * d * d
    sc, dc = s - s.mean(-1, keepdim=True), d - d.mean(-1, keepdim=True)  # per row, centred over its keys
    fitted = (sc * dc).sum() / (dc * dc).sum()
    return float((sc - fitted * dc).abs().max() / sc.abs().max())


def curve_for(ratio: float, slope: float) -> float:
    """The curve whose bend is `ratio` (bisection: the bend grows with the curve, to 0.36 for a parabola alone)."""
    lo, hi = 0.0, 100 * abs(slope)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bend(mid, slope) < ratio else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rewarding_bias_bent_by_a_quarter_of_distance_linear_is_alibis_and_by_four_times_it_is_not(dtype):
    """A bias that grows with the distance (slope +0.05), bent by a curve: read as a line (ALiBi's sign flipped, a
    finding) while its bend stays within DISTANCE_LINEAR, and not judged beyond (then a relative bias: the shift
    passes). Below float64 the bend is added in the layer's dtype only, as rounding would bend it: the float64 copy
    that a finding there is read again on stays a line. A parabola bends a line by 0.36 of its spread at most:
    bfloat16's outside twin sits at 0.35 (1.17x its 0.3; a tenfold 3.0 reads it as a line)."""
    slope, tol = 0.05, DISTANCE_LINEAR[dtype]
    rounding = dtype != torch.float64
    inside = verdict(biased(slope, curve_for(INSIDE * tol, slope), rounding_only=rounding), dtype=dtype)
    outside = verdict(biased(slope, curve_for(min(OUTSIDE * tol, 0.35), slope), rounding_only=rounding), dtype=dtype)
    if rounding:
        assert "on the float64 copy of the layer" in inside.evidence, inside  # the replay confirmed the line
    assert inside.verdict == "fail" and inside.message.startswith("the position bias rewards distance"), inside
    assert outside.verdict == "pass", outside


def test_a_declared_pattern_of_absolute_blocks_is_not_applicable_and_a_window_is_measured():
    """The guard on the declared pattern: chunked(4)'s blocks move with a shift of 5 (its mask over the real tokens
    changes: not applicable, said so), sliding_window(4)'s does not (measured: ALiBi passes)."""
    chunks = verdict(biased(), pattern=diagnostics.patterns.chunked(4))
    assert chunks.verdict == "skip" and "the declared attention pattern depends on absolute positions" in chunks.message
    window = verdict(biased(), pattern=diagnostics.patterns.sliding_window(4))
    assert window.verdict == "pass", window


def test_a_shifted_call_that_loses_the_batch_is_a_skip_that_says_so():
    """The guard on the shifted call's batch: a layer that returns one sequence where the shifted call (5 + 12 = 17
    tokens, 2 x 2 sequences) gave it four is not measured, and says why; the same layer keeping its batch passes."""

    def layer(q, k, v, mask=None):
        out, weights = biased()(q, k, v, mask)
        return (out[:1], weights[:1]) if q.shape[-2] == 5 + T else (out, weights)

    lost = verdict(layer)
    assert lost.verdict == "skip" and "has no row per batch element" in lost.message, lost
    assert verdict(biased()).verdict == "pass"


def sdpa_alibi(slope: float):
    """ALiBi through torch's fused attention: the distance bias slope x |i - j| as its float mask (the passed bool
    mask folded in as -inf), so the scores are read from the fused call."""

    def layer(q, k, v, mask=None):
        t_q, t_k = q.shape[-2], k.shape[-2]
        d = (torch.arange(t_q).view(-1, 1) - torch.arange(t_k).view(1, -1)).abs().to(q.dtype)  # (Tq, Tk)
        bias = (slope * d).expand(q.shape[0], 1, t_q, t_k)
        if mask is not None:
            bias = bias.masked_fill(~mask.view(-1, 1, t_q, t_k), float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    return layer


def test_a_flipped_alibi_in_a_fused_call_is_read_from_its_mask_and_the_right_sign_passes():
    """_scores_seen's fused path: q·k times the call's scale plus its float mask, over the (5 + 12)-token call."""
    flipped = verdict(sdpa_alibi(+0.5))
    assert flipped.verdict == "fail" and flipped.message.startswith("the position bias rewards distance"), flipped
    assert verdict(sdpa_alibi(-0.5)).verdict == "pass"


# ---- distance_reward: a head with no bias ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("slopes", [(0.0, -0.5), (0.0, 0.05)], ids=["penalises", "rewards"])
def test_a_head_without_a_bias_beside_alibis_passes_and_beside_a_rewarding_one_fails(slopes, dtype):
    """distance_reward's `slope > 0` over the heads: a head with no distance bias reads slope exactly 0 on identical
    tokens (its scores are flat); beside an ALiBi head (slope -0.5) no head rewards distance, a pass (with `>= 0` the
    flat head alone would read as rewarding, value 0.0); beside a head of slope +0.05 the layer fails, value 0.05."""
    found = verdict(biased(slope=torch.tensor(slopes, dtype=torch.float64).view(2, 1, 1)), dtype=dtype)
    if slopes[1] < 0:
        assert found.verdict == "pass", found
    else:
        assert found.verdict == "fail" and found.value == pytest.approx(0.05, rel=1e-4), found
        assert found.message.startswith("the position bias rewards distance"), found
