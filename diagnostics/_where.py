"""Point at the line: for each finding, the places in the user's code where the mistake is.

A passing audit pays nothing here. Each result that failed (or warned) gets a `Sites` whose sites are found
the first time someone reads them (a report printed, a test looking at `where`; a test that checks verdicts
only never pays): one more call of the layer, or one pair of calls, under a `Tracer`: every aten op it runs,
with the user's frames where it ran (the first frames outside torch and diagnostics), its outputs, which
probe inputs it depends on, and the user functions that returned a tensor they were given unchanged (a step
that did nothing). What is reported depends on the property:

- invariances (future leakage, masks honoured, query locality, batch independence, eval determinism,
  decode consistency): the baseline and the perturbed call run side by side, and the first op, in execution
  order, whose output moves where it must not is the site: where the leak enters, whatever the code looks
  like. An output element "must not move" when every position it is indexed by (batch, query, key) is one
  whose inputs did not change and whose output must hold; axes are told by their sizes.
- masks (before that, for the mask, future and alignment properties): the masking ops on (Tq, Tk) scores
  (masked_fill, where, an additive mask, a multiplication by a bool mask, a fused call's attn_mask and
  is_causal) against what the audit declared blocked: an op that blocks allowed keys, or masks that leave
  blocked keys open (then the op that built the mask, and the masking op), or a mask applied after the
  softmax. No masking op at all: the function that returned the scores unchanged where a mask belongs.
- the softmax temperature: the q·k matmul, the softmax it feeds and the scaling ops on the way, or, when
  there is none, where the scale belongs; for weights that are not the softmax's output, what made them.
- weight row sums: the op that produced the weights (a softmax over the wrong dim, with the size and meaning
  of that dim; a mask or dropout after the softmax; no softmax at all).
- non-finite outputs: the first op whose output has NaN or inf where its inputs had none.
- streams (output shape, query locality and keys mattering in cross-attention): a q·k or weights·v operand
  that does not come from the input it should, and the op that read the wrong one.
- gradients: a `.detach()` on the way, or a hand-written backward.
- `runs`: the user's line in the exception's traceback.

Nothing here knows the catalog or any implementation: only aten ops, their shapes and the declared mask.
"""

from __future__ import annotations

import linecache
import math
import os
import re
import sys
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ._core import relative_change
from ._guard import untouched
from ._observe import FusedAttention as Fused
from ._frames import frame_kind, traceback_frames, user_frames
from ._observe import Observer, Scaling, SoftmaxCall, applied_scales
from ._result import DetectorResult, Site, Sites
from ._thresholds import ROW_SUM, UNCHANGED, tolerance

ENABLED = os.environ.get("ATTENTION_AUDIT_WHERE", "1") != "0"
"""ATTENTION_AUDIT_WHERE=0 skips pointing at lines (findings then have no `where`): for timing what it costs."""

MAX_KEPT = 1 << 22
"""Op outputs larger than this many elements are not kept by a trace (a long audit's (T, T) scores); the
comparisons skip them."""

_NOTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # probe -> [(detector, Comparison)]


def note_comparison(probe, comparison) -> None:
    """Called by the perturb-and-compare core for every comparison a detector judges: kept, by reference,
    until the audit asks where a failed one went wrong."""
    _NOTED.setdefault(probe, []).append((probe.detector, comparison))


# ---- sites -----------------------------------------------------------------------------------------------


def _text(file: str, line: int) -> str:
    return linecache.getline(file, line).strip()


def site(frames: tuple, op: str, note: str = "") -> Site | None:
    """A `Site` from user_frames() ((code, lineno), ...), innermost first; None when there is none."""
    if not frames:
        return None
    code, line = frames[0]
    callers = tuple((c.co_filename, n, getattr(c, "co_qualname", c.co_name)) for c, n in frames[1:])
    return Site(code.co_filename, int(line), getattr(code, "co_qualname", code.co_name), _text(code.co_filename, line),
                op, note, callers)


def _unique(sites) -> tuple[Site, ...]:
    out, seen = [], set()
    for s in sites:
        if s is not None and (s.file, s.line) not in seen:
            seen.add((s.file, s.line))
            out.append(s)
    return tuple(out)


# ---- tracing ---------------------------------------------------------------------------------------------


@dataclass
class Op:
    index: int
    name: str  # e.g. "aten.masked_fill.Scalar"
    args: tuple  # tensors detached (not copied), other values as they were
    kwargs: dict
    outs: tuple  # copies of the outputs at the time (None where too large or not a tensor)
    out_ids: tuple
    in_ids: tuple
    frames: tuple
    sources: frozenset  # which probe inputs ("query", "key", "value") it depends on

    @property
    def short(self) -> str:
        return self.name.replace("aten.", "").split(".")[0]


@dataclass
class Unchanged:
    """A user function that returned one of its tensor arguments as it was: a step that did nothing."""

    at: int  # the number of ops recorded before it returned
    frames: tuple
    function: str
    tensor: int  # id of the tensor
    called: int = 0  # the order it was called in (an outer function before the helper it delegates to)


@dataclass
class Trace:
    ops: list[Op] = field(default_factory=list)
    unchanged: list[Unchanged] = field(default_factory=list)
    producer: dict = field(default_factory=dict)  # id(tensor) -> index of the op that last wrote it
    sources: dict = field(default_factory=dict)  # id(tensor) -> frozenset of probe inputs
    event_op: dict = field(default_factory=dict)  # id(observer event) -> op index
    inputs: dict = field(default_factory=dict)  # id(tensor) -> "query" | "key" | "value"
    buffers: dict = field(default_factory=dict)  # id(tensor) -> name, the layer's buffers and parameters
    record: object = None
    output: object = None
    error: BaseException | None = None
    alive: list = field(default_factory=list)


