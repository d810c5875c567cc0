"""`finite_output`: no NaN or inf on ordinary inputs; the localiser (shared with fully_masked_rows) finds the
first op whose output is non-finite where its inputs were not."""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import not_run, unravel
from .._probe import Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._tracing import (
    MATMULS,
    SOFTMAXES,
    declared_mask,
    op_site,
    producer,
    through_carries,
    trace_call,
    unique,
    weights_made_by,
)
from ._common import result

FILLS = frozenset({"masked_fill", "masked_fill_", "where", "full", "fill_", "scalar_tensor", "full_like", "new_full",
                   "fill"})
"""Ops whose inf output is a fill value (a mask's -inf), not an overflow."""
ROW_FILLS = FILLS | {"add", "add_", "sub", "clamp_min", "amax", "max", "maximum", "exp", "mul"}
"""Where a whole row is masked, the softmax's own steps may also make -inf or NaN from the fill."""


def nonfinite_sites(probe, result: DetectorResult, *, fills: frozenset = FILLS) -> list[Site]:
    """On the very call that gave a non-finite output (`result.replay`): the first op whose output has NaN or inf
    where its inputs had none (for an infinite weights·values product, what made the weights)."""
    call = result.replay
    if call is None:
        return []
    s, B = probe.subject, call.query.shape[0]
    q, k, v, allowed = call.query, call.key, call.value, call.allowed
    T = q.shape[s.time_dim]
    trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
    for op in trace.ops:
        if not op.frames or not op.outs or op.outs[0] is None or not op.outs[0].is_floating_point():
            continue
        out = op.outs[0]
        ins = [a for a in op.args if isinstance(a, Tensor) and a.is_floating_point()]
        nan_new = bool(torch.isnan(out).any()) and not any(bool(torch.isnan(a).any()) for a in ins)
        inf_new = (bool(torch.isinf(out).any()) and all(bool(torch.isfinite(a).all()) for a in ins)
                   and op.short not in fills)
        if nan_new or inf_new:
            what = "NaN" if nan_new else "inf"
            fix = ("subtract each row's maximum before the exponential (scores - scores.amax(-1, keepdim=True)), or "
                   "use torch.softmax, which does" if op.short == "exp" else "")
            here = op_site(op, f"the first op whose output has {what} where its inputs had none", fix=fix)
            if op.short in MATMULS:  # infinite weights times values: what made those weights?
                weights = next((i for i, a in zip(op.in_ids, op.args) if isinstance(a, Tensor)
                                and a.is_floating_point() and bool(torch.isinf(a).any())), None)
                made = through_carries(trace, producer(trace, weights)) if weights is not None else None
                if made is not None and made.frames and made.short not in SOFTMAXES:
                    t_q, t_k = made.outs[0].shape[-2:] if made.outs and made.outs[0] is not None else (T, T)
                    return list(unique(weights_made_by(probe, trace, made, declared_mask(probe, B, T, T, allowed),
                                                         t_q, t_k, plain=False) + [here]))
            return [here]
    return []


@detector("finite_output", "no NaN or inf on ordinary inputs", targets=("no softmax with -inf masks", "overflow"),
          fix="normalise with a softmax over keys; use a dtype-safe fill value", locate=nonfinite_sites)
def check_finite_output(probe: Probe) -> DetectorResult:
    det, base = "finite_output", probe.base()
    if not base.ok:
        return not_run(det, base)
    out = base.output.out
    bad = ~torch.isfinite(out)
    if bad.any():
        idx = unravel(bad.flatten().nonzero()[0, 0], out.shape)
        return result(det, "fail", "the output has NaN or inf on an ordinary input",
                       value=float(bad.sum()), threshold=0.0,
                       evidence=f"{int(bad.sum())} / {out.numel()} output values are NaN/inf; first at {idx}",
                       replay=base)
    return result(det, "pass", f"all {out.numel()} outputs are finite", value=0.0, threshold=0.0)
