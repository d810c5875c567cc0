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

from ._core import Case, Comparison, Inputs, allowed_text, compare, held, not_run, perturbed, relative_change, skip
from ._observe import applied_scales
from ._probe import Call, Probe
from ._registry import CAUSAL, DETECTORS, LONG, SEPARATE_QUERY, TAKES_MASK, detector
from ._result import DetectorResult
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
    if s.separate_kv:
        run(f"Tq={T}, Tk={T + 3}", B, T, T + 3, cross=True)
    if s.takes_mask:
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
    return _result(det, "pass", f"ran on all {len(own)} shapes ({', '.join(shape.label for shape in own)}) and on "
                                f"every other detector's probe", value=0.0, threshold=0.0)


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
    estimates = [(e.applied, e.d_k, e.source) for e in applied_scales(base.record)] if base.record else []
    if not estimates and probe.subject.form == "function":
        weights, source = ((base.output.weights, "returned weights") if base.output.weights is not None
                           else probe.recovered_weights())
        if weights is not None:
            estimates = [(s, d, f"log-weights vs q·k of the {source}")
                         for s, d in _log_weight_scale(weights, base.query, base.key)]
    if not estimates:
        return skip(det, "no softmax over q·k and no fused attention call was observed, and no weights to fit")
    rows = []
    for applied, d_k, source in estimates:
        expected = probe.scale if probe.scale is not None else 1.0 / math.sqrt(d_k)
        rows.append((applied / expected, applied, expected, d_k, source))
    ratio, applied, expected, d_k, source = max(rows, key=lambda r: abs(math.log(abs(r[0]) or 1e-300)))
    declared = "the declared scale" if probe.scale is not None else f"1/sqrt(d_k) (d_k={d_k})"
    evidence = (f"q·k is multiplied by {applied:.4g} before the softmax ({source}); expected {expected:.4g} = "
                f"{declared}; ratio {ratio:.3g} (allowed {1 / SCALE_RATIO:.2f} to {SCALE_RATIO:.2f})"
                f"{_entropy_text(base)}")
    if ratio > SCALE_RATIO:
        return _result(det, "fail", f"softmax is {ratio:.2f}x too sharp: logits are not scaled by {declared}",
                       value=ratio, threshold=SCALE_RATIO, evidence=evidence)
    if ratio < 1 / SCALE_RATIO:
        return _result(det, "fail", f"softmax is {1 / ratio:.2f}x too flat: logits are scaled by more than {declared}",
                       value=ratio, threshold=1 / SCALE_RATIO, evidence=evidence)
    return _result(det, "pass", f"softmax temperature matches {declared} (ratio {ratio:.4f})", value=ratio,
                   threshold=SCALE_RATIO, evidence=evidence,
                   margin=f"correct layers measured |ratio - 1| <= {MEASURED_SCALE_ERROR:.1e}")


def _entropy_text(call: Call) -> str:
    if call.record is None or not call.record.softmaxes:
        return ""
    w = call.record.softmaxes[-1].output.float()
    w = w.reshape(-1, w.shape[-1])[:4096]  # a sample of rows
    ent = -(w * w.clamp_min(1e-30).log()).sum(-1)
    return f"; mean weight entropy {float(ent.mean()):.3g} nats (uniform over {w.shape[-1]} keys: {math.log(w.shape[-1]):.3g})"


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
    return _judge(det, bool(bad), f"outputs depend on keys the mask blocks ({', '.join(bad)})",
                  "keys the mask blocks have no effect (padding and causal masks)",
                  value=max(w for _, _, w, _, _ in readings), threshold=results[0][1].tol,
                  evidence="; ".join(f"{name} mask: {text}" for name, _, _, text, _ in readings))


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


@detector("future_leakage", "for a causal layer, changing tokens after t leaves outputs at and before t unchanged",
          targets=("missing causal mask", "heads merged without transpose in a decoder"),
          fix="mask scores with causal_mask(Tq, Tk, align='bottom_right') before the softmax",
          needs=(CAUSAL, LONG))
def check_future_leakage(probe: Probe) -> DetectorResult:
    det, s, B, T = "future_leakage", probe.subject, probe.BATCH, probe.t
    cuts = sorted({0, T // 3, (2 * T) // 3, T - 2})
    base = Inputs(*probe.streams(B, T, cross=s.form == "function"))
    t = torch.arange(T)
    cases = [Case(x, hold=_rows(B, T, t <= c), move=_rows(B, T, t > c),
                  when=f"when only t>={c + 1} was perturbed (x{gain:g})")
             for c in cuts
             for gain, x in zip(_gains(probe), perturbed(probe, base, t > c, ("query", "key", "value"), gains=_gains(probe)))]
    comparison = compare(probe, base, cases, label=f"tokens after t in {cuts} changed")
    return _judge_held(det, comparison, probe, what="past outputs", fail_message="outputs depend on future tokens",
                       pass_message=f"no output moved when only later tokens changed (cuts at t={cuts})")


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
    t_q = max(1, T // 2)
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