def _tensors(x):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class Tracer(Observer):
    """The observer, plus every op with its outputs, frames and dependence on the probe inputs."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        trace.record = self.record
        self._params: dict = {}
        self._calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = len(self.record.order)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        try:
            self._op(func, args, kwargs, out, before)
        except Exception:  # tracing must never break the layer
            pass
        return out

    def _op(self, func, args, kwargs, out, before):
        t = self.trace
        index = len(t.ops)
        for event in self.record.order[before:]:
            t.event_op[id(event)] = index
        ins = [x for a in list(args) + list(kwargs.values()) for x in _tensors(a)]
        sources = frozenset().union(*(t.sources.get(id(x), frozenset()) for x in ins)) if ins else frozenset()
        outs = list(_tensors(out))
        kept = tuple(o.detach().clone() if o.numel() <= MAX_KEPT else None for o in outs)
        for o in outs:
            t.producer[id(o)] = index
            t.sources[id(o)] = sources | t.sources.get(id(o), frozenset())
            t.alive.append(o)
        t.alive.extend(ins)
        t.ops.append(Op(index, str(func), tuple(a.detach() if isinstance(a, Tensor) else a for a in args), dict(kwargs),
                        kept, tuple(id(o) for o in outs), tuple(id(x) for x in ins),
                        user_frames(sys._getframe(2)), sources))

    # user functions that hand back a tensor they were given, untouched
    def _profile(self, frame, event, arg):
        if event == "call":
            if frame_kind(frame.f_code) == 0:
                code = frame.f_code
                names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                ids = {id(v) for n in names for v in (frame.f_locals.get(n),) if isinstance(v, Tensor)}
                if ids:
                    self._calls += 1
                    self._params[id(frame)] = (ids, self._calls)
        elif event == "return":
            ids, called = self._params.pop(id(frame), (None, 0))
            if ids and isinstance(arg, Tensor) and id(arg) in ids:
                self.trace.unchanged.append(Unchanged(len(self.trace.ops), user_frames(frame), frame.f_code.co_name,
                                                      id(arg), called))

    def __enter__(self):
        self._old_profile = sys.getprofile()
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(self._old_profile)
        return super().__exit__(*exc)


def trace_call(subject, query, key, value, allowed, *, seed: int | None = 0, call=None) -> Trace:
    """Call the subject once under a Tracer (grad mode on, as observed calls are); never raises. `call`: a
    function of no argument to run instead of `subject(query, key, value, allowed)`."""
    t = Trace()
    for name, x in (("query", query), ("key", key), ("value", value)):
        t.sources[id(x)] = t.sources.get(id(x), frozenset()) | {name}
        t.inputs.setdefault(id(x), name)
    t.alive += [query, key, value]
    layer = getattr(subject, "layer", None)
    if isinstance(layer, torch.nn.Module):
        t.buffers = {id(b): name for name, b in list(layer.named_buffers()) + list(layer.named_parameters())}
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.enable_grad(), Tracer(t):
            t.output = subject(query, key, value, allowed) if call is None else call()
    except Exception as error:
        t.error = error
    return t


# ---- helpers on a trace ----------------------------------------------------------------------------------

_CARRIES = {"view", "_unsafe_view", "reshape", "clone", "transpose", "permute", "expand", "t", "_to_copy",
            "contiguous", "unsqueeze", "squeeze", "slice", "select", "alias", "detach", "_reshape_alias", "to",
            "lift_fresh", "copy_", "nan_to_num", "type_as"}
_MATMULS = {"bmm", "mm", "baddbmm", "matmul"}
_SOFTMAXES = {"_softmax", "_safe_softmax"}
_UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}  # memory, not values


def _producer(trace: Trace, tensor_id: int) -> Op | None:
    i = trace.producer.get(tensor_id)
    return None if i is None else trace.ops[i]


def _through_carries(trace: Trace, op: Op | None) -> Op | None:
    """Back from `op` through views, copies and casts to the op that computed the values."""
    seen = 0
    while op is not None and op.short in _CARRIES and op.in_ids and seen < 64:
        src = op.in_ids[-1] if op.short == "copy_" else op.in_ids[0]
        if src in trace.inputs:
            return op
        prev = _producer(trace, src)
        if prev is None:
            return op
        op, seen = prev, seen + 1
    return op


def _past_zeroing(trace: Trace, op: Op | None) -> Op | None:
    """A fill after a softmax that only zeroes rows the softmax left without weight (NaN rows of a query with
    no key: a safe softmax) is part of that softmax: return the softmax."""
    if op is None or op.short not in ("masked_fill", "masked_fill_", "where") or not op.in_ids:
        return op
    soft = _through_carries(trace, _producer(trace, op.in_ids[0]))
    if soft is None or soft.short not in _SOFTMAXES or not soft.outs or soft.outs[0] is None:
        return op
    out = soft.outs[0]
    got = _fill_pattern(op, *out.shape[-2:]) if out.dim() >= 2 else None
    if got is None or got[0].shape != out.shape or bool((got[0] & (out > 0)).any()):
        return op
    return soft


def _ancestors(trace: Trace, op: Op, limit: int = 4096) -> set[int]:
    """Indices of the ops whose outputs `op` depends on."""
    out, todo = set(), list(op.in_ids)
    while todo and len(out) < limit:
        p = trace.producer.get(todo.pop())
        if p is not None and p not in out and p < op.index:
            out.add(p)
            todo.extend(trace.ops[p].in_ids)
    return out


def _user(op: Op | None) -> bool:
    return op is not None and bool(op.frames)


def _op_site(op: Op | None, note: str = "", label: str | None = None) -> Site | None:
    if op is None:
        return None
    return site(op.frames, label or op.name.replace(".default", ""), note)


def _event_op(trace: Trace, event) -> Op | None:
    i = trace.event_op.get(id(event))
    return None if i is None else trace.ops[i]


def _first_softmax(trace: Trace, t_q: int, t_k: int) -> Op | None:
    for op in trace.ops:
        if op.short in _SOFTMAXES and op.outs and op.outs[0] is not None and tuple(op.outs[0].shape[-2:]) == (t_q, t_k):
            return op
    for op in trace.ops:
        if op.short in _SOFTMAXES:
            return op
    return None


def _fused_ops(trace: Trace) -> list[Op]:
    return [op for op in trace.ops if "scaled_dot_product" in op.name and "backward" not in op.name]


def _qk_matmul(trace: Trace, before: int) -> Op | None:
    """The last matmul before op index `before` (the scores a softmax normalises)."""
    for op in reversed(trace.ops[:before]):
        if op.short in _MATMULS:
            return op
    return None


def _did_nothing(trace: Trace, start: int, end: int, words: tuple[str, ...]) -> list[Site]:
    """Sites of user functions that returned their tensor unchanged between ops `start` and `end`, those named
    like the missing step first (`words`), each in the order they returned."""
    found = sorted((u for u in trace.unchanged if start <= u.at <= end and u.frames), key=lambda u: u.called)
    pattern = re.compile("|".join(words), re.I) if words else None
    # the closest name first (`mask` before `apply_mask`), then the order they were called in
    named = sorted((u for u in found if pattern and pattern.search(u.function)),
                   key=lambda u: (len(u.function) - len(pattern.search(u.function).group()), u.called))
    rest = [u for u in found if u not in named]
    return [site(u.frames, "returned its input unchanged", f"{u.function}() hands back the tensor it was given: "
                 f"the step its name promises does nothing here") for u in named] + \
           [site(u.frames, "returned its input unchanged", f"{u.function}() hands back the tensor it was given")
            for u in rest]


# ---- masks -----------------------------------------------------------------------------------------------


def _fill_pattern(op: Op, t_q: int, t_k: int) -> tuple[Tensor, int | None] | None:
    """(bool filled, index of the mask tensor's producer) of a masking op on (..., Tq, Tk) scores."""
    name, a = op.short, op.args
    out = op.outs[0] if op.outs else None
    if out is None or out.dim() < 2 or tuple(out.shape[-2:]) != (t_q, t_k):
        return None
    mask_arg = None
    if name in ("masked_fill", "masked_fill_") and len(a) >= 2 and isinstance(a[1], Tensor):
        filled, mask_arg = a[1], a[1]
    elif name == "where" and len(a) >= 3 and isinstance(a[0], Tensor) and a[0].dtype == torch.bool:
        x, y = a[1], a[2]
        big = lambda z: not isinstance(z, Tensor) or z.numel() == 1 or z.numel() < out.numel()  # noqa: E731
        if big(y) and not big(x):
            filled = ~a[0]
        elif big(x) and not big(y):
            filled = a[0]
        else:
            return None
        mask_arg = a[0]
    elif name in ("add", "add_") and len(a) >= 2 and all(isinstance(z, Tensor) for z in a[:2]):
        lows = [z for z in a[:2] if z.is_floating_point() and z.numel() > 1 and bool((z <= -1e4).any())]
        if not lows:
            return None
        filled, mask_arg = lows[0] <= -1e4, lows[0]
    elif name in ("mul", "mul_") and len(a) >= 2 and all(isinstance(z, Tensor) for z in a[:2]):
        bools = [z for z in a[:2] if z.dtype == torch.bool]
        if not bools:
            return None
        filled, mask_arg = ~bools[0], bools[0]
    else:
        return None
    try:
        filled = filled.to(torch.bool).expand(out.shape)
    except RuntimeError:
        return None
    tensors = [x for x in op.args if isinstance(x, Tensor)]
    at = next((n for n, x in enumerate(tensors) if x is mask_arg), None)
    return filled, (op.in_ids[at] if at is not None and at < len(op.in_ids) else None)


def _fused_pattern(op: Op, t_q: int, t_k: int) -> Tensor | None:
    a, kw = op.args, op.kwargs
    q = a[0]
    shape = tuple(q.shape[:-2]) + (t_q, t_k)
    mask = kw.get("attn_mask")
    if mask is None:
        mask = next((x for x in a[3:] if isinstance(x, Tensor)), None)
    causal = bool(kw.get("is_causal", next((x for x in a[3:] if isinstance(x, bool)), False)))
    filled = torch.zeros(shape, dtype=torch.bool)
    if mask is not None:
        m = mask.cpu()
        filled = filled | (~m if m.dtype == torch.bool else m <= -1e4)
    if causal:
        i, j = torch.arange(t_q).unsqueeze(-1), torch.arange(t_k)
        filled = filled | (j > i)
    return filled.expand(shape)


def _per_batch(filled: Tensor, B: int) -> Tensor | None:
    """(..., Tq, Tk) -> (B, Tq, Tk): a key is filled for a query of sequence b if it is in some head."""
    f = filled.cpu()
    if f.dim() == 2:
        return f.expand(B, *f.shape)
    lead = f.shape[0]
    if lead == 1:
        return f.reshape(1, -1, *f.shape[-2:]).any(1).expand(B, *f.shape[-2:])
    if lead % B:
        return None
    return f.reshape(B, -1, *f.shape[-2:]).any(1)


def mask_sites(trace: Trace, declared: Tensor, B: int, t_q: int, t_k: int) -> list[Site]:
    """Masking ops judged against `declared`, bool (B, Tq, Tk) True = may attend: [] when they agree."""
    declared = declared.cpu()
    soft = _first_softmax(trace, t_q, t_k)
    end = soft.index if soft is not None else len(trace.ops)
    masking = []  # (op, filled (B, Tq, Tk), mask producer index, before the softmax)
    for op in trace.ops:
        if not op.frames:
            continue
        if "scaled_dot_product" in op.name and "backward" not in op.name:
            q_len, k_len = op.args[0].shape[-2], op.args[1].shape[-2]
            if (q_len, k_len) != (t_q, t_k):  # not these queries over these keys (a cache lost a key)
                continue
            f = _fused_pattern(op, t_q, t_k)
            mask = op.kwargs.get("attn_mask")
            if mask is None:
                mask = next((x for x in op.args[3:] if isinstance(x, Tensor)), None)
            mask_id = op.in_ids[3] if mask is not None and len(op.in_ids) > 3 else None
            if f is not None and (_per_batch(f, B)) is not None:
                masking.append((op, _per_batch(f, B), mask_id, True))
            continue
        got = _fill_pattern(op, t_q, t_k)
        if got is None:
            continue
        per = _per_batch(got[0], B)
        if per is not None:
            masking.append((op, per, got[1], op.index < end))
    rows = declared.any(-1, keepdim=True)  # queries with some key to attend
    sites: list[Site] = []

    def made_by(mask_id, user_of=None):
        """The user op that built a mask: back through carries and through what the masking op's own line
        did to it (torch's SDPA turns a bool mask into an additive one on the caller's line)."""
        p = _through_carries(trace, _producer(trace, mask_id) if mask_id is not None else None)
        steps = 0
        while p is not None and user_of is not None and p.frames[:1] == user_of.frames[:1] and steps < 32:
            prev = next((trace.producer[x] for x in p.in_ids if x in trace.producer), None)
            p = _through_carries(trace, None if prev is None else trace.ops[prev])
            steps += 1
        return p if _user(p) else None

    # a mask applied after the softmax (a fill on rows that still have keys to attend)
    weighted = soft.outs[0] > 0 if soft is not None and soft.outs and soft.outs[0] is not None else None
    if soft is not None and weighted is not None:
        for op, f, made, before in masking:
            full = _fill_pattern(op, t_q, t_k)
            # zeroing weights the softmax gave (not the NaN rows of a query with no key, which a safe softmax zeroes)
            hits = (full is not None and full[0].shape == weighted.shape and bool((full[0] & weighted).any()))
            if not before and hits and soft.index in _ancestors(trace, op):
                sites += [_op_site(op, f"the mask is applied after the softmax at {_short(soft)}: the kept weights "
                                       f"no longer sum to 1, and blocked keys still shape them through the "
                                       f"normaliser"), _op_site(soft, "the softmax the mask should come before")]
        if sites:
            return sites
    before_ops = [(op, f, made) for op, f, made, before in masking if before]
    # an op that blocks keys the declared mask allows
    for op, f, made in before_ops:
        wrong = f & declared
        if bool(wrong.any()):
            n, total = int(wrong.sum()), int(declared.sum())
            b, i, j = (int(x) for x in wrong.nonzero()[0])
            note = (f"blocks {n} of the {total} (query, key) pairs the declared mask allows, e.g. query {i} -> key "
                    f"{j} in sequence {b}")
            maker = made_by(made, op)
            buffer = _buffer_behind(trace, made)
            note += f"; the mask comes from the layer's `{buffer}`, built before the call" if buffer else ""
            sites += [_op_site(maker, "builds the mask used below") if maker is not None and
                      maker.frames[0] != op.frames[0] else None, _op_site(op, note)]
    union = torch.zeros_like(declared)
    for _, f, _ in before_ops:
        union |= f
    missing = ~declared & ~union & rows
    if bool(missing.any()):
        n = int(missing.sum())
        b, i, j = (int(x) for x in missing.nonzero()[0])
        what = (f"leaves {n} blocked (query, key) pairs open, e.g. query {i} -> key {j} in sequence {b}"
                f"{' (a future key)' if j > i + t_k - t_q else ''}")
        if before_ops:
            for op, f, made in before_ops:
                maker = made_by(made, op)
                buffer = _buffer_behind(trace, made)
                from_buffer = f"; the mask comes from the layer's `{buffer}`, built before the call" if buffer else ""
                sites += [_op_site(maker, f"builds the mask that {what}") if maker is not None and
                          maker.frames[0] != op.frames[0] else None,
                          _op_site(op, f"the mask applied here {what}{from_buffer}")]
        else:
            matmul = _qk_matmul(trace, end)
            start = matmul.index if matmul is not None else 0
            sites += _did_nothing(trace, start, end, ("mask", "causal"))
            sites += [_op_site(soft, f"no masking op reaches this softmax: it {what}"),
                      _op_site(matmul, "the scores that should be masked before the softmax")]
    return [s for s in sites if s is not None]


def _buffer_behind(trace: Trace, tensor_id: int | None) -> str:
    """The name of the layer's buffer a mask was computed from (nanoGPT's `bias`), if any: built before the
    call, so no traced op shows where; the note says which to read."""
    todo, seen = [tensor_id], 0
    while todo and seen < 64:
        i = todo.pop()
        seen += 1
        if i is None:
            continue
        if i in trace.buffers:
            return trace.buffers[i]
        p = trace.producer.get(i)
        if p is not None:
            todo.extend(trace.ops[p].in_ids)
    return ""


def _short(op: Op) -> str:
    s = _op_site(op)
    return f"{s.file.rsplit('/', 1)[-1]}:{s.line}" if s else op.name


# ---- differential ----------------------------------------------------------------------------------------


def _held_elements(shape: tuple, P: Tensor) -> Tensor | None:
    """Bool `shape`: elements every position index of which is held (P: bool (B, T)); None when no axis can
    be read as a position."""
    B, T = P.shape
    dims = list(shape)
    if not dims:
        return None
    nd = len(dims)

    def place(values: Tensor, axes: tuple[int, ...]) -> Tensor:
        view = [1] * nd
        for a, n in zip(axes, values.shape):
            view[a] = n
        return values.reshape(view)

    held = torch.ones(shape, dtype=torch.bool)
    if dims[0] == B * T and T > 1 and B > 1:  # (B*T, D): a linear layer's flattened input or output
        return held & place(P.reshape(-1), (0,))
    if dims[0] == B or (nd >= 3 and dims[0] % B == 0 and dims[0] != T):
        # (B, ...) or batch-major (B*H, T, ...) as bmm sees heads; every other axis of length T is a position
        k, batch_axis = dims[0] // B, 0
        per = P.repeat_interleave(k, 0)  # (B*k, T)
        time_axes = [a for a in range(1, nd) if dims[a] == T]
    elif nd >= 2 and dims[0] == T and dims[1] % B == 0 and dims[1] != T:  # sequence first: (T, B[*H], ...)
        k, batch_axis = dims[1] // B, 1
        per = P.repeat_interleave(k, 0)
        time_axes = [0] + [a for a in range(2, nd) if dims[a] == T]
    else:  # no batch axis to read (a mean over the batch): hold only positions held in every sequence
        batch_axis, per = None, None
        time_axes = [a for a in range(nd) if dims[a] == T]
    # an axis of length T that is not a position (d_k == T) only holds fewer elements: never a false "moved"
    if not time_axes:
        if batch_axis is None:
            return None
        return held & place(per.all(-1), (batch_axis,))
    for a in time_axes:
        if batch_axis is None:
            held = held & place(P.all(0), (a,))
        elif batch_axis < a:
            held = held & place(per, (batch_axis, a))
        else:
            held = held & place(per.transpose(0, 1), (a, batch_axis))
    return held


def _moved(new: Tensor, old: Tensor, tol: float) -> Tensor:
    if not (old.is_floating_point() or old.is_complex()):
        return (new != old).cpu()
    o, n = old.double().cpu(), new.double().cpu()
    finite = o[torch.isfinite(o)]
    scale = float(finite.square().mean().sqrt()) if finite.numel() else 1.0
    same = (n == o) | (torch.isnan(n) & torch.isnan(o))
    return ~same & ~((n - o).abs() <= tol * (scale or 1.0))


def _aligned(a: Trace, b: Trace) -> list[tuple[Op, Op]]:
    """Pairs of ops of two calls that ran the same op from the same line, in order (a cached call runs ops the
    full pass does not: the concatenation with the cache)."""
    import difflib

    key = lambda op: (op.name, op.frames[0][0].co_filename if op.frames else "", op.frames[0][1] if op.frames else 0)  # noqa: E731
    matcher = difflib.SequenceMatcher(None, [key(x) for x in a.ops], [key(y) for y in b.ops], autojunk=False)
    return [(a.ops[i + k], b.ops[j + k]) for i, j, n in matcher.get_matching_blocks() for k in range(n)]


def first_moved(a: Trace, b: Trace, P: Tensor | None, tol: float, *, tail: int | None = None) -> Op | None:
    """The first op of `b` (with a user frame) whose output differs from `a`'s where it must not. `P`: held
    positions (B, T) for the position rule; `tail`: b is the last `tail` queries of a (decoding), compared
    with a's last rows, the ops of the two calls paired by what they ran and where."""
    pairs = _aligned(a, b) if tail is not None else zip(a.ops, b.ops)
    for x, y in pairs:
        if x.name != y.name:
            return None  # the two calls took different paths from here on
        if not y.frames or y.short in _UNINITIALISED:
            continue
        for ox, oy in zip(x.outs, y.outs):
            if ox is None or oy is None:
                continue
            if tail is not None:
                ox = _last_rows(ox, oy.shape, tail)
                if ox is None:
                    continue
                if bool(_moved(oy, ox, tol).any()):
                    return y
                continue
            if ox.shape != oy.shape:
                continue
            held = _held_elements(tuple(oy.shape), P)
            if held is None:
                continue
            if bool((_moved(oy, ox, tol) & held).any()):
                return y
    return None


def _last_rows(full: Tensor, shape: torch.Size, n: int) -> Tensor | None:
    """`full` cut to `shape` by keeping the last `n` entries of the axes where only the length differs."""
    if full.dim() != len(shape):
        return None
    out = full
    for a, (f, s) in enumerate(zip(full.shape, shape)):
        if f != s:
            if s != n or f < n:
                return None
            out = out.narrow(a, f - n, n)
    return out


# ---- per detector ----------------------------------------------------------------------------------------


def _declared(probe, B: int, t_q: int, t_k: int, allowed: Tensor | None) -> Tensor:
    """What the audit declares: the mask passed (True = may attend) and, for a causal audit, bottom-right causal."""
    out = torch.ones(B, t_q, t_k, dtype=torch.bool) if allowed is None else allowed.cpu().bool().expand(B, t_q, t_k)
    if probe.causal:
        i, j = torch.arange(t_q).unsqueeze(-1), torch.arange(t_k)
        out = out & (j <= i + t_k - t_q)
    return out


def _held_positions(probe, base, case) -> Tensor:
    s = probe.subject
    t = s.time_dim

    def changed(x, y):
        if x is y:
            return torch.zeros(x.shape[0], x.shape[t], dtype=torch.bool)
        d = (x != y)
        d = d.reshape(*d.shape[:t + 1], -1).any(-1)  # fold features
        return d.reshape(d.shape[0], -1, d.shape[-1]).any(1).cpu()  # fold heads: (B, T)

    moved = changed(base.query, case.inputs.query)
    if base.key.shape == base.query.shape:
        moved = moved | changed(base.key, case.inputs.key) | changed(base.value, case.inputs.value)
    return case.hold.cpu() & ~moved


def _invariance(probe, det: str, use_masks: bool) -> list[Site]:
    """The first case of the detector's comparisons in which a held row moved: its masks (`use_masks`), or its
    input streams (query locality of a cross-attention), else baseline and case traced side by side."""
    noted = [c for d, c in _NOTED.get(probe, []) if d == det]
    for comparison in noted:
        tol = comparison.tol
        for case, change in zip(comparison.cases, comparison.changes):
            hold = case.hold.to(change.device)
            hold = hold.view(hold.shape[0], *([1] * (change.dim() - 2)), hold.shape[-1]).expand_as(change)
            if not bool((change[hold] > tol).any()):
                continue
            base = comparison.base if comparison.base is not None else case.inputs
            s = probe.subject
            B, t_q, t_k = base.query.shape[0], base.query.shape[s.time_dim], base.key.shape[s.time_dim]
            seed = None if det == "eval_determinism" else probe.seed
            allowed = probe.allowed(B, t_q, t_k, base.extra)
            a = trace_call(s, base.query, base.key, base.value, allowed, seed=seed)
            sites: list[Site] = []
            if use_masks:
                sites += mask_sites(a, _declared(probe, B, t_q, t_k, allowed), B, t_q, t_k)
            if not sites and det in ("query_locality",) and not base.one_stream:
                sites += stream_sites(a, s)
            if not sites:
                b = trace_call(s, case.inputs.query, case.inputs.key, case.inputs.value,
                               probe.allowed(B, t_q, t_k, case.inputs.extra), seed=seed)
                P = (torch.ones(B, t_q, dtype=torch.bool) if det == "eval_determinism"
                     else _held_positions(probe, base, case))
                op = first_moved(a, b, P, tol)
                if op is not None:
                    sites.append(_op_site(op, _moved_note(det)))
            return sites
    return []


def _moved_note(det: str) -> str:
    return {"future_leakage": "the first op whose output at past positions moves when only later tokens change",
            "mask_honoured": "the first op whose output moves when only keys the mask blocks change",
            "query_locality": "the first op whose output at other positions moves when one query changes",
            "batch_independence": "the first op whose output for one sequence moves when only another changes",
            "eval_determinism": "the first op whose output differs between two eval-mode calls on the same input",
            }.get(det, "the first op whose output moves where it must not")


def stream_sites(trace: Trace, subject) -> list[Site]:
    """A q·k or weights·v operand that does not depend on the input stream it should (cross-attention): the
    op that read the wrong input on its way there, then the product."""
    value = "value" if getattr(subject, "separate_value", True) else "key"
    checks = []  # (operand tensor id, the input it must come from, what it is, the product)
    fused = _fused_ops(trace)
    soft = next((op for op in trace.ops if op.short in _SOFTMAXES), None)
    if fused:
        f = fused[0]
        checks = [(f.in_ids[0], "query", "the queries", f), (f.in_ids[1], "key", "the keys", f),
                  (f.in_ids[2], value, "the values", f)]
    elif soft is not None:
        qk = _qk_matmul(trace, soft.index)
        if qk is None:
            return []
        checks = [(qk.in_ids[-2], "query", "the queries (left operand of q·k)", qk),
                  (qk.in_ids[-1], "key", "the keys (right operand of q·k)", qk)]
        wv = next((op for op in trace.ops[soft.index + 1:]
                   if op.short in _MATMULS and soft.index in _ancestors(trace, op)), None)
        if wv is not None:
            checks.append((wv.in_ids[-1], value, "the values (right operand of weights·values)", wv))
    sites = []
    for tensor_id, stream, what, product in checks:
        got = trace.sources.get(tensor_id, frozenset())
        if stream in got or not got:
            continue
        wrong = "/".join(sorted(got))
        reader = _first_reader(trace, tensor_id)
        sites += [_op_site(reader, f"{what} at {_short(product)} are computed here from the {wrong} input, not "
                                   f"from the {stream} input"),
                  _op_site(product, f"{what} of this product depend on the {wrong} input, not on the {stream} input")]
    return [x for x in sites if x is not None]


def _first_reader(trace: Trace, tensor_id: int) -> Op | None:
    """Back from a tensor to the user op that read a probe input directly on the way to it."""
    op = _producer(trace, tensor_id)
    seen = 0
    while op is not None and seen < 256:
        direct = [i for i in op.in_ids if i in trace.inputs]
        if direct and op.frames:
            return _computing(trace, op)
        prev = next((trace.producer.get(i) for i in op.in_ids if trace.sources.get(i)), None)
        op = None if prev is None else trace.ops[prev]
        seen += 1
    return None


def _computing(trace: Trace, op: Op) -> Op:
    """From a view of an input to the op of the same line that computes with it (F.linear: view, then addmm),
    so that the site names the computation."""
    outs, at = set(op.out_ids), op
    for later in trace.ops[op.index + 1:op.index + 16]:
        if later.frames[:1] != op.frames[:1] or not outs & set(later.in_ids):
            continue
        if later.short not in _CARRIES:
            return later
        outs |= set(later.out_ids)
    return at


def _base_trace(probe) -> Trace:
    base = probe.base()
    return trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed)


