"""Skipped is not passed, and a crash is not a skip: for every detector, a layer that raises inside that
detector's own probe (and nowhere else) and a layer that does not respond, each with its exact verdict and
reason; the crash rule (the user's exception is a finding, ours an error); the NaN-spreading branch of
fully_masked_rows; relative_change against a zero scale.

Each raising layer is the reference except on the calls `when` picks out (the detector's own probe shape,
read from the calls a passing audit makes: a stacked batch, Tq != Tk, a padding mask, a float64 copy, the
n-th call), so every other call of the audit still runs and the skip is that detector's guard, no other.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from correct import MultiHeadAttention
from diagnostics._core import relative_change
from diagnostics._registry import Detector, run
from diagnostics.detectors import weights as weights_module

RAISED = "the layer's own error"
NOT_RUN = f"not measured: the layer raised on this detector's probe (ValueError: {RAISED}); see `runs`"


def attention(q, k, v, mask=None):
    """Scaled dot-product attention on (B, H, T, d) with a plain softmax, returning (out, weights)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights


class RaisesWhen:
    """The reference, raising ValueError(RAISED) on the calls `when(call_number, q, k, v, mask)` picks."""

    def __init__(self, when):
        self.when, self.calls = when, 0

    def __call__(self, q, k, v, mask=None):
        self.calls += 1
        if self.when(self.calls, q, k, v, mask):
            raise ValueError(RAISED)
        return attention(q, k, v, mask)


def result_of(layer, detector: str, **kw):
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


# compare() stacks baseline and perturbations; a batch of one is refused too, else the audit makes a stack the layer
# refuses in parts of the standard probe's batch (Probe._in_batches: a row alone must come out as in a part)
STACKED = lambda n, q, k, v, m: q.shape[0] != 2  # noqa: E731
CROSS = lambda n, q, k, v, m: q.shape[-2] != k.shape[-2]  # noqa: E731
PADDED = lambda n, q, k, v, m: m is not None and not bool(m.all())  # noqa: E731
IDENTICAL_VALUES = lambda n, q, k, v, m: bool((v == v[..., :1, :]).all())  # noqa: E731
NO_KEY = lambda n, q, k, v, m: m is not None and bool((~m).all(-1).any())  # noqa: E731
FLOAT64 = lambda n, q, k, v, m: q.dtype == torch.float64  # noqa: E731
ALWAYS = lambda n, q, k, v, m: True  # noqa: E731
SECOND = lambda n, q, k, v, m: n == 2  # noqa: E731
AFTER_FIRST = lambda n, q, k, v, m: n > 1  # noqa: E731

# detector: (when its own probe is called, audit options)
OWN_PROBE = {
    "output_shape": (CROSS, {"cross": True}),  # declared: a layer not declared cross is audited as self-only
    "finite_output": (ALWAYS, {}),
    "weight_row_sums": (PADDED, {}),
    "softmax_saturation": (ALWAYS, {}),
    "output_variance": (IDENTICAL_VALUES, {}),
    "query_locality": (STACKED, {}),
    "mask_honoured": (STACKED, {}),
    "fully_masked_rows": (NO_KEY, {}),
    "future_leakage": (STACKED, {"causal": True}),
    "causal_alignment": (CROSS, {"causal": True}),
    # its own probe: batch_independence's call, and where that raised, the standard probe again
    "eval_determinism": (AFTER_FIRST, {}),
    "batch_independence": (SECOND, {}),
    "keys_matter": (STACKED, {}),
    "decode_consistency": (CROSS, {"causal": True}),
}


@pytest.mark.parametrize("detector", list(OWN_PROBE))
def test_a_layer_that_raises_on_the_detectors_own_probe_is_not_measured_and_says_so(detector):
    when, options = OWN_PROBE[detector]
    layer = RaisesWhen(when)
    result = result_of(layer, detector, **options)
    if detector == "output_shape":  # its standard probe ran: the other shape is named
        assert result.verdict == "skip", result
        assert result.message == (f"not measured: query length 16, memory length 19: the layer raised (ValueError: "
                                  f"{RAISED}); see `runs`")
    else:
        assert (result.verdict, result.message) == ("skip", NOT_RUN), result
    twin = result_of(attention, detector, **options)  # the same inputs, nothing raised: measured
    assert twin.verdict in ("pass", "warn"), twin


def test_the_raising_probes_are_the_detectors_own_and_no_other():
    """Each `when` above fires on a call a passing audit of that detector makes: the raising layer's
    predicate, replayed over the calls of the reference's audit, picks at least one of them and not all."""
    for detector, (when, options) in OWN_PROBE.items():
        seen = []

        def recording(q, k, v, mask=None):
            seen.append((q, k, v, mask))
            return attention(q, k, v, mask)

        diagnostics.audit(recording, detectors=[detector], **options)
        picked = [when(n, *call) for n, call in enumerate(seen, start=1)]
        assert any(picked), detector
        assert not all(picked) or when is ALWAYS, detector


