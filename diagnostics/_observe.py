"""Look inside a layer without touching its code: a TorchDispatchMode records the softmax inputs and
outputs, the matmuls, fused SDPA calls and multiplications by constants, at the aten level, so it sees
the same operations whether the layer calls `torch.matmul`, `@`, `torch.bmm`, `torch.baddbmm`, `einsum`,
`F.softmax`, `Tensor.softmax` or `F.scaled_dot_product_attention`, and inside composite functions such as
`F.multi_head_attention_forward`.

From that record, `applied_scales()` estimates the factor the layer really multiplies q·k by before the
softmax. The estimate uses differences between the two halves of the probe batch, so any additive term
that does not depend on the content (masks, ALiBi and relative-position biases) cancels out.
"""

from __future__ import annotations

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
)
_SCALE_BY = _ops("mul.Tensor", "mul.Scalar", "mul_.Tensor", "mul_.Scalar")
_DIVIDE_BY = _ops("div.Tensor", "div.Scalar", "div_.Tensor", "div_.Scalar")
# matmul itself only where it is not decomposed before a dispatch mode sees it: inside flex_attention's eager
# implementation, which runs below autograd
_MATMULS = _ops("bmm.default", "mm.default", "matmul.default")
_SOFTMAX = _ops("_softmax.default", "_safe_softmax.default")


RECORD_SITES = True
"""Record where in the user's code each observed op ran (a few frame hops per softmax, matmul, fused call or
scaling; the text of the line is read only when a finding is shown). benchmarks/audit_cost.py --no-sites
turns it off to measure what it costs."""

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
    input: Tensor
    output: Tensor
    dim: int
    frames: tuple = ()  # user_frames() where it ran


@dataclass
class Matmul:
    out: Tensor
    a: Tensor
    b: Tensor
    factor: float  # alpha of baddbmm, times the constants a and b were multiplied by
    frames: tuple = ()


@dataclass
class FusedAttention:
    q: Tensor
    k: Tensor
    v: Tensor
    scale: float  # the scale the kernel applies, times the constants q and k were multiplied by
    attn_mask: Tensor | None
    is_causal: bool
    frames: tuple = ()


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
class Record:
    """What one forward pass did, in order."""

    softmaxes: list[SoftmaxCall] = field(default_factory=list)
    matmuls: list[Matmul] = field(default_factory=list)
    fused: list[FusedAttention] = field(default_factory=list)
    flex: list[FlexCall] = field(default_factory=list)
    order: list[object] = field(default_factory=list)


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
        self._keep: list[Tensor] = []  # keeps storages alive so that their addresses are not reused
        self._flex_compile: list = []  # the eager flex_attention's switches as each entry found them

    def _factor(self, t) -> float:
        return self._factors.get(_key(t), 1.0) if isinstance(t, Tensor) else 1.0

    def _set_factor(self, t, factor: float) -> None:
        if isinstance(t, Tensor) and factor != 1.0:
            self._factors[_key(t)] = factor
            self._keep.append(t)

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
        name = str(func)
        try:
            self._note(func, name, packet, args, kwargs, out)
        except Exception:  # observing must never break the layer under audit
            pass
        return out

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
        if func in _CARRY and isinstance(args[0], Tensor):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o in outs:
                self._set_factor(o, self._factor(args[0]))
        elif func in _SCALE_BY or func in _DIVIDE_BY:
            a, b = args[0], args[1]
            c_b, c_a = _constant(b), _constant(a) if isinstance(a, Tensor) and a.numel() == 1 else None
            if c_b is not None and isinstance(a, Tensor) and a.numel() > 1:
                c = c_b if func in _SCALE_BY else (1.0 / c_b if c_b else math.inf)
                self._set_factor(out, self._factor(a) * c)
                self._scaled(func, c, a)
            elif c_a is not None and func in _SCALE_BY and isinstance(b, Tensor):
                self._set_factor(out, self._factor(b) * c_a)
                self._scaled(func, c_a, b)
        elif func is aten.copy_.default:
            self._set_factor(args[0], self._factor(args[1]))
        elif func in _MATMULS:
            a, b = args[0], args[1]
            # a copy: a layer may scale the scores in place afterwards (Falcon's `scores /= sqrt(d)`)
            m = Matmul(out.detach().clone(), a.detach(), b.detach(), self._factor(a) * self._factor(b), self._frames())
            rec.matmuls.append(m)
            rec.order.append(m)
        elif func is aten.baddbmm.default:
            a, b = args[1], args[2]
            alpha = float(kwargs.get("alpha", args[4] if len(args) > 4 else 1.0))
            m = Matmul(out.detach().clone(), a.detach(), b.detach(), alpha * self._factor(a) * self._factor(b),
                       self._frames())
            rec.matmuls.append(m)
            rec.order.append(m)
        elif func in _SOFTMAX:
            s = SoftmaxCall(args[0].detach(), out.detach(), int(args[1]), self._frames())
            rec.softmaxes.append(s)
            rec.order.append(s)
        elif "scaled_dot_product" in name and "backward" not in name:
            q, k, v = args[0], args[1], args[2]
            scale = kwargs.get("scale")
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
            mask = kwargs.get("attn_mask")
            if mask is None:
                mask = next((a for a in args[3:] if isinstance(a, Tensor)), None)
            is_causal = bool(kwargs.get("is_causal", next((a for a in args[3:] if isinstance(a, bool)), False)))
            f = FusedAttention(q.detach(), k.detach(), v.detach(), scale * self._factor(q) * self._factor(k),
                               None if mask is None else mask.detach(), is_causal, self._frames())
            rec.fused.append(f)
            rec.order.append(f)


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


