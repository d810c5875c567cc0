"""Adapters: every kind of layer the audit accepts, called one uniform way.

A `Subject` makes probe inputs in the layer's own layout and calls it with a mask given in one internal
convention: a bool tensor `allowed` of shape (B, Tq, Tk), True = may attend. Each adapter translates:

- `function`:   f(q, k, v, mask=None) on (B, H, T, d) tensors; mask (B, 1, Tq, Tk), True = may attend.
- `qkv_module`: m(query, key, value, mask=None) on (B, T, D) tensors; mask (B, 1, Tq, Tk), True = may attend.
- `self_module`: m(x) or m(x, mask=None) on (B, T, D), nanoGPT's CausalSelfAttention style.
- `torch_mha`:  torch.nn.MultiheadAttention, whose bool attn_mask means True = *blocked*, (B*H, Tq, Tk).

Time runs along dimension `time_dim` of inputs and outputs: 2 for functions, 1 for modules.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._errors import AuditUsageError, expect

MASK_NAMES = ("mask", "attn_mask", "attention_mask")
D_MODEL_NAMES = ("d_model", "embed_dim", "hidden_size", "n_embd", "dim", "model_dim")
HEAD_NAMES = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads")
CAUSAL_NAMES = ("causal", "is_causal")
# The longest sequence a layer declares it takes (nanoGPT's block_size, Hugging Face's config names).
CONTEXT_NAMES = ("block_size", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_seq_length",
                 "context_length")
MASK_BUFFER_NAMES = ("bias", "mask", "causal_mask", "attn_mask")  # a precomputed (.., N, N) causal mask
DEFAULT_SEQ_LEN = 16


class LayerReturnedNothingUsable(Exception):
    """The layer ran but returned something that is not an attention output (a finding, not misuse)."""


@dataclass
class Output:
    out: Tensor
    weights: Tensor | None


class Subject:
    form: str
    takes_mask: bool
    separate_kv: bool  # query and key/value may differ (cross-attention, Tq != Tk)
    builtin_causal: bool  # the layer declares that it builds its own causal mask
    time_dim: int

    def __init__(self, layer, *, d_model: int, num_heads: int, head_dim: int, device, dtype):
        self.layer, self.d_model, self.num_heads, self.head_dim = layer, d_model, num_heads, head_dim
        self.device, self.dtype = device, dtype

    def make(self, gen: torch.Generator, batch: int, t: int, *, heads: int | None = None) -> Tensor:
        """One standard-normal input stream in the layer's layout, drawn from `gen` on the CPU (in float64
        for float64 layers, float32 otherwise), so every device draws the same numbers."""
        shape = self.shape(batch, t, heads=heads)
        draw = torch.float64 if self.dtype == torch.float64 else torch.float32
        return torch.randn(shape, generator=gen, dtype=draw).to(device=self.device, dtype=self.dtype)

    def shape(self, batch: int, t: int, *, heads: int | None = None) -> tuple[int, ...]:
        return (batch, t, self.d_model)

    def expected_out_shape(self, batch: int, t_q: int, *, heads: int | None = None) -> tuple[int, ...]:
        return (batch, t_q, self.d_model)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None) -> Output:
        raise NotImplementedError

    def describe(self) -> str:
        name = (getattr(self.layer, "audit_name", None)  # adapters name the layer they wrap
                or getattr(self.layer, "__qualname__", None) or type(self.layer).__qualname__)
        return f"{name} ({self.form}, d_model={self.d_model}, num_heads={self.num_heads})"


def _unpack(result, query: Tensor, key: Tensor, time_dim: int) -> Output:
    """`out` or `(out, weights, ...)`; anything else is a finding. Of the other returned tensors, the
    weights are the one shaped like them, (B, [H,] Tq, Tk): a returned (k, v) cache or a bias is not."""
    if isinstance(result, (tuple, list)):
        if not result:
            raise LayerReturnedNothingUsable("returned an empty tuple")
        out, rest = result[0], result[1:]
    else:
        out, rest = result, ()
    if not isinstance(out, Tensor):
        raise LayerReturnedNothingUsable(f"returned {type(out).__name__}, expected a tensor or (tensor, weights)")
    batch, t_q, t_k = query.shape[0], query.shape[time_dim], key.shape[time_dim]
    weights = next((w for w in rest if isinstance(w, Tensor) and w.is_floating_point() and w.dim() in (3, 4)
                    and w.shape[0] == batch and tuple(w.shape[-2:]) == (t_q, t_k)), None)
    return Output(out.detach(), None if weights is None else weights.detach())


def _parameter_names(fn) -> list[str] | None:
    """Parameter names from the signature; for builtins without one (torch's C functions), from the
    first line of the docstring, e.g. 'scaled_dot_product_attention(query, key, value, attn_mask=None, ...)'."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        head = (getattr(fn, "__doc__", None) or "").strip().split("\n\n")[0]  # may wrap over lines
        match = re.match(r"^[\w.]+\(([^)]*)\)", head)
        if not match:
            return None
        return [p.split("=")[0].strip().lstrip("*") for p in match.group(1).split(",") if p.strip()]


def _mask_param(fn) -> str | None:
    params = _parameter_names(fn) or []
    return next((n for n in MASK_NAMES if n in params), None)


class FunctionSubject(Subject):
    form, separate_kv, builtin_causal, time_dim = "function", True, False, 2

    def __init__(self, layer, **kw):
        super().__init__(layer, **kw)
        self.mask_name = _mask_param(layer)
        self.takes_mask = self.mask_name is not None

    def shape(self, batch, t, *, heads=None):
        return (batch, heads or self.num_heads, t, self.head_dim)

    def expected_out_shape(self, batch, t_q, *, heads=None):
        return (batch, heads or self.num_heads, t_q, self.head_dim)

    def __call__(self, query, key, value, allowed):
        if allowed is None or not self.takes_mask:
            return _unpack(self.layer(query, key, value), query, key, self.time_dim)
        return _unpack(self.layer(query, key, value, **{self.mask_name: allowed.unsqueeze(1)}),  # (B, 1, Tq, Tk)
                       query, key, self.time_dim)


class QKVModuleSubject(Subject):
    form, separate_kv, time_dim = "qkv_module", True, 1

    def __init__(self, layer, **kw):
        super().__init__(layer, **kw)
        self.mask_name = _mask_param(layer.forward)
        self.takes_mask = self.mask_name is not None
        self.builtin_causal = any(getattr(layer, n, False) is True for n in CAUSAL_NAMES)

    __call__ = FunctionSubject.__call__  # the same call: three inputs, our mask under its own name


class SelfModuleSubject(QKVModuleSubject):
    form, separate_kv = "self_module", False

    def __call__(self, query, key, value, allowed):
        if not (query is key and key is value):
            raise AuditUsageError("internal: a self-attention module takes one input stream")
        if allowed is None or not self.takes_mask:
            return _unpack(self.layer(query), query, key, self.time_dim)
        return _unpack(self.layer(query, **{self.mask_name: allowed.unsqueeze(1)}), query, key, self.time_dim)


class TorchMHASubject(Subject):
    """nn.MultiheadAttention natively: True = blocked, (B*H, Tq, Tk) masks, batch_first either way."""

    form, separate_kv, takes_mask, builtin_causal, time_dim = "torch_mha", True, True, False, 1

    def __init__(self, layer: nn.MultiheadAttention, *, need_weights: bool = True, **kw):
        super().__init__(layer, **kw)
        self.need_weights = need_weights
        # add_bias_kv / add_zero_attn append a key of their own that no mask and no input reaches
        self.extra_keys = layer.bias_k is not None or layer.add_zero_attn

    def __call__(self, query, key, value, allowed):
        mha: nn.MultiheadAttention = self.layer
        blocked = None
        if allowed is not None:
            blocked = (~allowed).repeat_interleave(mha.num_heads, dim=0)  # (B*H, Tq, Tk), True = blocked
        if not mha.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # (T, B, D)
        out, weights = mha(query, key, value, attn_mask=blocked, need_weights=self.need_weights,
                           average_attn_weights=False)
        if not mha.batch_first:
            out = out.transpose(0, 1)  # (B, Tq, D)
        return Output(out.detach(), None if weights is None else weights.detach())


def _attr(layer, names, given):
    if given is not None:
        return given
    for n in names:
        value = getattr(layer, n, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    config = getattr(layer, "config", None)  # Hugging Face layers keep sizes on their config
    for n in names:
        value = getattr(config, n, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _positional(fn) -> list[inspect.Parameter]:
    params = inspect.signature(fn).parameters.values()
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _module_device_dtype(layer: nn.Module, device, dtype):
    """The device and dtype most of the module's floating-point parameters have (a float32 norm weight in
    a bfloat16 layer does not decide); a conflicting `device=` or `dtype=` is misuse, not a finding."""
    params = [p for p in layer.parameters() if p.is_floating_point()]
    if not params:
        return torch.device(device or "cpu"), dtype or torch.float32
    counts: dict = {}
    for p in params:
        counts[(p.device, p.dtype)] = counts.get((p.device, p.dtype), 0) + p.numel()
    own_device, own_dtype = max(counts, key=counts.get)
    expect(dtype is None or dtype == own_dtype, f"dtype={own_dtype} (the layer's parameters)", f"dtype={dtype}",
           f"convert the layer first (layer.to({dtype})) or leave dtype out")
    expect(device is None or torch.device(device) == own_device, f"device={own_device} (the layer's parameters)",
           f"device={device}", "move the layer first (layer.to(device)) or leave device out")
    return own_device, own_dtype


def _spell(name: str, value, options: dict | None) -> str:
    """An option as the user wrote it: `d_model=30` for audit(), `--d-model 30` on the command line."""
    flag = (options or {}).get(name)
    return f"{name}={value!r}" if flag is None else f"{flag} {value}"


def _check_size(name: str, value, options: dict | None) -> None:
    expect(value is None or (isinstance(value, int) and not isinstance(value, bool)), f"{name} an int or None",
           f"{_spell(name, value, options)} ({type(value).__name__})",
           f"pass a whole number, e.g. {_spell(name, 32, options)}")
    expect(value is None or value >= 1, f"{name} >= 1", _spell(name, value, options),
           "pass the layer's size, or leave it out to read it from the layer")


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(k) for k in range(1, n + 1) if n % k == 0) + "}"


def _check_heads(d_model: int, num_heads: int, where: str, options: dict | None) -> None:
    expect(d_model % num_heads == 0, f"d_model divisible by num_heads ({where})",
           f"d_model={d_model} and num_heads={num_heads}, which leave {d_model % num_heads}",
           f"choose num_heads in {_divisors(d_model)}")


def _check_device(device, options: dict | None):
    """A device this torch can use: `device="cuda"` on a CPU-only build is misuse, not a layer failure."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise AuditUsageError(f"expected a torch device; got {_spell('device', device, options)} ({error}). "
                              "Fix: pass e.g. device=\"cpu\" or device=\"cuda\"") from None
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, AttributeError) as error:  # torch asserts for CUDA on a CPU-only build
        available = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        raise AuditUsageError(f"expected a device this torch can use ({', '.join(available)}); got "
                              f"{_spell('device', str(device), options)}, which fails: {str(error).splitlines()[0]}. "
                              "Fix: leave device out, or install a torch built for it") from None
    return device


def _linear_widths(layer: nn.Module) -> list[int]:
    """The input widths of the layer's nn.Linear projections, the most common first (lazy ones not yet built
    are not counted)."""
    counts = Counter(m.in_features for m in layer.modules() if isinstance(m, nn.Linear) and m.in_features > 0)
    return [width for width, _ in counts.most_common()]


def make_subject(layer, *, d_model=None, num_heads=None, device=None, dtype=None,
                 need_weights: bool = True, options: dict | None = None) -> Subject:
    """Recognise the layer's form and sizes; raise `AuditUsageError` when it cannot be called, or when an
    option is not of the right kind or does not fit the layer. `options` maps audit() parameter names to the
    way the caller's front end spells them (e.g. {"d_model": "--d-model"}), for the messages."""
    expect(not isinstance(layer, type), "an attention layer instance",
           f"the class {getattr(layer, '__qualname__', layer)}",
           f"pass an instance, e.g. {getattr(layer, '__name__', 'Layer')}(...)")
    expect(callable(layer), "an attention layer: a function f(q, k, v, mask=None) or an nn.Module",
           f"{type(layer).__name__}", "pass the layer object itself (an instance, not a string)")
    _check_size("d_model", d_model, options)
    _check_size("num_heads", num_heads, options)
    expect(dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point),
           "dtype a floating-point torch.dtype or None", f"dtype={dtype!r}", "pass e.g. dtype=torch.float32")
    device = _check_device(device, options)
    if isinstance(layer, nn.MultiheadAttention):
        expect(layer.kdim == layer.embed_dim and layer.vdim == layer.embed_dim,
               "nn.MultiheadAttention with kdim == vdim == embed_dim",
               f"embed_dim={layer.embed_dim}, kdim={layer.kdim}, vdim={layer.vdim}",
               "wrap it in a module whose key/value inputs are embed_dim wide (e.g. a Linear in front)")
        for name, given, own in (("d_model", d_model, layer.embed_dim), ("num_heads", num_heads, layer.num_heads)):
            expect(given is None or given == own, f"{name}={own}, as the nn.MultiheadAttention has it",
                   _spell(name, given, options), f"leave {name} out: it is read from the layer")
        device, dtype = _module_device_dtype(layer, device, dtype)
        return TorchMHASubject(layer, d_model=layer.embed_dim, num_heads=layer.num_heads,
                               head_dim=layer.head_dim, device=device, dtype=dtype, need_weights=need_weights)
    if isinstance(layer, nn.Module):
        device, dtype = _module_device_dtype(layer, device, dtype)
        given_d_model = d_model
        d_model, num_heads = _attr(layer, D_MODEL_NAMES, d_model), _attr(layer, HEAD_NAMES, num_heads)
        expect(d_model is not None, "a module with a d_model-like attribute (" + ", ".join(D_MODEL_NAMES) + ")",
               f"{type(layer).__name__} with none of them", "pass d_model=... to audit()"
               if not options or "d_model" not in options else f"pass {options['d_model']} D")
        widths = _linear_widths(layer)
        # A width its projections do not take (`--d-model 30` on a 32-wide layer) would fail every probe
        expect(not widths or d_model in widths, f"d_model to match the width of the layer's projections "
               f"(nn.Linear in_features {sorted(widths)})",
               _spell("d_model", d_model, options) if given_d_model is not None
               else f"d_model={d_model} read from the layer's attributes",
               f"pass the layer's width, {_spell('d_model', widths[0], options)}" if widths else "")
        num_heads = num_heads or 1
        _check_heads(d_model, num_heads, "a head takes d_model / num_heads of the width", options)
        try:
            positional = _positional(layer.forward)
        except (TypeError, ValueError):
            positional = []
        names = [p.name for p in positional if p.name not in MASK_NAMES]
        cls = QKVModuleSubject if len(names) >= 3 else SelfModuleSubject
        expect(len(names) >= 1, "forward(query, key, value, mask=None) or forward(x)",
               f"forward{inspect.signature(layer.forward)}", "wrap the layer in a function f(q, k, v, mask=None)")
        return cls(layer, d_model=d_model, num_heads=num_heads, head_dim=max(d_model // num_heads, 1),
                   device=device, dtype=dtype)
    try:
        positional = _positional(layer)
    except (TypeError, ValueError):
        positional = [None] * 3  # a builtin: assume f(q, k, v)
    expect(len(positional) >= 3, "a function f(q, k, v, mask=None) on (B, H, T, d) tensors",
           f"a function of {len(positional)} positional argument(s)", "wrap it as lambda q, k, v, mask=None: ...")
    if num_heads is None:
        num_heads = 2 if d_model is None or d_model % 2 == 0 else 1
    if d_model is not None:
        _check_heads(d_model, num_heads, "the probe gives each head d_model / num_heads", options)
    head_dim = (d_model // num_heads) if d_model else 8
    return FunctionSubject(layer, d_model=head_dim * num_heads, num_heads=num_heads, head_dim=head_dim,
                           device=device or torch.device("cpu"), dtype=dtype or torch.float32)


def context_length(layer) -> tuple[int, str] | None:
    """The longest sequence the layer declares it takes, and what says so: an attribute such as
    `block_size` or `max_position_embeddings` (on the layer, a submodule or its `config`), or a registered
    causal-mask buffer (`bias`, `mask`) of shape (.., N, N), nanoGPT's way. None if nothing says."""
    if not isinstance(layer, nn.Module):
        return None
    found: list[tuple[int, str]] = []
    for path, module in layer.named_modules():
        prefix = f"{path}." if path else ""
        for holder, where in ((module, prefix), (getattr(module, "config", None), f"{prefix}config.")):
            for name in CONTEXT_NAMES:
                value = getattr(holder, name, None) if holder is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.append((value, f"{where}{name}={value}"))
        for name, buffer in module.named_buffers(recurse=False):
            if name in MASK_BUFFER_NAMES and buffer is not None and buffer.dim() >= 2 and \
                    buffer.shape[-1] == buffer.shape[-2] > 0:
                found.append((int(buffer.shape[-1]), f"the {tuple(buffer.shape)} buffer {prefix}{name}"))
    return min(found, key=lambda f: f[0]) if found else None


def check_seq_len(subject: Subject, seq_len, *, options: dict | None = None) -> int:
    """The probe length for this subject: `seq_len` (None: the default, 16) checked to be an int >= 1 and no
    longer than the context the layer declares (see `context_length`). Raises `AuditUsageError` otherwise."""
    expect(seq_len is None or (isinstance(seq_len, int) and not isinstance(seq_len, bool)), "seq_len an int or None",
           f"{_spell('seq_len', seq_len, options)} ({type(seq_len).__name__})",
           "pass the context length you train with, e.g. seq_len=128")
    expect(seq_len is None or seq_len >= 1, "seq_len >= 1", _spell("seq_len", seq_len, options),
           "pass the context length you train with, e.g. seq_len=128")
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    limit = context_length(subject.layer)
    if limit is not None and length > limit[0]:
        seen = _spell("seq_len", length, options) + (" (the default)" if seq_len is None else "")
        raise AuditUsageError(f"expected seq_len <= {limit[0]}, the longest sequence the layer takes "
                              f"({limit[1]}); got {seen}. Fix: pass {_spell('seq_len', limit[0], options)} or less")
    return length


__all__ = ["AuditUsageError", "LayerReturnedNothingUsable", "Output", "Subject", "check_seq_len", "context_length",
           "make_subject"]
