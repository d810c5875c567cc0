"""Subjects: every kind of layer the audit accepts, called one uniform way.

A `Subject` makes probe inputs in the layer's own layout and calls it with a mask given in one internal
convention: a bool tensor `allowed` of shape (B, Tq, Tk), True = may attend. Each subject translates:

- `function`:     f(q, k, v, mask=None) on (B, H, T, d) tensors (or (B, T, H, d) with layout="bthd").
- `qkv_module`:   m(query, key, value, mask=None) on (B, T, D) tensors.
- `cross_module`: m(hidden_states, key_value_states, mask=None): a query stream and a memory.
- `self_module`:  m(x) or m(x, mask=None) on (B, T, D), nanoGPT's CausalSelfAttention style.
- `torch_mha`:    torch.nn.MultiheadAttention, whose bool attn_mask means True = *blocked*, (B*H, Tq, Tk).

A module's inputs are recognised by the names of its forward's parameters, never by their count: the
query stream (`x`, `hidden_states`, `query`, ...), key and value, a memory (`key_value_states`, `memory`,
...), masks (`mask`, `attn_mask`, `attention_mask`, `src_mask`, ...), and parameters left at their
defaults (caches, `use_cache`, `output_attentions`, ...). It is called by keyword. A parameter with no
default that none of these names is misuse, named in the message.

The mask reaches the layer in the convention it takes: declared (`mask="allowed" | "blocked" | "additive" |
"key_padding"`), or known for the library the layer comes from (torch's transformer layers: True = blocked,
per head; Hugging Face: additive in eager mode, bool in sdpa mode). The convention is never guessed from what
the layer does with a mask: an inverted mask must stay a finding.

Time runs along dimension `time_dim` of inputs and outputs: 2 for functions, 1 for modules.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ._errors import AuditUsageError, expect
from ._guard import untouched
from .adapters import convert_mask

QUERY_NAMES = ("x", "hidden_states", "query", "q", "tgt", "src", "inputs", "input", "hidden", "h")
KEY_NAMES = ("key", "k", "keys")
VALUE_NAMES = ("value", "v", "values")
MEMORY_NAMES = ("key_value_states", "encoder_hidden_states", "memory", "context", "kv")
# in the order one is chosen when a layer has several; `*_key_padding_mask` are masks too
MASK_NAMES = ("mask", "attn_mask", "attention_mask", "src_mask", "tgt_mask", "memory_mask", "encoder_attention_mask",
              "key_padding_mask")
# left at their defaults (or None where a library makes them required): caches, flags, positions, biases
LEAVE_NAMES = ("past_key_value", "past_key_values", "layer_past", "kv_cache", "cache", "past", "use_cache",
               "output_attentions", "output_hidden_states", "return_dict", "head_mask", "layer_head_mask",
               "cache_position", "position_ids", "need_weights", "average_attn_weights", "is_causal",
               "query_length", "position_bias", "alibi", "layer_idx", "sliding_window")
# a cache of past keys and values, in the order one is chosen (see ModuleSubject.cache_name)
CACHE_NAMES = ("past_key_value", "past_key_values", "layer_past", "kv_cache", "cache", "past")
MASK_CONVENTIONS = ("allowed", "blocked", "additive", "key_padding")
LAYOUTS = ("bhtd", "bthd")
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
    separate_value: bool = True  # the value is an input of its own (False: one memory stream is key and value)
    builtin_causal: bool  # the layer declares that it builds its own causal mask
    time_dim: int
    convention: str = "allowed"  # how the layer takes its mask (see adapters.convert_mask, and "key_padding")
    convention_declared: bool = False  # by the user (mask=...) or known for the layer's library
    mask_names: tuple[str, ...] = ()  # the parameters that receive the mask
    notes: tuple[str, ...] = ()  # what the audit assumed, said in the report's first line

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
        """Call the layer with `allowed` (B, Tq, Tk) in its convention. A key-padding layer takes one mask
        for every query; a mask that differs between queries reaches it one query at a time (each batch row
        repeated once per query, in one call), and each query's output row is read from its own copy."""
        if allowed is not None and self.convention == "key_padding" and not _same_for_every_query(allowed):
            return _per_query(self._call, query, key, value, allowed, self.time_dim)
        return _unpack(self._call(query, key, value, allowed), query, key, self.time_dim)

    def _call(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None):
        raise NotImplementedError

    def _mask(self, allowed: Tensor) -> Tensor:
        """`allowed` (B, Tq, Tk), True = may attend, in the layer's convention."""
        if self.convention == "key_padding":
            return ~allowed[:, 0, :]  # (B, Tk), True = padding: the same for every query here
        return convert_mask(allowed.unsqueeze(1), self.convention, dtype=self.dtype, num_heads=self.num_heads)

    def describe(self) -> str:
        name = (getattr(self.layer, "audit_name", None)  # adapters name the layer they wrap
                or getattr(self.layer, "__qualname__", None) or type(self.layer).__qualname__)
        # a size a note already gives (how it was found: "num_heads=1 assumed: ...") is said once, in the note
        sizes = [f"{field}={value}" for field, value in (("d_model", self.d_model), ("num_heads", self.num_heads))
                 if not any(note.startswith(f"{field}=") for note in self.notes)]
        return f"{name} ({', '.join([self.form, *sizes, *self.notes])})"


