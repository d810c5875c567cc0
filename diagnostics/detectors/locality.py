"""`query_locality`: each output row depends only on its own query row."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._core import Case, Inputs, perturbed
from .._probe import Probe
from .._registry import LONG, SEPARATE_QUERY, detector
from .._result import DetectorResult
from .._tracing import SOFTMAXES, qk_matmul, short, tensors, trace_call
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
    """The rows, relative to a query, that the convolutions along the sequence the queries pass through on their way
    to the q·k product carry it into ((lo, hi)), and where the first is (file:line); (None, "") where there is none,
    or one not read. Read from the standard call's trace (`queries_reach`); each convolution's axis is then checked to
    be the tokens' in a second traced call with query `changed_query` changed alone: its input must change at that
    token's index along the axis and nowhere else along it (an axis that is as long as the probe but holds features,
    or a view that lays the tokens out otherwise, does not)."""
    base = probe.base()
    trace, T = base_trace(probe), probe.t
    window, where, read = queries_reach(trace, T)
    if window is None:
        return None, ""
    p = changed_query(T)
    moved = base.query.clone()
    moved[:, p] = -2.0 * moved[:, p] + 1.0
    other = trace_call(probe.subject, moved, base.key, base.value, base.allowed, seed=probe.seed)
    for index, position, axis in read:
        if index >= len(other.ops) or other.ops[index].name != trace.ops[index].name:
            return None, ""
        a, b = trace.ops[index].outs, other.ops[index].outs
        a, b = (x[position] if position < len(x) else None for x in (a, b))
        if a is None or b is None or a.shape != b.shape or a.dim() <= axis:
            return None, ""
        changed = (a != b).movedim(axis, 0).reshape(a.shape[axis], -1).any(-1)
        if changed.nonzero().flatten().tolist() != [p]:
            return None, ""
    return window, where


LAYOUT = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t", "clone",
                    "contiguous", "expand", "unsqueeze", "squeeze", "alias", "detach", "_to_copy"})
"""Ops that move a tensor's numbers without combining them with others: the queries keep their rows through them."""
PARTS = frozenset({"split", "split_with_sizes", "unbind", "select", "slice"})
"""Ops that take a part of a tensor: the queries' part of a fused q, k and v, along an axis that is not the tokens'."""


def queries_reach(trace, T: int) -> tuple[tuple[int, int] | None, str, list]:
    """Walk back from the query operand of the q·k product (the matmul before the first softmax over scores with the T
    queries and T keys among their axes, not a kernel's or a gate's; or a fused attention call's q) through ops that
    only lay its numbers out (`LAYOUT`), take a part of them along another axis than one of T (`PARTS`: q out of a fused
    q, k, v) or scale them by numbers not of the queries (a scale, a bias): each convolution along the T tokens met
    there (`_conv_reach`), or sum of shifted slices written into a tensor of the queries (`shifted_sums`), adds the rows
    it carries a query into, and the walk goes on from its input. It stops at anything else: a convolution beside the
    queries (a gate's, one head group's of several, concatenated) or before some other op (a rotation, a norm) excuses
    nothing, nor does a shift alone (a pad, a cat). Returns ((lo, hi), the first one's line, [(the op index that made
    each one's input, its output position, the axis read as the tokens')]) or (None, "", [])."""
    first = next((i for i, op in enumerate(trace.ops) if "scaled_dot_product" in op.name or (
        op.short in SOFTMAXES and op.outs and op.outs[0] is not None and list(op.outs[0].shape).count(T) >= 2)),
        None)
    if first is None:
        return None, "", []
    op = trace.ops[first]
    product = op if "scaled_dot_product" in op.name else qk_matmul(trace, first)
    if product is None or not product.in_ids or "query" not in product.sources:
        return None, "", []
    made: dict = {}  # tensor id -> the op that made it (a write in place keeps the id: its maker is the first)
    for o in trace.ops:
        for out in o.out_ids:
            made.setdefault(out, o)
    sums = shifted_sums(trace, made, T)
    lo = hi = 0
    where, read, at = "", [], product.in_ids[0]
    for _ in range(64):
        maker = made.get(at)
        if maker is None:
            break
        found = sums.get(at) or (_conv_reach(trace, made, maker, T) if maker.short in ("convolution", "slice")
                                 else None)
        if found is not None:
            (a, b), line, at, axis = found
            source = made.get(at)
            if source is None:
                break
            lo, hi, where = lo + a, hi + b, where or line
            read.append((source.index, source.out_ids.index(at), axis))
            continue
        nxt = _passed_through(trace, maker, T)
        if nxt is None:
            break
        at = nxt
    return ((lo, hi), where, read) if read else (None, "", [])


def _passed_through(trace, op, T: int) -> int | None:
    """The input of `op` whose rows its output keeps (`queries_reach`'s walk), or None where it keeps none."""
    if op.short in LAYOUT and op.in_ids:
        return op.in_ids[0]  # a copy written into in place is a sum's R, read before this
    if op.short in PARTS and op.in_ids and isinstance(op.args[0], Tensor):
        at = 2 if op.short in ("split", "split_with_sizes") else 1  # the axis argument: split(x, n, dim), slice(x, dim)
        axis = int(op.args[at]) if len(op.args) > at else 0
        return op.in_ids[0] if op.args[0].shape[axis % op.args[0].dim()] != T else None  # never a part of the tokens
    return _scaled(trace, op, ELEMENTWISE + ("add", "sub"))  # a scale, a bias