def applied_scales(record: Record) -> list[ScaleEstimate]:
    """One estimate per softmax that normalises a matmul's output, and one per fused attention call."""
    estimates = [ScaleEstimate(f.scale, int(f.q.shape[-1]), "fused scaled_dot_product_attention", 0.0, fused=f)
                 for f in record.fused]
    for i, event in enumerate(record.order):
        if not isinstance(event, SoftmaxCall):
            continue
        earlier = [m for m in record.order[:i] if isinstance(m, Matmul) and m.out.numel() == event.input.numel()]
        for m in reversed(earlier):
            fitted = _fit_scale(event.input, m.out, event.output)
            if fitted is not None:
                s, residual = fitted
                estimates.append(ScaleEstimate(s * m.factor, int(m.a.shape[-1]), "softmax input vs q·k matmul",
                                               residual, matmul=m, softmax=event))
                found = _weights_used(record.order[i + 1:], event.output)
                if found is not None:  # something happened to the weights between the softmax and the values
                    used, by = found
                    again = _fit_log_weights(used, m.out)
                    if again is not None:
                        estimates.append(ScaleEstimate(again[0] * m.factor, int(m.a.shape[-1]),
                                                       "log of the weights that multiply the values vs q·k",
                                                       again[1], matmul=m, softmax=event, used_by=by))
                break
    return estimates


def _weights_used(later: list, weights: Tensor) -> tuple[Tensor, Matmul] | None:
    """The operand of the first later matmul that multiplies (Tq, Tk) weights like these by the values, and
    that matmul, when the operand is not the softmax output itself (a second softmax, a renormalisation)."""
    for m in later:
        if isinstance(m, Matmul) and m.a.numel() == weights.numel() and m.a.shape[-1] == weights.shape[-1]:
            used = m.a.reshape(weights.shape)
            same = torch.equal(used, weights.to(used.dtype))
            return None if same else (used, m)
    return None


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


_FIT_SAMPLES = 1 << 16


def _fit_scale(scores: Tensor, products: Tensor, weights: Tensor) -> tuple[float, float] | None:
    """Least-squares s in scores = s * products + bias, where bias is the same in both batch halves.
    Only entries the softmax gave weight in both halves count: masked ones (-inf, or a large negative fill
    such as float16's -65504, where the logits are pure rounding) say nothing about the scale."""
    s, p, w = scores.detach().reshape(-1), products.detach().reshape(-1), weights.detach().reshape(-1)
    half = s.numel() // 2
    if half == 0 or s.numel() % 2:
        return None
    step = max(1, half // _FIT_SAMPLES)  # a strided sample is plenty for one number, and keeps T=1024 cheap
    s0, s1, p0, p1 = (x.double() for x in (s[:half:step], s[half::step], p[:half:step], p[half::step]))
    ds, dp = s0 - s1, p0 - p1
    ok = torch.isfinite(ds) & torch.isfinite(dp) & (w[:half:step] > 0) & (w[half::step] > 0)
    ds, dp = ds[ok], dp[ok]
    denom = float((dp * dp).sum())
    if ds.numel() < 2 or denom == 0.0:
        return None
    scale = float((ds * dp).sum()) / denom
    residual = float((ds - scale * dp).norm() / ds.norm().clamp_min(1e-300))
    if residual > 0.05:  # not the matmul that produced these logits
        return None
    return scale, residual


def fused_weights(f) -> Tensor:
    """softmax(q k^T * scale + mask) of an observed fused call, in float64: (B, H, Tq, Tk)."""
    q, k = f.q.double(), f.k.double()
    if k.shape[-3] != q.shape[-3] and k.dim() == 4:  # grouped-query: each key head serves several query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1) * f.scale  # (B, H, Tq, Tk)
    if f.attn_mask is not None:
        m = f.attn_mask
        scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m.double()
    if f.is_causal:
        t_q, t_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(1), -math.inf)
    return scores.softmax(-1).nan_to_num(0.0)  # a row with no key: zeros, as torch's kernels give