def _scale_sites(probe) -> list[Site]:
    base = probe.base()
    if not base.ok:
        return []
    trace = _base_trace(probe)
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
    if worst.fused is not None:
        op = _event_op(trace, worst.fused)
        scalings = [e for e in rec.order[:rec.order.index(worst.fused)] if isinstance(e, Scaling)]
        return _unique([site(e.frames, e.op, f"multiplies by {e.factor:.4g}; {said}") for e in scalings]
                       + [_op_site(op, said)])
    soft_op, mm_op = _event_op(trace, worst.softmax), _event_op(trace, worst.matmul)
    if worst.used_by is not None:  # the weights that multiply the values are not the softmax's output
        wv = _event_op(trace, worst.used_by)
        maker = None if wv is None else _past_zeroing(trace, _through_carries(trace, _producer(trace, wv.in_ids[0])))
        return _unique([_op_site(maker, f"the weights that multiply the values are made here from the softmax at "
                                        f"{_short(soft_op) if soft_op else '?'}: their temperature is {r:.3g}x "
                                        f"the expected one"), _op_site(soft_op, "the softmax of q·k")])
    i_soft = rec.order.index(worst.softmax)
    prev_soft = max([j for j, e in enumerate(rec.order[:i_soft]) if isinstance(e, (SoftmaxCall, Fused))] or [-1])
    scalings = [e for e in rec.order[prev_soft + 1:i_soft] if isinstance(e, Scaling)]
    if scalings:
        return _unique([site(e.frames, e.op, f"multiplies by {e.factor:.4g}; {said}") for e in scalings]
                       + [_op_site(mm_op, said), _op_site(soft_op, said)])
    start = mm_op.index if mm_op is not None else 0
    end = soft_op.index if soft_op is not None else len(trace.ops)
    return _unique(_did_nothing(trace, start, end, ("scale", "temperature", "sqrt"))
                   + [_op_site(mm_op, f"{said}: no scaling op between this q·k and the softmax at "
                                      f"{_short(soft_op) if soft_op else '?'}; the scale belongs here"),
                      _op_site(soft_op, said)])


