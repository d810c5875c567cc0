"""A layer's own weights, read as attention: which module holds the query, key, value and output projections, how
many heads and key/value heads it has, its scale and norms, and what one of its calls passed (the inputs, the
mask, the rotary tables), so that the attention those weights define can be recomputed by the reference:

    out = concat_h softmax(q_h k_g(h)^T * scale + mask) v_g(h) W_O + b_O,   q = x W_Q + b_Q, k = x W_K + b_K, ...

where query head h reads key/value head g(h) = h // (H / H_kv) (grouped-query attention: each key/value head
shared by H / H_kv consecutive query heads, torch's `repeat_interleave`, Hugging Face's `repeat_kv`).

Recognisers, one per family, tried in this order (`RECOGNISERS`); each says what it read and from where:
    torch_mha     nn.MultiheadAttention: in_proj_weight (or q/k/v_proj_weight), out_proj, num_heads, batch_first
    huggingface   q_proj, k_proj, v_proj and o_proj (out_proj, dense), Phi-3's stacked qkv_proj, a
                  query_key_value laid out per key/value group (GPT-NeoX, BLOOM, Persimmon, Falcon: rows
                  (G, H/G + 2, d), each group's query heads, then its key, then its value; G = H without
                  key/value heads: q, k, v interleaved per head), or query, key and value (BERT's and ViT's
                  self-attention, whose output projection is its parent's), heads from the module or its config,
                  `scaling`, q_norm / k_norm, rotary tables from the call's position_embeddings (applied by the
                  module's own `apply_rotary_pos_emb`, a partial rotary where that function keeps the rest)
    fused_qkv     one qkv projection of 3 x heads x head_dim and proj (or out): timm's Attention (q_norm,
                  k_norm, norm), this project's reference (correct.MultiHeadAttention, its `causal`)
A module is identified only when every parameter and buffer it holds is one the recompute uses: a relative
position table, a learned sink, a gate, a rotary buffer of its own make it "not applicable", with their names.
Legend: B batch, Tq / Tk query / key length, D width, H query heads, G key/value heads, d head width.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class NotApplicable(Exception):
    """The module's attention cannot be recomputed from its weights; the message says why."""


@dataclass(frozen=True)
class Projection:
    weight: Tensor  # (out, in)
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)


@dataclass(frozen=True)
class CallInputs:
    """What one call passed, batch-first: the streams, the mask as an additive bias that broadcasts to
    (B, H, Tq, Tk) (None: none), the rotary step (q, k) -> (q, k) on (B, H, T, d), and what was read."""

    query: Tensor  # (B, Tq, D)
    key: Tensor  # (B, Tk, D)
    value: Tensor  # (B, Tk, D)
    bias: Tensor | None
    rotary: Callable | None = None
    read: tuple[str, ...] = ()
    unread: tuple[str, ...] = ()  # tensors the call passed that the recompute does not read (RoFormer's sinusoidal_pos)


@dataclass
class Projections:
    """A module's attention as its weights define it (see the module docstring)."""

    family: str
    module: nn.Module
    q: Projection
    k: Projection
    v: Projection
    o: Projection | None  # None: the module returns the merged heads (its parent projects them)
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    read: list[str]  # what was read and from where, for the report
    inputs: Callable  # (bound arguments of the call) -> CallInputs; raises NotApplicable
    output: Callable  # (what the module returned) -> (B, Tq, D) Tensor
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    norm: nn.Module | None = None  # on the merged heads, before the output projection (timm's scale_norm)
    causal: bool | None = None  # the module builds its own causal mask (None: not declared)
    value_scale: float = 1.0  # what the module multiplies its values by (MiMo-V2-Flash's v_scale), 1: nothing
    # the class is a library's own (torch, transformers, timm, this project's reference), whose every step the
    # recogniser knows; a class it has not seen may have a step of its own (rotary positions, ALiBi) that no
    # attribute names, so a difference there counts only where one step of the reference explains it
    known: bool = False
    _wide: dict = field(default_factory=dict, repr=False)

    def wide(self, norm: nn.Module | None, dtype: torch.dtype) -> nn.Module | None:
        """A norm module in `dtype` (a float64 copy for the golden recompute; the module itself otherwise)."""
        if norm is None or isinstance(norm, nn.Identity):
            return None
        if next(iter(norm.parameters()), torch.empty(0, dtype=dtype)).dtype == dtype:
            return norm
        if (id(norm), dtype) not in self._wide:
            self._wide[(id(norm), dtype)] = copy.deepcopy(norm).to(dtype)
        return self._wide[(id(norm), dtype)]


