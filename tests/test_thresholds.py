"""Tests that sit on the thresholds: for each tolerance and gain, a layer just inside it passes and one just
outside fails, on the same inputs, so that loosening (or tightening) any constant tenfold fails a test here.

The layers are the reference computation with one number changed: row sums off by a chosen epsilon, a softmax
temperature off by a chosen ratio, a second call off by a chosen fraction of the outputs' RMS, a leak that opens
only past a chosen push, a backward off by a chosen factor. "Just inside" and "just outside" are INSIDE and
OUTSIDE times the constant (or the reading a constant multiplies, measured here by the test itself), so that
10x either way crosses a twin's verdict. The constants are quoted from the source as literals on purpose: a test
that read them from the module would follow a mutated constant.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._common import logit_gain
from diagnostics.detectors._mask_hints import honoured_conventions
from diagnostics.model import _tolerance
from diagnostics.model.cache import schedules

INSIDE, OUTSIDE = 0.25, 4.0  # how far from a threshold the twins sit: 10x either way crosses one of them
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
ROW_SUM = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
UNCHANGED = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GOLDEN_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SCALE_RATIO = 1.25
GRADIENT_AGREEMENT = 1e-9
CACHE_NOISE_FACTOR = 4.0
FORWARD_MOVES = 1e-9


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


def centred_rms(x: torch.Tensor) -> float:
    """The outputs' RMS about each feature's mean, computed here independently of diagnostics."""
    x = x.double().flatten(0, -2)
    return float((x - x.mean(0)).square().mean().sqrt())


def attention(q, k, v, mask=None, *, row_sum=1.0, ratio=1.0):
    """Scaled dot-product attention on (B, H, T, d) returning (out, weights); `row_sum` scales the weights (rows
    then sum to it), `ratio` multiplies the logits (the softmax's temperature is off by that factor)."""
    scores = q @ k.transpose(-2, -1) * (ratio / math.sqrt(q.shape[-1]))  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1) * row_sum
    return weights @ v, weights  # (B, H, Tq, d)


def with_(**changed):
    return lambda q, k, v, mask=None: attention(q, k, v, mask, **changed)


