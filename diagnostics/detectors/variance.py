"""`output_variance`: the output is a convex combination of the values; for a layer with keys of its own (memory
slots, attention sinks, a bias key), of the values and those keys' values; for a block (a residual and a norm around
the attention), judged on the attention's own output inside it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._core import NON_CONTIGUOUS, not_run, relative_change, skip, transposed_layout, unravel
from .._observe import LearnedKeys, branch_sums, learned_keys, per_query_head, weighted_sum
from .._probe import Call, Probe
from .._registry import detector
from .._result import DetectorResult, ProbeShape, Site
from .._thresholds import CONVEX, UNCHANGED, dtype_name, tolerance
from .._registry import NOT_APPLICABLE
from .._tracing import (
    CARRIES,
    MATMULS,
    SOFTMAXES,
    Residual,
    ancestors,
    carries_input,
    producer,
    event_op,
    fused_ops,
    merge_fix,
    moved,
    op_name,
    op_site,
    residual_add,
    short,
    short_frames,
    through_carries,
    trace_call,
    value_before,
    weights_origin,
)
from ._common import float64_copy_or_skip, float64_output, length_rule, not_token_attention, result
from ._stacked import SEEDED_CALLS
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
    fused = fused_ops(trace)
    if fused and (not soft or fused[-1].index > soft[-1].index):
        wv = fused[-1]  # a fused call's output is the weights·values product itself (torch 2.14's CPU flash kernel)
    elif soft:
        wv = next((op for op in trace.ops[soft[-1].index + 1:] if op.short in MATMULS
                   and soft[-1].index in ancestors(trace, op)), None)
    else:
        wv = None
    if wv is None:
        return []
    tol = tolerance(UNCHANGED, s.dtype)
    mixed = positions_mixed(trace, wv.index, T, tol) or positions_split(trace, wv, T, tol)
    if mixed is not None:  # the evidence that heads (or the batch) were merged into the positions
        return [op_site(mixed, "every token is the same, yet this op's output differs between positions where its "
                               "input did not: it mixes positions with another axis (heads)",
                        fix=merge_fix(mixed, s.num_heads) or "merge the heads with y.transpose(1, 2).reshape(B, T, "
                                                             "H * d): keep positions apart from heads")]
    apart = positions_apart(trace, wv.index, T, tol)
    if apart is None:
        return []
    return [op_site(apart, "every token is the same, yet this op's output differs between positions: it reads "
                           "something besides the weighted sum of the values (a position, a neighbour, the query)",
                    fix="make the attention's output the weighted sum of the values, softmax(scores) @ v; what reads "
                        "a position or a neighbour after it is not attention")]


def _differs_along(t: Tensor, axis: int, tol: float) -> bool:
    """Whether `t` is not the same at every index of `axis` (beyond `tol` of its RMS)."""
    return bool(moved(t, t.narrow(axis, 0, 1).expand_as(t), tol).any())


def _reshaped(trace, op) -> tuple[Tensor, Tensor] | None:
    """(input, output) of a view or reshape whose output has 3 or more axes, (B, T, features...) or (B, H, T, d), and
    whose input the trace kept, in another shape; None for any other op. A 2-D view is (B * T, D), a linear layer's
    flattening, whose axis 1 is the features (of as many as the positions where D == T): no merge or split of heads."""
    out = op.outs[0] if op.outs else None
    if op.short not in ("view", "_unsafe_view", "reshape") or not op.in_ids or out is None \
            or not out.is_floating_point() or out.dim() < 3:
        return None
    x = value_before(trace, op.in_ids[0], op.index)
    return None if x is None or x.shape == out.shape or not x.is_floating_point() else (x, out)


def positions_split(trace, product, T: int, tol: float):
    """The first view or reshape the weighted sum `product` reads from whose input is the same at every position
    (along each of its axes of T) and whose output is not (along an axis of T, neither the first nor the last): on
    identical tokens only data moved between axes can do that, positions split into heads without their transpose,
    as `x.reshape(B, H, T, d)` of a (B, T, D) tensor does. What makes positions differ by computing (values rotated
    by their position) is no such op."""
    feeds = ancestors(trace, product)
    for op in trace.ops[:product.index]:
        pair = _reshaped(trace, op) if op.index in feeds else None
        if pair is None:
            continue
        x, out = pair
        axes = [a for a in range(x.dim() - 1) if x.shape[a] == T]
        if not axes or any(_differs_along(x, a, tol) for a in axes):
            continue
        if any(out.shape[a] == T and _differs_along(out, a, tol) for a in range(1, out.dim() - 1)):
            return op
    return None


def positions_apart(trace, start: int, T: int, tol: float):
    """The first op from op `start` on (with a user frame) whose output differs between positions, told by its axes of
    T (not the batch, not the features, last, of any size): on identical tokens, where the positions come apart."""
    for op in trace.ops[start:]:
        out = op.outs[0] if op.outs else None
        if not op.frames or out is None or not out.is_floating_point():
            continue
        if any(out.shape[a] == T and _differs_along(out, a, tol) for a in range(1, out.dim() - 1)):
            return op
    return None


def positions_mixed(trace, start: int, T: int, tol: float):
    """The first view or reshape from op `start` on that reshapes so that, on identical tokens, the positions of its
    output (its axis 1, (B, T, ...)) differ although its input is the same along an axis of T positions: heads (or
    the batch) moved into the positions, as `y.reshape(B, T, H * d)` or `y.reshape(B, T, H, d)` of a (B, H, T, d)
    tensor does. A transform that
    computes something else from the attended values (a gate, a convolution, the query, a rotation) is no such op."""
    if T < 2:
        return None
    for op in trace.ops[start:]:
        pair = _reshaped(trace, op)
        if pair is None or pair[1].shape[1] != T:
            continue
        x, out = pair
        if not _differs_along(out, 1, tol):
            continue
        if any(x.shape[a] == T and not _differs_along(x, a, tol) for a in range(x.dim() - 1)):
            return op
    return None


def out_of_range_sites(probe, base: Call) -> list[Site]:
    """The first op whose output, shaped like the output, leaves [min, max] of the values feature by feature."""
    if not base.ok:
        return []
    trace = trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed)
    v = base.value.double().cpu()  # (B, H, Tk, d_v)
    hi, lo = v.amax(-2, keepdim=True), v.amin(-2, keepdim=True)
    spread = (hi - lo).clamp_min(1e-12)
    tol = tolerance(CONVEX, probe.subject.dtype)
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
          "unchanged and outputs stay within the values' range (or, for a transform after it, the weights @ values "
          "seen inside the layer is)",
          targets=("no softmax", "softmax over the wrong axis", "dropout in eval", "heads merged without transpose"),
          fix="normalise the weights over keys before weighting the values, and merge heads with "
              "x.transpose(1, 2).reshape(B, T, D)", locate=variance_sites)
def check_output_variance(probe: Probe) -> DetectorResult:
    det, s, B, T = "output_variance", probe.subject, probe.BATCH, probe.t
    tol = tolerance(CONVEX, s.dtype)
    other = not_token_attention(probe, det)
    if other is not None:
        return other
    if s.form == "function":
        q, k, _ = probe.streams(B, T, cross=True)
        row = probe.make(B, 1)  # (B, H, 1, d)
        v = row.expand_as(k).contiguous()  # (B, H, T, d): every value row identical
        call = _transposed_call(probe, q, k, v, probe.allowed(B, T, T), "identical value rows")
        if not call.ok:
            return not_run(det, call)
        if call.output.out.shape != q.shape:
            return skip(det, f"output shape {tuple(call.output.out.shape)} is not the query's")
        got, expected = call.output.out, row.expand_as(call.output.out)
        what = "output rows differ from the one value row"
        calls = [call]
    else:
        # a token 10x the usual size: logits grow 100x, so weights that are not normalised (which scale the
        # output with the token count) show even where the initialisation keeps logits tiny
        token = 10 * probe.make(B, 1)  # (B, 1, D)
        same = token.expand(B, T, s.d_model).contiguous()  # (B, T, D): T identical tokens
        if s.separate_kv and not probe.causal:  # queries differ, memory is T copies of one token
            query = probe.make(B, T)
            call = _transposed_call(probe, query, same, same, probe.allowed(B, T, T), "a memory of identical tokens")
            # one query over that one token: every output row must equal its output (Tq = 1 also keeps
            # a wrong head merge from disguising the reference)
            _seed(probe)
            reference = probe.call(query[:, :1].clone(), token, token, probe.allowed(B, 1, 1),
                                   label="one query over that one token")
        else:
            call = _transposed_call(probe, same, same, same, probe.allowed(B, T, T), "identical tokens")
            _seed(probe)
            reference = probe.call(token, token, token, probe.allowed(B, 1, 1), label="that one token alone")
            w = length_rule(reference.error)
            if not reference.ok and 2 <= w < T and T % w == 0:  # one token refused by the layer's own check: W of them
                _seed(probe)
                few = token.expand(B, w, s.d_model).contiguous()
                reference = probe.call(few, few, few, probe.allowed(B, w, w), label=f"{w} of that token alone, the "
                                       f"fewest the layer takes (its own check: {reference.describe_error()})")
        for c in (call, reference):
            if not c.ok:
                return not_run(det, c)
        got, ref = call.output.out, reference.output.out
        if ref.dim() == 3 and 1 < ref.shape[1] < got.shape[1]:  # W copies of the token: every row a correct layer's same
            ref = ref[:, :1]
        # (B, T, D) and its one token's (B, 1, D); a layer's Q queries of its own: (B, Q, D) over either
        own = s.own_queries and ref.shape == got.shape
        if not own and (got.dim() != 3 or ref.shape != got[:, :1].shape):
            return skip(det, f"output shapes {tuple(got.shape)} and {tuple(ref.shape)} do not allow the comparison")
        expected = ref.expand_as(got)
        what = "output rows differ from the output for that one token"
        calls = [call, reference]
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
    # rounding, or the layer? The same reading on a float64 copy tells them apart, before anything is judged inside (a
    # plain layer's rounding is no transform after its weighted sum)
    exact = None
    if bad and s.dtype != torch.float64:
        exact = _float64_reading(probe, calls, None if s.form != "function" else row)
        if exact is not None and exact <= tolerance(CONVEX, torch.float32):
            return result(det, "pass", "identical value rows come out unchanged, up to rounding", value=exact,
                          threshold=tolerance(CONVEX, torch.float32),
                          evidence=f"{text}; a float64 copy of the layer on the same inputs measured {exact:.2g} (up to "
                                   f"{tolerance(CONVEX, torch.float32):.0e} allowed): the {dtype_name(s.dtype)} "
                                   f"difference is rounding")
    # keys of the layer's own (seen on the standard probe), or a residual around the attention: judged inside
    if s.form != "function" and (bad or _has_learned_keys(probe)):
        inside = _judged_inside(probe, call, reference, tol)
        if inside is not None:
            return inside
    if exact is not None:
        text += f"; a float64 copy of the layer on the same inputs measured {exact:.3g}: not rounding"
    if bad:
        return result(det, "fail", "the output is not a convex combination of the values: identical value rows "
                       "do not come out unchanged", value=worst, threshold=tol, evidence=text,
                      replay=VarianceReplay(call))
    bound = _bound_check(probe, tol) if s.form == "function" else None
    return bound or result(det, "pass", "identical value rows come out unchanged", value=worst, threshold=tol,
                            evidence=text)


def _float64_reading(probe: Probe, calls: list[Call], row: Tensor | None) -> float | None:
    """The identical-values reading again on the float64 copy of the layer (`float64_copy_or_skip`, the gradient
    checks' copy), on the very inputs of `calls` upcast: the call on identical values, then the one on that one token
    alone (for a function, `row`, the one value row, is what is expected). None where no copy runs or a call raises.

    At a tiny width a correct layer's rounding can pass the bound: an output projection whose few products nearly
    cancel turns one rounding step of the merged heads into a large share of the output's RMS (the reference in
    bfloat16, one head of width 2, two tokens: 0.0675 against 0.06, from an exploring CI seed). In float64 that
    rounding is gone (correct layers measure ~1e-16), while a layer that does not average its values (no softmax, a
    softmax over the queries, weights that do not sum to 1, a dropout left on: each replay draws as its call did, see
    `_seed`) differs as much as before."""
    twin = float64_copy_or_skip(probe, probe.detector)
    if isinstance(twin, DetectorResult):
        return None
    outs = []
    for c in calls:
        probe.passes += 1
        t = probe.subject.time_dim
        probe.shapes[probe.detector].append(ProbeShape(f"float64 copy: {c.label}", c.query.shape[0], c.query.shape[t],
                                                       c.key.shape[t], None if c.allowed is None else c.allowed.cpu(),
                                                       c.query is c.key and c.key is c.value))
        _seed(probe)  # as the call it replays
        try:
            outs.append(float64_output(twin, c))
        except Exception:  # noqa: BLE001 -- no reading, then: the verdict in the layer's own dtype stands
            return None
    got, alone = outs[0], row.to(torch.float64) if row is not None else outs[1]
    if row is None and alone.dim() == 3 and 1 < alone.shape[1] < got.shape[1]:  # W copies of the token (see above)
        alone = alone[:, :1]
    if got.dim() != alone.dim() or any(a not in (1, g) for a, g in zip(alone.shape, got.shape)):
        return None
    change = relative_change(got, alone.expand_as(got))
    return None if change is None else float(change.max())


def _transposed_call(probe: Probe, q, k, v, allowed, label: str) -> Call:
    """The call on identical values with its inputs laid out transposed in memory (`transposed_layout`), which is
    runs' non-contiguous probe too, at no call more (the values and what is compared are the same; the layout's
    rounding is a recomputation's, inside this check's tolerance). Where the layer raised on that layout (a `.view()`
    of its input: GPT-2's Conv1D), runs reports it, and the same inputs in the standard layout are measured here."""
    laid: dict[int, Tensor] = {}  # one stream stays one tensor

    def lay(x):
        return laid.setdefault(id(x), transposed_layout(x))

    _seed(probe)
    call = probe.call(lay(q), lay(k), lay(v), allowed, label=f"{label}, {NON_CONTIGUOUS}")
    if call.ok:
        return call
    _seed(probe)
    return probe.call(q, k, v, allowed, label=label)


def _seed(probe: Probe) -> None:
    """Every call of this check, and its replay on the float64 copy, draws the layer's randomness from one seed (the
    seed of `seeded_call`; audit() restores the RNG): a dropout left on in eval drops the same weights in the replay
    (torch's dropout masks do not depend on the dtype), so that its difference is never taken for rounding."""
    probe.seed_layer_rng(SEEDED_CALLS ^ probe.seed)


def _has_learned_keys(probe: Probe) -> bool:
    """The standard probe's record shows keys the layer adds of its own (whose share the identical-values probe
    cannot hold still, however small it happens to be)."""
    base = probe.base()
    return base.ok and base.record is not None and learned_keys(base.record, probe.t, probe.t) is not None


def _judged_inside(probe: Probe, call: Call, reference: Call, tol: float) -> DetectorResult | None:
    """The verdict on what the layer computes inside, where its output legitimately differs between identical value
    rows: keys of its own (memory slots, sinks, a bias_kv), whose share of the weight depends on the queries and on
    how many tokens there are, judged on the product of the weights and the values; or a residual (and a norm) around
    the attention, whose output carries each query, judged on the attention's own output, the operand of the
    residual add. None when neither is there (the output's verdict stands)."""
    s = probe.subject
    t_q, t_k = call.query.shape[s.time_dim], call.key.shape[s.time_dim]
    probe.passes += 1
    trace = trace_call(s, call.query, call.key, call.value, call.allowed, seed=probe.seed)
    if trace.error is not None:  # (a trace's record is made before its call: only a call that raised lacks one)
        return None
    keys = learned_keys(trace.record, t_q, t_k)
    if keys is not None:
        return _judged_with_learned_keys(keys, t_q, t_k, tol, s.dtype, call)
    block = residual_add(trace, tuple(call.output.out.shape))
    concat = block is None
    if concat:  # no residual: an output projection that reads [attention; query] (Luong's)
        block = query_concat(trace)
    if block is None:  # a transform after the weighted sum (a gate, a convolution beside it, values rotated back)
        return _judged_at_weighted_sum(probe, trace, call, tol)
    probe.passes += 1
    again = trace_call(s, reference.query, reference.key, reference.value, reference.allowed, seed=probe.seed)
    alone = None
    if again.error is None:
        alone = query_concat(again) if concat else residual_add(again, tuple(reference.output.out.shape))
    if alone is None or alone.inner.shape != block.inner.shape[:1] + (1,) + block.inner.shape[2:]:  # (B, 1, D)
        return None
    got, expected = block.inner, alone.inner.expand_as(block.inner)
    change = relative_change(got, expected)
    if change is None:
        return None
    bad, worst = int((change > tol).sum()), float(change.max())
    idx = unravel(change.argmax(), change.shape)
    if concat:
        shape = (f"the layer's output is computed from [attention; query] (the concatenation at {short(block.add)}), "
                 f"so it carries each query; judged on the attention's own output, the operand of that concatenation")
    else:
        around = (f"{op_name(block.norm)}(query + attention)" if block.norm is not None else "query + attention")
        where = short(block.add) + (f", normalised at {short(block.norm)}" if block.norm is not None else "")
        shape = (f"the layer is a block: its output is {around} (the residual add at {where}), so the output carries "
                 f"each query; judged on the attention's own output, the operand of that add")
    text = (f"{shape}: {bad} / {change.numel()} of its "
            f"rows differ from its row for one query over that one token ({100 * bad / change.numel():.1f}%) when "
            f"every value row is the same vector; greatest difference {worst:.3g} at {at_text(idx, ('b', 't'))} (up "
            f"to {tol:.2g} of its RMS allowed for {dtype_name(s.dtype)})")
    inside = "before the output reads the query" if concat else "inside the block"
    if bad:
        return result("output_variance", "fail", f"the attention {inside} does not output a convex combination of "
                      "the values: identical value rows do not come out unchanged", value=worst,
                      threshold=tol, evidence=text, replay=VarianceReplay(call))
    judged = "judged before the concatenation with the query" if concat else "judged before its residual and norm"
    return result("output_variance", "pass", f"identical value rows come out unchanged from the attention {inside} "
                  f"({judged})", value=worst, threshold=tol, evidence=text)


def reattention(trace, weights: int) -> tuple[str, int, object] | None:
    """Where the tensor `weights` (the operand that multiplies the values) is computed from a softmax's output by a
    product with a square (H, H) parameter of the layer, H >= 2, that mixes the heads (DeepViT's re-attention,
    talking heads after the softmax): (the parameter's name, H, that product's op); else None."""
    layer = trace.layer
    if not isinstance(layer, torch.nn.Module):
        return None
    square = {id(p): (n, p.shape[0]) for n, p in layer.named_parameters()
              if p.dim() == 2 and p.shape[0] == p.shape[1] >= 2}

    def behind(i: int):  # the parameter behind an operand, through views and copies (einsum's unsqueeze, permute)
        viewed = through_carries(trace, producer(trace, i))
        return square.get(i if viewed is None else viewed.in_ids[0] if viewed.short in CARRIES else None)

    start = producer(trace, weights)
    if start is None:
        return None
    for index in sorted(ancestors(trace, start) | {start.index}, reverse=True):
        op = trace.ops[index]
        if op.short not in MATMULS:
            continue
        held = [h for h in map(behind, op.in_ids[-2:]) if h is not None]
        if held and any(trace.ops[a].short in SOFTMAXES for a in ancestors(trace, op)):
            return held[0][0], held[0][1], op
    return None


def query_concat(trace) -> Residual | None:
    """The last concatenation, along the features, of the query input (through views and copies) and a tensor
    computed from the keys: the attention's output beside its query, as an output projection that reads
    [context; query] takes it (Luong et al. 2015, `tanh(W_c [c_t; h_t])`). As `residual_add`'s record: the cat as
    the add, the attention's output as the inner operand."""
    for op in reversed(trace.ops):
        if op.short != "cat" or len(op.in_ids) != 2 or not op.outs or op.outs[0] is None:
            continue
        dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
        if dim not in (-1, op.outs[0].dim() - 1):
            continue
        ids = list(op.in_ids)
        query = [i for i in ids if carries_input(trace, i, "query")]
        if len(query) != 1:
            continue
        other = ids[1 - ids.index(query[0])]
        inner = value_before(trace, other, op.index)
        if inner is not None and {"key", "value"} & trace.sources.get(other, frozenset()):
            return Residual(op, inner, None)
    return None


def _judged_at_weighted_sum(probe: Probe, trace, call: Call, tol: float) -> DetectorResult | None:
    """A pass where the layer's output differs between identical value rows only because of what it computes after
    its weighted sum of the values (a gate of the query, a convolution branch beside the attention, values rotated by
    position and back, an output read from [context; query]): the property belongs to `weights @ values`, judged
    there (`_judged_with_learned_keys`, with no keys of its own) when it is observed and reads the value input, and
    when no view or reshape after it moves heads into the positions (`positions_mixed`) nor one before it positions
    into the heads (`positions_split`). None otherwise: the
    output's verdict stands, with its own evidence (a weighted sum that is not convex, heads merged without their
    transpose, values read from another stream, no softmax seen)."""
    s = probe.subject
    t_q, t_k = call.query.shape[s.time_dim], call.key.shape[s.time_dim]
    found = weighted_sum(trace.record, t_q, t_k)
    event = None if found is None else found.product if found.product is not None else found.fused
    op = None if event is None else event_op(trace, event)
    if found is None:  # no weighted sum over (Tq, Tk): several over keys of the layer's own making, mixed after
        return _judged_at_branches(trace, call, tol, s.dtype, t_q)
    if op is None or found.keys:
        return None
    if found.fused is not None:
        values = op.in_ids[2] if len(op.in_ids) > 2 else None
    else:  # baddbmm's bias comes first
        values = op.in_ids[(1 if op.short == "baddbmm" else 0) + 1 - found.weights_operand]
    if values is None or "value" not in trace.sources.get(values, frozenset()):
        return None
    mixed = None if found.fused is not None else reattention(
        trace, op.in_ids[(1 if op.short == "baddbmm" else 0) + found.weights_operand])
    if mixed is not None:
        return skip("output_variance", NOT_APPLICABLE + f"the weights that multiply the values (at {short(op)}) are "
                    f"the softmax's mixed across heads by the layer's ({mixed[1]}, {mixed[1]}) matrix {mixed[0]} at "
                    f"{short(mixed[2])} and changed again after (re-attention, DeepViT's Norm(Theta^T softmax)), so "
                    f"they are no convex combination by design; the softmax itself is judged by weight_row_sums")
    inside = _judged_with_learned_keys(found, t_q, t_k, tol, s.dtype, call)
    unchanged = tolerance(UNCHANGED, s.dtype)
    if inside.verdict != "pass" or positions_mixed(trace, op.index, t_q, unchanged) is not None \
            or positions_split(trace, op, t_q, unchanged) is not None:
        return None
    apart = positions_apart(trace, op.index, t_q, unchanged)
    after = ("" if apart is None else f"; the positions come apart at {short(apart)} ({op_name(apart)}), computed "
             f"from the weighted sum" if apart.index > op.index else
             f"; the positions are apart already in the values it weights (computed from the value input before "
             f"{short(op)})")
    return result("output_variance", "pass", "the weighted sum of the values inside the layer is a convex combination "
                  "of them; the output is computed from it afterwards (judged on weights @ values at "
                  f"{short(op)})", value=inside.value, threshold=tol,
                  evidence=f"the layer's output differs between identical tokens, so it was judged inside: "
                           f"{inside.evidence}{after}; no view or reshape after it moves heads into the positions")


BRANCHES = 2
"""The fewest weighted sums `_judged_at_branches` judges a layer on: one alone over keys of the layer's making is a
pooled attention (`pooled_keys`), whose output a correct layer passes as it is."""


def _judged_at_branches(trace, call: Call, tol: float, dtype, t_q: int) -> DetectorResult | None:
    """A pass where the output differs between identical value rows because it mixes several weighted sums, none over
    the (Tq, Tk) tokens (native sparse attention: compressed blocks, selected blocks and local windows, each attended
    apart and summed under sigmoid gates that need not sum to 1): at least BRANCHES products of a softmax's own weights
    (over its last axis, read as they are: `branch_sums`) with their values, and no view or reshape after one that
    moves heads into the positions, nor one before it that splits positions into heads (`positions_mixed`,
    `positions_split`: heads merged without their transpose still fail). On identical tokens such weights are even,
    so each product is a convex combination by construction: how far each output lies outside its values' range (in
    units of their RMS) is evidence, not a verdict. None otherwise (the output's verdict stands: a weighted sum whose
    weights were changed after the softmax, or normalised by nothing, is no branch)."""
    sums = branch_sums(trace.record)
    if len(sums) < BRANCHES:
        return None
    unchanged = tolerance(UNCHANGED, dtype)
    for _, m, _ in sums:
        op = event_op(trace, m)
        if op is None or positions_mixed(trace, op.index, t_q, unchanged) is not None \
                or positions_split(trace, op, t_q, unchanged) is not None:
            return None
    worst, texts = 0.0, []
    for sm, m, operand in sums:
        _, v, out = ((m.a, m.b, m.out) if operand == 0 else (x.transpose(-2, -1) for x in (m.b, m.a, m.out)))
        v, out = v.double(), out.double()  # (N, K, d), (N, rows, d)
        hi, lo = v.amax(-2, keepdim=True), v.amin(-2, keepdim=True)
        unit = v.square().mean((-2, -1), keepdim=True).sqrt().clamp_min(1e-30)
        excess = float((torch.maximum(out - hi, lo - out) / unit).clamp_min(0).nan_to_num(nan=math.inf).max())
        texts.append(f"{tuple(sm.output.shape)} weights at {short_frames(m.frames) if m.frames else 'a product'}: "
                     f"{excess:.2g}")
        worst = max(worst, excess)
    return result("output_variance", "pass", f"the output mixes {len(sums)} weighted sums of the values inside the "
                  f"layer, each a softmax's own weights over keys of its making times their values, and no reshape "
                  f"moves heads into the positions (judged on each weights @ values)", value=worst, threshold=tol,
                  evidence=f"the layer's output differs between identical tokens, and no weighted sum over the (Tq, Tk) "
                           f"tokens was seen, so each softmax's weights times its values was read: outputs outside the "
                           f"values' range, in units of their RMS: {'; '.join(texts)}")


def _judged_with_learned_keys(keys: LearnedKeys, t_q: int, t_k: int, tol: float, dtype, call: Call) -> DetectorResult:
    """A layer with keys of its own: the weights that multiply the values must be the softmax's, over the input's
    keys and the learned ones (a sink's column takes weight and multiplies no value), and each output of that product
    (or of the fused call) must lie within the range of the values it combines, with zero for a sink: a convex
    combination. Correct layers measured 0 (float32 and bfloat16, default and std-0.02 init; the weights are the
    softmax's very numbers); dropout in eval moves a row of weights by >= 0.30 in all, 10x bfloat16's allowance."""
    det = "output_variance"
    found = (f"{keys.describe()} found: the scores have {t_k + keys.keys} keys for the input's {t_k}" if keys.keys
             else "the weighted sum of the values observed")
    if keys.softmax is not None and keys.softmax.dim not in (-1, keys.softmax.output.dim() - 1):
        return result(det, "fail", "the output is not a convex combination of the values and the learned slots: the "
                      "softmax does not normalise over the keys", evidence=f"{found}; the softmax normalises dim "
                      f"{keys.softmax.dim} of the (..., Tq, Tk + {keys.keys}) scores, not the keys (dim -1)",
                      replay=VarianceReplay(call))
    if keys.fused is not None:  # the kernel's own weights: only its output can be judged
        f = keys.fused
        if f.out is None:
            return skip(det, f"{found}, at a fused attention call whose output was not observed")
        v, out, width = per_query_head(f.v.double(), f.q), f.out.double(), f.v.shape[-2]  # grouped: per query head
        v, out = v.reshape(-1, width, v.shape[-1]), out.reshape(-1, t_q, out.shape[-1])  # (N, K, d), (N, Tq, d)
        text, gap = f"{found}; judged on the output of the fused attention call", None
    elif keys.product is None:
        return skip(det, f"{found}, but no product of their weights with the values was observed")
    else:
        m = keys.product
        if keys.weights_operand == 0:  # (N, Tq, K) @ (N, K, d)
            w, v, out = m.a.double(), m.b.double(), m.out.double()
        else:  # values first: (N, d, K) @ (N, K, Tq)
            w, v, out = (x.double().transpose(-2, -1) for x in (m.b, m.a, m.out))
        width = w.shape[-1]
        weights = keys.softmax.output.double().reshape(-1, t_q, keys.softmax.output.shape[-1])  # (N, Tq, Tk + n)
        w, v, out = w.reshape(-1, t_q, width), v.reshape(-1, width, v.shape[-1]), out.reshape(-1, t_q, out.shape[-1])
        if w.shape[0] != weights.shape[0]:
            return skip(det, f"{found}, but the softmax's weights {tuple(keys.softmax.output.shape)} and those of the "
                             f"product {tuple(m.a.shape)} do not pair up")
        # the softmax's columns the product reads, its first or last `width` (the learned keys first or last): how
        # far apart the two rows are as distributions (the sum of |difference|, which the row-sum allowance bounds)
        gap = min(float((w - weights[..., cut]).abs().sum(-1).nan_to_num(math.inf).max())
                  for cut in (slice(0, width), slice(weights.shape[-1] - width, weights.shape[-1])))
        at = f" at {short_frames(m.frames)}" if m.frames else ""
        text = f"{found}; judged on the product of the weights and the values{at}"
        if gap > tol:
            return result(det, "fail", "the weights that multiply the values are not the softmax's over the keys and "
                          "the learned slots", value=gap, threshold=tol,
                          evidence=f"{text}: a row of its weights differs from the softmax's by {gap:.3g} in all (the "
                                   f"sum of |difference| over the keys; up to {tol:.2g} allowed for "
                                   f"{dtype_name(dtype)})", replay=VarianceReplay(call))
    sink = keys.values < keys.keys
    if sink:  # a sink's weight multiplies nothing: zero is one of the combined vectors
        v = torch.cat([v, torch.zeros_like(v[:, :1])], 1)
    hi, lo = v.amax(-2, keepdim=True), v.amin(-2, keepdim=True)  # (N, 1, d)
    # in units of the values' RMS (of each head): a feature in which the slots and the values nearly agree has a range
    # too narrow to measure rounding against (float32 measured 2e-5 of it at the fused kernel's output)
    unit = v.square().mean((-2, -1), keepdim=True).sqrt().clamp_min(1e-30)  # (N, 1, 1)
    excess = (torch.maximum(out - hi, lo - out) / unit).clamp_min(0).nan_to_num(nan=math.inf)  # (N, Tq, d)
    worst, bad = float(excess.max()), int((excess > tol).sum())
    text += ((f": its weights are the softmax's ({gap:.2g} apart in a row at most); " if gap is not None else ": ")
             + f"{bad} / {excess.numel()} of its outputs lie outside the range of the {width} value rows"
               f"{' and zero' if sink else ''} they combine, by up to {worst:.3g} of the values' RMS (up to {tol:.2g} "
               f"allowed for {dtype_name(dtype)})")
    if bad:
        return result(det, "fail", "the output is not a convex combination of the values and the learned slots",
                      value=worst, threshold=tol, evidence=text, replay=VarianceReplay(call))
    return result(det, "pass", f"the output is a convex combination of the values and the layer's {keys.describe()}",
                  value=worst, threshold=tol, evidence=text)


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
