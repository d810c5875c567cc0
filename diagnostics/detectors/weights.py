"""`weight_row_sums`: the weights are non-negative and each row sums to 1 over the keys."""

from __future__ import annotations

import math

import torch

from .._core import not_run, skip, unravel
from .._observe import fused_weights, learned_keys, pooled_keys, pooled_shape, values_axis
from .._probe import Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._subject import own_query_mask
from .._thresholds import MEASURED_ROW_SUM, ROW_SUM, dtype_name, tolerance
from .._tracing import SOFTMAXES, site, trace_call, weights_origin
from ._common import channel_attention, result
from ._stacked import PADDED, stacked_baseline, stacked_cases


def weights_sites(probe, result: DetectorResult) -> list[Site]:
    """What made the weights of the very call they were read from (`result.replay`)."""
    call = result.replay
    if call is None:
        return []
    s = probe.subject
    trace = trace_call(s, call.query, call.key, call.value, call.allowed, seed=probe.seed)
    if trace.output is None:
        return []
    t_q, t_k = s.own_queries or call.query.shape[s.time_dim], call.key.shape[s.time_dim]
    allowed = call.allowed  # (B, Tq, Tk); a layer's own queries were given its one row (`own_query_mask`)
    if s.own_queries and allowed is not None:
        allowed = own_query_mask(allowed.cpu(), t_q)
    sites = weights_origin(probe, trace, allowed, t_q, t_k)
    # weights over m < Tk keys the layer pools from its tokens (`pooled_keys`, read unmasked only): made over (n, m),
    # n the Tq queries or fewer of its own, pooled too; only where the weights were read so (a linear attention's
    # feature maps have that shape too, and are no weights)
    pooled = [tuple(op.outs[0].shape[-2:]) for op in trace.ops if op.short in SOFTMAXES and op.outs
              and op.outs[0] is not None and pooled_shape(op.outs[0].shape, t_q, t_k, probe.BATCH, s.num_heads)]
    if not sites and pooled and call.allowed is None and POOLED in result.message:
        sites = weights_origin(probe, trace, call.allowed, *pooled[-1])
    return sites or _scaled_after(trace, result)


POOLED = "(pooled: a spatial reduction)"
SUM_MATCH = 1e-3  # knob: how close a factor comes to the rows' sum, beside the dtype's tolerance (x10, x0.1: the same)


def _scaled_after(trace, result: DetectorResult) -> list[Site]:
    """Where the rows sum to one number c != 1: the first op after a softmax that multiplied a tensor by the constant
    c, a scale applied after the normalisation (linear-attention-transformer's `q = q * dim ** -0.5` after
    `q.softmax(dim=-1)`, every row of its kernel then summing to 1/sqrt(d)); [] where none did."""
    if result.value is None:
        return []
    sums, after = (1.0 - result.value, 1.0 + result.value), False
    for op in trace.ops:
        after = after or op.short in SOFTMAXES
        number = op.args[1] if len(op.args) > 1 else None
        if not after or op.short not in ("mul", "div") or not isinstance(number, (int, float)) or not number:
            continue
        factor = float(number) if op.short == "mul" else 1.0 / float(number)
        if any(math.isclose(factor, c, rel_tol=SUM_MATCH, abs_tol=result.threshold or 0.0) for c in sums):
            found = site(op.frames, op.name, f"multiplies by {factor:.4g} after a softmax: every row of the weights "
                                             f"sums to {factor:.4g}",
                         fix="scale before the softmax (the scores, or q), not after it: each row of weights sums to 1")
            return [found] if found is not None else []
    return []


@detector("weight_row_sums", "weights are non-negative and each row sums to 1 over keys",
          targets=("no softmax", "softmax over the wrong axis", "mask after softmax", "dropout in eval"),
          fix="weights = softmax(masked scores, dim=-1)", locate=weights_sites)