# ---- ROW_SUM per dtype: weight_row_sums and output_variance --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_sums_off_by_a_quarter_of_the_tolerance_pass_and_by_four_times_it_fail(dtype):
    tol = ROW_SUM[dtype]
    inside = verdict(with_(row_sum=1 + INSIDE * tol), "weight_row_sums", dtype=dtype)
    outside = verdict(with_(row_sum=1 + OUTSIDE * tol), "weight_row_sums", dtype=dtype)
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail", outside
    assert outside.threshold == pytest.approx(tol)
    # the reading is the epsilon the layer was given (its weights' own rounding aside)
    assert outside.value == pytest.approx(OUTSIDE * tol, rel=0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outputs_off_by_a_quarter_of_the_row_sum_tolerance_pass_output_variance_and_by_four_times_fail(dtype):
    """Identical value rows come out scaled by the row sum: the change is the epsilon times |v| / RMS(v), at
    least the epsilon (the largest feature is at least the RMS), at most sqrt(d) times it; the inside twin
    is placed at INSIDE / sqrt(d) so that even the largest feature stays inside."""
    tol, d = ROW_SUM[dtype], 8  # the function form's head width at the audit's default d_model 16, 2 heads
    inside = verdict(with_(row_sum=1 + INSIDE * tol / math.sqrt(d)), "output_variance", dtype=dtype)
    outside = verdict(with_(row_sum=1 + OUTSIDE * tol), "output_variance", dtype=dtype)
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail", outside


# ---- SCALE_RATIO: softmax_saturation ---------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1.15, 1 / 1.15, 1.4, 1 / 1.4], ids=["1.15", "1/1.15", "1.4", "1/1.4"])
def test_a_temperature_off_by_15_percent_passes_and_one_off_by_40_percent_fails(ratio):
    """The smallest bug softmax_saturation must catch is sqrt(2) = 1.41 (a missing scale at d_k = 2); 1.15 is
    a correct layer's worth of slack, 1.4 is that bug: both sides of SCALE_RATIO = 1.25, tenfold either way
    crosses one."""
    result = verdict(with_(ratio=ratio), "softmax_saturation")
    inside = 1 / SCALE_RATIO < ratio < SCALE_RATIO
    assert result.verdict == ("pass" if inside else "fail"), result
    assert result.value == pytest.approx(ratio, rel=1e-3)  # the fit reads the ratio the layer was given


# ---- UNCHANGED per dtype: eval_determinism ---------------------------------------------------------


class SecondCallOff:
    """The reference, except that every call after the first moves one output value (of sequence 0) by `fraction` of
    the outputs' RMS about their mean (randomness left on, at a chosen size: eval_determinism reads its second
    call, batch_independence's, and where that moved, a third)."""

    def __init__(self, fraction: float):
        self.fraction, self.calls = fraction, 0

    def __call__(self, q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)
        self.calls += 1
        if self.calls > 1:
            wide = out.double()
            wide[0, 0, 0, 0] += self.fraction * centred_rms(wide)
            out = wide.to(out.dtype)
        return out, weights


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_second_call_off_by_a_quarter_of_unchanged_passes_eval_determinism_and_by_four_times_fails(dtype):
    """One rounding of the moved value is at most half an ulp of a value below 4: inside it reads at most
    INSIDE x tol + 2 ulp / RMS, still inside at every dtype; outside at least OUTSIDE x tol - that."""
    tol = UNCHANGED[dtype]
    inside = verdict(SecondCallOff(INSIDE * tol), "eval_determinism", dtype=dtype)
    outside = verdict(SecondCallOff(OUTSIDE * tol), "eval_determinism", dtype=dtype)
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail", outside
    assert outside.threshold == pytest.approx(tol)


# ---- the perturbation gains: query_locality ------------------------------------------------------


def leaks_past(threshold: float):
    """The reference, except that every output moves once some position's query averages more than `threshold`
    in absolute value: a leak between rows that only a hard push opens (a gate on an overflow, a clamp)."""

    def layer(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)
        opened = (q.abs().float().mean(-1).amax(-1) - threshold).clamp_min(0)  # (B, H)
        return out + opened[..., None, None].to(out.dtype), weights

    return layer


@pytest.mark.parametrize("dtype, gain", [(torch.float32, 1000.0), (torch.float16, 100.0)], ids=str)
def test_a_leak_that_opens_only_past_a_third_of_the_push_is_caught_and_one_past_three_times_it_is_not(dtype, gain):
    """query_locality pushes one query to `gain` times a fresh draw (|x + g (n - x)| averages 1.13 g over the
    features): a gate at 0.3 g opens, one at 3 g stays shut (the reference then), so a gain 10x smaller misses
    the first and one 10x larger opens the second."""
    caught = verdict(leaks_past(0.3 * gain), "query_locality", dtype=dtype)
    shut = verdict(leaks_past(3 * gain), "query_locality", dtype=dtype)
    assert caught.verdict == "fail", caught
    assert shut.verdict == "pass", shut
    assert f"x{gain:g}" in caught.evidence


# ---- GRADIENT_AGREEMENT: gradients -------------------------------------------------------------


class ScaledBackward(torch.autograd.Function):
    """The identity forward; the backward multiplies the gradient by `factor` (a hand-written backward off by
    a chosen relative error)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def backward_off_by(error: float, ratio: float = 1.0):
    def layer(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask, ratio=ratio)
        return ScaledBackward.apply(out, 1.0 + error), weights

    return layer


@pytest.mark.parametrize("ratio", [1.0, 30.0], ids=["scaled", "logits x30"])
def test_a_backward_off_by_a_quarter_of_the_agreement_passes_and_by_four_times_it_fails(ratio):
    """The disagreement gradients reads is linear in the backward's error (a fixed direction, float64): it is
    measured at a large error, then the twins are placed at INSIDE and OUTSIDE x GRADIENT_AGREEMENT. Logits 30x
    too sharp pin the finite differences' step (eps 1e-4): at 1e-3 their truncation error (6e-10 on the correct
    layer) raises the noise allowance to 1.7e-8 and the outside twin passes (measured)."""
    calibration = verdict(backward_off_by(1e-3, ratio), "gradients")
    assert calibration.verdict == "fail", calibration
    per_unit = calibration.value / 1e-3
    correct = verdict(backward_off_by(0.0, ratio), "gradients")
    inside = verdict(backward_off_by(INSIDE * GRADIENT_AGREEMENT / per_unit, ratio), "gradients")
    outside = verdict(backward_off_by(OUTSIDE * GRADIENT_AGREEMENT / per_unit, ratio), "gradients")
    assert correct.verdict == "pass" and correct.value < INSIDE * GRADIENT_AGREEMENT, correct
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail", outside
    assert outside.value == pytest.approx(OUTSIDE * GRADIENT_AGREEMENT, rel=0.2)
    # printed with the digits that tell them apart (6 would print a disagreement of 4e-9 as two equal numbers)
    told = re.search(r"autograd gives (\S+) and extrapolated central differences (\S+):", outside.evidence)
    assert told and told.group(1) != told.group(2) and len(told.group(1)) > 8, outside.evidence


# ---- the decode gain: its square root, its cap ------------------------------------------------------


def spread_logits(spread):
    """A function whose logits (what reaches the softmax) have exactly `spread` as each row's standard deviation
    over its keys, whatever q and k: fixed draws, standardised per row. `spread`: a number, or a function of the
    row's index in the flattened (B, H, Tq) rows."""

    def layer(q, k, v, mask=None):
        B, H, T, _ = q.shape
        z = torch.randn(B, H, T, k.shape[-2], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        z = (z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True)  # each row: mean 0, std 1
        rows = torch.arange(B * H * T, dtype=torch.float64).view(B, H, T, 1)
        scores = ((spread(rows) if callable(spread) else spread) * z).to(q.dtype)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        return weights @ v, weights

    return layer


def gain_for(spread, dtype=torch.float32) -> float:
    probe = Probe(make_subject(spread_logits(spread), d_model=16, num_heads=2, dtype=dtype), causal=False, scale=None,
                  seq_len=16, seed=0)
    return logit_gain(probe)


def test_the_decode_gain_reads_the_softmaxs_input_where_rounded_weights_would_hide_the_spread():
    """bfloat16 weights of logits 1e-3 apart (1/16 x (1 +- 1e-3), within one rounding of 1/16) all round alike: their
    log's spread is 0, which would ask the cap; the softmax's own input, observed, still spreads by 1e-3."""
    assert gain_for(1e-3, torch.bfloat16) == pytest.approx(math.sqrt(2.0 / 1e-3), rel=0.03)


def test_the_decode_gain_is_the_median_spread_over_every_row_of_the_probe():
    """Rows spread 0.01 x (1 + row): the 64 rows of the standard probe (B 2 x H 2 x T 16, fewer than the 512 read)
    have the median spread 0.01 x (1 + 31) (torch's median of an even count: the lower middle value)."""
    rows = 2 * 2 * 16
    median = 0.01 * (1 + (rows // 2 - 1))
    assert gain_for(lambda r: 0.01 * (1 + r)) == pytest.approx(math.sqrt(2.0 / median), rel=1e-6)


@pytest.mark.parametrize("spread", [0.02, 0.5, 2e-5, 8.0], ids=str)
def test_the_decode_gain_is_the_square_root_of_the_wanted_spread_over_the_seen_one_between_1_and_100(spread):
    """Logits grow as the square of the tokens: sqrt(2 / spread), capped at 100 (a spread of 2e-5 asks 316) and
    at least 1 (a spread of 8 asks 0.5)."""
    assert gain_for(spread) == pytest.approx(min(100.0, max(1.0, math.sqrt(2.0 / spread))), rel=1e-6)


def test_uniform_weights_get_the_cap_and_a_layer_without_weights_gets_10():
    assert gain_for(0.0) == 100.0
    def linear_attention(q, k, v, mask=None):  # no softmax, no weights returned: nothing to read a spread from
        return (q @ k.transpose(-2, -1) / q.shape[-2]) @ v

    probe = Probe(make_subject(linear_attention, d_model=16, num_heads=2), causal=False, scale=None, seq_len=16,
                  seed=0)
    assert logit_gain(probe) == 10.0


# ---- CACHE_NOISE_FACTOR: cache_decoding -------------------------------------------------------------


class LengthDependentDecoder(nn.Module):
    """A causal single-head decoder with a cache of its own (forward(x, kv_cache=None, use_cache=False) returns
    (out, (k, v)) when use_cache), whose outputs carry `per_token` times the length of the call (no cache) or of
    SEQ_LEN (with a cache): its first half alone differs from the full pass by a chosen recomputation noise,
    while its cached steps add `cache_error` on top. `window`: each query sees its last `window` keys only;
    `returns`: what a cached call returns, "cache" ((out, (k, v))), "weights" ((out, weights, (k, v)): its weights
    before its cache) or "nested" (((out,), weights, (k, v)): its output inside a tuple of its own)."""

    causal = True
    SEQ_LEN = 16

    def __init__(self, per_token=0.0, cache_error=0.0, d_model=8, window=None, returns="cache"):
        super().__init__()
        self.d_model, self.num_heads = d_model, 1
        self.per_token, self.cache_error, self.window, self.returns = per_token, cache_error, window, returns
        self.qkv = nn.Linear(d_model, 3 * d_model)
        torch.manual_seed(0)
        self.qkv.reset_parameters()

    def forward(self, x, kv_cache=None, use_cache=False):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, -1)  # (B, T, D) each
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], 1), torch.cat([kv_cache[1], v], 1)  # (B, Tk, D)
        t_k = k.shape[1]
        allowed = torch.ones(T, t_k, dtype=torch.bool).tril(t_k - T)  # bottom-right: query i sees j <= i + Tk - T
        if self.window:
            allowed &= ~torch.ones(T, t_k, dtype=torch.bool).tril(t_k - T - self.window)  # the last `window` keys
        weights = (q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, T, Tk)
        out = weights @ v
        out = out + self.per_token * (T if kv_cache is None else self.SEQ_LEN) + \
            (self.cache_error if kv_cache is not None else 0.0)
        if not use_cache:
            return out
        shapes = {"cache": (out, (k, v)), "weights": (out, weights, (k, v)), "nested": ((out,), weights, (k, v))}
        return shapes[self.returns]


