"""The detectors: one property of every correct attention layer each, measured from outside the layer
(and, where outside is blind, from the operations it was observed to run).

Each check takes a `Probe` and returns a `DetectorResult`; `@detector` registers it with what it needs of
the layer (`audit()` checks the needs before calling it). None of them knows any implementation: they ask
what every softmax attention must satisfy, whatever its code. The invariance checks ("this change must not
move those outputs") all go through the perturb-and-compare core in `_core.py`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ._core import (Case, Comparison, Inputs, _expand, allowed_text, baseline_scale, compare, held, not_run, perturbed,
                    relative_change, skip)
from ._observe import applied_scales
from ._probe import Call, Probe
from ._registry import CAUSAL, DETECTORS, HAS_CACHE, LONG, LONGER, SEPARATE_QUERY, TAKES_MASK, detector
from ._result import DetectorResult, ProbeShape
from ._thresholds import (MEASURED_ROW_SUM, MEASURED_SCALE_ERROR, ROW_SUM, SCALE_RATIO, UNCHANGED, dtype_name,
                          tolerance)

# ---- shared endings --------------------------------------------------------------------------------


def _result(det: str, verdict: str, message: str, **kw) -> DetectorResult:
    return DetectorResult(det, verdict, message, fix=kw.pop("fix", DETECTORS[det].fix if det in DETECTORS else ""),
                          **kw)


def _judge(det: str, failed: bool, fail_message: str, pass_message: str, **kw) -> DetectorResult:
    """The common ending: fail with one message or pass with the other, the same measurements either way."""
    return _result(det, "fail" if failed else "pass", fail_message if failed else pass_message, **kw)


def _judge_held(det: str, comparison: Comparison | DetectorResult, probe: Probe, *, what: str, fail_message: str,
                pass_message: str) -> DetectorResult:
    """The ending of every invariance check: fail if a held row moved; not measured if the layer did not
    respond even where a correct layer must; else pass."""
    if isinstance(comparison, DetectorResult):
        return comparison
    bad, worst, text, unresponsive = held(comparison, probe, what=what)
    if not bad and unresponsive:
        return skip(det, f"the output did not respond to the perturbation ({unresponsive}), so its not moving "
                         f"where it must not proves nothing")
    return _judge(det, bad > 0, fail_message, pass_message, value=worst, threshold=comparison.tol, evidence=text)


def _gains(probe: Probe) -> tuple[float, ...]:
    """How hard a perturbation pushes (see `perturbed`): 1000x a fresh draw, 100x in float16 (whose range
    ends at 65504). Rows that must not move do not move however hard the rest is pushed, while a bug that
    acts through the weights shows even where the initialisation keeps logits tiny: at GPT-2's std 0.02 and
    d_k = 1, a 100x key moves a logit by ~0.04, too little to show in bfloat16."""
    return (100.0,) if probe.subject.dtype == torch.float16 else (1000.0,)



def _rows(batch: int, t: int, where: Tensor) -> Tensor:
    """Bool (T,) or (B, T) -> (B, T)."""
    return where.expand(batch, t).clone() if where.dim() == 1 else where


# ---- the checks ------------------------------------------------------------------------------------


@detector("runs", "runs on every input shape the audit uses: the standard probe, B=1, T=1, H=1 (functions), "
          "non-contiguous inputs, Tq != Tk (cross-attention forms) and a mask (layers that take one)",
          targets=("view after transpose without .contiguous()", "shape assumptions"),
          fix="make the layer shape-agnostic: .contiguous() before .view(), or use .reshape()")
def check_runs(probe: Probe) -> DetectorResult:
    """Its own probes, one per input shape. `audit()` calls `runs_verdict` again once every detector has
    run, so that any other detector's probe that raised is reported here too: no failed call is dropped."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    probe.base()

    def run(label, batch, t_q, t_k=None, extra=None, **kw):
        q, k, v = probe.streams(batch, t_q, t_k, **kw)
        probe.call(q, k, v, probe.allowed(batch, t_q, t_k or t_q, extra), label=label)

    run("B=1", 1, T)
    run("T=1", B, 1)
    if s.form == "function":
        run("H=1", B, T, heads=1)
    # shapes another chosen detector calls anyway are not called twice: their raises reach runs_verdict
    if s.separate_kv and "output_shape" not in probe.chosen:
        run(f"Tq={T}, Tk={T + 3}", B, T, T + 3, cross=True)
    if s.takes_mask and "weight_row_sums" not in probe.chosen:
        run("a padding mask", B, T, extra=probe.padding(B, T, T))
    q, k, v = probe.streams(B, T)  # non-contiguous: the same values laid out transposed in memory
    nc = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
    nc = [nc[0]] * 3 if q is k else nc
    probe.call(*nc, probe.allowed(B, T, T), label="non-contiguous inputs")
    return runs_verdict(probe)


def runs_verdict(probe: Probe) -> DetectorResult:
    """`runs` judged on every call of the audit so far: its own, and every other detector's that raised."""
    det = "runs"
    own = probe.shapes[det]
    failed = _unique([(d, shape) for d, shape in probe.raised if d == det]
                     + [(d, shape) for d, shape in probe.raised if d != det])
    n_calls = sum(len(v) for v in probe.shapes.values())
    if failed:
        listed = "; ".join(f"{shape.label}{'' if d in (det, 'base') else f' ({d})'}: {shape.raised}"
                           for d, shape in failed)
        return _result(det, "fail", f"the layer raised on {len(failed)} of the audit's probes",
                       value=float(len(failed)), threshold=0.0, evidence=f"{listed} ({n_calls} calls in all)")
    return _result(det, "pass", f"ran on its {len(own)} shapes ({', '.join(shape.label for shape in own)}) and on "
                                f"every other detector's probe ({n_calls} calls in all)", value=0.0, threshold=0.0)


def _unique(failed):
    seen, out = set(), []
    for d, shape in failed:
        if id(shape) not in seen:
            seen.add(id(shape))
            out.append((d, shape))
    return out


@detector("output_shape", "output is (B, Tq, D), also when the memory length Tk differs from Tq",
          targets=("self/cross-attention inputs swapped",),
          fix="queries come from the decoder stream (query), keys and values from the memory")
def check_output_shape(probe: Probe) -> DetectorResult:
    det, s, B, T = "output_shape", probe.subject, probe.BATCH, probe.t
    base = probe.base()
    if not base.ok:
        return not_run(det, base)
    checks = [("the standard probe", base, s.expected_out_shape(B, T))]
    unmeasured = ""
    if s.separate_kv:
        t_k = T + 3  # Tq != Tk: a cross-attention (or cached-decoding) call
        q, k, v = probe.streams(B, T, t_k, cross=True)
        call = probe.call(q, k, v, probe.allowed(B, T, t_k), label=f"query length {T}, memory length {t_k}")
        if call.ok:
            checks.append((f"query length {T}, memory length {t_k}", call, s.expected_out_shape(B, T)))
        else:
            unmeasured = f"query length {T}, memory length {t_k}: the layer raised ({call.describe_error()}); see `runs`"
    wrong = [(label, tuple(c.output.out.shape), want) for label, c, want in checks if tuple(c.output.out.shape) != want]
    if wrong:
        text = "; ".join(f"{label}: output {got}, expected {want}" for label, got, want in wrong)
        return _result(det, "fail", "the output has the wrong shape", evidence=text)
    if unmeasured:
        return skip(det, unmeasured)
    return _result(det, "pass", "output shape is (B, Tq, ...) " + ", ".join(
        f"{tuple(c.output.out.shape)}" for _, c, _ in checks))


@detector("finite_output", "no NaN or inf on ordinary inputs", targets=("no softmax with -inf masks", "overflow"),
          fix="normalise with a softmax over keys; use a dtype-safe fill value")
def check_finite_output(probe: Probe) -> DetectorResult:
    det, base = "finite_output", probe.base()
    if not base.ok:
        return not_run(det, base)
    out = base.output.out
    bad = ~torch.isfinite(out)
    if bad.any():
        idx = tuple(int(i) for i in torch.unravel_index(bad.flatten().nonzero()[0, 0], out.shape))
        return _result(det, "fail", "the output has NaN or inf on an ordinary input",
                       value=float(bad.sum()), threshold=0.0,
                       evidence=f"{int(bad.sum())} / {out.numel()} output values are NaN/inf; first at {idx}")
    return _result(det, "pass", f"all {out.numel()} outputs are finite", value=0.0, threshold=0.0)


@detector("weight_row_sums", "weights are non-negative and each row sums to 1 over keys",
          targets=("no softmax", "softmax over the wrong axis", "mask after softmax", "dropout in eval"),
          fix="weights = softmax(masked scores, dim=-1)")
