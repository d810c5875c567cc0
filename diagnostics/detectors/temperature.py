"""`softmax_saturation`: the softmax temperature, q·k scaled by 1/sqrt(d_k) or the declared scale."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from .._core import not_run, skip
from .._observe import FusedAttention as Fused
from .._observe import Scaling, SoftmaxCall, applied_scales
from .._probe import Call, Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._thresholds import MEASURED_SCALE_ERROR, ROW_SUM, SCALE_RATIO, tolerance
from .._tracing import (
    did_nothing,
    event_op,
    op_site,
    past_zeroing,
    producer,
    short,
    site,
    through_carries,
    trace_call,
    unique,
)
from ._common import ENTROPY_ROWS, result


def scale_fix(applied: float, expected: float, d_k: int, d_model: int | None, num_heads: int | None, *,
              declared: bool = False) -> str:
    """The fix named by the factor q·k really reaches the softmax with: none, 1/sqrt(d_model), the scale twice or
    inverted; else the factor to use."""
    def near(x: float, y: float) -> bool:
        return abs(math.log(abs(x) / y)) < math.log(SCALE_RATIO) if x and y > 0 else False

    want = "the declared scale" if declared else f"1/sqrt(d_k) = 1/sqrt({d_k})"
    if near(applied, 1.0):
        return (f"scores = q @ k.transpose(-2, -1) / math.sqrt(d_k) before the softmax (d_k = {d_k}, the width of one "
                f"head): the scores reach it unscaled")
    if d_model and d_model != d_k and near(applied, 1.0 / math.sqrt(d_model)):
        heads = f" = sqrt(d_model / num_heads) = sqrt({d_model} / {num_heads})" if num_heads else ""
        return (f"divide by sqrt(d_k), the width of one head{heads}, not by sqrt(d_model) = sqrt({d_model})")
    if near(applied, expected ** 2):
        return f"scale once: the scores are multiplied by {want} twice"
    if near(applied, 1.0 / expected):
        return f"divide by sqrt(d_k), do not multiply by it: scores = q @ k.transpose(-2, -1) / math.sqrt({d_k})"
    return f"multiply q·k by {expected:.4g} ({want}) before the softmax, once"


def scale_sites(probe, result: DetectorResult) -> list[Site]:
    """On the very call the temperature was read from (`result.replay`): the q·k matmul, the softmax it feeds and
    the scaling ops on the way, or, when there is none, where the scale belongs."""
    base = result.replay
    if base is None or not base.ok:
        return []
    trace = trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed)
    rec = trace.record
    estimates = applied_scales(rec)
    if not estimates:
        return []

    def ratio(e):
        expected = probe.scale if probe.scale is not None else 1.0 / math.sqrt(e.d_k)
        return e.applied / expected, expected

    worst = max(estimates, key=lambda e: abs(math.log(abs(ratio(e)[0]) or 1e-300)))
    r, expected = ratio(worst)
    said = f"q·k reaches the softmax multiplied by {worst.applied:.4g}; expected {expected:.4g}"
    said += "" if probe.scale is not None else f" = 1/sqrt({worst.d_k})"
    fix = scale_fix(worst.applied, expected, worst.d_k, probe.subject.d_model, probe.subject.num_heads,
                    declared=probe.scale is not None)
    if worst.fused is not None:
        op = event_op(trace, worst.fused)
        scalings = [e for e in rec.order[:rec.order.index(worst.fused)] if isinstance(e, Scaling)]
        return unique([site(e.frames, e.op, f"multiplies by {e.factor:.4g}; {said}", fix) for e in scalings]
                      + [op_site(op, said, fix=fix)])
    soft_op, mm_op = event_op(trace, worst.softmax), event_op(trace, worst.matmul)
    if worst.used_by is not None:  # the weights that multiply the values are not the softmax's output
        wv = event_op(trace, worst.used_by)
        maker = None if wv is None else past_zeroing(trace, through_carries(trace, producer(trace, wv.in_ids[0])))
        return unique([op_site(maker, f"the weights that multiply the values are made here from the softmax at "
                                        f"{short(soft_op) if soft_op else '?'}: their temperature is {r:.3g}x "
                                        f"the expected one", fix="use the softmax's output as the weights: a "
                                        "second softmax (or power) of them changes their temperature"),
                       op_site(soft_op, "the softmax of q·k")])
    i_soft = rec.order.index(worst.softmax)
    prev_soft = max([j for j, e in enumerate(rec.order[:i_soft]) if isinstance(e, (SoftmaxCall, Fused))] or [-1])
    scalings = [e for e in rec.order[prev_soft + 1:i_soft] if isinstance(e, Scaling)]
    if scalings:
        return unique([site(e.frames, e.op, f"multiplies by {e.factor:.4g}; {said}", fix) for e in scalings]
                      + [op_site(mm_op, said, fix=fix), op_site(soft_op, said, fix=fix)])
    start = mm_op.index if mm_op is not None else 0
    end = soft_op.index if soft_op is not None else len(trace.ops)
    return unique([replace(x, fix=fix) for x in did_nothing(trace, start, end, ("scale", "temperature", "sqrt"))]
                  + [op_site(mm_op, f"{said}: no scaling op between this q·k and the softmax at "
                                    f"{short(soft_op) if soft_op else '?'}; the scale belongs here", fix=fix),
                     op_site(soft_op, said, fix=fix)])


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
          fix="scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  (d_k: the width of one head)", locate=scale_sites)
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
    own = _own_temperature_fix(estimate, applied, d_k, probe) if abs(math.log(abs(ratio) or 1e-300)) > \
        math.log(SCALE_RATIO) else None
    extra = {"fix": own[1]} if own else {}
    evidence += f"; {own[0]}" if own else ""
    if ratio > SCALE_RATIO:
        return result(det, "fail", f"softmax is {ratio:.2f}x too sharp: logits are multiplied by more than {declared} "
                                   f"(not divided enough)",
                       value=ratio, threshold=SCALE_RATIO, evidence=evidence, replay=base, **extra)
    if ratio < 1 / SCALE_RATIO:
        return result(det, "fail", f"softmax is {1 / ratio:.2f}x too flat: logits are multiplied by less than "
                                   f"{declared} (divided too much)",
                       value=ratio, threshold=1 / SCALE_RATIO, evidence=evidence, replay=base, **extra)
    return result(det, "pass", f"softmax temperature matches {declared} (ratio {ratio:.4f})", value=ratio,
                   threshold=SCALE_RATIO, evidence=evidence,
                   margin=f"correct layers measured |ratio - 1| <= {MEASURED_SCALE_ERROR:.1e}")


def _own_temperature_fix(estimate, applied: float, d_k: int, probe: Probe) -> tuple[str, str] | None:
    """(what was seen, the fix) where q and k reach q·k normalised, every query row and every key row of one norm
    (QK-norm scored with a temperature of the layer's own, cosine attention): the scale may be the layer's by design,
    so the fix offers to declare the factor observed, or else to scale by 1/sqrt(d_k). None otherwise."""
    m, f = getattr(estimate, "matmul", None), getattr(estimate, "fused", None)
    if probe.scale is not None:
        return None
    if m is not None and m.a.dim() >= 2 and m.b.dim() >= 2:
        norms = [m.a.double().norm(dim=-1), m.b.double().norm(dim=-2)]  # the queries' rows, the keys' (columns of k^T)
    elif f is not None:
        norms = [f.q.double().norm(dim=-1), f.k.double().norm(dim=-1)]  # what the fused call was given
    else:
        return None
    apart = tolerance(ROW_SUM, probe.subject.dtype)  # an RMS or L2 norm with a uniform gain: equal to rounding
    if not all(n.numel() and float(n.min()) > 0 and float(n.max() / n.min()) < 1 + apart for n in norms):
        return None
    seen = (f"q and k reach q·k normalised (every query's norm {float(norms[0].mean()):.3g}, every key's "
            f"{float(norms[1].mean()):.3g})")
    factor = float(f"{applied:.4g}")
    return seen, (f"{seen}: if the layer means to score them with its own temperature, declare it: "
                  f"scale={factor!r} (the factor q·k is multiplied by); if not, multiply q·k by 1/sqrt(d_k) = "
                  f"1/sqrt({d_k}) before the softmax")



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