def _dim_meaning(shape, dim: int, probe) -> str:
    n = shape[dim]
    nd = len(shape)
    dim = dim % nd
    if dim == nd - 1:
        return "keys"
    if dim == nd - 2:
        return "queries"
    if dim == 0:
        return "batch"
    if probe.subject.num_heads and n == probe.subject.num_heads:
        return "heads"
    return "not keys"


def _weights_sites(probe, det: str) -> list[Site]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    shapes = [x for x in probe.shapes.get(det, ()) if x.label == "a padding mask"]
    if shapes:
        q, k, v = probe.streams(B, T)
        allowed = shapes[0].allowed.to(s.device) if shapes[0].allowed is not None else None
    else:
        base = probe.base()
        q, k, v, allowed = base.query, base.key, base.value, base.allowed
    trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
    if trace.output is None:
        return []
    return weights_origin(probe, trace, allowed, T, T)


def weights_origin(probe, trace: Trace, allowed, t_q: int, t_k: int, *, plain: bool = True) -> list[Site]:
    """What made the weights of a traced call: a softmax over the wrong dim, a mask or dropout after the
    softmax, masks that disagree with the declared one, no softmax at all. `plain`: also point at a correct
    softmax when nothing else is found."""
    B = probe.BATCH
    made = None
    if trace.output is not None and trace.output.weights is not None:
        made = _past_zeroing(trace, _through_carries(trace, _producer(trace, id(trace.output.weights))))
    if made is None:
        soft = [op for op in trace.ops if op.short in _SOFTMAXES and op.outs and op.outs[0] is not None
                and tuple(op.outs[0].shape[-2:]) == (t_q, t_k)]
        made = soft[-1] if soft else None
    if made is None:
        mats = [op for op in trace.ops if op.short in _MATMULS and op.args and isinstance(op.args[-2], Tensor)
                and tuple(op.args[-2].shape[-2:]) == (t_q, t_k)]
        made = _past_zeroing(trace, _through_carries(trace, _producer(trace, mats[-1].in_ids[-2]))) if mats else None
    if made is None or not made.frames:
        fused = _fused_ops(trace)
        return [_op_site(fused[0], "the fused attention whose weights these are")] if fused and plain else []
    return _weights_made_by(probe, trace, made, _declared(probe, B, t_q, t_k, allowed), t_q, t_k, plain=plain)


