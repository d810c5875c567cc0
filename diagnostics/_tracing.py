"""Generic tracing: run one call of a layer under a `Tracer` and read where things happened, in the user's code.

A `Trace` holds every aten op the call ran, with the user's frames where it ran (the first frames outside torch
and diagnostics), its outputs, which probe inputs it depends on, and the user functions that returned a tensor
they were given unchanged (a step that did nothing). On a trace (or a pair of traces):

- `mask_sites`: the masking ops on (Tq, Tk) scores (masked_fill, where, an additive mask, a multiplication by a
  bool mask, a fused call's attn_mask and is_causal) against what the audit declared blocked: an op that blocks
  allowed keys, masks that leave blocked keys open (then the op that built the mask, and the masking op), a mask
  applied after the softmax; no masking op at all: the function that returned the scores unchanged.
- `first_moved`: baseline and perturbed call side by side, the first op, in execution order, whose output moves
  where it must not: where a leak enters, whatever the code looks like. An output element "must not move" when
  every position it is indexed by (batch, query, key) is one whose inputs did not change and whose output must
  hold; axes are told by their sizes.
- `stream_sites`: a q·k or weights·v operand that does not come from the input it should, and the op that read
  the wrong one.
- `weights_origin`: what made the weights (a softmax over the wrong dim, a mask or dropout after the softmax,
  no softmax at all).
- `GradientCut`: the first torch call whose output leaves the autograd graph.

This module knows no detector: each detector's localiser (in `diagnostics/detectors/`) replays the very inputs
its verdict was computed on and reads the trace with these functions. Nothing here knows the catalog or any
implementation: only aten ops, their shapes and the declared mask.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import linecache
import re
import sys
import textwrap
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ._frames import frame_kind, user_frames
from ._guard import seed_rng
from ._observe import Observer, dispatch_name, fused_arguments
from ._result import Site

MAX_KEPT = 1 << 22
"""Op outputs larger than this many elements are not kept by a trace (a long audit's (T, T) scores); the
comparisons skip them."""


# ---- sites -----------------------------------------------------------------------------------------------


def text(file: str, line: int) -> str:
    return linecache.getline(file, line).strip()


def site(frames: tuple, op: str, note: str = "", fix: str = "") -> Site | None:
    """A `Site` from user_frames() ((code, lineno), ...), innermost first; None when there is none. `fix`: what
    to write instead, when what the op did names the cause."""
    if not frames:
        return None
    code, line = frames[0]
    callers = tuple((c.co_filename, n, getattr(c, "co_qualname", c.co_name)) for c, n in frames[1:])
    return Site(code.co_filename, int(line), getattr(code, "co_qualname", code.co_name), text(code.co_filename, line),
                op, note, callers, fix)


def unique(sites) -> tuple[Site, ...]:
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
    values: dict = field(default_factory=dict)  # the innermost user frame's `self` and its locals that are numbers

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
class Returned:
    """A user function's return during the call: the line it returned from, the user line that called it, and what
    it returned where that is None or a number (or a tuple of them); `...` for anything else."""

    code: object
    line: int
    caller: object  # the code object of the innermost user frame that called it (None: none)
    caller_line: int
    value: object
    tensors: tuple = ()  # ids of the tensors it returned (alone, or in a tuple or list), kept alive by the trace


@dataclass
class Trace:
    ops: list[Op] = field(default_factory=list)
    unchanged: list[Unchanged] = field(default_factory=list)
    returns: list[Returned] = field(default_factory=list)
    producer: dict = field(default_factory=dict)  # id(tensor) -> index of the op that last wrote it
    sources: dict = field(default_factory=dict)  # id(tensor) -> frozenset of probe inputs
    event_op: dict = field(default_factory=dict)  # id(observer event) -> op index
    inputs: dict = field(default_factory=dict)  # id(tensor) -> "query" | "key" | "value"
    buffers: dict = field(default_factory=dict)  # id(tensor) -> name, the layer's buffers and parameters
    record: object = None
    output: object = None
    error: BaseException | None = None
    failed_ins: tuple = ()  # ids of the tensors the op that raised `error` was given (the innermost such op)
    layer: object = None  # the module called, whose buffers and parameters `buffers` names
    alive: list = field(default_factory=list)
    storage: dict = field(default_factory=dict)  # id(tensor) -> its storage's address (0: none), for `ancestors`
    writes: dict = field(default_factory=dict)  # storage address -> indices of the ops that wrote into it in place


def tensors(x):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)


class Tracer(Observer):
    """The observer, plus every op with its outputs, frames and dependence on the probe inputs."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        trace.record = self.record
        self._params: dict = {}
        self._calls = 0
        self._old_profiles: list = []  # the profile each (re-)entry replaced, restored as it exits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = len(self.record.order)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except Exception:
            if not self.trace.failed_ins:  # the innermost op that raised: what it was given, for `state_behind`
                ins = [x for a in list(args) + list(kwargs.values()) for x in tensors(a)]
                self.trace.failed_ins = tuple(id(x) for x in ins)
                self.trace.alive.extend(ins)
            raise
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
        ins = [x for a in list(args) + list(kwargs.values()) for x in tensors(a)]
        sources = frozenset().union(*(t.sources.get(id(x), frozenset()) for x in ins)) if ins else frozenset()
        outs = list(tensors(out))
        kept = tuple(o.detach().clone() if o.numel() <= MAX_KEPT else None for o in outs)
        for o in outs:
            t.producer[id(o)] = index
            t.sources[id(o)] = sources | t.sources.get(id(o), frozenset())
            t.alive.append(o)
        t.alive.extend(ins)
        for x in outs + ins:
            t.storage.setdefault(id(x), _address(x))
        name = dispatch_name(func).replace("aten.", "").split(".")[0]
        if name.endswith("_") and args and isinstance(args[0], Tensor) and t.storage.get(id(args[0])):
            t.writes.setdefault(t.storage[id(args[0])], []).append(index)  # a write in place (into a view, too)
        frames = user_frames(sys._getframe(2))
        t.ops.append(Op(index, dispatch_name(func), tuple(a.detach() if isinstance(a, Tensor) else a for a in args), dict(kwargs),
                        kept, tuple(id(o) for o in outs), tuple(id(x) for x in ins),
                        frames, sources, _frame_values(sys._getframe(2), frames)))

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
            if frame_kind(frame.f_code) == 0:
                self.trace.returns.append(_returned(frame, arg))
                self.trace.alive.extend(_returned_tensors(arg))  # their ids name them until the trace is read
            ids, called = self._params.pop(id(frame), (None, 0))
            if ids and isinstance(arg, Tensor) and id(arg) in ids:
                self.trace.unchanged.append(Unchanged(len(self.trace.ops), user_frames(frame), frame.f_code.co_name,
                                                      id(arg), called))

    def __enter__(self):
        # a stack: FlexAttention's eager path enters the current mode again inside the call, and one saved profile
        # would then be our own, left installed after the trace (every later call of the process profiled)
        self._old_profiles.append(sys.getprofile())
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc):
        sys.setprofile(self._old_profiles.pop())
        return super().__exit__(*exc)


def made_before(trace: Trace, op: Op | None, other: Trace | None = None) -> Site | None:
    """Where `op` reads a tensor that no op of this call made (through views and casts), that is no input and no
    buffer or parameter of the layer, that `other` (the call `op`'s output is compared with) never reads, and that a
    function of the user's code returned: a value made by an earlier call and read back from a cache (a dict keyed by
    what it was made for). The line that returned it, its caller (the line that asked for it, with the key) after;
    None where there is none. A table both calls read (made once, in __init__) is no stale value, and an `op` that is
    itself a view of it (a slice that ignores the offset) is the site, not where the table came from."""
    if op is None or op.short in CARRIES:
        return None
    read_there = {i for o in other.ops for i in o.in_ids} if other is not None else set()
    for tensor_id in op.in_ids:
        for _ in range(64):  # back through views and casts to the tensor itself
            p = producer(trace, tensor_id)
            if p is None or p.short not in CARRIES or not p.in_ids:
                break
            tensor_id = carried_from(p)
        if producer(trace, tensor_id) is not None or tensor_id in trace.inputs or tensor_id in trace.buffers or \
                tensor_id in read_there:
            continue
        r = next((r for r in reversed(trace.returns) if tensor_id in r.tensors), None)
        if r is None:
            continue
        frames = ((r.code, r.line),) + (((r.caller, r.caller_line),) if r.caller is not None else ())
        return site(frames, "returns it", f"returns a tensor no op of this call made, which {op.short} reads below: a "
                                          f"value an earlier call made, kept and read back (a cache): what it is "
                                          f"looked up by must hold everything it was made from (the length and the "
                                          f"offset of the positions, the dtype)", CACHE_KEY_FIX)
    return None


CACHE_KEY_FIX = ("key a cached value by everything it is made from (f'freqs:{seq_len}|offset:{offset}'), or make it "
                 "anew on each call")


