"""Real attention bugs, each reproduced in this project's own code as a fixed layer and its buggy twin.

Every bug below was reported in a public issue tracker or pull request (the URL is cited as the search
returned it). None of their code is copied: each layer is written here, in the style the bug lived in (a ViT
block, a nanoGPT-style decoder, a BERT-style encoder, a cached decoder, a FlexAttention-style mask_mod...),
and the buggy twin is a subclass that overrides one small method, or one function beside its fixed twin,
written as that method with the bug in it. `benchmarks/real_bugs.py` finds the differing lines with difflib
over the two methods' sources, audits both halves with the declarations a user would give, and prints the
table.

Legend:  B = batch, T = sequence length (Tq / Tk: queries / keys), D = d_model, H = heads, d = D // H.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diagnostics.patterns import sliding_window

D_MODEL, HEADS = 32, 4  # every layer here: width 32, 4 heads of 8


def rotary(x: Tensor, positions: Tensor) -> Tensor:
    """RoPE, half-split pairing (i, i + d/2): x (..., T, d) turned by positions (T,) along its axis -2."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)  # (d/2,)
    angles = positions.to(torch.float64)[:, None] * freqs  # (T, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


# ---- 1. a ViT block: fused qkv, no mask ---------------------------------------------------------------------
class ViTAttention(nn.Module):
    """timm-style multi-head self-attention of an image encoder: (B, T, D) -> (B, T, D)."""

    def __init__(self, dim: int = D_MODEL, num_heads: int = HEADS, attn_drop: float = 0.0):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.scale = self.softmax_scale()

    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5  # 1/sqrt(d_k), d_k the width of one head

    def split(self, x: Tensor) -> list[Tensor]:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, D)
        return [t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)]  # 3 x (B, H, T, d)

    def attend(self, q: Tensor, k: Tensor) -> Tensor:
        scores = q @ k.transpose(-2, -1)  # (B, H, T, d) x (B, H, d, T) -> (B, H, T, T)
        weights = (scores * self.scale).softmax(dim=-1)  # each query's weights over the keys sum to 1
        return weights

    def merge(self, y: Tensor) -> Tensor:
        B, H, T, d = y.shape
        return y.transpose(1, 2).reshape(B, T, H * d)  # (B, H, T, d) -> (B, T, H, d) -> (B, T, D)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split(x)
        weights = self.attn_drop(self.attend(q, k))  # (B, H, T, T)
        return self.proj(self.merge(weights @ v))


class ViTScaledByWidth(ViTAttention):
    def softmax_scale(self) -> float:
        return self.d_model ** -0.5  # 1/sqrt(d_k), d_k the width of one head


class ViTScaledByHeads(ViTAttention):
    def softmax_scale(self) -> float:
        return self.num_heads ** -0.5  # 1/sqrt(d_k), d_k the width of one head


class ViTUnscaled(ViTAttention):
    def attend(self, q: Tensor, k: Tensor) -> Tensor:
        scores = q @ k.transpose(-2, -1)  # (B, H, T, d) x (B, H, d, T) -> (B, H, T, T)
        weights = scores.softmax(dim=-1)  # each query's weights over the keys sum to 1
        return weights


class ViTScaledAfterSoftmax(ViTAttention):
    def attend(self, q: Tensor, k: Tensor) -> Tensor:
        scores = q @ k.transpose(-2, -1)  # (B, H, T, d) x (B, H, d, T) -> (B, H, T, T)
        weights = scores.softmax(dim=-1) * self.scale  # each query's weights over the keys sum to 1
        return weights


class ViTSoftmaxOverQueries(ViTAttention):
    def attend(self, q: Tensor, k: Tensor) -> Tensor:
        scores = q @ k.transpose(-2, -1)  # (B, H, T, d) x (B, H, d, T) -> (B, H, T, T)
        weights = (scores * self.scale).softmax(dim=-2)  # each query's weights over the keys sum to 1
        return weights


class ViTMergedWithoutTranspose(ViTAttention):
    def merge(self, y: Tensor) -> Tensor:
        B, H, T, d = y.shape
        return y.reshape(B, T, H * d)  # (B, H, T, d) -> (B, T, H, d) -> (B, T, D)


class ViTSplitWithoutTranspose(ViTAttention):
    def split(self, x: Tensor) -> list[Tensor]:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, D)
        return [t.reshape(B, self.num_heads, T, self.head_dim) for t in (q, k, v)]  # 3 x (B, H, T, d)