def _same_for_every_query(allowed: Tensor) -> bool:
    return bool((allowed == allowed[:, :1, :]).all())


def _per_query(call, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, time_dim: int) -> Output:
    """One copy of each batch row per query q, given the mask row of q for every query; output row q of
    copy q is what a layer taking the full mask gives, wherever a row depends on its own query and the keys
    it may attend alone (what every correct attention does)."""
    B, Tq, Tk = allowed.shape  # batch, queries, keys
    copies = {}

    def repeat(x):
        if id(x) not in copies:
            copies[id(x)] = x.repeat_interleave(Tq, dim=0)  # (B*Tq, ...)
        return copies[id(x)]

    rows = allowed.reshape(B * Tq, 1, Tk).expand(B * Tq, Tq, Tk)  # copy (b, q): query q's row for every query
    q, k, v = repeat(query), repeat(key), repeat(value)
    from ._observe import Observer  # torch's dispatch machinery, loaded only for this

    observer = Observer()  # the weights, if the layer returns none: each copy's softmax holds its own row
    with observer:
        got = _unpack(call(q, k, v, rows), q, k, time_dim)
    weights = got.weights if got.weights is not None else _observed_weights(observer.record, Tq, Tk)

    def own_rows(t: Tensor, dim: int) -> Tensor:  # (B*Tq, .., Tq@dim, ..) -> (B, .., Tq@dim, ..)
        t = t.reshape(B, Tq, *t.shape[1:])
        return torch.diagonal(t, dim1=1, dim2=dim + 1).movedim(-1, dim)

    out = own_rows(got.out, time_dim)
    ok = weights is not None and weights.dim() in (3, 4) and weights.shape[0] == B * Tq
    return Output(out, own_rows(weights.detach(), weights.dim() - 2) if ok else None)


def _observed_weights(record, t_q: int, t_k: int) -> Tensor | None:
    """The last softmax over (Tq, Tk) scores in an observed call, or the weights of its fused attention."""
    for sm in reversed(record.softmaxes):
        if tuple(sm.output.shape[-2:]) == (t_q, t_k):
            return sm.output
    for f in reversed(record.fused):
        if f.q.shape[-2] == t_q and f.k.shape[-2] == t_k:
            from ._observe import fused_weights  # torch's dispatch machinery, loaded only where it is used

            return fused_weights(f)
    return None


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


def _is_mask_name(name: str) -> bool:
    return name in MASK_NAMES or name.endswith("_key_padding_mask")


def _choose_mask(names, convention: str | None, *, cross: bool = False) -> str | None:
    """The mask parameter to give the audit's mask: a key-padding one where that convention is declared,
    the memory's mask in a cross-attention, else the first of MASK_NAMES the layer has."""
    masks = [n for n in names if _is_mask_name(n)]
    if not masks:
        return None
    if convention == "key_padding":
        padding = [n for n in masks if "key_padding" in n]
        if padding:
            return padding[0]
    order = (("encoder_attention_mask", "memory_mask") if cross else ()) + MASK_NAMES
    return min(masks, key=lambda n: order.index(n) if n in order else len(order))


class FunctionSubject(Subject):
    """f(q, k, v, mask=None): q, k and v positionally, the mask under its own name. With layout "bthd"
    (flash-attn's) the probes' (B, H, T, d) tensors are passed as (B, T, H, d), contiguous where they
    were, and the output is read back: the detectors see one layout."""

    form, separate_kv, builtin_causal, time_dim = "function", True, False, 2

    def __init__(self, layer, *, mask_name: str | None, convention: str | None, layout: str, **kw):
        super().__init__(layer, **kw)
        self.mask_name, self.layout = mask_name, layout
        self.takes_mask = mask_name is not None
        self.mask_names = (mask_name,) if mask_name else ()
        self.convention, self.convention_declared = convention or "allowed", convention is not None
        self.notes = (f"layout={layout}",) if layout != "bhtd" else ()

    def shape(self, batch, t, *, heads=None):
        return (batch, heads or self.num_heads, t, self.head_dim)

    def expected_out_shape(self, batch, t_q, *, heads=None):
        return (batch, heads or self.num_heads, t_q, self.head_dim)

    def _call(self, query, key, value, allowed):
        if self.layout == "bthd":
            query, key, value = (_swap_time_heads(x) for x in (query, key, value))  # (B, T, H, d)
        if allowed is None or not self.takes_mask:
            result = self.layer(query, key, value)
        else:
            result = self.layer(query, key, value, **{self.mask_name: self._mask(allowed)})
        if self.layout == "bthd":
            result = _swap_result(result)  # (B, H, T, d)
        return result


