"""`query_locality`: each output row depends only on its own query row."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._core import Case, Inputs, perturbed
from .._probe import Probe
from .._registry import LONG, SEPARATE_QUERY, detector
from .._result import DetectorResult
from .._tracing import producer, short
from ._common import base_trace, invariance_locator, judge_held, perturbation_gains, rows
from ._stacked import SEPARATE_STREAMS, stacked, stacked_cases


@detector("query_locality", "each output row depends only on its own query row",
          targets=("self/cross-attention inputs swapped", "heads merged without transpose", "softmax over queries"),
          fix="take Q from the query stream; merge heads with x.transpose(1, 2).reshape(B, T, D)",
          needs=(SEPARATE_QUERY, LONG),
          locate=invariance_locator("the first op whose output at other positions moves when one query changes",
                                    streams=True))
def check_query_locality(probe: Probe) -> DetectorResult:
    comparison = stacked(probe, SEPARATE_STREAMS, "query_locality")
    verdict = judge_held("query_locality", comparison, probe, what="other output rows",
                         fail_message="an output row depends on other queries than its own",
                         pass_message="each output row depends only on its own query")
    if verdict.verdict != "fail" or isinstance(comparison, DetectorResult):
        return verdict
    window, where = convolved_queries(probe)
    if window is None:
        return verdict
    # the queries convolved along the sequence by design (Primer's multi-DConv-head attention, a convolutional query
    # projection): the rows the convolution carries query p into, read from its padding and crop, may move; every
    # other row must not
    B, T, p = probe.BATCH, probe.t, changed_query(probe.t)
    lo, hi = window
    near = rows(B, T, ((torch.arange(T) - p) >= lo) & ((torch.arange(T) - p) <= hi))
    if bool(near.all()):
        return DetectorResult("query_locality", "skip", f"not measured: the queries are convolved along the sequence "
                              f"before the attention ({where}), over rows {lo:+d} to {hi:+d} of the changed query, "
                              f"which leaves no row of {T} to hold", evidence=verdict.evidence)
    span = f"rows {lo:+d} to {hi:+d} of the query"
    beyond = replace(comparison, cases=[replace(c, hold=c.hold & ~near) for c in comparison.cases])
    said = (f"the queries are convolved along the sequence before the attention ({where}), which carries a query into "
            f"{span} by design (its kernel, dilation, padding and crop); ")
    again = judge_held("query_locality", beyond, probe, what=f"output rows outside {span}",
                       fail_message=f"an output row depends on queries the convolution that mixes them does not carry "
                                    f"into it (outside {span})",
                       pass_message=f"each output row depends only on the queries the convolution along the sequence "
                                    f"carries into it ({span})")
    return replace(again, evidence=said + again.evidence)


def convolved_queries(probe: Probe) -> tuple[tuple[int, int] | None, str]:
    """The rows, relative to a query, that the 1-D convolutions along the sequence on the queries' path carry it into
    ((lo, hi), summed over those convolutions), and where the first is (file:line), from the standard call's trace;
    (None, "") where there is none, or one whose geometry is not read. Each convolution's input depends on the queries
    and holds the T tokens, padded (by its own `padding` and a constant pad just before it) on the left by P_l; its
    output is T long, or cropped to T by a slice just after it from s: output row r reads tokens r + s - P_l + j x
    dilation (j < K), so query p reaches rows p - s + P_l - (K - 1) x dilation .. p - s + P_l (a causal convolution:
    p .. p + K - 1; a "same" one: p - (K - 1) / 2 .. p + (K - 1) / 2)."""
    trace, T = base_trace(probe), probe.t
    lo = hi = 0
    where, found = "", False
    for op in trace.ops:
        if op.short != "convolution" or "query" not in op.sources or len(op.args) < 9:
            continue
        x, w, stride, padding, dilation, transposed = op.args[0], op.args[1], op.args[3], op.args[4], op.args[5], \
            op.args[6]
        if not isinstance(x, Tensor) or not isinstance(w, Tensor) or x.dim() != 3 or w.shape[-1] < 2:
            continue  # a 1x1 convolution (a projection) mixes no tokens
        if transposed or int(stride[-1]) != 1:
            return None, ""
        K, dil, pad = int(w.shape[-1]), int(dilation[-1]), int(padding[-1])
        left, length = pad, x.shape[-1]
        made = producer(trace, op.in_ids[0])
        if made is not None and made.short == "constant_pad_nd" and length != T:
            sides = list(made.args[1])
            left, length = left + int(sides[0]), length - int(sides[0]) - int(sides[1])
        if length != T:
            return None, ""  # not the tokens, or padded in a way not read
        out = x.shape[-1] + 2 * pad - (K - 1) * dil  # its output's length (stride 1)
        start = 0
        if out != T:
            cut = next((o for o in trace.ops if o.short == "slice" and op.out_ids and op.out_ids[0] in o.in_ids), None)
            if cut is None or len(cut.args) < 3 or int(cut.args[1]) not in (-1, 2):
                return None, ""
            start = int(cut.args[2] or 0)
            end = cut.args[3] if len(cut.args) > 3 and cut.args[3] is not None else out
            end = int(end) if int(end) >= 0 else out + int(end)
            if min(end, out) - start != T:
                return None, ""
        lo += left - start - (K - 1) * dil
        hi += left - start
        where, found = where or short(op), True
    return ((lo, hi), where) if found else (None, "")


def changed_query(t: int) -> int:
    """The query `query_cases` changes alone, and the one the convolutions' rows are counted from."""
    return t // 2


@stacked_cases(SEPARATE_STREAMS, "query_locality")
def query_cases(probe: Probe, base: Inputs) -> tuple[list[Case], str]:
    """Query T // 2 changed alone, in every sequence; every other row held."""
    B, T = probe.BATCH, probe.t
    p = changed_query(T)
    moved = torch.arange(T) == p
    # gain 1000 (100 in float16): the other rows' weights do not depend on query p in a correct layer, however hard
    # it is pushed; in a layer that mixes queries, a large change shows even where logits are tiny
    gains = perturbation_gains(probe)
    cases = [Case(x, hold=rows(B, T, ~moved), move=rows(B, T, moved), when=f"when only query t={p} changed "
                  f"(x{gain:g})") for gain, x in zip(gains, perturbed(probe, base, moved, ("query",), gains=gains))]
    return cases, f"query t={p} changed"