def test_runs_fails_naming_the_shape_the_layer_raised_on():
    layer = RaisesWhen(lambda n, q, k, v, m: q.shape[0] == 1)
    result = result_of(layer, "runs")
    assert result.verdict == "fail" and result.message == "the layer raised on 1 of the audit's probes", result
    assert result.evidence.startswith(f"B=1: ValueError: {RAISED}")
    assert result_of(attention, "runs").verdict == "pass"


def test_gradients_and_parameters_used_skip_a_layer_that_does_not_run_in_float64():
    result = result_of(RaisesWhen(FLOAT64), "gradients")
    assert result.verdict == "skip", result
    assert result.message.startswith(f"not measured: the layer does not run as a float64 copy (ValueError: {RAISED})")
    module = Float64Refused(16, 2)
    used = result_of(module, "parameters_used")
    assert used.verdict == "skip", used
    assert used.message.startswith("not measured: the layer does not run with autograd as a float64 copy "
                                   f"(ValueError: {RAISED})")
    used = result_of(Float64Refused(16, 2, refuse=False), "parameters_used", seq_len=32)
    assert used.verdict == "pass", used
    # its probe length is the gradient checks' own (6 tokens: one forward and backward for both), not the audit's
    # seq_len; the forward before it reads those tokens' gain (gradient_gain)
    assert [(p.t_q, p.t_k, p.backward) for p in used.probes] == [(6, 6, False), (6, 6, True)], used.probes


class RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError(RAISED)


def test_a_backward_that_raises_is_a_gradients_finding():
    result = result_of(lambda q, k, v, mask=None: (RaisingBackward.apply(attention(q, k, v, mask)[0]),), "gradients")
    assert (result.verdict, result.message) == ("fail", "the backward pass (or the float64 copy) raised: ValueError")
    assert result.evidence == RAISED


class BackwardOnce(torch.autograd.Function):
    """The identity, with a correct backward that frees what it kept: it cannot run twice on one graph."""

    @staticmethod
    def forward(ctx, x):
        ctx.kept = x.shape
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        del ctx.kept  # AttributeError the second time
        return grad


@pytest.mark.parametrize("once", [False, True], ids=["walked twice", "a backward that runs once"])
def test_the_future_gradient_of_a_backward_that_runs_once_is_read_from_a_fresh_graph(once):
    """A causal audit's second backward (outputs up to the middle) walks the graph the first kept; where the layer's
    backward cannot run twice, a fresh forward gives it one, so a correct layer passes either way, and the check
    still reads it (a backward that lets the future in fails through the same path: test_thresholds)."""
    wrap = BackwardOnce.apply if once else (lambda x: x)
    result = result_of(lambda q, k, v, mask=None: (wrap(attention(q, k, v, mask)[0]),), "gradients", causal=True)
    assert (result.verdict, result.message) == ("pass", "gradients agree with finite differences and do not flow "
                                                        "from the past to the future"), result


class Float64Refused(nn.Module):
    """One-stream self-attention module (forward(x, mask=None)); `refuse`: raises on float64 inputs."""

    def __init__(self, d_model, num_heads, refuse=True):
        super().__init__()
        self.d_model, self.num_heads, self.refuse = d_model, num_heads, refuse
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        if self.refuse and x.dtype == torch.float64:
            raise ValueError(RAISED)
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        out, _ = attention(q, k, v, mask)
        return self.out(out.transpose(1, 2).reshape(B, T, D))  # (B, H, T, d) -> (B, T, D)


class RaisingSelfAttention(Float64Refused):
    """Causal one-stream module that raises on the calls `when(call_number)` picks."""

    causal = True

    def __init__(self, when):
        super().__init__(16, 2, refuse=False)
        self.when, self.calls = when, 0

    def forward(self, x, mask=None):
        self.calls += 1
        if self.when(self.calls):
            raise ValueError(RAISED)
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        return super().forward(x, causal if mask is None else mask & causal)


def test_causal_alignment_of_a_one_stream_layer_that_raises_is_not_measured():
    result = result_of(RaisingSelfAttention(lambda n: True), "causal_alignment", causal=True)
    assert (result.verdict, result.message) == ("skip", NOT_RUN), result
    assert result_of(RaisingSelfAttention(lambda n: False), "causal_alignment", causal=True).verdict == "pass"


# ---- batch_independence: the third call, and randomness between calls --------------------------------