def check_weight_row_sums(probe: Probe) -> DetectorResult:
    det, s, B, T = "weight_row_sums", probe.subject, probe.BATCH, probe.t
    if s.takes_mask:  # blocked keys are where a mask applied after the softmax shows
        q, k, v = probe.streams(B, T)
        allowed = probe.allowed(B, T, T, probe.padding(B, T, T))
        call = probe.call(q, k, v, allowed, label="a padding mask", observe=True)
    else:
        call = probe.base()
    if not call.ok:
        return not_run(det, call)
    weights, source = probe.weights(call)
    if weights is None:
        call = probe.base()
        weights, source = probe.recovered_weights()
    if weights is None:
        return skip(det, "the layer returns no (..., Tq, Tk) weights, no softmax over them and no fused attention "
                         "call was observed (a function that accepts values of another width is read through v = I)")
    t_k = weights.shape[-1]  # Tk, plus any key the layer appends of its own (add_bias_kv)
    if weights.numel() % (B * T * t_k):
        return skip(det, f"weights of shape {tuple(weights.shape)} do not split into batch {B}")
    w = weights.double().reshape(B, -1, T, t_k)  # (B, heads or 1, Tq, Tk)
    allowed = call.allowed if call.allowed is not None else torch.ones(B, T, t_k, dtype=torch.bool)
    nonempty = allowed.to(w.device).any(-1).unsqueeze(1)  # (B, 1, Tq): rows with a key to attend
    tol = tolerance(ROW_SUM, s.dtype)
    sums = w.sum(-1)  # (B, heads, Tq)
    dev = (sums - 1).abs().nan_to_num(nan=math.inf)
    rows = nonempty.expand_as(dev)
    bad_rows = int((dev[rows] > tol).sum())
    negative = w < -tol
    total = int(rows.sum())
    worst = float(dev[rows].max()) if total else 0.0
    names = ("b", "h", "q") if w.shape[1] > 1 else ("b", "_", "q")
    if bad_rows or negative.any():
        parts = []
        if bad_rows:
            idx = tuple(int(i) for i in torch.unravel_index(torch.where(rows, dev, -1.0).argmax(), dev.shape))
            parts.append(f"{bad_rows} / {total} weight rows ({100 * bad_rows / total:.1f}%) do not sum to 1 over "
                         f"keys; worst row {_at(idx, names)} sums to {_number(float(sums[idx]))} "
                         f"(|sum - 1| up to {tol:.2g} allowed for {dtype_name(s.dtype)})")
        if negative.any():
            idx = tuple(int(i) for i in torch.unravel_index(w.argmin(), w.shape))
            parts.append(f"{int(negative.sum())} weights are negative, the least {_number(float(w.min()))} at "
                         f"{_at(idx, names + ('k',))}")
        return _result(det, "fail", f"attention weights are not a distribution over keys ({source})",
                       value=worst, threshold=tol, evidence="; ".join(parts))
    return _result(det, "pass", f"all {total} weight rows sum to 1 and no weight is negative ({source})",
                   value=worst, threshold=tol, margin=_row_sum_margin(s.dtype))


def _at(index: tuple[int, ...], names: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip(names, index)) + ")"