def test_a_cache_off_by_twice_the_recomputation_noise_passes_and_by_six_times_it_fails():
    """With a noise above the row-sum tolerance, the allowed difference is CACHE_NOISE_FACTOR x the noise, which
    this test measures itself on the very tokens the detector decoded (its replay): the prefill of 8 alone
    against the full pass."""
    base = verdict(LengthDependentDecoder(per_token=1e-3), "cache_decoding", causal=True)
    assert base.verdict == "pass", base
    x = base.replay  # (B, T, D): the tokens cache_decoding decoded
    layer = LengthDependentDecoder(per_token=1e-3)
    with torch.no_grad():
        full, prefix = layer(x), layer(x[:, :8])
    rms = centred_rms(full)
    noise = float((prefix - full[:, :8]).abs().max()) / rms
    assert noise > 10 * ROW_SUM[torch.float32]  # the factor, not the row-sum floor, sets the tolerance
    assert base.threshold == pytest.approx(CACHE_NOISE_FACTOR * noise, rel=1e-3)
    inside = verdict(LengthDependentDecoder(1e-3, cache_error=0.5 * CACHE_NOISE_FACTOR * noise * rms),
                     "cache_decoding", causal=True)
    outside = verdict(LengthDependentDecoder(1e-3, cache_error=1.5 * CACHE_NOISE_FACTOR * noise * rms),
                      "cache_decoding", causal=True)
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail", outside


