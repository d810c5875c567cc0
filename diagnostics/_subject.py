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
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._errors import AuditUsageError, expect

MASK_NAMES = ("mask", "attn_mask", "attention_mask")
D_MODEL_NAMES = ("d_model", "embed_dim", "hidden_size", "n_embd", "dim", "model_dim")
HEAD_NAMES = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads")
CAUSAL_NAMES = ("causal", "is_causal")


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


def make_subject(layer, *, d_model=None, num_heads=None, device=None, dtype=None,
                 need_weights: bool = True) -> Subject:
    """Recognise the layer's form and sizes; raise `AuditUsageError` when it cannot be called."""
    expect(callable(layer), "an attention layer: a function f(q, k, v, mask=None) or an nn.Module",
           f"{type(layer).__name__}", "pass the layer object itself (an instance, not a string)")
    if isinstance(layer, nn.MultiheadAttention):
        expect(layer.kdim == layer.embed_dim and layer.vdim == layer.embed_dim,
               "nn.MultiheadAttention with kdim == vdim == embed_dim",
               f"embed_dim={layer.embed_dim}, kdim={layer.kdim}, vdim={layer.vdim}",
               "wrap it in a module whose key/value inputs are embed_dim wide (e.g. a Linear in front)")
        device, dtype = _module_device_dtype(layer, device, dtype)
        return TorchMHASubject(layer, d_model=layer.embed_dim, num_heads=layer.num_heads,
                               head_dim=layer.head_dim, device=device, dtype=dtype, need_weights=need_weights)
    if isinstance(layer, nn.Module):
        device, dtype = _module_device_dtype(layer, device, dtype)
        d_model, num_heads = _attr(layer, D_MODEL_NAMES, d_model), _attr(layer, HEAD_NAMES, num_heads)
        expect(d_model is not None, "a module with a d_model-like attribute (" + ", ".join(D_MODEL_NAMES) + ")",
               f"{type(layer).__name__} with none of them", "pass d_model=... to audit()")
        num_heads = num_heads or 1
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
    num_heads = num_heads or 2
    head_dim = (d_model // num_heads) if d_model else 8
    expect(head_dim >= 1, "d_model >= num_heads", f"d_model={d_model}, num_heads={num_heads}", "pass a larger d_model")
    return FunctionSubject(layer, d_model=head_dim * num_heads, num_heads=num_heads, head_dim=head_dim,
                           device=torch.device(device or "cpu"), dtype=dtype or torch.float32)


__all__ = ["AuditUsageError", "LayerReturnedNothingUsable", "Output", "Subject", "make_subject"]