def _number(x: float) -> str:
    """A reading as a person writes it: inf and NaN by name, not 1.798e+308."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x) or abs(x) > 1e300:
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _row_sum_margin(dtype) -> str:
    measured = MEASURED_ROW_SUM.get(dtype)
    return f"correct layers measured <= {measured:.1e} at {dtype_name(dtype)}" if measured is not None else ""


def _log_weight_scale(weights: Tensor, q: Tensor, k: Tensor) -> list[tuple[float, int]]:
    """Fit log w = s * (q . k) + c per row for (B, H, Tq, Tk) weights of (B, H, T, d) q and k: [(s, d_k)]."""
    if q.dim() != 4 or tuple(weights.shape) != (q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
        return []
    qk = q.double() @ k.double().transpose(-2, -1)  # (B, H, Tq, Tk)
    logw = weights.double().log()
    ok = torch.isfinite(logw) & (weights > 0)
    if ok.sum() < 4:
        return []
    n = ok.sum(-1, keepdim=True).clamp_min(1)
    mean = lambda x: torch.where(ok, x, 0).sum(-1, keepdim=True) / n  # noqa: E731
    dq, dl = torch.where(ok, qk - mean(qk), 0), torch.where(ok, logw - mean(logw), 0)
    denom = float((dq * dq).sum())
    return [(float((dq * dl).sum()) / denom, int(q.shape[-1]))] if denom > 0 else []


@detector("softmax_saturation", "the softmax temperature: q·k is scaled by 1/sqrt(d_k) or the declared scale",
          targets=("missing 1/sqrt(d_k)", "scaled by sqrt(d_model)", "scale applied twice or inverted"),
          fix="scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  (d_k: the width of one head)")
def check_softmax_saturation(probe: Probe) -> DetectorResult:
    det, base = "softmax_saturation", probe.base()
    if not base.ok:
        return not_run(det, base)
    estimates = [(e.applied, e.d_k, e.source, e) for e in applied_scales(base.record)] if base.record else []
    if not estimates and probe.subject.form == "function":
        weights, source = ((base.output.weights, "returned weights") if base.output.weights is not None
                           else probe.recovered_weights())
        if weights is not None:
            estimates = [(s, d, f"log-weights vs q·k of the {source}", None)
                         for s, d in _log_weight_scale(weights, base.query, base.key)]
    if not estimates:
        return skip(det, "no softmax over q·k and no fused attention call was observed, and no weights to fit")
    rows = []
    for applied, d_k, source, estimate in estimates:
        expected = probe.scale if probe.scale is not None else 1.0 / math.sqrt(d_k)
        rows.append((applied / expected, applied, expected, d_k, source, estimate))
    ratio, applied, expected, d_k, source, estimate = max(rows, key=lambda r: abs(math.log(abs(r[0]) or 1e-300)))
    declared = "the declared scale" if probe.scale is not None else f"1/sqrt(d_k) (d_k={d_k})"
    evidence = (f"q·k is multiplied by {applied:.4g} before the softmax ({source}); expected {expected:.4g} = "
                f"{declared}; ratio {ratio:.3g} (allowed {1 / SCALE_RATIO:.2f} to {SCALE_RATIO:.2f})"
                f"{_entropy_text(base, ratio, expected, estimate)}")
    if ratio > SCALE_RATIO:
        return _result(det, "fail", f"softmax is {ratio:.2f}x too sharp: logits are not scaled by {declared}",
                       value=ratio, threshold=SCALE_RATIO, evidence=evidence)
    if ratio < 1 / SCALE_RATIO:
        return _result(det, "fail", f"softmax is {1 / ratio:.2f}x too flat: logits are scaled by more than {declared}",
                       value=ratio, threshold=1 / SCALE_RATIO, evidence=evidence)
    return _result(det, "pass", f"softmax temperature matches {declared} (ratio {ratio:.4f})", value=ratio,
                   threshold=SCALE_RATIO, evidence=evidence,
                   margin=f"correct layers measured |ratio - 1| <= {MEASURED_SCALE_ERROR:.1e}")


ENTROPY_ROWS = 512
"""Rows of weights the entropies are averaged over (the first ones: batch 0, head 0 first)."""


def _entropy_text(call: Call, ratio: float, expected: float, estimate) -> str:
    """The mean entropy of the weights the layer used (its last softmax), and of the weights a correct scale
    gives: softmax(expected * q·k) over the keys the layer gave weight, from the observed q·k matmul; without
    one, softmax(log w / ratio) (log w is the scaled logits shifted per row: exact for one softmax)."""
    if call.record is None or not call.record.softmaxes:
        return ""
    w = call.record.softmaxes[-1].output
    flat = w.reshape(-1, w.shape[-1])[:ENTROPY_ROWS].double()  # a sample of rows: a mean needs no more
    keep = (flat.sum(-1) > 0.5) & torch.isfinite(flat).all(-1)  # rows that attend somewhere
    if not bool(keep.any()):
        return ""

    def entropy(p: Tensor) -> float:
        return float(-(p * p.clamp_min(1e-300).log()).sum(-1)[keep].mean())

    text = f"; mean weight entropy {entropy(flat):.3g} nats"
    m = getattr(estimate, "matmul", None)
    if m is not None and m.out.numel() == w.numel() and m.factor:
        qk = m.out.reshape(-1, w.shape[-1])[:ENTROPY_ROWS].double() / m.factor  # (rows, Tk)
        logits = torch.where(flat > 0, expected * qk, torch.full_like(qk, -math.inf))
        text += f", {entropy(torch.softmax(logits, -1).nan_to_num(0.0)):.3g} at the expected scale"
    elif math.isfinite(ratio) and ratio > 0:
        text += f", {entropy(torch.softmax(flat.clamp_min(1e-300).log() / ratio, -1)):.3g} at the expected scale"
    return text + f" (uniform over {w.shape[-1]} keys: {math.log(w.shape[-1]):.3g})"


@detector("output_variance", "the output is a convex combination of the values: identical value rows come out "
          "unchanged and outputs stay within the values' range",
          targets=("no softmax", "softmax over the wrong axis", "dropout in eval", "heads merged without transpose"),
          fix="normalise the weights over keys before weighting the values, and merge heads with "
              "x.transpose(1, 2).reshape(B, T, D)")
def check_output_variance(probe: Probe) -> DetectorResult:
    det, s, B, T = "output_variance", probe.subject, probe.BATCH, probe.t
    tol = max(tolerance(UNCHANGED, s.dtype), tolerance(ROW_SUM, s.dtype))
    if s.form == "function":
        q, k, _ = probe.streams(B, T, cross=True)
        row = probe.make(B, 1)  # (B, H, 1, d)
        v = row.expand_as(k).contiguous()  # (B, H, T, d): every value row identical
        call = probe.call(q, k, v, probe.allowed(B, T, T), label="identical value rows")
        if not call.ok:
            return not_run(det, call)
        if call.output.out.shape != q.shape:
            return skip(det, f"output shape {tuple(call.output.out.shape)} is not the query's")
        got, expected = call.output.out, row.expand_as(call.output.out)
        what = "output rows differ from the one value row"
    elif getattr(s, "extra_keys", False):
        return skip(det, "the layer appends a learned or zero key (add_bias_kv / add_zero_attn) that identical "
                         "inputs do not reach, so outputs legitimately depend on how many tokens there are")
    else:
        # a token 10x the usual size: logits grow 100x, so weights that are not normalised (which scale the
        # output with the token count) show even where the initialisation keeps logits tiny
        token = 10 * probe.make(B, 1)  # (B, 1, D)
        same = token.expand(B, T, s.d_model).contiguous()  # (B, T, D): T identical tokens
        if s.separate_kv and not probe.causal:  # queries differ, memory is T copies of one token
            query = probe.make(B, T)
            call = probe.call(query, same, same, probe.allowed(B, T, T), label="a memory of identical tokens")
            # one query over that one token: every output row must equal its output (Tq = 1 also keeps
            # a wrong head merge from disguising the reference)
            reference = probe.call(query[:, :1].clone(), token, token, probe.allowed(B, 1, 1),
                                   label="one query over that one token")
        else:
            call = probe.call(same, same, same, probe.allowed(B, T, T), label="identical tokens")
            reference = probe.call(token, token, token, probe.allowed(B, 1, 1), label="that one token alone")
        for c in (call, reference):
            if not c.ok:
                return not_run(det, c)
        got, ref = call.output.out, reference.output.out
        if got.dim() != 3 or ref.dim() != 3 or ref.shape[1] != 1 or ref.shape[::2] != got.shape[::2]:
            return skip(det, f"output shapes {tuple(got.shape)} and {tuple(ref.shape)} do not allow the comparison")
        expected = ref.expand_as(got)
        what = "output rows differ from the output for that one token"
    change = relative_change(got, expected)
    if change is None:
        return skip(det, "the expected output is zero everywhere, so a difference cannot be measured against it")
    bad = int((change > tol).sum())
    worst = float(change.max())
    idx = tuple(int(i) for i in torch.unravel_index(change.argmax(), change.shape))
    shown = "inf (non-finite)" if math.isinf(worst) else f"{worst:.3g}"
    text = (f"{bad} / {change.numel()} {what} ({100 * bad / change.numel():.1f}%) when every value row is the same "
            f"vector; greatest difference {shown} at {_at(idx, ('b', 't') if change.dim() == 2 else ('b', 'h', 't'))} "
            f"(up to {tol:.2g} of the output's RMS allowed for {dtype_name(s.dtype)})")
    if bad:
        return _result(det, "fail", "the output is not a convex combination of the values: identical value rows "
                       "do not come out unchanged", value=worst, threshold=tol, evidence=text)
    bound = _bound_check(probe, tol) if s.form == "function" else None
    return bound or _result(det, "pass", "identical value rows come out unchanged", value=worst, threshold=tol,
                            evidence=text)


def _bound_check(probe: Probe, tol: float) -> DetectorResult | None:
    """Function form: every output feature lies between the smallest and largest value of that feature."""
    base = probe.base()
    if not base.ok or base.output.out.shape[:-1] != base.query.shape[:-1] or base.output.out.shape[-1] != base.value.shape[-1]:
        return None
    out, v = base.output.out.double(), base.value.double()  # (B, H, Tq, d_v), (B, H, Tk, d_v)
    hi, lo = v.amax(-2, keepdim=True), v.amin(-2, keepdim=True)  # (B, H, 1, d_v)
    spread = (hi - lo).clamp_min(1e-12)
    excess = (torch.maximum(out - hi, lo - out) / spread).clamp_min(0).nan_to_num(nan=math.inf)  # (B, H, Tq, d_v)
    if (excess > tol).any():
        n = int((excess > tol).sum())
        idx = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        return _result("output_variance", "fail", "outputs leave the range of the values",
                       value=float(excess.max()), threshold=tol,
                       evidence=f"{n} / {excess.numel()} output features lie outside [min, max] of the values by up "
                                f"to {float(excess.max()):.3g} of their spread at (b, h, t, feature)={idx}")
    return None


@detector("query_locality", "each output row depends only on its own query row",
          targets=("self/cross-attention inputs swapped", "heads merged without transpose", "softmax over queries"),
          fix="take Q from the query stream; merge heads with x.transpose(1, 2).reshape(B, T, D)",
          needs=(SEPARATE_QUERY, LONG))
def check_query_locality(probe: Probe) -> DetectorResult:
    det, s, B, T = "query_locality", probe.subject, probe.BATCH, probe.t
    q, k, v = probe.streams(B, T, cross=True)
    base = Inputs(q, k, v)
    p = T // 2
    moved = torch.arange(T) == p
    # gain 100 as well as 1: the other rows' weights do not depend on query p in a correct layer, however
    # hard it is pushed; in a layer that mixes queries, a large change shows even where logits are tiny
    cases = [Case(x, hold=_rows(B, T, ~moved), move=_rows(B, T, moved), when=f"when only query t={p} changed "
                  f"(x{gain:g})") for gain, x in zip(_gains(probe), perturbed(probe, base, moved, ("query",), gains=_gains(probe)))]
    comparison = compare(probe, base, cases, label=f"query t={p} changed")
    return _judge_held(det, comparison, probe, what="other output rows",
                       fail_message="an output row depends on other queries than its own",
                       pass_message="each output row depends only on its own query")


@detector("mask_honoured", "changing a key the mask blocks changes nothing (padding and causal masks)",
          targets=("mask polarity inverted", "mask applied after softmax", "mask ignored or misshaped"),
          fix="apply the mask to the scores before the softmax: scores.masked_fill(~allowed, -inf)",
          needs=(TAKES_MASK, LONG))
def check_mask_honoured(probe: Probe) -> DetectorResult:
    det, B, T = "mask_honoured", probe.BATCH, probe.t
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    cut = (T - 1) // 2
    pad = probe.padding(B, T, T)  # (B, Tq, Tk)
    scenarios = (("padding", pad, ~pad[:, 0, :], "when only padded keys changed"),  # (B, Tk): the blocked keys
                 ("causal", (j <= i).expand(B, T, T), (j > cut).expand(B, T), f"when only keys after t={cut} changed"))
    if probe.causal:
        # a causal mask passed to a layer audited as causal blocks what the layer's own causality (or the causal
        # mask the audit passes) blocks already: that probe is future_leakage's, which runs on such layers
        scenarios = scenarios[:1]
    results = []
    for name, mask, keys, when in scenarios:
        q, k, v = probe.streams(B, T)
        base = Inputs(q, k, v, mask)
        allowed = probe.allowed(B, T, T, mask).cpu()  # what the layer is given, causal included
        # rows that must not move: they may attend some key, and none of the changed ones
        hold = allowed.any(-1) & ~(allowed & keys.unsqueeze(1)).any(-1)  # (B, Tq)
        sees = (allowed & keys.unsqueeze(1)).any(-1)  # (B, Tq): rows a correct layer moves
        if base.one_stream:
            hold &= ~keys  # in self-attention the changed positions are also changed queries
            sees |= keys & allowed.any(-1)
        cases = [Case(x, hold=hold, move=sees, when=f"{when} (x{gain:g})")
                 for gain, x in zip(_gains(probe), perturbed(probe, base, keys, ("key", "value"), gains=_gains(probe)))]
        comparison = compare(probe, base, cases, label=f"{name} mask, blocked keys changed")
        if isinstance(comparison, DetectorResult):
            return comparison
        results.append((name, comparison))
    readings = [(name, *held(c, probe, what="outputs")) for name, c in results]
    bad = [name for name, b, _, _, _ in readings if b]
    if not bad and all(silent for _, _, _, _, silent in readings):
        return skip(det, "the output did not respond to changed keys anywhere, so its not moving where the mask "
                         "blocks them proves nothing")
    result = _judge(det, bool(bad), f"outputs depend on keys the mask blocks ({', '.join(bad)})",
                    f"keys the mask blocks have no effect ({' and '.join(name for name, _ in results)} "
                    f"mask{'s' if len(results) > 1 else ''})",
                    value=max(w for _, _, w, _, _ in readings), threshold=results[0][1].tol,
                    evidence="; ".join(f"{name} mask: {text}" for name, _, _, text, _ in readings))
    if result.verdict == "fail":
        # before saying the mask is ignored: the layer's mask may be another convention, as its parameter's
        # name, annotation or default says (never judged from the layer's behaviour: an inverted mask must fail)
        from ._subject import mask_convention_hint

        hint = mask_convention_hint(probe.subject, probe.options) or _adds_its_mask(probe)
        if hint:
            result = DetectorResult(det, "fail", f"{result.message}; {hint}", value=result.value,
                                    threshold=result.threshold, evidence=result.evidence,
                                    fix=f"{hint}; {result.fix}")
    return result


def _adds_its_mask(probe: Probe) -> str | None:
    """For a mask_honoured failure of a module given bool masks by default: whether it adds its mask to the
    scores (a bool mask then shifts allowed logits by the constant 1, and blocks nothing). Told by its output
    being the same when the same mask comes as 0./1. floats: a layer that blocks with a bool mask cannot take a
    float one alike (masked_fill needs bools; a multiplication would zero, not shift). Two calls, only on a
    failure; never a verdict: the finding stays, with the convention to declare if that is the layer's."""
    s = probe.subject
    if s.convention_declared or s.convention != "allowed" or not hasattr(s, "_kwargs") or not s.mask_names:
        return None
    B, T = probe.BATCH, probe.t
    q, k, v = probe.streams(B, T)
    allowed = probe.allowed(B, T, T, probe.padding(B, T, T))
    outputs = []
    try:
        for cast in (False, True):
            kwargs = s._kwargs(q, k, v, allowed)
            if cast:
                for name in s.mask_names:
                    kwargs[name] = kwargs[name].to(s.dtype)  # True -> 1.0, False -> 0.0
            probe.passes += 1
            with torch.no_grad():
                result = s.layer(**kwargs)
            outputs.append(result[0] if isinstance(result, (tuple, list)) else result)
    except Exception:  # noqa: BLE001 - a layer that refuses float masks does not add them
        return None
    bool_out, float_out = outputs
    if not (isinstance(bool_out, Tensor) and isinstance(float_out, Tensor)) or bool_out.shape != float_out.shape:
        return None
    change = relative_change(float_out, bool_out, centred=True)
    if change is None or not bool(torch.isfinite(bool_out).all()) or float(change.max()) > tolerance(UNCHANGED, s.dtype):
        return None
    from ._subject import HINTS, _spell

    return (f"the layer adds its mask to the scores: the bool mask passed as 0./1. floats gives the same output "
            f"(up to {float(change.max()):.2g} of its RMS), so True shifts the allowed logits by 1 and blocks "
            f"nothing; if its mask is additive ({HINTS['additive']}), audit with "
            f"{_spell('mask', 'additive', probe.options)}")


