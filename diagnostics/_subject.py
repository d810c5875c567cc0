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
default that none of these names is misuse, named in the message, which suggests declaring the call:
`call=lambda layer, x, memory, mask: layer(x, xa=memory, mask=mask)` (the call's own parameters say the form:
(layer, x[, mask]) self-attention, (layer, query, memory[, mask]) cross-attention, (layer, query, key,
value[, mask]) separate keys and values).

The mask reaches the layer in the convention it takes (diagnostics._masks: a meaning and a shape): declared
(`mask="additive:B,Tq,Tk"`, `mask="key_padding"`, a `MaskConvention`), known for the library the layer comes
from (torch's transformer layers: True = blocked, per head; Hugging Face: additive in eager mode, bool in sdpa
mode), or stated by the layer itself (a parameter named `*key_padding_mask*`, or its docstring: "True for
positions to mask"). The convention is never chosen from what the layer does with a mask: an inverted mask must
stay a finding (what the layer does is only ever a hint, in the finding: see diagnostics._mask_hints).

Time runs along dimension `time_dim` of inputs and outputs: 2 for functions, 1 for modules.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib
import inspect
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ._errors import AuditUsageError, ProbeNotTaken, expect
from ._guard import untouched
from .adapters import image_channels, image_seq_len
from ._masks import (
    SHORTCUTS,
    MaskConvention,
    convert_mask,
    expressible,
    known_convention,
    mask_convention,
    stated_in_text,
    stated_layout_in_text,
)

QUERY_NAMES = ("x", "hidden_states", "query", "q", "tgt", "src", "inputs", "input", "hidden", "h", "xq")
KEY_NAMES = ("key", "k", "keys", "xk")  # xq, xk, xv: vit-pytorch's dense cross-layer attention, Llama's reference
VALUE_NAMES = ("value", "v", "values", "xv")
# queries that are the keys too (Reformer's shared-QK attention, `forward(qk, v)`): the query's stream, the keys made
# from it inside the layer, so the audit gives it one stream (self-attention) and no key of its own
QK_NAMES = ("qk", "shared_qk")
MEMORY_NAMES = ("key_value_states", "encoder_hidden_states", "memory", "context", "kv")
# in the order one is chosen when a layer has several; `*_key_padding_mask` are masks too
MASK_NAMES = ("mask", "attn_mask", "attention_mask", "src_mask", "tgt_mask", "memory_mask", "encoder_attention_mask",
              "key_padding_mask")
# a mask named by the stream whose keys it covers, after those: `input_mask` (local-attention's, Sinkhorn's,
# Reformer's), `context_mask` (x-transformers', conformer's), `kv_mask`, `padding_mask`, `context_padding_mask`.
# A query's own (`q_mask`, `query_mask`), a head's (`head_mask`) and a pattern's (`block_mask`) are not the keys' mask
STREAM_MASK = re.compile(r"(input|inputs|pad|padding|key|keys|kv|context|ctx|memory|mem|encoder|src|source)_"
                         r"(padding_|attn_|attention_)?mask")
MEMORY_MASK = re.compile(r"(encoder|memory|mem|context|ctx|kv|key|keys)_.*mask")
"""A mask over a memory's keys, chosen first in a cross-attention: `encoder_attention_mask`, `context_mask`."""
# left at their defaults (or None where a library makes them required): caches, flags, positions, biases
LEAVE_NAMES = ("past_key_value", "past_key_values", "layer_past", "kv_cache", "cache", "past", "use_cache",
               "output_attentions", "output_hidden_states", "return_dict", "head_mask", "layer_head_mask",
               "cache_position", "position_ids", "need_weights", "average_attn_weights", "is_causal",
               "query_length", "position_bias", "alibi", "layer_idx", "sliding_window")
# a cache of past keys and values, in the order one is chosen (see ModuleSubject.cache_name)
CACHE_NAMES = ("past_key_value", "past_key_values", "layer_past", "kv_cache", "cache", "past")
LAYOUTS = ("bhtd", "bthd")  # a function's per-head tensors: (B, H, T, d) or flash-attn's (B, T, H, d)
MODULE_LAYOUTS = ("btd", "tbd")  # a module's tokens: batch first (B, T, D), or sequence first (T, B, D)
D_MODEL_NAMES = ("d_model", "embed_dim", "hidden_size", "n_embd", "dim", "model_dim")
HEAD_NAMES = ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads")
CAUSAL_NAMES = ("causal", "is_causal")
# Attributes of a layer that builds its own attention pattern (a window, chunks, a prefix, documents, a mask_mod):
# one that is not None says so, as a truthy `causal` does for the causal mask.
PATTERN_NAMES = ("window", "window_size", "sliding_window", "chunk", "attention_chunk_size", "prefix", "documents",
                 "mask_mod")
# The longest sequence a layer declares it takes (nanoGPT's block_size, Hugging Face's config names).
CONTEXT_NAMES = ("block_size", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_seq_length",
                 "context_length")
MASK_BUFFER_NAMES = ("bias", "mask", "causal_mask", "attn_mask")  # a precomputed (.., N, N) causal mask
# Of CONTEXT_NAMES, those a flash-style (tiled) attention gives its tile: read as a context only where the layer does
# not run beyond it (see `probe_context`)
TILE_NAMES = ("block_size",)
DEFAULT_SEQ_LEN = 16


def declares_pattern(layer) -> bool:
    """The layer builds its own attention pattern: one of PATTERN_NAMES holds a setting (a width, a size, a flag).
    A method (or a module) of that name is a step of the layer's code (`def sliding_window(self, scores)`), not a
    declaration; only `mask_mod` is a function by nature (flex attention's), and counts whether stored or defined."""
    return any(getattr(layer, name, None) is not None and (name == "mask_mod" or not callable(getattr(layer, name)))
               for name in PATTERN_NAMES)


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
    builtin_pattern: bool = False  # the layer declares that it builds its own attention pattern (a window, ...)
    # its causality is torch's `is_causal` flag, whose contract (SDPA's, nn.MultiheadAttention's) is "attn_mask or
    # is_causal": a mask given instead carries the causality itself (see `mask_carries_causality`)
    mask_carries_causality: bool = False
    time_dim: int
    mask_convention: MaskConvention = SHORTCUTS["allowed"]  # how the layer takes its mask (diagnostics._masks)
    # who chose it: "default" (nothing said), "user" (mask=...), "library" (torch's and Hugging Face's layers) or
    # "layer" (what the layer states: its mask parameter's name, its docstring); `convention_why` says how
    convention_by: str = "default"
    convention_why: str = ""
    call = None  # a declared call(layer, *streams, mask) (see make_subject), or None: called by its signature
    mask_names: tuple[str, ...] = ()  # the parameters that receive the mask
    notes: tuple[str, ...] = ()  # what the audit assumed, said in the report's first line
    # queries of the layer's own (a pooling head's learned query, a latent array), not one per token: `queries=Q`
    # declared, or kept by a layer in place whose model's call showed them (`InPlace.own_queries`). The output then
    # has Q rows ((B, D) read as (B, 1, D) where Q = 1), the weights are (Q, Tk) and a mask reaches the layer per key
    own_queries: int | None = None

    def __init__(self, layer, *, d_model: int, num_heads: int, head_dim: int, device, dtype):
        self.layer, self.d_model, self.num_heads, self.head_dim = layer, d_model, num_heads, head_dim
        self.device, self.dtype = device, dtype

    @property
    def convention(self) -> str:
        """The mask convention's spelling: its shortcut ("key_padding") or MEANING:SHAPE ("additive:B,Tq,Tk")."""
        return str(self.mask_convention)

    @property
    def cross_declared(self) -> bool:
        """The layer says it attends a memory, so a raise at Tq != Tk is a failure, never 'self-attention only': a
        memory parameter (or a declared call with one), torch's MultiheadAttention, key and value parameters that
        may be left out (self-attention when omitted, a memory when given: the reference's forward(query,
        key=None, value=None)), an `is_cross_attention` flag or a class named for cross-attention."""
        sig = getattr(self, "sig", None)
        return (self.form in ("cross_module", "torch_mha") or bool(sig is not None and sig.optional_memory)
                or getattr(self.layer, "is_cross_attention", False) is True or "Cross" in type(self.layer).__name__)

    def declarations(self) -> dict:
        """The make_subject() arguments that rebuild this subject on a copy of its layer (the float64 twin)."""
        return {"mask": self.mask_convention if self.convention_by == "user" else None,
                "layout": getattr(self, "layout", None), "call": self.call, "cross": self.form == "cross_module",
                "queries": self.own_queries}

    def make(self, gen: torch.Generator, batch: int, t: int, *, heads: int | None = None) -> Tensor:
        """One standard-normal input stream in the layer's layout, drawn from `gen` on the CPU (in float64
        for float64 layers, float32 otherwise), so every device draws the same numbers."""
        shape = self.shape(batch, t, heads=heads)
        draw = torch.float64 if self.dtype == torch.float64 else torch.float32
        return torch.randn(shape, generator=gen, dtype=draw).to(device=self.device, dtype=self.dtype)

    def shape(self, batch: int, t: int, *, heads: int | None = None) -> tuple[int, ...]:
        return (batch, t, self.d_model)

    def expected_out_shape(self, batch: int, t_q: int, *, heads: int | None = None) -> tuple[int, ...]:
        # the width it takes, unless its model's own call returned another (`InPlace.returned_width`: Zamba2's shared
        # attention takes [hidden states; embeddings], 2D wide, and returns D); as many rows as its queries of its own
        # (`own_queries`: declared, or shown by its model's call: a class token's, a pooling head's), else one a token
        return (batch, self.own_queries or t_q, getattr(self.layer, "returned_width", None) or self.d_model)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None) -> Output:
        """Call the layer with `allowed` (B, Tq, Tk) in its convention. A mask its convention cannot hold at once
        reaches it in parts, in one batched call: a (B, Tk) key mask that differs between queries one query at a
        time (each batch row repeated once per query, each query's output row read from its own copy), a
        (Tq, Tk) mask that differs between batch rows one batch row at a time."""
        if allowed is not None and self.takes_mask and self.own_queries:
            allowed = own_query_mask(allowed, self.own_queries)
        if allowed is not None and self.takes_mask and not expressible(allowed, self.mask_convention):
            if self.mask_convention.per_key:
                return _per_query(self._call, query, key, value, allowed, self.time_dim)
            return _per_batch(self._call, query, key, value, allowed, self.time_dim)
        got = _unpack(self._call(query, key, value, allowed), query, key, self.time_dim, t_q=self.own_queries)
        if self.own_queries == 1 and got.out.dim() == 2:  # a pooling head's (B, D): its one query's row
            return Output(got.out.unsqueeze(1), got.weights)
        return got

    def _call(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None):
        raise NotImplementedError

    def _mask(self, allowed: Tensor, heads: int | None = None) -> Tensor:
        """`allowed` (B, Tq, Tk), True = may attend, in the layer's convention (`heads`: for a B*H shape)."""
        return convert_mask(allowed, self.mask_convention, dtype=self.dtype, num_heads=heads or self.num_heads)

    def with_convention(self, convention: MaskConvention) -> Subject:
        """A copy of this subject that gives the layer its mask in `convention` (for hints: never the audit's)."""
        other = copy.copy(self)
        other.mask_convention, other.convention_by = convention, "hint"
        return other

    def describe(self) -> str:
        name = (getattr(self.layer, "audit_name", None)  # adapters name the layer they wrap
                or getattr(self.layer, "__qualname__", None) or type(self.layer).__qualname__)
        # a size a note already gives (how it was found: "num_heads=1 assumed: ...") is said once, in the note
        sizes = [f"{field}={value}" for field, value in (("d_model", self.d_model), ("num_heads", self.num_heads))
                 if not any(note.startswith(f"{field}=") for note in self.notes)]
        Q = self.own_queries
        if Q and "of its own" not in name:  # declared (a layer in place names them in its own name)
            sizes.append(f"{Q} quer{'y' if Q == 1 else 'ies'} of its own (queries={Q})")
        return f"{name} ({', '.join([FORM_WORDS.get(self.form, self.form), *sizes, *self.notes])})"