def _never_raises(function):
    """A localising helper that returns [] where reading the source fails in a way not foreseen: pointing at a line
    must never cost a finding its other sites."""
    def guarded(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception:  # noqa: BLE001
            return []

    guarded.__doc__, guarded.__name__, guarded.__wrapped__ = function.__doc__, function.__name__, function
    return guarded


def _number(v) -> bool:
    return v is None or (isinstance(v, (bool, int, float)) and not isinstance(v, Tensor)) or \
        (isinstance(v, tuple) and len(v) <= 8 and all(isinstance(x, (bool, int, float)) for x in v))


def _frame_values(frame, frames: tuple) -> dict:
    """`self` and the locals that are numbers (or None) of the innermost user frame of an op: what a line read that
    no traced op shows (a scale, a window bound)."""
    if not frames:
        return {}
    code = frames[0][0]
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return {}
    try:
        return {name: v for name, v in frame.f_locals.items() if name == "self" or _number(v)}
    except Exception:  # noqa: BLE001 -- reading a frame must never break the layer
        return {}


def _returned(frame, value) -> Returned:
    caller = frame.f_back
    while caller is not None and frame_kind(caller.f_code) == 1:
        caller = caller.f_back  # torch's frames between a module's forward and the line that called the module
    if caller is not None and frame_kind(caller.f_code) != 0:
        caller = None
    # a return event without a return statement (an exception unwinding) says None too: only a `return` line counts
    line = frame.f_lineno
    if value is None and not text(frame.f_code.co_filename, line).startswith("return"):
        value = ...
    return Returned(frame.f_code, line, None if caller is None else caller.f_code,
                    0 if caller is None else caller.f_lineno, value if _number(value) else ...,
                    tuple(id(t) for t in _returned_tensors(value)))


def _returned_tensors(value) -> list:
    """The tensors a function returned: the tensor, or those of a tuple or list (a cache's (cos, sin))."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and len(value) <= 8:
        return [t for t in value if isinstance(t, Tensor)]
    return []


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
        t.layer = layer
    if seed is not None:
        seed_rng(seed, getattr(subject, "device", "cpu"))
    try:
        with torch.enable_grad(), Tracer(t):
            t.output = subject(query, key, value, allowed) if call is None else call()
    except Exception as error:
        t.error = error
    return t


# ---- helpers on a trace ----------------------------------------------------------------------------------

CARRIES = {"view", "_unsafe_view", "reshape", "clone", "transpose", "permute", "expand", "t", "_to_copy",
            "contiguous", "unsqueeze", "squeeze", "slice", "select", "alias", "detach", "_reshape_alias", "to",
            "lift_fresh", "copy_", "nan_to_num", "type_as"}
MATMULS = {"bmm", "mm", "baddbmm", "matmul"}
SOFTMAXES = {"_softmax", "_safe_softmax"}
UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}  # memory, not values


def producer(trace: Trace, tensor_id: int) -> Op | None:
    i = trace.producer.get(tensor_id)
    return None if i is None else trace.ops[i]


def carried_from(op: Op) -> int:
    """The id of the tensor a view, copy or cast `op` carries the values of (`copy_` writes its last input)."""
    return op.in_ids[-1] if op.short == "copy_" else op.in_ids[0]


def through_carries(trace: Trace, op: Op | None) -> Op | None:
    """Back from `op` through views, copies and casts to the op that computed the values."""
    seen = 0
    while op is not None and op.short in CARRIES and op.in_ids and seen < 64:
        src = carried_from(op)
        if src in trace.inputs:
            return op
        prev = producer(trace, src)
        if prev is None:
            return op
        op, seen = prev, seen + 1
    return op


def first_out(op: Op) -> Tensor | None:
    """The op's first output the trace kept (outputs too large to copy are None)."""
    return next((o for o in op.outs if o is not None), None)


ROW_PICKS = {"slice", "select", "index", "narrow"}


def batch_picker(trace: Trace, mask_id: int | None, batch: int) -> Op | None:
    """Back from the mask `mask_id` through its inputs, the op of the user's that takes some of the `batch` rows
    of a mask for every sequence: `mask[:1]` or `mask[0]` (fewer rows out than the batch's in), which a broadcast or
    an expand then hands to each. None where the mask keeps its batch axis all the way back (a mask shared by the
    batch from the start, a causal buffer of one row, is never picked)."""
    queue, seen = [producer(trace, mask_id)] if mask_id is not None else [], set()
    while queue and len(seen) < 64:  # back through every input: `buffer & mask[:1]` as well as `mask[:1] & buffer`
        op = queue.pop(0)
        if op is None or op.index in seen:
            continue
        seen.add(op.index)
        if op.frames and op.short in ROW_PICKS and _picks_rows(op, batch):
            return op
        queue += [producer(trace, i) for i in op.in_ids]
    return None


def _picks_rows(op: Op, batch: int) -> bool:
    """Whether `op` (a slice, select, index or narrow) of a tensor of `batch` rows keeps fewer of them, or drops the
    batch axis (`mask[0]`)."""
    given = op.args[0] if op.args and isinstance(op.args[0], Tensor) else None
    out = first_out(op)
    dim = op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else 0
    if given is None or out is None or not given.dim() or given.shape[0] != batch or batch < 2:
        return False
    if op.short == "select":
        return dim == 0
    return (op.short == "index" or dim == 0) and out.dim() > 0 and out.shape[0] < batch


def past_zeroing(trace: Trace, op: Op | None) -> Op | None:
    """A fill after a softmax that only zeroes rows the softmax left without weight (NaN rows of a query with
    no key: a safe softmax) is part of that softmax: return the softmax."""
    if op is None or op.short not in ("masked_fill", "masked_fill_", "where") or not op.in_ids:
        return op
    soft = through_carries(trace, producer(trace, op.in_ids[0]))
    if soft is None or soft.short not in SOFTMAXES or not soft.outs or soft.outs[0] is None:
        return op
    out = soft.outs[0]
    got = fill_pattern(op, *out.shape[-2:]) if out.dim() >= 2 else None
    if got is None or got[0].shape != out.shape or bool((got[0] & (out > 0)).any()):
        return op
    return soft


def ancestors(trace: Trace, op: Op, limit: int = 4096) -> set[int]:
    """Indices of the ops whose outputs `op` depends on: each tensor's producer, and the ops before `op` that wrote
    into its storage in place, through a view as well (Longformer's banded scores, copied slice by slice into a
    `new_zeros`, whose producer alone reads no input)."""
    out, todo, seen = set(), list(op.in_ids), set()
    while todo and len(out) < limit:
        tensor_id = todo.pop()
        if tensor_id in seen:
            continue
        seen.add(tensor_id)
        written = trace.writes.get(trace.storage.get(tensor_id, 0), ())
        for p in (trace.producer.get(tensor_id), *written):
            if p is not None and p not in out and p < op.index:
                out.add(p)
                todo.extend(trace.ops[p].in_ids)
    return out


def _address(x: Tensor) -> int:
    """The address of a tensor's storage (0 where it has none to read: a meta or sparse tensor)."""
    try:
        return x.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001
        return 0


def user(op: Op | None) -> bool:
    return op is not None and bool(op.frames)


def op_site(op: Op | None, note: str = "", label: str | None = None, fix: str = "") -> Site | None:
    if op is None:
        return None
    return site(op.frames, label or op.name.replace(".default", ""), note, fix)


def event_op(trace: Trace, event) -> Op | None:
    i = trace.event_op.get(id(event))
    return None if i is None else trace.ops[i]


def first_softmax(trace: Trace, t_q: int, t_k: int) -> Op | None:
    for op in trace.ops:
        if op.short in SOFTMAXES and op.outs and op.outs[0] is not None and tuple(op.outs[0].shape[-2:]) == (t_q, t_k):
            return op
    for op in trace.ops:
        if op.short in SOFTMAXES:
            return op
    return None


def softmax_call(trace: Trace, op: Op):
    """The observer's record of a traced softmax op (its scores read as (..., Tq, Tk)), or None."""
    record = trace.record
    for sm in getattr(record, "softmaxes", ()):
        if trace.event_op.get(id(sm)) == op.index:
            return sm
    return None


def fused_ops(trace: Trace) -> list[Op]:
    return [op for op in trace.ops if "scaled_dot_product" in op.name and "backward" not in op.name]


def qk_matmul(trace: Trace, before: int) -> Op | None:
    """The last matmul before op index `before` (the scores a softmax normalises)."""
    for op in reversed(trace.ops[:before]):
        if op.short in MATMULS:
            return op
    return None


def did_nothing(trace: Trace, start: int, end: int, words: tuple[str, ...]) -> list[Site]:
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



# ---- online softmax: accumulators carried over blocks of keys ------------------------------------------------

RUNNING_MAXES = {"maximum", "max", "amax", "fmax"}
SCALINGS = {"mul", "mul_", "div", "div_"}


def _line(op: Op):
    return (op.frames[0][0], op.frames[0][1]) if op.frames else None


def _carried(trace: Trace, op: Op) -> tuple[Op, bool] | None:
    """Where `op` updates a value an earlier run of its very line made (the same op on the same line: the previous
    block of a loop): (that earlier op, whether its value reaches `op` unscaled, through views and copies only). A
    scaling (a mul, a div) on the way is the rescale where its factor is an exponential (`exp(m_old - m_new)`, see
    `_exponential`); one by another factor alone is not (FlashAttention-1's `(l_old / l_new) * O` keeps O relative to
    the old max); views, copies and the line's own other steps carry the value. None where no operand comes from
    such an op."""
    todo = [(i, False, 0, op.index) for i in op.in_ids]
    while todo:
        i, scaled, depth, before = todo.pop(0)
        prev = _written_before(trace, i, before)
        if prev is None or depth > 8:
            continue
        if prev.name == op.name and _line(prev) == _line(op):
            return prev, not scaled
        if prev.short in SCALINGS and not scaled:
            todo += [(j, any(_exponential(trace, f, prev.index) for f in prev.in_ids if f != j), depth + 1, prev.index)
                     for j in prev.in_ids]
        elif (prev.short in CARRIES or _line(prev) == _line(op)) and prev.in_ids:  # a view; or the line's own
            # step on the previous value (`torch.maximum(m, s.amax(-1)).clamp_min(-1e30)`)
            todo.append((carried_from(prev), scaled, depth + 1, prev.index))
    return None


EXPONENTIALS = {"exp", "exp_", "exp2", "exp2_"}
FACTOR_STEPS = SCALINGS | CARRIES | {"where", "clamp", "clamp_min", "masked_fill", "masked_fill_"}


def _exponential(trace: Trace, tensor_id: int, before: int, depth: int = 0, seen: set | None = None) -> bool:
    """Whether the factor `tensor_id` is an exponential, or a product, quotient or view of one (a rescale factor
    `exp(m_old - m_new)`, maybe guarded by a `where` for rows with no key yet); a sum of one is not. Each op is read
    once (`seen`), at most 8 steps back."""
    seen = set() if seen is None else seen
    made = _written_before(trace, tensor_id, before)
    if made is None or depth > 8 or made.index in seen:
        return False
    seen.add(made.index)
    if made.short in EXPONENTIALS:
        return True
    return made.short in FACTOR_STEPS and any(_exponential(trace, i, made.index, depth + 1, seen) for i in made.in_ids)


def _written_before(trace: Trace, tensor_id: int, index: int) -> Op | None:
    """The last op before op `index` that wrote the tensor `tensor_id`: its producer, or for a tensor updated in
    place (`acc.mul_(c).add_(p @ v)`, one tensor written at every block) the write before that op."""
    last = producer(trace, tensor_id)
    if last is None or last.index < index:
        return last
    return next((trace.ops[i] for i in range(index - 1, -1, -1) if tensor_id in trace.ops[i].out_ids), None)


UNRESCALED_FIX = ("rescale the running value before adding the block: x = x * torch.exp(m_old - m_new) + ..., for the "
                  "running sum and the weighted values alike")


def unrescaled_accumulators(trace: Trace) -> list[Site]:
    """An online (blockwise, flash-style) softmax that adds a block's exp(s - m_new) to a running sum, or its product
    with the values to a running accumulator, without first multiplying the running value by exp(m_old - m_new) when
    that block raised the running max: the running value's line, at the first block where the max grew. The running
    max is an elementwise max of its own previous value (`m_new = maximum(m, s.amax(-1))`, a value carried across
    the loop); an accumulator is an add of its own previous value that depends on that max and feeds the output.
    Read from values, not names: what grew is told by the max's recorded outputs."""
    outs = list(tensors(getattr(trace.output, "out", trace.output))) if trace.output is not None else []
    storages = {x.untyped_storage().data_ptr() for x in outs} - {0}
    # what the output is made of: its producer, and the writes into it in place (`O[..., i:i + Br, :] = O_i / l_i`)
    last = [producer(trace, id(x)) for x in outs] + [
        op for op in trace.ops if (op.short.endswith("_") and op.args and isinstance(op.args[0], Tensor)
                                   and op.args[0].untyped_storage().data_ptr() in storages)]
    feeding: set = set()  # the lines whose ops the output is made of (a tensor updated in place: its last write)
    for op in last:
        if op is not None:
            feeding |= {_line(trace.ops[i]) for i in ancestors(trace, op, limit=1 << 16) | {op.index}}
    grew: dict[int, bool] = {}  # op index of a running max's update -> whether it raised the max anywhere
    for op in trace.ops:
        if op.short in RUNNING_MAXES and op.frames and op.outs and op.outs[0] is not None:
            found = _carried(trace, op)
            if found is not None and found[0].outs and found[0].outs[0] is not None \
                    and found[0].outs[0].shape == op.outs[0].shape and found[0].index < op.index - 1:
                grew[op.index] = bool((op.outs[0] > found[0].outs[0]).any())
    if not grew:
        return []
    sites = []
    for op in trace.ops:
        if op.short not in ("add", "add_") or not op.frames or _line(op) not in feeding:
            continue
        found = _carried(trace, op)
        if found is None or not found[1]:
            continue
        # the running max's update of this block: the last one before this add, after the previous block's add
        maxes = [i for i in grew if found[0].index < i < op.index]
        current = max(maxes) if maxes else None
        if current is None or not grew[current] or current not in ancestors(trace, op, limit=1 << 16):
            continue
        if _line(op) in {(s.file, s.line) for s in sites if s is not None}:
            continue
        m = trace.ops[current]
        sites.append(op_site(op, f"adds this block's terms, taken relative to the new running max (at "
                                 f"{short(m)}), to a running value kept relative to the old one: the max grew, and the "
                                 f"running value was not rescaled",
                             fix=UNRESCALED_FIX))
    return [s for s in sites if s is not None]


# ---- blocks: a residual (and a norm) around the attention ----------------------------------------------------


@dataclass
class Residual:
    """The add of a block's input to its attention's output (`inner`, as it was before the add)."""

    add: Op
    inner: Tensor
    norm: Op | None  # the normalisation that reads the sum, if one does


def carries_input(trace: Trace, tensor_id: int, name: str) -> bool:
    """True when the tensor is the probe input `name` itself, or a view, copy or cast of it."""
    for _ in range(64):
        if trace.inputs.get(tensor_id) == name:
            return True
        op = producer(trace, tensor_id)
        if op is None or op.short not in CARRIES or not op.in_ids:
            return False
        tensor_id = carried_from(op)
    return False


def value_before(trace: Trace, tensor_id: int, index: int) -> Tensor | None:
    """What the tensor held before op `index` (an in-place add writes into its operand)."""
    for op in reversed(trace.ops[:index]):
        if tensor_id in op.out_ids:
            return op.outs[op.out_ids.index(tensor_id)]
    return None


def residual_add(trace: Trace, shape: tuple) -> Residual | None:
    """The last add, shaped like the output, of the query input (through views and copies) to a tensor computed
    from it and the keys (the attention's output): a block's residual, with the norm that reads the sum, if any."""
    for op in reversed(trace.ops):
        if op.short not in ("add", "add_") or len(op.in_ids) < 2 or not op.outs or op.outs[0] is None \
                or tuple(op.outs[0].shape) != tuple(shape):
            continue
        ids = list(op.in_ids[:2])
        skip = [i for i in ids if carries_input(trace, i, "query")]
        if len(skip) != 1:
            continue
        other = ids[1 - ids.index(skip[0])]
        inner = value_before(trace, other, op.index)
        if inner is None or not ({"key", "value"} & trace.sources.get(other, frozenset())):
            continue
        norm = next((later for later in trace.ops[op.index + 1:] if "norm" in later.short
                     and set(op.out_ids) & set(later.in_ids)), None)
        return Residual(op, inner, norm)
    return None


# ---- masks -----------------------------------------------------------------------------------------------


def fill_pattern(op: Op, t_q: int, t_k: int) -> tuple[Tensor, int | None] | None:
    """(bool filled, index of the mask tensor's producer) of a masking op on (..., Tq, Tk) scores."""
    out = op.outs[0] if op.outs else None
    if out is None or out.dim() < 2 or tuple(out.shape[-2:]) != (t_q, t_k):
        return None
    return filled_by(op)


def filled_by(op: Op) -> tuple[Tensor, int | None] | None:
    """(bool filled, in the op's output shape, id of the mask tensor) of a masking op on scores of any layout: a
    fill, a where, an added very negative mask, a product with a bool mask. None for any other op."""
    name, a = op.short, op.args
    out = op.outs[0] if op.outs else None
    if out is None or out.dim() < 2:
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


def fused_pattern(op: Op, t_q: int, t_k: int) -> Tensor | None:
    a, kw = op.args, op.kwargs
    q = a[0]
    shape = tuple(q.shape[:-2]) + (t_q, t_k)
    mask, causal, _ = fused_arguments(op.name, a, kw)
    filled = torch.zeros(shape, dtype=torch.bool)
    if mask is not None:
        m = mask.cpu()
        filled = filled | (~m if m.dtype == torch.bool else m <= -1e4)
    if causal:
        i, j = torch.arange(t_q).unsqueeze(-1), torch.arange(t_k)
        filled = filled | (j > i)
    return filled.expand(shape)


def per_batch(filled: Tensor, B: int) -> Tensor | None:
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


# ---- fixes named by what a masking op did ------------------------------------------------------------------

FUTURE = "torch.ones(Tq, Tk, dtype=torch.bool, device=scores.device).triu(1 + Tk - Tq)"
MASK_FIX = "apply the mask to the scores before the softmax: scores = scores.masked_fill(~allowed, float('-inf'))"
CAUSAL_FIX = (f"mask the future before the softmax: scores = scores.masked_fill({FUTURE}, float('-inf')) (True marks "
              f"key j > i + Tk - Tq)")
AFTER_SOFTMAX_FIX = ("mask the scores before the softmax, not the weights after it: weights = "
                     "scores.masked_fill(~allowed, float('-inf')).softmax(-1)")
COMBINE_FIX = ("combine the masks instead of letting one replace the other: allowed = causal & padding (both True = "
               "may attend), then mask the scores with ~allowed")


def blocking_fix(blocked: Tensor, declared: Tensor, t_q: int, t_k: int) -> str:
    """The fix for masking that blocks (query, key) pairs which may be attended, read from the pattern it blocks:
    an inverted or transposed mask, the layer's own causal mask in an audit not told it is causal, a causal mask
    that blocks the diagonal, one aligned top-left, one that blocks the past, or (none of these) the general rule.
    `blocked` and `declared` (True = may attend) are (B, Tq, Tk)."""
    rows = declared.any(-1, keepdim=True).expand_as(declared)
    if bool((blocked[rows] == declared[rows]).all()):
        return ("the mask's meaning is inverted: True marks the keys that may be attended, so block where it is "
                "False: scores.masked_fill(~mask, float('-inf'))")
    if t_q == t_k and bool((blocked == ~declared.transpose(-1, -2)).all()):
        return ("the mask is read transposed: mask[b, i, j] says whether query i may attend key j; a (B, Tk) padding "
                "mask broadcasts over the queries as mask[:, None, :], not mask[:, :, None]")
    i, j = torch.arange(t_q).unsqueeze(-1), torch.arange(t_k)
    shift = t_k - t_q
    wrong = blocked & declared  # the pairs blocked that may be attended
    own = (j > i + shift).expand_as(blocked) & declared
    if bool(own.any()) and bool((wrong == own).all()):
        return ("the layer masks the future itself: if it is meant to be causal, audit it as causal (causal=True, "
                "--causal); if not, remove its causal mask")
    for pattern, fix in (
            (j == i + shift, "a query may attend its own position: block the keys after it, "
                             "torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq), not triu(Tk - Tq)"),
            ((j > i) & (shift > 0), "align the causal mask bottom-right when Tq != Tk (cached decoding): the blocked "
                                    "keys are torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq), query i sees "
                                    "keys j <= i + Tk - Tq"),
            (j < i + shift, "the mask blocks the past instead of the future: the allowed keys are the lower "
                            "triangle, torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq) (tril, not triu)")):
        mistake = pattern.expand_as(declared) & declared  # what this mistake may block of what is allowed
        if bool(wrong.any()) and not bool((wrong & ~mistake).any()):  # it blocks nothing else that is allowed
            return fix
    return "block only the keys the mask marks as not allowed (and, for a causal layer, the future)"


def opening_fix(blocked: Tensor, declared: Tensor, t_q: int, t_k: int) -> str:
    """The fix for masking that leaves blocked pairs open (and blocks nothing allowed): nothing blocked at all, a
    causal mask k tokens too wide, a mask that blocks the padding but not the future (one replacing the other), or
    the general rule."""
    i, j = torch.arange(t_q).unsqueeze(-1), torch.arange(t_k)
    shift = t_k - t_q
    future = (j > i + shift).expand_as(declared)
    if not bool(blocked.any()):
        return CAUSAL_FIX if bool((future & ~declared).any()) else MASK_FIX
    for extra in range(1, t_k):
        wide = (j > i + shift + extra).expand_as(declared)
        if bool(wide.any()) and bool((blocked & future == wide).all()):
            return (f"the causal mask lets each query see {extra} future key{'s' if extra > 1 else ''}: block every "
                    f"key after its own position, torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq), not "
                    f"triu({1 + extra} + Tk - Tq)")
    if not bool((blocked & future).any()) and bool((future & ~declared).any()):
        return COMBINE_FIX
    if bool((blocked & future).any()) and bool((future & ~blocked).any()):  # the future blocked only in part
        return ("combine the masks with AND, not OR: a key may be attended only where every mask allows it "
                "(allowed = causal & padding); with OR a query sees the future wherever the padding allows it")
    return "block every key the mask marks as not allowed, before the softmax"


def merge_fix(op: Op | None, num_heads: int | None) -> str:
    """The fix for a view or reshape that mixes positions with heads: (B, H, T, d) merged straight to
    (B, T, H * d), or (B, T, D) split straight to (B, H, T, d)."""
    if op is None or op.short not in ("view", "_unsafe_view", "reshape") or not op.args or not op.outs:
        return ""
    x, out = op.args[0], op.outs[0]
    if not isinstance(x, Tensor) or out is None:
        return ""
    if x.dim() == 4 and out.dim() == 3 and (not num_heads or x.shape[1] == num_heads):
        return ("move the heads next to their features before merging them: y.transpose(1, 2).reshape(B, T, H * d), "
                "not y.reshape(B, T, H * d) of the (B, H, T, d) tensor")
    if x.dim() == 3 and out.dim() == 4 and (not num_heads or out.shape[1] == num_heads) and out.shape[2] == x.shape[1]:
        return ("split the heads off the features, then move them: x.view(B, T, H, d).transpose(1, 2), not "
                "x.view(B, H, T, d) of the (B, T, D) tensor")
    return ""


def masking_ops(trace: Trace, B: int, t_q: int, t_k: int) -> list[tuple]:
    """The ops of the user's that mask (Tq, Tk) scores or weights: (op, what it blocks per batch row (B, Tq, Tk),
    the id of the mask it was given, whether it comes before the first softmax over the keys); a fused attention
    call with a mask or a causal flag counts as before."""
    soft = first_softmax(trace, t_q, t_k)
    end = soft.index if soft is not None else len(trace.ops)
    masking = []
    for op in trace.ops:
        if not op.frames:
            continue
        if "scaled_dot_product" in op.name and "backward" not in op.name:
            q_len, k_len = op.args[0].shape[-2], op.args[1].shape[-2]
            if (q_len, k_len) != (t_q, t_k):  # not these queries over these keys (a cache lost a key)
                continue
            f = fused_pattern(op, t_q, t_k)
            mask = fused_arguments(op.name, op.args, op.kwargs)[0]
            mask_id = op.in_ids[3] if mask is not None and len(op.in_ids) > 3 else None
            if f is not None and (per_batch(f, B)) is not None:
                masking.append((op, per_batch(f, B), mask_id, True))
            continue
        got = fill_pattern(op, t_q, t_k)
        if got is None:
            continue
        per = per_batch(got[0], B)
        if per is not None:
            masking.append((op, per, got[1], op.index < end))
    return _per_sequence(masking, B)


def _per_sequence(masking: list[tuple], B: int) -> list[tuple]:
    """A loop over the sequences, each attended apart: B masking ops on one line, each over scores of one batch row,
    the k-th masking sequence k (not every sequence, as `per_batch` broadcasts a row), each before its own softmax
    where the first is before the first."""
    lines: dict = {}
    for i, (op, _, _, _) in enumerate(masking):
        out = first_out(op)
        if B > 1 and out is not None and out.dim() >= 3 and out.shape[0] == 1:
            lines.setdefault(op.frames[0], []).append(i)
    for indices in lines.values():
        if len(indices) != B:
            continue
        before = masking[indices[0]][3]
        for b, i in enumerate(indices):
            op, per, made, _ = masking[i]
            own = torch.zeros_like(per)
            own[b] = per[b]
            masking[i] = (op, own, made, before)
    return masking


def mask_sites(trace: Trace, declared: Tensor, B: int, t_q: int, t_k: int, *, origins: bool = True) -> list[Site]:
    """Masking ops judged against `declared`, bool (B, Tq, Tk) True = may attend: [] when they agree. `origins`: a
    mask computed from a buffer of the layer's alone is shown first where `__init__` made that buffer (False where
    the mask is taken to be the layer's intent, and only its use is in question)."""
    declared = declared.cpu()
    soft = first_softmax(trace, t_q, t_k)
    end = soft.index if soft is not None else len(trace.ops)
    masking = masking_ops(trace, B, t_q, t_k)
    rows = declared.any(-1, keepdim=True)  # queries with some key to attend
    sites: list[Site] = []

    def row_picker_sites(mask_id, user_of) -> list:
        """The line that hands every sequence another batch row's mask, where it is not the masking op's."""
        picker = batch_picker(trace, mask_id, B)
        used = first_out(user_of)
        # a mask of fewer rows broadcast over the whole batch's scores; not a sequence's own row, masking that
        # sequence's scores alone (a loop over the batch)
        if picker is None or picker.frames[:1] == user_of.frames[:1] or used is None or not used.dim() \
                or used.shape[0] != B:
            return []
        given, out = tuple(picker.args[0].shape), tuple(first_out(picker).shape)
        return [op_site(picker, f"keeps fewer batch rows of the mask than the batch has ({given} in, {out} out): "
                                f"a sequence is then given another's mask",
                        fix="index the mask by each sequence's own batch row (mask, or mask[:, ...]), not mask[:1] "
                            "or mask[0] broadcast over the batch")]

    def made_by(mask_id, user_of=None):
        """The user op that built a mask: back through carries and through what the masking op's own line
        did to it (torch's SDPA turns a bool mask into an additive one on the caller's line)."""
        p = through_carries(trace, producer(trace, mask_id) if mask_id is not None else None)
        steps = 0
        while p is not None and user_of is not None and p.frames[:1] == user_of.frames[:1] and steps < 32:
            prev = next((trace.producer[x] for x in p.in_ids if x in trace.producer), None)
            p = through_carries(trace, None if prev is None else trace.ops[prev])
            steps += 1
        return p if user(p) else None

    # a mask applied after the softmax (a fill on rows that still have keys to attend)
    weighted = soft.outs[0] > 0 if soft is not None and soft.outs and soft.outs[0] is not None else None
    if soft is not None and weighted is not None:
        for op, f, made, before in masking:
            full = fill_pattern(op, t_q, t_k)
            # zeroing weights the softmax gave (not the NaN rows of a query with no key, which a safe softmax zeroes)
            hits = (full is not None and full[0].shape == weighted.shape and bool((full[0] & weighted).any()))
            if not before and hits and soft.index in ancestors(trace, op):
                sites += [op_site(op, f"the mask is applied after the softmax at {short(soft)}: the kept weights "
                                       f"no longer sum to 1, and blocked keys still shape them through the "
                                       f"normaliser", fix=AFTER_SOFTMAX_FIX),
                          op_site(soft, "the softmax the mask should come before")]
        if sites:
            return sites
    before_ops = [(op, f, made) for op, f, made, before in masking if before]
    # an op before the softmax that marks blocked pairs but leaves them a score the softmax still weighs: a product
    # with a 0/1 mask (score 0, weight exp(0)), a fill with 0
    weights = per_batch(soft.outs[0].detach().nan_to_num(0.0) > WEIGHED, B) if soft is not None and soft.outs and \
        soft.outs[0] is not None and soft.outs[0].dim() >= 2 else None
    for op, f, made in before_ops:
        if weights is None or "scaled_dot_product" in op.name or weights.shape != f.shape:
            continue
        open_ = f & ~declared & rows & weights
        if bool(open_.any()) and op.index in ancestors(trace, soft):
            b, i, j = (int(x) for x in open_.nonzero()[0])
            out = soft.outs[0]
            w = float(out.reshape(B, -1, t_q, t_k)[b, :, i, j].max()) if out.numel() % (B * t_q * t_k) == 0 else \
                float("nan")
            how = ("multiplies the scores by the 0/1 mask: a blocked key gets score 0, not -inf"
                   if op.short in ("mul", "mul_") else "fills the blocked scores with a value the softmax still weighs")
            sites += [op_site(op, f"{how}; the softmax at {short(soft)} gives {int(open_.sum())} blocked (query, key) "
                                  f"pairs weight, e.g. query {i} -> key {j} in sequence {b}: {w:.3g}", fix=FILL_FIX)]
    # an op that blocks keys the declared mask allows
    for op, f, made in before_ops:
        wrong = f & declared
        if bool(wrong.any()):
            n, total = int(wrong.sum()), int(declared.sum())
            b, i, j = (int(x) for x in wrong.nonzero()[0])
            note = (f"blocks {n} of the {total} (query, key) pairs that may be attended (by the mask passed and "
                    f"causality), e.g. query {i} -> key {j} in sequence {b}")
            maker = made_by(made, op)
            buffer = buffer_behind(trace, made)
            note += f"; the mask comes from the layer's `{buffer}`, built before the call" if buffer else ""
            fix = blocking_fix(f, declared, t_q, t_k)
            sites += row_picker_sites(made, op)
            sites += buffer_sites(trace, made, f"the mask it holds {note.split(' (', 1)[0]}", fix) if origins else []
            sites += [op_site(maker, "builds the mask used below", fix=fix) if maker is not None and
                      maker.frames[0] != op.frames[0] else None]
            sites += [replace(x, fix=fix) for x in number_origins(trace, maker if maker is not None else op)]
            sites.append(op_site(op, note, fix=fix))
    union = torch.zeros_like(declared)
    for _, f, _ in before_ops:
        union |= f
    missing = ~declared & ~union & rows
    if bool(missing.any()):
        n = int(missing.sum())
        b, i, j = (int(x) for x in missing.nonzero()[0])
        future = j > i + t_k - t_q
        what = (f"leaves {n} blocked (query, key) pairs open, e.g. query {i} -> key {j} in sequence {b}"
                f"{' (a future key)' if future else ''}")
        if before_ops:
            for op, f, made in before_ops:
                maker = made_by(made, op)
                buffer = buffer_behind(trace, made)
                from_buffer = f"; the mask comes from the layer's `{buffer}`, built before the call" if buffer else ""
                fix = (blocking_fix(f, declared, t_q, t_k) if bool((f & declared).any())
                       else opening_fix(union, declared, t_q, t_k))
                sites += row_picker_sites(made, op)
                sites += buffer_sites(trace, made, f"the mask it holds {what}", fix) if origins else []
                sites += [op_site(maker, f"builds the mask that {what}", fix=fix) if maker is not None and
                          maker.frames[0] != op.frames[0] else None]
                sites += [replace(x, fix=fix) for x in number_origins(trace, maker if maker is not None else op)]
                sites += [replace(x, fix=fix) for x in none_origins(trace, op)]
                sites.append(op_site(op, f"the mask applied here {what}{from_buffer}", fix=fix))
        else:
            matmul = qk_matmul(trace, end)
            start = matmul.index if matmul is not None else 0
            fix = CAUSAL_FIX if future else MASK_FIX
            sites += empty_masks(trace, soft, what, made_by)
            sites += held_masks_unused(trace, what, fix) if origins else []
            sites += [replace(x, fix=fix) for x in did_nothing(trace, start, end, ("mask", "causal"))]
            sites += [op_site(soft, f"no masking op on (query, key) scores reaches this softmax: it {what}", fix=fix),
                      op_site(matmul, "the scores that should be masked before the softmax", fix=fix)]
    return [s for s in sites if s is not None]


@_never_raises
def held_masks_unused(trace: Trace, what: str, fix: str) -> list[Site]:
    """A mask the layer holds (a square buffer: bool, float of 0s and 1s as the causal mask xformers 0.0.3 registers
    in __init__, or float with -inf or large negative entries) that no op of this call read, while the softmax leaves
    pairs open: where it is made, then the lines of its owner's forward that read it (the condition under which it is
    applied, `if att_mask is not None:` there, is among them). [] where the call read every such mask."""
    if not isinstance(trace.layer, torch.nn.Module):
        return []
    read = {i for op in trace.ops for i in op.in_ids}
    sites = []
    for name, held in trace.layer.named_buffers():
        if id(held) in read or held.dim() < 2 or held.shape[-1] != held.shape[-2] or held.shape[-1] < 2:
            continue
        zero_one = (held.is_floating_point() and bool(((held == 0) | (held == 1)).all())
                    and 0 < held.sum() < held.numel())
        if not (held.dtype == torch.bool or zero_one or (held.is_floating_point() and bool((held < -1e4).any()))):
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = trace.layer.get_submodule(owner_path) if owner_path else trace.layer
        sites += [Site(file, line, function, text(file, line), "made before the call",
                       f"self.{attr}: a mask the layer holds, made here; no op of this call read it, and the softmax "
                       f"{what}", fix=fix) for file, line, function in made_at(trace.layer, name)[-1:]]
        forward = inspect.unwrap(type(owner).forward)
        found = _function_of(getattr(forward, "__code__", None))
        if found is None:
            continue
        body, start = found
        reads = sorted({node.lineno for node in ast.walk(body) if isinstance(node, ast.Attribute) and node.attr == attr
                        and isinstance(node.value, ast.Name) and node.value.id == "self"})
        file = forward.__code__.co_filename
        sites += [Site(file, start + n - 1, forward.__qualname__, text(file, start + n - 1), "reads it",
                       f"reads self.{attr}, the mask the layer holds, which this call did not apply", fix=fix)
                  for n in reads]
    return sites


WEIGHED = 1e-6
"""A weight above this is a key the softmax attends (a -inf or -1e4 fill leaves exactly 0 in float32)."""
FILL_FIX = ("block a key with -inf before the softmax, not with 0: scores = scores.masked_fill(~allowed, "
            "float('-inf')) (a 0/1 mask multiplied in leaves blocked keys score 0, which the softmax still weighs)")


@_never_raises
def none_origins(trace: Trace, op: Op) -> list[Site]:
    """A fused attention call given no mask (and not causal): where the None it got was made, the making line first:
    the return line of a user function called on its line that returned None (as this call ran it), or the line that
    assigned None to a name its line passes. []: the op is not such a call."""
    if "scaled_dot_product" not in op.name or not op.frames:
        return []
    mask, causal, _ = fused_arguments(op.name, op.args, op.kwargs)
    if mask is not None or causal:
        return []
    code, line = op.frames[0]
    sites = [site(((r.code, r.line),), "returns None", f"returns None, which line {line} passes as the mask of the "
                                                        f"fused call: nothing is masked")
             for r in trace.returns if r.caller is code and r.caller_line == line and r.value is None]
    found = _function_of(code)
    statement = None if found is None else _statement(found[0], line - found[1] + 1)
    for node in ([] if statement is None else ast.walk(statement)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in op.values \
                and op.values[node.id] is None:
            sites += [x for x in _origin(trace, op.frames, op.values, node, "None") if x.op == "assigns it"]
    return sites


def empty_masks(trace: Trace, soft: Op | None, what: str, made_by) -> list[Site]:
    """Masking ops on the scores `soft` reads, in a layout not read as (query, key) pairs (local attention's
    buckets, (B, windows, W, look-around)), whose mask blocks nothing at all (all False), while the audit's pairs
    are left open: the line that built that mask, then the op that applied it. Where a mask is combined from two
    conditions with `&` where one of them alone should block (local-attention 1.2.1's `mask & too_far`), the result
    is such an empty mask."""
    if soft is None or not soft.args or not isinstance(soft.args[0], Tensor):
        return []
    sites, shape = [], tuple(soft.args[0].shape)
    # the ops before the softmax on scores of its shape (not its ancestors: an in-place fill overwrites the
    # scores' producer, so a chain of in-place fills shows only its last)
    for op in trace.ops[:soft.index]:
        if not op.outs or op.outs[0] is None or tuple(op.outs[0].shape) != shape:
            continue
        got = filled_by(op) if op.frames else None
        if got is None or bool(got[0].any()):
            continue
        maker = made_by(got[1], op)
        note = (f"the mask applied here, to scores of shape {tuple(op.outs[0].shape)}, blocks nothing (every entry "
                f"False); the softmax {what}")
        fix = ("the mask is the & of conditions that never hold together: to block where either holds, combine "
               "them with | (blocked = a | b)" if maker is not None and maker.short in ("bitwise_and", "logical_and")
               else "build the mask so that it blocks the pairs the softmax leaves open")
        sites += [op_site(maker, "builds a mask that blocks nothing (all False), applied below", fix=fix)
                  if maker is not None and maker.frames[0] != op.frames[0] else None, op_site(op, note, fix=fix)]
    return sites


def buffer_behind(trace: Trace, tensor_id: int | None) -> str:
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


def made_at(layer: torch.nn.Module, name: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the lines that made the layer's parameter or buffer `name` ("attn.mem_k"), the
    origin first: in the first class of its owner's MRO whose `__init__` writes it (a subclass's runs after its
    parent's), the last statement there that writes it (`self.mem_k = ...`, `self.register_buffer("mem_k", ...)`,
    `self.bias.copy_(...)`, `self.bias[...] = ...`); where `__init__` only sets it to None, the last statement of
    another method that writes it (a cache the first call fills). Preceded by the last assignment, before it in the
    same function, of a local variable it was written from (`allowed = torch.tril(...)` before
    `self.bias.copy_(allowed)`), where there is one. [] where none is found."""
    owner_path, _, attr = name.rpartition(".")
    try:
        owner = layer.get_submodule(owner_path) if owner_path else layer
    except AttributeError:
        return []
    for cls, file, start, tree in init_sources(owner):
        writes = [node for node in ast.walk(tree) if _writes(node, attr)]
        if writes and not all(_writes_none(node) for node in writes):  # the last write that makes something
            return _with_origin(tree, max((node for node in writes if not _writes_none(node)),
                                          key=lambda node: node.lineno), file, start, f"{cls.__qualname__}.__init__")
        if writes:  # set to None in __init__: made by a call, in another method of this class
            try:
                lines, first = inspect.getsourcelines(cls)
                body = ast.parse(textwrap.dedent("".join(lines))).body[0]
            except (OSError, TypeError, SyntaxError, IndexError):
                return []
            made = [(f, node) for f in ast.walk(body) if isinstance(f, ast.FunctionDef) and f.name != "__init__"
                    for node in ast.walk(f) if _writes(node, attr) and not _writes_none(node)]
            if not made:
                return []
            function, last = max(made, key=lambda pair: pair[1].lineno)
            return _with_origin(function, last, file, first, f"{cls.__qualname__}.{function.name}")
    return []


def _with_origin(scope, write, file: str, start: int, where: str) -> list[tuple[str, int, str]]:
    """[the last assignment in `scope` before `write` of a local that `write` reads, if any, then `write`]."""
    read = {n.id for n in ast.walk(write) if isinstance(n, ast.Name) and n.id != "self"}
    origins = [node for node in ast.walk(scope) if isinstance(node, ast.Assign) and node.lineno < write.lineno
               and any(isinstance(t, ast.Name) and t.id in read for t in node.targets)]
    made = [(file, start + write.lineno - 1, where)]
    if origins:
        made.insert(0, (file, start + max(origins, key=lambda node: node.lineno).lineno - 1, where))
    return made


def _writes_none(node) -> bool:
    """`node` sets the attribute to None (`self.x = None`, `register_buffer("x", None)`): it makes nothing."""
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and len(node.value.args) >= 2:
        value = node.value.args[1]
    return isinstance(value, ast.Constant) and value.value is None


def _writes(node, attr: str) -> bool:
    """`node` is a statement that writes self.<attr>: assigns it (or an item of it), registers it
    (register_buffer / register_parameter("<attr>", ...)), or calls an in-place method on it (`copy_`)."""
    def is_self_attr(t) -> bool:
        return (isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                and t.value.id == "self")

    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(is_self_attr(t) or (isinstance(t, ast.Subscript) and is_self_attr(t.value)) for t in targets)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        call = node.value
        if call.func.attr in ("register_buffer", "register_parameter") and call.args:
            first = call.args[0]
            return isinstance(first, ast.Constant) and first.value == attr
        return call.func.attr.endswith("_") and not call.func.attr.startswith("_") and is_self_attr(call.func.value)
    return False


def buffer_alone(trace: Trace, tensor_id: int | None) -> str:
    """The name of the one parameter or buffer of the layer a tensor of the call was computed from, where every
    tensor it was computed from that no traced op made is that one (no mask or input of the call's): "" otherwise."""
    todo, seen, names = [tensor_id], set(), set()
    while todo and len(seen) < 256:
        i = todo.pop()
        if i is None or i in seen:
            continue
        seen.add(i)
        p = trace.producer.get(i)  # first: a buffer the call overwrote is what the call made of it
        if p is not None:
            todo.extend(trace.ops[p].in_ids)
        elif i in trace.buffers:
            names.add(trace.buffers[i])
        else:
            return ""  # a tensor the call was given
    return names.pop() if len(names) == 1 and not todo else ""


def buffer_sites(trace: Trace, tensor_id: int | None, note: str, fix: str) -> list[Site]:
    """The lines of `__init__` that made the layer's buffer a mask was computed from alone (see `made_at`)."""
    name = buffer_alone(trace, tensor_id)
    if not name or not isinstance(trace.layer, torch.nn.Module):
        return []
    made = made_at(trace.layer, name)
    attr = name.rpartition(".")[2]
    how = ["made here"] if len(made) == 1 else [f"computed here, then written into self.{attr}", "written here"]
    return [Site(file, line, function, text(file, line), "made before the call", f"self.{attr}: {h}; {note}", fix=fix)
            for h, (file, line, function) in zip(how, made)]


def init_sources(obj):
    """(class, file, first line, parsed `__init__`) for each class in the MRO of `obj` that defines an `__init__`
    whose source can be read, torch's own and builtins left out."""
    for cls in type(obj).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None or cls.__module__.startswith(("torch.", "builtins")):
            continue
        try:
            lines, start = inspect.getsourcelines(init)
            file = inspect.getsourcefile(init)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        if file is not None:
            yield cls, file, start, tree


# ---- where a number an op's line read was made -------------------------------------------------------------

_FUNCTIONS: dict = {}  # code object -> (parsed function, its first line) or None


def _function_of(code):
    """(the parsed `def` of a code object, the file line of its first line), None where its source is not read."""
    if code not in _FUNCTIONS:
        try:
            lines, start = inspect.getsourcelines(code)
            tree = ast.parse(textwrap.dedent("".join(lines)))
            node = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else None
            _FUNCTIONS[code] = None if node is None else (node, start)
        except (OSError, TypeError, SyntaxError, IndentationError):
            _FUNCTIONS[code] = None
    return _FUNCTIONS[code]


def _statement(function, line: int):
    """The innermost statement of `function` that spans its (1-based, relative) `line`."""
    found = None
    for node in ast.walk(function):
        if isinstance(node, ast.stmt) and node is not function and node.lineno <= line <= (node.end_lineno or line):
            if found is None or node.lineno >= found.lineno and (node.end_lineno or 0) <= (found.end_lineno or 0):
                found = node
    return found


def branch_of(op: Op | None, note: str, fix: str = "") -> Site | None:
    """The `if` that chose between two ways of making what the op made: the innermost `if` of the op's own function
    whose branch holds the op's line, where its other branch assigns a name the op's branch assigns too (x-transformers
    0.6.6's `if causal: ... n = ... else: n = torch.max(n, ...)` made the causal buckets for a bidirectional layer under
    the wrong test). A site at the condition's line saying which branch ran; None where the line is in no such branch
    (an `if` without an alternative: a cache check, a shape check) or its source is not read."""
    if op is None or not op.frames:
        return None
    code, line = op.frames[0]
    found = _function_of(code)
    if found is None:
        return None
    function, start = found
    rel = line - start + 1
    within = lambda nodes: any(n.lineno <= rel <= (n.end_lineno or n.lineno) for n in nodes)
    chosen = [node for node in ast.walk(function) if isinstance(node, ast.If) and (within(node.body) or
                                                                                  within(node.orelse))
              and _assigned_names(node.body) & _assigned_names(node.orelse)]
    if not chosen:
        return None
    inner = max(chosen, key=lambda node: node.lineno)
    taken = "if" if within(inner.body) else "else"
    both = ", ".join(sorted(_assigned_names(inner.body) & _assigned_names(inner.orelse)))
    return site(((code, start + inner.lineno - 1),) + tuple(op.frames[1:]), "if",
                f"{note}: line {line} ({op.short}) ran in its {taken} branch, and its other branch makes {both} "
                f"another way", fix)


def _assigned_names(statements) -> set[str]:
    """The local names the statements assign, at any depth: plain names and tuples of them, not an attribute or an
    item (`self.x = ...` and `stats["a"] = ...` assign no name `self` or `stats`)."""
    def plain(target) -> set[str]:
        if isinstance(target, ast.Name):
            return {target.id}
        if isinstance(target, (ast.Tuple, ast.List)):
            return set().union(*(plain(t) for t in target.elts))
        if isinstance(target, ast.Starred):
            return plain(target.value)
        return set()

    names: set[str] = set()
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    names |= plain(target)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                names |= plain(node.target)
    return names


def _names(target) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _assigned(function, name: str, before: int):
    """The last statement of `function` before its relative line `before` that assigns the local `name`."""
    found = [node for node in ast.walk(function) if isinstance(node, ast.stmt) and node.lineno < before
             and ((isinstance(node, ast.Assign) and any(name in _names(t) for t in node.targets))
                  or (isinstance(node, (ast.AnnAssign, ast.AugAssign)) and name in _names(node.target)))]
    return max(found, key=lambda node: node.lineno) if found else None


SCALING_CALLS = {"mul", "mul_", "div", "div_", "multiply", "divide", "true_divide"}


def _factor_operands(statement) -> list:
    """The names and `self.x` attributes a statement multiplies or divides by as they are (`s * self.scale`,
    `s.mul(scale)`, `s /= t`, `f(..., scale=sm_scale)`): the operands that carry a factor made elsewhere."""
    plain = (ast.Name, ast.Attribute)
    out = []
    for node in ast.walk(statement):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            out += [x for x in (node.left, node.right) if isinstance(x, plain)]
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Mult, ast.Div)) and \
                isinstance(node.value, plain):
            out.append(node.value)
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in SCALING_CALLS:
                out += [x for x in node.args if isinstance(x, plain)]
            out += [k.value for k in node.keywords if k.arg and "scale" in k.arg and isinstance(k.value, plain)]
    return out


def _value(node, values: dict):
    """What a name or `self.x` held when the op ran (a number, None), or `...` where it is not known."""
    if isinstance(node, ast.Name):
        return values.get(node.id, ...)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
            and "self" in values:
        v = getattr(values["self"], node.attr, ...)
        return v if v is ... or _number(v) else ...
    return ...


def _returns_of(function) -> list:
    return [node for node in ast.walk(function) if isinstance(node, ast.Return)]


def _origin(trace: Trace, frames: tuple, values: dict, node, value: str, *, plain: bool = True) -> list[Site]:
    """Where the number `node` (a name or `self.x` read on the line of `frames[0]`) was made, the making line
    first: a parameter, by the call that passed it (or left it at its default); a local, by the line that assigned
    it, after the return line of the user function that computed it (as this call ran it); `self.x`, by the line
    of `__init__` that wrote it, after the return line of the method it was computed by. `plain`: also a local
    assigned by an expression of its own (else only what another function made)."""
    code, line = frames[0]
    found = _function_of(code)
    if found is None:
        return []
    function, start = found
    rel, name = line - start + 1, ast.unparse(node)
    if isinstance(node, ast.Name):
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if node.id in params and node.id != "self" and len(frames) > 1:
            caller = site(frames[1:], "passes the argument", "")
            if caller is None:
                return []
            return [replace(caller, note=f"`{name}` = {value} is a parameter of {code.co_name}() (read at line "
                                         f"{line}): this call {_passes(caller.file, caller.line, code, node.id)}")]
        assigned = _assigned(function, node.id, rel)
        if assigned is None:
            return []
        at = start + assigned.lineno - 1
        made = [r for r in trace.returns if r.caller is code and r.caller_line == at]
        if not made and not plain:
            return []
        sites = [site(((r.code, r.line),), "returns it", f"returns {r.value!r}, which line {line} reads as `{name}`")
                 for r in made[-1:]]
        return sites + [site(((code, at),), "assigns it", f"assigns `{name}` = {value}, read at line {line}")]
    owner = values.get("self")
    if not isinstance(node, ast.Attribute) or owner is None:
        return []
    for cls, file, first, tree in init_sources(owner):
        writes = [w for w in ast.walk(tree) if _writes(w, node.attr) and not _writes_none(w)]
        if not writes:
            continue
        write = max(writes, key=lambda w: w.lineno)
        at = first + write.lineno - 1
        sites = []
        for call in (c for c in ast.walk(write) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                     and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"):
            method = inspect.unwrap(getattr(type(owner), call.func.attr, None) or (lambda: None))
            method = getattr(method, "__func__", method)
            inner = _function_of(getattr(method, "__code__", None)) if hasattr(method, "__code__") else None
            if inner is not None:
                body, begin = inner
                sites += [Site(method.__code__.co_filename, begin + r.lineno - 1,
                               getattr(method.__code__, "co_qualname", method.__name__),
                               text(method.__code__.co_filename, begin + r.lineno - 1), "returns it",
                               f"computes {value}, which __init__ stores in self.{node.attr} (line {at}), read "
                               f"at line {line}")
                          for r in _returns_of(body)]
        if not sites and not plain:
            return []
        return sites + [Site(file, at, f"{cls.__qualname__}.__init__", text(file, at), "made before the call",
                             f"self.{node.attr} = {value}, read at line {line}, is made here")]
    return []


def _passes(file: str, line: int, code, param: str) -> str:
    """'passes it' or 'leaves it at its default', as the call of the function of `code` on a line reads."""
    try:
        tree = ast.parse(text(file, line).removesuffix(":") or "None")
    except SyntaxError:
        return "passes it"
    names = code.co_varnames[:code.co_argcount]
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        bound = isinstance(call.func, ast.Attribute) and names[:1] in (("self",), ("cls",))
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if name != code.co_name or any(isinstance(a, ast.Starred) for a in call.args) or \
                any(k.arg is None or k.arg == param for k in call.keywords):
            continue
        at = names.index(param) - bound if param in names else 1 << 30
        return "leaves it at its default" if at >= len(call.args) else "passes it"
    return "passes it"


@_never_raises
def factor_origins(trace: Trace, frames: tuple, values: dict, factor: float) -> list[Site]:
    """Where the factor a scaling op multiplied by was made, when its line multiplies by a name or `self.x` that
    held that factor (or divides by one that held its inverse) as it ran: see `_origin`. [] where the line computes
    the factor itself (`* d ** -0.5`)."""
    if not frames or not factor:
        return []
    code, line = frames[0]
    found = _function_of(code)
    statement = None if found is None else _statement(found[0], line - found[1] + 1)
    if statement is None:
        return []
    for node in _factor_operands(statement):
        v = _value(node, values)
        if isinstance(v, (bool, int, float)) and v and any(
                abs(x - factor) <= 1e-5 * abs(factor) for x in (float(v), 1.0 / float(v))):
            sites = _origin(trace, frames, values, node, f"{float(v):.4g}")
            if sites:
                return sites
    return []


@_never_raises
def number_origins(trace: Trace, op: Op) -> list[Site]:
    """Where the numbers the line of `op` read were made in another function than the line's: a local assigned from
    a user function's return (`left, right = self.window_size()`: the line it returned from), or `self.x` written in
    `__init__` from a method's result (that method's return line). Sizes and locals computed on the spot are left
    out: the op's own line shows them."""
    if not op.frames:
        return []
    code, line = op.frames[0]
    found = _function_of(code)
    statement = None if found is None else _statement(found[0], line - found[1] + 1)
    if statement is None:
        return []
    found, seen = {}, set()  # (file, line) -> (its site, the names read that it made)
    for node in sorted((n for n in ast.walk(statement) if isinstance(n, (ast.Name, ast.Attribute))),
                       key=lambda n: (n.lineno, n.col_offset)):
        key = ast.unparse(node)
        if key in seen or not isinstance(node.ctx, ast.Load):
            continue
        seen.add(key)
        v = _value(node, op.values)
        if v is ... or v is None or isinstance(v, tuple):
            continue
        for made in _origin(trace, op.frames, op.values, node, repr(v), plain=False):
            if made.op == "returns it":
                found.setdefault((made.file, made.line), (made, []))[1].append(f"`{key}` = {v!r}")
    return [replace(made, note=f"makes what line {line} reads as {', '.join(names)}") for made, names in found.values()]


@_never_raises
def axis_origins(trace: Trace, op: Op, fix: str) -> list[Site]:
    """Where the axis a softmax op normalised over was set, when its line does not say it: a softmax module the line
    calls as `self.softmax(x)`, made in `__init__` (`self.softmax = nn.Softmax(dim=2)`: that line); a `dim=` the line
    reads from a name or `self.x` made elsewhere (see `_origin`), each with `fix`. [] where the line writes the axis
    itself."""
    if not op.frames:
        return []
    code, line = op.frames[0]
    found = _function_of(code)
    statement = None if found is None else _statement(found[0], line - found[1] + 1)
    owner = op.values.get("self")
    if statement is None:
        return []
    for call in (n for n in ast.walk(statement) if isinstance(n, ast.Call)):
        func = call.func
        module = getattr(owner, func.attr, None) if owner is not None and isinstance(func, ast.Attribute) and \
            isinstance(func.value, ast.Name) and func.value.id == "self" else None
        if isinstance(module, torch.nn.Module) and isinstance(getattr(module, "dim", None), int):
            for cls, file, first, tree in init_sources(owner):
                writes = [w for w in ast.walk(tree) if _writes(w, func.attr) and not _writes_none(w)]
                if writes:
                    at = first + max(writes, key=lambda w: w.lineno).lineno - 1
                    return [Site(file, at, f"{cls.__qualname__}.__init__", text(file, at), "made before the call",
                                 f"self.{func.attr} = {type(module).__name__}(dim={module.dim}), called at line "
                                 f"{line}, is made here: its dim is the axis the softmax normalises over", fix=fix)]
        for keyword in call.keywords:
            if keyword.arg == "dim" and isinstance(keyword.value, (ast.Name, ast.Attribute)):
                v = _value(keyword.value, op.values)
                if isinstance(v, int) and not isinstance(v, bool):
                    return [replace(x, fix=fix) for x in _origin(trace, op.frames, op.values, keyword.value, repr(v))]
    return []


def short(op: Op) -> str:
    s = op_site(op)
    return f"{s.file.rsplit('/', 1)[-1]}:{s.line}" if s else op.name


def short_frames(frames: tuple) -> str:
    """file:line of an observed event's innermost user frame ("" when none was recorded)."""
    s = site(frames, "")
    return f"{s.file.rsplit('/', 1)[-1]}:{s.line}" if s else ""


def op_name(op: Op) -> str:
    """The op as a person names it: "native_layer_norm" -> "layer_norm"."""
    return op.short.replace("native_", "")


# ---- differential ----------------------------------------------------------------------------------------


def held_elements(shape: tuple, P: Tensor) -> Tensor | None:
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


def moved(new: Tensor, old: Tensor, tol: float) -> Tensor:
    if not (old.is_floating_point() or old.is_complex()):
        return (new != old).cpu()
    o, n = old.double().cpu(), new.double().cpu()
    # the scale of the values, not of a mask's fill: scores filled with -finfo.max (lucidrains' `max_neg_value`) made
    # it 1e38, and no score moved by less than that
    kept = torch.isfinite(o)
    if old.is_floating_point():
        kept &= o.abs() < torch.finfo(old.dtype).max / 2
    finite = o[kept]
    scale = float(finite.square().mean().sqrt()) if finite.numel() else 1.0
    same = (n == o) | (torch.isnan(n) & torch.isnan(o))
    return ~same & ~((n - o).abs() <= tol * (scale or 1.0))


def aligned(a: Trace, b: Trace) -> list[tuple[Op, Op]]:
    """Pairs of ops of two calls that ran the same op from the same line, in order (a cached call runs ops the
    full pass does not: the concatenation with the cache)."""
    key = lambda op: (op.name, op.frames[0][0].co_filename if op.frames else "", op.frames[0][1] if op.frames else 0)  # noqa: E731
    matcher = difflib.SequenceMatcher(None, [key(x) for x in a.ops], [key(y) for y in b.ops], autojunk=False)
    return [(a.ops[i + k], b.ops[j + k]) for i, j, n in matcher.get_matching_blocks() for k in range(n)]


def first_moved(a: Trace, b: Trace, P: Tensor | None, tol: float, *, tail: int | None = None,
                reads_inputs: bool = False) -> Op | None:
    """The first op of `b` (with a user frame) whose output differs from `a`'s where it must not. `P`: held
    positions (B, T) for the position rule; `tail`: b is the last `tail` queries of a (decoding), compared
    with a's last rows, the ops of the two calls paired by what they ran and where. `reads_inputs`: only ops whose
    output depends on the probe's inputs (not a mask's own conversion, where the two calls differ in their mask)."""
    pairs = aligned(a, b) if tail is not None else zip(a.ops, b.ops)
    for x, y in pairs:
        if x.name != y.name:
            return None  # the two calls took different paths from here on
        if not y.frames or y.short in UNINITIALISED or reads_inputs and not y.sources:
            continue
        for ox, oy in zip(x.outs, y.outs):
            if ox is None or oy is None:
                continue
            if tail is not None:
                ox = last_rows(ox, oy.shape, tail)
                if ox is None:
                    continue
                if bool(moved(oy, ox, tol).any()):
                    return y
                continue
            if ox.shape != oy.shape:
                continue
            held = held_elements(tuple(oy.shape), P)
            if held is None:
                continue
            if bool((moved(oy, ox, tol) & held).any()):
                return y
    return None


def made_apart(a: Trace, b: Trace, P: Tensor | None, tol: float) -> list[Op]:
    """Two calls on the same input, the later after the calls before it left the layer a state (a cache it made): the
    ops of the two paired by what they ran and where (`aligned`), the first of `b`'s with a user frame whose output
    moved where held (`P`), and before it the op that made the value that moved it, followed back through the ops of
    both calls whose outputs moved to one only `b` ran (its own path, the cached one: PaLM-lite's ALiBi `return
    qk_sim + self.bias[...]`): [making op, consuming op], or [consuming op], or []."""
    pairs = aligned(a, b)
    partner = {y.index: x for x, y in pairs}

    def differs(x: Op, y: Op, held: Tensor | None = None) -> bool:
        for ox, oy in zip(x.outs, y.outs):
            if ox is None or oy is None or ox.shape != oy.shape:
                continue
            where = held_elements(tuple(oy.shape), held) if held is not None else True
            if where is not None and bool((moved(oy, ox, tol) & where).any()):
                return True
        return False

    def maker(tensor: int, before: int) -> Op | None:  # the last op before `before` that wrote it (in place too)
        return next((op for op in reversed(b.ops[:before]) if tensor in op.out_ids), None)

    def origin(y: Op, depth: int = 0) -> Op | None:
        for tensor in dict.fromkeys(y.in_ids):
            z = maker(tensor, y.index)
            if z is None:
                continue
            if z.index not in partner:
                if z.frames:
                    return z
            elif depth < ORIGIN_DEPTH and differs(partner[z.index], z):
                found = origin(z, depth + 1)
                if found is not None:
                    return found
        return None

    for x, y in pairs:
        if y.frames and y.short not in UNINITIALISED and differs(x, y, P):
            made = origin(y)
            return ([made] if made is not None else []) + [y]
    return []


ORIGIN_DEPTH = 8  # knob: ops followed back from the first that moved (a mask fill, a cast between): no verdict, a site


def last_rows(full: Tensor, shape: torch.Size, n: int) -> Tensor | None:
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


def declared_mask(probe, B: int, t_q: int, t_k: int, allowed: Tensor | None) -> Tensor:
    """What the audit declares: the mask passed (True = may attend) and, for a causal audit, bottom-right causal."""
    out = torch.ones(B, t_q, t_k, dtype=torch.bool) if allowed is None else allowed.cpu().bool().expand(B, t_q, t_k)
    if probe.causal:
        i, j = torch.arange(t_q).unsqueeze(-1), torch.arange(t_k)
        out = out & (j <= i + t_k - t_q)
    return out


def stream_sites(trace: Trace, subject) -> list[Site]:
    """A q·k or weights·v operand that does not depend on the input stream it should (cross-attention): the
    op that read the wrong input on its way there, then the product."""
    value = "value" if getattr(subject, "separate_value", True) else "key"
    checks = []  # (operand tensor id, the input it must come from, what it is, the product)
    fused = fused_ops(trace)
    soft = next((op for op in trace.ops if op.short in SOFTMAXES), None)
    if fused:
        f = fused[0]
        checks = [(f.in_ids[0], "query", "the queries", f), (f.in_ids[1], "key", "the keys", f),
                  (f.in_ids[2], value, "the values", f)]
    elif soft is not None:
        qk = qk_matmul(trace, soft.index)
        if qk is None:
            return []
        checks = [(qk.in_ids[-2], "query", "the queries (left operand of q·k)", qk),
                  (qk.in_ids[-1], "key", "the keys (right operand of q·k)", qk)]
        wv = next((op for op in trace.ops[soft.index + 1:]
                   if op.short in MATMULS and soft.index in ancestors(trace, op)), None)
        if wv is not None:
            checks.append((wv.in_ids[-1], value, "the values (right operand of weights·values)", wv))
    sites = []
    for tensor_id, stream, what, product in checks:
        got = trace.sources.get(tensor_id, frozenset())
        if stream in got or not got:
            continue
        wrong = "/".join(sorted(got))
        reader = first_reader(trace, tensor_id)
        fix = (f"compute {what.split(' (')[0]} from the {stream} input (in cross-attention the queries come from "
               f"the decoder stream, the keys and values from the memory)")
        sites += [op_site(reader, f"{what} at {short(product)} are computed here from the {wrong} input, not "
                                   f"from the {stream} input", fix=fix),
                  op_site(product, f"{what} of this product depend on the {wrong} input, not on the {stream} input",
                          fix=fix)]
    return [x for x in sites if x is not None]


def first_reader(trace: Trace, tensor_id: int) -> Op | None:
    """Back from a tensor to the user op that read a probe input directly on the way to it."""
    op = producer(trace, tensor_id)
    seen = 0
    while op is not None and seen < 256:
        direct = [i for i in op.in_ids if i in trace.inputs]
        if direct and op.frames:
            return computing(trace, op)
        prev = next((trace.producer.get(i) for i in op.in_ids if trace.sources.get(i)), None)
        op = None if prev is None else trace.ops[prev]
        seen += 1
    return None


def computing(trace: Trace, op: Op) -> Op:
    """From a view of an input to the op of the same line that computes with it (F.linear: view, then addmm),
    so that the site names the computation."""
    outs, at = set(op.out_ids), op
    for later in trace.ops[op.index + 1:op.index + 16]:
        if later.frames[:1] != op.frames[:1] or not outs & set(later.in_ids):
            continue
        if later.short not in CARRIES:
            return later
        outs |= set(later.out_ids)
    return at


def dim_meaning(shape, dim: int, probe) -> str:
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


def weights_origin(probe, trace: Trace, allowed, t_q: int, t_k: int, *, plain: bool = True) -> list[Site]:
    """What made the weights of a traced call: a softmax over the wrong dim, a mask or dropout after the
    softmax, masks that disagree with the declared one, no softmax at all. `plain`: also point at a correct
    softmax when nothing else is found."""
    B = probe.BATCH
    made = None
    if trace.output is not None and trace.output.weights is not None:
        made = past_zeroing(trace, through_carries(trace, producer(trace, id(trace.output.weights))))
    if made is None:
        soft = [op for op in trace.ops if op.short in SOFTMAXES and op.outs and op.outs[0] is not None
                and tuple(op.outs[0].shape[-2:]) == (t_q, t_k)]
        made = soft[-1] if soft else None
    if made is None:
        mats = [op for op in trace.ops if op.short in MATMULS and op.args and isinstance(op.args[-2], Tensor)
                and tuple(op.args[-2].shape[-2:]) == (t_q, t_k)]
        made = past_zeroing(trace, through_carries(trace, producer(trace, mats[-1].in_ids[-2]))) if mats else None
    if made is None:
        online = unrescaled_accumulators(trace)
        if online:
            return online
    if made is None or not made.frames:
        fused = fused_ops(trace)
        return [op_site(fused[0], "the fused attention whose weights these are")] if fused and plain else []
    return weights_made_by(probe, trace, made, declared_mask(probe, B, t_q, t_k, allowed), t_q, t_k, plain=plain)


def weights_made_by(probe, trace: Trace, made: Op, declared: Tensor, t_q: int, t_k: int, *,
                     plain: bool = True) -> list[Site]:
    B = probe.BATCH
    if made.short in SOFTMAXES:
        dim = int(made.args[1]) if len(made.args) > 1 else -1
        shape = tuple(made.outs[0].shape) if made.outs and made.outs[0] is not None else ()
        seen = softmax_call(trace, made)
        if seen is not None and seen.laid_out:  # scores laid out otherwise than (..., Tq, Tk): the observer read them
            q_axis, k_axis = seen.laid_out[-2:]
            if seen.dim == -1:
                masks = mask_sites(trace, declared, B, t_q, t_k)
                return masks or ([op_site(made, f"the softmax that makes the weights ({seen.layout})")] if plain else [])
            fix = f"normalise over the keys: softmax(dim={k_axis}) for scores laid out as {shape}"
            return axis_origins(trace, made, fix) + [op_site(
                made, f"normalises over dim {dim % len(shape)} of {shape}, the queries (size {shape[q_axis]}); the "
                      f"keys are dim {k_axis} (size {shape[k_axis]}), the axis the weights are summed over with the "
                      f"values", fix=fix)]
        if shape and dim % len(shape) != len(shape) - 1:
            meaning = dim_meaning(shape, dim, probe)
            fix = "normalise over the keys, the last dim of the (..., Tq, Tk) scores: softmax(dim=-1)"
            return axis_origins(trace, made, fix) + [op_site(
                made, f"normalises over dim {dim % len(shape)}, of size {shape[dim]} = {meaning}; keys are dim -1 "
                      f"(size {shape[-1]})", fix=fix)]
        masks = mask_sites(trace, declared, B, t_q, t_k)
        return masks or ([op_site(made, "the softmax that makes the weights")] if plain else [])
    soft_before = [i for i in ancestors(trace, made) if trace.ops[i].short in SOFTMAXES]
    if soft_before:
        soft = trace.ops[max(soft_before)]
        masks = mask_sites(trace, declared, B, t_q, t_k)
        if masks:
            return masks
        # a random mask drawn between the softmax and the weights, and multiplied in (F.dropout: bernoulli_, div_)
        dropout = any(("dropout" in op.name or "bernoulli" in op.name) and set(op.in_ids + op.out_ids) & set(made.in_ids)
                      for op in trace.ops[soft.index:made.index + 1])
        what = ("dropout is active in eval mode: it zeroes weights and rescales the rest by 1/(1-p)" if dropout else
                f"changes the weights after the softmax at {short(soft)}")
        fix = ("let dropout follow the mode: F.dropout(weights, p, training=self.training), or an nn.Dropout "
               "module, which eval() turns off" if dropout else
               "use the softmax's output as the weights: do not rescale, mask or normalise them again after it")
        return [op_site(made, what, fix=fix), op_site(soft, "the softmax the weights came from")]
    matmul = next((trace.ops[i] for i in sorted(ancestors(trace, made), reverse=True)
                   if trace.ops[i].short in MATMULS), None)
    start = matmul.index if matmul is not None else 0
    fix = "normalise the scores over the keys: weights = scores.softmax(dim=-1)"
    return list(unique([replace(x, fix=fix) for x in did_nothing(trace, start, made.index + 1,
                                                                 ("softmax", "normal", "prob"))]
                       + [op_site(made, "the weights come from here, and no softmax is on their way from q·k",
                                  fix=fix)]))


def in_custom_function(frame) -> bool:
    """Inside an autograd.Function's forward, which runs without grad by design: a `forward` whose first argument
    is the function's context (torch 2.14 calls it from C++, with no Python `apply` frame above it), or, on older
    torch, below `Function.apply` in autograd/function.py."""
    context = torch.autograd.function.FunctionCtx
    while frame is not None:
        code = frame.f_code
        if code.co_name in ("apply", "forward") and code.co_filename.endswith(
                ("autograd/function.py", "autograd\\function.py")):
            return True
        if code.co_name == "forward" and code.co_argcount and isinstance(frame.f_locals.get(code.co_varnames[0]),
                                                                          context):
            return True
        frame = frame.f_back
    return False


class GradientCut(torch.overrides.TorchFunctionMode):
    """Above autograd: the first torch call whose floating output does not require grad while a floating
    input does (a .detach(), a block under torch.no_grad(), .data), with the user's frames."""

    def __init__(self):
        super().__init__()
        self.cut: tuple = ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.cut and (torch.is_grad_enabled() or not in_custom_function(sys._getframe(1))):
            try:
                ins = [x for a in list(args) + list(kwargs.values()) for x in tensors(a)]
                outs = list(tensors(out))
                if (any(x.requires_grad and x.is_floating_point() for x in ins)
                        and any(o.is_floating_point() and not o.requires_grad for o in outs)):
                    self.cut = user_frames(sys._getframe(1))
            except Exception:
                pass
        return out