@detector("fully_masked_rows", "a query whose every key is masked gives a finite output (warns on NaN)",
          targets=("plain softmax over an all -inf row",),
          fix="zero the weights of rows with no allowed key (torch's SDPA does), or never build such rows",
          needs=(TAKES_MASK,))
def check_fully_masked_rows(probe: Probe) -> DetectorResult:
    det, B, T = "fully_masked_rows", probe.BATCH, probe.t
    r = T // 2
    extra = torch.ones(B, T, T, dtype=torch.bool)
    extra[0, r, :] = False  # batch 0, query r may attend nothing
    q, k, v = probe.streams(B, T)
    call = probe.call(q, k, v, probe.allowed(B, T, T, extra), label="a query with no key to attend")
    if not call.ok:
        return not_run(det, call)
    finite = torch.isfinite(call.output.out).all(-1)  # (B, T) or (B, H, T)
    empty = torch.zeros_like(finite)
    empty[0, ..., r] = True
    if (~finite & ~empty).any():
        n = int((~finite & ~empty).sum())
        return _result(det, "fail", "NaN spreads beyond the query whose every key is masked",
                       value=float(n), threshold=0.0,
                       evidence=f"{n} output rows other than (b=0, t={r}) are NaN/inf when only that query has no key")
    if (~finite & empty).any():
        return _result(det, "warn", "a query whose every key is masked gets NaN (torch's SDPA gives zeros)",
                       value=1.0, threshold=0.0,
                       evidence=f"output at (b=0, t={r}) is NaN/inf when that query may attend no key; it will "
                                f"poison the loss and the gradients unless such rows are dropped")
    return _result(det, "pass", "a query with no key to attend gives a finite output", value=0.0, threshold=0.0)


@detector("future_leakage", "for a causal layer, changing tokens after t leaves outputs at and before t unchanged, "
          "with no mask and with a padding mask",
          targets=("missing causal mask", "heads merged without transpose in a decoder",
                   "padding mask replacing (or ORed with) the causal mask"),
          fix="mask scores with causal_mask(Tq, Tk, align='bottom_right') before the softmax",
          needs=(CAUSAL, LONG))