class FusedViTAttention(ViTAttention):
    """The same block on torch's fused kernel; SDPA's dropout_p is applied whatever the module's mode."""

    def fused(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.attn_drop.p if self.training else 0.0  # F.dropout's `training`, which SDPA does not take
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, T, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.merge(self.fused(*self.split(x))))


class FusedViTDropoutInEval(FusedViTAttention):
    def fused(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.attn_drop.p  # F.dropout's `training`, which SDPA does not take
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, T, d)


# ---- 2. a nanoGPT-style decoder: causal by construction, no mask argument ----------------------------------
class CausalSelfAttention(nn.Module):
    """A GPT block's attention on SDPA: causal itself, (B, T, D) -> (B, T, D)."""

    causal = True

    def __init__(self, d_model: int = D_MODEL, n_head: int = HEADS, dropout: float = 0.0):
        super().__init__()
        self.d_model, self.num_heads, self.dropout = d_model, n_head, dropout
        self.c_attn, self.c_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def heads(self, x: Tensor) -> list[Tensor]:
        B, T, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)  # 3 x (B, T, D)
        return [t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2) for t in (q, k, v)]  # (B, H, T, d)

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, d)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        y = self.attention(*self.heads(x))  # (B, H, T, d)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, D))


class CausalDropoutInEval(CausalSelfAttention):
    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.dropout
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, d)


class ExplicitMaskCausal(CausalSelfAttention):
    """The same decoder passing SDPA a bool mask it builds, where True = may attend."""

    def causal_mask(self, T: int, device) -> Tensor:
        return torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T), True on and below the diagonal

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal_mask(q.shape[-2], q.device))


class ExplicitMaskInverted(ExplicitMaskCausal):
    def causal_mask(self, T: int, device) -> Tensor:
        return torch.ones(T, T, dtype=torch.bool, device=device).triu(diagonal=1)  # (T, T), True on and below the diagonal


class MaskModCausal(CausalSelfAttention):
    """The same decoder with its mask written as a FlexAttention-style mask_mod: True = the pair is kept."""

    @staticmethod
    def mask_mod(b, h, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx  # keep a key at or before the query

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        idx = torch.arange(q.shape[-2], device=q.device)
        keep = self.mask_mod(None, None, idx[:, None], idx[None, :])  # (T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class MaskModInverted(MaskModCausal):
    @staticmethod
    def mask_mod(b, h, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx < kv_idx  # keep a key at or before the query


class WeightsCausalAttention(CausalSelfAttention):
    """The decoder that can return its weights: then it leaves the fused path for an explicit softmax."""

    def __init__(self, *args, return_attention_scores: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.return_attention_scores = return_attention_scores

    def explicit(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), float("-inf"))  # the future
        weights = scores.softmax(dim=-1)
        return weights @ v, weights  # (B, H, T, d), (B, H, T, T)

    def forward(self, x: Tensor):
        B, T, D = x.shape
        q, k, v = self.heads(x)
        if not self.return_attention_scores:
            return super().forward(x)
        y, weights = self.explicit(q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, D)), weights


class WeightsPathDropsCausal(WeightsCausalAttention):
    def explicit(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        weights = scores.softmax(dim=-1)
        return weights @ v, weights  # (B, H, T, d), (B, H, T, T)


class MaskedCausalAttention(CausalSelfAttention):
    """A decoder that builds its own causal mask and also takes a mask (True = may attend) to combine with it."""

    def combined(self, mask: Tensor | None, T: int, device) -> Tensor:
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
        if mask is None:
            return causal
        return mask & causal  # (B, 1, T, T)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.combined(mask, T, x.device))
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, D))


class CausalOnlyWithMask(MaskedCausalAttention):
    def combined(self, mask: Tensor | None, T: int, device) -> Tensor:
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
        if mask is None:
            return mask
        return mask & causal  # (B, 1, T, T)


class Head(nn.Module):
    """One head of a from-scratch GPT, as a module of its own: a registered causal mask as long as the context."""

    def __init__(self, n_embd: int, head_size: int, block_size: int = 64):
        super().__init__()
        self.key, self.query = nn.Linear(n_embd, head_size, bias=False), nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def scores(self, q: Tensor, k: Tensor, x: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, hs) x (B, hs, T) -> (B, T, T), over sqrt(head_size)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        k, q = self.key(x), self.query(x)  # (B, T, hs)
        wei = self.scores(q, k, x).masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        return wei.softmax(dim=-1) @ self.value(x)  # (B, T, hs)


class HeadScaledByEmbedding(Head):
    def scores(self, q: Tensor, k: Tensor, x: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1) * x.shape[-1] ** -0.5  # (B, T, hs) x (B, hs, T) -> (B, T, T), over sqrt(head_size)