def _conv_reach(trace, made: dict, op, T: int):
    """((lo, hi), its line, its input's id, 2: the axis of the tokens in it) of a 1-D convolution along the T tokens
    (`op`, or a slice that crops one): its input holds the T tokens, padded (by its own `padding` and a constant pad
    just before it) on the left by P_l; its output is T long, or cropped to T by the slice from s: output row r reads
    tokens r + s - P_l + j x dilation (j < K), so query p reaches rows p - s + P_l - (K - 1) x dilation .. p - s + P_l
    (a causal convolution: p .. p + K - 1; a "same" one: p - (K - 1) / 2 .. p + (K - 1) / 2). None for anything else (a
    stride, a 2-D map, a 1x1 projection, a crop not read)."""
    start, cut = 0, None
    if op.short == "slice":
        cut, op = op, made.get(op.in_ids[0]) if op.in_ids else None
        if op is None or op.short != "convolution":
            return None
    if "query" not in op.sources or len(op.args) < 9:
        return None
    x, w, stride, padding, dilation, transposed = op.args[0], op.args[1], op.args[3], op.args[4], op.args[5], \
        op.args[6]
    if not isinstance(x, Tensor) or not isinstance(w, Tensor) or x.dim() != 3 or w.shape[-1] < 2:
        return None
    if transposed or int(stride[-1]) != 1:
        return None
    K, dil, pad = int(w.shape[-1]), int(dilation[-1]), int(padding[-1])
    left, length, source = pad, x.shape[-1], op.in_ids[0]
    padded = made.get(op.in_ids[0])
    if padded is not None and padded.short == "constant_pad_nd" and length != T:
        sides = list(padded.args[1])
        left, length, source = left + int(sides[0]), length - int(sides[0]) - int(sides[1]), padded.in_ids[0]
    if length != T:
        return None  # not the tokens, or padded in a way not read
    out = x.shape[-1] + 2 * pad - (K - 1) * dil  # its output's length (stride 1)
    if out != T:
        if cut is None or len(cut.args) < 3 or int(cut.args[1]) not in (-1, 2):
            return None
        start = int(cut.args[2] or 0)
        end = cut.args[3] if len(cut.args) > 3 and cut.args[3] is not None else out
        end = int(end) if int(end) >= 0 else out + int(end)
        if min(end, out) - start != T:
            return None
    elif cut is not None:
        return None  # a slice of a convolution already T long: a shift, not read
    return (left - start - (K - 1) * dil, left - start), short(op), source, 2


ELEMENTWISE = ("mul", "mul_", "div", "div_", "neg", "clone", "_to_copy", "to")
SUMS = ("add_", "sub_")


def shifted_sums(trace, made: dict, T: int) -> dict:
    """{id of R: ((lo, hi), line, id of X, the axis of X read as the tokens')} for the convolutions along the sequence
    written by hand as sums of shifted slices into a tensor R of the queries X (labml-nn's Primer `efficient`: `res = x
    * w[0]`, then `res[i:] += x[:-i] * w[i]`). A sum counts where it is written in place into rows s_r.. of R, which
    carries X unshifted (X itself, or X scaled or copied: a clone per tap too), and adds rows s_x.. of X (scaled), both
    sliced along X's token axis (its one axis of length T): token t of X lands on row t + s_r - s_x of R. The shifts
    summed into R and into the copies it was made from are one convolution (its reach: 0 and every shift). A sum out of
    place is not read (where its result lands is the caller's), nor is a shift alone (a slice or a pad with no sum with
    the query's own row)."""
    shifts: dict[int, list] = {}  # id of R -> [its X, the shifts written into it, the first line]
    for op in trace.ops:
        if op.short not in SUMS or "query" not in op.sources or len(op.in_ids) != 2:
            continue
        dest, src = (_token_slice(trace, made, i, T) for i in op.in_ids)
        if dest is None or src is None or (dest[1], dest[3]) != (src[1], src[3]):
            continue
        (r, axis, s_r, _), (x, _, s_x, _) = dest, src
        if _scaled_to(trace, made, r, x):
            shifts.setdefault(r, [x, [], short(op), axis])[1].append(s_r - s_x)
    found = {}
    for r, (x, own, line, axis) in shifts.items():
        every, at = [0, *own], r
        for _ in range(8):  # the copies R was made from (a clone per tap): their shifts are this convolution's too
            op = made.get(at)
            at = _scaled(trace, op) if op is not None else None
            if at is None or at == x:
                break
            every += shifts.get(at, [None, []])[1]
        found[r] = ((min(every), max(every)), line, x, axis)
    return found


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
    for _ in range(8):
        if r == x:
            return True
        op = made.get(r)
        r = _scaled(trace, op) if op is not None else None
        if r is None:
            return False
    return False


def _scaled(trace, op, ops: tuple = ELEMENTWISE) -> int | None:
    """The one input of an elementwise op (one of `ops`) that its output is, scaled: of its shape and of the queries,
    every other input not of the queries; else None."""
    if op.short not in ops or not op.outs or op.outs[0] is None:
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