def _weights_made_by(probe, trace: Trace, made: Op, declared: Tensor, t_q: int, t_k: int, *,
                     plain: bool = True) -> list[Site]:
    B = probe.BATCH
    if made.short in _SOFTMAXES:
        dim = int(made.args[1]) if len(made.args) > 1 else -1
        shape = tuple(made.outs[0].shape) if made.outs and made.outs[0] is not None else ()
        if shape and dim % len(shape) != len(shape) - 1:
            meaning = _dim_meaning(shape, dim, probe)
            return [_op_site(made, f"normalises over dim {dim % len(shape)}, of size {shape[dim]} = {meaning}; keys "
                                   f"are dim -1 (size {shape[-1]})")]
        masks = mask_sites(trace, declared, B, t_q, t_k)
        return masks or ([_op_site(made, "the softmax that makes the weights")] if plain else [])
    soft_before = [i for i in _ancestors(trace, made) if trace.ops[i].short in _SOFTMAXES]
    if soft_before:
        soft = trace.ops[max(soft_before)]
        masks = mask_sites(trace, declared, B, t_q, t_k)
        if masks:
            return masks
        what = ("dropout is active in eval mode: it zeroes weights and rescales the rest by 1/(1-p)"
                if "dropout" in made.name or "bernoulli" in made.name else
                f"changes the weights after the softmax at {_short(soft)}")
        return [_op_site(made, what), _op_site(soft, "the softmax the weights came from")]
    matmul = next((trace.ops[i] for i in sorted(_ancestors(trace, made), reverse=True)
                   if trace.ops[i].short in _MATMULS), None)
    start = matmul.index if matmul is not None else 0
    return list(_unique(_did_nothing(trace, start, made.index + 1, ("softmax", "normal", "prob"))
                        + [_op_site(made, "the weights come from here, and no softmax is on their way from q·k")]))