class MultiHeadFromHeads(nn.Module):
    """Heads run side by side and concatenated, then projected."""

    causal = True

    def __init__(self, head: type[Head] = Head, n_embd: int = D_MODEL, num_heads: int = HEADS, block_size: int = 64):
        super().__init__()
        self.d_model, self.num_heads, self.block_size = n_embd, num_heads, block_size
        self.heads = nn.ModuleList(head(n_embd, n_embd // num_heads, block_size) for _ in range(num_heads))
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))  # (B, T, D)


# ---- 3. a BERT-style encoder that takes a mask -------------------------------------------------------------
class MaskedEncoderAttention(nn.Module):
    """Encoder self-attention; mask bool (B, 1, T, T), True = may attend."""

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)

    def masked_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before the softmax: blocked keys get 0
        return scores.softmax(dim=-1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, T)
        y = self.masked_softmax(scores, mask) @ v  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class MaskAfterSoftmax(MaskedEncoderAttention):
    def masked_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        scores = scores.softmax(dim=-1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before the softmax: blocked keys get 0
        return scores


class MaskMultiplied(MaskedEncoderAttention):
    def masked_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            scores = scores * mask  # -inf before the softmax: blocked keys get 0
        return scores.softmax(dim=-1)


class ZeroRowsEncoder(MaskedEncoderAttention):
    """The encoder whose query with every key blocked gets zeros (SDPA's and the ONNX spec's behaviour)."""

    def masked_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before the softmax: blocked keys get 0
        return scores.softmax(dim=-1).nan_to_num(0.0)  # an all -inf row is NaN after softmax: flush it to 0


class NaNRowsEncoder(ZeroRowsEncoder):
    def masked_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before the softmax: blocked keys get 0
        return scores.softmax(dim=-1)  # an all -inf row is NaN after softmax: flush it to 0


class PaddedEncoderAttention(MaskedEncoderAttention):
    """The encoder fed a padding mask (B, Tk), True = padding, which it turns into a (B, 1, 1, Tk) keep mask."""

    def keep_mask(self, padding: Tensor) -> Tensor:
        return ~padding[:, None, None, :]  # (B, Tk) -> (B, 1, 1, Tk): one row of keys, shared by every query

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return super().forward(x, None if key_padding_mask is None else self.keep_mask(key_padding_mask))


class PaddingMaskOnQueries(PaddedEncoderAttention):
    def keep_mask(self, padding: Tensor) -> Tensor:
        return ~padding[:, None, :, None]  # (B, Tk) -> (B, 1, 1, Tk): one row of keys, shared by every query


# ---- 4. a cached decoder: queries are the last Tq of the Tk positions ----------------------------------------
class CachedDecoderAttention(nn.Module):
    """Decoder self-attention over a KV cache: `key`/`value` hold the cached tokens and the new ones, and the
    queries are the newest Tq of them (Tq = Tk without a cache). Causal with bottom-right alignment."""

    causal = True

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS, rotary: bool = False):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim, self.rotary = d_model, num_heads, d_model // num_heads, rotary
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def positions(self, t_q: int, t_k: int, device) -> tuple[Tensor, Tensor]:
        return torch.arange(t_k - t_q, t_k, device=device), torch.arange(t_k, device=device)  # the queries come last

    def causal_mask(self, t_q: int, t_k: int, device) -> Tensor:
        i = torch.arange(t_q, device=device)[:, None] + (t_k - t_q)  # (Tq, 1): query i is token Tk - Tq + i
        return torch.arange(t_k, device=device) <= i  # (Tq, Tk), True = may attend

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal_mask(q.shape[-2], k.shape[-2], q.device))

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None) -> Tensor:
        key = query if key is None else key
        value = key if value is None else value
        B, t_q, D = query.shape

        def split(t: Tensor) -> Tensor:
            return t.view(B, t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)

        q, k, v = split(self.wq(query)), split(self.wk(key)), split(self.wv(value))
        if self.rotary:
            pos_q, pos_k = self.positions(q.shape[-2], k.shape[-2], q.device)
            q, k = rotary(q, pos_q), rotary(k, pos_k)
        y = self.attend(q, k, v)  # (B, H, Tq, d)
        return self.wo(y.transpose(1, 2).reshape(B, t_q, D))


class CausalMaskTopLeft(CachedDecoderAttention):
    def causal_mask(self, t_q: int, t_k: int, device) -> Tensor:
        i = torch.arange(t_q, device=device)[:, None]  # (Tq, 1): query i is token Tk - Tq + i
        return torch.arange(t_k, device=device) <= i  # (Tq, Tk), True = may attend