# ---- the model wing: FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR, relative errors ---------------------------


def golden_case(reference_error: float, test_error: float, dtype, *, scale: float = 1.0, golden: bool = True):
    """A float64 'golden' output, a reference off it by `reference_error` and a tested path off by `test_error`
    (both relative to the golden output's RMS, at one position), all times `scale`."""
    g = torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * scale
    rms = float(g.square().mean().sqrt())

    def off(e):
        x = g.clone()
        x[0, 2, 3] += e * rms
        return x

    judged = _tolerance.Golden(g if golden else None, off(reference_error) if golden else g, dtype)
    return judged.judge(off(test_error) if golden else off(test_error), "the tested path")


FUDGE = {torch.float32: 10.0, torch.float16: 10.0, torch.bfloat16: 2.0}


@pytest.mark.parametrize("dtype", list(FUDGE), ids=str)
def test_a_tested_path_within_the_fudge_times_the_reference_error_passes_and_past_it_fails(dtype):
    """A reference error 100x the floor, so that the fudge (10, bfloat16's 2) decides: half of it passes, twice
    fails; tenfold either way (of FUDGE or FUDGE_BY_DTYPE) crosses one."""
    ref = 100 * GOLDEN_FLOOR[dtype]
    fudge = FUDGE[dtype]
    inside = golden_case(ref, 0.5 * fudge * ref, dtype)
    outside = golden_case(ref, 2 * fudge * ref, dtype)
    assert inside[0] and not outside[0], (inside, outside)
    assert outside[2] == pytest.approx(fudge * ref + GOLDEN_FLOOR[dtype], rel=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_a_float64_copy_the_floor_alone_is_allowed(dtype):
    floor = GOLDEN_FLOOR[dtype]
    inside = golden_case(0.0, INSIDE * floor, dtype, golden=False)
    outside = golden_case(0.0, OUTSIDE * floor, dtype, golden=False)
    assert inside[0] and not outside[0], (inside, outside)
    assert inside[2] == floor


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3], ids=str)
def test_model_parity_errors_are_relative_to_the_outputs_rms(scale):
    """The same relative errors at std-0.02-like (1e-3) and large (1e3) outputs: the same verdicts and readings.
    An absolute error would pass everything at 1e-3 and fail everything at 1e3."""
    dtype, ref = torch.float32, 100 * GOLDEN_FLOOR[torch.float32]
    inside = golden_case(ref, 5 * ref, dtype, scale=scale)
    outside = golden_case(ref, 20 * ref, dtype, scale=scale)
    assert inside[0] and not outside[0], (inside, outside)
    assert outside[1] == pytest.approx(20 * ref, rel=1e-6)


