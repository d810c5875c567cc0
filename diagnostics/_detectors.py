"""The detectors: one property of every correct attention layer each, measured from outside the layer
(and, where outside is blind, from the operations it was observed to run).

Each check takes a `Probe` and returns a `DetectorResult`. None of them knows any implementation: they
ask what every softmax attention must satisfy, whatever its code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._observe import applied_scales
from ._probe import Call, Probe, batched, perturb
from ._result import Detector, DetectorResult
from ._thresholds import (MEASURED_ROW_SUM, MEASURED_SCALE_ERROR, ROW_SUM, SCALE_RATIO, UNCHANGED, dtype_name,
                          tolerance)

# ---- evidence helpers ------------------------------------------------------------------------------


def _where(index: tuple[int, ...], names: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip(names, index)) + ")"


def _names(probe: Probe, ndim: int) -> tuple[str, ...]:
    """Index names for per-position tensors: (b, t) for modules, (b, h, t) for functions."""
    return ("b", "t") if ndim == 2 else ("b", "h", "t") if ndim == 3 else tuple(f"i{k}" for k in range(ndim))


def _per_position(x: Tensor) -> Tensor:
    """Collapse the feature dimension: (B, T, D) -> (B, T); (B, H, T, d) -> (B, H, T)."""
    return x.amax(dim=-1)


def _change(new: Tensor, old: Tensor) -> Tensor:
    """Per-position relative change: |new - old| / max(1, max|old|), NaN where either is not finite."""
    wide = torch.float64 if old.dtype == torch.float64 else torch.float32
    finite = old[torch.isfinite(old)]
    scale = float(finite.abs().max().clamp_min(1.0)) if finite.numel() else 1.0
    diff = (new.to(wide) - old.to(wide)).abs() / scale
    return _per_position(diff.nan_to_num(nan=math.inf))


def _allowed_text(tol: float, dtype) -> str:
    return f"up to {tol:.0e} allowed for {dtype_name(dtype)}"


def _count_changed(change: Tensor, must_hold: Tensor, tol: float, probe: Probe, what: str, when: str):
    """Evidence for 'these positions must not move': (n_changed, worst, text)."""
    must_hold = must_hold.expand_as(change)
    checked = change[must_hold]
    total = int(must_hold.sum())
    bad = int((checked > tol).sum())
    if total == 0:
        return 0, 0.0, "no positions to check"
    worst_value = float(checked.max())
    masked = torch.where(must_hold, change, torch.full_like(change, -1.0))
    idx = tuple(int(i) for i in torch.unravel_index(masked.argmax(), change.shape))
    where = _where(idx, _names(probe, change.dim()))
    worst = "inf (non-finite)" if math.isinf(worst_value) else f"{worst_value:.3g}"
    text = (f"{bad} / {total} {what} changed ({100 * bad / total:.1f}%); greatest change {worst} at {where} "
            f"{when} ({_allowed_text(tol, probe.subject.dtype)})")
    return bad, worst_value, text


def _result(det: str, verdict: str, message: str, **kw) -> DetectorResult:
    return DetectorResult(det, verdict, message, fix=kw.pop("fix", DETECTORS[det].fix if det in DETECTORS else ""),
                          **kw)


def _judge(det: str, failed: bool, fail_message: str, pass_message: str, **kw) -> DetectorResult:
    """The common ending: fail with one message or pass with the other, the same measurements either way."""
    return _result(det, "fail" if failed else "pass", fail_message if failed else pass_message, **kw)


def _skip(det: str, reason: str) -> DetectorResult:
    return DetectorResult(det, "skip", f"not measured: {reason}")


def _failed_call(det: str, call: Call) -> DetectorResult:
    return _skip(det, f"the layer did not run on this probe ({call.describe_error()}); see `runs`")


def _split(x: Tensor, parts: int) -> list[Tensor]:
    return list(x.chunk(parts, dim=0))


def _time_index(per_position: Tensor) -> Tensor:
    """Time index of a per-position tensor (time is its last dimension)."""
    return torch.arange(per_position.shape[-1], device=per_position.device)


# ---- the checks ------------------------------------------------------------------------------------


def check_runs(probe: Probe) -> DetectorResult:
    s, B, T = probe.subject, probe.BATCH, probe.t
    cases: list[tuple[str, Call]] = [("the standard probe (B=2, T=%d)" % T, probe.base())]

    def run(label, batch, t_q, t_k=None, **kw):
        q, k, v = probe.streams(40 + len(cases), batch, t_q, t_k, **kw)
        cases.append((label, probe.call(q, k, v, probe.allowed(batch, t_q, t_k or t_q))))

    run("B=1", 1, T)
    run("T=1", B, 1)
    if s.form == "function":
        run("H=1", B, T, heads=1)
    # non-contiguous inputs: the same values laid out transposed in memory
    q, k, v = probe.streams(50, B, T)
    nc = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
    nc = [nc[0]] * 3 if q is k else nc
    cases.append(("non-contiguous inputs", probe.call(*nc, probe.allowed(B, T, T))))
    failed = [(label, c) for label, c in cases if not c.ok]
    if failed:
        listed = "; ".join(f"{label}: {c.describe_error()}" for label, c in failed)
        return _result("runs", "fail", f"the layer raised on {len(failed)} / {len(cases)} probes",
                       value=float(len(failed)), threshold=0.0, evidence=listed,
                       fix=DETECTORS["runs"].fix)
    return _result("runs", "pass", f"ran on all {len(cases)} probes ({', '.join(l for l, _ in cases)})",
                   value=0.0, threshold=0.0)


def check_output_shape(probe: Probe) -> DetectorResult:
    s, B, T = probe.subject, probe.BATCH, probe.t
    base = probe.base()
    if not base.ok:
        return _failed_call("output_shape", base)
    checks = [("the standard probe", base, s.expected_out_shape(B, T))]
    if s.separate_kv:
        t_k = T + 3  # Tq != Tk: a cross-attention (or cached-decoding) call
        q, k, v = probe.streams(60, B, T, t_k, cross=True)
        call = probe.call(q, k, v, probe.allowed(B, T, t_k))
        if call.ok:
            checks.append((f"query length {T}, memory length {t_k}", call, s.expected_out_shape(B, T)))
    wrong = [(label, tuple(c.output.out.shape), want) for label, c, want in checks if tuple(c.output.out.shape) != want]
    if wrong:
        text = "; ".join(f"{label}: output {got}, expected {want}" for label, got, want in wrong)
        return _result("output_shape", "fail", "the output has the wrong shape", evidence=text)
    return _result("output_shape", "pass", "output shape is (B, Tq, ...) " + ", ".join(
        f"{tuple(c.output.out.shape)}" for _, c, _ in checks))


def check_finite_output(probe: Probe) -> DetectorResult:
    base = probe.base()
    if not base.ok:
        return _failed_call("finite_output", base)
    out = base.output.out
    bad = ~torch.isfinite(out)
    if bad.any():
        idx = tuple(int(i) for i in torch.unravel_index(bad.flatten().nonzero()[0, 0], out.shape))
        return _result("finite_output", "fail", "the output has NaN or inf on an ordinary input",
                       value=float(bad.sum()), threshold=0.0,
                       evidence=f"{int(bad.sum())} / {out.numel()} output values are NaN/inf; first at {idx}")
    return _result("finite_output", "pass", f"all {out.numel()} outputs are finite", value=0.0, threshold=0.0)


def _weights_from(call: Call, t_q: int, t_k: int) -> tuple[Tensor | None, str]:
    """The attention weights: returned by the layer, else the last observed softmax over (Tq, Tk) scores."""
    if call.output is not None and call.output.weights is not None:
        w = call.output.weights
        if tuple(w.shape[-2:]) == (t_q, t_k):
            return w, "returned weights"
    if call.record is not None:
        for sm in reversed(call.record.softmaxes):
            if tuple(sm.output.shape[-2:]) == (t_q, t_k):
                return sm.output, f"observed softmax output (dim={sm.dim})"
    return None, ""


def check_weight_row_sums(probe: Probe) -> DetectorResult:
    s, B, T = probe.subject, probe.BATCH, probe.t
    det = "weight_row_sums"
    if s.takes_mask:  # blocked keys are where a mask applied after the softmax shows
        q, k, v = probe.streams(70, B, T)
        allowed = probe.allowed(B, T, T, probe.padding(B, T, T))
        call = probe.call(q, k, v, allowed)
        if call.ok and call.output.weights is None:  # look inside only when the layer returns no weights
            call = probe.call(q, k, v, allowed, observe=True)
    else:
        call = probe.base()
    if not call.ok:
        return _failed_call(det, call)
    weights, source = _weights_from(call, T, T)
    if weights is None:
        return _skip(det, "the layer returns no (..., Tq, Tk) weights and no softmax over them was observed")
    if weights.numel() % (B * T * T):
        return _skip(det, f"weights of shape {tuple(weights.shape)} do not split into batch {B}")
    w = weights.double().reshape(B, -1, T, T)  # (B, heads or 1, Tq, Tk)
    allowed = call.allowed if call.allowed is not None else torch.ones(B, T, T, dtype=torch.bool)
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
                         f"keys; worst row {_where(idx, names)} sums to {float(sums[idx]):.4g} "
                         f"(|sum - 1| {_allowed_text(tol, s.dtype)})")
        if negative.any():
            idx = tuple(int(i) for i in torch.unravel_index(w.argmin(), w.shape))
            parts.append(f"{int(negative.sum())} weights are negative, the least {float(w.min()):.3g} at "
                         f"{_where(idx, names + ('k',))}")
        return _result(det, "fail", f"attention weights are not a distribution over keys ({source})",
                       value=worst, threshold=tol, evidence="; ".join(parts))
    return _result(det, "pass", f"all {total} weight rows sum to 1 and no weight is negative ({source})",
                   value=worst, threshold=tol, margin=_row_sum_margin(s.dtype))


def _row_sum_margin(dtype) -> str:
    measured = MEASURED_ROW_SUM.get(dtype)
    return f"correct layers measured <= {measured:.1e} at {dtype_name(dtype)}" if measured is not None else ""


def _log_weight_scale(call: Call, probe: Probe) -> list[tuple[float, int]]:
    """For a function returning weights: fit log w = s * (q . k) + c per row; returns [(s, d_k)]."""
    w = call.output.weights
    q, k = call.query, call.key
    if w is None or q.dim() != 4 or tuple(w.shape) != (q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
        return []
    qk = (q.double() @ k.double().transpose(-2, -1))  # (B, H, Tq, Tk)
    logw = w.double().log()
    ok = torch.isfinite(logw) & (w > 0)
    if ok.sum() < 4:
        return []
    n = ok.sum(-1, keepdim=True).clamp_min(1)
    mean = lambda x: torch.where(ok, x, 0).sum(-1, keepdim=True) / n  # noqa: E731
    dq, dl = torch.where(ok, qk - mean(qk), 0), torch.where(ok, logw - mean(logw), 0)
    denom = float((dq * dq).sum())
    return [(float((dq * dl).sum()) / denom, int(q.shape[-1]))] if denom > 0 else []


def check_softmax_saturation(probe: Probe) -> DetectorResult:
    det = "softmax_saturation"
    base = probe.base()
    if not base.ok:
        return _failed_call(det, base)
    estimates = [(e.applied, e.d_k, e.source) for e in applied_scales(base.record)] if base.record else []
    if not estimates and probe.subject.form == "function":
        estimates = [(s, d, "log-weights vs q·k of the returned weights") for s, d in _log_weight_scale(base, probe)]
    if not estimates:
        return _skip(det, "no softmax over q·k and no fused attention call was observed, and no weights to fit")
    rows = []
    for applied, d_k, source in estimates:
        expected = probe.scale if probe.scale is not None else 1.0 / math.sqrt(d_k)
        ratio = applied / expected if expected else math.inf
        rows.append((ratio, applied, expected, d_k, source))
    ratio, applied, expected, d_k, source = max(rows, key=lambda r: abs(math.log(abs(r[0]) or 1e-300)))
    declared = "the declared scale" if probe.scale is not None else f"1/sqrt(d_k) (d_k={d_k})"
    entropy = _entropy_text(base)
    evidence = (f"q·k is multiplied by {applied:.4g} before the softmax ({source}); expected {expected:.4g} = "
                f"{declared}; ratio {ratio:.3g} (allowed {1 / SCALE_RATIO:.2f} to {SCALE_RATIO:.2f}){entropy}")
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


def check_output_variance(probe: Probe) -> DetectorResult:
    """A convex combination of values: identical value rows come out unchanged, outputs stay within the values."""
    det = "output_variance"
    s, B, T = probe.subject, probe.BATCH, probe.t
    tol = max(tolerance(UNCHANGED, s.dtype), tolerance(ROW_SUM, s.dtype))
    if s.form == "function":
        q, k, _ = probe.streams(80, B, T, cross=True)
        row = probe.make(83, B, 1)  # (B, H, 1, d)
        v = row.expand_as(k).contiguous()  # (B, H, T, d): every value row identical
        call = probe.call(q, k, v, probe.allowed(B, T, T))
        if not call.ok:
            return _failed_call(det, call)
        expected = row.expand_as(call.output.out) if call.output.out.shape == q.shape else None
        if expected is None:
            return _skip(det, f"output shape {tuple(call.output.out.shape)} is not the query's")
        change = _change(call.output.out, expected)
        what = "output rows differ from the one value row"
    elif getattr(s, "extra_keys", False):
        return _skip(det, "the layer appends a learned or zero key (add_bias_kv / add_zero_attn) that identical "
                          "inputs do not reach, so outputs legitimately depend on how many tokens there are")
    else:
        token = probe.make(81, B, 1)  # (B, 1, D)
        same = token.expand(B, T, s.d_model).contiguous()  # (B, T, D): T identical tokens
        if s.separate_kv and not probe.causal:  # queries differ, memory is T copies of one token
            query = probe.make(82, B, T)
            call = probe.call(query, same, same, probe.allowed(B, T, T))
            # one query over that one token: every output row must equal its output (Tq = 1 also keeps
            # a wrong head merge from disguising the reference)
            reference = probe.call(query[:, :1].clone(), token, token, probe.allowed(B, 1, 1))
        else:
            call = probe.call(same, same, same, probe.allowed(B, T, T))
            reference = probe.call(token, token, token, probe.allowed(B, 1, 1))  # that one token alone
        for c in (call, reference):
            if not c.ok:
                return _failed_call(det, c)
        got, ref = call.output.out, reference.output.out
        if got.dim() != 3 or ref.dim() != 3 or ref.shape[1] != 1 or ref.shape[::2] != got.shape[::2]:
            return _skip(det, f"output shapes {tuple(got.shape)} and {tuple(ref.shape)} do not allow the comparison")
        change = _change(got, ref.expand_as(got))
        what = "output rows differ from the output for that one token"
    everywhere = torch.ones_like(change, dtype=torch.bool)
    bad, worst, text = _count_changed(change, everywhere, tol, probe, what,
                                      "when every value row is the same vector")
    if bad:
        return _result(det, "fail", "the output is not a convex combination of the values (weights do not sum to 1)",
                       value=worst, threshold=tol, evidence=text)
    bound = _bound_check(probe, tol) if s.form == "function" else None
    if bound is not None:
        return bound
    return _result(det, "pass", "identical value rows come out unchanged", value=worst, threshold=tol, evidence=text)


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


def check_query_locality(probe: Probe) -> DetectorResult:
    det = "query_locality"
    s, B, T = probe.subject, probe.BATCH, probe.t
    if not s.separate_kv:
        return _skip(det, "the layer takes one input stream; a query cannot change without its key")
    if T < 2:
        return _skip(det, "needs seq_len >= 2")
    q, k, v = probe.streams(90, B, T, cross=True)
    p = T // 2
    moved = torch.arange(T) == p
    q2 = perturb(q, moved, s.time_dim, probe.generator(91))
    K = batched(k, k)
    V = K if v is k else batched(v, v)
    call = probe.call(batched(q, q2), K, V, probe.allowed(2 * B, T, T))
    if not call.ok:
        return _failed_call(det, call)
    out = call.output.out
    if out.shape[0] != 2 * B or out.dim() < 3 or out.shape[-2 if s.form == "function" else 1] != T:
        return _skip(det, f"output shape {tuple(out.shape)} has no row per query (see output_shape)")
    old, new = _split(out, 2)
    change = _change(new, old)
    others = _time_index(change) != p
    bad, worst, text = _count_changed(change, others, tolerance(UNCHANGED, s.dtype), probe,
                                      "other output rows", f"when only query t={p} changed")
    return _judge(det, bad > 0, "an output row depends on other queries than its own",
                  "each output row depends only on its own query", value=worst,
                  threshold=tolerance(UNCHANGED, s.dtype), evidence=text)


def check_mask_honoured(probe: Probe) -> DetectorResult:
    det = "mask_honoured"
    s, B, T = probe.subject, probe.BATCH, probe.t
    if not s.takes_mask:
        return _skip(det, "the layer takes no mask argument")
    if T < 2:
        return _skip(det, "needs seq_len >= 2")
    pad = probe.padding(B, T, T)  # (B, Tq, Tk)
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    cut = (T - 1) // 2
    causal = (j <= i).expand(B, T, T)  # (B, Tq, Tk)
    padded_keys = ~pad[:, 0, :]  # (B, Tk): the keys the padding mask blocks
    future_keys = (j > cut).expand(B, T)  # (B, Tk): keys after the cut, blocked for rows <= cut
    q, k, v = probe.streams(100, B, T)
    one_stream = q is k
    gen = probe.generator(101)

    def changed(x, keys):
        return perturb(x, keys, s.time_dim, gen)

    variants = []  # (inputs, mask, keys perturbed)
    for mask, keys in ((pad, padded_keys), (causal, future_keys)):
        if one_stream:
            x2 = changed(q, keys)
            variants.append(((q, q, q), mask, keys))
            variants.append(((x2, x2, x2), mask, keys))
        else:
            k2 = changed(k, keys)
            v2 = k2 if v is k else changed(v, keys)
            variants.append(((q, k, v), mask, keys))
            variants.append(((q, k2, v2), mask, keys))
    Q = batched(*(x[0] for x, _, _ in variants))
    K = Q if one_stream else batched(*(x[1] for x, _, _ in variants))
    V = K if (one_stream or v is k) else batched(*(x[2] for x, _, _ in variants))
    extra = batched(*(m for _, m, _ in variants))
    allowed = probe.allowed(len(variants) * B, T, T, extra)
    call = probe.call(Q, K, V, allowed)
    if not call.ok:
        return _failed_call(det, call)
    out = call.output.out
    if out.shape[0] != len(variants) * B:
        return _skip(det, f"output shape {tuple(out.shape)} does not keep the batch")
    chunks = _split(out, len(variants))
    allowed_chunks = _split(allowed.cpu(), len(variants))
    tol = tolerance(UNCHANGED, s.dtype)
    reports = []
    for n, (label, when) in enumerate((("padding", "when only padded keys changed"),
                                        ("causal", f"when only keys after t={cut} changed"))):
        old, new = chunks[2 * n], chunks[2 * n + 1]
        keys = variants[2 * n][2]  # (B, Tk)
        a = allowed_chunks[2 * n]  # (B, Tq, Tk)
        # rows that must not move: they may attend some key, and none of the changed ones
        hold = a.any(-1) & ~(a & keys.unsqueeze(1)).any(-1)  # (B, Tq)
        if one_stream:
            hold &= ~keys  # in self-attention the changed positions are also changed queries
        change = _change(new, old)
        hold = hold.to(change.device).view(B, *([1] * (change.dim() - 2)), T)
        reports.append((label, *_count_changed(change, hold, tol, probe, "outputs", when)))
    bad = [(label, b, w, t) for label, b, w, t in reports if b]
    evidence = "; ".join(f"{label} mask: {t}" for label, _, _, t in reports)
    worst = max(w for _, _, w, _ in reports)
    return _judge(det, bool(bad), "outputs depend on keys the mask blocks (" + ", ".join(b[0] for b in bad) + ")",
                  "keys the mask blocks have no effect (padding and causal masks)",
                  value=worst, threshold=tol, evidence=evidence)


def check_fully_masked_rows(probe: Probe) -> DetectorResult:
    det = "fully_masked_rows"
    s, B, T = probe.subject, probe.BATCH, probe.t
    if not s.takes_mask:
        return _skip(det, "the layer takes no mask argument")
    r = T // 2
    extra = torch.ones(B, T, T, dtype=torch.bool)
    extra[0, r, :] = False  # batch 0, query r may attend nothing
    q, k, v = probe.streams(110, B, T)
    call = probe.call(q, k, v, probe.allowed(B, T, T, extra))
    if not call.ok:
        return _failed_call(det, call)
    out = call.output.out
    finite = _per_position(torch.isfinite(out).to(torch.int8)).bool()  # (B, T) or (B, H, T)
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
                                f"poison the loss and the gradients unless such rows are dropped",
                       fix=DETECTORS[det].fix)
    return _result(det, "pass", "a query with no key to attend gives a finite output", value=0.0, threshold=0.0)


def check_future_leakage(probe: Probe) -> DetectorResult:
    det = "future_leakage"
    s, B, T = probe.subject, probe.BATCH, probe.t
    if not probe.causal:
        return _skip(det, "the layer is not audited as causal (pass causal=True)")
    if T < 2:
        return _skip(det, "needs seq_len >= 2")
    cuts = sorted({0, T // 3, (2 * T) // 3, T - 2})
    q, k, v = probe.streams(120, B, T, cross=s.form == "function")
    one_stream = q is k
    gen = probe.generator(121)
    qs, ks, vs = [q], [k], [v]
    for c in cuts:
        later = torch.arange(T) > c
        if one_stream:
            x = perturb(q, later, s.time_dim, gen)
            qs.append(x), ks.append(x), vs.append(x)
        else:
            qs.append(perturb(q, later, s.time_dim, gen))
            ks.append(perturb(k, later, s.time_dim, gen))
            vs.append(perturb(v, later, s.time_dim, gen))
    Q = batched(*qs)
    K, V = (Q, Q) if one_stream else (batched(*ks), batched(*vs))
    n = len(qs)
    call = probe.call(Q, K, V, probe.allowed(n * B, T, T))
    if not call.ok:
        return _failed_call(det, call)
    out = call.output.out
    if out.shape[0] != n * B:
        return _skip(det, f"output shape {tuple(out.shape)} does not keep the batch")
    chunks = _split(out, n)
    changes, holds = [], []
    for c, new in zip(cuts, chunks[1:]):
        change = _change(new, chunks[0])
        changes.append(change)
        holds.append(_time_index(change) <= c)
    change = torch.stack(changes)  # (cuts, B, [H,] T)
    hold = torch.stack([h.expand_as(changes[0]) for h in holds])
    tol = tolerance(UNCHANGED, s.dtype)
    total = int(hold.sum())
    checked = change[hold]
    bad = int((checked > tol).sum())
    worst = float(checked.max()) if total else 0.0
    idx = tuple(int(i) for i in torch.unravel_index(torch.where(hold, change, -1.0).argmax(), change.shape))
    cut = cuts[idx[0]]
    where = _where(idx[1:], _names(probe, change.dim() - 1))
    text = (f"{bad} / {total} past outputs changed ({100 * bad / max(total, 1):.1f}%); greatest change "
            f"{worst:.3g} at {where} when only t>={cut + 1} was perturbed ({_allowed_text(tol, s.dtype)})")
    return _judge(det, bad > 0, "outputs depend on future tokens",
                  f"no output moved when only later tokens changed (cuts at t={cuts})",
                  value=worst, threshold=tol, evidence=text)


def check_causal_alignment(probe: Probe) -> DetectorResult:
    det = "causal_alignment"
    s, B, T = probe.subject, probe.BATCH, probe.t
    if not probe.causal:
        return _skip(det, "the layer is not audited as causal (pass causal=True)")
    if s.separate_kv:
        t_q = max(1, T // 2)  # cached decoding: the last t_q positions query all T keys
        if s.form == "function":
            q = probe.make(130, B, t_q)
            k, v = probe.make(131, B, T), probe.make(132, B, T)
        else:
            k = v = probe.make(131, B, T)
            q = k[:, T - t_q:].clone()
        newest = torch.arange(T) == T - 1
        gen = probe.generator(133)
        # A blocked key moves nothing. A visible one moves the output, and a large change of it in both
        # directions makes one draw's logit dominate, so a correct layer moves far above rounding noise.
        k_new = perturb(k, newest, s.time_dim, gen)
        v_new = k_new if v is k else perturb(v, newest, s.time_dim, gen)
        gains = (1.0, 100.0, -100.0)
        ks = [k] + [k + c * (k_new - k) for c in gains]
        vs = ks if v is k else [v] + [v + c * (v_new - v) for c in gains]
        K = batched(*ks)
        V = K if v is k else batched(*vs)
        n = len(ks)
        call = probe.call(batched(*[q] * n), K, V, probe.allowed(n * B, t_q, T))
        if not call.ok:
            return _failed_call(det, call)
        chunks = _split(call.output.out, n)
        change = torch.stack([_change(new, chunks[0]) for new in chunks[1:]]).amax(0)  # (B, [H,] Tq)
        last = change[..., -1]  # the newest query, at position T - 1
        tol = tolerance(UNCHANGED, s.dtype)
        if bool((last <= tol).any()):
            return _result(det, "fail", "the newest query does not see the newest key (causal mask misaligned "
                           "or blocking the diagonal)", value=float(last.min()), threshold=tol,
                           evidence=f"with {t_q} queries at positions {T - t_q}..{T - 1} over {T} keys, changing "
                                    f"key {T - 1} (by up to 100x, both signs) moved the output of query {T - 1} by "
                                    f"at most {float(last.min()):.3g} in some row (more than {tol:.0e} expected for "
                                    f"{dtype_name(s.dtype)}): query i must see keys <= i + Tk - Tq, its own "
                                    f"position included")
        return _result(det, "pass", f"the newest of {t_q} queries sees the newest of {T} keys (bottom-right)",
                       value=float(last.min()), threshold=tol)
    base = probe.base()
    if not base.ok:
        return _failed_call(det, base)
    weights, source = _weights_from(base, T, T)
    if weights is None:
        return _skip(det, "one input stream and no weights: a key cannot change without its query")
    diag = weights.double().diagonal(dim1=-2, dim2=-1)  # (..., T): each query's weight on its own position
    if bool((diag <= 0).any()):
        idx = tuple(int(i) for i in torch.unravel_index(diag.argmin(), diag.shape))
        return _result(det, "fail", "a query gives zero weight to its own position", value=float(diag.min()),
                       threshold=0.0, evidence=f"{int((diag <= 0).sum())} / {diag.numel()} queries give their own "
                                               f"position weight 0, e.g. at {idx} ({source})")
    return _result(det, "pass", f"every query attends its own position ({source})", value=float(diag.min()),
                   threshold=0.0)


def check_eval_determinism(probe: Probe) -> DetectorResult:
    det = "eval_determinism"
    base = probe.base()
    if not base.ok:
        return _failed_call(det, base)
    again = probe.call(base.query, base.key, base.value, base.allowed)
    if not again.ok:
        return _failed_call(det, again)
    tol = tolerance(UNCHANGED, probe.subject.dtype)
    change = _change(again.output.out, base.output.out)
    everywhere = torch.ones_like(change, dtype=torch.bool)
    bad, worst, text = _count_changed(change, everywhere, tol, probe, "outputs", "between two eval-mode calls "
                                      "on the same input")
    return _judge(det, bad > 0, "two eval-mode calls on the same input differ (randomness left on)",
                  "eval-mode calls are deterministic", value=worst, threshold=tol, evidence=text)


# ---- the registry ----------------------------------------------------------------------------------

DETECTORS: dict[str, Detector] = {d.id: d for d in [
    Detector("runs", "runs on the standard probe, B=1, T=1, H=1 (functions) and non-contiguous inputs",
             ("view after transpose without .contiguous()", "shape assumptions"),
             "make the layer shape-agnostic: .contiguous() before .view(), or use .reshape()", check_runs),
    Detector("output_shape", "output is (B, Tq, D), also when the memory length Tk differs from Tq",
             ("self/cross-attention inputs swapped",),
             "queries come from the decoder stream (query), keys and values from the memory", check_output_shape),
    Detector("finite_output", "no NaN or inf on ordinary inputs", ("no softmax with -inf masks", "overflow"),
             "normalise with a softmax over keys; use a dtype-safe fill value", check_finite_output),
    Detector("weight_row_sums", "weights are non-negative and each row sums to 1 over keys",
             ("no softmax", "softmax over the wrong axis", "mask after softmax", "dropout in eval"),
             "weights = softmax(masked scores, dim=-1)", check_weight_row_sums),
    Detector("softmax_saturation", "the softmax temperature: q·k is scaled by 1/sqrt(d_k) or the declared scale",
             ("missing 1/sqrt(d_k)", "scaled by sqrt(d_model)", "scale applied twice or inverted"),
             "scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  (d_k: the width of one head)",
             check_softmax_saturation),
    Detector("output_variance", "the output is a convex combination of the values: identical value rows come out "
             "unchanged and outputs stay within the values' range",
             ("no softmax", "softmax over the wrong axis", "dropout in eval"),
             "normalise the weights over keys before weighting the values", check_output_variance),
    Detector("query_locality", "each output row depends only on its own query row",
             ("self/cross-attention inputs swapped", "heads merged without transpose", "softmax over queries"),
             "take Q from the query stream; merge heads with x.transpose(1, 2).reshape(B, T, D)",
             check_query_locality, needs="a separate query input"),
    Detector("mask_honoured", "changing a key the mask blocks changes nothing (padding and causal masks)",
             ("mask polarity inverted", "mask applied after softmax", "mask ignored or misshaped"),
             "apply the mask to the scores before the softmax: scores.masked_fill(~allowed, -inf)",
             check_mask_honoured, needs="a mask argument"),
    Detector("fully_masked_rows", "a query whose every key is masked gives a finite output (warns on NaN)",
             ("plain softmax over an all -inf row",), "zero the weights of rows with no allowed key "
             "(torch's SDPA does), or never build such rows", check_fully_masked_rows, needs="a mask argument"),
    Detector("future_leakage", "for a causal layer, changing tokens after t leaves outputs at and before t unchanged",
             ("missing causal mask", "heads merged without transpose in a decoder"),
             "mask scores with causal_mask(Tq, Tk, align='bottom_right') before the softmax",
             check_future_leakage, needs="causal=True"),
    Detector("causal_alignment", "for a causal layer, the newest query sees the newest key (bottom-right "
             "alignment for cached decoding, diagonal included)",
             ("top-left causal mask with a KV cache", "causal mask blocking the diagonal"),
             "allow keys j <= i + (Tk - Tq): causal_mask(Tq, Tk, align='bottom_right'), i.e. triu(diagonal=1 + Tk - Tq)",
             check_causal_alignment, needs="causal=True"),
    Detector("eval_determinism", "two eval-mode calls on the same input give the same output",
             ("dropout left on in eval mode",), "F.dropout(weights, p, training=self.training)", check_eval_determinism),
]}