def _variance_sites(probe) -> list[Site]:
    """output_variance: on its own probe (identical value rows), what made the weights; else, with identical
    tokens, the first op after the weights·values product whose output is not the same at every position; for
    a function, the first op whose (B, H, Tq, d_v) output leaves the range of the values."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    if s.form == "function":
        q, k, _ = probe.streams(B, T, cross=True)
        v = probe.make(B, 1).expand_as(k).contiguous()
        allowed = probe.allowed(B, T, T)
        trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
        return weights_origin(probe, trace, allowed, T, T, plain=False)
    same = (10 * probe.make(B, 1)).expand(B, T, s.d_model).contiguous()
    query = probe.make(B, T) if s.separate_kv and not probe.causal else same
    allowed = probe.allowed(B, T, T)
    trace = trace_call(s, query, same, same, allowed, seed=probe.seed)
    sites = weights_origin(probe, trace, allowed, T, T, plain=False)
    if sites:  # else: after weights @ values, a row of identical values is the same at every position
        return sites
    soft = [op for op in trace.ops if op.short in _SOFTMAXES]
    if not soft:
        return []
    wv = next((op for op in trace.ops[soft[-1].index + 1:] if op.short in _MATMULS
               and soft[-1].index in _ancestors(trace, op)), None)
    if wv is None:
        return []
    tol = tolerance(UNCHANGED, s.dtype)
    for op in trace.ops[wv.index:]:
        out = op.outs[0] if op.outs else None
        if not op.frames or out is None or not out.is_floating_point():
            continue
        for a in range(1, out.dim()):
            if out.shape[a] == T and bool(_moved(out, out.narrow(a, 0, 1).expand_as(out), tol).any()):
                return [_op_site(op, "every token is the same, yet this op's output differs between positions: it "
                                     "mixes positions with another axis (heads)")]
    return []


def _out_of_range(probe) -> list[Site]:
    """The first op whose output, shaped like the output, leaves [min, max] of the values feature by feature."""
    base = probe.base()
    if not base.ok:
        return []
    trace = _base_trace(probe)
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
            return [_op_site(op, "the first op whose output leaves the range of the values: not a weighted "
                                 "average of them")]
    return []


def _finite_sites(probe, det: str) -> list[Site]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    if det == "fully_masked_rows":
        r = T // 2
        extra = torch.ones(B, T, T, dtype=torch.bool)
        extra[0, r, :] = False
        q, k, v = probe.streams(B, T)
        allowed = probe.allowed(B, T, T, extra)
    else:
        base = probe.base()
        q, k, v, allowed = base.query, base.key, base.value, base.allowed
    trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
    fills = {"masked_fill", "masked_fill_", "where", "full", "fill_", "scalar_tensor", "full_like", "new_full", "fill",
             "add", "add_", "sub", "clamp_min", "amax", "max", "maximum", "exp", "mul"} if det == "fully_masked_rows" \
        else {"masked_fill", "masked_fill_", "where", "full", "fill_", "scalar_tensor", "full_like", "new_full", "fill"}
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
            here = _op_site(op, f"the first op whose output has {what} where its inputs had none")
            if op.short in _MATMULS:  # infinite weights times values: what made those weights?
                weights = next((i for i, a in zip(op.in_ids, op.args) if isinstance(a, Tensor)
                                and a.is_floating_point() and bool(torch.isinf(a).any())), None)
                made = _through_carries(trace, _producer(trace, weights)) if weights is not None else None
                if made is not None and made.frames and made.short not in _SOFTMAXES:
                    t_q, t_k = made.outs[0].shape[-2:] if made.outs and made.outs[0] is not None else (T, T)
                    return list(_unique(_weights_made_by(probe, trace, made, _declared(probe, B, T, T, allowed),
                                                         t_q, t_k, plain=False) + [here]))
            return [here]
    return []


def _keys_sites(probe) -> list[Site]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    q, k, v = probe.make(B, T), probe.make(B, T), probe.make(B, T)
    if not getattr(s, "separate_value", True):
        v = k
    trace = trace_call(s, q, k, v, None if not probe.pass_causal_mask else probe.allowed(B, T, T), seed=probe.seed)
    return stream_sites(trace, s)


def _decode_sites(probe) -> list[Site]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    t = s.time_dim
    if s.form == "function":
        q, k, v = 10 * probe.make(B, T), 10 * probe.make(B, T), 10 * probe.make(B, T)
    else:
        q = k = v = 10 * probe.make(B, T)
    full = trace_call(s, q, k, v, probe.allowed(B, T, T), seed=probe.seed)
    if full.output is None:
        return []
    tol = tolerance(ROW_SUM, s.dtype)
    for n in sorted({min(n, T - 1) for n in (1, 3, T - T // 3)}):
        tail = q.narrow(t, T - n, n).clone()
        part = trace_call(s, tail, k, v, probe.allowed(B, n, T), seed=probe.seed)
        if part.output is None or part.output.out.shape != full.output.out.narrow(t, T - n, n).shape:
            continue
        sites = mask_sites(part, _declared(probe, B, n, T, probe.allowed(B, n, T)), B, n, T)
        if sites:
            return sites
        op = first_moved(full, part, None, tol, tail=n)
        if op is not None:
            return [_op_site(op, f"the first op whose output for the last {n} queries differs from the same rows of "
                                 f"the full pass")]
    return []


def _cache_sites(probe) -> list[Site]:
    """cache_decoding: replays the detector's plan (prefill, then steps through the layer's own cache); at the
    first step whose rows differ from the full pass over the same tokens, its masks, else the first op whose
    output for the new tokens differs from the same rows of that full pass."""
    from ._detectors import _cache_plan, _decode_gain, _split_cache

    s, B, T = probe.subject, probe.BATCH, probe.t
    x = _decode_gain(probe) * probe.make(B, T)
    tol = tolerance(ROW_SUM, s.dtype)
    cache, filled, start = None, False, 0
    for n in _cache_plan(T):
        chunk, allowed = x[:, start:start + n], probe.allowed(B, n, start + n)
        step = trace_call(s, chunk, chunk, chunk, allowed, seed=probe.seed,
                          call=lambda: s.call_cached(chunk, allowed, cache))
        if step.output is None:
            return []
        out, returned = _split_cache(step.output, B, n, start + n)
        if start == 0 and returned is None and not filled:  # a container the layer fills, passed in
            cache, filled = {}, True
            step = trace_call(s, chunk, chunk, chunk, allowed, seed=probe.seed,
                              call=lambda: s.call_cached(chunk, allowed, cache))
            out, returned = _split_cache(step.output, B, n, start + n)
        if out is None:
            return []
        whole = x[:, :start + n]
        full = trace_call(s, whole, whole, whole, probe.allowed(B, start + n, start + n), seed=probe.seed)
        if full.output is None:
            return []
        change = relative_change(out, full.output.out[:, start:], centred=True, scale_of=full.output.out)
        if change is not None and bool((change > tol).any()):
            sites = mask_sites(step, _declared(probe, B, n, start + n, allowed), B, n, start + n)
            op = None if sites else first_moved(full, step, None, tol, tail=n)
            return sites or ([_op_site(op, f"the first op whose output for the {n} new tokens differs from the "
                                           f"same rows of the full pass over {start + n} tokens")] if op else [])
        cache = cache if filled else returned
        if cache is None:
            return []
        if start == 0:  # the prefill's cache must hold n positions: told by a prefill one token longer
            longer = _cache_of(s, x[:, :n + 1], probe.allowed(B, n + 1, n + 1), filled)
            short = _cache_short(step, cache, longer, n)
            if short:
                return short
        start += n
    return []


def _cache_of(s, x: Tensor, allowed, filled: bool):
    from ._detectors import _split_cache

    try:
        with torch.no_grad():
            cache = {} if filled else None
            result = s.call_cached(x, allowed, cache)
        return cache if filled else _split_cache(result, x.shape[0], x.shape[1], x.shape[1])[1]
    except Exception:
        return None


def _cache_short(trace: Trace, cache, longer, tokens: int) -> list[Site]:
    """A cache tensor whose position axis (the one a prefill one token longer makes one longer) does not hold
    `tokens` positions (a key dropped or repeated): the op that made it."""
    def flat(c):
        return [y for item in (c.values() if isinstance(c, dict) else [c]) for y in _tensors(item)]

    mine, other = flat(cache), flat(longer) if longer is not None else []
    for x, y in zip(mine, other):
        if x.dim() != y.dim():
            continue
        axes = [a for a in range(x.dim()) if y.shape[a] == x.shape[a] + 1]
        made = _producer(trace, id(x))
        if len(axes) == 1 and x.shape[axes[0]] != tokens and made is not None and made.frames:
            return [_op_site(made, f"the cache returned after {tokens} tokens holds {x.shape[axes[0]]} positions "
                                   f"along dim {axes[0]} {tuple(x.shape)}")]
    return []


def _alignment_sites(probe) -> list[Site]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    if s.separate_kv:
        t_q = max(1, T // 2)
        if s.form == "function":
            q, k, v = probe.make(B, t_q), probe.make(B, T), probe.make(B, T)
        else:
            k = v = probe.make(B, T)
            q = k[:, T - t_q:].clone()
        allowed = probe.allowed(B, t_q, T)
        trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
        return mask_sites(trace, _declared(probe, B, t_q, T, allowed), B, t_q, T)
    trace = _base_trace(probe)
    base = probe.base()
    return mask_sites(trace, _declared(probe, B, T, T, base.allowed), B, T, T)


def _runs_sites(probe) -> list[Site]:
    s = probe.subject
    for det, shape in probe.raised:
        kw = {"heads": 1} if shape.label == "H=1" else {}
        try:
            q, k, v = probe.streams(shape.batch, shape.t_q, shape.t_k, cross=not shape.self_attention, **kw)
        except TypeError:
            continue
        if "non-contiguous" in shape.label:
            nc = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (q, k, v)]
            q, k, v = [nc[0]] * 3 if q is k else nc
        allowed = None if shape.allowed is None else shape.allowed.to(s.device)
        try:
            with torch.no_grad():
                s(q, k, v, allowed)
        except Exception as error:
            frames = traceback_frames(error.__traceback__)
            if frames:
                return [site(frames, type(error).__name__, str(error).strip().splitlines()[0][:160]
                             if str(error).strip() else "")]
    return []


def _in_custom_function(frame) -> bool:
    """Inside an autograd.Function's forward, which runs without grad by design."""
    while frame is not None:
        if frame.f_code.co_name in ("apply", "forward") and frame.f_code.co_filename.endswith(
                ("autograd/function.py", "autograd\\function.py")):
            return True
        frame = frame.f_back
    return False