# ---- the reference, step by step ------------------------------------------------------------------------
STEPS = ("grouped key/value heads repeated in the wrong order (repeat, not repeat_interleave)",
         "heads split as (d, H) instead of (H, d)", "heads merged without moving them next to their width",
         "output projection skipped", "scale", "the values' stated scale not applied",
         "the mask the call passed not applied (nor a causal one)")
"""The one-step changes of the reference a mismatch is tested against, to name the step that differs."""


def attend(p: Projections, c: CallInputs, *, dtype: torch.dtype, causal: bool, step: str | None = None,
           scale: float | None = None) -> Tensor:
    """The attention `p`'s weights compute on `c`, in `dtype`, with the causal mask (bottom-right) or not; `step`:
    one of STEPS done the other way (`scale` with step "scale"), to see whether that explains a layer's output."""
    xq, xk, xv = (x.to(dtype) for x in (c.query, c.key, c.value))
    B, Tq, _ = xq.shape
    Tk = xk.shape[1]
    H, G, d = p.heads, p.kv_heads, p.head_dim
    q, k, v = p.q(xq), p.k(xk), p.v(xv)  # (B, Tq, H*d), (B, Tk, G*d), (B, Tk, G*d)
    if p.value_scale != 1.0 and step != STEPS[5]:
        v = v * p.value_scale
    q_norm, k_norm = p.wide(p.q_norm, dtype), p.wide(p.k_norm, dtype)
    if q_norm is not None and _norm_width(q_norm) == H * d:  # a norm over all heads at once (OLMo 2)
        q = q_norm(q)
    if k_norm is not None and _norm_width(k_norm) == G * d:
        k = k_norm(k)
    if step == STEPS[1]:
        q, k, v = (x.view(B, x.shape[1], d, -1).transpose(-1, -2) for x in (q, k, v))  # (B, T, H, d), wrongly
    q = q.reshape(B, Tq, H, d).transpose(1, 2)  # (B, H, Tq, d)
    k = k.reshape(B, Tk, G, d).transpose(1, 2)  # (B, G, Tk, d)
    v = v.reshape(B, Tk, G, d).transpose(1, 2)  # (B, G, Tk, d)
    if q_norm is not None and _norm_width(q_norm) != H * d:
        q = q_norm(q)  # per head, over its width
    if k_norm is not None and _norm_width(k_norm) != G * d:
        k = k_norm(k)
    if c.rotary is not None:
        q, k = c.rotary(q, k)
    if H != G:
        if step == STEPS[0]:
            k, v = k.repeat(1, H // G, 1, 1), v.repeat(1, H // G, 1, 1)  # head h reads h % G: the bug
        else:
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, Tk, d)
    s = p.scale if step != STEPS[4] else scale
    scores = (q @ k.transpose(-2, -1)) * s  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if c.bias is not None and step != STEPS[6]:
        scores = scores + c.bias.to(dtype)
    if causal and step != STEPS[6]:
        i = torch.arange(Tq, device=scores.device).unsqueeze(-1)
        j = torch.arange(Tk, device=scores.device)
        scores = scores.masked_fill(j > i + Tk - Tq, -math.inf)  # -inf: masked keys get exactly zero weight
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with every key masked attends nothing
    out = weights @ v  # (B,H,Tq,Tk) x (B,H,Tk,d) -> (B,H,Tq,d)
    if step == STEPS[2]:
        out = out.reshape(B, Tq, H * d)  # (B, H, Tq, d) read as (B, Tq, H*d): wrongly
    else:
        out = out.transpose(1, 2).reshape(B, Tq, H * d)  # (B, Tq, H*d)
    norm = p.wide(p.norm, dtype)
    if norm is not None:
        out = norm(out)
    return out if step == STEPS[3] or p.o is None else p.o(out)  # (B, Tq, D)


