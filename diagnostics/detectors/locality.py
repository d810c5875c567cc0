"""`query_locality`: each output row depends only on its own query row."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._core import Case, Inputs, perturbed
from .._probe import Probe
from .._registry import LONG, SEPARATE_QUERY, detector
from .._result import DetectorResult
from .._tracing import producer, short, tensors
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
    for (shift_lo, shift_hi), at in shifted_sums(trace, T):
        lo, hi = lo + shift_lo, hi + shift_hi
        where, found = where or at, True
    return ((lo, hi), where) if found else (None, "")


ELEMENTWISE = ("mul", "mul_", "div", "div_", "neg", "clone", "_to_copy", "to")
SUMS = ("add", "add_", "sub", "sub_")


def shifted_sums(trace, T: int) -> list[tuple[tuple[int, int], str]]:
    """The convolutions along the sequence written by hand as sums of shifted slices (labml-nn's Primer `efficient`:
    `res = x * w[0]`, then `res[i:] += x[:-i] * w[i]`), each as the rows it carries a query into, relative to it, and
    its line. A sum counts where one operand is rows s_r.. of a tensor R that carries the queries X unshifted (X
    itself, or X scaled) and the other is rows s_x.. of X (scaled), both sliced along X's token axis (its one axis of
    length T): token t of X lands on row t + s_r - s_x of R. The shifts summed into one R are one convolution (its
    reach: 0 and every shift); convolutions one after another add up. A shift alone (a slice or a pad with no sum
    with the unshifted queries) is no convolution and is not read: it moves a query off its own row."""
    made = {}  # tensor id -> the op that made it (a write in place keeps the id: its maker is still the view's)
    for op in trace.ops:
        for out in op.out_ids:
            made.setdefault(out, op)
    reach: dict[int, list] = {}  # id of R -> [lo, hi, where]
    for op in trace.ops:
        if op.short not in SUMS or "query" not in op.sources or len(op.in_ids) != 2:
            continue
        a, b = (_token_slice(trace, made, i, T) for i in op.in_ids)
        for dest, src in ((a, b), (b, a)):
            if dest is None or src is None or (dest[1], dest[3]) != (src[1], src[3]):
                continue
            (r, axis, s_r, _), (x, _, s_x, _) = dest, src
            if _scaled_to(trace, made, r, x):
                span = reach.setdefault(r, [0, 0, short(op)])
                span[0], span[1] = min(span[0], s_r - s_x), max(span[1], s_r - s_x)
                break
    return [((lo, hi), at) for lo, hi, at in reach.values() if (lo, hi) != (0, 0)]


def _token_slice(trace, made: dict, tensor_id: int, T: int):
    """(id of the sliced tensor, axis, start, length) where `tensor_id` is a slice along the one axis of length T of
    a tensor of the queries, or such a slice scaled; else None."""
    op = made.get(tensor_id)
    for _ in range(4):
        if op is None:
            return None
        if op.short == "slice" and len(op.args) >= 3 and isinstance(op.args[0], Tensor) and op.outs \
                and op.outs[0] is not None:
            whole, axis = op.args[0], int(op.args[1]) % op.args[0].dim()
            if list(whole.shape).count(T) != 1 or whole.shape[axis] != T:
                return None
            start = int(op.args[2] or 0)
            return op.in_ids[0], axis, start + T if start < 0 else start, int(op.outs[0].shape[axis])
        carried = _scaled(trace, op)
        if carried is None:
            return None
        op = made.get(carried)
    return None


def _scaled_to(trace, made: dict, r: int, x: int) -> bool:
    """Whether tensor `r` is `x`, or `x` scaled or copied (row t of r from row t of x alone)."""
    for _ in range(5):
        if r == x:
            return True
        op = made.get(r)
        r = _scaled(trace, op) if op is not None else None
        if r is None:
            return False
    return False


def _scaled(trace, op) -> int | None:
    """The one input of an elementwise op (`ELEMENTWISE`) that its output is, scaled: of its shape and of the queries,
    every other input not of the queries; else None."""
    if op.short not in ELEMENTWISE or not op.outs or op.outs[0] is None:
        return None
    ins = list(zip(op.in_ids, (x for a in op.args for x in tensors(a))))
    of_queries = [i for i, _ in ins if "query" in trace.sources.get(i, ())]
    same = [i for i, x in ins if x.shape == op.outs[0].shape]
    return of_queries[0] if len(of_queries) == 1 and same == of_queries else None


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