def check_weight_row_sums(probe: Probe) -> DetectorResult:
    det, s, B, T = "weight_row_sums", probe.subject, probe.BATCH, probe.t
    if s.takes_mask:  # blocked keys are where a mask applied after the softmax shows
        call = padded_call(probe)
    else:
        call = probe.base()
    if not call.ok:
        return not_run(det, call)
    weights, source = probe.weights(call)
    keys = learned_keys(call.record, T, T) if weights is None and call.record is not None else None
    if keys is not None:  # memory slots, sinks, a bias key: a distribution over Tk + n keys
        weights, source = ((keys.softmax.output, "observed softmax output") if keys.softmax is not None else
                           (fused_weights(keys.fused), "weights of the observed fused attention call (recomputed "
                                                       "from its inputs)"))
        source += f", over the {T} keys and {keys.describe()}"
    if weights is None and (channels := _channel_weights(probe, det)) is not None:
        return channels  # channel attention (XCA's, DaViT's): its weights are between a head's channels, not over keys
    unmasked = call.allowed is None or bool(call.allowed.all())
    pooled = pooled_keys(call.record, T, T, B, s.num_heads) if weights is None and unmasked and call.record is not None \
        else None
    if pooled is not None:  # keys of the layer's own making, fewer than the tokens: rows over them
        weights, n, m, source = pooled
        source += f", over the {m} keys the layer makes of its own from the {T} tokens {POOLED}"
        if n < T:  # queries pooled too: rows are the layer's n queries, none masked
            source += f", for {n} queries of its own making (pooled from the tokens too)"
    if weights is None:
        call = probe.base()
        weights, source = probe.recovered_weights()
    if weights is None:
        return skip(det, "the layer returns no (..., Tq, Tk) weights, no softmax over them and no fused attention "
                         "call was observed, and its values did not show them (a layer given its values apart is read "
                         "through them: v = I, or one key at a time, where its output is those weights applied to its "
                         "values)")
    t_k = weights.shape[-1]  # Tk, plus any key the layer appends of its own (add_bias_kv)
    # T, or a layer with queries of its own: its Q rows, or every token's where it attends them all and
    # keeps the class token's row (`Probe._observed`)
    t_q = weights.shape[-2] if s.own_queries or pooled is not None else T  # observed weights: (.., Tq, Tk)
    if weights.numel() % (B * t_q * t_k):
        return skip(det, f"weights of shape {tuple(weights.shape)} do not split into batch {B}")
    # no float64 copy of the weights (at (2, 8, 1024, 1024) 128 MB, ~0.5 forward passes): row sums accumulate in
    # float64, the sign is read in the weights' own dtype
    w = weights.detach().reshape(B, -1, t_q, t_k)  # (B, heads or 1, Tq, Tk)
    # pooled keys are read unmasked only: every row has its keys
    allowed = call.allowed if call.allowed is not None and pooled is None else \
        torch.ones(B, t_q, t_k, dtype=torch.bool)
    if s.own_queries and allowed.shape[-2] != t_q:  # its queries' rows: the mask they were given, one row per key
        allowed = own_query_mask(allowed.cpu(), t_q)
    if probe.pattern is not None and t_k == T == t_q:  # a layer that keeps its declared pattern itself is not given it
        allowed = allowed.cpu() & probe.pattern.allowed(B, T, T)
    nonempty = allowed.to(w.device).any(-1).unsqueeze(1)  # (B, 1, Tq): rows with a key to attend
    tol = tolerance(ROW_SUM, s.dtype)
    sums = w.sum(-1, dtype=torch.float64)  # (B, heads, Tq)
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
            idx = unravel(torch.where(rows, dev, -1.0).argmax(), dev.shape)
            parts.append(f"{bad_rows} / {total} weight rows ({100 * bad_rows / total:.1f}%) do not sum to 1 over "
                         f"keys; worst row {at_text(idx, names)} sums to {number_text(float(sums[idx]))} "
                         f"(|sum - 1| up to {tol:.2g} allowed for {dtype_name(s.dtype)})")
        if negative.any():
            idx = unravel(w.argmin(), w.shape)
            parts.append(f"{int(negative.sum())} weights are negative, the least {number_text(float(w.min()))} at "
                         f"{at_text(idx, names + ('k',))}")
        return result(det, "fail", f"attention weights are not a distribution over keys ({source})",
                       value=worst, threshold=tol, evidence="; ".join(parts), replay=call)
    exact = _exact_row_sums(call.record, weights, rows, B, t_q, t_k)
    if exact is not None:
        return result(det, "fail", f"attention weights are not a distribution over keys ({source})",
                       value=exact[0], threshold=tolerance(ROW_SUM, torch.float64), replay=call,
                       evidence=f"the layer's softmax normalises another axis than the keys (dim={exact[1]}): "
                                f"recomputed exactly, in float64, from the scores it was given, its rows sum to 1 "
                                f"within {exact[0]:.2g} only; its {dtype_name(s.dtype)} weights, each rounded, hide "
                                f"that within the {tol:.2g} allowed (small scores, as at initialisation, make a "
                                f"softmax over any axis nearly uniform)")
    return result(det, "pass", f"all {total} weight rows sum to 1 and no weight is negative ({source})",
                   value=worst, threshold=tol, margin=_row_sum_margin(s.dtype))