def _swap_time_heads(x: Tensor) -> Tensor:
    """(B, H, T, d) <-> (B, T, H, d), keeping the input contiguous if it was (the `runs` probe of
    non-contiguous inputs stays non-contiguous)."""
    y = x.transpose(1, 2)
    return y.contiguous() if x.is_contiguous() else y


def _swap_result(result):
    if isinstance(result, Tensor):
        return _swap_time_heads(result) if result.dim() == 4 else result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor) and result[0].dim() == 4:
        return (_swap_time_heads(result[0]), *result[1:])
    return result


@dataclass
class Signature:
    """A module's forward, read by parameter names: which receives what."""

    query: str
    key: str | None = None
    value: str | None = None
    memory: str | None = None
    masks: tuple[str, ...] = ()  # every mask parameter
    fixed: dict = field(default_factory=dict)  # parameters given a value on every call (None for required ones)
    rotary: bool = False  # position_embeddings=(cos, sin) must be supplied


class ModuleSubject(Subject):
    """A module called by keyword: its query stream (and key/value, or memory) and its masks under the
    names its forward gives them; every other parameter left at its default."""

    time_dim = 1

    def __init__(self, layer, *, sig: Signature, form: str, mask_names: tuple[str, ...], convention: str,
                 declared: bool, builtin_causal: bool, extra=None, notes: tuple[str, ...] = (), **kw):
        super().__init__(layer, **kw)
        self.sig, self.form, self.mask_names = sig, form, mask_names
        self.separate_kv = form != "self_module"
        self.separate_value = form == "qkv_module"
        self.takes_mask = bool(mask_names)
        self.convention, self.convention_declared = convention, declared
        self.builtin_causal, self.extra, self.notes = builtin_causal, extra, notes
        self.fixed_memory = isinstance(layer, nn.TransformerDecoderLayer)  # an encoder's output, not the queries

    def _call(self, query, key, value, allowed):
        if self.form == "self_module" and not (query is key and key is value):
            raise AuditUsageError("internal: a self-attention module takes one input stream")
        return self.layer(**self._kwargs(query, key, value, allowed))

    @property
    def cache_name(self) -> str | None:
        """The parameter through which forward takes a cache of past keys and values, where the audit can
        drive it: a self-attention module's (a Hugging Face layer's only with its `layer_idx`, which its
        Cache object files keys under)."""
        if self.form != "self_module":
            return None
        hf = _is_huggingface(self.layer)
        if (hf and getattr(self.layer, "layer_idx", None) is None) or (self.extra is not None and not hf):
            return None
        names = _parameter_names(self.layer.forward) or []
        return next((n for n in CACHE_NAMES if n in names), None)

    def new_cache(self):
        """An empty cache of the layer's library to pass on every call (transformers' DynamicCache for a Hugging
        Face layer, which files keys under the layer's `layer_idx`), or None: the layer makes its own."""
        if not _is_huggingface(self.layer):
            return None
        return importlib.import_module("transformers.cache_utils").DynamicCache()

    def call_cached(self, query: Tensor, allowed: Tensor | None, cache, *, start: int = 0):
        """Call with `cache` as the cache argument (and use_cache=True where forward takes that flag), the
        tokens of `query` at positions start, start + 1, ...; the layer's raw result."""
        kwargs = self._kwargs(query, query, query, allowed, start=start)
        kwargs[self.cache_name] = cache
        if "use_cache" in (_parameter_names(self.layer.forward) or []):
            kwargs["use_cache"] = True
        return self.layer(**kwargs)

    def _kwargs(self, query, key, value, allowed, *, start: int = 0) -> dict:
        kwargs = dict(self.sig.fixed)
        if self.extra is not None:
            kwargs.update(self.extra(query, start))
        kwargs[self.sig.query] = query
        if self.form == "qkv_module":
            kwargs[self.sig.key], kwargs[self.sig.value] = key, value
        elif self.form == "cross_module":
            kwargs[self.sig.memory] = key
        elif self.sig.memory is not None and self.sig.memory in kwargs:  # a required memory
            kwargs[self.sig.memory] = _encoder_output(query) if self.fixed_memory else query
        mask = None if allowed is None or not self.takes_mask else self._mask(allowed)
        for name in self.mask_names:
            kwargs[name] = mask
        return kwargs


