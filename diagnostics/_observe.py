"""Look inside a layer without touching its code: a TorchDispatchMode records the softmax inputs and
outputs, the matmuls, fused SDPA calls and multiplications by constants, at the aten level, so it sees
the same operations whether the layer calls `torch.matmul`, `@`, `torch.bmm`, `torch.baddbmm`, `einsum`,
`F.softmax`, `Tensor.softmax` or `F.scaled_dot_product_attention`, and inside composite functions such as
`F.multi_head_attention_forward`.

From that record, `applied_scales()` estimates the factor the layer really multiplies q·k by before the
softmax. The estimate uses differences between the two halves of the probe batch, so any additive term
that does not depend on the content (masks, ALiBi and relative-position biases) cancels out; a term that does
(Transformer-XL's shifted (q + v)·r, DeBERTa's c2p + p2c), added to q·k on its way, is recorded (`Sum`) and read
beside q·k with a factor of its own.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ._frames import user_frames

aten = torch.ops.aten

def _ops(*names: str) -> frozenset:
    """The aten overloads named "op.overload" that this torch has, skipping the others: `_safe_softmax`
    (what SDPA's math path calls for masked rows) appeared in torch 2.5, and an op a build lacks is one no
    layer can call. (Older torch raises RuntimeError, not AttributeError, for an unknown op.)"""
    found = set()
    for name in names:
        op, overload = name.split(".")
        try:
            found.add(getattr(getattr(aten, op), overload))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


# Ops whose output carries the same values as their first input (a view or a copy of it).
_CARRY = _ops(
    "view.default", "_unsafe_view.default", "reshape.default", "clone.default", "transpose.int", "permute.default",
    "expand.default", "t.default", "_to_copy.default", "contiguous.default", "unsqueeze.default", "squeeze.dim",
    "squeeze.default", "slice.Tensor", "select.int", "alias.default", "detach.default",
    "repeat_interleave.self_int", "repeat.default", "unbind.int", "split.Tensor", "split_with_sizes.default",
    "unsafe_split.Tensor", "_reshape_alias.default",
    # and the steps of a rotary embedding that move or negate values (rotate_half, LLaMA's complex pairs)
    "neg.default", "view_as_complex.default", "view_as_real.default", "index_select.default", "gather.default",
    "roll.default", "flip.default", "narrow.default", "flatten.using_ints", "unflatten.int", "movedim.int",
    # and the steps of a relative shift (Transformer-XL's pad, Parakeet's), and a mask filled in: the entries kept are
    # the same numbers (the fits read only entries the softmax gave weight)
    "constant_pad_nd.default", "masked_fill.Scalar", "masked_fill_.Scalar",
)
# Ops that keep a factor their inputs carry when every tensor input carries the same one: with the products by a
# tensor (below), a rotary embedding applied after q was scaled (x * cos + rotate_half(x) * sin) keeps q's scale.
_KEEP_COMMON = _ops("add.Tensor", "add_.Tensor", "sub.Tensor", "sub_.Tensor", "cat.default", "stack.default")
# Sums and means over some axes, linear in their input: sum(c * x) = c * sum(x), so a factor the input carries is kept
# (Nyström's landmarks, the scaled queries summed over each segment, then divided by its length: a mean, whose division
# is no factor of the scores; `_counts`)
_REDUCE = _ops("sum.dim_IntList", "mean.dim")
_SCALE_BY = _ops("mul.Tensor", "mul.Scalar", "mul_.Tensor", "mul_.Scalar")
_DIVIDE_BY = _ops("div.Tensor", "div.Scalar", "div_.Tensor", "div_.Scalar")
# matmul itself only where it is not decomposed before a dispatch mode sees it: inside flex_attention's eager
# implementation, which runs below autograd
_MATMULS = _ops("bmm.default", "mm.default", "matmul.default")
_SOFTMAX = _ops("_softmax.default", "_safe_softmax.default")
_SUMS = frozenset({aten.add, aten.add_, aten.sub, aten.sub_})
_GATE_OPS = frozenset({aten.sigmoid, aten.log_sigmoid_forward})  # where a probability or a log-probability is made
BLOCKING_FILL = -1e4
"""A fill at or below this blocks its entry (a mask: -inf, the dtype's minimum, -10000), which keeps a log-probability a
gate's (`_Observer._gate`); a fill above it, other than 0, is a value of the layer's making."""


_UNKNOWN_HOPS = 16
"""How many ops past a scaled tensor its descendants are still marked as of unknown factor (a norm is a few)."""

RECORD_SITES = True
"""Record where in the user's code each observed op ran (a few frame hops per softmax, matmul, fused call or
scaling; the text of the line is read only when a finding is shown). benchmarks/audit_cost.py --no-sites
turns it off to measure what it costs."""

_OP_NAMES: dict = {}


def dispatch_name(func) -> str:
    """`str(func)` of an op ("aten.bmm.default"), formatted once per op: an observed call asks for every op it runs."""
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func)
    return name


@functools.lru_cache(maxsize=None)
def _argument_names(name: str) -> tuple[str, ...] | None:
    """The names an aten op's schema gives its arguments, in order ("aten.X.default" -> torch.ops.aten.X.default);
    None where the name is not one of torch's ops."""
    parts = name.split(".")
    try:
        op = getattr(getattr(torch.ops.aten, parts[1]), parts[2] if len(parts) > 2 else "default")
        return tuple(a.name for a in op._schema.arguments)
    except (AttributeError, IndexError, RuntimeError):
        return None


def fused_arguments(name: str, args: tuple, kwargs: dict) -> tuple[Tensor | None, bool, float | None]:
    """A fused attention op's mask (or additive bias), causal flag and `scale=` (None where not given), read by the
    names its schema gives them. Each kernel orders them its own way: CUDA's memory-efficient and cuDNN kernels take
    `attn_bias` and then a `compute_log_sumexp` flag before `is_causal` (True whenever an input requires grad, so
    the first bool is not the causal one there), the CPU's flash kernel takes `attn_mask` by keyword only. An op
    whose schema cannot be read falls back to the first tensor and the first bool after q, k and v."""
    names = _argument_names(name)
    if names is None:
        bound = dict(kwargs)
        bound.setdefault("attn_mask", next((a for a in args[3:] if isinstance(a, Tensor)), None))
        bound.setdefault("is_causal", next((a for a in args[3:] if isinstance(a, bool)), False))
    else:
        bound = {**dict(zip(names, args)), **kwargs}
    mask = bound.get("attn_mask")
    if mask is None:
        mask = bound.get("attn_bias")
    scale = bound.get("scale")
    return (mask if isinstance(mask, Tensor) else None), bool(bound.get("is_causal", False)), (
        None if scale is None else float(scale))


PADDED_TO = 8
"""torch's scaled_dot_product_attention pads a head width that its CUDA kernels cannot take to a multiple of 8 with
zero columns (q, k and v each) and passes them the scale of the width the layer wrote (1/sqrt of it, or the layer's
own `scale=`); the output's padded columns are cut after the kernel. Seen on an H200: heads of width 1 in bfloat16
reached the flash kernel 8 wide, and the scale 1 = 1/sqrt(1) was judged against 1/sqrt(8), "2.83x too sharp"."""


def unpadded(q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, *, pads: bool):
    """A fused call as the layer made it, where torch padded its head widths (`pads`: the call ran where torch pads,
    on CUDA): the trailing columns of q and k that are zero in both, and those of v and the output that are zero in
    v, cut where the width is the next multiple of `PADDED_TO` after the columns in use (a width that is a multiple
    of 8 already is never padded). Elsewhere, or where no such columns are there, the call as it was given."""
    if not pads:
        return q, k, v, out

    def in_use(*ts: Tensor) -> int:  # the columns up to the last that holds a nonzero entry in any of ts
        used = torch.zeros(ts[0].shape[-1], dtype=torch.bool, device=ts[0].device)
        for t in ts:
            used |= t.ne(0).reshape(-1, t.shape[-1]).any(0)
        nonzero = used.nonzero()
        return int(nonzero[-1]) + 1 if len(nonzero) else 0

    def padded(width: int, used: int) -> bool:
        return 0 < used < width and used % PADDED_TO != 0 and -(-used // PADDED_TO) * PADDED_TO == width

    if q.shape[-1] == k.shape[-1]:
        qk = in_use(q, k)
        if padded(q.shape[-1], qk):
            q, k = q[..., :qk], k[..., :qk]
    vo = in_use(v)
    if padded(v.shape[-1], vo) and (out is None or out.shape[-1] == v.shape[-1]):
        v, out = v[..., :vo], (None if out is None else out[..., :vo])
    return q, k, v, out


def _key(t: Tensor):
    """This view of the memory: a factor applied in place to one slice (q of a packed qkv) is not k's."""
    try:
        return t.data_ptr(), tuple(t.shape), tuple(t.stride())
    except (RuntimeError, NotImplementedError):
        return None


def _constant(x) -> float | None:
    """A Python number or a one-element tensor: a factor that is the same for every element."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, Tensor) and x.numel() == 1:
        return float(x.detach().reshape(()).item())
    return None


@dataclass
class SoftmaxCall:
    """A softmax, as (..., Tq, Tk) scores and weights (see `orient`); `dim`: the axis it normalised, in that view
    (-1: the keys); `layout`: how the layer laid the scores out, where that was not (..., Tq, Tk)."""

    input: Tensor
    output: Tensor
    dim: int
    frames: tuple = ()  # user_frames() where it ran
    layout: str = ""
    laid_out: tuple = ()  # the permutation of the layer's axes that gave this view (empty: none)
    # the scores before the layer subtracted each row's maximum (`s - s.amax(-1, keepdim=True)`, which the softmax
    # ignores): in half precision the shifted logits of a near-uniform row round to one value
    unshifted: Tensor | None = field(default=None, repr=False)

    def as_computed(self, t: Tensor) -> Tensor:
        """`t` (the input or the output) with its axes as the layer laid them out."""
        return t.permute([self.laid_out.index(a) for a in range(t.dim())]) if self.laid_out else t


@dataclass
class Matmul:
    out: Tensor
    a: Tensor
    b: Tensor
    factor: float  # alpha of baddbmm, times the constants a and b were multiplied by
    frames: tuple = ()


@dataclass
class Affine:
    """A product and a bias added in one op, bias + a @ b (aten.addmm: what nn.Linear with a bias runs on a contiguous
    input): its output's shape and its right operand b (a weight's transposed view, sharing the weight's storage)
    only, nothing copied. Not a `Matmul`, whose readers look for q·k: a projection is none. Read by the model audit's
    router rule (a gate with a bias, softmax(x W + c), is a router as softmax(x W) is)."""

    shape: tuple
    b: Tensor


@dataclass
class FusedAttention:
    q: Tensor
    k: Tensor
    v: Tensor
    scale: float  # the scale the kernel applies, times the constants q and k were multiplied by
    attn_mask: Tensor | None
    is_causal: bool
    frames: tuple = ()
    out: Tensor | None = field(default=None, repr=False)  # the attention's output, (..., Tq, d_v)
    given: float | None = None  # the kernel's own scale (its `scale=`, else 1/sqrt(d)): what it multiplies q·k by
    stated: bool = False  # the call passed `scale=` itself (the layer's own words for its temperature)


@dataclass
class FlexCall:
    """A `flex_attention` call (the higher-order operator under `torch.nn.attention.flex_attention`): its
    inputs, its `score_mod` and its block mask's `mask_mod` as the program wrote them."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    score_mod: object
    mask_mod: object
    frames: tuple = ()


@dataclass
class Scaling:
    """A multiplication or division of a tensor by one constant (`factor`: what the values were multiplied by)."""

    op: str
    factor: float
    shape: tuple
    frames: tuple = ()


@dataclass
class Sum:
    """Two tensors of one shape added (or one subtracted from the other) after a product of that many elements, since
    the last softmax: scores and a term added to them before the softmax (Transformer-XL's shifted (q + v)·r,
    DeBERTa's c2p + p2c, a bias computed from the tokens), as the op read them: a + b is what it wrote (b negated for
    a subtraction, times its alpha; a as it was before an in-place add)."""

    a: Tensor
    b: Tensor
    out: Tensor = field(repr=False)  # what it wrote (held, so that its memory is not another tensor's while recorded)
    keys: tuple = ()  # `_key` of a, b and out as the op saw them: which sum made an operand of a later one
    # of a and of b: (the product it was read from, through moves and constant factors only, and that factor), else
    # None: a term's own factor on its product (`_term_ratios`)
    origins: tuple = (None, None)
    # of a and of b: where it is a log-probability the layer made (log of a sigmoid, logsigmoid, their running sums:
    # a gate on the weights), the constant it was multiplied by since, else None (`_term_ratios`)
    gates: tuple = (None, None)


@dataclass(frozen=True)
class GateLeaf:
    """A leaf of a term added to q·k (`_added_terms`) that is a log-probability of the layer's own, times `factor`:
    softmax(s + log p) weighs each key by p (a sparse or forget gate), so its factor is 1 in every such design."""

    factor: float


@dataclass
class Record:
    """What one forward pass did, in order."""

    softmaxes: list[SoftmaxCall] = field(default_factory=list)
    matmuls: list[Matmul] = field(default_factory=list)
    fused: list[FusedAttention] = field(default_factory=list)
    flex: list[FlexCall] = field(default_factory=list)
    order: list[object] = field(default_factory=list)
    # products of a softmax's weights with values read at points (grid_sample): deformable attention weighs the memory
    # it sampled so (`Observer._lineage`)
    weighed_samples: int = 0
    # how many products of softmax weights with values gathered by unfold (im2col: each location's k x k
    # neighbourhood) the forward made: VOLO's outlook attention (`Observer._lineage`)
    weighed_unfolds: int = 0


_SAMPLERS = frozenset(getattr(aten, n) for n in ("grid_sampler", "grid_sampler_2d", "grid_sampler_3d")
                      if hasattr(aten, n))  # overload packets
_GATHERS = frozenset(getattr(aten, n) for n in ("im2col",) if hasattr(aten, n))  # unfold: neighbourhoods gathered
_FLEX: tuple = ()


def flex_ops() -> tuple:
    """(the module that calls it, torch's flex_attention higher-order operator, its eager implementation), or
    Nones: read only once something has imported torch.nn.attention.flex_attention (a layer that calls it has),
    because importing it loads torch.fx's symbolic shapes and sympy (~0.3 s) on torch 2.14; a torch without
    FlexAttention has no layer that can call it."""
    global _FLEX
    if not _FLEX:
        if "torch.nn.attention.flex_attention" not in sys.modules:
            return None, None, None
        try:
            import torch.nn.attention.flex_attention as module
            from torch._higher_order_ops.flex_attention import flex_attention, sdpa_dense
            _FLEX = (module, flex_attention, sdpa_dense)
        except ImportError:
            _FLEX = (None, None, None)
    return _FLEX


class Mode(TorchDispatchMode):
    """A TorchDispatchMode whose `__torch_dispatch__` torch does not wrap in `torch._disable_dynamo` when the class
    is made: that wrapper imports torch._dynamo (1.2-1.6 s, ~300 modules, 83% of a cold audit) on the first op
    under the mode. Dynamo is kept out of our frames once it is loaded, which any torch.compile'd layer has done
    before it runs (checked: a compiled function run under an Observer compiles none of our frames)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __enter__(self):
        cls = type(self)
        if "_dynamo_kept_out" not in cls.__dict__ and "torch._dynamo" in sys.modules:
            cls.__torch_dispatch__ = torch._disable_dynamo(cls.__torch_dispatch__, recursive=True)
            cls._dynamo_kept_out = True
        return super().__enter__()


class Observer(Mode):
    """Records attention-relevant aten calls into `self.record` while active.

    FlexAttention: a dispatch mode sees `flex_attention` as a higher-order operator, which raises in a mode
    that does not declare `supports_higher_order_operators`; and the eager `flex_attention` compiles its call
    with dynamo, which refuses to run under a user dispatch mode. So while observing, the eager path is taken
    uncompiled (torch's own debugging switch, restored on exit), the operator is recorded (`FlexCall`) and its
    eager implementation runs under this mode, so that its scores, softmax and matmuls are observed like any
    other layer's. Other higher-order operators run unobserved."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.record = Record()
        self._factors: dict[tuple, float] = {}  # (address, shape, stride) -> constant the values were multiplied by
        # tensors computed from a scaled one by an op that does not keep its scale (a norm, a power): how many such
        # ops away; their factor is unknown, and a product with one of them keeps none (q_scaled / |q_scaled|)
        self._unknown: dict[tuple, int] = {}
        self._counts: dict[tuple, int] = {}  # key of a sum of a scaled tensor -> how many of its values each one adds
        self._keep: list[Tensor] = []  # keeps storages alive so that their addresses are not reused
        self._origin: dict[tuple, Matmul] = {}  # key -> the product its values were read from (`Sum.origins`)
        self._sampled: set[tuple] = set()  # keys of values read at points (grid_sample) and of what moved them
        self._unfolded: set[tuple] = set()  # keys of values gathered by unfold (im2col) and of what moved them
        self._normalised: set[tuple] = set()  # keys of softmax weights and of what moved them
        self._shifted: dict[tuple, Tensor] = {}  # a row-shifted tensor (s - s.amax(-1)) -> s
        self._flex_compile: list = []  # the eager flex_attention's switches as each entry found them
        self._products: set[int] = set()  # the sizes of the products made since the last softmax (see `_summed`)
        self._probs: set[tuple] = set()  # keys of sigmoid outputs (probabilities), through moves and clamps
        self._logp: dict[tuple, float] = {}  # key of a log-probability (`Sum.gates`) -> the constant it was multiplied by
        self._running: dict[tuple, tuple] = {}  # key of a log-probability read from a running sum -> that sum's key

    def _factor(self, t) -> float:
        """The constant `t`'s values were multiplied by since the last projection (1.0 where unknown)."""
        return self._factors.get(_key(t), 1.0) if isinstance(t, Tensor) else 1.0

    def _known(self, t) -> float | None:
        """`t`'s factor, None where it is unknown (computed from a scaled tensor by an op that loses the scale)."""
        if not isinstance(t, Tensor):
            return 1.0
        key = _key(t)
        return None if key in self._unknown else self._factors.get(key, 1.0)

    def _set_factor(self, t, factor: float | None, hops: int = 0) -> None:
        """Record `t`'s factor; None: unknown, `hops` ops away from a scaled tensor."""
        if not isinstance(t, Tensor):
            return
        key = _key(t)
        if factor is None:
            if hops <= _UNKNOWN_HOPS:
                self._unknown[key] = hops
            self._factors.pop(key, None)
            return
        self._unknown.pop(key, None)
        if factor == 1.0:
            self._factors.pop(key, None)  # a new tensor at a reused address: not the old one's factor
        else:
            self._factors[key] = factor
            self._keep.append(t)

    def _gain(self, t: Tensor) -> float | None:
        """What multiplying by the tensor `t` multiplies the other operand's factor by: its own factor where it carries
        one; 1 for a table computed without gradients (a rotary embedding's cos and sin); None (unknown) for a learned
        or computed gain (a norm's weight, even one still at a single value: vit-pytorch's QK RMSNorm, whose sqrt(d)
        and gain make the norm, and whose scores are then scaled by the declared factor alone)."""
        key = _key(t)
        if key in self._factors or key in self._unknown:
            return self._known(t)
        return None if t.requires_grad else 1.0

    def _fresh(self, outs) -> None:
        """Outputs of a product, a softmax or a fused call: a new start, whatever a freed tensor at their address had."""
        if self._factors or self._unknown:
            for o in outs:
                if isinstance(o, Tensor):
                    self._set_factor(o, 1.0)

    def _hops(self, tensors) -> int | None:
        """How far the nearest scaled or unknown input is (0: one carries a factor itself); None: none is."""
        near = None
        for t in tensors:
            key = _key(t)
            h = 0 if key in self._factors else self._unknown.get(key)
            if h is not None and (near is None or h < near):
                near = h
        return near

    def _frames(self) -> tuple:
        return user_frames(sys._getframe(3)) if RECORD_SITES else ()  # above _frames, _note, __torch_dispatch__

    def _scaled(self, func, factor: float, t: Tensor) -> None:
        if t.dim() >= 2:  # scores and projections, not a scalar's arithmetic
            event = Scaling(str(func.overloadpacket), factor, tuple(t.shape), self._frames())
            self.record.order.append(event)

    def __enter__(self):
        # a stack: the mode is entered again, nested, around each flex_attention's eager implementation
        self._flex_compile.append(_uncompiled_flex(True))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _uncompiled_flex(self._flex_compile.pop())
            if not self._flex_compile:  # the outermost exit: the whole call is recorded
                try:
                    orient(self.record)
                except Exception:  # observing must never break the audit
                    pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            _, flex, eager = flex_ops()
            if flex is not None and func is flex:
                self._note_flex(args, kwargs)
                with self:  # the eager implementation's ops, observed (the mode is popped while it dispatches)
                    return eager(*args, **kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        name = dispatch_name(func)
        try:
            self._note(func, name, packet, args, kwargs, out)
        except Exception:  # observing must never break the layer under audit
            pass
        return out

    def _from(self, t: Tensor, m: Matmul) -> None:
        self._origin[_key(t)] = m
        self._keep.append(t)

    def _inherit(self, func, args, outs) -> None:
        """Each output's product of origin (`_origin`): kept through the ops that move values (`_CARRY`), a constant
        factor, and a concatenation with zeros (Transformer-XL's relative shift pads the product with a column of
        zeros); dropped by any other op, whose output is computed, not read (an output of the op in place keeps it
        only so). Its factor is tracked apart (`_known`)."""
        first = args[0] if args else None
        source = None
        if func in _CARRY and isinstance(first, Tensor):
            source = self._origin.get(_key(first))
        elif (func in _SCALE_BY or func in _DIVIDE_BY) and len(args) > 1:
            a, b = args[0], args[1]
            # a constant, not a learned one (a gate's parameter: its factor is the model's to learn, not a scale)
            if isinstance(a, Tensor) and _constant(b) is not None and a.numel() > 1 and not _learned(b):
                source = self._origin.get(_key(a))
            elif func in _SCALE_BY and isinstance(b, Tensor) and _constant(a) is not None and b.numel() > 1 \
                    and not _learned(a):
                source = self._origin.get(_key(b))
        elif func.overloadpacket in _SUMS and len(args) > 1 and _constant(args[1]) == 0.0 and isinstance(first, Tensor):
            source = self._origin.get(_key(first))  # x + 0: `score = 0; score += c2p / scale` (DeBERTa's)
        elif func is aten.cat.default and isinstance(first, (list, tuple)):
            found = [self._origin.get(_key(x)) for x in first if isinstance(x, Tensor)]
            read = [m for m in found if m is not None]
            rest = [x for x, m in zip(first, found) if m is None]
            if len(read) == 1 and all(isinstance(x, Tensor) and not bool(x.any()) for x in rest):
                source = read[0]
        for o in outs:
            if not isinstance(o, Tensor):
                continue
            if source is not None:
                self._from(o, source)
            else:
                self._origin.pop(_key(o), None)

    def _lineage(self, func, packet, args, outs) -> None:
        """Follow values read at points (a grid_sample's output), values gathered by unfold (im2col) and softmax weights
        through the ops that only move them (`_CARRY`, stack, cat), and count a product of weights with either
        (`Record.weighed_samples`, `Record.weighed_unfolds`): deformable attention weighs each sampled point by its
        weight, outlook attention each location's neighbours. A grid_sample whose output no softmax's weights multiply
        (a table resized, a position read) is none."""
        ins = [x for a in args for x in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(x, Tensor)]
        keys = {_key(x) for x in ins}
        if packet in (aten.mul, aten.mul_, aten.bmm, aten.matmul, aten.mm) and len(ins) == 2 \
                and keys & self._normalised:
            if keys & self._sampled:
                self.record.weighed_samples += 1
            if keys & self._unfolded:
                self.record.weighed_unfolds += 1
        moved = {_key(ins[0])} if func in _CARRY and ins else keys if packet in (aten.cat, aten.stack) else set()
        for held, made in ((self._sampled, packet in _SAMPLERS), (self._unfolded, packet in _GATHERS),
                           (self._normalised, func in _SOFTMAX)):
            follows = made or bool(moved & held)
            for o in outs:  # an output at an address another tensor had is that tensor no more (held: no copy kept)
                if isinstance(o, Tensor):
                    (held.add if follows else held.discard)(_key(o))

    def _summed(self, func, args, kwargs, out) -> None:
        """Record a `Sum` where two whole tensors with as many elements as a product made since the last softmax are
        added: what is added to q·k on its way to the softmax (a term of the queries and the positions) is read
        beside it in the fit."""
        a, b = args[0], args[1]
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor) and a.dim() >= 2
                and a.shape == b.shape == out.shape and out.numel() in self._products):
            return
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        sign = 1 if func.overloadpacket in (aten.add, aten.add_) else -1
        b = b.detach() if alpha * sign == 1 else b.detach() * (alpha * sign)
        keys = (_key(a), _key(args[1]), _key(out))
        origins = tuple(None if self._origin.get(k) is None or self._known(x) is None else
                        (self._origin[k], self._known(x) * (1.0 if x is a else float(alpha * sign)))
                        for k, x in ((keys[0], a), (keys[1], args[1])))
        gates = (self._logp.get(keys[0]), None if keys[1] not in self._logp else self._logp[keys[1]] * alpha * sign)
        # in place, `a` is the output now: what it held is the output less b (a copy, which later writes leave alone)
        a = out.detach() - b if a is out else a.detach()
        self.record.order.append(Sum(a, b, out.detach(), keys, origins, gates))

    def _gate(self, func, packet, args, kwargs, outs) -> None:
        """Follow probabilities (a sigmoid's output, clamped from below or moved) and the log-probabilities made from
        them (their log, logsigmoid's output) with the constant each was multiplied by since (`Sum.gates`): through
        moves, a negation (the factor negated), a pad or a fill with 0 (log 1: a key the gate leaves open) or with a
        blocking value (<= BLOCKING_FILL), running sums, the sum of two at one factor, the difference of two entries
        of one running sum (a forget gate's c_i - c_j: the log of the gates between key j and query i, on the entries
        a causal mask keeps), and a constant factor. Any other op's output is neither (a pad with another value, a
        difference of two unrelated gates, a sum with alpha)."""
        first = args[0] if args and isinstance(args[0], Tensor) else None
        key = None if first is None else _key(first)
        held = self._logp.get(key)
        prob, logp, running = packet is aten.sigmoid, None, None
        if packet is aten.log_sigmoid_forward or packet in (aten.log, aten.log_) and key in self._probs:
            logp = 1.0
        elif held is None and packet not in (aten.clamp, aten.clamp_min) and func not in _CARRY:
            pass  # nothing marked reaches this op, and it makes no probability
        elif packet is aten.neg:
            logp = None if held is None else -held
        elif packet is aten.constant_pad_nd or packet in (aten.masked_fill, aten.masked_fill_):
            fill = _constant(args[2]) if len(args) > 2 else 0.0
            logp = held if fill is not None and (fill == 0.0 or fill <= BLOCKING_FILL) else None
            running = self._running.get(key) if logp is not None else None
        elif packet in (aten.clamp, aten.clamp_min):
            prob, logp = key in self._probs, held
        elif func in _CARRY:
            prob, logp, running = key in self._probs, held, self._running.get(key)
        elif packet in (aten.cumsum, aten.cumsum_):
            logp, running = held, True  # its own output is the running sum (below)
        elif packet in _SUMS and len(args) > 1 and isinstance(args[1], Tensor):
            other = _key(args[1])
            alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            if alpha == 1 and held is not None and self._logp.get(other) == held:
                if packet in (aten.add, aten.add_):
                    logp = held  # two gates at one factor summed: a gate at that factor
                elif self._running.get(key) is not None and self._running.get(key) == self._running.get(other):
                    logp = held  # c_i - c_j of one running sum
        elif (func in _SCALE_BY or func in _DIVIDE_BY) and len(args) > 1:
            c = _constant(args[1])
            if c is not None and not _learned(args[1]) and (func in _SCALE_BY or c):
                logp = held * (c if func in _SCALE_BY else 1.0 / c)
        marked = outs if func in _CARRY else outs[:1]  # logsigmoid's second output is its buffer
        for o in outs:
            if not isinstance(o, Tensor):
                continue
            k = _key(o)
            mine = any(o is m for m in marked)
            (self._probs.add if prob and mine else self._probs.discard)(k)
            if logp is None or not mine:
                self._logp.pop(k, None)
                self._running.pop(k, None)
                continue
            self._logp[k] = logp
            root = k if running is True else running
            if root is None:
                self._running.pop(k, None)
            else:
                self._running[k] = root
            self._keep.append(o)

    def _note_flex(self, args, kwargs):
        try:
            q, k, v, score_mod, block_mask, scale = args[:6]
            mask_mod = block_mask[-1] if isinstance(block_mask, tuple) and block_mask else None
            f = FlexCall(q.detach(), k.detach(), v.detach(), float(scale) * self._factor(q) * self._factor(k),
                         score_mod, mask_mod, user_frames(sys._getframe(2)) if RECORD_SITES else ())
            self.record.flex.append(f)
            self.record.order.append(f)
        except Exception:  # observing must never break the layer under audit
            pass

    def _note(self, func, name, packet, args, kwargs, out):
        rec = self.record
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if packet in _SAMPLERS or packet in _GATHERS or func in _SOFTMAX or self._sampled or self._unfolded \
                or self._normalised:
            self._lineage(func, packet, args, outs)
        if packet is aten.sub and len(args) > 1 and isinstance(args[1], Tensor) and _row_constant(args[0], args[1]):
            self._shifted[_key(out)] = args[0].detach()  # scores less each row's max: the softmax reads the same
            self._keep.append(out)
        if packet in _SUMS and self._products and len(args) > 1:
            self._summed(func, args, kwargs, out)
        if packet in _GATE_OPS or self._probs or self._logp:  # after `_summed`, which reads its inputs' marks
            self._gate(func, packet, args, kwargs, outs)
        if self._products:  # between a product and the softmax: which product each tensor's values come from
            self._inherit(func, args, outs)
        if func in _CARRY and isinstance(args[0], Tensor):
            f = self._known(args[0])
            for o in outs:
                self._set_factor(o, f, self._unknown.get(_key(args[0]), 0))
        elif func in _SCALE_BY or func in _DIVIDE_BY:
            a, b = args[0], args[1]
            c_b, c_a = _constant(b), _constant(a) if isinstance(a, Tensor) and a.numel() == 1 else None
            if c_b is not None and isinstance(a, Tensor) and a.numel() > 1:
                c = c_b if func in _SCALE_BY else (1.0 / c_b if c_b else math.inf)
                if func in _DIVIDE_BY and c_b == self._counts.get(_key(a)):
                    c = 1.0  # a sum divided by how many values it adds: their mean, at the factor they carried
                self._set_factor(out, self._factor(a) * c)
                self._scaled(func, c, a)
            elif c_a is not None and func in _SCALE_BY and isinstance(b, Tensor):
                self._set_factor(out, self._factor(b) * c_a)
                self._scaled(func, c_a, b)
            elif isinstance(a, Tensor) and isinstance(b, Tensor) and (self._factors or self._unknown):
                near = self._hops((a, b))  # None: neither carries a factor (nor an unknown one)
                fa, fb = (self._gain(x) if near is not None else 1.0 for x in (a, b))
                f = None if fa is None or fb is None else fa * fb if func in _SCALE_BY else (fa / fb if fb else None)
                self._set_factor(out, f, (near or 0) + 1)
        elif func in _KEEP_COMMON and (self._factors or self._unknown):
            ins = [x for a in args for x in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(x, Tensor)]
            alpha = kwargs.get("alpha", args[2] if len(args) > 2 and not isinstance(args[2], Tensor) else 1)
            common = {self._known(x) for x in ins}
            whole = all(x.numel() > 1 for x in ins) and (alpha == 1 or packet not in (aten.add, aten.add_, aten.sub,
                                                                                        aten.sub_))
            f = common.pop() if len(common) == 1 and whole else None
            for o in outs:
                self._set_factor(o, f, (self._hops(ins) or 0) + 1)
        elif func in _REDUCE and isinstance(args[0], Tensor):
            f = self._known(args[0])
            if self._factors or self._unknown:
                self._set_factor(out, f, self._unknown.get(_key(args[0]), 0))
            dims = args[1] if len(args) > 1 and args[1] is not None else range(args[0].dim())
            n = math.prod(args[0].shape[d] for d in ([dims] if isinstance(dims, int) else dims))
            if f is not None and func.overloadpacket is aten.sum and n > 1:  # scaled or not: /n makes it a mean
                self._counts[_key(out)] = n
                self._keep.append(out)
        elif func is aten.copy_.default:
            self._set_factor(args[0], self._known(args[1]), self._unknown.get(_key(args[1]), 0))
        elif func in _MATMULS:
            a, b = args[0], args[1]
            # a copy: a layer may scale the scores in place afterwards (Falcon's `scores /= sqrt(d)`)
            m = Matmul(out.detach().clone(), a.detach(), b.detach(), self._factor(a) * self._factor(b), self._frames())
            self._products.add(out.numel())
            self._fresh(outs)
            self._from(out, m)
            rec.matmuls.append(m)
            rec.order.append(m)
        elif func is aten.addmm.default:
            rec.order.append(Affine(tuple(out.shape), args[2].detach()))
        elif func is aten.baddbmm.default:
            a, b = args[1], args[2]
            alpha = float(kwargs.get("alpha", args[4] if len(args) > 4 else 1.0))
            m = Matmul(out.detach().clone(), a.detach(), b.detach(), alpha * self._factor(a) * self._factor(b),
                       self._frames())
            self._products.add(out.numel())
            self._fresh(outs)
            self._from(out, m)
            rec.matmuls.append(m)
            rec.order.append(m)
        elif func in _SOFTMAX:
            scores = args[0].detach()
            if scores.untyped_storage().nbytes() > scores.numel() * scores.element_size():
                # a slice of a larger tensor, which the layer may then overwrite with these weights (labml-nn's
                # `attn[half:] = attn[half:].softmax(-1)`): kept as it was
                scores = scores.clone()
            s = SoftmaxCall(scores, out.detach(), int(args[1]), self._frames(),
                            unshifted=self._shifted.get(_key(args[0])))
            self._products.clear()
            self._origin.clear()
            self._fresh(outs)
            if out.numel():  # a softmax over no key (a stream given no tokens) weighs nothing: not recorded
                rec.softmaxes.append(s)
                rec.order.append(s)
        elif "scaled_dot_product" in name and "backward" not in name:
            mask, is_causal, stated = fused_arguments(name, args, kwargs)
            out = outs[0].detach() if isinstance(outs[0], Tensor) else None
            q, k, v, out = unpadded(args[0].detach(), args[1].detach(), args[2].detach(), out,
                                    pads=args[0].device.type == "cuda")
            scale = 1.0 / math.sqrt(q.shape[-1]) if stated is None else float(stated)
            f = FusedAttention(q, k, v, scale * self._factor(args[0]) * self._factor(args[1]),
                               None if mask is None else mask.detach(), is_causal, self._frames(), out, scale,
                               stated is not None)
            self._fresh(outs)
            rec.fused.append(f)
            rec.order.append(f)
        elif self._factors or self._unknown:  # any other op: what it computes from a scaled tensor has no known factor
            ins = [x for a in list(args) + list(kwargs.values())
                   for x in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(x, Tensor)]
            near = self._hops(ins)
            for o in outs:
                if isinstance(o, Tensor):
                    self._set_factor(o, None if near is not None else 1.0, (near or 0) + 1)


def _learned(x) -> bool:
    """A tensor that requires grad: a parameter of the layer, or computed from one."""
    return isinstance(x, Tensor) and x.requires_grad


def _row_constant(a, b) -> bool:
    """`b` holds one number per row of `a` (..., n): what a stable softmax subtracts."""
    return (isinstance(a, Tensor) and a.dim() >= 2 and a.shape[-1] > 1 and b.dim() == a.dim() and b.shape[-1] == 1
            and b.shape[:-1] == a.shape[:-1])


def orient(record: Record) -> None:
    """Lay out every softmax over a non-last axis as (..., Tq, Tk) scores, heads and batch first, so that what reads
    the weights finds them by their sizes whatever the layer's layout ((B, Tq, Tk, H) with softmax(dim=2), keys
    first): the keys are the axis the weights are summed over with the values (the next product that reads them),
    else the softmax's own axis where the q·k product's sizes say so; the queries are the scores' other axis. Where
    Tq = Tk and no product tells, the queries are the earlier of the two axes (every einsum layout writes them
    first). A softmax over the queries stays one: its `dim` is then -2."""
    for i, sm in enumerate(record.order):
        if not isinstance(sm, SoftmaxCall) or sm.layout:
            continue
        nd = sm.input.dim()
        d = sm.dim % nd if nd else 0
        if nd == 2 and d == 1:  # rows of every (batch, query) flattened: read as the product that sums them reads them
            _unflatten(record, i, sm)
            continue
        if nd < 3:
            continue
        axes = _heads_between(record, i, sm)
        if d == nd - 1 and axes is None:  # the usual layout, unless the values are summed over another axis (keys
            if sm.output.numel() > _ORIENT_LAST_MAX:  # first, over queries)
                continue
            k = _summed_with_values(record.order[i + 1:], sm.output)
            if k is None or k == d or sm.output.shape[k] != sm.output.shape[d]:
                continue
        axes = axes or _query_key_axes(record, i, sm, d)
        if axes is None:
            continue
        q, k = axes
        perm = [a for a in range(nd) if a not in (q, k)] + [q, k]
        if perm == list(range(nd)):  # already (..., Tq, Tk): a softmax over another axis of them stays as it was
            continue
        shape = tuple(sm.input.shape)
        sm.layout = (f"softmax over dim {d} of {shape}: read as (..., Tq, Tk) with the queries from dim {q} and "
                     f"the keys from dim {k}")
        sm.input, sm.output, sm.dim = sm.input.permute(perm), sm.output.permute(perm), perm.index(d) - nd
        if sm.unshifted is not None:
            sm.unshifted = sm.unshifted.permute(perm)
        sm.laid_out = tuple(perm)


def _heads_between(record: Record, i: int, sm: SoftmaxCall) -> tuple[int, int] | None:
    """(queries, keys) of scores laid out (..., Tq, H, Tk), the heads between the queries and the keys (timm's
    MultiQueryAttentionV2: einsum('bnhk,bmk->bnhm', q, k)), whatever axis the softmax is over: the q·k product that
    made them has Tq x H rows, the two axes before the keys flattened, where the axis just before the keys alone is
    not its rows, nor as long as the keys while the one before is not. None otherwise."""
    shape = tuple(sm.output.shape)
    scores = next((m for m in reversed(record.order[:i]) if isinstance(m, Matmul)
                   and m.out.numel() == sm.input.numel() and m.out.dim() >= 2), None)
    if len(shape) < 4 or scores is None:
        return None
    rows, cols = tuple(scores.out.shape[-2:])
    if cols != shape[-1] or rows == shape[-2] or rows != shape[-3] * shape[-2]:
        return None
    if shape[-2] == shape[-1] != shape[-3]:
        # as many rows as keys just before the keys, not two axes before: (..., H, Tq, Tk) with Tq = Tk (the audit's
        # probes), its rows flattened the same way (CoCa's einsum('b h i d, b j d -> b h i j', q, k), one key head)
        return None
    return len(shape) - 3, len(shape) - 1


def _unflatten(record: Record, i: int, sm: SoftmaxCall) -> None:
    """A softmax over the last axis of (B * Tq, Tk) rows (pytorch-seq2seq's `F.softmax(attn.view(-1, Tk), dim=1)`)
    whose very numbers the next product reads as a (..., Tq, Tk) operand summed over its last axis (the view back):
    take that operand's shape as the weights' own."""
    for m in record.order[i + 1:]:
        if not isinstance(m, Matmul):
            continue
        x = m.a
        if x.dim() >= 3 and x.numel() == sm.output.numel() and x.shape[-1] == sm.output.shape[-1] \
                and torch.equal(x.reshape(sm.output.shape), sm.output.to(x.dtype)):
            shape = tuple(x.shape)
            sm.layout = (f"softmax over dim 1 of {tuple(sm.output.shape)}: read as {shape}, the shape the product at "
                         f"its values reads it in")
            # its axis, the last of the rows, is the keys' of the shape read: -1 (dim=1 of a 3-D view is the queries)
            sm.input, sm.output, sm.dim = sm.input.reshape(shape), sm.output.reshape(shape), -1
            if sm.unshifted is not None:
                sm.unshifted = sm.unshifted.reshape(shape)
        return


_ORIENT_LAST_MAX = 1 << 22
"""Weights larger than this (a long audit's (B, H, T, T)) laid out with the softmax's axis last are taken as (..., Tq, Tk)
without asking the values product (a keys-first layout shows at the standard probe's length)."""


def _query_key_axes(record: Record, i: int, sm: SoftmaxCall, d: int) -> tuple[int, int] | None:
    shape = tuple(sm.output.shape)
    k = _summed_with_values(record.order[i + 1:], sm.output)
    scores = next((m for m in reversed(record.order[:i]) if isinstance(m, Matmul)
                   and m.out.numel() == sm.input.numel() and m.out.dim() >= 2), None)
    rows, cols = (tuple(scores.out.shape[-2:]) if scores is not None else (None, None))
    if k is None:
        if scores is not None and rows != cols and shape[d] in (rows, cols):
            size = cols  # q·k: the keys are the product's columns
            k = d if shape[d] == size else next((a for a in reversed(range(1, len(shape))) if shape[a] == size), None)
        elif sum(n == shape[d] for n in shape[1:]) == 2:  # two axes of this size: queries first
            k = max(a for a in range(1, len(shape)) if shape[a] == shape[d])
        if k is None:
            return None
    other = (rows if cols == shape[k] else cols) if scores is not None and shape[k] in (rows, cols) else shape[k]
    candidates = [a for a in range(1, len(shape)) if a != k and shape[a] == other]
    if not candidates and k != 0 and shape[0] == other:
        # the queries first and the batch after them: (Tq, Tk, B, H), labml's einsum('ibhd,jbhd->ijbh') with its
        # softmax(dim=1). Axis 0 is read as the queries only where no later axis has their size, so a batch as long
        # as the queries (B == Tq), which would leave the queries' own axis among the later ones, is never taken
        candidates = [0]
    if not candidates:
        return None
    before = [a for a in candidates if a < k]
    return (before[-1] if before else candidates[0]), k


def _summed_with_values(later: list, weights: Tensor) -> int | None:
    """The axis of `weights` that the first later product reading them sums over (the keys), told by the sums along
    it: a product's operand holds the same numbers, so its sums over the contracted axis are the weights' sums over
    one of their axes, in some order. None when no product reads them as they are."""
    for m in later:
        if not isinstance(m, Matmul):
            continue
        for operand, contracted in ((m.a, -1), (m.b, -2)):
            if operand.numel() != weights.numel() or operand.dim() < 2:
                continue
            n = operand.shape[contracted]
            wide = torch.float64 if weights.dtype == torch.float64 else torch.float32
            want = operand.to(wide).nan_to_num(0.0).sum(contracted).flatten().sort().values
            w = weights.to(wide).nan_to_num(0.0)  # a row of no key: NaN, zeroed before it reaches the values
            scale = float(want.abs().mean()) or 1.0
            gaps = {a: float((w.sum(a).flatten().sort().values - want).abs().max()) / scale
                    for a in range(w.dim()) if w.shape[a] == n}
            if not gaps:
                continue
            best = min(gaps, key=gaps.get)
            others = [g for a, g in gaps.items() if a != best]
            # the same numbers summed in another order differ by rounding only (<= 1e-6 relative measured in float32);
            # near-uniform weights (GPT-2's init) sum to ~1 over either axis, so the other axis must be 10x further
            if gaps[best] <= _SAME_SUMS and all(g > 10 * max(gaps[best], 1e-7) for g in others):
                return best
        return None
    return None


KEYS_PARALLEL = 0.99
"""The least cosine between each token's key and its query for `keys_are_queries` to read a product's keys as its
queries (scaled, as Reformer's l2-normalised ones): bfloat16's rounding of both leaves them within 1e-3 of parallel;
keys of their own projection, at any initialisation, are nowhere near (|cos| about 1/sqrt(d))."""


def keys_are_queries(record: Record | None) -> bool:
    """Whether the q·k product before every softmax over (T, T) scores takes each token's key parallel to its query
    (shared-QK attention, Reformer's: the keys are the queries l2-normalised), read from the product's operands; False
    where there is no such softmax or product."""
    found = False
    for i, sm in enumerate(record.order if record is not None else ()):
        if not isinstance(sm, SoftmaxCall) or sm.input.dim() < 2 or sm.input.shape[-1] != sm.input.shape[-2]:
            continue
        m = next((e for e in reversed(record.order[:i]) if isinstance(e, Matmul)
                  and e.out.numel() == sm.input.numel()), None)
        if m is None or m.a.dim() < 2 or m.a.shape[-2] != m.b.shape[-1] or m.a.shape[-1] != m.b.shape[-2]:
            return False
        q, k = m.a.double(), m.b.double().transpose(-2, -1)
        cosine = (q * k).sum(-1) / (q.norm(dim=-1) * k.norm(dim=-1)).clamp_min(1e-300)
        if not bool((cosine > KEYS_PARALLEL).all()):
            return False
        found = True
    return found


def values_axis(record: Record, sm: SoftmaxCall) -> int | None:
    """The axis of the softmax's output (as recorded) that the first later product reading it sums its values over,
    or None where none reads it as it is (`_summed_with_values`)."""
    i = next((j for j, e in enumerate(record.order) if e is sm), None)
    return None if i is None else _summed_with_values(record.order[i + 1:], sm.output)


_SAME_SUMS = 1e-4
"""The largest relative difference between the sorted sums of the weights along an axis and those of a product's
operand over its contracted axis for them to be the same numbers. Measured (tests/test_observed_conventions.py's
heads-last and keys-first layers and their twins, float32 and bfloat16, default and std-0.02 init, 5 seeds): the
contracted axis <= 3.6e-7 (margin 280x), the other axis >= 4.2e-3 (near-uniform weights at std 0.02)."""


def _uncompiled_flex(state):
    """Set eager flex_attention's switches for an observed call, returning the old ones (pass them back to restore):
    torch's own switch that skips its dynamo compilation, and its device check, which refuses inputs that require
    grad on the CPU (FlexAttention has no CPU backward). An observed call runs in grad mode only so that torch's
    fused inference paths are not taken, and never runs backward: the check is lifted while observing, so that a
    module with trainable weights that calls flex_attention can be observed on the CPU."""
    _flex_module = flex_ops()[0]
    if _flex_module is None or state is None:  # nothing set on entry, so nothing to restore on exit
        return None
    old = (getattr(_flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False),
           getattr(_flex_module, "_validate_device", None))
    compile_off, check = (True, _no_device_check) if state is True else state
    if hasattr(_flex_module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"):
        _flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = compile_off
    if old[1] is not None and check is not None:
        _flex_module._validate_device = check
    return old


def _no_device_check(query: Tensor, key: Tensor, value: Tensor) -> None:
    return None


@dataclass(frozen=True)
class ScaleEstimate:
    applied: float  # the factor q·k is multiplied by before the softmax
    d_k: int  # the width of the dot products
    source: str  # how it was found
    fit: float  # relative residual of the fit (0 = exact)
    # what it was read from (the events of the record), for pointing at the line
    matmul: Matmul | None = field(default=None, compare=False, repr=False)
    softmax: SoftmaxCall | None = field(default=None, compare=False, repr=False)
    fused: FusedAttention | None = field(default=None, compare=False, repr=False)
    used_by: Matmul | None = field(default=None, compare=False, repr=False)  # weights @ values, when not the softmax's
    parts: int = 1  # the products the scores sum, q·k and the terms added to it (DeBERTa's c2p and p2c: 3)
    terms: int = 0  # the terms read beside q·k, each with a factor of its own the fit leaves free
    # each term's products' own factor over q·k's (`_term_ratios`), None for one that is no such product; a gate's
    # (a log-probability of the layer's own) its own factor, whose right value is 1
    term_ratios: tuple = ()
    term_gates: tuple = ()  # for each of term_ratios: whether it is a gate's
    # the products read as a query's (or key's) against a table of each token's own (`_per_query_table`): vouched for
    # only where the caller's trace shows that table made from no probe input (`softmax_saturation`)
    term_tables: tuple = field(default=(), compare=False, repr=False)


def applied_scales(record: Record) -> list[ScaleEstimate]:
    """One estimate per softmax that normalises a matmul's output, and one per fused attention call."""
    estimates = [ScaleEstimate(f.scale, int(f.q.shape[-1]), "fused scaled_dot_product_attention", 0.0, fused=f)
                 for f in record.fused]
    sums = [j for j, e in enumerate(record.order) if isinstance(e, Sum)]  # where terms may be added to q·k
    where = {id(e): j for j, e in enumerate(record.order)} if sums else {}
    for i, event in enumerate(record.order):
        if not isinstance(event, SoftmaxCall):
            continue
        found = len(estimates)
        read = _scale_of(record, i, event, estimates, sums, where)
        part = _part_of_product(record, i, event) if read and len(estimates) == found else None
        if part is not None:  # a softmax over one part of the batch's scores at a time (labml-nn's in-place halves)
            m, c, n, (s, residual) = part
            estimates.append(ScaleEstimate(s * m.factor, int(m.a.shape[-1]), f"softmax input vs part {c + 1} of {n} "
                                           f"of the q·k matmul (the scores normalised a part of the batch at a time)",
                                           residual, matmul=m, softmax=event))
    return estimates


SCORE_PARTS = 8
"""The most parts a layer's softmaxes may split one product's scores into (`_part_of_product`)."""


def _part_of_product(record: Record, i: int, event: SoftmaxCall):
    """(the product, which part, of how many, the fit) where the softmax's scores are one of n equal consecutive parts
    (n <= `SCORE_PARTS`) of an earlier q·k product's elements, multiplied by one factor: a layer that normalises its
    scores a slice of the batch at a time, in place (labml-nn's Stable Diffusion `attn[half:] =
    attn[half:].softmax(-1)`, then the first half), which no whole product's size matches. None where none fits."""
    size = event.input.numel()
    scores = event.input if event.unshifted is None else event.unshifted
    for m in [e for e in record.order[:i] if isinstance(e, Matmul)][::-1]:
        n = m.out.numel() // max(size, 1)
        if not 2 <= n <= SCORE_PARTS or m.out.numel() != n * size or m.out.shape[-1] != scores.shape[-1]:
            continue
        for c, part in enumerate(m.out.reshape(n, -1)):
            fitted = _fit_scale(scores, part.reshape(scores.shape), event.output)
            if fitted is not None and fitted[1] <= 0.05:
                return m, c, n, fitted
    return None


def weights_in_parts(record: Record, sm: SoftmaxCall) -> tuple[Tensor, int, int] | None:
    """(the weights the values meet, which part `sm` or a softmax of its shape wrote, of how many) where the output of
    `sm`, or of another softmax of the same shape beside it with no product between them (the part `sm` wrote may have
    been changed since: a mask after the softmax in the last part normalised; another attention's softmax, before
    its own product, is no part of this one), is one of n equal consecutive parts (2 <= n <= `SCORE_PARTS`) of a later
    product's operand: the layer normalised its scores a part of the batch at a time into one tensor (labml-nn's
    in-place halves), whose whole, shaped as n of `sm`'s outputs along their first axis, is what multiplies the
    values. Every part counts as that tensor holds it, also one no softmax wrote (a half the layer forgot to
    normalise). None where no later product holds one so, or where every part is the same (one map broadcast over
    the batch and heads: the softmax's own output is the weights)."""
    at = next((j for j, e in enumerate(record.order) if e is sm), None)
    if at is None:
        return None
    run = [at]  # the softmaxes of sm's shape next to it, no product between: the other parts of one normalisation
    for step in (-1, 1):
        j = at + step
        while 0 <= j < len(record.order) and not isinstance(record.order[j], Matmul):
            e = record.order[j]
            if isinstance(e, SoftmaxCall) and e.output.shape == sm.output.shape:
                run.append(j)
            j += step
    for candidate in (record.order[j] for j in run):
        found = _part_of_operand(record, candidate)
        if found is not None:
            return found
    return None


def _part_of_operand(record: Record, sm: SoftmaxCall) -> tuple[Tensor, int, int] | None:
    out, at = sm.output, next((j for j, e in enumerate(record.order) if e is sm), None)
    if at is None or out.dim() < 3 or not out.numel():
        return None
    for m in record.order[at + 1:]:
        if not isinstance(m, Matmul):
            continue
        for operand in (m.a, m.b):
            n = operand.numel() // out.numel()
            if 2 <= n <= SCORE_PARTS and operand.numel() == n * out.numel() and operand.dtype == out.dtype:
                parts, flat = operand.reshape(n, -1), out.reshape(-1)
                same = [torch.equal(part, flat) for part in parts]
                if any(same) and not all(same):  # every part the same: one map broadcast to the batch, no parts
                    return operand.reshape(n * out.shape[0], *out.shape[1:]), same.index(True), n
    return None


def _scale_of(record: Record, i: int, event: SoftmaxCall, estimates: list, sums: list, where: dict) -> bool:
    """`applied_scales`' estimates for the softmax `event` (the i-th event), appended to `estimates`; False where
    the softmax is not read at all (a pooling softmax beside a fused call; q·k zero everywhere)."""
    if record.fused and event.dim not in (-1, event.output.dim() - 1):
        # beside a fused attention call, a softmax over another axis than the keys is not the attention's: it
        # pools (GLM-5-Next's indexer averages each pool's keys by a softmax over the pool's tokens, of a
        # projection that its fit read as q·k multiplied by 1); the fused call is judged
        return False
    if _zero_scores(record, i) is not None:  # q·k is 0 everywhere: no factor can be read, and an older product
        return False  # of the same size (a projection x @ W_q where T = d_k) is not the softmax's
    earlier = [m for m in record.order[:i] if isinstance(m, Matmul) and m.out.numel() == event.input.numel()]
    # or q·k with fewer columns than the softmax: the layer's own logits (sinks) beside the products
    beside = [m for m in record.order[:i] if isinstance(m, Matmul) and m.out.numel() < event.input.numel()]
    scores = event.input if event.unshifted is None else event.unshifted
    for m in earlier[::-1] + beside[::-1]:
        same = m.out.numel() == event.input.numel()
        fitted = (_fit_scale if same else _fit_beside)(scores, m.out, event.output)
        if fitted is None and event.laid_out:  # the product's elements in the order the layer laid out the scores
            fitted = _fit_scale(event.as_computed(scores), m.out, event.as_computed(event.output))
        relative, added, parts = None, [], 1
        if fitted is None and same:  # scores plus terms of each key row and column of a grid (q·R_h, q·R_w)
            at = next(j for j, e in enumerate(record.order) if e is m)
            relative = _fit_decomposed(scores, m.out, record.order[at + 1:i])
            fitted = relative
        at = where.get(id(m), i)
        for cut in _columns(scores, m.out) if relative is None and any(at < j < i for j in sums) else []:
            # scores plus terms added to q·k on the way (Transformer-XL's, DeBERTa's), sinks beside them or not;
            # read beside q·k even where q·k alone fits (terms small at std 0.02): the products summed count
            added, parts, leaves = _added_terms(m.out, record.order[at + 1:i], event.output[..., cut])
            beside = _fit_scale(scores[..., cut], m.out, event.output[..., cut], tuple(added)) if added else None
            if beside is not None:
                fitted = beside
                ratios, tables = _term_ratios(scores[..., cut], m, event.output[..., cut], added, leaves)
                gates = tuple(isinstance(leaf, GateLeaf) for each in leaves for leaf in each)
                break
        else:
            added, parts, ratios, gates, tables = [], 1, (), (), ()
        heads = _fit_per_head(scores, m.out, event.output) if fitted is None and same else []
        for h, (s, residual) in enumerate(heads):  # a temperature of each head's own (a learned one per head)
            estimates.append(ScaleEstimate(s * m.factor, int(m.a.shape[-1]), f"softmax input vs q·k matmul, "
                                           f"head {h} of {len(heads)}", residual, matmul=m, softmax=event))
        if heads:
            break
        at = next(j for j, e in enumerate(record.order) if e is m)
        mix = [e.b.reshape(e.b.shape[-2:]) for e in record.order[at + 1:i] if _mixes_heads(e)]
        # a (H, H) operand between q·k and the softmax, as einsum("bhij,hk->bkij") runs it: (1, H, H)
        mixed = _fit_mixed_heads(scores, m.out, event.output, mix[0]) if fitted is None and same and mix else None
        if mixed is not None:  # talking heads: each head's scores a mix of every head's q·k by the layer's matrix
            s, residual = mixed
            estimates.append(ScaleEstimate(s * m.factor, int(m.a.shape[-1]), "softmax input vs the heads' q·k "
                                           "mixed across heads by the layer's own matrix (talking heads)",
                                           residual, matmul=m, softmax=event))
            break
        if fitted is not None:
            s, residual = fitted
            estimates.append(ScaleEstimate(s * m.factor, int(m.a.shape[-1]), "softmax input vs q·k matmul" + (
                ", less a term of each key's row and one of its column of the grid (decomposed relative "
                "positions)" if relative is not None else "") + (
                f", beside {len(added)} term{'s' if len(added) > 1 else ''} added to q·k on its way (relative "
                f"positions, a bias or a gate, whose own factor is not the temperature)" if added else ""),
                residual, matmul=m, softmax=event, parts=parts, terms=len(added), term_ratios=ratios,
                term_tables=tables,
                term_gates=gates))
            found = _weights_used(record.order[i + 1:], event.output)
            if found is not None:  # something happened to the weights between the softmax and the values
                used, by = found
                again = _fit_log_weights(used, m.out)
                if again is not None and _log_weights_read(event.output, m.out, s):
                    estimates.append(ScaleEstimate(again[0] * m.factor, int(m.a.shape[-1]),
                                                   "log of the weights that multiply the values vs q·k",
                                                   again[1], matmul=m, softmax=event, used_by=by))
            break
    return True


def zero_products(record: Record) -> list[Matmul]:
    """The products q·k that are 0 for every query and key, one per softmax (`_zero_scores`): the queries or the keys
    reached it as zeros (Zaya's keys times a learned temperature that its init sets to 0), so the softmax's input is
    the mask alone and its weights are the same whatever q·k is multiplied by. `applied_scales` reads no factor
    there."""
    found = (_zero_scores(record, i) for i, e in enumerate(record.order) if isinstance(e, SoftmaxCall))
    return [m for m in found if m is not None]


def _zero_scores(record: Record, i: int) -> Matmul | None:
    """The product before the softmax `record.order[i]` of the scores' size, where it is all zeros and the softmax's
    input is the same in both batch halves (the mask alone reaches it: a product of zeros with a term of the tokens
    added after it is not the scores' whole story); None otherwise."""
    event = record.order[i]
    m = next((m for m in reversed(record.order[:i]) if isinstance(m, Matmul) and m.out.numel() == event.input.numel()),
             None)
    if m is None or not m.out.numel() or bool(m.out.detach().any()) or event.input.numel() % 2:
        return None
    first, second = _paired(event.input, 0)
    return m if torch.equal(first, second) else None


def _added_terms(products: Tensor, between: list, weights: Tensor) -> tuple[list[Tensor], int, list[list]]:
    """The terms added to q·k between its product and the softmax (`Sum`s of as many elements as the scores), in the
    order they were added, and how many parts the scores sum, q·k one of them: Transformer-XL's shifted (q + v)·r
    (XLNet, Conformer, Parakeet: 2 parts), DeBERTa's c2p + p2c (3), a bias projected from the tokens (VITS, Inkling).
    These depend on the tokens, so no bias the same in both batch halves holds them, and `_fit_scale` found none. Of
    each sum, the operand that the products (and the terms already found) explain carries q·k; the other is a term,
    of as many parts as sums of neither (c2p + p2c) made it. A sum that adds nothing that differs between the batch
    halves (a mask) adds no term. Third, each term's leaves: the (product, factor) its values were read from
    (`Sum.origins`), one per product a join of terms summed, a `GateLeaf` for a log-probability of the layer's own
    (`Sum.gates`), None for a leaf read from neither."""
    terms: list[Tensor] = []
    leaves: list[list] = []
    parts = 1
    joins: list[tuple[int, Sum]] = []  # sums of which neither operand carries q·k, by their place in `between`

    def carries(x: Tensor) -> bool:  # q·k in it, with the terms found so far: the fit holds and x moves between halves
        flat = x.reshape(-1)
        half = flat.numel() // 2
        return not torch.equal(flat[:half], flat[half:]) and _fit_scale(x, products, weights, tuple(terms)) is not None

    def made_of(key, before: int) -> int:  # the parts of the operand of this key: the last sum that wrote it, else 1
        j = next(((i, e) for i, e in reversed(joins) if i < before and e.keys[2] == key), None)
        return 1 if j is None else made_of(j[1].keys[0], j[0]) + made_of(j[1].keys[1], j[0])

    def read_from(key, origin, gate, before: int) -> list:  # the (product, factor) or GateLeaf of each part
        j = next(((i, e) for i, e in reversed(joins) if i < before and e.keys[2] == key), None)
        if j is None:
            return [GateLeaf(gate) if gate is not None else origin]
        i, e = j
        return read_from(e.keys[0], e.origins[0], e.gates[0], i) + read_from(e.keys[1], e.origins[1], e.gates[1], i)

    for i, e in enumerate(between):
        if not isinstance(e, Sum) or e.a.numel() != products.numel() or e.a.numel() % 2:
            continue
        a, b = carries(e.a), carries(e.b)
        if a == b:
            joins += [] if a else [(i, e)]
            continue
        term = e.b if a else e.a
        if not torch.equal(term.reshape(-1)[:term.numel() // 2], term.reshape(-1)[term.numel() // 2:]):
            terms.append(term)
            side = 1 if a else 0
            parts += made_of(e.keys[side], i)
            leaves.append(read_from(e.keys[side], e.origins[side], e.gates[side], i))
    return terms, parts, leaves


def _term_ratios(scores: Tensor, m: Matmul, weights: Tensor, terms: list, leaves: list) -> tuple[tuple, tuple]:
    """For each product a term added to q·k was read from (`_added_terms`' leaves), the factor that product reaches the
    scores with, over the factor q·k reaches them with: the fit's coefficient of the term x the constant the product
    was multiplied by on its way to the sum x the product's own (its operands' constants), over the fit's s x q·k's
    own. A term that is such a product of the same width as q·k (Transformer-XL's (q + v)·r, DeBERTa's c2p and p2c)
    is a dot product like q·k, scaled as q·k is in every such layer: 1. A log-probability of the layer's own (a
    `GateLeaf`: a sparse gate's log sigmoid, a forget gate's running sum of them) weighs each key by its probability
    at a factor of 1 in every such design: its factor itself, the fit's coefficient x the constant on its way. None
    for a part that is neither (a bias projected from the tokens by a weight: its factor is learned; a product of
    another width; values computed on the way, not moved), which leaves the temperature unjudged. Second, the products
    read as a query's against a table of each token's own (`_position_product`'s "table"), for the caller to confirm
    that no probe input made the table."""
    every: list = []
    fitted = _fit_scale(scores, m.out, weights, tuple(terms), every)
    if fitted is None or len(every) != len(terms) or fitted[0] * m.factor == 0.0:
        return tuple(None for parts in leaves for _ in parts), ()
    qk = fitted[0] * m.factor
    ratios, tables = [], []
    for c, parts in zip(every, leaves):
        for leaf in parts:
            if c is not None and isinstance(leaf, GateLeaf):
                ratios.append(c * leaf.factor)
                continue
            judged = c is not None and leaf is not None and _position_product(leaf[0], m)
            if judged == "table":
                tables.append(leaf[0])
            ratios.append(c * leaf[1] * leaf[0].factor / qk if judged else None)
    return tuple(ratios), tuple(tables)


def _position_product(p: Matmul, m: Matmul) -> bool | str:
    """Whether the product `p` is one of q·k's queries (or keys) with positions: one operand q·k's left one (or its
    right one's rows), up to a factor and a term the same in both batch halves ((q + v) against q·k's (q + u)), the
    other the same in both batch halves (made from the positions alone, no token). Transformer-XL's (q + v)·r,
    DeBERTa's c2p (q against its position keys) and p2c (k against its position queries) are; a bias of each key
    (k·w, one column), a product of the tokens with a weight, or q·k's operands read twice (a typo that reads k for
    r) are not."""
    # the probe's batch of 2 is the products' first axis, batch-major (B*H) or heads-first (H*B: einsum may fold
    # (heads, batch)), the same way for both products of one layer
    for mixed in (False, True):
        for side, other in ((p.a, p.b), (p.b.transpose(-1, -2), p.a.transpose(-1, -2))):
            # positions: a table over distances (more than one column), not one vector per head (a key bias, k·w)
            if other.dim() < 2 or other.shape[-1] < 2:
                continue
            if _same_halves(other, mixed) and any(side.shape == x.shape and _reads(side, x, mixed)
                                                   for x in (m.a, m.b.transpose(-1, -2))):
                return True
            if _per_query_table(side, other, m, mixed):
                return "table"  # made without the tokens? the record cannot tell: the caller's trace confirms
    return False


def _per_query_table(side: Tensor, other: Tensor, m: Matmul, mixed: bool) -> bool:
    """Whether `side` is q·k's queries (or keys) with their batch and token axes swapped, (T, B*H, d), against a table
    of each token's own, (T, d, R): Shaw's relative positions gathered per query (conformer's einsum("b h n d, n r
    d -> b h n r", q, rel_pos_emb[dist]) runs as such a bmm, the tokens its batch). The table has no batch axis, but
    that alone does not make it token-free (one sample's keys expanded, a batch mean): `applied_scales`' caller vouches
    for such a term only where its trace shows the table made from no probe input (`ScaleEstimate.term_tables`)."""
    if side.dim() != 3 or other.dim() != 3 or other.shape[0] != side.shape[0]:
        return False
    back = side.transpose(0, 1)
    return any(back.shape == x.shape and _reads(back, x, mixed) for x in (m.a, m.b.transpose(-1, -2)))


def _halves(x: Tensor, mixed: bool = False) -> tuple[Tensor, Tensor]:
    """x's two batch halves, flattened: its first and second half, or (`mixed`) its first axis's even and odd rows."""
    x = x.detach().double()
    if mixed:
        if x.dim() < 1 or x.shape[0] % 2:
            return x.new_zeros(0), x.new_zeros(0)
        x = x.reshape(x.shape[0] // 2, 2, -1)
        return x[:, 0].reshape(-1), x[:, 1].reshape(-1)
    flat = x.reshape(-1)
    half = flat.numel() // 2
    return flat[:half], flat[half:2 * half]


def _tolerance(x: Tensor) -> float:
    """Rounding of x's dtype at its largest magnitude, times 8: what two equal computations may differ by."""
    return 8 * torch.finfo(x.dtype).eps * float(x.detach().abs().max().double()) if x.is_floating_point() else 0.0


def _same_halves(x: Tensor, mixed: bool = False) -> bool:
    """Whether x is the same in both batch halves (to its dtype's rounding): made without the tokens."""
    a, b = _halves(x, mixed)
    return a.numel() > 0 and float((a - b).abs().max()) <= _tolerance(x)


def _reads(x: Tensor, y: Tensor, mixed: bool = False) -> bool:
    """Whether x = lam * y + c, lam != 0 and c the same in both batch halves: x is y, scaled, with a bias of its own."""
    (x0, x1), (y0, y1) = _halves(x, mixed), _halves(y, mixed)
    if x0.numel() == 0:
        return False
    dx, dy = x0 - x1, y0 - y1
    if float(dy.norm()) == 0.0 or float(dx.norm()) == 0.0:
        return False
    lam = float((dx * dy).sum() / (dy * dy).sum())
    # the rest within 1% of x's differences, or within both dtypes' rounding (bfloat16's q + v, v far larger than q at
    # std-0.02 initialisation, rounds by more than q's differences)
    rest = float((dx - lam * dy).abs().max())
    return lam != 0.0 and (rest <= 1e-2 * float(dx.abs().max()) or rest <= 2 * (_tolerance(x) + abs(lam) * _tolerance(y)))


def _fit_decomposed(scores: Tensor, products: Tensor, between: list) -> tuple[float, float] | None:
    """s in scores = s * products + a(query, key row) + b(query, key column), the Tk keys a grid of rows and columns:
    MViTv2's and SAM's decomposed relative positions add q·R_h[i_h - j_h] and q·R_w[i_w - j_w], each a product with
    the query, to q·k, so no bias is the same in both batch halves and `_fit_scale` finds none. The grid's side is
    the last axis of such a product made between q·k and the softmax, ((.., Tq, k1) for k1 dividing Tk); centred over
    each row and each column of the grid, per query, both terms vanish exactly and q·k's interactions stay. A class
    token ahead of the grid (its row and column carry no such term) is left out. Unmasked scores only; None where no
    such product was made or the fit leaves more than 5% of the scores."""
    t_q, t_k = scores.shape[-2:] if scores.dim() >= 2 else (0, 0)
    if t_k < 4 or products.numel() != scores.numel() or not bool(torch.isfinite(scores).all()):
        return None
    batch = scores.numel() // (t_q * t_k)  # batch x heads
    products = products.reshape(scores.shape)
    for lead in (0, 1):  # a class token first, off the grid (MViTv2's `_cls` models): its row and column left out
        rows, keys = batch * (t_q - lead), t_k - lead
        sides = {e.out.shape[-1] for e in between if isinstance(e, Matmul) and e.out.dim() >= 2 and
                 1 < e.out.shape[-1] < keys and keys % e.out.shape[-1] == 0 and e.out.numel() == rows * e.out.shape[-1]}
        for side in sorted(sides):
            for grid in {(side, keys // side), (keys // side, side)}:
                def centred(x: Tensor) -> Tensor:
                    x = x.detach()[..., lead:, lead:].double().reshape(rows, *grid)
                    return x - x.mean(-1, keepdim=True) - x.mean(-2, keepdim=True) + x.mean((-2, -1), keepdim=True)
                sc, pc = centred(scores), centred(products)
                denom = float((pc * pc).sum())
                if denom == 0.0:
                    continue
                scale = float((sc * pc).sum()) / denom
                residual = float((sc - scale * pc).norm() / sc.norm().clamp_min(1e-300))
                if residual <= 0.05:
                    return scale, residual
    return None


def _fit_per_head(scores: Tensor, products: Tensor, weights: Tensor) -> list[tuple[float, float]]:
    """`_fit_scale` per head, when one factor does not fit them all: (B*H, Tq, Tk) products (batch first, as bmm sees
    the heads) against scores of as many elements. [] unless every head fits."""
    if products.dim() != 3 or products.shape[0] % 2 or products.shape[0] < 4:
        return []
    n = products.shape[0] // 2  # heads: the probe's batch is 2
    per = lambda t: t.detach().reshape(2, n, -1, products.shape[-1])  # noqa: E731  (batch, head, Tq, Tk)
    s, p, w = per(scores), per(products), per(weights)
    fits = [_fit_scale(s[:, h], p[:, h], w[:, h]) for h in range(n)]
    return fits if all(f is not None for f in fits) else []


def _fit_mixed_heads(scores: Tensor, products: Tensor, weights: Tensor, mix: Tensor) -> tuple[float, float] | None:
    """Talking-heads attention (Shazeer et al. 2020) mixes the heads' q·k across heads before the softmax by a (H, H)
    matrix of its own (`mix`, seen as a product's operand): head k's scores are sum_h M[k, h] (q·k)_h + bias, with
    M = s * mix (or its transpose). M fitted by least squares on the differences between the batch halves (the bias
    cancels) over the entries every head gives weight in both halves, then s: the factor q·k is multiplied by apart
    from the layer's learned mix. (s, relative residual), None unless M fits (<= 0.05, as `_fit_scale`) and is s times
    the mix (<= 0.05 again)."""
    n = mix.shape[0]
    if products.dim() != 3 or products.shape[0] != 2 * n or n < 2:  # (B * H, Tq, Tk), the probe's batch of 2
        return None
    per = lambda t: t.detach().double().reshape(2, n, -1)  # noqa: E731  (batch, head, Tq * Tk)
    s, p, w = per(scores), per(products), per(weights)
    ds, dp = s[0] - s[1], p[0] - p[1]  # (H, N)
    ok = torch.isfinite(ds).all(0) & torch.isfinite(dp).all(0) & (w > 0).all(0).all(0)  # (N,) used by every head
    if int(ok.sum()) < 4 * n:
        return None
    X, Y = dp[:, ok].T, ds[:, ok].T  # (N, H) every head's q·k differences, (N, H) each head's score differences
    M = torch.linalg.lstsq(X, Y).solution.T  # (H, H): head k's scores = M[k] @ the heads' q·k
    residual = float((Y - X @ M.T).norm() / Y.norm().clamp_min(1e-300))
    if residual > 0.05:
        return None
    for P in (mix.detach().double().T, mix.detach().double()):
        factor = float((M * P).sum() / (P * P).sum().clamp_min(1e-300))
        if float((M - factor * P).norm() / M.norm().clamp_min(1e-300)) <= 0.05:
            return factor, residual
    return None


def _fit_beside(scores: Tensor, products: Tensor, weights: Tensor) -> tuple[float, float] | None:
    """`_fit_scale` of (..., Tq, Tk + n) scores whose first or last Tk columns a (..., Tq, Tk) product fills: the layer's
    own n logits (attention sinks) stand beside the products."""
    for cut in _columns(scores, products):
        fitted = _fit_scale(scores[..., cut], products, weights[..., cut])
        if fitted is not None:
            return fitted
    return None


def _columns(scores: Tensor, products: Tensor) -> list[slice]:
    """The columns of the scores a product of (..., Tq, Tk) fills: all of them where they have as many elements, else
    the first and the last Tk of (..., Tq, Tk + n) scores (the layer's own n logits, attention sinks, beside them)."""
    if products.numel() == scores.numel():
        return [slice(None)]
    if scores.dim() < 2 or products.dim() < 2 or scores.shape[-2] != products.shape[-2]:
        return []
    t_k, wide = products.shape[-1], scores.shape[-1]
    if not t_k < wide or scores.numel() // wide != products.numel() // t_k:
        return []
    return [slice(0, t_k), slice(wide - t_k, wide)]


def _mixes_heads(e) -> bool:
    """A product whose second operand is one (H, H) matrix, as einsum("bhij,hk->bkij") runs it ((1, H, H)): the
    heads mixed by a matrix of the layer's (talking heads, re-attention)."""
    return isinstance(e, Matmul) and e.b.dim() >= 2 and e.b.shape[-1] == e.b.shape[-2] >= 2 \
        and e.b.numel() == e.b.shape[-1] ** 2


def _weights_used(later: list, weights: Tensor) -> tuple[Tensor, Matmul] | None:
    """The operand of the first later matmul that multiplies (Tq, Tk) weights like these by the values, and
    that matmul, when the operand is not the softmax output itself (a second softmax, a renormalisation). None
    also where the heads are mixed by a matrix of the layer's on the way (talking heads after the softmax, DeepViT's
    re-attention): the weights are then a design of their own, and the softmax's temperature is what is judged."""
    for m in later:
        if _mixes_heads(m):
            return None
        # the weights laid out as the softmax left them, (.., Tq, Tk): not a tensor of as many elements that the
        # layer multiplies after the softmax for another reason (the values' projection, its input flattened to
        # (B*T, D), computed after the softmax where it is an argument beside it, and D = T)
        if isinstance(m, Matmul) and _transposed_weights(m.b, weights):
            return None  # values first, v @ w^T (a channels-first layer's: EfficientViT's): the softmax's output
        if isinstance(m, Matmul) and m.a.numel() == weights.numel() and m.a.shape[-2:] == weights.shape[-2:]:
            used = m.a.reshape(weights.shape)
            same = torch.equal(used, weights.to(used.dtype))
            return None if same else (used, m)
    return None


def _transposed_weights(operand: Tensor, weights: Tensor) -> bool:
    """Whether a product's second operand is the softmax's (.., Tq, Tk) weights transposed, (.., Tk, Tq): the values
    multiplied from the left. Told by the numbers, not the sizes: where a head's width is the number of tokens (16
    channels on a 4 x 4 map), the values (.., d, Tk) have the weights' very shape, and were read as a second
    softmax's weights."""
    if operand.numel() != weights.numel() or operand.dim() < 2 or operand.shape[-2:] != weights.shape[-2:][::-1]:
        return False
    return torch.equal(operand.transpose(-2, -1).reshape(weights.shape), weights.to(operand.dtype))


def _fit_log_weights(used: Tensor, products: Tensor) -> tuple[float, float] | None:
    """s in log w = s * (q·k) + c_row + bias, fitted on the differences between the two batch halves (the
    content-independent bias cancels) centred per row (the row's normaliser cancels), over entries with
    weight in both halves. A dropout mask leaves it unchanged; a second softmax flattens it."""
    w, p = used.detach().double(), products.detach().double().reshape(used.shape)
    half = w.shape[0] // 2
    if half == 0 or w.shape[0] % 2 or w.numel() > 4 * _FIT_SAMPLES * 16:
        return None
    ok = (w[:half] > 0) & (w[half:] > 0) & torch.isfinite(w[:half]) & torch.isfinite(w[half:])
    dl = torch.where(ok, w[:half].clamp_min(1e-300).log() - w[half:].clamp_min(1e-300).log(), 0.0)
    dp = torch.where(ok, p[:half] - p[half:], 0.0)
    n = ok.sum(-1, keepdim=True).clamp_min(1)
    dl = torch.where(ok, dl - dl.sum(-1, keepdim=True) / n, 0.0)
    dp = torch.where(ok, dp - dp.sum(-1, keepdim=True) / n, 0.0)
    denom = float((dp * dp).sum())
    if int(ok.sum()) < 4 or denom == 0.0:
        return None
    scale = float((dl * dp).sum()) / denom
    residual = float((dl - scale * dp).norm() / dl.norm().clamp_min(1e-300))
    return scale, residual


LOG_WEIGHTS_CONTROL = 0.02
"""How close the log-weights fit of the softmax's own output must come to the factor its input shows (relative) for
the same fit of the weights that multiply the values to be read: where q·k is tiny beside the weights' rounding (one
head of width 1 at GPT-2's init: q·k ~ 1e-8, float32 weights 0.5 to the last bit) the fit reads 0 or noise (a dropout
left on read "flat, every weight equal", a masked diagonal "1.44x too sharp"), and the weights show no temperature."""


def _log_weights_read(weights: Tensor, products: Tensor, factor: float) -> bool:
    """Whether the log-weights fit can read a temperature at all on these products: its control, the softmax's own
    output, gives back the factor its input was fitted with, within LOG_WEIGHTS_CONTROL."""
    control = _fit_log_weights(weights, products)
    return control is not None and abs(control[0] - factor) <= LOG_WEIGHTS_CONTROL * abs(factor)


_FIT_SAMPLES = 1 << 16


def _fit_scale(scores: Tensor, products: Tensor, weights: Tensor, terms: tuple = (),
               every: list | None = None) -> tuple[float, float] | None:
    """Least-squares s in scores = s * products + bias, where bias is the same in both batch halves; with `terms`
    (tensors added to the products on their way, as many elements as the scores), s in scores = s * products +
    sum_j t_j * terms_j + bias, each t_j free: the factor of the products alone.
    Only entries the softmax gave weight in both halves count: masked ones (-inf, or a large negative fill
    such as float16's -65504, where the logits are pure rounding) say nothing about the scale. Where the products'
    halves are equal (a batch of copies: classifier-free guidance's [unconditioned, conditioned] parts of the same
    latents, PAG's), its first axis's even and odd rows are the pairs instead."""
    fitted = _fit_scale_paired(scores, products, weights, terms, every, rows=0)
    if fitted is None and _copies(products) and all(t.numel() == products.numel() for t in (scores, weights, *terms)):
        # each tensor read as the products' rows, the same elements in order: with a (B x H, T, T) product the pairs
        # are heads of one sequence, so a bias of each head's own (ALiBi) leaves the fit residual, and nothing read
        fitted = _fit_scale_paired(scores, products, weights, terms, every, rows=products.shape[0])
    return fitted


def _copies(x: Tensor) -> bool:
    """Whether x's batch halves are equal and its first axis pairs rows otherwise (`_fit_scale`'s other pairing)."""
    return x.dim() >= 1 and x.shape[0] >= 4 and x.shape[0] % 2 == 0 and torch.equal(
        *x.detach().reshape(2, -1))


def _paired(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """x's batch pairs, flattened: its first and second half, or (`rows`, even) x read as that many rows, the even
    ones and the odd ones."""
    x = x.detach()
    if rows:
        x = x.reshape(rows // 2, 2, -1)
        return x[:, 0].reshape(-1), x[:, 1].reshape(-1)
    flat = x.reshape(-1)
    half = flat.numel() // 2
    return flat[:half], flat[half:2 * half]


def _fit_scale_paired(scores: Tensor, products: Tensor, weights: Tensor, terms: tuple, every: list | None,
                      rows: int) -> tuple[float, float] | None:
    half = scores.numel() // 2
    if half == 0 or scores.numel() % 2:
        return None
    step = max(1, half // _FIT_SAMPLES)  # a strided sample is plenty for one number, and keeps T=1024 cheap
    (s0, s1), (p0, p1), (w0, w1), (f0, f1), *tt = (_paired(x, rows) for x in (scores, products, weights,
                                                                              _filled_rows(scores), *terms))
    ds, dp, *dt = (a[::step].double() - b[::step].double() for a, b in ((s0, s1), (p0, p1), *tt))
    ok = torch.isfinite(ds) & torch.isfinite(dp) & (w0[::step] > 0) & (w1[::step] > 0) & ~f0[::step] & ~f1[::step]
    for d in dt:
        ok &= torch.isfinite(d)
    fitted = _least_squares(ds[ok], [dp[ok]] + [d[ok] for d in dt], every)
    if fitted is None or fitted[1] > 0.05:  # a shift of each row (scores - their max, which the softmax ignores)
        return _fit_scale_rows(scores, products, weights, terms, every, rows=rows)
    return fitted


def _filled_rows(scores: Tensor) -> Tensor:
    """Each entry of a row of `scores` (over its last axis) that is one number throughout, where other rows are not:
    a query whose every key the layer blocks with a finite fill (local-attention's `-finfo.max` over a window the
    padding covers wholly), whose softmax then spreads weight evenly over scores that say nothing of the scale; a
    fit that read them found q·k multiplied by 0. All False where every row is one number (a layer that multiplies
    q·k by 0: that is the finding)."""
    x = scores.detach()
    flat = (x == x.amax(-1, keepdim=True)).all(-1, keepdim=True).expand_as(x)
    return flat if not bool(flat.all()) else torch.zeros_like(flat)


def _least_squares(y: Tensor, xs: list[Tensor], every: list | None = None) -> tuple[float, float] | None:
    """(the coefficient of xs[0], the relative residual) of y = sum_j c_j * xs[j] by least squares; a column that is
    zero (a term the same in both batch halves, which the bias already holds) is left out. None where xs[0] is zero
    or fewer than 2 entries count. `every`: filled with each c_j of xs[1:] (None for a column left out)."""
    n, kept = len(xs) - 1, [0] + [j for j, x in enumerate(xs) if j and bool(x.any())]
    xs = [xs[j] for j in kept]
    if y.numel() < 2 or float((xs[0] * xs[0]).sum()) == 0.0:
        return None
    if len(xs) == 1:
        scale = float((y * xs[0]).sum()) / float((xs[0] * xs[0]).sum())
        fit, coef = scale * xs[0], [scale]
    else:
        X = torch.stack(xs, -1)  # (n, 1 + terms)
        solution = torch.linalg.lstsq(X, y[:, None]).solution[:, 0]
        scale, fit, coef = float(solution[0]), X @ solution, solution.tolist()
    if every is not None:
        at = dict(zip(kept, coef))
        every[:] = [at.get(j) for j in range(1, n + 1)]
    return scale, float((y - fit).norm() / y.norm().clamp_min(1e-300))


def _fit_scale_rows(scores: Tensor, products: Tensor, weights: Tensor, terms: tuple = (),
                    every: list | None = None, rows: int = 0) -> tuple[float, float] | None:
    """`_fit_scale` with a bias of each row's own as well: the differences between the batch halves (`rows`: the
    products' even and odd rows, `_paired`) centred per row over the entries with weight in both (a stable softmax's
    `scores - scores.amax(-1)` shifts each row)."""
    t_k = scores.shape[-1] if scores.dim() else 0
    if t_k < 2 or products.numel() != scores.numel():
        return None
    half = scores.numel() // t_k // 2
    if half == 0 or (scores.numel() // t_k) % 2 or rows and (scores.numel() // rows) % t_k:
        return None
    step = max(1, half * t_k // _FIT_SAMPLES)  # a sample of rows
    (s0, s1), (p0, p1), (w0, w1), (f0, f1), *tt = (
        (a.reshape(-1, t_k), b.reshape(-1, t_k)) for a, b in
        (_paired(x, rows) for x in (scores, products, weights, _filled_rows(scores), *terms)))
    ds, dp, *dt = (a[::step].double() - b[::step].double() for a, b in ((s0, s1), (p0, p1), *tt))
    ok = torch.isfinite(ds) & torch.isfinite(dp) & (w0[::step] > 0) & (w1[::step] > 0) & ~f0[::step] & ~f1[::step]
    for d in dt:
        ok &= torch.isfinite(d)
    n = ok.sum(-1, keepdim=True).clamp_min(1)
    ds, dp, *dt = (torch.where(ok, x - torch.where(ok, x, 0.0).sum(-1, keepdim=True) / n, 0.0) for x in (ds, dp, *dt))
    if int(ok.sum()) < 4:
        return None
    fitted = _least_squares(ds.reshape(-1), [dp.reshape(-1)] + [d.reshape(-1) for d in dt], every)
    return fitted if fitted is not None and fitted[1] <= 0.05 else None


@dataclass(frozen=True)
class LearnedKeys:
    """Keys a layer adds of its own to every sequence, which no input reaches: memory key/value slots, attention
    sinks (a learned logit column that takes weight and brings no value), a bias_kv or zero key. Seen as more keys
    at the softmax (or a fused call) than the input has. With `keys` 0 (`weighted_sum`): the plain weighted sum of the
    values, the softmax (or fused call) and the product that makes it."""

    keys: int  # keys beyond the input's Tk
    values: int  # of those, how many bring a value of their own (a sink brings none)
    softmax: SoftmaxCall | None = field(default=None, compare=False, repr=False)
    fused: FusedAttention | None = field(default=None, compare=False, repr=False)
    product: Matmul | None = field(default=None, compare=False, repr=False)  # weights · values, when seen
    weights_operand: int = 0  # which operand of `product` holds the weights: 0 (a, summed over its last axis), 1 (b)

    def describe(self) -> str:
        sinks = self.keys - self.values
        parts = ([f"{self.values} learned key/value slot{'s' if self.values != 1 else ''}"] if self.values else []) + \
                ([f"{sinks} attention sink{'s' if sinks != 1 else ''} (a learned logit that takes weight and brings no "
                  f"value)"] if sinks else [])
        return " and ".join(parts)


def learned_keys(record: Record, t_q: int, t_k: int) -> LearnedKeys | None:
    """The layer's own keys beyond the input's `t_k`, read from its last softmax over (Tq, Tk + n) scores and the
    product that sums its weights with the values (or from a fused call's keys); None when it adds none."""
    return _last_weighted_sum(record, t_q, t_k, 1)


def weighted_sum(record: Record, t_q: int, t_k: int) -> LearnedKeys | None:
    """The layer's last weighted sum of its values over (Tq, Tk + n) weights, n >= 0 keys of its own: the softmax and
    the product that sums its weights with the values, or a fused call; None when neither was observed."""
    return _last_weighted_sum(record, t_q, t_k, 0)


def _last_weighted_sum(record: Record, t_q: int, t_k: int, least: int) -> LearnedKeys | None:
    """The last softmax over (Tq, Tk + n) scores with n >= `least` and the product that sums its weights with the
    values, else the last fused call with as many keys."""
    for i in reversed(range(len(record.order))):
        sm = record.order[i]
        if isinstance(sm, SoftmaxCall) and sm.output.dim() >= 2 and sm.output.shape[-2] == t_q \
                and sm.output.shape[-1] >= t_k + least:
            n = sm.output.shape[-1] - t_k
            product, operand = _values_product(record.order[i + 1:], sm.output, t_q, t_k, n)
            if product is None:
                return LearnedKeys(n, n, softmax=sm)
            width = (product.a.shape[-1] if operand == 0 else product.b.shape[-2]) - t_k
            return LearnedKeys(n, max(0, min(n, width)), softmax=sm, product=product, weights_operand=operand)
    for f in reversed(record.fused):
        if f.q.shape[-2] == t_q and f.k.shape[-2] >= t_k + least:
            return LearnedKeys(f.k.shape[-2] - t_k, f.k.shape[-2] - t_k, fused=f)
    return None


def branch_sums(record: Record) -> list[tuple[SoftmaxCall, Matmul, int]]:
    """Every weighted sum the record shows, over keys of any count and layout: (a softmax over its last axis, the first
    later product that sums its very numbers over that axis, which operand holds them: 0 (a, contracted over its last
    axis) or 1 (b, over its second last)). Native sparse attention's three branches (compressed blocks (.., Tq, 9),
    selected blocks (B*H*Tq, 1, 8), local windows (B*H, W, w, 3w)) are three; a softmax no product reads as it is (a
    block selection's scores, weights changed after it) is none."""
    found = []
    for i, sm in enumerate(record.order):
        if not isinstance(sm, SoftmaxCall) or sm.dim not in (-1, sm.output.dim() - 1) or sm.output.dim() < 2:
            continue
        n = sm.output.shape[-1]
        for m in record.order[i + 1:]:
            if not isinstance(m, Matmul):
                continue
            held = next((operand for operand, (x, contracted) in enumerate(((m.a, -1), (m.b, -2)))
                         if x.dim() >= 2 and x.shape[contracted] == n and x.numel() == sm.output.numel()
                         and _same_values(x if operand == 0 else x.transpose(-2, -1), sm.output)), None)
            if held is not None:
                found.append((sm, m, held))
                break
    return found


def pooled_keys(record: Record, t_q: int, t_k: int, batch: int, heads: int) -> tuple[Tensor, int, int, str] | None:
    """(weights, queries, keys, source) of attention over m < Tk keys the layer makes of its own from the tokens (a
    spatial reduction: PVT's and Twins' keys and values from a strided convolution or a pooling of the map), its
    queries the Tq tokens or, pooled too, n < Tq of its own (CPUBone's and LowFormer's attention among the pixels of a
    strided convolution of the map, upsampled back): the last softmax over (n, m) scores whose weights a later product
    sums with m values (a router's softmax over experts has no such product), else the last fused call with n queries
    and m keys. None when neither was observed. A softmax over the queries of those scores (the wrong axis) is read
    too: its rows over the keys then do not sum to 1, the bug `weight_row_sums` names; left unread, it was inconclusive
    (SegFormer's, injected). Pooled queries only as (batch, heads, n, m), the layer's own head count, one set per
    sequence: windows and buckets of the tokens also make fewer queries and keys per softmax row, laid out with a
    windows axis (Swin's (B * windows, H, w, w), local attention's buckets (B, buckets, w, 2w)); they are read
    elsewhere, as the windows they are."""
    for i in reversed(range(len(record.order))):
        sm = record.order[i]
        if isinstance(sm, SoftmaxCall) and sm.dim in (-1, -2, sm.output.dim() - 1, sm.output.dim() - 2) \
                and pooled_shape(sm.output.shape, t_q, t_k, batch, heads):  # at least 3-D: pooled_shape asks
            n, m = sm.output.shape[-2:]
            product, _ = _values_product(record.order[i + 1:], sm.output, n, m, 0, held=True)
            if product is not None:
                return sm.output, n, m, f"observed softmax output (dim={sm.dim})"
    for f in reversed(record.fused):
        if pooled_shape(f.q.shape[:-1] + f.k.shape[-2:-1], t_q, t_k, batch, heads):
            n, m = f.q.shape[-2], f.k.shape[-2]
            return fused_weights(f), n, m, "weights of the observed fused attention call (recomputed from its inputs)"
    return None


def pooled_shape(shape, t_q: int, t_k: int, batch: int, heads: int) -> bool:
    """Whether weights of this shape, (.., n, m), are over m < Tk keys pooled from the tokens, for the Tq queries or,
    laid out (batch, heads, n, m), n < Tq pooled too (`pooled_keys`)."""
    n, m = shape[-2:]
    return len(shape) >= 3 and 1 < m < t_k and (n == t_q or (1 < n < t_q and tuple(shape[:2]) == (batch, heads)
                                                              and len(shape) == 4))


def _values_product(later: list, weights: Tensor, t_q: int, t_k: int, n: int, *,
                    held: bool = False) -> tuple[Matmul | None, int]:
    """The first later product that sums (Tq, Tk + m) weights, m <= n, with values: (it, the weights' operand).
    `held`: only one whose operand holds the weights' own values (moved or laid out anew, not made anew): a product of
    the same shape that reads another tensor is not theirs (a linear attention's q feature map times its context,
    beside k's softmax over the tokens, which `pooled_keys` took for weights over the features)."""
    rows = weights.numel() // weights.shape[-1]  # every (batch, head, query)
    for m in later:
        if not isinstance(m, Matmul):
            continue
        for operand, (x, contracted, query_axis) in enumerate(((m.a, -1, -2), (m.b, -2, -1))):
            if x.dim() >= 2 and x.shape[query_axis] == t_q and t_k <= x.shape[contracted] <= t_k + n \
                    and x.numel() // x.shape[contracted] == rows and (not held or _same_values(x, weights)):
                return m, operand
    return None, 0


def _same_values(x: Tensor, weights: Tensor) -> bool:
    """Whether `x` holds the values of `weights`, in any order (a transpose, a reshape, a copy in another dtype)."""
    if x.numel() != weights.numel():
        return False
    a, b = (t.detach().float().reshape(-1).sort().values for t in (x, weights))
    return bool(torch.allclose(a, b, rtol=1e-2, atol=1e-3 * float(b.abs().max().clamp_min(1e-30))))


def per_query_head(x: Tensor, q: Tensor) -> Tensor:
    """Keys or values of an observed fused call with one head per query head: grouped ones (sdpa's enable_gqa, H_kv
    heads for H) each repeated for the H / H_kv consecutive query heads it serves; as they are otherwise."""
    if x.dim() == 4 and q.dim() == 4 and x.shape[-3] != q.shape[-3] and x.shape[-3] and \
            q.shape[-3] % x.shape[-3] == 0:
        return x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3)
    return x


def fused_weights(f) -> Tensor:
    """softmax(q k^T * scale + mask) of an observed fused call, in float64: (B, H, Tq, Tk)."""
    q, k = f.q.double(), f.k.double()
    k = per_query_head(k, q)  # grouped-query: each key head serves several query heads
    # the kernel's own scale: q and k as given already carry what they were multiplied by (f.scale counts it too)
    scores = q @ k.transpose(-2, -1) * (f.scale if f.given is None else f.given)  # (B, H, Tq, Tk)
    if f.attn_mask is not None:
        m = f.attn_mask
        scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m.double()
    if f.is_causal:
        t_q, t_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(1), -math.inf)
    return scores.softmax(-1).nan_to_num(0.0)  # a row with no key: zeros, as torch's kernels give


def summed_and_scores(record: Record, call) -> tuple:
    """(the size its q·k product summed over, or None where no product is found; its scores' shape) of an observed
    softmax (the last product before it with as many numbers as its scores) or fused call (its q's last axis)."""
    if isinstance(call, FusedAttention):
        return int(call.q.shape[-1]), tuple(call.q.shape[:-1]) + (int(call.k.shape[-2]),)
    i = next((j for j, o in enumerate(record.order) if o is call), None)
    if not isinstance(call, SoftmaxCall) or i is None:
        return None, ()
    product = next((m for m in reversed(record.order[:i]) if isinstance(m, Matmul)
                    and m.out.numel() == call.input.numel() and m.a.dim() >= 2), None)
    return (None if product is None else int(product.a.shape[-1])), tuple(call.output.shape)


def not_over_tokens(record: Record, t_q: int, t_k: int, *, summed: bool = False) -> str:
    """Why the attention the record shows is not over the tokens ('' where it is, or where nothing was seen): every
    softmax's scores have neither the queries' nor the keys' count in their last two axes (its (.., Tq, Tk), as `orient`
    lays them out), and every fused call's q and k none as their token axis (-2). DaViT's channel attention,
    softmax((q^T k) / sqrt(N)) over (B, H, d, d), attends between the channels of a head, which the checks of a token
    attention (identical tokens out unchanged, the recompute from the projections) do not describe. Only those axes:
    DaViT's third stage at 64 px has as many heads as tokens (16), and read over every axis past the batch it was judged
    as token attention and failed. A softmax over a wrong axis of (Tq, Tk) scores (queries, heads) keeps those axes:
    judged. `summed`: only where every q·k product before them sums over an axis of the tokens' count too and its scores
    are square past a batch axis (q^T k, (d, T) x (T, d): a head's channels by its channels, channel attention's own
    form; (B, B) scores of (B, T) rows attend across the batch), which no token attention's are (a bucketed one's
    (buckets, look-around) scores over a head of the tokens' width are not square)."""
    if not (record.softmaxes or record.fused) or record.flex:
        return ""
    tokens = {t_q, t_k}
    shapes = [tuple(sm.output.shape) for sm in record.softmaxes] + [tuple(f.q.shape[-2:-1]) + tuple(f.k.shape[-2:-1])
                                                                    for f in record.fused]
    if any(tokens & set(shape[-2:]) for shape in shapes):
        return ""
    if summed and any(summed_and_scores(record, c)[0] != t_k or len(set(shape[-2:])) != 1 or len(shape) < 3
                      for c, shape in zip((*record.softmaxes, *record.fused), shapes)):
        return ""
    seen = ", ".join(sorted({str(s) for s in shapes})[:3])
    return (f"the layer's softmax runs over scores of shape {seen}, none of whose axes past the batch is the {t_q} "
            f"queries or the {t_k} keys: it attends over something else than the tokens (channels, as DaViT's "
            f"channel attention does), which this check of token attention does not describe")