class IsCausalWithCache(CachedDecoderAttention):
    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class AdditiveCachedDecoder(CachedDecoderAttention):
    """The cached decoder with an additive causal bias: -inf above the diagonal of the new tokens."""

    def causal_bias(self, t_q: int, t_k: int, device) -> Tensor:
        square = torch.full((t_q, t_q), float("-inf"), device=device).triu(1)  # (Tq, Tq): new tokens among themselves
        return torch.hstack([torch.zeros(t_q, t_k - t_q, device=device), square])  # (Tq, Tk): every cached key is seen

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal_bias(q.shape[-2], k.shape[-2], q.device))


class SquareBiasWithCache(AdditiveCachedDecoder):
    def causal_bias(self, t_q: int, t_k: int, device) -> Tensor:
        square = torch.full((t_q, t_q), float("-inf"), device=device).triu(1)  # (Tq, Tq): new tokens among themselves
        return square  # (Tq, Tk): every cached key is seen


class RotaryNotOffset(CachedDecoderAttention):
    def positions(self, t_q: int, t_k: int, device) -> tuple[Tensor, Tensor]:
        return torch.arange(t_q, device=device), torch.arange(t_k, device=device)  # the queries come last


# ---- 5. heads-last layout (B, T, H, d), rotary -------------------------------------------------------------
class HeadsLastRotaryAttention(nn.Module):
    """A causal LM's attention keeping q, k, v as (B, T, H, d), flash-attn's layout, with rotary embeddings."""

    causal = True

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.in_proj, self.out_proj = nn.Linear(d_model, 3 * d_model, bias=False), nn.Linear(d_model, d_model, bias=False)

    def rotate(self, x: Tensor) -> Tensor:  # x (B, T, H, d)
        positions = torch.arange(x.shape[1], device=x.device)  # (T,)
        return rotary(x.transpose(1, 2), positions).transpose(1, 2)  # turned along the sequence axis

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.in_proj(x).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)  # 3 x (B, T, H, d)
        q, k = self.rotate(q), self.rotate(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, D))


class RotaryOverHeads(HeadsLastRotaryAttention):
    def rotate(self, x: Tensor) -> Tensor:  # x (B, T, H, d)
        positions = torch.arange(x.shape[-2], device=x.device)  # (T,)
        return rotary(x, positions)  # turned along the sequence axis


# ---- 6. ALiBi ------------------------------------------------------------------------------------------------
class AlibiCausalAttention(CausalSelfAttention):
    """Causal attention with ALiBi: a per-head penalty growing with the distance to the key (Press et al. 2021)."""

    def bias(self, T: int, device) -> Tensor:
        i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.num_heads + 1, device=device) / self.num_heads)  # (H,)
        distance = j - i  # (T, T): <= 0 for the past, so the bias penalises far keys
        return (slopes[:, None, None] * distance).masked_fill(j > i, float("-inf"))  # (H, T, T)

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(q.shape[-2], q.device))


class AlibiSignFlipped(AlibiCausalAttention):
    def bias(self, T: int, device) -> Tensor:
        i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.num_heads + 1, device=device) / self.num_heads)  # (H,)
        distance = i - j  # (T, T): <= 0 for the past, so the bias penalises far keys
        return (slopes[:, None, None] * distance).masked_fill(j > i, float("-inf"))  # (H, T, T)


# ---- 7. a sliding window given as flash-attn's (left, right), both inclusive --------------------------------
WINDOW = 4  # keys per query, its own included