def test_a_zero_output_is_measured_against_1_not_divided_by_zero():
    zero = torch.zeros(1, 4, 3, dtype=torch.float64)
    assert _tolerance.scale_of(zero) == 1.0
    moved = zero.clone()
    moved[0, 1, 2] = 3e-6
    assert _tolerance.worst_change(moved, zero, _tolerance.scale_of(zero)) == pytest.approx(3e-6)


# ---- cache_parity's schedules: the short-T prefill -------------------------------------------------


@pytest.mark.parametrize("T", range(4, 12))
def test_cache_parity_schedules_cover_every_token_and_keep_six_steps_from_t7_three_below(T):
    plans = schedules(T)
    steps = 6 if T >= 7 else 3  # tokens decoded one at a time after the prefill
    assert plans["steps of 1"] == [T - steps] + [1] * steps
    assert ("steps of 3" in plans) == (T >= 7)
    if T >= 7:
        assert plans["steps of 3"] == [T - 6, 3, 3]
    assert ("uneven" in plans) == (T >= 5)
    if T >= 5:  # three uneven steps, the last one at least a token (`T - a - b > 0`): never the two-step fallback
        assert len(plans["uneven"]) == 3 and len(set(plans["uneven"])) > 1, plans["uneven"]
    for name, plan in plans.items():
        assert sum(plan) == T and min(plan) >= 1, (name, plan)


# ---- KEY_DRAWS: keys_matter's redraws ------------------------------------------------------------------


class ValuesReadFromAttempt:
    """The reference, except that the values are ignored (the keys stand in for them) on keys_matter's first
    `blind` attempts: each attempt is two stacked calls (the changed inputs, and the null twin)."""

    def __init__(self, blind: int):
        self.blind, self.stacked = blind, 0

    def __call__(self, q, k, v, mask=None):
        if q.shape[0] > 2:  # a stacked call of keys_matter
            self.stacked += 1
            if self.stacked <= 2 * self.blind:
                v = k
        return attention(q, k, v, mask)


def test_keys_matter_draws_three_times_before_calling_an_input_ignored():
    """Values read from the third draw on: passed (over 3 draws); from the fourth: the values are ignored on all
    KEY_DRAWS = 3 draws, a finding. Tenfold fewer draws (0) measures nothing, tenfold more passes the second."""
    third = verdict(ValuesReadFromAttempt(blind=2), "keys_matter")
    fourth = verdict(ValuesReadFromAttempt(blind=3), "keys_matter")
    assert third.verdict == "pass" and "over 3 independent draws" in third.evidence, third
    assert (fourth.verdict, fourth.message) == ("fail", "the output does not depend on the values"), fourth
    assert "over 3 independent draws" in fourth.evidence
    once = verdict(attention, "keys_matter")  # the reference moves on the first draw: no redraw
    assert once.verdict == "pass" and "independent draws" not in once.evidence, once


# ---- FORWARD_MOVES and SHIFT_INERT: parameters_used ------------------------------------------------------


class WithInertParameter(nn.Module):
    """One-stream self-attention (forward(x, mask=None)) with one extra parameter that autograd never sees
    (read through .detach(), so its gradient is exactly zero): `through="output"` adds `size` x (x . p) to the
    output (the output does depend on p, by a chosen amount); `through="scores"` adds p x (SHIFT + spread x j / T)
    to the scores of key j (a per-row shift, which the softmax removes, plus a chosen spread over the keys)."""

    SHIFT = 0.025

    def __init__(self, through: str, size: float, d_model=16, num_heads=2):
        super().__init__()
        self.d_model, self.num_heads, self.through, self.size = d_model, num_heads, through, size
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.p = nn.Parameter(torch.randn(d_model if through == "output" else 1))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        if self.through == "scores":
            j = torch.arange(T, dtype=x.dtype) / T
            scores = scores + self.p.detach() * (self.SHIFT + self.size * j)  # the same for every row
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))
        if self.through == "output":
            out = out + self.size * (x @ self.p.detach()).unsqueeze(-1)
        return out