# how each form of target is named to users (the form itself is the audit's internal name)
FORM_WORDS = {"function": "a function of q, k, v", "self_module": "a module given one stream",
              "cross_module": "a module given queries and a memory", "qkv_module": "a module given query, key and value"}


def own_query_mask(allowed: Tensor, queries: int) -> Tensor:
    """`allowed` (B, Tq, Tk), one row per token's query, as (B, Q, Tk) for a layer with `queries` queries of its own:
    a mask the same for every query (padding, keys blocked for all) holds for its queries too; one that differs
    between queries (a causal mask) has no meaning for queries that are no token's, and that probe cannot be given
    (`ProbeNotTaken`: skipped with the reason, never a `runs` failure)."""
    B, Tq, Tk = allowed.shape  # batch, the audit's queries, keys
    if not bool((allowed == allowed[:, :1]).all()):
        raise ProbeNotTaken(f"the layer's {queries} quer{'y' if queries == 1 else 'ies'} of its own "
                            f"(queries={queries}) are no token's, so a mask that differs between the tokens' queries (causal, one query's "
                            f"keys blocked) has no meaning for them; masks the same for every query are given")
    return allowed[:, :1].expand(B, queries, Tk)


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
    got, weights = _observed_call(call, q, k, v, rows, time_dim, Tq, Tk)

    def own_rows(t: Tensor, dim: int) -> Tensor:  # (B*Tq, .., Tq@dim, ..) -> (B, .., Tq@dim, ..)
        t = t.reshape(B, Tq, *t.shape[1:])
        return torch.diagonal(t, dim1=1, dim2=dim + 1).movedim(-1, dim)

    out = own_rows(got.out, time_dim)
    ok = weights is not None and weights.dim() in (3, 4) and weights.shape[0] == B * Tq
    return Output(out, own_rows(weights.detach(), weights.dim() - 2) if ok else None)


def _per_batch(call, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, time_dim: int) -> Output:
    """Each batch row called alone with its own (Tq, Tk) mask, the outputs (and weights) stacked again."""
    B, Tq, Tk = allowed.shape  # batch, queries, keys
    outs, weights = [], []
    for b in range(B):
        rows = {}

        def row(x, rows=rows, b=b):  # one slice per stream, so that one stream stays one tensor (x, x, x)
            if id(x) not in rows:
                rows[id(x)] = x[b:b + 1]
            return rows[id(x)]

        got, w = _observed_call(call, row(query), row(key), row(value), allowed[b:b + 1], time_dim, Tq, Tk)
        outs.append(got.out)
        weights.append(w)
    same = all(w is not None and w.shape == weights[0].shape for w in weights)
    return Output(torch.cat(outs), torch.cat([w.detach() for w in weights]) if same else None)


def _observed_call(call, q, k, v, allowed, time_dim: int, t_q: int, t_k: int) -> tuple[Output, Tensor | None]:
    """One call, observed: its output and its weights (returned if they are weights, else its softmax's)."""
    from ._observe import Observer  # torch's dispatch machinery, loaded only for this

    observer = Observer()
    with observer:
        got = _unpack(call(q, k, v, allowed), q, k, time_dim)
    observed = _observed_weights(observer.record, t_q, t_k)
    weights = got.weights if got.weights is not None and not_weights(got.weights, observed) is None else observed
    return got, weights


def not_weights(returned: Tensor, observed: Tensor | None) -> str | None:
    """Why a (..., Tq, Tk) tensor a layer returns beside its output is not its attention weights, or None if it
    may be: it has negative entries (no distribution has; scores and logits do) while the same call shows a
    softmax over (Tq, Tk) (or a fused attention) to read the weights from instead. Wrong weights that are
    non-negative (a mask applied after the softmax, dropout in eval, a softmax over queries) stay the weights,
    and so does a tensor with negative entries where no softmax was observed (no softmax at all): those fail
    weight_row_sums, as they should. Never: 'its rows do not sum to 1', which is the bug that detector finds."""
    if observed is None or not returned.is_floating_point():
        return None
    least = float(returned.detach().min()) if returned.numel() else 0.0  # no copy: NaN only where there is one
    if math.isnan(least):
        least = float(returned.detach().nan_to_num(nan=0.0).min())
    if least >= -NOT_A_DISTRIBUTION:
        return None
    return (f"the layer's second output has negative entries (the least {least:.3g}), so it is not a distribution "
            f"over keys (scores or logits?)")


NOT_A_DISTRIBUTION = 1e-2
"""A returned tensor more negative than this anywhere is not attention weights. Weights computed in bfloat16 round
to >= 0 (softmax outputs are never negative, and rounding keeps the sign); a negative entry of -1e-2 is a score,
not a rounding error (logits on the standard probe are O(1): the least is about -3 for q·k/sqrt(d) at d=8)."""


def _observed_weights(record, t_q: int, t_k: int) -> Tensor | None:
    """The last softmax over (Tq, Tk) scores in an observed call, or the weights of its fused attention."""
    for sm in reversed(record.softmaxes):
        if tuple(sm.output.shape[-2:]) == (t_q, t_k):
            return sm.output
    for f in reversed(record.fused):
        if f.q.shape[-2] == t_q and f.k.shape[-2] == t_k:
            from ._observe import (
                fused_weights,  # torch's dispatch machinery, loaded only where it is used
            )

            return fused_weights(f)
    return None


_GRAPH_KEPT = contextvars.ContextVar("graph_kept", default=False)


@contextlib.contextmanager
def graph_kept():
    """Inside, the subject's outputs keep their autograd graph (the gradient checks' float64 copy, `graph_call`):
    elsewhere they are detached. The output is the subject's, laid out and cut as every probe reads it: a mask
    given in parts (`_per_query`'s row of each copy, `_per_batch`'s rows) included."""
    token = _GRAPH_KEPT.set(True)
    try:
        yield
    finally:
        _GRAPH_KEPT.reset(token)


def _out_of(out: Tensor) -> Tensor:
    """The output as the subject returns it: detached, or with its graph inside `graph_kept`."""
    return out if _GRAPH_KEPT.get() else out.detach()


def _unpack(result, query: Tensor, key: Tensor, time_dim: int, t_q: int | None = None) -> Output:
    """`out` or `(out, weights, ...)`; anything else is a finding. Of the other returned tensors, the
    weights are the one shaped like them, (B, [H,] Tq, Tk): a returned (k, v) cache or a bias is not (`t_q`: the
    layer's own queries, where it has them, else the query's length)."""
    if isinstance(result, (tuple, list)):
        if not result:
            raise LayerReturnedNothingUsable("returned an empty tuple")
        out, rest = result[0], result[1:]
    else:
        out, rest = result, ()
    if not isinstance(out, Tensor):
        raise LayerReturnedNothingUsable(f"returned {type(out).__name__}, expected a tensor or (tensor, weights)")
    batch, t_q, t_k = query.shape[0], t_q or query.shape[time_dim], key.shape[time_dim]
    weights = next((w for w in rest if isinstance(w, Tensor) and w.is_floating_point() and w.dim() in (3, 4)
                    and w.shape[0] == batch and tuple(w.shape[-2:]) == (t_q, t_k)), None)
    return Output(_out_of(out), None if weights is None else weights.detach())


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
    name = name.lower()  # `Mask`, `attn_Mask`: the names are read in any case, as the streams' are
    return name in MASK_NAMES or name.endswith("_key_padding_mask") or STREAM_MASK.fullmatch(name) is not None