def _norm_width(norm: nn.Module) -> int | None:
    w = getattr(norm, "weight", None)
    if isinstance(w, Tensor):
        return w.numel()
    shape = getattr(norm, "normalized_shape", None)
    return int(math.prod(shape)) if shape else None


# ---- masks, as the families take them -------------------------------------------------------------------
def additive(mask, *, blocked_when_true: bool, dtype=torch.float64) -> Tensor | None:
    """A mask as an additive bias: bool (True = may attend, or True = blocked) to 0 / -inf, a float one as is."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise NotApplicable(f"a mask of type {type(mask).__name__}, not a tensor")
    if mask.dtype == torch.bool:
        keep = ~mask if blocked_when_true else mask
        return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(~keep, -math.inf)
    if mask.is_floating_point():
        return mask.to(dtype).clamp_min(-math.inf)
    raise NotApplicable(f"a mask of dtype {mask.dtype}")


def _four_d(bias: Tensor | None, B: int, H: int, Tq: int, Tk: int) -> Tensor | None:
    """(Tq, Tk), (B, Tq, Tk), (B*H, Tq, Tk) or (B, 1|H, Tq, Tk) as a (B|1, 1|H, Tq, Tk) bias."""
    if bias is None:
        return None
    if bias.dim() == 2:
        return bias.view(1, 1, *bias.shape)
    if bias.dim() == 3:
        return bias.view(B, H, Tq, Tk) if bias.shape[0] == B * H and H > 1 else bias.unsqueeze(1)
    if bias.dim() == 4:
        return bias[..., :Tk]
    raise NotApplicable(f"a mask of shape {tuple(bias.shape)}")


# ---- recognisers ----------------------------------------------------------------------------------------
def _linear(m) -> Projection | None:
    w = getattr(m, "weight", None)
    if isinstance(m, nn.Linear) and isinstance(w, Tensor):
        return Projection(w, m.bias)
    return None


def _dropout_active(module: nn.Module, *names: str) -> str | None:
    """Why the module's output is random (dropout in training mode), or None."""
    if not module.training:
        return None
    for sub_name, sub in module.named_modules():
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            return f"dropout {sub_name or 'of the module'} (p={sub.p}) is active in training mode"
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, float) and value > 0:
            return f"{name}={value} is active in training mode"
    return None


def _unused(module: nn.Module, used: list) -> list[str]:
    """Names of the module's parameters and buffers the recompute does not use."""
    seen = {id(t) for t in used if isinstance(t, Tensor)}
    for m in used:
        if isinstance(m, nn.Module):
            seen |= {id(t) for t in (*m.parameters(), *m.buffers())}
    return [n for n, t in (*module.named_parameters(), *module.named_buffers()) if id(t) not in seen]


def _batch_first(x: Tensor, time_first: bool) -> Tensor:
    return x.transpose(0, 1) if time_first else x