def test_a_detached_parameter_that_moves_the_output_by_4x_forward_moves_is_used_and_by_a_quarter_unused():
    """How far the output moves with the parameter is linear in `size` (float64 copy, fixed draws): measured at
    a tiny size (a finding, whose value is that move), then the twins are placed at INSIDE and OUTSIDE x
    FORWARD_MOVES. Moved more: the output depends on it, its gradient is cut (the gradients detector's
    finding), so parameters_used passes; moved less: unused."""
    calibration = verdict(WithInertParameter("output", 1e-13), "parameters_used")
    assert calibration.verdict == "fail", calibration
    per_unit = calibration.value / 1e-13
    used = verdict(WithInertParameter("output", OUTSIDE * FORWARD_MOVES / per_unit), "parameters_used")
    unused = verdict(WithInertParameter("output", INSIDE * FORWARD_MOVES / per_unit), "parameters_used")
    assert used.verdict == "pass" and "p: the output depends on it" in used.evidence, used
    assert (unused.verdict, unused.message) == ("fail", "the output does not depend on p"), unused
    assert unused.value == pytest.approx(INSIDE * FORWARD_MOVES, rel=1e-3)


SHIFT_INERT = 1e-9


def test_a_score_shift_constant_over_keys_to_a_quarter_of_shift_inert_is_explained_and_one_4x_off_is_not():
    """The change of the scores is p x (SHIFT + spread x j / T): its spread over a row divided by its largest
    value is spread / (SHIFT + spread), so the twins sit at INSIDE and OUTSIDE x SHIFT_INERT of that ratio (and
    move the output by far less than FORWARD_MOVES, so that the shift test decides)."""
    shift = WithInertParameter.SHIFT
    inert = verdict(WithInertParameter("scores", INSIDE * SHIFT_INERT * shift), "parameters_used")
    spread = verdict(WithInertParameter("scores", OUTSIDE * SHIFT_INERT * shift), "parameters_used")
    assert inert.verdict == "pass" and "p: zero gradient, and changing it shifts every row" in inert.evidence, inert
    assert (spread.verdict, spread.message) == ("fail", "the output does not depend on p"), spread
    assert spread.value < INSIDE * FORWARD_MOVES  # the forward pass did not decide it


# ---- the probes' own shape: which query query_locality moves, which key causal_alignment changes ------------


def one_way_leak(q, k, v, mask=None):
    """The reference, except that every other row reads the middle query (T // 2) at 1e-2: a leak out of one
    row only, which moving that very query shows and moving all the others does not."""
    out, weights = attention(q, k, v, mask)
    p = q.shape[-2] // 2
    leak = torch.ones(q.shape[-2], 1, dtype=q.dtype)
    leak[p] = 0.0
    return out + 1e-2 * leak * q[..., p:p + 1, :], weights


def test_query_locality_moves_the_middle_query_and_holds_every_other_row():
    caught = verdict(one_way_leak, "query_locality")
    assert caught.verdict == "fail" and "when only query t=8 changed" in caught.evidence, caught
    assert verdict(attention, "query_locality").verdict == "pass"