def check_future_leakage(probe: Probe) -> DetectorResult:
    """With no mask, and (for layers that take one) with a padding mask too: a decoder that builds its own
    causal mask and lets the user's padding mask replace it (or ORs them) is causal only in the first."""
    det, s, B, T = "future_leakage", probe.subject, probe.BATCH, probe.t
    cuts = sorted({0, T // 2, T - 2})
    t = torch.arange(T)
    # each copy of the batch cuts its sequences at their own t (sequence b of copy n at cuts[(n * B + b) %
    # len(cuts)]): every cut is measured, in as few copies as the batch allows
    packed = [[cuts[(n * B + b) % len(cuts)] for b in range(B)] for n in range(-(-len(cuts) // B))]
    scenarios = [("no mask", None, packed)]
    if s.takes_mask:
        pad = probe.padding(B, T, T)  # (B, Tq, Tk): trailing keys blocked for every query
        # one cut, at 0: every sequence keeps at least its first two keys once T >= 4, so key 1 is visible
        scenarios.append(("a padding mask", pad | (t.view(1, 1, T) <= 0), [[0] * B]))  # key 0 always kept
    readings = []
    for name, extra, copies in scenarios:
        base = Inputs(*probe.streams(B, T, cross=s.form == "function"), extra)
        allowed = probe.allowed(B, T, T, extra)
        attends = torch.ones(B, T, dtype=torch.bool) if allowed is None else allowed.cpu().any(-1)
        cases = []
        for at in copies:
            after = t.view(1, T) > torch.tensor(at).view(B, 1)  # (B, T): the perturbed positions of each sequence
            shown = (f"t>={at[0] + 1} was" if len(set(at)) == 1 else
                     " and ".join(f"t>={c + 1} of sequence {b}" for b, c in enumerate(at)) + " were")
            cases += [Case(x, hold=~after & attends, move=after & attends,
                           when=f"when only {shown} perturbed (x{gain:g}, {name})")
                      for gain, x in zip(_gains(probe), perturbed(probe, base, after, ("query", "key", "value"),
                                                                  gains=_gains(probe)))]
        shown = sorted({c for at in copies for c in at})
        comparison = compare(probe, base, cases, label=f"tokens after t in {shown} changed, {name}")
        if isinstance(comparison, DetectorResult):
            return comparison
        readings.append((name, comparison, *held(comparison, probe, what="past outputs")))
    bad = [name for name, _, b, _, _, _ in readings if b]
    if not bad and all(silent for *_, silent in readings):
        return skip(det, "the output did not respond to later tokens at all, so its not moving proves nothing")
    return _judge(det, bool(bad), "outputs depend on future tokens" + (f" (with {', '.join(bad)})" if bad else ""),
                  f"no output moved when only later tokens changed (cuts at t={cuts}; "
                  f"{' and '.join(n for n, *_ in readings)})",
                  value=max(w for _, _, _, w, _, _ in readings), threshold=readings[0][1].tol,
                  evidence="; ".join(f"{name}: {text}" for name, _, _, _, text, _ in readings))


@detector("causal_alignment", "for a causal layer, the newest query sees the newest key (bottom-right "
          "alignment for cached decoding, diagonal included)",
          targets=("top-left causal mask with a KV cache", "causal mask blocking the diagonal"),
          fix="allow keys j <= i + (Tk - Tq): causal_mask(Tq, Tk, align='bottom_right'), i.e. "
              "triu(diagonal=1 + Tk - Tq)",
          needs=(CAUSAL,))
def check_causal_alignment(probe: Probe) -> DetectorResult:
    det, s, B, T = "causal_alignment", probe.subject, probe.BATCH, probe.t
    if s.separate_kv:
        return _newest_key_seen(probe)
    base = probe.base()
    if not base.ok:
        return not_run(det, base)
    weights, source = probe.weights(base)
    if weights is None:
        return skip(det, "one input stream and no weights: a key cannot change without its query")
    diag = weights.double().diagonal(dim1=-2, dim2=-1)  # (..., T): each query's weight on its own position
    if bool((diag <= 0).any()):
        idx = tuple(int(i) for i in torch.unravel_index(diag.argmin(), diag.shape))
        return _result(det, "fail", "a query gives zero weight to its own position", value=float(diag.min()),
                       threshold=0.0, evidence=f"{int((diag <= 0).sum())} / {diag.numel()} queries give their own "
                                               f"position weight 0, e.g. at {idx} ({source})")
    return _result(det, "pass", f"every query attends its own position ({source})", value=float(diag.min()),
                   threshold=0.0)


def _newest_key_seen(probe: Probe) -> DetectorResult:
    """Cached decoding: the last Tq positions query all T keys; changing key T-1 must move query T-1."""
    det, s, B, T = "causal_alignment", probe.subject, probe.BATCH, probe.t
    t_q = max(1, min(T // 2, 8))  # several queries (a layer may special-case one), the newest read; capped: cost
    if s.form == "function":
        q = probe.make(B, t_q)
        k, v = probe.make(B, T), probe.make(B, T)
    else:
        k = v = probe.make(B, T)
        q = k[:, T - t_q:].clone()
    base = Inputs(q, k, v)
    newest = torch.arange(T) == T - 1
    # A blocked key moves nothing. A visible one moves the output, and a large change of it in both
    # directions makes one draw's logit dominate, so a correct layer moves far above rounding noise.
    gains = (1.0, 100.0, -100.0)
    cases = [Case(x, hold=torch.zeros(B, t_q, dtype=torch.bool), when=f"key {T - 1} x{gain:g}")
             for gain, x in zip(gains, perturbed(probe, base, newest, ("key", "value"), gains=gains))]
    comparison = compare(probe, base, cases, label=f"{t_q} newest queries over {T} keys, key {T - 1} changed")
    if isinstance(comparison, DetectorResult):
        return comparison
    change = torch.stack(comparison.changes).amax(0)  # (B, [H,] Tq): the most any gain moved each row
    last = change[..., -1]  # the newest query, at position T - 1
    tol = comparison.tol
    if bool((last <= tol).any()):
        return _result(det, "fail", "the newest query does not see the newest key (causal mask misaligned "
                       "or blocking the diagonal)", value=float(last.min()), threshold=tol,
                       evidence=f"with {t_q} queries at positions {T - t_q}..{T - 1} over {T} keys, changing "
                                f"key {T - 1} (by up to 100x, both signs) moved the output of query {T - 1} by "
                                f"at most {float(last.min()):.3g} of the outputs' RMS about their mean in some row (more than "
                                f"{tol:.2g} expected for {dtype_name(s.dtype)}): query i must see keys "
                                f"<= i + Tk - Tq, its own position included")
    return _result(det, "pass", f"the newest of {t_q} queries sees the newest of {T} keys (bottom-right)",
                   value=float(last.min()), threshold=tol)


@detector("eval_determinism", "two eval-mode calls on the same input give the same output",
          targets=("dropout left on in eval mode",), fix="F.dropout(weights, p, training=self.training)")
def check_eval_determinism(probe: Probe) -> DetectorResult:
    det, base = "eval_determinism", probe.base()
    if not base.ok:
        return not_run(det, base)
    # observed like the standard probe, so that both calls take the same path (nn.MultiheadAttention has a
    # fused fast path for inference without grad, which rounds differently in float16)
    again = probe.call(base.query, base.key, base.value, base.allowed, label="the standard probe, again",
                       observe=True)
    if not again.ok:
        return not_run(det, again)
    B, t_q = base.query.shape[0], base.query.shape[probe.subject.time_dim]
    change = relative_change(again.output.out, base.output.out, centred=True)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
    everywhere = torch.ones(B, t_q, dtype=torch.bool)
    comparison = Comparison([Case(Inputs(base.query, base.key, base.value), everywhere,
                                  "between two eval-mode calls on the same input")], [change],
                            tolerance(UNCHANGED, probe.subject.dtype), again)
    bad, worst, text, _ = held(comparison, probe, what="outputs")
    return _judge(det, bad > 0, "two eval-mode calls on the same input differ (randomness left on)",
                  "eval-mode calls are deterministic", value=worst, threshold=comparison.tol, evidence=text)


__all__ = ["DETECTORS"]


@detector("batch_independence", "each sequence's output depends on that sequence only: changing another "
          "sequence of the batch, in a separate call, moves nothing",
          targets=("batch and sequence axes mixed (permute or transpose over dim 0)", "normalisation over the batch",
                   "a mask or cache broadcast across sequences"),
          fix="keep the batch axis apart: merge heads with x.transpose(1, 2).reshape(B, T, D), reduce over "
              "dim=-1, never over dim 0")
def check_batch_independence(probe: Probe) -> DetectorResult:
    """Two separate calls, so that a layer that mixes the batch is not compared with itself mixed the same way
    (every other invariance check stacks its probes along the batch of one call)."""
    det, s, B, T = "batch_independence", probe.subject, probe.BATCH, probe.t
    base = Inputs(*probe.streams(B, T))
    other = torch.zeros(B, T, dtype=torch.bool)
    other[1:] = True  # every position of every sequence but the first
    [changed] = perturbed(probe, base, other, ("query", "key", "value"))
    allowed = probe.allowed(B, T, T)

    def call(x: Inputs, label: str):
        probe.seed_layer_rng()  # one draw of any randomness for every call (the audit restores the RNG)
        return probe.call(x.query, x.key, x.value, allowed, label=label)

    calls = [call(base, "a batch of 2"), call(changed, "the same batch, sequence 1 changed")]
    for c in calls:
        if not c.ok:
            return not_run(det, c)
    old, new = (c.output.out for c in calls)
    if old.shape != new.shape or old.shape[0] != B:
        return skip(det, f"the output {tuple(old.shape)} does not keep the batch")
    change = relative_change(new, old, centred=True)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a change cannot be measured")
    first = torch.zeros(B, T, dtype=torch.bool)
    first[0] = True
    tol = tolerance(UNCHANGED, s.dtype)
    if bool((change[_expand(first, change)] > tol).any()):
        # sequence 0 moved: mixing, or randomness that one seed does not pin down, which would read as mixing
        # and is not ours to judge; a third call on the same batch tells them apart (only a moved layer pays it)
        again = call(base, "the same batch again")
        if not again.ok:
            return not_run(det, again)
        if not torch.equal(old.nan_to_num(), again.output.out.nan_to_num()):
            return skip(det, "two calls on the same batch differ, so a change between calls cannot be attributed "
                             "to the other sequence (see eval_determinism)")
    comparison = Comparison([Case(changed, hold=first, move=~first, when="when only sequence 1 changed (a "
                                  "separate call)")], [change], tol, calls[1], base)
    return _judge_held(det, comparison, probe, what="outputs of sequence 0",
                       fail_message="a sequence's output depends on another sequence of the batch",
                       pass_message="each sequence's output depends on that sequence only")


PACKED_KEYS = 8
"""From this many positions keys_matter changes keys and values in different sequences of one copy."""


@detector("keys_matter", "the output depends on the keys and on the values: changing either input alone "
          "moves it", targets=("q @ v^T instead of q @ k^T", "keys or values projected from the wrong stream"),
          fix="scores = q @ k.transpose(-2, -1) with k = W_k(key); out = weights @ v with v = W_v(value)",
          needs=(SEPARATE_QUERY, LONG))  # with one key per query, the weights are 1 whatever the keys
def check_keys_matter(probe: Probe) -> DetectorResult:
    det, s, B, T = "keys_matter", probe.subject, probe.BATCH, probe.t
    # the keys act only through the softmax: at d_k = 1 and std-0.02 initialisation a bfloat16 layer whose W_Q
    # drew 0.0012 moved its output by exactly 0 (below its rounding) for keys pushed 10000x (15 of 400 seeds),
    # so keys are pushed a million-fold outside float16 (whose range ends at 65504)
    gains = {"key": (100.0,) if s.dtype == torch.float16 else (1e6,), "value": _gains(probe)}
    # a cross-attention module takes one memory stream: its value cannot change without its key
    streams = ("key", "value") if getattr(s, "separate_value", True) else ("key",)
    # with PACKED_KEYS positions or more, one copy of the batch: the keys of sequence 0 changed and (where values
    # are an input of their own) the values of sequence 1 (batch_independence checks that sequences do not mix;
    # each row is read alone); with fewer, one copy per stream, every sequence changed: at seq_len 2 a correct
    # bfloat16 layer's one sequence moved by exactly 0 when only its keys changed
    packed = T >= PACKED_KEYS and B >= len(streams)
    rows = {stream: torch.zeros(B, T, dtype=torch.bool) if packed else torch.ones(B, T, dtype=torch.bool)
            for stream in streams}
    if packed:
        for b, stream in enumerate(streams):
            rows[stream][b::len(streams)] = True
    nothing = torch.zeros(B, T, dtype=torch.bool)

    def attempt() -> list[float] | DetectorResult:
        q = probe.make(B, T)
        k, v = probe.make(B, T), probe.make(B, T)  # key and value inputs apart, even for modules
        base = Inputs(q, k, v) if "value" in streams else Inputs(q, k, k)
        changed = {stream: perturbed(probe, base, rows[stream], (stream,), gains=gains[stream])[0]
                   for stream in streams}
        if packed and "value" in streams:
            cases = [Case(Inputs(q, changed["key"].key, changed["value"].value), hold=nothing,
                          when="when only the keys of sequence 0 and the values of sequence 1 changed")]
        else:
            cases = [Case(changed[stream], hold=nothing, when=f"when only the {stream}s changed") for stream in streams]
        comparison = compare(probe, base, cases, label="keys, values changed alone")
        if isinstance(comparison, DetectorResult):
            return comparison
        # "moved" is measured against a null twin of the same call (the baseline stacked as often, nothing
        # changed), not against the baseline rows: CPU kernels round a row by its place in the batch (a layer
        # that ignores its values moved sequence 1 by 2.8e-7 of its RMS, against the baseline in rows 0-1, from
        # rows 2-3 of the same call), while the same inputs in the same place give the same numbers exactly
        null = compare(probe, base, [Case(base, hold=nothing, when="nothing changed")] * len(cases),
                       label="keys, values: the same call with nothing changed")
        if isinstance(null, DetectorResult):
            return null
        n = len(cases) + 1
        real, twin = comparison.call.output.out.chunk(n), null.call.output.out.chunk(n)
        scale = baseline_scale(real[0], centred=True) or None
        changes = [relative_change(a, b, centred=True, scale=scale) for a, b in zip(real[1:], twin[1:])]
        if any(c is None for c in changes):
            return skip(det, "the output is zero or non-finite everywhere on this probe, so a change cannot be "
                             "measured against it")
        if packed:  # (B, [H,] Tq): the most each stream's rows moved
            return [float(changes[0][rows[stream][:, 0]].max()) for stream in streams]
        return [float(c.max()) for c in changes]

    # moved at all: a layer that ignores an input computes the same numbers and moves by exactly 0 on every
    # draw, while a correct layer at d_k = 1 and std-0.02 initialisation in bfloat16 moved by as little as 0.5%
    # of its RMS, and by exactly 0 on one draw in a few hundred (keys that round alike, a query near 0): an input
    # that did not move the output is drawn again, up to KEY_DRAWS times in all
    tol, moved, draws = 0.0, None, 0
    while draws < KEY_DRAWS and (moved is None or not all(m > tol for m in moved)):
        reading = attempt()
        if isinstance(reading, DetectorResult):
            return reading
        moved = reading if moved is None else [max(a, b) for a, b in zip(moved, reading)]
        draws += 1
    dead = [stream for stream, m in zip(streams, moved) if not m > tol]
    evidence = "; ".join(f"changing every {stream}" + (f" of sequence {b}" if packed else "") +
                         f" (x{gains[stream][0]:g}) moved the output by at most {m:.3g} of its RMS"
                         for b, (stream, m) in enumerate(zip(streams, moved)))
    drawn = f", over {draws} independent draws" if draws > 1 else ""
    return _judge(det, bool(dead), f"the output does not depend on the {' or the '.join(d + 's' for d in dead)}",
                  "the output depends on the keys and on the values", value=min(moved), threshold=tol,
                  evidence=f"{evidence}{drawn} (any change expected; a layer that ignores the input moves by exactly 0)")


KEY_DRAWS = 3
"""Independent draws keys_matter makes before an input that never moved the output is called ignored."""


DECODE_SPREAD = 2.0
"""The spread (std over a row's keys) of the logits the decoding checks aim for by scaling their tokens."""
DECODE_GAIN_CAP = 100.0
"""The largest factor: a 2-wide head at std-0.02 initialisation spreads its logits by ~0.06 even at 10x."""


def _decode_gain(probe: Probe) -> float:
    """The factor, 1 to DECODE_GAIN_CAP, by which the decoding checks scale their tokens so that the logits spread by about
    DECODE_SPREAD over each row's keys: at GPT-2's std-0.02 initialisation attention is nearly uniform, and a
    position or mask error shows only once tokens are ~10x larger; at torch's default initialisation 10x
    makes attention one-hot, where half precision's rounding of a logit moves the output as much as a bug
    (bfloat16 measured 0.08 of the RMS between two correct computations). The spread is read from the
    standard probe's weights (a softmax's log is its logits, shifted per row); 10 where none are exposed, the
    cap where they are uniform to their rounding."""
    base = probe.base()
    weights = probe.weights(base)[0] if base.ok else None
    if weights is None:
        return 10.0
    w = weights.detach().flatten(0, -2)[:ENTROPY_ROWS].double()  # (rows, Tk): a sample, as for the entropy
    seen = w > 0
    n = seen.sum(-1)
    logits = torch.where(seen, w.clamp_min(1e-300).log(), torch.zeros_like(w))
    # the softmax's own input where it was observed: weights rounded to half precision are 0.5 / 0.5 for
    # logits 0.01 apart, whose spread they would read as 0
    sm = next((sm for sm in reversed(base.record.softmaxes) if sm.input.numel() == weights.numel()), None) \
        if base.record is not None else None
    if sm is not None:
        raw = sm.input.detach().reshape(-1, w.shape[-1])[:ENTROPY_ROWS].double()
        seen = seen & torch.isfinite(raw)
        n = seen.sum(-1)
        logits = torch.where(seen, raw, torch.zeros_like(raw))
    mean = logits.sum(-1) / n.clamp_min(1)
    var = (torch.where(seen, logits - mean.unsqueeze(-1), torch.zeros_like(w)) ** 2).sum(-1) / (n - 1).clamp_min(1)
    rows = n >= 2
    if not bool(rows.any()):
        return 10.0
    spread = float(var[rows].sqrt().median())
    if not math.isfinite(spread):
        return 10.0
    if spread <= 0:  # uniform to the weights' rounding: as hard as allowed
        return DECODE_GAIN_CAP
    return min(DECODE_GAIN_CAP, max(1.0, math.sqrt(DECODE_SPREAD / spread)))  # logits grow as the square of the tokens


@detector("decode_consistency", "for a causal layer, the last Tq queries over all Tk keys give exactly the last "
          "Tq rows of the full pass (decoding with a cache equals the full pass), for Tq = 1, 3 and an uneven split",
          targets=("causal mask top-left or dropped once queries are fewer than keys",
                   "positions of new queries not offset by the cache length"),
          fix="build the causal mask bottom-right (causal_mask(Tq, Tk, align='bottom_right')) and offset the "
              "positions of new queries by the number of cached tokens",
          needs=(CAUSAL, SEPARATE_QUERY, LONGER))
def check_decode_consistency(probe: Probe) -> DetectorResult:
    det, s, B, T = "decode_consistency", probe.subject, probe.BATCH, probe.t
    g = _decode_gain(probe)  # attention neither uniform (std-0.02 weights) nor one-hot (rounding-bound)
    if s.form == "function":
        q, k, v = g * probe.make(B, T), g * probe.make(B, T), g * probe.make(B, T)
    else:
        q = k = v = g * probe.make(B, T)
    full = probe.call(q, k, v, probe.allowed(B, T, T), label=f"the full pass, {T} tokens")
    if not full.ok:
        return not_run(det, full)
    t = s.time_dim
    splits = [min(n, T - 1) for n in (1, 3, T - T // 3)]  # three calls at every length: a constant cost
    readings, worst = [], 0.0
    # the same rows from matmuls of other shapes: summed in another order, so rounding may differ (nn.MHA in
    # float32 measured 1.5e-5); the row-sum tolerance is that of a recomputation
    tol = tolerance(ROW_SUM, s.dtype)
    for n in splits:
        tail = q.narrow(t, T - n, n).clone()
        part = probe.call(tail, k, v, probe.allowed(B, n, T), label=f"the last {n} queries over {T} keys")
        if not part.ok:
            return not_run(det, part)
        expected = full.output.out.narrow(t, T - n, n)
        if part.output.out.shape != expected.shape:
            return skip(det, f"the output {tuple(part.output.out.shape)} has no row per query (see output_shape)")
        change = relative_change(part.output.out, expected, centred=True, scale_of=full.output.out)
        if change is None:
            return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
        bad = int((change > tol).sum())
        worst = max(worst, float(change.max()))
        readings.append((n, bad, change.numel(), float(change.max())))
    failed = [r for r in readings if r[1]]
    evidence = "; ".join(f"last {n} of {T} queries: {bad} / {total} rows differ from the full pass, by up to "
                         f"{m:.3g}" for n, bad, total, m in readings) + f" ({allowed_text(tol, s.dtype)})"
    return _judge(det, bool(failed), "decoding the last queries over all keys differs from the full pass",
                  f"the last Tq queries over all keys reproduce the full pass (Tq = {splits})", value=worst,
                  threshold=tol, evidence=evidence)


def _split_cache(result, batch: int, t_q: int, t_k: int):
    """(out, cache) from what a cached call returned: `out`, or `(out, cache[, weights])` in any order after
    `out`; the cache is the first returned thing that is not the weights (None: nothing returned)."""
    if isinstance(result, Tensor):
        return result, None
    if not (isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor)):
        return None, None

    def weights_like(r) -> bool:
        return (isinstance(r, Tensor) and r.is_floating_point() and r.dim() in (3, 4) and r.shape[0] == batch
                and tuple(r.shape[-2:]) == (t_q, t_k))

    caches = [r for r in result[1:] if r is not None and not isinstance(r, bool) and not weights_like(r)]
    return result[0], caches[0] if caches else None


CACHE_NOISE_FACTOR = 4.0
"""How far beyond the recomputation noise (no-cache rows computed twice) a cached decode may differ. Measured:
see benchmarks/margins.py."""


def _cache_plan(T: int) -> list[int]:
    """Token counts of the cached calls: a prefill of half, steps of 1, 1 and 3, then the uneven remainder."""
    plan, rest = [max(1, T // 2)], T - max(1, T // 2)
    for n in (1, 1, 3):
        if rest:
            plan.append(min(n, rest))
            rest -= plan[-1]
    return plan + ([rest] if rest else [])


@detector("cache_decoding", "for a causal layer with a cache of its own, prefilling half the tokens and decoding "
          "the rest through that cache (steps of 1, 1, 3 and the remainder) gives the rows of the full pass",
          targets=("rotary positions of new tokens not offset by the cache length",
                   "the causal mask dropped or misaligned once a cache is attached",
                   "a cache that loses or repeats keys"),
          fix="offset the positions of new tokens by the cache length, mask new tokens bottom-right against cached "
              "and new keys (causal_mask(Tq, Tk, align='bottom_right')), and append every new key and value",
          needs=(CAUSAL, LONG, HAS_CACHE))
def check_cache_decoding(probe: Probe) -> DetectorResult:
    """Drives the layer's own cache: the cache argument left at None with use_cache=True must return a cache
    (fed back on the next call), or a dict passed in must be filled (passed again). Calls the layer raises on
    are the audit guessing a protocol wrong, so they skip with the error, never fail `runs`; a layer that
    refuses several new tokens at once is decoded one token at a time there, and the report says so."""
    det, s, B, T = "cache_decoding", probe.subject, probe.BATCH, probe.t
    name = s.cache_name
    if probe.pass_causal_mask and s.convention == "key_padding":
        return skip(det, "the layer's mask is a key-padding mask, which cannot carry the causal mask of several "
                         "new tokens")
    x = _decode_gain(probe) * probe.make(B, T)  # as in decode_consistency
    full = probe.call(x, x, x, probe.allowed(B, T, T), label=f"the full pass, {T} tokens")
    if not full.ok:
        return not_run(det, full)
    expected = full.output.out
    if expected.shape[:2] != (B, T):
        return skip(det, f"the output {tuple(expected.shape)} has no row per token (see output_shape)")

    def cached(start: int, n: int, cache):
        chunk = x[:, start:start + n].contiguous()  # (B, n, D): a slice of time is not contiguous (see `runs`)
        allowed = probe.allowed(B, n, start + n)
        probe.passes += 1
        probe.shapes[det].append(ProbeShape(f"{n} new tokens over a cache of {start}", B, n, start + n,
                                            None if allowed is None else allowed.cpu(), True))
        with torch.no_grad():
            result = s.call_cached(chunk, allowed, cache, start=start)
        out, returned = _split_cache(result, B, n, start + n)
        if out is None or tuple(out.shape[:2]) != (B, n):
            raise ValueError(f"returned {type(result).__name__} with no (B, {n}, D) output first")
        return out.detach(), returned

    outs, notes, start = [], [], 0
    try:
        plan = _cache_plan(T)
        library = s.new_cache()  # a Hugging Face layer's: an empty DynamicCache it fills
        if library is not None:
            cache, how = library, f"a {type(library).__name__} it fills"
            out, _ = cached(0, plan[0], cache)
        else:
            out, cache = cached(0, plan[0], None)
            how = "the cache it returns"
            if cache is None:  # no cache returned: a container the layer fills, passed in
                cache, how = {}, "a dict it fills"
                out, _ = cached(0, plan[0], cache)
                if not cache:
                    return skip(det, f"called with {name}=None (and use_cache=True where it takes it) the layer "
                                     f"returned no cache, and it did not fill a dict passed as {name}: the audit cannot "
                                     f"drive its cache (an object of its own type, or a cache kept inside the module)")
        filled = how != "the cache it returns"
        outs.append(out)
        start = plan[0]
        for n in plan[1:]:
            try:
                out, returned = cached(start, n, cache)
                got = [out]
            except Exception as error:
                if n == 1:
                    raise
                notes.append(f"it raised on {n} new tokens at once ({type(error).__name__}), so those were "
                             f"decoded one at a time")
                got = []
                for at in range(start, start + n):
                    out, returned = cached(at, 1, cache)
                    got.append(out)
                    cache = cache if filled else returned
            else:
                cache = cache if filled else returned
            if cache is None:
                return skip(det, f"the layer stopped returning a cache after {start} tokens")
            outs += got
            start += n
    except Exception as error:
        text = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return skip(det, f"decoding through {name} raised after {start} tokens ({type(error).__name__}: {text}); "
                         f"the audit passes {name}=None, then what the layer returned (or a dict it fills)")
    got = torch.cat(outs, dim=1)
    change = relative_change(got, expected, centred=True, scale_of=expected)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
    # the same rows computed twice without a cache (the first half alone, and within the full pass) differ by
    # the rounding of a recomputation, which sharp attention in half precision amplifies: a cached decode
    # must agree as well as that, within CACHE_NOISE_FACTOR
    P = plan[0]
    first = x[:, :P].contiguous()
    prefix = probe.call(first, first, first, probe.allowed(B, P, P), label=f"the first {P} tokens, no cache")
    if not prefix.ok:
        return not_run(det, prefix)
    noise = relative_change(prefix.output.out, expected[:, :P], centred=True, scale_of=expected)
    noise = 0.0 if noise is None else float(noise.max())
    tol = max(tolerance(ROW_SUM, s.dtype), CACHE_NOISE_FACTOR * noise)
    readings, at = [], 0
    for i, n in enumerate(plan):
        part = change[:, at:at + n]
        what = f"prefill of {n}" if i == 0 else f"{n} new token{'s' if n > 1 else ''} at t={at}"
        readings.append((what, int((part > tol).sum()), part.numel(), float(part.max())))
        at += n
    bad = [r for r in readings if r[1]]
    evidence = (f"through {name} ({how}): " + "; ".join(f"{what}: {b} / {total} rows differ from the full pass by up "
                                                           f"to {m:.3g}" for what, b, total, m in readings)
                + f" (up to {tol:.2g} of the outputs' RMS about their mean allowed: {tolerance(ROW_SUM, s.dtype):.2g} "
                  f"for {dtype_name(s.dtype)}, or {CACHE_NOISE_FACTOR:g}x the {noise:.2g} by which the first {P} "
                  f"tokens alone differ from the full pass without a cache)" + "".join(f"; {note}" for note in notes))
    return _judge(det, bool(bad), "decoding through the layer's cache differs from the full pass (from the "
                  f"{bad[0][0] if bad else ''})",
                  f"decoding through the layer's cache ({'+'.join(map(str, plan))} tokens) gives the full pass",
                  value=float(change.max()), threshold=tol, evidence=evidence)


PARAMETER_ENTRIES = 512
"""The finite differences move at most this many entries of each parameter tensor (all of a smaller one)."""

GRADIENT_AGREEMENT = 1e-9
"""|autograd - finite difference| / (|grad| |direction|) for the directional derivative of (out ** 2).sum() in
float64 (Richardson-extrapolated central differences at eps 1e-4 and 5e-5: ~1e-12 on smooth float64 layers;
correct layers measured at most 5.7e-13, benchmarks/margins.py). A detached softmax at GPT-2's std-0.02
initialisation measured 2.8e-7 at d_model 32, and 5.7e-9 at d_model 1 with two tokens: its q and k gradients
are small there."""


def _float64_twin(probe: Probe):
    """A float64 subject for the same layer (a deep copy of a module, so the user's layer is untouched)."""
    import copy

    from ._subject import make_subject

    s = probe.subject
    layer = s.layer if s.form == "function" else copy.deepcopy(s.layer).to(torch.float64)
    from ._subject import MASK_CONVENTIONS

    declared = getattr(s, "convention", None) if getattr(s, "convention_declared", False) else None
    twin = make_subject(layer, d_model=s.d_model, num_heads=s.num_heads, device=s.device, dtype=torch.float64,
                        mask=declared if declared in MASK_CONVENTIONS else None, layout=getattr(s, "layout", None))
    call, casts = twin._call, []

    def in_float64(*args):
        if casts and not any(casts):  # the first call cast nothing down: no need to watch every op
            return call(*args)
        with _KeepFloat64() as mode:
            result = call(*args)
        casts.append(mode.kept)
        return result

    twin._call = in_float64  # every call of the copy, the per-query path of key-padding layers included
    return twin


class _KeepFloat64(TorchDispatchMode):
    """Casts from float64 down to a lower precision stay float64: a layer that computes its softmax in float32
    on purpose (Hugging Face's eager Llama and Gemma: softmax(..., dtype=torch.float32)) would otherwise add
    float32 rounding to the float64 copy, and the finite differences, which divide by the step, would measure
    that noise (2.5e-7 of |grad| |direction| measured on a correct eager Llama layer) instead of the gradient."""

    kept = 0  # casts kept at float64

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (func is torch.ops.aten._to_copy.default and args and isinstance(args[0], Tensor)
                and args[0].dtype == torch.float64 and kwargs.get("dtype") in (torch.float32, torch.float16,
                                                                                torch.bfloat16)):
            kwargs["dtype"] = torch.float64
            self.kept += 1
        return func(*args, **kwargs)


def _graph_call(sub, q, k, v, allowed) -> Tensor:
    """Call `sub` and return its raw output with the autograd graph (Subject outputs are detached), laid out
    like the subject's output."""
    captured = []
    if isinstance(sub.layer, torch.nn.Module):
        handle = sub.layer.register_forward_hook(lambda m, a, out: captured.append(out))
        try:
            shown = sub(q, k, v, allowed).out
        finally:
            handle.remove()
    else:
        fn = sub.layer
        sub.layer = lambda *a, **kw: captured.append(fn(*a, **kw)) or captured[-1]
        try:
            shown = sub(q, k, v, allowed).out
        finally:
            sub.layer = fn
    raw = captured[-1] if captured else None
    raw = raw[0] if isinstance(raw, (tuple, list)) else raw
    def same(x):
        if x.shape != shown.shape:
            return False
        if x.data_ptr() == shown.data_ptr() and x.stride() == shown.stride() and x.dtype == shown.dtype:
            return True  # the returned tensor itself (detached)
        return torch.equal(x.detach().nan_to_num(), shown.nan_to_num())

    if isinstance(raw, Tensor) and not same(raw) and raw.dim() >= 2 and same(raw.transpose(0, 1)):
        raw = raw.transpose(0, 1)  # nn.MultiheadAttention without batch_first: (T, B, D)
    if not isinstance(raw, Tensor) or not same(raw):
        raise ValueError(f"could not find the layer's output in what its forward returned ({type(raw).__name__})")
    return raw


@detector("gradients", "gradients are right: autograd's directional derivative of (out ** 2).sum() matches finite "
          "differences in float64; for a causal layer no gradient flows from outputs to earlier positions' future "
          "inputs, and keys a padding mask blocks get none",
          targets=("detached softmax or attention under torch.no_grad()", "a custom autograd.Function with a wrong "
                   "backward", "a backward that lets the future in", "gradient reaching masked keys"),
          fix="compute attention with autograd on (no .detach(), no torch.no_grad()); check a custom backward with "
              "torch.autograd.gradcheck")
def check_gradients(probe: Probe) -> DetectorResult:
    det, s = "gradients", probe.subject
    B, T = probe.BATCH, min(probe.t, 6)  # gradient bugs do not need long sequences; keeps the cost constant
    try:
        sub = _float64_twin(probe)
    except Exception as error:  # a layer that cannot be copied or converted: say so
        return skip(det, f"no float64 copy of the layer could be made ({type(error).__name__}: {error})")
    gen = probe.generator()
    cross = s.separate_kv and not probe.causal
    draw = lambda: sub.make(gen, B, T)  # noqa: E731
    if s.form == "function":
        inputs = [draw(), draw(), draw()]
    elif cross:
        inputs = [draw(), draw()]
    else:
        inputs = [draw()]
    inputs = [x.requires_grad_(True) for x in inputs]
    qkv = (lambda xs: (xs[0], xs[1], xs[2]) if len(xs) == 3 else (xs[0], xs[1], xs[1]) if len(xs) == 2
           else (xs[0], xs[0], xs[0]))
    # where keys are an input apart from the queries, a padding mask: keys it blocks for every query must get
    # exactly zero gradient, read from the same backward pass
    # (only the last key, from T >= 3: every query keeps a choice of keys, which a detached softmax needs to show)
    padded = s.takes_mask and len(inputs) >= 2 and T >= 3
    allowed = probe.allowed(B, T, T, (torch.arange(T) < T - 1).expand(B, T, T) if padded else None)
    params = [p for p in (sub.layer.parameters() if isinstance(sub.layer, torch.nn.Module) else []) if p.requires_grad]
    probe.passes += 7  # forward + backward (counted as two), four forwards for the finite differences (six when
    # they disagree), causal: +3
    probe.shapes[det].append(ProbeShape(f"float64 copy, forward and backward (B={B}, T={T}"
                                        f"{', a padding mask' if padded else ''})", B, T, T,
                                        None if allowed is None else allowed.cpu(), len(inputs) == 1,
                                        backward=True))
    try:
        probe.seed_layer_rng()  # every call draws the same randomness (the audit restores the RNG)
        with torch.enable_grad():
            out = _graph_call(sub, *qkv(inputs), allowed)
    except Exception as error:
        return skip(det, f"the layer does not run as a float64 copy ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:160] if str(error) else ''}), and finite differences need "
                         f"float64; if it raises in its own dtype too, see `runs`")
    try:
        with torch.enable_grad():
            if out.grad_fn is None:
                if params:
                    return _result(det, "fail", "no gradient reaches the output: attention runs without autograd",
                                   value=0.0, threshold=0.0, evidence=f"the output has no grad_fn although the layer "
                                   f"has {len(params)} trainable parameters (torch.no_grad() or .detach() inside)")
                return DetectorResult(det, "skip", "not applicable: the layer has no trainable parameters and no "
                                                   "differentiable path")
            # inputs and parameters: a detached softmax hides little from the inputs' gradient of a layer whose
            # logits are tiny (std-0.02 weights), but everything from W_Q's and W_K's
            grads = torch.autograd.grad((out ** 2).sum(), inputs + params, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs + params, grads)]
        # finite everywhere iff the sum of squares is (float64: no overflow below 1e154), one pass each
        if not math.isfinite(float(sum(g.square().sum() for g in grads))):
            given = " with a padding mask" if padded else ""
            if not bool(torch.isfinite(out).all()):
                return _result(det, "fail", f"the output is NaN or inf on an ordinary input{given}, and so are its "
                               "gradients", value=math.inf, threshold=0.0,
                               evidence=f"float64 copy, B={B}, T={T}{given}: {int((~torch.isfinite(out)).sum())} "
                                        f"non-finite output values")
            return _result(det, "fail", f"gradients are NaN or inf on an ordinary input{given}", value=math.inf,
                           threshold=0.0, evidence="(out ** 2).sum() has a non-finite gradient w.r.t. the inputs or "
                                                   "parameters")
        # inputs: Gaussian draws over every entry; parameters: Gaussian draws at up to PARAMETER_ENTRIES entries
        # of each tensor, at pseudo-random places (a million-entry direction costs more than the whole check,
        # and a detached or wrong backward is wrong at almost every entry of the weights it misses)
        u_in = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device) for x in inputs]
        picks = []  # per parameter: (flat indices, direction there)
        with torch.no_grad():
            for p in params:
                if not p.is_contiguous():  # the float64 copy's own tensor: entries addressable through a flat view
                    p.data = p.data.contiguous()
        for p in params:
            k = min(p.numel(), PARAMETER_ENTRIES)
            # a low-discrepancy sequence of places (a permutation of a million entries costs more than the check)
            spread = torch.arange(k, dtype=torch.float64).mul_(0.6180339887498949).add_(float(torch.rand((), generator=gen)))
            index = spread.frac_().mul_(p.numel()).long().unique() if k < p.numel() else torch.arange(k)
            picks.append((index.to(p.device), torch.randn(len(index), generator=gen, dtype=torch.float64).to(p.device)))
        originals = [p.detach().reshape(-1)[i].clone() for p, (i, _) in zip(params, picks)]

        def loss_at(eps: float) -> float:
            # under grad mode, like the autograd call: torch's layers take fused fast paths without it
            probe.seed_layer_rng()
            with torch.no_grad():
                for p, p0, (i, d) in zip(params, originals, picks):
                    p.view(-1)[i] = p0 + eps * d  # the float64 copy's own parameters, never the user's
            try:
                with torch.enable_grad():
                    out = sub(*qkv([(x + eps * d).detach() for x, d in zip(inputs, u_in)]), allowed).out
                return float((out ** 2).sum())
            finally:
                with torch.no_grad():
                    for p, p0, (i, _) in zip(params, originals, picks):
                        p.view(-1)[i] = p0

        def central(eps: float) -> float:
            return (loss_at(eps) - loss_at(-eps)) / (2 * eps)

        # Richardson extrapolation of two central differences: error O(eps^4), so that a sharp softmax (an
        # unscaled T5-style layer: 1.6e-3 off with one difference at eps 1e-5) is measured to ~1e-10
        eps = 1e-4
        coarse, fine = central(eps), central(eps / 2)
        fd = (4 * fine - coarse) / 3
        # the gradient along the direction: every entry of the inputs', the picked entries of the parameters'
        g_dir = grads[:len(inputs)] + [g.reshape(-1)[i] for g, (i, _) in zip(grads[len(inputs):], picks)]
        u = u_in + [d for _, d in picks]
        ad = float(sum((g * d).sum() for g, d in zip(g_dir, u)))
        # relative to |grad| |u| on the direction's support, the most the directional derivative can be (it may
        # be small by cancellation)
        scale = max(math.sqrt(float(sum((g * g).sum() for g in g_dir)) * float(sum((d * d).sum() for d in u))), 1e-300)
        rel = abs(fd - ad) / scale
        limit = GRADIENT_AGREEMENT
        if rel > limit:
            # a layer that computes inside in float32 (a softmax upcast to float32 is common) makes the finite
            # differences themselves noisy: two extrapolations from different step sizes disagree by that noise
            fd_fine = (4 * central(eps / 4) - fine) / 3
            limit = max(GRADIENT_AGREEMENT, 30 * abs(fd_fine - fd) / scale)
        evidence = (f"along a pseudo-random direction of the inputs and parameters, autograd gives {ad:.6g} and extrapolated central "
                    f"differences {fd:.6g}: disagreement {rel:.2g} of |grad| |direction| (up to {limit:.2g} "
                    f"allowed: {GRADIENT_AGREEMENT:.0e}, or 30x the finite differences' own noise)")
        if rel > limit:
            return _result(det, "fail", "autograd's gradient disagrees with the layer's own finite differences "
                           "(a detached or hand-written backward)", value=rel, threshold=limit,
                           evidence=evidence)
        if probe.causal and T >= 2:
            leak = _future_gradient(probe, sub, inputs, qkv, allowed)
            if leak:
                return _result(det, "fail", "the gradient lets the future in: past outputs send gradient to later "
                               "inputs", value=1.0, threshold=0.0, evidence=leak + "; " + evidence)
        checked = ""
        if padded:
            leak, checked = _masked_key_gradient(sub, inputs, grads[1:len(inputs)], allowed)
            if leak:
                return _result(det, "fail", "masked keys receive gradient: the mask is applied after the softmax "
                               "normalised over them, or not at all", value=1.0, threshold=0.0,
                               evidence=leak + "; " + evidence)
        evidence += checked
    except Exception as error:  # the layer raised on float64 or in backward: a finding about its gradients
        return _result(det, "fail", f"the backward pass (or the float64 copy) raised: {type(error).__name__}",
                       value=None, evidence=str(error).splitlines()[0][:200] if str(error) else "",
                       fix="make the layer differentiable in float64 (the check that catches wrong backwards)")
    return _result(det, "pass", "gradients agree with finite differences" + (" and do not flow from the past to "
                   "the future" if probe.causal else ""), value=rel, threshold=limit, evidence=evidence)


def _masked_key_gradient(sub, inputs, grads, allowed) -> tuple[str, str]:
    """('', what was checked) if the key and value inputs got exactly zero gradient at the keys `allowed` blocks
    for every query; else (the evidence, '')."""
    t_dim = sub.time_dim
    B, T = inputs[1].shape[0], inputs[1].shape[t_dim]
    blocked = ~allowed.cpu().any(1)  # (B, Tk): keys no query may attend
    if not bool(blocked.any()):
        return "", ""
    for name, g in zip(("key", "value") if len(inputs) == 3 else ("key/value input",), grads):
        at = g.movedim(t_dim, -2).abs().amax(-1) if g.dim() > t_dim + 1 else g.abs()  # (B, [H,] Tk)
        at = at.reshape(B, -1, T).amax(1)  # (B, Tk)
        worst = float(at[blocked.to(g.device)].max())
        if worst > 1e-12 * max(float(g.abs().max()), 1e-300):
            return (f"(out ** 2).sum() has gradient up to {worst:.3g} w.r.t. {name} positions a padding mask blocks "
                    f"for every query ({int(blocked.sum())} of them; must be exactly 0)"), ""
    return "", f"; {int(blocked.sum())} keys a padding mask blocks get exactly zero gradient"


def _future_gradient(probe: Probe, sub, inputs, qkv, allowed) -> str:
    """'' if outputs up to the middle send no gradient to later inputs, else the evidence."""
    t_dim = sub.time_dim
    T = inputs[0].shape[t_dim]
    c = (T - 1) // 2
    probe.seed_layer_rng(0)
    with torch.enable_grad():
        out = _graph_call(sub, *qkv(inputs), allowed)
        grads = torch.autograd.grad((out.narrow(t_dim, 0, c + 1) ** 2).sum(), inputs, allow_unused=True)
    for name, x, g in zip(("query", "key", "value") if len(inputs) == 3 else ("input",), inputs, grads):
        if g is None:
            continue
        later = g.narrow(t_dim, c + 1, T - c - 1).abs().max()
        if float(later) > 1e-12 * max(float(g.abs().max()), 1e-300):
            return (f"(out[:, :{c + 1}] ** 2).sum() has gradient up to {float(later):.3g} w.r.t. {name} positions "
                    f"after t={c} (must be exactly 0)")
    return ""