class MixesTheBatch:
    """Adds `mix` x the batch's mean to every sequence (mixing); raises on call `raise_on`; `noise`: adds a fresh
    draw of that size on every call (randomness one seed does not pin down)."""

    def __init__(self, mix=1.0, raise_on=None, noise=0.0):
        self.mix, self.raise_on, self.noise, self.calls = mix, raise_on, noise, 0

    def __call__(self, q, k, v, mask=None):
        self.calls += 1
        if self.calls == self.raise_on:
            raise ValueError(RAISED)
        out, weights = attention(q, k, v, mask)
        out = out + self.mix * out.mean(0, keepdim=True) + self.noise * torch.randn(out.shape)
        return out, weights


def test_batch_independence_third_call_raising_is_not_measured_and_a_mixing_layer_fails():
    result = result_of(MixesTheBatch(raise_on=3), "batch_independence")
    assert (result.verdict, result.message) == ("skip", NOT_RUN), result
    mixing = result_of(MixesTheBatch(), "batch_independence")
    assert mixing.verdict == "fail", mixing


def test_batch_independence_does_not_call_randomness_between_calls_mixing():
    class Unseeded(MixesTheBatch):
        def __call__(self, q, k, v, mask=None):
            out, weights = attention(q, k, v, mask)
            return out + 1e-2 * torch.randn(out.shape, generator=self.gen), weights

    layer = Unseeded(mix=0.0)
    layer.gen = torch.Generator().manual_seed(0)  # a generator of its own: the audit's seeding does not reach it
    result = result_of(layer, "batch_independence")
    assert result.verdict == "skip", result
    assert result.message == ("not measured: two calls on the same batch differ, so a change between calls cannot "
                              "be attributed to the other sequence (see eval_determinism)")


# ---- layers that do not respond ----------------------------------------------------------------------


def constant(q, k, v, mask=None):
    """An output that depends on nothing: a fixed vector at every position."""
    bias = torch.linspace(-1.0, 1.0, q.shape[-1], dtype=q.dtype)
    return bias.expand(*q.shape[:-1], q.shape[-1]).clone()


class ConstantModule(nn.Module):
    """One-stream module forward(x, mask=None) whose output is a fixed vector at every position."""

    def __init__(self, d_model=16, num_heads=2):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads

    def forward(self, x, mask=None):
        return constant(x, x, x, mask)


UNRESPONSIVE = {  # detector: (audit options, the skip's reason)
    "query_locality": ({}, "not measured: the output did not respond to the perturbation ("),
    "future_leakage": ({"causal": True}, "not measured: the output did not respond to later tokens at all, so its "
                                         "not moving proves nothing"),
    "batch_independence": ({}, "not measured: the output did not respond to the perturbation ("),
}


@pytest.mark.parametrize("detector", list(UNRESPONSIVE))
def test_a_layer_that_does_not_respond_is_not_measured_not_passed(detector):
    options, reason = UNRESPONSIVE[detector]
    result = result_of(constant, detector, **options)
    assert result.verdict == "skip" and result.message.startswith(reason), result
    assert result_of(attention, detector, **options).verdict == "pass"


def test_mask_honoured_of_a_one_stream_layer_that_does_not_respond_is_not_measured():
    """One stream: the changed keys are changed queries too, so both scenarios have rows a correct layer moves,
    and both stay silent."""
    result = result_of(ConstantModule(), "mask_honoured")
    assert (result.verdict, result.message) == ("skip", "not measured: the output did not respond to changed keys "
                                                        "with the padding and causal mask (not even the rows a correct "
                                                        "layer moves), so its not moving where the mask blocks them "
                                                        "proves nothing"), result
    assert result_of(Float64Refused(16, 2, refuse=False), "mask_honoured").verdict == "pass"


def test_mask_honoured_of_a_function_that_does_not_respond_is_not_measured():
    """A function's padding scenario has no rows a correct layer must move, so it is never silent; its causal
    scenario is. One silent scenario is enough to prove nothing (the mutation run found the skip could not fire
    here when it needed every scenario silent: a constant function passed)."""
    result = result_of(constant, "mask_honoured")
    assert result.verdict == "skip" and "with the causal mask" in result.message, result
    assert result_of(attention, "mask_honoured").verdict == "pass"


def test_keys_matter_fails_a_layer_that_reads_neither_keys_nor_values():
    result = result_of(constant, "keys_matter")
    assert (result.verdict, result.message) == ("fail", "the output does not depend on the keys or the values")
    assert result.value == 0.0
    assert result_of(attention, "keys_matter").verdict == "pass"


def zero(q, k, v, mask=None):
    return torch.zeros_like(q)


@pytest.mark.parametrize("detector, reason", [
    ("query_locality", "the output is zero or non-finite everywhere on this probe, so a change cannot be measured "
                       "against it"),
    ("keys_matter", "the output is zero or non-finite everywhere on this probe, so a change cannot be measured "
                    "against it"),
    ("eval_determinism", "the output is zero or non-finite everywhere, so a difference cannot be measured"),
    ("batch_independence", "the output is zero or non-finite everywhere, so a change cannot be measured"),
])
def test_an_output_that_is_zero_everywhere_is_not_measured(detector, reason):
    result = result_of(zero, detector)
    assert (result.verdict, result.message) == ("skip", f"not measured: {reason}"), result