class TorchMHASubject(Subject):
    """nn.MultiheadAttention natively: True = blocked, (B*H, Tq, Tk) masks, batch_first either way. Keys
    and values of another width (kdim, vdim) are the key stream's features repeated to that width: a fixed
    per-position map, so what changes at a position still changes there and nowhere else."""

    form, separate_kv, takes_mask, builtin_causal, time_dim = "torch_mha", True, True, False, 1
    convention_declared = True

    def __init__(self, layer: nn.MultiheadAttention, *, need_weights: bool = True, **kw):
        super().__init__(layer, **kw)
        self.need_weights = need_weights
        self.convention = "mha_blocked"
        self.mask_names = ("attn_mask",)
        # add_bias_kv / add_zero_attn append a key of their own that no mask and no input reaches
        self.extra_keys = layer.bias_k is not None or layer.add_zero_attn
        if layer.kdim != layer.embed_dim or layer.vdim != layer.embed_dim:
            self.notes = (f"kdim={layer.kdim}, vdim={layer.vdim}: keys and values are the key stream repeated "
                          f"to that width",)

    def __call__(self, query, key, value, allowed):  # its weights have a key more with add_bias_kv: kept as they are
        mha: nn.MultiheadAttention = self.layer
        blocked = None
        if allowed is not None:
            blocked = (~allowed).repeat_interleave(mha.num_heads, dim=0)  # (B*H, Tq, Tk), True = blocked
        key, value = _widen(key, mha.kdim), _widen(value, mha.vdim)
        if not mha.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # (T, B, D)
        out, weights = mha(query, key, value, attn_mask=blocked, need_weights=self.need_weights,
                           average_attn_weights=False)
        if not mha.batch_first:
            out = out.transpose(0, 1)  # (B, Tq, D)
        return Output(out.detach(), None if weights is None else weights.detach())