def torch_mha(module: nn.Module) -> Projections | None:
    if not isinstance(module, nn.MultiheadAttention):
        return None
    if module.bias_k is not None or module.add_zero_attn:
        raise NotApplicable("nn.MultiheadAttention with add_bias_kv or add_zero_attn appends keys of its own")
    why = _dropout_active(module, "dropout")
    if why:
        raise NotApplicable(why)
    E, H = module.embed_dim, module.num_heads
    d = E // H
    if module.in_proj_weight is not None:
        w_q, w_k, w_v = module.in_proj_weight.split(E)
        read = "in_proj_weight"
    else:
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        read = "q_proj_weight, k_proj_weight, v_proj_weight"
    b = module.in_proj_bias.split(E) if module.in_proj_bias is not None else (None, None, None)
    time_first = not module.batch_first

    def inputs(args: dict) -> CallInputs:
        q, k, v = (_batch_first(args[n], time_first) for n in ("query", "key", "value"))
        B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
        if args.get("is_causal") and args.get("attn_mask") is None:
            raise NotApplicable("is_causal=True without attn_mask (nn.MultiheadAttention takes it as a hint only)")
        bias = _four_d(additive(args.get("attn_mask"), blocked_when_true=True), B, H, Tq, Tk)
        pad = additive(args.get("key_padding_mask"), blocked_when_true=True)
        if pad is not None:
            pad = pad.view(B, 1, 1, Tk)
            bias = pad if bias is None else bias + pad
        return CallInputs(q, k, v, bias, read=("masks: attn_mask and key_padding_mask, True = blocked",))

    return Projections("torch nn.MultiheadAttention", module, Projection(w_q, b[0]), Projection(w_k, b[1]),
                       Projection(w_v, b[2]), Projection(module.out_proj.weight, module.out_proj.bias), H, H, d,
                       d ** -0.5, [f"{read} and out_proj of nn.MultiheadAttention, {H} heads (num_heads), "
                                   f"scale 1/sqrt({d})"],
                       inputs, lambda out: _batch_first(_first(out), time_first))


HF_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
HF_OUT = ("o_proj", "out_proj", "dense")
# `heads` last (lucidrains' layers, x-transformers' and vit-pytorch's, keep their head count as `self.heads`): a module
# that also states one of the others is read by it first
HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_key_value_groups_heads")


def _read_int(module: nn.Module, names: tuple[str, ...]) -> tuple[int | None, str]:
    """The first positive int under `names` on the module, else on its config; (value, where it was read)."""
    for holder, where in ((module, type(module).__name__), (getattr(module, "config", None), "config")):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{where}.{name}"
    return None, ""


QK_POSITIONS = ("position_embeddings", "object_queries", "query_position_embeddings")
"""Absolute positions a call passes as one (B, T, D) tensor, added to the input of the query projection and, in
self-attention, of the key projection, never of the value projection (DETR's recipe: `q_proj(x + pos)`, `k_proj(x +
pos)`, `v_proj(x)`; Table Transformer's and DAB-DETR's `object_queries`)."""
KEY_POSITIONS = ("encoder_position_embeddings", "spatial_position_embeddings")
"""The memory's absolute positions in a cross-attention call, added to the key projection's input only."""
CALL_STREAMS = ("hidden_states", "attention_mask", "key_value_states", "encoder_hidden_states")

SCORE_BIASES = ("alibi", "position_bias", "relative_position_bias", "rel_pos", "attention_bias")


