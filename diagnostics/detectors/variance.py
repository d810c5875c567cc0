"""`output_variance`: the output is a convex combination of the values."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._core import not_run, relative_change, skip, unravel
from .._probe import Call, Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._thresholds import ROW_SUM, UNCHANGED, dtype_name, tolerance
from .._tracing import MATMULS, SOFTMAXES, ancestors, merge_fix, moved, op_site, trace_call, weights_origin
from ._common import result
from .weights import at_text


@dataclass(frozen=True)
class VarianceReplay:
    """What output_variance's verdict was computed on: the call, and which of its two checks failed."""

    call: Call
    out_of_range: bool = False  # the value-range check of functions, not the identical-values one


def variance_sites(probe, result: DetectorResult) -> list[Site]:
    """Where the output stopped being a convex combination of the values, replayed on the failing call."""
    replay = result.replay
    if replay is None:
        return []
    return out_of_range_sites(probe, replay.call) if replay.out_of_range else identical_values_sites(probe, replay.call)


def identical_values_sites(probe, call: Call) -> list[Site]:
    """On the identical-values probe: what made the weights; else (modules, identical tokens) the first op after
    the weights·values product whose output is not the same at every position."""
    s = probe.subject
    T, t_k = call.query.shape[s.time_dim], call.key.shape[s.time_dim]
    allowed = call.allowed
    trace = trace_call(s, call.query, call.key, call.value, allowed, seed=probe.seed)
    if s.form == "function":
        return weights_origin(probe, trace, allowed, T, t_k, plain=False)
    sites = weights_origin(probe, trace, allowed, T, t_k, plain=False)
    if sites:  # else: after weights @ values, a row of identical values is the same at every position
        return sites
    soft = [op for op in trace.ops if op.short in SOFTMAXES]
    if not soft:
        return []
    wv = next((op for op in trace.ops[soft[-1].index + 1:] if op.short in MATMULS
               and soft[-1].index in ancestors(trace, op)), None)
    if wv is None:
        return []
    tol = tolerance(UNCHANGED, s.dtype)
    for op in trace.ops[wv.index:]:
        out = op.outs[0] if op.outs else None
        if not op.frames or out is None or not out.is_floating_point():
            continue
        for a in range(1, out.dim() - 1):  # position axes: not the batch, not the features (last, of any size)
            if out.shape[a] == T and bool(moved(out, out.narrow(a, 0, 1).expand_as(out), tol).any()):
                return [op_site(op, "every token is the same, yet this op's output differs between positions: it "
                                     "mixes positions with another axis (heads)",
                                fix=merge_fix(op, s.num_heads) or "merge the heads with y.transpose(1, 2).reshape(B, "
                                                                  "T, H * d): keep positions apart from heads")]
    return []


def out_of_range_sites(probe, base: Call) -> list[Site]:
    """The first op whose output, shaped like the output, leaves [min, max] of the values feature by feature."""
    if not base.ok:
        return []
    trace = trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed)
    v = base.value.double().cpu()  # (B, H, Tk, d_v)
    hi, lo = v.amax(-2, keepdim=True), v.amin(-2, keepdim=True)
    spread = (hi - lo).clamp_min(1e-12)
    tol = max(tolerance(UNCHANGED, probe.subject.dtype), tolerance(ROW_SUM, probe.subject.dtype))
    shape = tuple(base.output.out.shape)
    for op in trace.ops:
        out = op.outs[0] if op.outs else None
        if (not op.frames or out is None or tuple(out.shape) != shape or not out.is_floating_point()
                or "value" not in op.sources):
            continue
        o = out.double().cpu()
        if bool(((torch.maximum(o - hi, lo - o) / spread) > tol).any()):
            return [op_site(op, "the first op whose output leaves the range of the values: not a weighted "
                                 "average of them")]
    return []


@detector("output_variance", "the output is a convex combination of the values: identical value rows come out "
          "unchanged and outputs stay within the values' range",
          targets=("no softmax", "softmax over the wrong axis", "dropout in eval", "heads merged without transpose"),
          fix="normalise the weights over keys before weighting the values, and merge heads with "
              "x.transpose(1, 2).reshape(B, T, D)", locate=variance_sites)
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
    idx = unravel(change.argmax(), change.shape)
    shown = "inf (non-finite)" if math.isinf(worst) else f"{worst:.3g}"
    text = (f"{bad} / {change.numel()} {what} ({100 * bad / change.numel():.1f}%) when every value row is the same "
            f"vector; greatest difference {shown} at {at_text(idx, ('b', 't') if change.dim() == 2 else ('b', 'h', 't'))} "
            f"(up to {tol:.2g} of the output's RMS allowed for {dtype_name(s.dtype)})")
    if bad:
        return result(det, "fail", "the output is not a convex combination of the values: identical value rows "
                       "do not come out unchanged", value=worst, threshold=tol, evidence=text,
                      replay=VarianceReplay(call))
    bound = _bound_check(probe, tol) if s.form == "function" else None
    return bound or result(det, "pass", "identical value rows come out unchanged", value=worst, threshold=tol,
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
        idx = unravel(excess.argmax(), excess.shape)
        return result("output_variance", "fail", "outputs leave the range of the values",
                       value=float(excess.max()), threshold=tol,
                       evidence=f"{n} / {excess.numel()} output features lie outside [min, max] of the values by up "
                                f"to {float(excess.max()):.3g} of their spread at (b, h, t, feature)={idx}",
                       replay=VarianceReplay(base, out_of_range=True))
    return None