class _GradientCut(torch.overrides.TorchFunctionMode):
    """Above autograd: the first torch call whose floating output does not require grad while a floating
    input does (a .detach(), a block under torch.no_grad(), .data), with the user's frames."""

    def __init__(self):
        super().__init__()
        self.cut: tuple = ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.cut and (torch.is_grad_enabled() or not _in_custom_function(sys._getframe(1))):
            try:
                ins = [x for a in list(args) + list(kwargs.values()) for x in _tensors(a)]
                outs = list(_tensors(out))
                if (any(x.requires_grad and x.is_floating_point() for x in ins)
                        and any(o.is_floating_point() and not o.requires_grad for o in outs)):
                    self.cut = user_frames(sys._getframe(1))
            except Exception:
                pass
        return out


def _gradient_sites(probe) -> list[Site]:
    from ._detectors import _float64_twin, _graph_call

    s, B = probe.subject, probe.BATCH
    T = min(probe.t, 6)
    try:
        sub = _float64_twin(probe)
    except Exception:
        return []
    gen = torch.Generator().manual_seed(probe.seed)
    xs = [sub.make(gen, B, T) for _ in range(3 if s.form == "function" else 1)]
    inputs = [x.requires_grad_(True) for x in xs]
    qkv = (xs[0], xs[1], xs[2]) if len(xs) == 3 else (xs[0], xs[0], xs[0])
    allowed = probe.allowed(B, T, T)
    torch.manual_seed(probe.seed)
    called = []

    def profile(frame, event, arg):
        if event == "return" and frame_kind(frame.f_code) == 0:
            called.append(user_frames(frame))

    try:
        with torch.enable_grad():
            cut = _GradientCut()
            with cut:
                out = _graph_call(sub, *qkv, allowed)
            if cut.cut:
                return [site(cut.cut, "detached", "the output of this call does not require grad though its input "
                                                  "does: no gradient flows back through here")]
            old = sys.getprofile()
            sys.setprofile(profile)
            try:
                torch.autograd.grad((out ** 2).sum(), inputs, allow_unused=True)
            finally:
                sys.setprofile(old)
    except Exception:
        return []
    hand = [f for f in called if f]
    if hand:
        return [site(hand[0], "backward", "a hand-written backward ran here: check it with torch.autograd.gradcheck")]
    return []