def _per_group(fused: Projection, H: int, G: int, d: int) -> tuple[Projection, Projection, Projection]:
    """q, k and v of a query_key_value whose rows are laid out per key/value group: (G, H/G + 2, d), each group's
    H/G query heads, then its key head, then its value head (GPT-NeoX: G = H, q, k, v interleaved per head)."""
    D = fused.weight.shape[-1]
    w = fused.weight.view(G, H // G + 2, d, D)
    b = fused.bias.view(G, H // G + 2, d) if fused.bias is not None else None
    parts = (slice(0, H // G), slice(H // G, H // G + 1), slice(H // G + 1, H // G + 2))
    return tuple(Projection(w[:, p].reshape(-1, D), None if b is None else b[:, p].reshape(-1)) for p in parts)


def huggingface(module: nn.Module) -> Projections | None:
    names = next((n for n in HF_QKV if all(_linear(getattr(module, x, None)) is not None for x in n)), None)
    fused = _linear(getattr(module, "qkv_proj", None)) if names is None else None  # Phi-3's q, k, v rows stacked
    # GPT-NeoX's (BLOOM's, Falcon's): rows per key/value group, (G, H/G + 2, d)
    grouped = _linear(getattr(module, "query_key_value", None)) if names is None and fused is None else None
    if names is None and fused is None and grouped is None:
        return None
    out_name = next((n for n in HF_OUT if _linear(getattr(module, n, None)) is not None), None)
    if out_name is None and names != HF_QKV[1]:
        return None
    o = _linear(getattr(module, out_name)) if out_name else None  # BERT's self-attention: projected by its parent
    d, d_where = _read_int(module, ("head_dim", "attention_head_size", "head_size"))
    H, h_where = _read_int(module, HEADS)
    G, g_where = _read_int(module, KV_HEADS)
    if fused is not None:
        if not (H and d):
            raise NotApplicable("a fused qkv_proj, but no num_attention_heads and head_dim to split it by")
        G, g_where = (G, g_where) if G else (H, "num_attention_heads: no key/value heads declared")
        if fused.weight.shape[0] != (H + 2 * G) * d:
            raise NotApplicable(f"qkv_proj gives {fused.weight.shape[0]} features, not ({H} + 2 x {G}) heads x {d}")
        w, b = fused.weight.split((H * d, G * d, G * d)), (fused.bias.split((H * d, G * d, G * d))
                                                          if fused.bias is not None else (None,) * 3)
        q, k, v = (Projection(w[i], b[i]) for i in range(3))
        names = ("qkv_proj",)
    elif grouped is not None:
        if not H:
            raise NotApplicable("a fused query_key_value, but no number of heads to split it by")
        G, g_where = (G, g_where) if G else (H, "num_attention_heads: no key/value heads declared")
        d, d_where = (d, d_where) if d else (grouped.weight.shape[0] // (H + 2 * G), "query_key_value's width")
        if grouped.weight.shape[0] != (H + 2 * G) * d or H % G:
            raise NotApplicable(f"query_key_value gives {grouped.weight.shape[0]} features, not ({H} + 2 x {G}) "
                                f"heads x {d}")
        q, k, v = _per_group(grouped, H, G, d)
        names = ("query_key_value",)
    else:
        q, k, v = (_linear(getattr(module, n)) for n in names)
    if H is None and d:
        H, h_where = q.weight.shape[0] // d, f"q_proj's {q.weight.shape[0]} features / head_dim"
    if H is None:
        raise NotApplicable("no number of heads on the module or its config (num_heads, num_attention_heads)")
    if d is None:
        d, d_where = q.weight.shape[0] // H, f"q_proj's {q.weight.shape[0]} features / {H} heads"
    if G is None:
        G, g_where = k.weight.shape[0] // d, f"k_proj's {k.weight.shape[0]} features / head_dim {d}"
    if q.weight.shape[0] != H * d or k.weight.shape[0] != G * d or v.weight.shape[0] != G * d or H % G:
        raise NotApplicable(f"projection widths q {q.weight.shape[0]}, k {k.weight.shape[0]}, v {v.weight.shape[0]} "
                            f"are not {H} heads ({h_where}) and {G} key/value heads ({g_where}) of width {d}")
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool) and scaling > 0:
        scale, s_where = float(scaling), f"scale {float(scaling):.4g} ({type(module).__name__}.scaling)"
    else:
        scale, s_where = d ** -0.5, f"scale 1/sqrt({d}) (no `scaling` attribute)"
    value_scale, v_where = _value_scale(module)
    config = getattr(module, "config", None)
    for name in ("attn_logit_softcapping", "logit_softcapping"):
        if getattr(module, name, None) or getattr(config, name, None):
            raise NotApplicable(f"{name} is set: the recompute has no soft-capping")
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    used = [*(getattr(module, n) for n in names), getattr(module, out_name) if out_name else None, q_norm, k_norm]
    projections = ", ".join(names) + f" and {out_name}" if out_name else ", ".join(names) + " (no output projection)"
    unused = _unused(module, used)
    if unused:
        raise NotApplicable(f"{type(module).__name__} holds {', '.join(unused[:4])}, which the recompute from "
                            f"{projections} does not use")
    why = _dropout_active(module, "attention_dropout", "dropout")
    if why:
        raise NotApplicable(why)
    rotate = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)

    def inputs(args: dict) -> CallInputs:
        x = args.get("hidden_states")
        if not isinstance(x, Tensor):
            raise NotApplicable("the call passed no hidden_states tensor")
        memory = next((args[n] for n in ("key_value_states", "encoder_hidden_states")
                       if isinstance(args.get(n), Tensor)), x)
        B, Tq, Tk = x.shape[0], x.shape[1], memory.shape[1]
        read = []
        # a memory given as encoder_hidden_states comes with its own mask where one is passed (LightGlue's
        # cross-attention applies encoder_attention_mask; its attention_mask is the queries' own)
        mask_name = "encoder_attention_mask" if memory is args.get("encoder_hidden_states") and \
            isinstance(args.get("encoder_attention_mask"), Tensor) else "attention_mask"
        bias = _four_d(additive(args.get(mask_name), blocked_when_true=False), B, H, Tq, Tk)
        if bias is not None:
            read.append(f"{mask_name} as passed (bool: True = may attend; float: added)")
        rotary = None
        tables = args.get("position_embeddings")
        query_in, key_in, used = x, memory, set(CALL_STREAMS)
        if isinstance(tables, Tensor):  # absolute positions, one (B, T, D) tensor: added to the q and k inputs
            tables = None
        for names, into_query in ((QK_POSITIONS, True), (KEY_POSITIONS, False)):
            name = next((n for n in names if isinstance(args.get(n), Tensor)), None)
            if name is None:
                continue
            pos = args[name]
            if not pos.is_floating_point() or pos.shape[-1] != x.shape[-1]:
                raise NotApplicable(f"{name} of shape {tuple(pos.shape)}: not positions of the hidden states' width "
                                    f"{x.shape[-1]} to add to them")
            try:
                if into_query:
                    query_in = x + pos
                    key_in = key_in + pos if memory is x else key_in
                else:
                    key_in = memory + pos
            except RuntimeError:
                raise NotApplicable(f"{name} of shape {tuple(pos.shape)} does not add to the inputs "
                                    f"{tuple(x.shape)} / {tuple(memory.shape)}") from None
            used.add(name)
            read.append(f"{name} added to the " + ("query's input" + (" and the key's" if memory is x else "")
                                                   if into_query else "key's input") + ", not the value's")
        if tables is not None:
            if not (isinstance(tables, tuple) and len(tables) == 2 and callable(rotate)):
                raise NotApplicable("position_embeddings given, but no (cos, sin) pair or no apply_rotary_pos_emb "
                                    f"in {type(module).__module__} to apply them as the module does")
            cos, sin = tables
            if not isinstance(cos, Tensor) or cos.shape[-1] > d:
                raise NotApplicable(f"rotary tables of width {getattr(cos, 'shape', ['?'])[-1]}, not at most the head "
                                    f"width {d}")

            def rotary(q_, k_):
                partial = cos.shape[-1] < d
                try:
                    turned = rotate(q_, k_, cos.to(q_.dtype), sin.to(q_.dtype))
                except (RuntimeError, TypeError) as error:  # another signature or layout than Llama's
                    raise NotApplicable(f"{type(module).__module__}.apply_rotary_pos_emb does not take (q, k, cos, "
                                        f"sin) on (B, H, T, d) as Llama's does"
                                        + (f", or a partial rotary of width {cos.shape[-1]} of {d} (the module "
                                           f"applies it in its own way)" if partial else "") + f" ({error})") from None
                if tuple(turned[0].shape) != tuple(q_.shape) or tuple(turned[1].shape) != tuple(k_.shape):
                    raise NotApplicable(f"{type(module).__module__}.apply_rotary_pos_emb returns another shape than "
                                        f"it is given: a partial rotary the module applies in its own way")
                return turned

            read.append(f"rotary tables from the call's position_embeddings, applied by "
                        f"{type(module).__module__}.apply_rotary_pos_emb")
        biased = next((n for n in SCORE_BIASES if isinstance(args.get(n), Tensor)), None)
        if biased:  # BLOOM's ALiBi, T5's relative bias: added to the scores by the module
            raise NotApplicable(f"the call passes {biased}, a bias on the scores the recompute does not add")
        if tables is None and any(n in args for n in ("position_ids", "rotary_pos_emb", "freqs_cis")) and \
                args.get("position_ids") is not None:
            raise NotApplicable("the call passes positions the module turns into rotary tables itself")
        if tables is not None:
            used.add("position_embeddings")
        # values the module may apply in its own way (RoFormer's sinusoidal_pos); an index (cache_position,
        # position_ids) is no value of its own: the positions it points at come in the tables read above
        unread = tuple(n for n, a in args.items() if isinstance(a, Tensor) and a.is_floating_point() and n not in used)
        return CallInputs(query_in, key_in, memory, bias, rotary, tuple(read), unread)

    read = [f"{projections} of {type(module).__name__}, {H} heads ({h_where}), {G} key/value "
            f"heads ({g_where}), head width {d}" + (f" ({d_where})" if d_where else ""), s_where]
    if v_where:
        read.append(v_where)
    if q_norm is not None or k_norm is not None:
        read.append("q_norm / k_norm applied to each head" + (" (or to all heads where their width says so)"))
    return Projections("Hugging Face", module, q, k, v, o, H, G, d, scale, read, inputs, _first,
                       q_norm=q_norm, k_norm=k_norm, value_scale=value_scale)


VALUE_SCALES = ("v_scale", "value_scale")
"""Attributes in which a module states what it multiplies its values by (MiMo-V2-Flash: `v_scale`, from its config's
`attention_value_scale`, 0.707 by default): the recompute applies it, so that a module that states one and does not
apply it (or applies another) still differs."""


def _value_scale(module: nn.Module) -> tuple[float, str]:
    for name in VALUE_SCALES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1:
            return float(value), f"values times {float(value):.4g} ({type(module).__name__}.{name})"
    return 1.0, ""


FUSED_OUT = ("proj", "out", "out_proj", "o_proj")
PATTERN_ATTRIBUTES = ("rotary", "sliding_window", "attention_chunk_size", "prefix", "documents", "window_size")


def fused_qkv(module: nn.Module) -> Projections | None:
    qkv = _linear(getattr(module, "qkv", None))
    out_name = next((n for n in FUSED_OUT if _linear(getattr(module, n, None)) is not None), None)
    if qkv is None or out_name is None:
        return None
    H, h_where = _read_int(module, HEADS)
    if H is None:
        raise NotApplicable(f"a fused qkv projection but no number of heads ({', '.join(HEADS)}) on the module")
    width = qkv.weight.shape[0]
    d, d_where = _read_int(module, ("head_dim",))
    d = d or width // (3 * H)
    if width != 3 * H * d:
        raise NotApplicable(f"qkv gives {width} features, not 3 x {H} heads x {d}")
    for name in PATTERN_ATTRIBUTES:
        value = getattr(module, name, None)
        if value is not None and value is not False and not callable(value):
            raise NotApplicable(f"{type(module).__name__}.{name}={value!r}: a position or pattern step the recompute "
                                f"does not make (it would have to guess the layer's table)")
    scale = getattr(module, "scale", None)
    scale = float(scale) if isinstance(scale, float) and scale > 0 else d ** -0.5
    q_norm, k_norm, norm = (getattr(module, n, None) for n in ("q_norm", "k_norm", "norm"))
    norm = norm if isinstance(norm, nn.Module) else None
    used = [module.qkv, getattr(module, out_name), q_norm, k_norm, norm]
    unused = _unused(module, used)
    if unused:
        raise NotApplicable(f"{type(module).__name__} holds {', '.join(unused[:4])}, which the recompute from qkv "
                            f"and {out_name} does not use")
    why = _dropout_active(module, "dropout_p")
    if why:
        raise NotApplicable(why)
    w_q, w_k, w_v = qkv.weight.split(H * d)
    b_q, b_k, b_v = qkv.bias.split(H * d) if qkv.bias is not None else (None, None, None)
    causal = getattr(module, "causal", None)
    causal = causal if isinstance(causal, bool) else None
    params = list(inspect.signature(module.forward).parameters)

    def inputs(args: dict) -> CallInputs:
        x = args.get(params[0]) if params else None
        if not isinstance(x, Tensor):
            raise NotApplicable(f"the call passed no tensor as {params[0] if params else 'its first argument'}")
        k = args.get("key") if isinstance(args.get("key"), Tensor) else x
        v = args.get("value") if isinstance(args.get("value"), Tensor) else k
        mask_name = next((n for n in ("mask", "attn_mask", "attention_mask") if n in args), None)
        if args.get("is_causal"):
            raise NotApplicable("is_causal=True passed: the recompute reads causality from the output instead")
        mask = args.get(mask_name) if mask_name else None
        # a tensor the call passes beside the tokens and the mask (timm's EVA `rope`, ViT-SRelPos' `shared_rel_pos`)
        # is a step of the layer's own recipe (rotary positions, a bias on the scores) the recompute cannot make
        taken = (params[0], "key", "value", mask_name)
        extra = [n for n, a in args.items() if isinstance(a, Tensor) and n not in taken]
        if extra:
            raise NotApplicable(f"the call passes {', '.join(extra)}, a tensor the recompute from qkv and {out_name} "
                                f"does not use (rotary positions or a bias on the scores of the layer's own)")
        B, Tq, Tk = x.shape[0], x.shape[1], k.shape[1]
        bias = _four_d(additive(mask, blocked_when_true=False), B, H, Tq, Tk)
        read = (f"{mask_name} as passed (bool: True = may attend)",) if bias is not None else ()
        return CallInputs(x, k, v, bias, read=read)

    kind = "this project's reference" if type(module).__module__.startswith("correct.") else type(module).__module__
    read = [f"qkv and {out_name} of {type(module).__name__} ({kind}), {H} heads ({h_where}), head width {d}"
            + (f" ({d_where})" if d_where else ""), f"scale {scale:.4g}"]
    return Projections("fused qkv", module, Projection(w_q, b_q), Projection(w_k, b_k), Projection(w_v, b_v),
                       _linear(getattr(module, out_name)), H, H, d, scale, read, inputs, _first,
                       q_norm=q_norm, k_norm=k_norm, norm=norm, causal=causal)


KNOWN_LIBRARIES = ("torch.", "transformers.", "timm.", "correct.")


def _known(module: nn.Module) -> bool:
    return type(module).__module__.startswith(KNOWN_LIBRARIES)


def _first(out) -> Tensor:
    """The attention output of what a module returned: itself, or the first tensor of a tuple."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise NotApplicable(f"the module returned {type(out).__name__}, not a tensor or a tuple starting with one")


RECOGNISERS = (torch_mha, huggingface, fused_qkv)


def recognise(module: nn.Module) -> Projections | str | None:
    """The module's projections, or why they cannot be used (a str), or None where no recogniser matches."""
    for recogniser in RECOGNISERS:
        try:
            found = recogniser(module)
        except NotApplicable as why:
            return str(why)
        if found is not None:
            found.known = _known(module)
            return found
    return None


def bind(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by parameter name (a `**kwargs` parameter's entries among them)."""
    sig = inspect.signature(module.forward)
    bound = dict(sig.bind_partial(*args, **kwargs).arguments)
    for name, p in sig.parameters.items():
        if p.kind == inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
            bound.update(bound.pop(name))
    return bound


__all__ = ["STEPS", "CallInputs", "NotApplicable", "Projection", "Projections", "RECOGNISERS", "attend", "bind",
           "recognise"]