def _choose_mask(names, convention: MaskConvention | None, *, cross: bool = False) -> str | None:
    """The mask parameter to give the audit's mask: a key-padding one where a (B, Tk) convention is declared,
    the memory's mask in a cross-attention (`MEMORY_MASK`), else the first of MASK_NAMES the layer has, else the first
    named by its stream (`STREAM_MASK`)."""
    masks = [n for n in names if _is_mask_name(n)]
    if not masks:
        return None
    if convention is not None and convention.per_key:
        padding = [n for n in masks if "key_padding" in n.lower()]
        if padding:
            return padding[0]
    def rank(name: str) -> tuple[int, int]:
        low = name.lower()
        return (0 if cross and MEMORY_MASK.fullmatch(low) else 1,
                MASK_NAMES.index(low) if low in MASK_NAMES else len(MASK_NAMES))

    return min(masks, key=rank)


class FunctionSubject(Subject):
    """f(q, k, v, mask=None): q, k and v positionally, the mask under its own name. With layout "bthd"
    (flash-attn's) the probes' (B, H, T, d) tensors are passed as (B, T, H, d), contiguous where they
    were, and the output is read back: the detectors see one layout."""

    form, separate_kv, builtin_causal, time_dim = "function", True, False, 2

    def __init__(self, layer, *, mask_name: str | None, convention: MaskConvention, by: str, why: str = "",
                 layout: str, call=None, **kw):
        super().__init__(layer, **kw)
        self.mask_name, self.layout, self.call = mask_name, layout, call
        self.takes_mask = mask_name is not None
        self.mask_names = (mask_name,) if mask_name else ()
        self.mask_convention, self.convention_by, self.convention_why = convention, by, why
        notes = [f"layout={layout}"] if layout != "bhtd" else []
        notes += [convention_note(mask_name, convention, by, why)] if mask_name and by != "default" else []
        notes += ["called through the declared call"] if call is not None else []
        self.notes = tuple(n for n in notes if n)

    def shape(self, batch, t, *, heads=None):
        return (batch, heads or self.num_heads, t, self.head_dim)

    def expected_out_shape(self, batch, t_q, *, heads=None):
        return (batch, heads or self.num_heads, t_q, self.head_dim)

    def _call(self, query, key, value, allowed):
        heads = query.shape[1]  # (B, H, T, d): the probe's own head count (runs calls H=1 too)
        mask = None if allowed is None or not self.takes_mask else self._mask(allowed, heads)
        if self.layout == "bthd":
            query, key, value = (_swap_time_heads(x) for x in (query, key, value))  # (B, T, H, d)
        if self.call is not None:  # a declared call gets its mask parameter always, None for no mask
            result = self.call(self.layer, query, key, value, **({self.mask_name: mask} if self.takes_mask else {}))
        else:  # the layer itself only where there is a mask: its own default otherwise
            result = self.layer(query, key, value, **({} if mask is None else {self.mask_name: mask}))
        if self.layout == "bthd":
            result = _swap_result(result)  # (B, H, T, d)
        return result


def _swap_time_heads(x: Tensor) -> Tensor:
    """(B, H, T, d) <-> (B, T, H, d), keeping the input contiguous if it was (the `runs` probe of
    non-contiguous inputs stays non-contiguous)."""
    y = x.transpose(1, 2)
    return y.contiguous() if x.is_contiguous() else y


def _swap_batch_time(x: Tensor) -> Tensor:
    """(B, T, D) <-> (T, B, D), contiguous where the input was (the `runs` probe of non-contiguous inputs stays so)."""
    if x.dim() < 3:
        return x
    y = x.transpose(0, 1)
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
    optional_memory: bool = False  # key and value (or the memory) may be left out: self-attention, else a memory
    # required positional parameters of names the audit does not know (`forward(x, cond)`, Perceiver's `latents`):
    # left out of every call, so each raises; `runs` then tries what they take (`runs._required_input`)
    streams: tuple[str, ...] = ()
    by_name: bool = True  # the query read by its name; False: the first parameter of no known name taken as it
    first: str = ""  # forward's first parameter, which a declared call passes x to positionally
    # key and value parameters without a default of a shared-QK layer (`forward(qk, v)`: its keys are its queries):
    # given the query's stream, as self-attention; a lone key or value of another layer is a stream `runs` tries
    required_kv: tuple[str, ...] = ()


class ModuleSubject(Subject):
    """A module called by keyword: its query stream (and key/value, or memory) and its masks under the
    names its forward gives them; every other parameter left at its default."""

    time_dim = 1

    def __init__(self, layer, *, sig: Signature, form: str, mask_names: tuple[str, ...], convention: MaskConvention,
                 by: str, why: str = "", builtin_causal: bool, builtin_pattern: bool = False, extra=None, call=None,
                 notes: tuple[str, ...] = (), layout: str = "btd", **kw):
        super().__init__(layer, **kw)
        self.sig, self.form, self.mask_names, self.call = sig, form, mask_names, call
        self.layout = layout  # "tbd": the layer takes (and returns) its tokens sequence-first
        self.separate_kv = form != "self_module"
        self.separate_value = form == "qkv_module"
        self.takes_mask = bool(mask_names)
        self.mask_convention, self.convention_by, self.convention_why = convention, by, why
        self.builtin_causal, self.extra, self.notes = builtin_causal, extra, notes
        self.builtin_pattern = builtin_pattern
        self.fixed_memory = isinstance(layer, nn.TransformerDecoderLayer)  # an encoder's output, not the queries

    def _call(self, query, key, value, allowed):
        if self.form == "self_module" and not (query is key and (key is value or self.sig.required_kv)):
            raise AuditUsageError("internal: a self-attention module takes one input stream")
        if self.call is not None:  # the declared call: its streams by form, the mask under the call's own name
            streams = {"self_module": (query,), "cross_module": (query, key)}.get(self.form, (query, key, value))
            mask = {self.mask_names[0]: None if allowed is None else self._mask(allowed)} if self.takes_mask else {}
            return self._tokens_back(self.call(self.layer, *self._tokens_in(*streams), **mask))
        return self._tokens_back(self.layer(**self._kwargs(query, key, value, allowed)))

    def _tokens_in(self, *streams: Tensor) -> tuple:
        """The streams as the layer takes them: sequence-first (T, B, D) under layout "tbd", one tensor given as
        several streams still one tensor (a layer may test `query is key`), contiguous where it was."""
        if self.layout != "tbd":
            return streams
        moved: dict = {}
        return tuple(moved.setdefault(id(x), _swap_batch_time(x)) for x in streams)

    def _tokens_back(self, result):
        """The layer's result with its output batch first again (its first tensor, or its first element's)."""
        if self.layout != "tbd":
            return result
        if isinstance(result, Tensor):
            return _swap_batch_time(result)
        if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
            return (_swap_batch_time(result[0]), *result[1:])
        return result

    @property
    def cache_name(self) -> str | None:
        """The parameter through which forward takes a cache of past keys and values, where the audit can
        drive it: a self-attention module's (a Hugging Face layer's only with its `layer_idx`, which its
        Cache object files keys under)."""
        if self.form != "self_module" or self.call is not None:
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
        return self._tokens_back(self.layer(**kwargs))

    def _kwargs(self, query, key, value, allowed, *, start: int = 0) -> dict:
        kwargs = dict(self.sig.fixed)
        if self.extra is not None:
            kwargs.update(self.extra(query, start))
        query, key, value = self._tokens_in(query, key, value)
        kwargs[self.sig.query] = query
        if self.form == "self_module":  # the value a shared-QK core requires (`forward(qk, v)`): the same stream,
            kwargs.update(dict.fromkeys(self.sig.required_kv, value))  # or its values changed alone (keys_matter)
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
    mask_convention, convention_by = SHORTCUTS["mha_blocked"], "library"

    def __init__(self, layer: nn.MultiheadAttention, *, need_weights: bool = True, **kw):
        super().__init__(layer, **kw)
        self.need_weights = need_weights
        self.mask_names = ("attn_mask",)
        # add_bias_kv / add_zero_attn append a key of their own that no mask and no input reaches
        self.extra_keys = layer.bias_k is not None or layer.add_zero_attn
        if layer.kdim != layer.embed_dim or layer.vdim != layer.embed_dim:
            self.notes = ((f"kdim={layer.kdim}, vdim={layer.vdim}: keys and values are the key stream repeated "
                           f"to that width"),)

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
        return Output(_out_of(out), None if weights is None else weights.detach())