def _mask_gradient_sites(probe, *, padding: bool) -> list[Site]:
    """Gradient reaching keys a mask blocks (or the future): the masks on a call like the check's, else what
    made the weights (a second softmax gives blocked keys weight back)."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    q, k, v = probe.streams(B, T)
    allowed = probe.allowed(B, T, T, probe.padding(B, T, T) if padding and s.takes_mask else None)
    trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
    if trace.output is None:
        return []
    declared = _declared(probe, B, T, T, allowed)
    return (mask_sites(trace, declared, B, T, T) or (stream_sites(trace, s) if q is not k else [])
            or weights_origin(probe, trace, allowed, T, T))


def _output_shape_sites(probe) -> list[Site]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    if not s.separate_kv:
        return []
    q, k, v = probe.streams(B, T, T + 3, cross=True)
    trace = trace_call(s, q, k, v, probe.allowed(B, T, T + 3), seed=probe.seed)
    return stream_sites(trace, s)


LOCATED = frozenset({"future_leakage", "mask_honoured", "query_locality", "batch_independence", "eval_determinism",
                     "softmax_saturation", "weight_row_sums", "finite_output", "fully_masked_rows", "keys_matter",
                     "decode_consistency", "causal_alignment", "runs", "gradients", "output_shape", "output_variance",
                     "cache_decoding"})
"""The detectors whose findings this module can point at the line (the others' `where` stays empty)."""


def _locate(probe, det: str, result: DetectorResult) -> list[Site]:
    if det in ("future_leakage", "mask_honoured"):
        return _invariance(probe, det, use_masks=True)
    if det in ("query_locality", "batch_independence", "eval_determinism"):
        return _invariance(probe, det, use_masks=False)
    if det == "softmax_saturation":
        return _scale_sites(probe)
    if det == "weight_row_sums":
        return _weights_sites(probe, det)
    if det in ("finite_output", "fully_masked_rows"):
        return _finite_sites(probe, det)
    if det == "keys_matter":
        return _keys_sites(probe)
    if det == "decode_consistency":
        return _decode_sites(probe)
    if det == "causal_alignment":
        return _alignment_sites(probe)
    if det == "cache_decoding":
        return _cache_sites(probe)
    if det == "runs":
        return _runs_sites(probe)
    if det == "gradients":
        if result.message.startswith(("masked keys receive gradient", "the gradient lets the future in")):
            return _mask_gradient_sites(probe, padding=result.message.startswith("masked"))
        return _gradient_sites(probe)
    if det == "output_shape":
        return _output_shape_sites(probe)
    if det == "output_variance":  # the value-range check of functions, or the identical-values one
        return _out_of_range(probe) if result.message.startswith("outputs leave the range") else _variance_sites(probe)
    return []


def localise(probe, measured: dict[str, DetectorResult], layer=None, device=None) -> dict[str, DetectorResult]:
    """Each failed or warned result with `where` to be found when first read (a `Sites`): then the finding's
    probe runs again under a tracer, with `layer` in eval mode and its parameters, buffers, grads and the RNG
    restored afterwards, as during the audit. A passing audit makes no call; a report whose sites nobody reads
    makes none either."""
    out = dict(measured)
    if not ENABLED:
        _NOTED.pop(probe, None)
        return out
    for det, result in measured.items():
        if result.verdict in ("fail", "warn"):
            out[det] = replace(result, where=Sites(resolve=lambda det=det, result=result:
                                                   _resolve(probe, det, result, layer, device)))
    return out


def release(probe) -> None:
    """Once the report has its weights: drop the standard probe's observed record (copies of (B, H, T, T)
    scores and weights), which the sites, found later by fresh traces, never need."""
    base = getattr(probe, "_base", None)
    if base is not None:
        base.record = None


def _resolve(probe, det: str, result: DetectorResult, layer, device) -> tuple[Site, ...]:
    asking = probe.detector
    try:
        with untouched(layer, device if device is not None else probe.subject.device):
            probe.detector = f"where/{det}"
            return _unique(_locate(probe, det, result))
    except Exception:  # pointing at the line must never cost the report its verdicts
        return ()
    finally:
        probe.detector = asking