class SlidingWindowAttention(CausalSelfAttention):
    """Causal attention over the last `window` tokens (its own included), with the window passed as flash-attn's
    `window_size=(left, right)`: query i sees keys i - left .. i + right, inclusive; left < 0 means unlimited."""

    def __init__(self, *args, window: int = WINDOW, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window

    def window_size(self) -> tuple[int, int]:
        return (self.window - 1, 0)  # inclusive bounds: window - 1 keys before the query, and the query

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        left, right = self.window_size()
        i, j = torch.arange(q.shape[-2], device=q.device)[:, None], torch.arange(k.shape[-2], device=q.device)
        keep = (j <= i + right) & ((left < 0) | (i - j <= left))  # (T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class WindowOneTooWide(SlidingWindowAttention):
    def window_size(self) -> tuple[int, int]:
        return (self.window, 0)  # inclusive bounds: window - 1 keys before the query, and the query


class WindowNegatedIsGlobal(SlidingWindowAttention):
    def window_size(self) -> tuple[int, int]:
        return (-self.window, 0)  # inclusive bounds: window - 1 keys before the query, and the query


# ---- 8. cross-attention of a seq2seq decoder -----------------------------------------------------------------
class CrossAttention(nn.Module):
    """A decoder's cross-attention: queries from the decoder stream x, keys and values from the encoder memory."""

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(d_model, d_model) for _ in range(4))

    def project(self, x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self.w_q(x)  # (B, Tq, D): what the decoder asks
        k = self.w_k(memory)  # (B, Tk, D): what the encoder offers
        v = self.w_v(memory)
        return q, k, v

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        q, k, v = self.project(x, memory)
        B, H = x.shape[0], self.num_heads
        q, k, v = (t.view(B, t.shape[1], H, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, Tq, d)
        return self.w_o(y.transpose(1, 2).reshape(B, q.shape[2], -1))


class CrossAttentionSwapped(CrossAttention):
    def project(self, x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self.w_q(memory)  # (B, Tq, D): what the decoder asks
        k = self.w_k(x)  # (B, Tk, D): what the encoder offers
        v = self.w_v(x)
        return q, k, v


# ---- 9. torch's nn.MultiheadAttention (sequence first) inside a batch-first block ---------------------------
class TokenMixer(nn.Module):
    """A batch-first block around a sequence-first nn.MultiheadAttention: (B, T, D) <-> (T, B, D)."""

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.mha = nn.MultiheadAttention(d_model, num_heads)  # batch_first=False: (T, B, D)

    def swap(self, y: Tensor) -> Tensor:
        return y.transpose(0, 1)  # (B, T, D) <-> (T, B, D): the batch and sequence axes change places

    def forward(self, x: Tensor) -> Tensor:
        y = self.swap(x)
        y, _ = self.mha(y, y, y, need_weights=False)
        return self.swap(y)


class TokenMixerViewed(TokenMixer):
    def swap(self, y: Tensor) -> Tensor:
        return y.reshape(y.shape[1], y.shape[0], y.shape[2])  # (B, T, D) <-> (T, B, D): the batch and sequence axes change places


# ---- 10. heads computed one by one, or in a (B*H, T, d) batch -----------------------------------------------
class LoopHeadsAttention(nn.Module):
    """Each head computed in a loop and the results stacked head-first, (H, B, T, d), then concatenated."""

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        d = d_model // num_heads
        self.q, self.k, self.v = (nn.ModuleList(nn.Linear(d_model, d) for _ in range(num_heads)) for _ in range(3))
        self.o = nn.Linear(d_model, d_model)

    def concat(self, heads: Tensor) -> Tensor:
        H, B, T, d = heads.shape
        return heads.permute(1, 2, 0, 3).reshape(B, T, H * d)  # (H, B, T, d) -> (B, T, H, d) -> (B, T, D)

    def forward(self, x: Tensor) -> Tensor:
        outs = [F.scaled_dot_product_attention(q(x), k(x), v(x)) for q, k, v in zip(self.q, self.k, self.v)]
        return self.o(self.concat(torch.stack(outs)))  # stacked: (H, B, T, d)


class LoopHeadsViewed(LoopHeadsAttention):
    def concat(self, heads: Tensor) -> Tensor:
        H, B, T, d = heads.shape
        return heads.reshape(B, T, H * d)  # (H, B, T, d) -> (B, T, H, d) -> (B, T, D)


class FlatHeadsAttention(nn.Module):
    """Heads folded into the batch, (B*H, T, d) with index b*H + h, as bmm-based layers do."""

    def __init__(self, d_model: int = D_MODEL, num_heads: int = HEADS):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.qkv, self.o = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def unfold(self, y: Tensor, B: int) -> Tensor:
        _, T, d = y.shape
        return y.view(B, self.num_heads, T, d).permute(0, 2, 1, 3).reshape(B, T, self.num_heads * d)  # (B*H, T, d) -> (B, T, D)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.shape[:2]
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2).reshape(B * self.num_heads, T, -1)
                   for t in self.qkv(x).chunk(3, dim=-1))  # 3 x (B*H, T, d)
        weights = torch.bmm(q, k.transpose(1, 2)).div(math.sqrt(self.head_dim)).softmax(dim=-1)  # (B*H, T, T)
        return self.o(self.unfold(torch.bmm(weights, v), B))


class FlatHeadsUnfoldedHeadsFirst(FlatHeadsAttention):
    def unfold(self, y: Tensor, B: int) -> Tensor:
        _, T, d = y.shape
        return y.view(self.num_heads, B, T, d).permute(0, 2, 1, 3).reshape(B, T, self.num_heads * d)  # (B*H, T, d) -> (B, T, D)


# ---- 11. a single-head dot attention of a seq2seq library: softmax over a flattened (B*Tq, Tk) -------------
class DotAttention(nn.Module):
    """Luong-style dot attention: scores q·k (no scale), weights over the memory, output tanh(W [mix; query])."""

    def __init__(self, d_model: int = D_MODEL):
        super().__init__()
        self.d_model, self.num_heads = d_model, 1
        self.linear_out = nn.Linear(2 * d_model, d_model, bias=False)

    def normalise(self, scores: Tensor) -> Tensor:
        B, t_q, t_k = scores.shape
        return scores.view(B * t_q, t_k).softmax(dim=-1).view(B, t_q, t_k)  # over each query's keys

    def forward(self, query: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        weights = self.normalise(query @ memory.transpose(1, 2))  # (B, Tq, D) x (B, D, Tk) -> (B, Tq, Tk)
        mix = weights @ memory  # (B, Tq, D)
        return torch.tanh(self.linear_out(torch.cat([mix, query], dim=-1))), weights


class DotAttentionSoftmaxDim0(DotAttention):
    def normalise(self, scores: Tensor) -> Tensor:
        B, t_q, t_k = scores.shape
        return scores.view(B * t_q, t_k).softmax(dim=0).view(B, t_q, t_k)  # over each query's keys


# ---- 12. an inference library's attention fallback, a function on (B, H, T, d) -------------------------------
def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, sm_scale: float = 1.0) -> Tensor:
    scores = q @ k.transpose(-2, -1) * sm_scale  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, H, Tq, d)