def _widen(x: Tensor, width: int) -> Tensor:
    """(B, T, D) -> (B, T, width): the features repeated (or cut) to `width`; x itself when it fits."""
    if x.shape[-1] == width:
        return x
    times = -(-width // x.shape[-1])
    return x.repeat(*([1] * (x.dim() - 1)), times)[..., :width]


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


def spell(name: str, value, options: dict | None) -> str:
    """An option as the user wrote it: `d_model=30` for audit(), `--d-model 30` on the command line."""
    flag = (options or {}).get(name)
    return f"{name}={value!r}" if flag is None else f"{flag} {value}"


def _check_size(name: str, value, options: dict | None) -> None:
    expect(value is None or (isinstance(value, int) and not isinstance(value, bool)), f"{name} an int or None",
           f"{spell(name, value, options)} ({type(value).__name__})",
           f"pass a whole number, e.g. {spell(name, 32, options)}")
    expect(value is None or value >= 1, f"{name} >= 1", spell(name, value, options),
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
        raise AuditUsageError(f"expected a torch device; got {spell('device', device, options)} ({error}). "
                              "Fix: pass e.g. device=\"cpu\" or device=\"cuda\"") from None
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, AttributeError) as error:  # torch asserts for CUDA on a CPU-only build
        available = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        raise AuditUsageError(f"expected a device this torch can use ({', '.join(available)}); got "
                              f"{spell('device', str(device), options)}, which fails: {str(error).splitlines()[0]}. "
                              "Fix: leave device out, or install a torch built for it") from None
    return device


def _linear_widths(layer: nn.Module) -> list[int]:
    """The input widths of the layer's nn.Linear projections, the most common first (lazy ones not yet built
    are not counted)."""
    counts = Counter(m.in_features for m in layer.modules() if isinstance(m, nn.Linear) and m.in_features > 0)
    return [width for width, _ in counts.most_common()]


def _forward_parameters(layer: nn.Module) -> list[inspect.Parameter]:
    try:
        params = inspect.signature(layer.forward).parameters.values()
    except (TypeError, ValueError):
        raise AuditUsageError(f"expected a module whose forward has a readable signature; got "
                              f"{type(layer).__name__}.forward. Fix: wrap the layer in a function "
                              f"f(q, k, v, mask=None) or a module forward(x, mask=None)") from None
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _first(params, names) -> str | None:
    return next((p.name for p in params if p.name in names), None)


def read_signature(layer: nn.Module, *, library: bool = False) -> Signature:
    """Which of forward's parameters takes what, by name. `library`: a Hugging Face layer, whose
    `position_embeddings` the audit builds from its model family's rotary class."""
    params = _forward_parameters(layer)
    query, key, value = _first(params, QUERY_NAMES), _first(params, KEY_NAMES), _first(params, VALUE_NAMES)
    memory = _first(params, MEMORY_NAMES)
    masks = tuple(p.name for p in params if _is_mask_name(p.name))
    fixed, unknown, rotary = {}, [], False
    for p in params:
        if p.name in (query, key, value, memory) or _is_mask_name(p.name):
            if p.name == memory and p.default is p.empty:
                fixed[p.name] = None  # a required memory: given on every call (see ModuleSubject._call)
            continue
        if p.name in LEAVE_NAMES:
            if p.default is p.empty:
                fixed[p.name] = None  # required by the library, None meaning "none"
        elif p.name == "position_embeddings" and library:
            rotary = True
        elif p.default is p.empty:
            unknown.append(p)
    if query is None and unknown and unknown[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                         inspect.Parameter.POSITIONAL_OR_KEYWORD):
        query = unknown.pop(0).name  # one unnamed input stream: the query
    shown = f"forward{inspect.signature(layer.forward)}"
    expect(query is not None, "forward(query, key, value, mask=None) or forward(x, mask=None)", shown,
           "wrap the layer in a function f(q, k, v, mask=None)")
    if unknown:
        name = unknown[0].name
        raise AuditUsageError(
            f"expected forward's parameters without a default to be inputs the audit knows (a query such as x "
            f"or hidden_states, key and value, a memory, a mask); got `{name}` in {shown}. Fix: wrap the layer "
            f"so that it gets {name}, e.g. adapters.self_attention(layer, mask_arg=..., d_model=..., "
            f"num_heads=..., {name}=...), or a module whose forward(x, mask=None) calls it with {name}")
    return Signature(query, key, value, memory, masks, fixed, rotary)


def _is_huggingface(layer) -> bool:
    return type(layer).__module__.startswith("transformers.") and getattr(layer, "config", None) is not None


def _huggingface_convention(layer) -> str:
    """The mask the parent model builds for this layer: bool (True = keep) where the layer dispatches on
    `attn_implementation="sdpa"`; additive (0 keep, finfo.min block) in eager mode and in layers that
    compute their attention themselves."""
    implementation = getattr(layer.config, "_attn_implementation", None) or "eager"
    expect(implementation in ("eager", "sdpa"), 'a Hugging Face layer with attn_implementation "eager" or "sdpa"',
           repr(implementation), 'build its config with attn_implementation="eager" (weights returned) or "sdpa"')
    try:
        source = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        source = ""
    dispatches = "ALL_ATTENTION_FUNCTIONS" in source or "_attn_implementation" in source
    return "allowed" if implementation == "sdpa" and dispatches else "additive"


def _huggingface_rotary(layer, device):
    """The rotary embedding of the layer's model family, built from its config: `LlamaRotaryEmbedding`
    for `LlamaAttention`. None if the family has none that its config builds."""
    module = sys.modules.get(type(layer).__module__)
    family = re.sub(r"(Self|Cross|Flash|Sdpa)?Attention\w*$", "", type(layer).__name__)
    classes = [obj for name, obj in vars(module or {}).items() if name.endswith("RotaryEmbedding")
               and isinstance(obj, type) and issubclass(obj, nn.Module)]
    classes.sort(key=lambda c: not c.__name__.startswith(family))
    for cls in classes:
        try:
            return cls(config=layer.config).to(device)
        except Exception:  # noqa: BLE001 - another family's signature: try the next
            continue
    return None


def _rotary_extra(rotary):
    def extra(x: Tensor, start: int = 0) -> dict:
        B, T = x.shape[:2]  # batch, sequence length
        positions = torch.arange(start, start + T, device=x.device).expand(B, T)  # (B, T)
        return {"position_embeddings": rotary(x, positions)}  # (cos, sin), each (B, T, head_dim)
    return extra


MEMORY_TOKENS = 5


def _encoder_output(query: Tensor) -> Tensor:
    """The memory a whole Transformer decoder layer attends: MEMORY_TOKENS standard-normal tokens, the same for
    every call and every sequence of the batch (so that stacked probes and separate calls compare alike)."""
    memory = torch.randn(1, MEMORY_TOKENS, query.shape[-1], generator=torch.Generator().manual_seed(0))
    return memory.to(query.device, query.dtype).expand(query.shape[0], -1, -1)  # (B, Tm, D)


TRIAL_TOKENS = 4


def _trial(layer: nn.Module, width: int, device, dtype):
    """One call of forward on (1, TRIAL_TOKENS, width) tokens, by keyword, observed, with the layer's state and
    the RNG restored: (the output, the record), or None when it raises or returns no tensor first."""
    from ._observe import Observer

    try:
        sig = read_signature(layer)
        x = torch.randn(1, TRIAL_TOKENS, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        kwargs = dict(sig.fixed)
        kwargs[sig.query] = x
        for name in (sig.key, sig.value):
            if name is not None:
                kwargs[name] = x
        if sig.memory is not None and sig.memory in kwargs:
            kwargs[sig.memory] = x
        observer = Observer()
        with untouched(layer, device), torch.no_grad(), observer:
            out = layer(**kwargs)
    except Exception:  # noqa: BLE001 - a width the layer does not take: the caller tries the next
        return None
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    return (out, observer.record) if isinstance(out, Tensor) else None


def _trial_width(layer: nn.Module, device, dtype) -> int | None:
    """The width the layer takes and returns, (1, T, D) -> (1, T, D), tried among its parameters' sizes (the most
    common first): for a module that keeps its weights as bare nn.Parameter and names no width."""
    sizes = Counter(n for p in layer.parameters() for n in p.shape if n > 1)
    for width, _ in sizes.most_common(8):
        tried = _trial(layer, width, device, dtype)
        if tried is not None and tuple(tried[0].shape) == (1, TRIAL_TOKENS, width):
            return width
    return None


def _trial_heads(layer: nn.Module, d_model: int, device, dtype) -> int | None:
    """The number of heads a trial call's attention runs with: the head axis of its fused attention's q
    (B, H, T, d) or of its softmax over (B, H, T, T) scores (B*H rows of (T, T) ones), when they all agree."""
    tried = _trial(layer, d_model, device, dtype)
    if tried is None:
        return None
    record, T = tried[1], TRIAL_TOKENS
    seen = {f.q.shape[1] for f in record.fused if f.q.dim() == 4 and f.q.shape[0] == 1}
    for sm in record.softmaxes:
        shape = tuple(sm.output.shape)
        if shape[-2:] == (T, T) and len(shape) == 4 and shape[0] == 1:
            seen.add(shape[1])
        elif shape[-2:] == (T, T) and len(shape) == 3:
            seen.add(shape[0])
    heads = seen.pop() if len(seen) == 1 else None
    return heads if heads and d_model % heads == 0 else None


def _first_linear_width(layer: nn.Module) -> int | None:
    return next((m.in_features for m in layer.modules() if isinstance(m, nn.Linear) and m.in_features > 0), None)


def make_subject(layer, *, d_model=None, num_heads=None, device=None, dtype=None, need_weights: bool = True,
                 mask: str | None = None, layout: str | None = None, options: dict | None = None) -> Subject:
    """Recognise the layer's form and sizes; raise `AuditUsageError` when it cannot be called, or when an
    option is not of the right kind or does not fit the layer. `mask`: the convention the layer takes its
    mask in (MASK_CONVENTIONS; default: the library's, else "allowed"); `layout`: a function's, "bhtd"
    (default) or "bthd". `options` maps audit() parameter names to the way the caller's front end spells
    them (e.g. {"d_model": "--d-model"}), for the messages."""
    expect(not isinstance(layer, type), "an attention layer instance",
           f"the class {getattr(layer, '__qualname__', layer)}",
           f"pass an instance, e.g. {getattr(layer, '__name__', 'Layer')}(...)")
    expect(callable(layer), "an attention layer: a function f(q, k, v, mask=None) or an nn.Module",
           f"{type(layer).__name__}", "pass the layer object itself (an instance, not a string)")
    _check_size("d_model", d_model, options)
    _check_size("num_heads", num_heads, options)
    expect(dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point),
           "dtype a floating-point torch.dtype or None", f"dtype={dtype!r}", "pass e.g. dtype=torch.float32")
    expect(mask is None or mask in MASK_CONVENTIONS, f"mask one of {', '.join(MASK_CONVENTIONS)}",
           spell("mask", mask, options), 'pass "allowed" (bool, True = may attend), "blocked" (bool, True = '
           'blocked), "additive" (float, 0 keep / large negative block) or "key_padding" ((B, Tk) bool, True = '
           'padding)')
    expect(layout is None or layout in LAYOUTS, f"layout one of {', '.join(LAYOUTS)}", spell("layout", layout, options),
           'pass "bhtd" for (B, H, T, d) tensors or "bthd" for (B, T, H, d) (flash-attn\'s)')
    device = _check_device(device, options)
    if isinstance(layer, nn.MultiheadAttention):
        expect(mask is None, "no mask convention for nn.MultiheadAttention (its own is known)",
               spell("mask", mask, options), "leave mask out; to pass padding through key_padding_mask, audit "
                                              "adapters.mha_key_padding(mha)")
        for name, given, own in (("d_model", d_model, layer.embed_dim), ("num_heads", num_heads, layer.num_heads)):
            expect(given is None or given == own, f"{name}={own}, as the nn.MultiheadAttention has it",
                   spell(name, given, options), f"leave {name} out: it is read from the layer")
        device, dtype = _module_device_dtype(layer, device, dtype)
        return TorchMHASubject(layer, d_model=layer.embed_dim, num_heads=layer.num_heads,
                               head_dim=layer.head_dim, device=device, dtype=dtype, need_weights=need_weights)
    if isinstance(layer, nn.Module):
        return _module_subject(layer, d_model=d_model, num_heads=num_heads, device=device, dtype=dtype, mask=mask,
                               layout=layout, options=options)
    try:
        params = [p for p in inspect.signature(layer).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        params = None  # a builtin: assume f(q, k, v, ...) and read the mask's name from its docstring
    if params is not None:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        expect(len(positional) >= 3, "a function f(q, k, v, mask=None) on (B, H, T, d) tensors",
               f"a function of {len(positional)} positional argument(s)", "wrap it as lambda q, k, v, mask=None: ...")
        rest = params[3:] if params[:3] == positional[:3] else [p for p in params if p not in positional[:3]]
        unknown = [p.name for p in rest if p.default is p.empty and not _is_mask_name(p.name)]
        expect(not unknown, "a function whose parameters after q, k, v are a mask or have defaults",
               f"`{unknown[0]}` with no default" if unknown else "", f"wrap it, e.g. lambda q, k, v, mask=None: "
               f"f(q, k, v, mask, {unknown[0]}=...)" if unknown else "")
        names = [p.name for p in rest]
    else:
        names = _parameter_names(layer) or []
    if num_heads is None:
        num_heads = 2 if d_model is None or d_model % 2 == 0 else 1
    if d_model is not None:
        _check_heads(d_model, num_heads, "the probe gives each head d_model / num_heads", options)
    head_dim = (d_model // num_heads) if d_model else 8
    return FunctionSubject(layer, mask_name=_choose_mask(names, mask), convention=mask, layout=layout or "bhtd",
                           d_model=head_dim * num_heads, num_heads=num_heads, head_dim=head_dim,
                           device=device or torch.device("cpu"), dtype=dtype or torch.float32)


def _module_subject(layer: nn.Module, *, d_model, num_heads, device, dtype, mask, layout, options) -> Subject:
    expect(layout is None, "no layout for a module (its inputs are (B, T, D))", spell("layout", layout, options),
           "leave layout out; it describes functions on per-head tensors")
    device, dtype = _module_device_dtype(layer, device, dtype)
    notes: list[str] = []
    hf = _is_huggingface(layer)
    torch_layer = isinstance(layer, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
    sized = layer.self_attn if torch_layer else layer  # torch's layers keep their sizes on self_attn
    given_d_model = d_model
    d_model, found_heads = _attr(sized, D_MODEL_NAMES, d_model), _attr(sized, HEAD_NAMES, num_heads)
    if d_model is None:  # no attribute names the width: from the heads' sizes, else the first projection
        head_dim = _attr(layer, ("head_dim", "head_size", "attention_head_size"), None)
        d_model = found_heads * head_dim if found_heads and head_dim else _first_linear_width(layer)
    if d_model is None and not hf and not torch_layer:  # bare nn.Parameter weights: a trial call
        d_model = _trial_width(layer, device, dtype)
        if d_model is not None:
            notes.append(f"d_model={d_model} found by a trial call (the width it takes and returns)")
    expect(d_model is not None, "a module with a d_model-like attribute (" + ", ".join(D_MODEL_NAMES) + ")",
           f"{type(layer).__name__} with none of them", "pass d_model=... to audit()"
           if not options or "d_model" not in options else f"pass {options['d_model']} D")
    widths = _linear_widths(layer)
    # A width its projections do not take (`--d-model 30` on a 32-wide layer) would fail every probe
    expect(not widths or d_model in widths, f"d_model to match the width of the layer's projections "
           f"(nn.Linear in_features {sorted(widths)})",
           spell("d_model", d_model, options) if given_d_model is not None
           else f"d_model={d_model} read from the layer's attributes",
           f"pass the layer's width, {spell('d_model', widths[0], options)}" if widths else "")
    if found_heads is None and not hf and not torch_layer:
        found_heads = _trial_heads(layer, d_model, device, dtype)
        if found_heads is not None:
            notes.append(f"num_heads={found_heads} read from a trial call (the head axis of its attention)")
    if found_heads is None:
        notes.append(f"num_heads=1 assumed: nothing on the layer names it, and a trial call did not show it "
                     f"({spell('num_heads', 4, options)} declares 4)")
    num_heads = found_heads or 1
    _check_heads(d_model, num_heads, "a head takes d_model / num_heads of the width", options)
    sig = read_signature(layer, library=hf)
    builtin_causal = any(getattr(layer, n, False) is True for n in CAUSAL_NAMES)
    convention, declared, extra = mask or "allowed", mask is not None, None
    if isinstance(layer, nn.TransformerDecoderLayer):
        # the whole layer: self-attention over tgt (the probed stream, its mask tgt_mask), cross-attention over
        # memory, a fixed encoder output that no probe changes and no mask covers, as in a real decoder
        form = "self_module"
        mask_names = ("tgt_mask",) if mask != "key_padding" else ("tgt_key_padding_mask",)
        convention, declared = mask or "mha_blocked", True
        notes.append(f"memory: a fixed encoder output of {MEMORY_TOKENS} tokens")
    elif isinstance(layer, nn.TransformerEncoderLayer):
        form = "self_module"
        mask_names = ("src_key_padding_mask",) if mask == "key_padding" else ("src_mask",)
        convention, declared = mask or "mha_blocked", True
    else:
        if sig.key is not None and sig.value is not None:
            form = "qkv_module"
        elif sig.memory is not None and (sig.memory in sig.fixed or getattr(layer, "is_cross_attention", False) is True
                                         or "Cross" in type(layer).__name__):
            form = "cross_module"
        else:
            form = "self_module"
        chosen = _choose_mask(sig.masks, mask, cross=form == "cross_module")
        mask_names = (chosen,) if chosen else ()
    if hf:
        builtin_causal = False  # its model builds the causal mask; `is_causal` tells the model, not the layer
        if mask is None:
            convention, declared = _huggingface_convention(layer), True
        if sig.rotary:
            rotary = _huggingface_rotary(layer, device)
            expect(rotary is not None, f"a rotary embedding class in {type(layer).__module__} built from the config",
                   "none that builds", "audit adapters.huggingface(layer, rotary=YourRotaryEmbedding(config))")
            extra = _rotary_extra(rotary)
            notes.append(f"position_embeddings from {type(rotary).__name__}")
    if mask_names and convention != "allowed" and not torch_layer:
        notes.append(f"{mask_names[0]}: {convention}")
    return ModuleSubject(layer, sig=sig, form=form, mask_names=mask_names, convention=convention, declared=declared,
                         builtin_causal=builtin_causal, extra=extra, notes=tuple(notes), d_model=d_model,
                         num_heads=num_heads, head_dim=max(d_model // num_heads, 1), device=device, dtype=dtype)


HINTS = {
    "additive": "float, 0 where attending is allowed and a large negative number where blocked",
    "key_padding": "bool (B, Tk), True = a padding key",
    "blocked": "bool, True = blocked",
}


def mask_convention_hint(subject: Subject, options: dict | None = None) -> str | None:
    """For a `mask_honoured` failure: the convention the layer's mask looks like it takes, from its
    parameter's name, annotation or default (never from what the layer did with the audit's mask), or None
    where nothing suggests one or the convention was declared. E.g. 'the layer's `attention_mask` may be
    additive (...): if it is, audit with mask="additive".'"""
    if subject.convention_declared or not subject.takes_mask or not subject.mask_names:
        return None
    name = subject.mask_names[0]
    fn = subject.layer.forward if isinstance(subject.layer, nn.Module) else subject.layer
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        param = None
    annotation = "" if param is None or param.annotation is param.empty else str(param.annotation)
    default = None if param is None else param.default
    if "padding" in name:
        convention, why = "key_padding", f"its name, `{name}`, says key padding"
    elif name in ("src_mask", "tgt_mask", "memory_mask"):
        convention, why = "blocked", f"`{name}` is torch's name for a mask with True = blocked"
    elif isinstance(default, Tensor) and default.is_floating_point():
        convention, why = "additive", f"the default of `{name}` is a float tensor"
    elif "float" in annotation.lower():
        convention, why = "additive", f"`{name}` is annotated {annotation}"
    elif name == "attention_mask":
        convention, why = "additive", "`attention_mask` is additive in Hugging Face-style layers"
    else:
        return None
    return (f"the mask may be in another convention: {why} ({HINTS[convention]}); if so, audit with "
            f"{spell('mask', convention, options)}, else the layer ignores or misapplies the mask")


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
           f"{spell('seq_len', seq_len, options)} ({type(seq_len).__name__})",
           "pass the context length you train with, e.g. seq_len=128")
    expect(seq_len is None or seq_len >= 1, "seq_len >= 1", spell("seq_len", seq_len, options),
           "pass the context length you train with, e.g. seq_len=128")
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    limit = context_length(subject.layer)
    if limit is not None and length > limit[0]:
        seen = spell("seq_len", length, options) + (" (the default)" if seq_len is None else "")
        raise AuditUsageError(f"expected seq_len <= {limit[0]}, the longest sequence the layer takes "
                              f"({limit[1]}); got {seen}. Fix: pass {spell('seq_len', limit[0], options)} or less")
    return length


__all__ = ["LAYOUTS", "MASK_CONVENTIONS", "AuditUsageError", "LayerReturnedNothingUsable", "Output", "Signature",
           "Subject", "check_seq_len", "context_length", "make_subject", "mask_convention_hint", "read_signature"]