def top_left(q, k, v, mask=None):
    """Causal attention with the mask aligned top-left (query i sees keys j <= i): right while Tq == Tk, wrong
    once queries are the last Tq of Tk positions (cached decoding); the audit's causal mask is ignored."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril()  # top-left
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return weights @ v, weights


def bottom_right(q, k, v, mask=None):
    t_q, t_k = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)  # bottom-right
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return weights @ v, weights


def test_causal_alignment_fails_a_top_left_mask_and_passes_bottom_right():
    caught = verdict(top_left, "causal_alignment", causal=True)
    assert (caught.verdict, caught.message) == ("fail", "the newest query does not see the newest key (causal mask "
                                                        "misaligned or blocking the diagonal)"), caught
    assert caught.value <= caught.threshold == UNCHANGED[torch.float32]
    right = verdict(bottom_right, "causal_alignment", causal=True)
    assert right.verdict == "pass" and right.value > right.threshold, right


def test_gradients_of_a_layer_audited_causal_that_reads_the_future_fail_on_the_future_gradient():
    """Its gradient is right (finite differences agree): what fails is that past outputs send gradient to later
    inputs."""
    leak = verdict(lambda q, k, v, mask=None: attention(q, k, v), "gradients", causal=True)  # the mask ignored
    assert leak.verdict == "fail" and leak.message == ("the gradient lets the future in: past outputs send gradient "
                                                       "to later inputs"), leak
    assert (leak.value, leak.threshold) == (1.0, 0.0)  # a found / not-found reading: 1 found, none allowed
    assert verdict(with_(), "gradients", causal=True).verdict == "pass"  # the audit's causal mask applied


# ---- mask_honoured's hint: a layer that adds its mask ---------------------------------------------------


class MaskedSelfAttention(nn.Module):
    """forward(x, mask=None): `how` = "adds" adds the mask to the scores (a bool mask then shifts allowed logits
    by 1), "bool ignored" ignores bool masks and adds float ones x 100, "blocks" masks with masked_fill; "adds, NaN":
    adds it, and its first output value is NaN whatever the inputs; "adds, float shape": adds it, and given a float
    mask returns one position fewer. `reach`: the outputs of the queries from that position on are zeros (the layer
    drops them after attending), so changing key 0 moves the first `reach` rows only, while every query's weights
    reach it (`Probe.own_reach` reads the weights: a key the weights block is out of a query's reach, not counted)."""

    def __init__(self, how, d_model=16, num_heads=2, reach=None):
        super().__init__()
        self.d_model, self.num_heads, self.how, self.reach = d_model, num_heads, how, reach
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        if mask is not None:
            if self.how.startswith("adds"):
                scores = scores + mask
            elif self.how == "bool ignored":
                scores = scores if mask.dtype == torch.bool else scores + 100 * mask
            else:
                scores = scores.masked_fill(~mask, float("-inf"))
        out = self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))
        if self.reach is not None:
            out = torch.cat([out[:, :self.reach], torch.zeros_like(out[:, self.reach:])], 1)  # the rest dropped
        if self.how == "adds, NaN":
            out = out.clone()
            out[:, 0, 0] = float("nan")
        if self.how == "adds, float shape" and mask is not None and mask.dtype != torch.bool:
            out = out[:, :-1]
        return out


HINT = "the layer adds its mask to the scores"


def test_mask_honoured_says_a_layer_adds_its_mask_only_when_it_does_and_its_convention_is_not_declared():
    # undeclared, adding is right for additive masks: a declaration is needed (never FAIL), the behaviour named
    adds = verdict(MaskedSelfAttention("adds"), "mask_honoured")
    assert adds.verdict == "skip" and adds.declaration == "mask='additive'" and HINT in adds.message, adds
    declared = verdict(MaskedSelfAttention("adds"), "mask_honoured", mask="allowed")
    assert declared.verdict == "fail" and HINT not in declared.message, declared
    # bool masks ignored, additive floats honoured (x100): float masks act otherwise, so not "adds", but a declaration
    other = verdict(MaskedSelfAttention("bool ignored"), "mask_honoured")
    assert other.verdict == "skip" and other.declaration == "mask='additive'" and HINT not in other.message, other
    assert verdict(MaskedSelfAttention("bool ignored"), "mask_honoured", mask="allowed").verdict == "fail"
    assert verdict(MaskedSelfAttention("blocks"), "mask_honoured").verdict == "pass"
    # outputs the two masks cannot be compared on: no such words; with NaN in one place, honoured as additive floats
    # all the same (a declaration), with a row short for float masks, honoured in no other convention (the FAIL stays)
    for how, honoured in (("adds, NaN", True), ("adds, float shape", False)):
        unsure = verdict(MaskedSelfAttention(how), "mask_honoured")
        assert unsure.verdict == ("skip" if honoured else "fail") and HINT not in unsure.message, (how, unsure)
        assert bool(unsure.declaration) == honoured, (how, unsure)


def test_cache_decoding_takes_the_cache_after_the_weights_a_layer_returns():
    """_split_cache: the cache is the first returned thing that is not the weights ((B, Tq, Tk) floats)."""
    result = verdict(LengthDependentDecoder(returns="weights"), "cache_decoding", causal=True)
    assert result.verdict == "pass" and "through kv_cache (the cache it returns)" in result.evidence, result