def attention_fallback(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """The path taken where no fused kernel applies; mask bool (B, 1, Tq, Tk), True = may attend."""
    return _attend(q, k, v, mask, sm_scale=q.shape[-1] ** -0.5)


def attention_fallback_unscaled(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """The path taken where no fused kernel applies; mask bool (B, 1, Tq, Tk), True = may attend."""
    return _attend(q, k, v, mask)


# ---- the benchmark's records ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RealBug:
    """One real bug: where it was reported, what it is, and its two halves here.

    `fixed` and `buggy` are the two objects whose sources differ by the bug (methods or functions);
    `make_fixed` / `make_buggy` build the layers a user would audit, and `audit` the declarations the user
    would give, the same for both halves. `cheap`: in the test's default run."""

    id: str
    url: str
    what: str
    fixed: Callable
    buggy: Callable
    make_fixed: Callable[[], object]
    make_buggy: Callable[[], object]
    audit: dict = field(default_factory=dict)
    cheap: bool = False


def _pair(fixed_cls, buggy_cls, method: str, *args, **kwargs):
    """(fixed method, buggy method, fixed factory, buggy factory) of a class pair."""
    return (getattr(fixed_cls, method), getattr(buggy_cls, method),
            lambda: fixed_cls(*args, **kwargs).eval(), lambda: buggy_cls(*args, **kwargs).eval())


def _bug(id: str, url: str, what: str, pair, audit: dict | None = None, cheap: bool = False) -> RealBug:
    fixed, buggy, make_fixed, make_buggy = pair
    return RealBug(id, url, what, fixed, buggy, make_fixed, make_buggy, audit or {}, cheap)


def _heads(head_cls):
    return lambda: MultiHeadFromHeads(head_cls).eval()


CAUSAL = {"causal": True}
WINDOWED = {"causal": True, "pattern": sliding_window(WINDOW)}  # W keys, its own included

BUGS: list[RealBug] = [
    _bug("vit_scale_by_width", "https://github.com/omihub777/ViT-CIFAR/pull/11",
         "the scores are divided by sqrt(d_model), the width of all heads, instead of sqrt(d_k) of one head",
         _pair(ViTAttention, ViTScaledByWidth, "softmax_scale"), cheap=True),
    _bug("clip_scale_by_heads", "https://github.com/tenstorrent/tt-metal/pull/56789",
         "the scores are scaled by 1/sqrt(num_heads) instead of 1/sqrt(head_dim)",
         _pair(ViTAttention, ViTScaledByHeads, "softmax_scale")),
    _bug("no_scale", "https://github.com/PAIR-code/tiny-transformers/issues/71",
         "the raw q·k scores go into the softmax without the 1/sqrt(d_k) scale",
         _pair(ViTAttention, ViTUnscaled, "attend")),
    _bug("scale_after_softmax", "https://github.com/FrancescoSaverioZuppichini/ViT/issues/2",
         "the scale multiplies the weights after the softmax instead of the scores before it",
         _pair(ViTAttention, ViTScaledAfterSoftmax, "attend")),
    _bug("vit_softmax_dim", "https://github.com/nerminnuraydogan/vision-transformer/issues/1",
         "the softmax normalises over the queries (dim=-2) instead of the keys (dim=-1)",
         _pair(ViTAttention, ViTSoftmaxOverQueries, "attend")),
    _bug("merge_without_permute", "https://github.com/jsbaan/transformer-from-scratch/pull/6",
         "the heads' outputs (B, H, T, d) are reshaped to (B, T, D) without moving the head axis behind T first",
         _pair(ViTAttention, ViTMergedWithoutTranspose, "merge"), cheap=True),
    _bug("split_without_transpose", "https://github.com/649453932/Chinese-Text-Classification-Pytorch/issues/10",
         "q, k and v (B, T, D) are split into heads with a plain reshape to (B, H, T, d), no transpose",
         _pair(ViTAttention, ViTSplitWithoutTranspose, "split"), cheap=True),
    _bug("sdpa_dropout_in_eval", "https://github.com/huggingface/pytorch-image-models/pull/1978",
         "dropout_p is passed to SDPA whatever the module's mode, so attention dropout runs in eval",
         _pair(FusedViTAttention, FusedViTDropoutInEval, "fused", attn_drop=0.1)),
    _bug("causal_sdpa_dropout_in_eval", "https://github.com/suno-ai/bark/pull/662",
         "a causal GPT's SDPA call gets its training dropout_p also in eval mode",
         _pair(CausalSelfAttention, CausalDropoutInEval, "attention", dropout=0.1), CAUSAL),
    _bug("sdpa_mask_inverted", "https://github.com/rasbt/LLMs-from-scratch/pull/1062",
         "a True-above-the-diagonal (True = blocked) causal mask is passed to SDPA, whose True means may attend",
         _pair(ExplicitMaskCausal, ExplicitMaskInverted, "causal_mask"), CAUSAL, cheap=True),
    _bug("mask_mod_inverted", "https://github.com/tilde-research/nsa-release/issues/3",
         "the causal mask_mod returns True for the keys to block, but a mask_mod's True means keep",
         _pair(MaskModCausal, MaskModInverted, "mask_mod"), CAUSAL),
    _bug("head_scale_by_embedding", "https://github.com/Graylab/DL4Proteins-notebooks/issues/12",
         "each head scales its scores by C**-0.5, C the embedding width, instead of its own head_size**-0.5",
         (Head.scores, HeadScaledByEmbedding.scores, _heads(Head), _heads(HeadScaledByEmbedding)), CAUSAL),
    _bug("weights_path_drops_causal", "https://github.com/keras-team/keras/issues/23038",
         "the explicit path taken to return the attention scores leaves out the causal mask the fused path had",
         _pair(WeightsCausalAttention, WeightsPathDropsCausal, "explicit"), CAUSAL),
    _bug("causal_only_with_mask", "https://github.com/facebookresearch/xformers/issues/103",
         "the causal mask is applied only when an attention mask is also passed: without one nothing is masked",
         _pair(MaskedCausalAttention, CausalOnlyWithMask, "combined"), CAUSAL),
    _bug("mask_after_softmax", "https://github.com/huggingface/pytorch-image-models/pull/2236",
         "the attention mask is applied to the weights after the softmax instead of to the scores before it",
         _pair(MaskedEncoderAttention, MaskAfterSoftmax, "masked_softmax"), cheap=True),
    _bug("mask_multiplied", "https://github.com/georg-wolflein/good-features/pull/1",
         "a 0/1 mask multiplies the scores, so blocked keys get score 0 and still weight after the softmax",
         _pair(MaskedEncoderAttention, MaskMultiplied, "masked_softmax")),
    _bug("fully_masked_row_nan", "https://github.com/robertknight/rten/pull/1321",
         "a query whose every key is masked gets NaN from the softmax of an all -inf row instead of zeros",
         _pair(ZeroRowsEncoder, NaNRowsEncoder, "masked_softmax")),
    _bug("padding_mask_on_queries", "https://github.com/hyunwoongko/transformer/pull/40",
         "the (B, T) padding mask is expanded to (B, 1, T, 1), blocking padded queries' rows, not padded keys",
         _pair(PaddedEncoderAttention, PaddingMaskOnQueries, "keep_mask"), {"mask": "key_padding"}, cheap=True),
    _bug("causal_mask_top_left_index", "https://github.com/gittensor-ai-lab/sparkinfer/issues/3",
         "with a KV cache the causal bound is key <= query index, forgetting the Tk - Tq cached keys before it",
         _pair(CachedDecoderAttention, CausalMaskTopLeft, "causal_mask"), CAUSAL),
    _bug("is_causal_with_cache", "https://github.com/pytorch/executorch/issues/22426",
         "SDPA's is_causal (top-left aligned) is used when the queries are fewer than the keys, as in decoding",
         _pair(CachedDecoderAttention, IsCausalWithCache, "attend"), CAUSAL, cheap=True),
    _bug("square_mask_with_cache", "https://github.com/meta-llama/llama/pull/900",
         "the causal bias is (Tq, Tq) when the scores are (Tq, Tk) with a cache: more than one new token fails",
         _pair(AdditiveCachedDecoder, SquareBiasWithCache, "causal_bias"), CAUSAL),
    _bug("rotary_not_offset_with_cache", "https://github.com/pytorch/executorch/pull/2010",
         "with a KV cache the new queries are rotated at positions 0..Tq-1 instead of start_pos..start_pos+Tq-1",
         _pair(CachedDecoderAttention, RotaryNotOffset, "positions", rotary=True), CAUSAL),
    _bug("rotary_over_heads", "https://github.com/mlfoundations/open_lm/issues/4",
         "rotary embeddings are applied to (B, T, H, d) tensors along their axis -2, the heads, not the sequence",
         _pair(HeadsLastRotaryAttention, RotaryOverHeads, "rotate"),
         {"causal": True, "positions": "relative"}),  # a rotary layer's author promises relative positions
    _bug("alibi_sign_flipped", "https://github.com/meta-pytorch/attention-gym/pull/86",
         "the ALiBi bias uses q_idx - kv_idx, rewarding distant keys, instead of kv_idx - q_idx",
         _pair(AlibiCausalAttention, AlibiSignFlipped, "bias"), CAUSAL, cheap=True),
    _bug("window_one_too_wide", "https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/2656",
         "a window of W keys (its own included) is passed as flash-attn's inclusive left bound W: W + 1 keys",
         _pair(SlidingWindowAttention, WindowOneTooWide, "window_size"), WINDOWED, cheap=True),
    _bug("window_negated_global", "https://github.com/proger/hippogriff/issues/7",
         "the window is passed as (-W, 0): a negative left bound means unlimited, so attention is global",
         _pair(SlidingWindowAttention, WindowNegatedIsGlobal, "window_size"), WINDOWED),
    _bug("cross_attention_swapped", "https://github.com/rexrex9/nlp_torchtext/pull/2",
         "the decoder's cross-attention takes its queries from the encoder output and keys/values from the decoder",
         _pair(CrossAttention, CrossAttentionSwapped, "project")),
    _bug("seq_first_view", "https://github.com/rish-16/tokenlearner-pytorch/issues/1",
         "(B, T, D) is made sequence-first for nn.MultiheadAttention with a view to (T, B, D) instead of a transpose",
         _pair(TokenMixer, TokenMixerViewed, "swap"), cheap=True),
    _bug("stacked_heads_viewed", "https://github.com/hackiey/QAnet-pytorch/issues/2",
         "heads stacked as (H, B, T, d) are viewed as (B, T, H*d) without the permute that puts B and T first",
         _pair(LoopHeadsAttention, LoopHeadsViewed, "concat")),
    _bug("flat_heads_order", "https://github.com/gazelle93/Transformer-Various-Positional-Encoding/issues/1",
         "the (B*H, T, d) output, batch-major, is unfolded as (H, B, T, d), mixing heads and batch rows",
         _pair(FlatHeadsAttention, FlatHeadsUnfoldedHeadsFirst, "unfold")),
    _bug("softmax_over_batch", "https://github.com/PetrochukM/PyTorch-NLP/issues/2",
         "the softmax of the flattened (B*Tq, Tk) scores runs over dim 0, across queries and batch, not the keys",
         (DotAttention.normalise, DotAttentionSoftmaxDim0.normalise, lambda: DotAttention().eval(),
          lambda: DotAttentionSoftmaxDim0().eval()), {"scale": 1.0}),
    _bug("fallback_unscaled", "https://github.com/mlc-ai/mlc-llm/pull/3426",
         "the fallback path calls the attention helper without sm_scale, so its default 1.0 replaces 1/sqrt(d)",
         (attention_fallback, attention_fallback_unscaled, lambda: attention_fallback,
          lambda: attention_fallback_unscaled), {"d_model": D_MODEL, "num_heads": HEADS}),
]