def _widen(x: Tensor, width: int) -> Tensor:
    """(B, T, D) -> (B, T, width): the features repeated (or cut) to `width`; x itself when it fits."""
    if x.shape[-1] == width:
        return x
    times = -(-width // x.shape[-1])
    return x.repeat(*([1] * (x.dim() - 1)), times)[..., :width]


def _attr(layer, names, given):
    return _read_attr(layer, names, given)[0]


def _read_attr(layer, names, given) -> tuple[int | None, str]:
    """A size and where it was read, for the report's first line: "declared", "its `embed_dim`", "its config's
    `hidden_size`", or "" when nothing names it."""
    if given is not None:
        return given, "declared"
    for n in names:
        value = getattr(layer, n, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"its `{n}`"
    config = getattr(layer, "config", None)  # Hugging Face layers keep sizes on their config
    for n in names:
        value = getattr(config, n, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"its config's `{n}`"
    return None, ""


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
    expect(own_device.type != "meta", "a layer whose parameters hold values (on cpu or cuda)",
           "its parameters on the meta device (shapes only, no values: nothing to measure)",
           "materialise it first, e.g. layer.to_empty(device=\"cpu\") then load or initialise its weights "
           "(layer.load_state_dict(...))")
    expect(dtype is None or dtype == own_dtype, f"dtype={own_dtype} (the layer's parameters)", f"dtype={dtype}",
           f"convert the layer first (layer.to({dtype})) or leave dtype out")
    expect(device is None or torch.device(device) == own_device, f"device={own_device} (the layer's parameters)",
           f"device={device}", "move the layer first (layer.to(device)) or leave device out")
    return own_device, own_dtype


def spell(name: str, value, options: dict | None) -> str:
    """An option as the user wrote it: `d_model=30` for audit(), `--d-model 30` on the command line (a flag alone
    for True: `--cross`)."""
    flag = (options or {}).get(name)
    if flag is None:
        return f"{name}={value!r}"
    return flag if value is True else f"{flag} {value}"


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
    expect(device.type != "meta", "a device that holds values (cpu or cuda)",
           f"{spell('device', str(device), options)} (shapes only, no values: nothing to measure)",
           f"leave device out, or pass {spell('device', 'cpu', options)}")
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
    sig = forward_signature(layer)
    if sig is None:
        raise AuditUsageError(f"expected a module whose forward has a readable signature; got "
                              f"{type(layer).__name__}.forward. Fix: wrap the layer in a function "
                              f"f(q, k, v, mask=None) or a module forward(x, mask=None)")
    return [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def forward_signature(layer: nn.Module) -> inspect.Signature | None:
    """The signature of `layer.forward`: Python's, else, for a TorchScript module that keeps none (a scripted module's
    deepcopy, the audit's float64 copy of it; one from torch.jit.load), the one its compiled schema gives (names and
    defaults, `self` left out); None where neither can be read."""
    try:
        return inspect.signature(layer.forward)
    except (TypeError, ValueError):
        schema = getattr(layer.forward, "schema", None)
    if schema is None:
        return None
    return inspect.Signature([inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=a.default_value if a.has_default_value() else
                                                inspect.Parameter.empty) for a in schema.arguments[1:]])


def _first(params, names) -> str | None:
    """The first parameter whose name, in any case, is one of `names`: `forward(Q, K, V)` names q, k and v."""
    return next((p.name for p in params if p.name.lower() in names), None)


def read_signature(layer: nn.Module, *, library: bool = False, options: dict | None = None) -> Signature:
    """Which of forward's parameters takes what, by name. `library`: a Hugging Face layer, whose
    `position_embeddings` the audit builds from its model family's rotary class. A required positional parameter
    of no known name is a second stream, left out of every call for `runs` to find what it takes (`streams`); a
    required keyword-only one is misuse, and the message suggests declaring the call (`call=`), which passes it."""
    params = _forward_parameters(layer)
    query, key, value = _first(params, QUERY_NAMES + QK_NAMES), _first(params, KEY_NAMES), _first(params, VALUE_NAMES)
    memory = _first(params, MEMORY_NAMES)
    masks = tuple(p.name for p in params if _is_mask_name(p.name))
    fixed, unknown, rotary = {}, [], False
    for p in params:
        if p.name in (query, key, value, memory) or _is_mask_name(p.name):
            if p.name == memory and p.default is p.empty:
                fixed[p.name] = None  # a required memory: given on every call (see ModuleSubject._call)
            continue
        if p.name.lower() in LEAVE_NAMES:
            if p.default is p.empty:
                fixed[p.name] = None  # required by the library, None meaning "none"
        elif p.name == "position_embeddings" and library:
            rotary = True
        elif p.default is p.empty:
            unknown.append(p)
    by_name = query is not None
    if query is None and unknown and unknown[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                         inspect.Parameter.POSITIONAL_OR_KEYWORD):
        query = unknown.pop(0).name  # one unnamed input stream: the query
    shown = f"forward{forward_signature(layer)}"
    expect(query is not None, "forward(query, key, value, mask=None) or forward(x, mask=None)", shown,
           f"declare how to call it, {_call_example(options, 'layer(x, mask=mask)')}, or wrap the layer in a "
           f"function f(q, k, v, mask=None)")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    # a second input stream (a memory named `xa`, `y`, `cond`): what it takes is tried on the layer (`runs`)
    streams = tuple(p.name for p in unknown if p.kind in positional)
    unknown = [p for p in unknown if p.kind not in positional]
    if unknown:  # something else the layer needs, by keyword only (`*, rel_pos`)
        _unknown_required(layer, unknown[0].name, _call_example(options, f"layer(x, {unknown[0].name}=..., mask=mask)"))
    optional = [p for p in params if p.name in (key, value, memory) and p.name is not None]
    optional_memory = bool(optional) and all(p.default is not p.empty for p in optional)
    required_kv = tuple(p.name for p in params if p.name in (key, value) and p.default is p.empty)
    if required_kv and query.lower() not in QK_NAMES and not (key and value):
        # a key or a value required alone (`forward(q, k)`, `forward(x, v)`): the same stream again, or a memory its
        # keys and values are both made from? Its name does not say; a second stream that `runs` tries, as any other
        streams, required_kv = streams + required_kv, ()
        key, value = (None if n in streams else n for n in (key, value))
    return Signature(query, key, value, memory, masks, fixed, rotary, optional_memory, streams, by_name,
                     params[0].name if params else "", required_kv)


def _unknown_required(layer: nn.Module, name: str, example: str):
    """Misuse: a required parameter `name` of forward that the audit neither knows nor tries (one passed by keyword
    only, or a stream beside a layer's key and value or memory); the message names the call to declare."""
    raise AuditUsageError(
        f"expected forward's parameters without a default to be inputs the audit knows (a query such as x "
        f"or hidden_states, key and value, a memory, a mask); got `{name}` in forward{forward_signature(layer)}"
        f". Fix: declare how to call the layer, {example}; or wrap the layer so that it gets {name}, e.g. a module "
        f"whose forward(x, mask=None) calls it with {name}")


def _refuse_streams(layer: nn.Module, sig: Signature, form: str, options: dict | None) -> None:
    """A required stream of a name the audit does not know is tried only where the layer takes one stream of its
    own (`runs._required_input`); beside key and value, or a memory, it is misuse, said before any probe."""
    if sig.streams and form != "self_module":
        name = sig.streams[0]
        _unknown_required(layer, name, _call_example(options, f"layer(x, {name}=..., mask=mask)"))


def stream_calls(name: str, options: dict | None = None, *, query: str | None = None,
                 mask_name: str | None = "mask") -> str:
    """How to declare the call of a layer that wants a second stream `name` (`forward(x, y)`, "for self attention,
    x=y"), self-attention first: the audit cannot tell whether it is the same stream again or a memory. `query`:
    the parameter x goes to, where it is not forward's first (None: x passed first); `mask_name`: the layer's
    mask parameter (None: it takes none)."""
    cross = (options or {}).get("cross", "cross=True")
    to = "x" if query is None else f"{query}=x"
    mask = "" if mask_name is None else f", {mask_name}=mask"
    return (f"{_call_example(options, f'layer({to}, {name}=x{mask})', mask=mask_name is not None)} if `{name}` is "
            f"the same stream again (self-attention), or "
            f"{_call_example(options, f'layer({to}, {name}=memory{mask})', memory=True, mask=mask_name is not None)} "
            f"with {cross} if it is a memory")


def stream_call(name: str, given: str, mask_name: str | None, options: dict | None = None, *,
                query: str | None = None) -> str:
    """The declared call that gives the layer's stream `name` the expression `given` of x ("x": the same stream
    again, self-attention; "x[:, :0]": no tokens, under which a joint attention, both streams concatenated along the
    sequence, is self-attention over x), and the mask, if the layer takes one, under its own name. `query`: the
    parameter x goes to, where it is not forward's first (None: x passed first)."""
    params = "layer, x, mask" if mask_name else "layer, x"
    x = "x" if query is None else f"{query}=x"
    body = f"layer({x}, {name}={given}" + (f", {mask_name}=mask)" if mask_name else ")")
    return call_declaration(params, body, options)


def call_declaration(params: str, body: str, options: dict | None = None) -> str:
    """A declared call as the front end writes it: `call=lambda PARAMS: BODY` in Python, a function named by `--call
    MODULE:FUNCTION` on the command line."""
    flag = (options or {}).get("call")
    if flag is None:
        return f"call=lambda {params}: {body}"
    return f"{flag} mymodule:call with def call({params}): return {body}"


def left_streams(subject: Subject) -> list[str]:
    """Parameters of a module's forward that the audit leaves out (a required stream of a name it does not know,
    `forward(x, cond)`) or at their default None though they are not among the names it knows (`forward(x,
    y=None)`): a second stream the layer may need passed even for self-attention."""
    sig = getattr(subject, "sig", None)
    if sig is None or subject.call is not None or not isinstance(subject.layer, nn.Module):
        return []
    known = {sig.query, sig.key, sig.value, sig.memory, *sig.masks}
    return [p.name for p in _forward_parameters(subject.layer)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in known
            and (p.name in sig.streams or p.default is None and p.name.lower() not in LEAVE_NAMES)]


def _call_example(options: dict | None, body: str, *, memory: bool = False, mask: bool = True) -> str:
    """How the front end declares a call: `call=lambda layer, x, memory, mask: ...` in Python, a function named by
    `--call MODULE:FUNCTION` on the command line (`mask`: whether the call takes the mask)."""
    params = ("layer, x, memory" if memory else "layer, x") + (", mask" if mask else "")
    flag = (options or {}).get("call")
    if flag is None:
        return f"e.g. call=lambda {params}: {body}"
    return f"e.g. {flag} mymodule:call with def call({params}): return {body}"


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
        except Exception:  # noqa: BLE001, S112 - another family's signature: try the next
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


def _trial(layer: nn.Module, width: int, device, dtype, call=None):
    """One call of forward on (1, TRIAL_TOKENS, width) tokens, by keyword (or through the declared `call`, every
    stream the same tokens, no mask), observed, with the layer's state and the RNG restored: (the output, the
    record), or None when it raises or returns no tensor first."""
    from ._observe import Observer

    try:
        x = torch.randn(1, TRIAL_TOKENS, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        if call is not None:
            streams = call_form(call)[2]
            invoke = lambda: call(layer, *([x] * streams))
        else:
            sig = read_signature(layer)
            kwargs = dict(sig.fixed)
            kwargs[sig.query] = x
            for name in (sig.key, sig.value):
                if name is not None:
                    kwargs[name] = x
            if sig.memory is not None and sig.memory in kwargs:
                kwargs[sig.memory] = x
            invoke = lambda: layer(**kwargs)
        observer = Observer()
        with untouched(layer, device), torch.no_grad(), observer:
            out = invoke()
    except Exception:  # noqa: BLE001 - a width the layer does not take: the caller tries the next
        return None
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    return (out, observer.record) if isinstance(out, Tensor) else None


CORE_WIDTHS = (8, 16, 32, 64, 128)
"""The widths a module that owns no parameters and takes q, k and v is tried at, the narrowest first (8: a function's
head width): local-attention's LocalAttention takes any width, or the one its rotary table (a buffer) was built for."""


def _core_width(layer: nn.Module, device, dtype) -> int | None:
    """The first of CORE_WIDTHS at which a trial call returns the tokens' form, (1, T, width); None if none does."""
    for width in CORE_WIDTHS:
        tried = _trial(layer, width, device, dtype)
        if tried is not None and tuple(tried[0].shape) == (1, TRIAL_TOKENS, width):
            return width
    return None


def _core_module(layer: nn.Module) -> bool:
    """Whether the layer is an attention core: a module that owns no parameters and whose forward takes q, k and v
    (by any of their names), so that the width is its caller's to choose."""
    return not any(True for _ in layer.parameters()) and takes_qkv(layer)


def takes_qkv(layer: nn.Module) -> bool:
    """Whether the module's forward takes q, k and v, by any of the names the audit reads them by (QUERY_NAMES,
    KEY_NAMES, VALUE_NAMES), or queries that are its keys too and values (QK_NAMES: `forward(qk, v)`)."""
    try:
        params = _forward_parameters(layer)
    except AuditUsageError:
        return False
    if _first(params, QK_NAMES) is not None and _first(params, VALUE_NAMES) is not None:
        return True
    return all(_first(params, names) is not None for names in (QUERY_NAMES, KEY_NAMES, VALUE_NAMES))


def _trial_width(layer: nn.Module, device, dtype, call=None) -> int | None:
    """The width the layer takes and returns, (1, T, D) -> (1, T, D), tried among its parameters' sizes (the most
    common first): for a module that keeps its weights as bare nn.Parameter and names no width."""
    sizes = Counter(n for p in layer.parameters() for n in p.shape if n > 1)
    for width, _ in sizes.most_common(8):
        tried = _trial(layer, width, device, dtype, call)
        if tried is not None and tuple(tried[0].shape) == (1, TRIAL_TOKENS, width):
            return width
    return None


def _trial_heads(layer: nn.Module, d_model: int, device, dtype, call=None) -> int | None:
    """The number of heads a trial call's attention runs with: the head axis of its fused attention's q
    (B, H, T, d) or of its softmax over (B, H, T, T) scores (B*H rows of (T, T) ones), when they all agree."""
    tried = _trial(layer, d_model, device, dtype, call)
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
                 mask=None, layout: str | None = None, call=None, cross: bool = False, queries: int | None = None,
                 options: dict | None = None) -> Subject:
    """`_recognised`'s subject, with the queries of its own the layer has (`queries=Q` declared, else a layer in place
    that keeps them: `InPlace.own_queries`), `Subject.own_queries`."""
    expect(queries is None or (isinstance(queries, int) and not isinstance(queries, bool) and queries >= 1),
           "queries an int >= 1 (the learned queries the layer attends with) or None", spell("queries", queries, options),
           f"pass the number of rows the layer returns per sequence, e.g. {spell('queries', 1, options)} for a pooling "
           f"head that returns (B, D) or (B, 1, D)")
    expect(queries is None or not cross, "queries or cross, not both",
           f"{spell('queries', queries, options)} with {spell('cross', True, options)}",
           "leave cross out: queries=Q says the layer makes its queries itself, cross=True that the audit gives them")
    subject = _recognised(layer, d_model=d_model, num_heads=num_heads, device=device, dtype=dtype,
                          need_weights=need_weights, mask=mask, layout=layout, call=call, cross=cross, options=options)
    expect(queries is None or subject.form == "self_module",
           "queries=Q for a module given one stream (its tokens), whose queries are its own",
           f"{spell('queries', queries, options)} for {FORM_WORDS.get(subject.form, subject.form)}",
           "leave queries out: the audit gives this layer its queries")
    kept = getattr(layer, "own_queries", None)  # a layer in place's, read from its model's call
    subject.own_queries = queries or (kept if isinstance(kept, int) and not isinstance(kept, bool) and kept >= 1
                                      else None)
    return subject


def _recognised(layer, *, d_model=None, num_heads=None, device=None, dtype=None, need_weights: bool = True,
                mask=None, layout: str | None = None, call=None, cross: bool = False,
                options: dict | None = None) -> Subject:
    """Recognise the layer's form and sizes; raise `AuditUsageError` when it cannot be called, or when an
    option is not of the right kind or does not fit the layer. `mask`: the convention the layer takes its
    mask in (a MaskConvention or its spelling, see diagnostics._masks; default: the library's, else what the
    layer states, else "allowed"); `layout`: a function's, "bhtd" (default) or "bthd"; `call`: how to call the
    layer, call(layer, x[, mask]), call(layer, query, memory[, mask]) or call(layer, query, key, value[, mask])
    for a module, call(layer, q, k, v[, mask]) for a function. `cross`: the layer is declared cross-attention, so a
    memory parameter it may be called without (`forward(x, context=None)`) is given the memory. `options` maps audit() parameter names to the way
    the caller's front end spells them (e.g. {"d_model": "--d-model"}), for the messages."""
    expect(not isinstance(layer, type), "an attention layer instance",
           f"the class {getattr(layer, '__qualname__', layer)}",
           f"pass an instance, e.g. {getattr(layer, '__name__', 'Layer')}(...)")
    expect(callable(layer), "an attention layer: a function f(q, k, v, mask=None) or an nn.Module",
           f"{type(layer).__name__}", "pass the layer object itself (an instance, not a string)")
    # torch's recurrent layers are known by class, as its attention layers are: they mix tokens through a hidden
    # state and return (output, h) or (output, (h, c)), so no attention property holds or fails for them
    expect(not isinstance(layer, nn.RNNBase), "an attention layer: a function f(q, k, v, mask=None) or an nn.Module",
           f"torch.nn.{type(layer).__name__}, a recurrent layer (it mixes tokens through its hidden state, not by "
           "attention, and returns (output, hidden state))",
           "audit the attention layer of your model instead; diagnostics checks attention only")
    _check_size("d_model", d_model, options)
    _check_size("num_heads", num_heads, options)
    expect(dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point),
           "dtype a floating-point torch.dtype or None", f"dtype={dtype!r}", "pass e.g. dtype=torch.float32")
    mask = None if mask is None else mask_convention(mask, spelled=(options or {}).get("mask", "mask="))
    expect(call is None or callable(call), "call a function call(layer, x, mask) (see audit's docstring)",
           spell("call", call, options), "pass e.g. call=lambda layer, x, memory, mask: layer(x, xa=memory, mask=mask)")
    expect(layout is None or layout in LAYOUTS + MODULE_LAYOUTS, f"layout one of {', '.join(LAYOUTS + MODULE_LAYOUTS)}",
           spell("layout", layout, options), 'pass "bhtd" or "bthd" for a function on (B, H, T, d) or (B, T, H, d) '
           'tensors (flash-attn\'s), "btd" or "tbd" for a module on (B, T, D) or sequence-first (T, B, D) tokens')
    device = _check_device(device, options)
    if isinstance(layer, nn.MultiheadAttention):
        expect(mask in (None, SHORTCUTS["mha_blocked"]), "no mask convention for nn.MultiheadAttention (its own is "
               "known)", spell("mask", mask, options), "leave mask out; to pass padding through key_padding_mask, "
                                                       "audit adapters.mha_key_padding(mha)")
        expect(call is None, "no call for nn.MultiheadAttention (the audit calls it as torch documents it)",
               spell("call", call, options), "leave call out")
        for name, given, own in (("d_model", d_model, layer.embed_dim), ("num_heads", num_heads, layer.num_heads)):
            expect(given is None or given == own, f"{name}={own}, as the nn.MultiheadAttention has it",
                   spell(name, given, options), f"leave {name} out: it is read from the layer")
        device, dtype = _module_device_dtype(layer, device, dtype)
        return TorchMHASubject(layer, d_model=layer.embed_dim, num_heads=layer.num_heads,
                               head_dim=layer.head_dim, device=device, dtype=dtype, need_weights=need_weights)
    if isinstance(layer, nn.Module):
        return _module_subject(layer, d_model=d_model, num_heads=num_heads, device=device, dtype=dtype, mask=mask,
                               layout=layout, call=call, cross=cross, options=options)
    expect(layout not in MODULE_LAYOUTS, f"for a function, layout one of {', '.join(LAYOUTS)}",
           spell("layout", layout, options), 'pass "bhtd" for (B, H, T, d) tensors or "bthd" for (B, T, H, d); "btd" '
           'and "tbd" describe a module\'s tokens')
    try:
        params = [p for p in inspect.signature(layer).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        params = None  # a builtin: assume f(q, k, v, ...) and read the mask's name from its docstring
    if call is not None:  # the declared call says how: (layer, q, k, v[, mask])
        _, mask_param, streams = call_form(call, options)
        expect(streams == 3, "for a function, call(layer, q, k, v[, mask])", f"call{_shown_signature(call)}",
               "pass e.g. call=lambda f, q, k, v, mask: f(q, k, v, bias=mask)")
        names = [mask_param] if mask_param else []
    elif params is not None:
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
    mask_name = _choose_mask(names, mask)
    convention, by, why = _convention(layer, layer, mask_name, mask)
    return FunctionSubject(layer, mask_name=mask_name, convention=convention, by=by, why=why, layout=layout or "bhtd",
                           call=call,
                           d_model=head_dim * num_heads, num_heads=num_heads, head_dim=head_dim,
                           device=device or torch.device("cpu"), dtype=dtype or torch.float32)


def _module_subject(layer: nn.Module, *, d_model, num_heads, device, dtype, mask: MaskConvention | None, layout,
                    call, cross: bool = False, options) -> Subject:
    expect(layout is None or layout in MODULE_LAYOUTS, f"for a module, layout one of {', '.join(MODULE_LAYOUTS)}",
           spell("layout", layout, options), 'pass "tbd" for a module that takes sequence-first (T, B, D) tokens, or '
           'leave layout out ("bhtd" and "bthd" describe functions on per-head tensors)')
    device, dtype = _module_device_dtype(layer, device, dtype)
    notes: list[str] = []
    hf = _is_huggingface(layer)
    torch_layer = isinstance(layer, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
    expect(call is None or not (hf or torch_layer), "no call for a torch or Hugging Face layer (the audit calls it "
           "as its library does)", spell("call", call, options), "leave call out")
    declared_call = call_form(call, options) if call is not None else None
    sized = layer.self_attn if torch_layer else layer  # torch's layers keep their sizes on self_attn
    inner = _inner_mha(layer) if not torch_layer else None  # a block around nn.MultiheadAttention: its sizes
    given_d_model = d_model
    (d_model, width_read), (found_heads, heads_read) = (_read_attr(sized, D_MODEL_NAMES, d_model),
                                                        _read_attr(sized, HEAD_NAMES, num_heads))
    if torch_layer:
        width_read, heads_read = (r.replace("its ", "its self_attn's ", 1) for r in (width_read, heads_read))
    if d_model is None and inner is not None:
        d_model, width_read = inner[1].embed_dim, f"its nn.MultiheadAttention `{inner[0]}`"
    if d_model is None:  # no attribute names the width: from the heads' sizes, else the first projection
        head_dim, head_dim_read = _read_attr(layer, ("head_dim", "head_size", "attention_head_size"), None)
        if found_heads and head_dim:
            d_model, width_read = found_heads * head_dim, f"num_heads x {head_dim_read.removeprefix('its ')}"
        else:
            d_model, width_read = _first_linear_width(layer), "its first projection's in_features"
    if d_model is None and not hf and not torch_layer:  # bare nn.Parameter weights: a trial call
        d_model = _trial_width(layer, device, dtype, declared_call and call)
        if d_model is not None:
            notes.append(f"d_model={d_model} found by a trial call (the width it takes and returns)")
    if d_model is None and not hf and not torch_layer and declared_call is None and _core_module(layer):
        d_model = _core_width(layer, device, dtype)
        if d_model is not None:
            found_heads = found_heads or 1
            notes += [f"d_model={d_model} chosen: the narrowest of {', '.join(map(str, CORE_WIDTHS))} a module that "
                      f"owns no parameters and takes q, k and v runs at (a buffer may fix its width; "
                      f"{spell('d_model', 64, options)} chooses another)",
                      f"num_heads={found_heads}: its inputs (B, T, D) are one head's"]
    # no width found, and convolutions where projections would be: a layer over (B, C, H, W) pixels
    channels = image_channels(layer) if d_model is None and not hf and not torch_layer and not any(
        isinstance(m, nn.Linear) for m in layer.modules()) else None
    if channels is not None:
        length = image_seq_len(layer)
        sized = f", {spell('seq_len', length, options)} or more (images of two of its kernels a side, so that a " \
                f"strided key convolution leaves more than one key)" if length is not None else ""
        cli = "" if not options else (" (on the command line, have your factory return "
                                      "diagnostics.adapters.image(layer))")
        expect(False, "a layer over token sequences, (B, T, D)", f"{type(layer).__name__}, whose projections are "
               f"nn.Conv2d over {channels} channels: an attention over an image's pixels, (B, C, H, W)",
               f"audit adapters.image(layer){sized}{cli}: it lays each probe's tokens out as a (B, {channels}, H, W) "
               f"image and reads the output back as tokens", adapter="image")
    expect(d_model is not None, "a module with a d_model-like attribute (" + ", ".join(D_MODEL_NAMES) + ")",
           f"{type(layer).__name__} with none of them", "pass d_model=... to audit()"
           if not options or "d_model" not in options else f"pass {options['d_model']} D")
    widths = _linear_widths(layer)
    # A width its projections neither take nor return (`--d-model 30` on a 32-wide layer) would fail every probe;
    # one they only return is a layer without a query projection whose output projection reads [context; query]
    returned = {m.out_features for m in layer.modules() if isinstance(m, nn.Linear)}
    # (not where the width is the one the layer's own model passed it: DAB-DETR's cross-attention takes queries and
    # keys twice as wide as its values, [content; position], projected outside it; its only Linear reads the values)
    expect(not widths or d_model in widths or d_model in returned or getattr(layer, "width_from_call", False),
           f"d_model to match the width of the layer's projections "
           f"(nn.Linear in_features {sorted(widths)})",
           spell("d_model", d_model, options) if given_d_model is not None
           else f"d_model={d_model} read from the layer's attributes",
           f"pass the layer's width, {spell('d_model', widths[0], options)}" if widths else "")
    if found_heads is None and inner is not None and inner[1].embed_dim == d_model:
        found_heads = inner[1].num_heads  # the layer's own statement, before any trial call
        notes.append(f"num_heads={found_heads} read from its nn.MultiheadAttention `{inner[0]}`")
    if found_heads is None and not hf and not torch_layer:
        found_heads = _trial_heads(layer, d_model, device, dtype, declared_call and call)
        if found_heads is not None:
            notes.append(f"num_heads={found_heads} read from a trial call (the head axis of its attention)")
    if found_heads is None:
        notes.append(f"num_heads=1 assumed: nothing on the layer names it, and a trial call did not show it "
                     f"({spell('num_heads', 4, options)} declares 4)")
    num_heads = found_heads or 1
    # how each size was read, said once on the report's first line (a size a note gives is said in its note)
    notes[:0] = [f"{field}={value} from {how}" for field, value, how in
                 (("d_model", d_model, width_read), ("num_heads", found_heads, heads_read))
                 if how and how != "declared" and not any(n.startswith(f"{field}=") for n in notes)]
    _check_heads(d_model, num_heads, "a head takes d_model / num_heads of the width", options)
    # its own flag, or a part's `causal` (linear-attention-transformer's SelfAttention keeps it on its LocalAttention
    # only, and its causal linear attention as a function chosen by it); not a part's `is_causal`, which in a Hugging
    # Face layer a wrapper holds says that its model builds the causal mask
    builtin_causal = any(getattr(layer, n, False) is True for n in CAUSAL_NAMES) or \
        any(getattr(m, "causal", False) is True for m in layer.modules())
    builtin_pattern = declares_pattern(layer)
    carries = mask_carries_causality(layer)
    extra = None
    if declared_call is not None:  # the call says the form and the mask's name; the forward is not read
        form, mask_param, _ = declared_call
        sig, mask_names = Signature(query="x"), (mask_param,) if mask_param else ()
        convention, by, why = _convention(layer, layer.forward, None, mask)
        notes.append("called through the declared call")
    else:
        sig = read_signature(layer, library=hf, options=options)
        if isinstance(layer, nn.TransformerDecoderLayer):
            # the whole layer: self-attention over tgt (the probed stream, its mask tgt_mask), cross-attention over
            # memory, a fixed encoder output that no probe changes and no mask covers, as in a real decoder
            form = "self_module"
            mask_names = ("tgt_key_padding_mask",) if mask is not None and mask.per_key else ("tgt_mask",)
            notes.append(f"memory: a fixed encoder output of {MEMORY_TOKENS} tokens")
        elif isinstance(layer, nn.TransformerEncoderLayer):
            form = "self_module"
            mask_names = ("src_key_padding_mask",) if mask is not None and mask.per_key else ("src_mask",)
        else:
            if sig.key is not None and sig.value is not None:
                form = "qkv_module"
            elif sig.memory is not None and (cross or sig.memory in sig.fixed or getattr(layer, "is_cross_attention",
                                                                                          False) is True
                                             or "Cross" in type(layer).__name__):
                form = "cross_module"
            else:
                form = "self_module"
            _refuse_streams(layer, sig, form, options)
            chosen = _choose_mask(sig.masks, mask, cross=form == "cross_module")
            mask_names = (chosen,) if chosen else ()
        if torch_layer:
            convention, by, why = (mask, "user", "") if mask is not None else (SHORTCUTS["mha_blocked"], "library", "")
        elif hf and mask is None:
            convention, by, why = mask_convention(_huggingface_convention(layer)), "library", ""
        else:
            convention, by, why = _convention(layer, layer.forward, mask_names[0] if mask_names else None, mask)
    if hf:
        builtin_causal = False  # its model builds the causal mask; `is_causal` tells the model, not the layer
        builtin_pattern = False  # and the sliding window's mask: `sliding_window` tells the model, not the layer
        if sig.rotary:
            rotary = _huggingface_rotary(layer, device)
            expect(rotary is not None, f"a rotary embedding class in {type(layer).__module__} built from the config",
                   "none that builds", "audit adapters.huggingface(layer, rotary=YourRotaryEmbedding(config))")
            extra = _rotary_extra(rotary)
            notes.append(f"position_embeddings from {type(rotary).__name__}")
    if mask_names and not torch_layer and (by != "default"):
        notes.append(convention_note(mask_names[0], convention, by, why))
    if layout is None and not (hf or torch_layer) and declared_call is None:  # a declared call lays the tokens out
        stated = stated_layout(layer, sig.query)
        if stated is not None:
            layout = stated[0]
            notes.append(f"layout={layout}: sequence-first (T, B, D) tokens, as {stated[1]}")
    elif layout == "tbd":
        notes.append("layout=tbd: sequence-first (T, B, D) tokens")
    subject = ModuleSubject(layer, sig=sig, form=form, mask_names=mask_names, convention=convention, by=by, why=why,
                            builtin_causal=builtin_causal, builtin_pattern=builtin_pattern, extra=extra, call=call,
                            layout=layout or "btd",
                            notes=tuple(n for n in notes if n), d_model=d_model, num_heads=num_heads,
                            head_dim=max(d_model // num_heads, 1), device=device, dtype=dtype)
    subject.mask_carries_causality = carries and builtin_causal and subject.takes_mask
    return subject


def mask_carries_causality(layer) -> bool:
    """The layer's causality is a truthy `is_causal` (torch's name, whose contract in SDPA and nn.MultiheadAttention is
    "attn_mask or is_causal": the flag says the mask is causal, or stands in for one), and no `causal` attribute says
    it builds its own causal mask whatever it is given: then the mask it takes carries the causality, and a layer that
    applies the flag only when no mask is given is correct (the audit's masks for it are causal too)."""
    return getattr(layer, "is_causal", False) is True and getattr(layer, "causal", None) is not True


def convention_note(name: str, convention: MaskConvention, by: str, why: str) -> str:
    """The report's first line on the mask: `mask: additive:B,Tq,Tk`, with what says so when the layer does.
    Nothing for the default (bool (B, 1, Tq, Tk), True = may attend), nor where a library or the layer says that."""
    if by == "default" or (by in ("library", "layer") and str(convention) == "allowed"):
        return ""
    return f"{name}: {convention}" + (f" ({why})" if by == "layer" and why else "")


def _convention(layer, fn, mask_name: str | None, declared: MaskConvention | None) -> tuple[MaskConvention, str, str]:
    """(convention, who chose it, why): the user's declaration; else what the layer states for its mask parameter
    (see `stated_convention`); else the default, bool (B, 1, Tq, Tk), True = may attend."""
    if declared is not None:
        return declared, "user", ""
    stated = stated_convention(layer, fn, mask_name) if mask_name else None
    if stated is not None:
        return stated[0], "layer", stated[1]
    return SHORTCUTS["allowed"], "default", ""


def stated_convention(layer, fn, mask_name: str) -> tuple[MaskConvention, str] | None:
    """The convention the layer itself states for its mask parameter `mask_name`, and where it says so:
    a library class whose convention is documented (`_masks.KNOWN_LAYERS`); a parameter named `*key_padding_mask`
    (torch's name for a (B, Tk) mask, True = padding); or its docstring (forward's, else the class's), read by
    `_masks.stated_in_text` ("True for positions to mask", "additive", "(batch, src_len)"). Never what the layer
    does with a mask."""
    known = known_convention(layer, mask_name)
    if known is not None:
        return known, f"documented for {type(layer).__name__}"
    if "key_padding" in mask_name:
        return SHORTCUTS["key_padding"], "its name is torch's for a (B, Tk) mask, True = padding"
    if mask_name.lower().endswith("padding_mask"):  # `context_padding_mask`, fairseq's `encoder_padding_mask`
        return SHORTCUTS["key_padding"], (f"its name, `{mask_name}`, says a padding mask: one per key, True = padding, "
                                          f"as torch's key_padding_mask")
    for doc in (inspect.getdoc(fn), inspect.getdoc(type(layer)) if isinstance(layer, nn.Module) else None):
        stated = stated_in_text(doc, mask_name)
        if stated is not None:
            return stated
    return None


def stated_layout(layer: nn.Module, query: str) -> tuple[str, str] | None:
    """("tbd", where it says so) where the layer states that it takes sequence-first (T, B, D) tokens: its own
    `batch_first` set to False (torch's name; True decides the other way), or its docstring (forward's, else the
    class's) giving its query input, in the query's own entry, as (time, batch, width) (`_masks.stated_layout_in_text`;
    one that gives it batch first decides too). Never what the layer does with its tokens: a layer that attends across
    the batch by mistake does what a sequence-first one does given batch-first tokens."""
    flag = getattr(layer, "batch_first", None)
    if isinstance(flag, bool):  # torch's name decides, either way
        return ("tbd", "its `batch_first` is False") if flag is False else None
    for doc in (inspect.getdoc(layer.forward), inspect.getdoc(type(layer))):
        stated = stated_layout_in_text(doc, query)
        if stated is not None:  # the first docstring that gives the query's shape decides, batch first too
            return stated if stated[0] == "tbd" else None
    return None


def _inner_mha(layer: nn.Module) -> tuple[str, nn.MultiheadAttention] | None:
    """The nn.MultiheadAttention a block wraps: (its name, it), where the block holds one (or several alike)."""
    found = [(name, m) for name, m in layer.named_modules() if isinstance(m, nn.MultiheadAttention) and name]
    if not found or len({(m.embed_dim, m.num_heads) for _, m in found}) != 1:
        return None
    return found[0]


def call_form(call, options: dict | None = None) -> tuple[str, str | None, int]:
    """(form, the mask parameter's name or None, the number of streams) of a declared call, read from its
    parameters: (layer, x[, mask]) a self-attention module, (layer, query, memory[, mask]) a cross-attention one,
    (layer, query, key, value[, mask]) separate key and value (and a function's q, k, v). The mask is the parameter
    named like one (mask, attn_mask, ...)."""
    try:
        params = [p for p in inspect.signature(call).parameters.values() if p.kind in (p.POSITIONAL_ONLY,
                                                                                       p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = None
    names = [p.name for p in params or []]
    mask_param = next((n for n in names[1:] if _is_mask_name(n)), None)
    streams = len([n for n in names[1:] if n != mask_param])
    expect(params is not None and 1 <= streams <= 3, "call(layer, x[, mask]), call(layer, query, memory[, mask]) or "
           "call(layer, query, key, value[, mask])", f"{spell('call', call, options)} with parameters {names}",
           "pass e.g. call=lambda layer, x, memory, mask: layer(x, xa=memory, mask=mask)")
    return {1: "self_module", 2: "cross_module", 3: "qkv_module"}[streams], mask_param, streams


def _shown_signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def suggested_conventions(subject: Subject) -> list[tuple[MaskConvention, str]]:
    """Conventions the layer's mask parameter suggests without stating them, most telling first, each with what
    suggests it: its name (`*padding*`; torch's `src_mask`, True = blocked; Hugging Face's additive
    `attention_mask`), its annotation or default (a float: additive), an nn.MultiheadAttention it wraps (torch's
    conventions). Hints only: the audit never gives the layer its mask in one of these unless it is declared."""
    if not subject.takes_mask or not subject.mask_names:
        return []
    name = subject.mask_names[0]
    param = _mask_parameter(subject)
    annotation = "" if param is None or param.annotation is param.empty else str(param.annotation)
    default = None if param is None else param.default
    found = []
    words = set(name.split("_"))
    if "padding" in name or "pad" in words:
        found.append((SHORTCUTS["key_padding"], f"its name, `{name}`, says key padding"))
    if name in ("src_mask", "tgt_mask", "memory_mask"):
        found.append((SHORTCUTS["blocked"], f"`{name}` is torch's name for a mask with True = blocked"))
    elif STREAM_MASK.fullmatch(name) and not re.search("pad|attn|attention", name):
        # input_mask, context_mask, kv_mask: a mask over one stream's tokens, read before (B, Tq, Tk) forms where the
        # layer honours none and runs in several (Routing Transformer's input_mask runs given (Tq, Tk) too)
        found.append((SHORTCUTS["key_keep"], f"its name, `{name}`, names a mask over one stream's tokens"))
    if isinstance(default, Tensor) and default.is_floating_point():
        found.append((SHORTCUTS["additive"], f"the default of `{name}` is a float tensor"))
    if "float" in annotation.lower():
        found.append((SHORTCUTS["additive"], f"`{name}` is annotated {annotation}"))
    if name == "attention_mask":
        found.append((SHORTCUTS["additive"], "`attention_mask` is additive in Hugging Face-style layers"))
    inner = _inner_mha(subject.layer) if isinstance(subject.layer, nn.Module) else None
    if inner is not None:
        why = (f"it wraps nn.MultiheadAttention `{inner[0]}`, whose attn_mask is (B*H, Tq, Tk) or (Tq, Tk), bool "
               f"True = blocked or float additive")
        found += [(MaskConvention(meaning, shape), why) for meaning in ("blocked", "additive")
                  for shape in ("B*H,Tq,Tk", "Tq,Tk")]
    return [(c, why) for c, why in found if c != subject.mask_convention]


def stated_bool(subject: Subject) -> str:
    """What in the layer's own words says its mask is bool (an annotation such as `torch.BoolTensor` or `bool`, or a
    bool convention its docstring or name states), or "": the words that decide, where what the layer does with its
    mask reads as a bug in one convention and as correct in another."""
    if not subject.takes_mask or not subject.mask_names:
        return ""
    name = subject.mask_names[0]
    if subject.convention_by == "layer" and subject.mask_convention.meaning != "additive":
        return f"the audit read `{name}` as bool because {subject.convention_why}"
    param = _mask_parameter(subject)
    annotation = "" if param is None or param.annotation is param.empty else str(param.annotation)
    return f"`{name}` is annotated {annotation}" if "bool" in annotation.lower() else ""


def _mask_parameter(subject: Subject) -> inspect.Parameter | None:
    """The parameter of the layer's forward (or function) that receives the mask, None where none can be read."""
    fn = subject.layer.forward if isinstance(subject.layer, nn.Module) else subject.layer
    try:
        return inspect.signature(fn).parameters.get(subject.mask_names[0])
    except (TypeError, ValueError):
        return None


def mask_convention_hint(subject: Subject, options: dict | None = None) -> str | None:
    """For a mask finding (mask_honoured, runs): what the layer says or suggests about its mask's convention,
    never what it did with the audit's mask; None where the user or the library declared it, or nothing
    suggests one. Where the layer stated it (its parameter's name, its docstring), the finding says what the
    audit read and how to declare another; otherwise the first suggestion (see `suggested_conventions`), e.g.
    'the mask may be in another convention: `attention_mask` is additive in ... ; if so, audit with
    mask='additive''."""
    if subject.convention_by in ("user", "library") or not subject.takes_mask or not subject.mask_names:
        return None
    name = subject.mask_names[0]
    if subject.convention_by == "layer":
        return (f"the audit gave `{name}` as {subject.mask_convention} ({subject.mask_convention.describe()}), as "
                f"{subject.convention_why}; if the layer takes another convention, declare it, e.g. "
                f"{spell('mask', _other(subject.mask_convention), options)}")
    suggestions = suggested_conventions(subject)
    if not suggestions:
        return None
    convention, why = suggestions[0]
    return (f"the mask may be in another convention: {why} ({convention.describe()}); if so, audit with "
            f"{spell('mask', str(convention), options)}, else the layer ignores or misapplies the mask")


def _other(convention: MaskConvention) -> str:
    """The opposite meaning in the same shape: what to declare when a stated convention was misread."""
    meaning = {"allowed": "blocked", "blocked": "allowed", "additive": "allowed"}[convention.meaning]
    return str(MaskConvention(meaning, convention.shape))


def context_length(layer) -> tuple[int, str] | None:
    """The longest sequence the layer declares it takes, and what says so: an attribute such as
    `block_size` or `max_position_embeddings` (on the layer, a submodule or its `config`), or a registered
    causal-mask buffer (`bias`, `mask`) of shape (.., N, N), nanoGPT's way. None if nothing says."""
    found = _context_candidates(layer)
    return min(((n, text) for n, text, _ in found), key=lambda f: f[0]) if found else None


def _context_candidates(layer) -> list[tuple[int, str, str]]:
    """Every statement of a context on the layer: (length, what says so, the attribute's name, or "" for a mask
    buffer)."""
    if not isinstance(layer, nn.Module):
        return []
    found: list[tuple[int, str, str]] = []
    for path, module in layer.named_modules():
        prefix = f"{path}." if path else ""
        for holder, where in ((module, prefix), (getattr(module, "config", None), f"{prefix}config.")):
            for name in CONTEXT_NAMES:
                value = getattr(holder, name, None) if holder is not None else None
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.append((value, f"{where}{name}={value}", name))
        for name, buffer in module.named_buffers(recurse=False):
            if name in MASK_BUFFER_NAMES and buffer is not None and buffer.dim() >= 2 and \
                    buffer.shape[-1] == buffer.shape[-2] > 1 and _holds_a_mask(buffer):
                found.append((int(buffer.shape[-1]), f"the {tuple(buffer.shape)} buffer {prefix}{name}", ""))
    return found


def probe_context(subject: Subject, length: int) -> tuple[int, str] | None:
    """The context that bounds probes of `length` tokens: `context_length`'s, less every statement under a name a
    tile may have (`TILE_NAMES`: nanoGPT's `block_size` is its context, a flash-style kernel's its tile of keys) that
    the layer is seen to run beyond: a call at `length` tokens (or twice the statement, if shorter) that returns one
    finite row per token. Such a statement bounds nothing (a tile, or a context the layer does not enforce), and the
    report's first line says so. A mask buffer, or another name, bounds whatever the layer does beyond it (a context
    is what it was trained on)."""
    kept = []
    for n, text, name in _context_candidates(subject.layer):
        # at the probe length, or at twice the statement where that is shorter: a multiple of a tile, which a kernel
        # may need, and a call no longer than needed, made before the audit's memory check
        trial = min(length, 2 * n)
        if name in TILE_NAMES and n < length and _runs_at(subject, trial):
            if not any(note.startswith(f"{text} bounds nothing") for note in subject.notes):
                subject.notes = (*subject.notes, f"{text} bounds nothing: the layer ran at {trial} tokens (a tile of "
                                                 f"its kernel, or a context it does not enforce)")
            continue
        kept.append((n, text))
    return min(kept, key=lambda f: f[0]) if kept else None


def _runs_at(subject: Subject, length: int) -> bool:
    """One call of the layer on a batch of one at `length` tokens, no mask, with its state and the RNG restored:
    whether it returned a finite output with a row per token. Cached on the subject."""
    tried = subject.__dict__.setdefault("_runs_at", {})
    if length not in tried:
        try:
            x = subject.make(torch.Generator().manual_seed(0), 1, length)
            with untouched(subject.layer, subject.device), torch.no_grad():
                out = subject(x, x, x, None).out
            tried[length] = (out.dim() >= 2 and out.shape[subject.time_dim] == length
                             and bool(torch.isfinite(out).all()))
        except Exception:  # noqa: BLE001 - the layer refuses the length: a context after all
            tried[length] = False
    return tried[length]


def _holds_a_mask(buffer: Tensor) -> bool:
    """A buffer that can be a precomputed mask: bool, or numbers that are all 0 / 1 (nanoGPT's tril of ones) or all
    0 / very negative (an additive mask). A named `bias` of other values (ALiBi's distances times slopes, cached
    on the shape of the last call) is a positional bias, and says nothing of the longest sequence."""
    if buffer.dtype == torch.bool:
        return True
    b = buffer.detach()
    if b.is_complex():
        return False
    return bool(((b == 0) | (b == 1)).all()) or (b.is_floating_point() and bool(((b == 0) | (b <= -1e4)).all()))


def check_seq_len(subject: Subject, seq_len, *, options: dict | None = None) -> int:
    """The probe length for this subject: `seq_len` (None: the default, 16) checked to be an int >= 1 and no
    longer than the context the layer declares (see `context_length`). Raises `AuditUsageError` otherwise."""
    expect(seq_len is None or (isinstance(seq_len, int) and not isinstance(seq_len, bool)), "seq_len an int or None",
           f"{spell('seq_len', seq_len, options)} ({type(seq_len).__name__})",
           "pass the context length you train with, e.g. seq_len=128")
    expect(seq_len is None or seq_len >= 1, "seq_len >= 1", spell("seq_len", seq_len, options),
           "pass the context length you train with, e.g. seq_len=128")
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    limit = probe_context(subject, length)
    if limit is not None and length > limit[0]:
        seen = spell("seq_len", length, options) + (" (the default)" if seq_len is None else "")
        raise AuditUsageError(f"expected seq_len <= {limit[0]}, the longest sequence the layer takes "
                              f"({limit[1]}); got {seen}. Fix: pass {spell('seq_len', limit[0], options)} or less")
    return length


__all__ = ["LAYOUTS", "MODULE_LAYOUTS", "NOT_A_DISTRIBUTION", "AuditUsageError", "LayerReturnedNothingUsable", "Output",
           "Signature", "Subject", "call_form", "check_seq_len", "context_length", "convention_note", "make_subject",
           "probe_context",
           "call_declaration", "left_streams", "mask_convention_hint", "stated_bool", "not_weights", "read_signature", "stated_convention", "stream_call",
           "stream_calls", "suggested_conventions"]