def test_gradients_of_a_function_without_a_differentiable_path_are_not_applicable():
    result = result_of(constant, "gradients")
    assert (result.verdict, result.message) == ("skip", "not applicable: the layer has no trainable parameters and "
                                                        "no differentiable path"), result


class NoGrad(Float64Refused):
    def forward(self, x, mask=None):
        with torch.no_grad():
            return super().forward(x, mask)


def test_a_module_run_without_autograd_fails_gradients():
    result = result_of(NoGrad(16, 2, refuse=False), "gradients")
    assert (result.verdict, result.message) == ("fail", "no gradient reaches the output: attention runs without "
                                                        "autograd"), result
    assert result_of(Float64Refused(16, 2, refuse=False), "gradients").verdict == "pass"


# ---- cache_decoding's skips ---------------------------------------------------------------------------


class Decoder(nn.Module):
    """A causal single-head decoder with a cache of its own: forward(x, kv_cache=None, use_cache=False) returns
    (out, (k, v)) when use_cache. `raise_cached`: raises once a cache is passed; `no_cache`: returns none."""

    causal = True

    def __init__(self, raise_cached=False, no_cache=False, d_model=8):
        super().__init__()
        self.d_model, self.num_heads = d_model, 1
        self.raise_cached, self.no_cache = raise_cached, no_cache
        self.qkv = nn.Linear(d_model, 3 * d_model)

    def forward(self, x, kv_cache=None, use_cache=False):
        if not isinstance(kv_cache, tuple):  # None, or a dict the audit passes to be filled: not filled here
            kv_cache = None
        if self.raise_cached and kv_cache is not None:
            raise ValueError(RAISED)
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, -1)  # (B, T, D) each
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], 1), torch.cat([kv_cache[1], v], 1)  # (B, Tk, D)
        t_k = k.shape[1]
        allowed = torch.ones(T, t_k, dtype=torch.bool).tril(t_k - T)  # bottom-right
        out = (q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        return (out, None if self.no_cache else (k, v)) if use_cache else out


def test_cache_decoding_that_raises_once_a_cache_is_passed_is_not_measured():
    result = result_of(Decoder(raise_cached=True), "cache_decoding", causal=True)
    assert result.verdict == "skip", result
    assert result.message == (f"not measured: decoding through kv_cache raised after 8 tokens (ValueError: {RAISED}); "
                              f"the audit passes kv_cache=None, then what the layer returned (or a dict it fills)")
    assert result_of(Decoder(), "cache_decoding", causal=True).verdict == "pass"


def test_cache_decoding_of_a_layer_that_returns_no_cache_and_fills_no_dict_is_not_measured():
    result = result_of(Decoder(no_cache=True), "cache_decoding", causal=True)
    assert result.verdict == "skip", result
    assert result.message.startswith("not measured: called with kv_cache=None (and use_cache=True where it takes it) "
                                     "the layer returned no cache, and it did not fill a dict passed as kv_cache")


# ---- fully_masked_rows: the NaN that stays, and the NaN that spreads ----------------------------------


def spreading(q, k, v, mask=None):
    """A plain softmax (a row with no key is NaN), then every query of a sequence mixed in at weight 0: 0 x NaN
    is NaN, so the one empty row poisons its whole sequence."""
    out, weights = attention(q, k, v, mask)
    return out + 0.0 * out.sum(-2, keepdim=True), weights


def safe(q, k, v, mask=None):
    out, weights = attention(q, k, v, mask)
    return out.nan_to_num(0.0), weights.nan_to_num(0.0)


def test_fully_masked_rows_fails_nan_that_spreads_warns_nan_that_stays_and_passes_zeros():
    T, H = 16, 2  # the audit's defaults: seq_len 16, the function form's 2 heads
    spread = result_of(spreading, "fully_masked_rows")
    assert (spread.verdict, spread.message) == ("fail", "NaN spreads beyond the query whose every key is masked")
    assert spread.value == H * T - H  # every row of sequence 0 (each head) but the empty query's own
    stays = result_of(attention, "fully_masked_rows")
    assert (stays.verdict, stays.message) == ("warn", "a query whose every key is masked gets NaN (torch's SDPA gives "
                                                      "zeros)")
    assert result_of(safe, "fully_masked_rows").verdict == "pass"


def test_fully_masked_rows_that_raises_on_its_empty_row_is_not_measured():
    result = result_of(RaisesWhen(NO_KEY), "fully_masked_rows")
    assert (result.verdict, result.message) == ("skip", NOT_RUN)


# ---- the crash rule ---------------------------------------------------------------------------------


def users_code(probe):
    raise ValueError("raised in the user's code")


def test_an_exception_raised_in_the_users_code_is_a_finding_one_raised_in_ours_is_an_error(monkeypatch):
    det = Detector("crash_probe", "raises", (), "fix", users_code, (), None, "not located", "layer")
    found = run(det, object())  # a check with no needs is called on any context
    assert (found.verdict, found.message) == ("fail", "the layer raised on this detector's probe (ValueError: raised "
                                                      "in the user's code)")
    monkeypatch.setattr(weights_module, "ROW_SUM", {})  # tolerance() then raises KeyError inside diagnostics
    result = result_of(attention, "weight_row_sums")
    assert result.verdict == "error" and result.message.startswith("the detector crashed: KeyError"), result
    assert "an internal error of diagnostics" in result.evidence


# ---- relative_change against a zero scale -------------------------------------------------------------


def test_relative_change_against_a_zero_scale_is_none_not_a_division_by_zero():
    zeros = torch.zeros(2, 4, 3)
    assert relative_change(zeros, zeros) is None
    assert relative_change(zeros + 1.0, zeros, scale=0.0) is None
    moved = zeros.clone()
    moved[0, 1, 2] = 2.0
    change = relative_change(moved, zeros)  # the baseline is zero: measured against the new output's RMS
    rms = float(moved.square().mean().sqrt())
    assert change is not None and torch.isfinite(change).all()
    assert float(change.max()) == pytest.approx(2.0 / rms)
    assert float(change[0, 1]) == pytest.approx(2.0 / rms) and float(change.sum()) == pytest.approx(2.0 / rms)


# ---- a layer that raises on every call ------------------------------------------------------------------

MEASURED_ON_A_CAUSAL_FUNCTION = ["output_shape", "finite_output", "weight_row_sums", "softmax_saturation",
                                 "output_variance", "query_locality", "mask_honoured", "blocked_keys_absent",
                                 "fully_masked_rows",
                                 "future_leakage", "causal_alignment", "eval_determinism", "batch_independence",
                                 "keys_matter", "decode_consistency"]


def test_a_layer_that_raises_on_every_call_fails_runs_and_every_other_detector_says_it_measured_nothing():
    """Each detector's first call is its guard's: the standard probe (finite_output, softmax_saturation,
    eval_determinism, causal_alignment, decode_consistency's gain), or its own probe."""
    report = diagnostics.audit(RaisesWhen(ALWAYS), causal=True)
    assert report.result("runs").verdict == "fail"
    for detector in MEASURED_ON_A_CAUSAL_FUNCTION:
        result = report.result(detector)
        assert (result.verdict, result.message) == ("skip", NOT_RUN), (detector, result)
    assert report.result("gradients").message.startswith("not measured: the layer does not run as a float64 copy")
    # relative_positions' guard is its own probe (the keys' positions permuted): not run, like those above; the
    # twin below has no positions, so there it is not applicable
    assert (report.result("relative_positions").verdict, report.result("relative_positions").message) == ("skip", NOT_RUN)
    others = [r for r in report.results
              if r.detector not in MEASURED_ON_A_CAUSAL_FUNCTION + ["runs", "gradients", "relative_positions"]]
    assert all(r.verdict == "skip" and r.message.startswith("not applicable: ") for r in others), others
    twin = diagnostics.audit(attention, causal=True)
    assert all(twin.result(d).verdict in ("pass", "warn") for d in MEASURED_ON_A_CAUSAL_FUNCTION), str(twin)


# ---- the other skips and edges of single detectors ----------------------------------------------------


class OddDecoder(Decoder):
    """Decoder whose full pass has no row per token (`rows`: returns its output transposed), or which refuses
    several new tokens at once through its cache (`one_at_a_time`), as some decoders do."""

    def __init__(self, rows=True, one_at_a_time=False):
        super().__init__()
        self.rows, self.one_at_a_time = rows, one_at_a_time

    def forward(self, x, kv_cache=None, use_cache=False):
        if self.one_at_a_time and isinstance(kv_cache, tuple) and x.shape[1] > 1:
            raise ValueError("one new token at a time")
        result = super().forward(x, kv_cache, use_cache)
        return result if self.rows or use_cache else result.transpose(1, 2)


def test_cache_decoding_skips_a_full_pass_without_a_row_per_token_and_decodes_refused_steps_one_at_a_time():
    no_rows = result_of(OddDecoder(rows=False), "cache_decoding", causal=True)
    assert (no_rows.verdict, no_rows.message) == ("skip", "not measured: the output (2, 8, 16) has no row per token "
                                                          "(see output_shape)"), no_rows
    stepwise = result_of(OddDecoder(one_at_a_time=True), "cache_decoding", causal=True)
    assert stepwise.verdict == "pass", stepwise
    assert "it raised on 3 new tokens at once (ValueError), so those were decoded one at a time" in stepwise.evidence


def ignores_the_mask(q, k, v, mask=None):
    return attention(q, k, v)


def test_gradients_fail_a_layer_whose_masked_keys_receive_gradient():
    leak = result_of(ignores_the_mask, "gradients")
    assert (leak.verdict, leak.message) == ("fail", "masked keys receive gradient: the mask is applied after the "
                                                    "softmax normalised over them, or not at all"), leak
    assert (leak.value, leak.threshold) == (1.0, 0.0)  # a found / not-found reading: 1 found, none allowed
    assert result_of(attention, "gradients").verdict == "pass"


@pytest.mark.parametrize("T", [7, 8])
def test_keys_matter_packs_keys_and_values_into_one_copy_from_8_positions(T):
    result = result_of(attention, "keys_matter", seq_len=T)
    packed = T >= 8  # PACKED_KEYS
    assert result.verdict == "pass", result
    assert ("changing every key of sequence 0" in result.evidence) == packed, result.evidence
    assert ("changing every value of sequence 1" in result.evidence) == packed


def test_runs_probes_only_the_shapes_no_other_chosen_detector_probes():
    """Alone, runs calls Tq != Tk (a function has separate streams), a padding mask and non-contiguous inputs itself;
    in a full audit output_shape, weight_row_sums and output_variance call those, and runs does not call them twice."""
    alone = result_of(attention, "runs")
    assert alone.message.startswith("ran on its 7 shapes (the standard probe (B=2, T=16), B=1, T=1, H=1, Tq=16, "
                                    "Tk=19, a padding mask, non-contiguous inputs)"), alone
    full = diagnostics.audit(attention).result("runs")
    assert full.message.startswith("ran on its 4 shapes (the standard probe (B=2, T=16), B=1, T=1, H=1) and on every "
                                   "other detector's probe ("), full
    # non-contiguous inputs: output_variance's identical values are laid out so
    assert "calls in all; non-contiguous inputs in output_variance's (identical value rows, non-contiguous inputs))" \
        in full.message, full
    module = result_of(Float64Refused(16, 2, refuse=False), "runs")  # one stream: no Tq != Tk
    assert "Tq=" not in module.message and module.verdict == "pass", module


def keys_as_queries(q, k, v, mask=None):
    """Queries and keys swapped (the queries serve as values too): the output has a row per key."""
    return attention(k, q, q)


def test_output_shape_replays_exactly_the_calls_whose_output_had_the_wrong_shape():
    result = result_of(keys_as_queries, "output_shape")
    assert result.verdict == "fail", result
    assert [tuple(c.key.shape) for c in result.replay] == [(2, 2, 19, 8)]  # the Tq != Tk call, not the standard


def hand_softmax(q, k, v, mask=None, *, heads_averaged=False):
    """A softmax written out (exp / sum, which the audit does not observe as a softmax); returns its weights per
    head, or averaged over heads ((B, Tq, Tk), which cannot be fitted against each head's q and k)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    weights = e / e.sum(-1, keepdim=True)
    return weights @ v, weights.mean(1) if heads_averaged else weights


def test_softmax_saturation_fits_returned_weights_per_head_and_skips_weights_of_another_shape():
    fitted = result_of(hand_softmax, "softmax_saturation")
    assert fitted.verdict == "pass" and fitted.value == pytest.approx(1.0, abs=1e-3), fitted
    averaged = result_of(lambda q, k, v, mask=None: hand_softmax(q, k, v, heads_averaged=True), "softmax_saturation")
    assert (averaged.verdict, averaged.message) == ("skip", "not measured: no softmax over q·k and no fused attention "
                                                            "call was observed, and no weights to fit"), averaged


def negative_weights(q, k, v, mask=None):
    """Weights 2 softmax - 1 / Tk: rows still sum to 1 (identical values come out unchanged), but some weights
    are negative, so outputs leave the range of the values."""
    out, weights = attention(q, k, v, mask)
    weights = 2 * weights - 1.0 / weights.shape[-1]
    return weights @ v, weights


def test_output_variance_fails_outputs_outside_the_range_of_the_values_that_identical_rows_miss():
    result = result_of(negative_weights, "output_variance")
    assert (result.verdict, result.message) == ("fail", "outputs leave the range of the values"), result
    assert result_of(attention, "output_variance").verdict == "pass"


@pytest.mark.parametrize("heads", [1, 2])
def test_weight_row_sums_names_the_head_axis_only_where_there_are_heads(heads):
    off = lambda q, k, v, mask=None: (lambda out, w: (out * 1.01, w * 1.01))(*attention(q, k, v, mask))  # noqa: E731
    result = diagnostics.audit(off, detectors=["weight_row_sums"], d_model=8 * heads, num_heads=heads)
    evidence = result.result("weight_row_sums").evidence
    assert ("worst row (b=" in evidence) and ((", h=" in evidence) == (heads > 1)) and ((", _=0" in evidence)
                                                                                        == (heads == 1)), evidence


# ---- the model wing's skips and findings -------------------------------------------------------------------


def protocol_gpt(**kw):
    from buggy_variants.teaching_model import ProtocolGPT

    torch.manual_seed(0)
    return ProtocolGPT(n_layer=2, **kw)


def model_result(model, detector: str, **kw):
    return diagnostics.audit_model(model, detectors=[detector], **kw).result(detector)


def test_sliding_window_off_by_one_fails_at_the_first_position_past_the_window_and_a_wide_window_is_not_measured():
    w = 5
    wider = model_result(protocol_gpt(sliding_window=w, layer_bugs={1: "window_off_by_one"}), "sliding_window")
    assert wider.verdict == "fail" and wider.layer == "h.1.attn", wider
    assert f"changing position 0 moved the output at t={w}" in wider.evidence  # t - s = w: just past the window
    assert model_result(protocol_gpt(sliding_window=w), "sliding_window").verdict == "pass"
    wide = model_result(protocol_gpt(sliding_window=40), "sliding_window")
    assert (wide.verdict, wide.message) == ("skip", "not measured: h.0.attn: window 40 >= seq_len 16, not measured; "
                                                    "h.1.attn: window 40 >= seq_len 16, not measured"), wide


def test_declared_window_reads_a_positive_int_only():
    from diagnostics.model.window import declared_window

    def module(**attrs):
        m = nn.Module()
        for name, value in attrs.items():
            setattr(m, name, value)
        return m

    config = type("Config", (), {"sliding_window": 4, "use_sliding_window": False})
    assert [declared_window(module(sliding_window=v)) for v in (3, 1, 0, -2, True, None, 2.0)] == \
        [3, 1, None, None, None, None, None]
    assert declared_window(module(config=config)) is None  # Qwen2's switch off
    config.use_sliding_window = True
    assert declared_window(module(config=config)) == 4


class DetachedOut(nn.Linear):
    """An output projection whose weight autograd never sees (its gradient: None)."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight.detach(), self.bias)


class ZeroedOut(nn.Linear):
    """An output projection whose weight's gradient is a tensor of exact zeros (read times 0, plus a copy)."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight.detach() + 0.0 * self.weight, self.bias)


def test_gradient_flow_names_every_parameter_without_gradient_and_the_first_layer_holding_one():
    model = protocol_gpt()
    layers = [block.attn for block in model.h]
    for attn, kind in zip(layers, (DetachedOut, ZeroedOut)):
        detached = kind(attn.out.in_features, attn.out.out_features)
        detached.load_state_dict(attn.out.state_dict())
        attn.out = detached
    total = sum(len(list(attn.parameters())) for attn in layers)
    result = model_result(model, "gradient_flow")
    assert (result.verdict, result.message) == ("fail", f"{len(layers)} of {total} attention parameters get no "
                                                        f"gradient"), result
    assert result.layer == "h.0.attn"
    assert model_result(protocol_gpt(), "gradient_flow").verdict == "pass"


def test_batch_invariance_pads_the_other_sequences_where_the_model_takes_a_mask():
    result = model_result(protocol_gpt(), "batch_invariance")
    assert (result.verdict, result.message) == ("pass", "a sequence alone gives its output between two sequences of "
                                                        "other lengths (right-padded)"), result


class CacheAddsAPosition(nn.Module):
    """ProtocolGPT whose cached calls return one position more than they were given (a stale token left in)."""

    causal = True

    def __init__(self):
        super().__init__()
        self.inner = protocol_gpt()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        out = self.inner(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        if use_cache and past_key_values and past_key_values[0]:
            logits, cache = out
            return torch.cat([logits[:, :1], logits], 1), cache
        return out


def test_cache_parity_fails_cached_outputs_of_another_shape():
    result = model_result(CacheAddsAPosition(), "cache_parity")
    assert result.verdict == "fail" and result.message.startswith("cached decoding returns (1, "), result
    assert "where the full pass returns (1, 16, 64)" in result.message
    assert model_result(protocol_gpt(), "cache_parity").verdict == "pass"


def test_eval_determinism_whose_standard_probe_raised_is_not_measured_though_the_second_call_runs():
    """The first call (the standard probe) raises and the second would run: the verdict comes from the guard on
    the standard probe, not from comparing with an output that does not exist."""
    result = result_of(RaisesWhen(lambda n, q, k, v, m: n == 1), "eval_determinism")
    assert (result.verdict, result.message) == ("skip", NOT_RUN), result


def rows_per_key_when_decoding(q, k, v, mask=None):
    """Causal attention whose output has a row per key once queries are fewer than keys (queries and keys
    swapped there)."""
    if q.shape[-2] == k.shape[-2]:
        return attention(q, k, v, mask)
    return attention(k, q, q)


def test_decode_consistency_skips_partial_calls_without_a_row_per_query():
    result = result_of(rows_per_key_when_decoding, "decode_consistency", causal=True)
    assert (result.verdict, result.message) == ("skip", "not measured: the output (2, 2, 16, 8) has no row per query "
                                                        "(see output_shape)"), result
    assert result_of(attention, "decode_consistency", causal=True).verdict == "pass"


class _Config:
    _attn_implementation = "eager"


def switchable(broken: bool, shorter: bool = False):
    """ProtocolGPT posing as a Hugging Face model (its class's module, a config with _attn_implementation, and
    set_attn_implementation), so that backend_parity runs without transformers; `broken`: its sdpa path scales
    the logits by 1.01; `shorter`: it returns one position fewer (a length computed from values that the
    implementations round apart, VITS')."""
    from buggy_variants.teaching_model import ProtocolGPT

    class Switchable(ProtocolGPT):
        def __init__(self):
            torch.manual_seed(0)
            super().__init__(n_layer=2)
            self.config, self.broken = _Config(), broken

        def set_attn_implementation(self, name):
            self.config = _Config()
            self.config._attn_implementation = name

        def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
            out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
            sdpa = self.config._attn_implementation == "sdpa"
            if shorter and sdpa:
                return out[:, :-1]
            return out * 1.01 if self.broken and sdpa else out

    Switchable.__module__ = "transformers.models.switchable.modeling_switchable"
    return Switchable()


def test_backend_parity_fails_implementations_that_disagree_and_passes_ones_that_agree():
    broken = model_result(switchable(True), "backend_parity")
    assert (broken.verdict, broken.message) == ("fail", "attention implementations disagree: sdpa against eager")
    assert broken.value > broken.threshold
    same = model_result(switchable(False), "backend_parity")
    assert (same.verdict, same.message) == ("pass", "eager and sdpa agree"), same
    assert same.value <= same.threshold


def test_backend_parity_of_outputs_of_another_length_is_not_measured_where_it_crashed():
    """VITS (transformers 5.25, whole sweep at 5a3f78e): backend_parity crashed, an internal error, comparing (1, 8448)
    with (1, 6144). Another length is said and not compared; the model that agrees (its twin above) passes."""
    other = model_result(switchable(False, shorter=True), "backend_parity")
    assert other.verdict == "skip" and other.message.startswith("not measured: the model returns (2, 16, 64) with "
                                                                "eager and (2, 15, 64) with sdpa"), other


class ViewsItsInput(torch.nn.Module):
    """The reference behind a projection that flattens its input with `.view` (GPT-2's Conv1D does `x.view(-1, D)`):
    correct on contiguous inputs, raising on others; `reshape=True` is its fix."""

    def __init__(self, reshape: bool):
        super().__init__()
        self.reshape = reshape
        self.attention = MultiHeadAttention(16, 2)

    def forward(self, query, key, value, mask=None):
        flat = query.reshape(-1, 16) if self.reshape else query.view(-1, 16)  # (B * T, D)
        return self.attention(flat.view_as(query), key, value, mask)


def test_a_layer_that_views_its_input_fails_runs_on_output_variances_non_contiguous_probe_and_is_still_measured():
    """In a full audit the non-contiguous probe is output_variance's call on identical tokens: the layer that raises
    there fails `runs` (its evidence names the probe), and output_variance measures it on the standard layout."""
    torch.manual_seed(0)
    broken = diagnostics.audit(ViewsItsInput(reshape=False).eval())
    runs = broken.result("runs")
    assert runs.verdict == "fail", runs
    assert runs.evidence.startswith("a memory of identical tokens, non-contiguous inputs (output_variance): RuntimeError: "
                                    "view size is not compatible"), runs.evidence
    assert broken.result("output_variance").verdict == "pass", broken.result("output_variance")
    assert set(broken.fired()) == {"runs"}, broken.fired()
    torch.manual_seed(0)
    fixed = diagnostics.audit(ViewsItsInput(reshape=True).eval())  # the same weights, reshape: every layout
    assert fixed.passed, fixed
    assert "non-contiguous inputs in output_variance's" in fixed.result("runs").message
    alone = diagnostics.audit(ViewsItsInput(reshape=False).eval(), detectors=["runs"]).result("runs")
    assert alone.verdict == "fail" and alone.evidence.startswith("non-contiguous inputs: RuntimeError: view size"), alone