def _channel_weights(probe: Probe, det: str) -> DetectorResult | None:
    """For a channel attention (`_common.channel_attention`: XCA's, DaViT's), whether each softmax normalises the axis
    its values are then summed over, read from the axes themselves (a softmax over the other axis of near-uniform
    weights sums to 1 within rounding either way); None where the layer is no channel attention."""
    said = channel_attention(probe)
    if not said:
        return None
    record = probe.base().record
    read = [(sm, values_axis(record, sm)) for sm in record.softmaxes]
    if not read or any(axis is None for _, axis in read):
        return skip(det, f"no product was seen to read the channel weights as they are ({said})")
    wrong = [(sm, axis) for sm, axis in read if axis % sm.output.dim() != sm.dim % sm.output.dim()]
    if wrong:
        sm, axis = wrong[0]
        return result(det, "fail", "channel attention weights are not a distribution over the channels its values "
                      "are summed over", value=1.0, threshold=0.0,
                      evidence=f"a softmax over scores of shape {tuple(sm.output.shape)} normalises axis {sm.dim}, and "
                               f"the product that reads its weights sums the values over axis {axis}; {said}")
    shapes = ", ".join(sorted({str(tuple(sm.output.shape)) for sm, _ in read}))
    return result(det, "pass", f"each softmax normalises the axis its values are summed over (channel attention: "
                               f"weights between a head's channels, {shapes}; none over the tokens)",
                  value=0.0, threshold=0.0, evidence=said)


def _exact_row_sums(record, weights, rows, batch: int, t_q: int, t_k: int) -> tuple[float, int] | None:
    """(the largest |row sum - 1|, the axis) of the observed softmax whose output `weights` are, recomputed exactly in
    float64 from its own scores, where that softmax normalises another axis than the keys and its rows miss 1 by more
    than float64's rounding; None otherwise. Over the keys, rows sum to 1 by construction: nothing is recomputed.
    Over the queries, rows miss 1 by about the scores' spread: at GPT-2's std-0.02 initialisation in bfloat16 by
    less than the rounding `ROW_SUM` allows, so that the wrong axis passed on the rounded weights alone."""
    softmax = next((sm for sm in (record.softmaxes if record is not None else ()) if sm.output is weights), None)
    if softmax is None or softmax.dim in (-1, softmax.output.dim() - 1):
        return None
    exact = softmax.input.detach().double().softmax(softmax.dim).reshape(batch, -1, t_q, t_k)
    dev = (exact.sum(-1) - 1).abs().nan_to_num(nan=math.inf)
    worst = float(dev[rows.expand_as(dev)].max()) if bool(rows.any()) else 0.0
    return (worst, softmax.dim) if worst > tolerance(ROW_SUM, torch.float64) else None


@stacked_cases(PADDED, "weight_row_sums")
def _reads_the_baseline(probe: Probe, base) -> tuple[list, str]:
    return [], ""  # the baseline copy only: its weights under the padding mask


def padded_call(probe: Probe):
    """A call with a padding mask: where the standard probe shows that the layer returns its weights, the baseline
    copy of the stacked padding probe (mask_honoured's call), whose returned weights are read; otherwise a call of
    its own, observed, so that the weights can be read from its softmax (or recognised as what it returns)."""
    B, T = probe.BATCH, probe.t
    base = probe.base()
    if base.ok and base.output.weights is not None and probe.returned_not_weights() is None:
        call = stacked_baseline(probe, PADDED)
        if not call.ok or call.output.weights is not None:
            return call
    q, k, v = probe.streams(B, T)
    allowed = probe.allowed(B, T, T, probe.padding(B, T, T))
    return probe.call(q, k, v, allowed, label="a padding mask", observe=True)


def at_text(index: tuple[int, ...], names: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip(names, index)) + ")"


def number_text(x: float) -> str:
    """A reading as a person writes it: inf and NaN by name, not 1.798e+308."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x) or abs(x) > 1e300:
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _row_sum_margin(dtype) -> str:
    measured = MEASURED_ROW_SUM.get(dtype)
    return f"correct layers measured <= {measured:.1e} at {dtype_name(dtype)}" if measured is not None else ""