def test_cache_decoding_says_a_cached_call_returned_no_output_first():
    """_split_cache: what a cached call returns must start with the output; a tuple that starts with anything else is
    read as no output (a skip that says what came back), never taken for it."""
    result = verdict(LengthDependentDecoder(returns="nested"), "cache_decoding", causal=True)
    assert result.verdict == "skip" and "(ValueError: returned tuple with no (B, 8, D) output first)" in result.message


def test_cache_decoding_under_a_window_decodes_alone_the_tokens_where_the_cache_fills_and_rolls_over():
    """Under sliding_window(4) at T = 16: a prefill of 3, then t = 3, 4, 7 and 8 each alone (the cache fills to the
    window at 4, a cache of 4 slots rolls over at 4 and 8), the tokens between them in calls of several."""
    result = verdict(LengthDependentDecoder(window=4), "cache_decoding", causal=True,
                     pattern=diagnostics.patterns.sliding_window(4))
    assert result.verdict == "pass", result
    assert "single tokens at t=3, 4, 7, 8," in result.evidence, result


# ---- the mask hints' MOVED and guard: which convention a layer behaves as if it took ------------------------------


def hints(layer, *, seq_len=16, **subject):
    return honoured_conventions(Probe(make_subject(layer, **subject), causal=False, scale=None, seq_len=seq_len,
                                      seed=0))


def test_a_convention_counts_when_changing_an_allowed_key_moves_half_the_rows_that_see_it():
    """MOVED = 0.5: key 0 read by 8 of 16 queries (half): the additive convention is honoured; by 4 of 16 (a
    quarter, above a tenth of MOVED): no convention."""
    half, quarter = hints(MaskedSelfAttention("adds", reach=8)), hints(MaskedSelfAttention("adds", reach=4))
    assert [str(c) for c, _ in half] == ["additive"] and "moved 16 of 32 rows that see it" in half[0][1], half
    assert quarter == [], quarter


def test_no_convention_is_hinted_where_it_was_declared_or_nothing_can_be_read():
    """honoured_conventions' guard: a convention the user declared, or a probe of one token (no key can be blocked
    beside key 0): nothing to hint, where the same layer undeclared at 16 tokens, or 2, is hinted."""
    adds = MaskedSelfAttention("adds")
    assert [str(c) for c, _ in hints(adds)] == ["additive"]
    assert [str(c) for c, _ in hints(adds, seq_len=2)] == ["additive"]
    assert hints(adds, mask="allowed") == []
    assert hints(adds, seq_len=1) == []


# ---- keys_matter's ROUNDING_BOUND: when a null twin call is needed ---------------------------------------


class FaintValues:
    """The reference with values read at a chosen strength (out = w @ (k + faint x v)), counting keys_matter's
    stacked calls."""

    def __init__(self, faint: float):
        self.faint, self.stacked = faint, 0

    def __call__(self, q, k, v, mask=None):
        self.stacked += q.shape[0] > 2
        return attention(q, k, k + self.faint * v, mask)


def test_keys_matter_calls_its_null_twin_only_below_ten_times_the_unchanged_tolerance():
    """A stream that moved the output by more than ROUNDING_BOUND (10) x UNCHANGED needs no null twin: values read
    at a strength that moves the output by 30x pass in one stacked call, at 3x in two (the twin tells rounding
    from a real move). The move is linear in the strength: measured at a large one first."""
    tol, bound = UNCHANGED[torch.float32], 10.0
    calibration = FaintValues(1e-2)
    measured = verdict(calibration, "keys_matter")
    per_unit = measured.value / 1e-2  # the values' move: the smaller of the two streams'
    plain, faint = FaintValues(3 * bound * tol / per_unit), FaintValues(0.3 * bound * tol / per_unit)
    assert verdict(plain, "keys_matter").verdict == "pass" and plain.stacked == 1
    assert verdict(faint, "keys_matter").verdict == "pass" and faint.stacked == 2


def masks_the_future_itself(q, k, v, mask=None):
    return bottom_right(q, k, v)


def test_undeclared_causality_warns_that_a_layer_audited_as_not_causal_masks_the_future():
    hint = verdict(masks_the_future_itself, "undeclared_causality")
    assert hint.verdict == "warn" and hint.message == ("every weight above the diagonal is exactly 0 though no mask "
                                                       "was passed: it masks the future itself: a causal layer, whose "
                                                       "causality this audit does not check"), hint
    assert hint.extras["suggests"] == {"causal": True}  # the declaration it names, as data (the diffusers sweep reads it)
    assert verdict(attention, "undeclared_causality").verdict == "pass"
