"""Layers written unlike `correct/`: the audit must classify them by their properties alone.

Correct ones use einsum, fused SDPA, a chunked online softmax, nanoGPT's fused projection and tril buffer,
rotary embeddings, ALiBi, QK-norm, grouped-query heads, timm's q-side scaling, a declared scale of 1,
additive float masks, and half precision. Broken ones make mistakes the catalog does not contain, or the
catalog's mistakes written another way.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

# ---- correct, unlike the reference -------------------------------------------------------------------


def einsum_attention(q, k, v, mask=None):
    """(B, H, T, d) einsum attention with a bool mask, True = may attend."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v), weights


def chunked_online_attention(q, k, v, mask=None, chunk=3):
    """Flash-style: keys in chunks, a running max and running sum, no (Tq, Tk) weights kept."""
    scale = q.shape[-1] ** -0.5
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)  # running max (B, H, Tq, 1)
    l = torch.zeros_like(m)  # running normaliser  # noqa: E741
    acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)  # (B, H, Tq, d_v)
    for start in range(0, k.shape[-2], chunk):
        s = (q @ k[..., start:start + chunk, :].transpose(-2, -1)) * scale  # (B, H, Tq, c)
        if mask is not None:
            s = s.masked_fill(~mask[..., start:start + chunk], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - safe)
        correction = torch.exp(m - safe)
        l = l * correction + p.sum(-1, keepdim=True)  # noqa: E741
        acc = acc * correction + p @ v[..., start:start + chunk, :]
        m = m_new
    return acc / l.clamp_min(1e-30)


class FusedSDPA(nn.Module):
    """Separate q/k/v projections and torch's fused kernel; returns the output only."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, query, key, value, attn_mask=None):
        B, Tq, D = query.shape
        split = lambda x: x.view(B, x.shape[1], self.num_heads, -1).transpose(1, 2)  # noqa: E731  (B, H, T, d)
        out = F.scaled_dot_product_attention(split(self.q(query)), split(self.k(key)), split(self.v(value)),
                                             attn_mask=attn_mask)
        return self.o(out.transpose(1, 2).reshape(B, Tq, D))


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: fused c_attn, a tril buffer, forward(x)."""

    def __init__(self, n_embd, n_head, block_size=64):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def _rotate(x, positions):
    """Rotary embedding, half-split pairing: (B, H, T, d) rotated by position."""
    d = x.shape[-1] // 2 * 2
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    angles = positions.double().unsqueeze(-1) * freqs  # (T, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2, rest = x[..., : d // 2], x[..., d // 2: d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


class RotaryCausal(nn.Module):
    """RoPE on q and k, then torch's fused causal SDPA: not permutation- or shift-invariant, and correct."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads, self.is_causal = d_model, num_heads, True
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        pos = torch.arange(T, device=x.device)
        y = F.scaled_dot_product_attention(_rotate(q, pos), _rotate(k, pos), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class ALiBiCausal(nn.Module):
    """ALiBi: a per-head linear distance penalty added to the scores, causal, weights returned."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads, self.causal = d_model, num_heads, True
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, num_heads + 1) / num_heads))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        i, j = torch.arange(T, device=x.device).unsqueeze(-1), torch.arange(T, device=x.device)
        bias = -self.slopes.view(-1, 1, 1) * (i - j).abs()  # (H, T, T)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias
        allowed = j <= i if mask is None else (j <= i) & mask
        w = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(B, T, D)), w


class QKNormGQA(nn.Module):
    """QK-norm (per-head LayerNorm of q and k) and grouped-query attention with repeat_interleave."""

    def __init__(self, d_model, num_heads, kv_heads=2):
        super().__init__()
        self.d_model, self.num_heads, self.kv_heads = d_model, num_heads, kv_heads
        self.d = d_model // num_heads
        self.q, self.o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * kv_heads * self.d)
        self.q_norm, self.k_norm = nn.LayerNorm(self.d), nn.LayerNorm(self.d)

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        Tk = key.shape[1]
        q = self.q_norm(self.q(query).view(B, Tq, self.num_heads, self.d).transpose(1, 2))  # (B, H, Tq, d)
        k, _ = self.kv(key).split(self.kv_heads * self.d, -1)
        _, v = self.kv(value).split(self.kv_heads * self.d, -1)
        k = self.k_norm(k.view(B, Tk, self.kv_heads, self.d).transpose(1, 2))  # (B, Hkv, Tk, d)
        v = v.view(B, Tk, self.kv_heads, self.d).transpose(1, 2)
        group = self.num_heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, Tk, d)
        w = (q @ k.transpose(-2, -1) / math.sqrt(self.d))
        if mask is not None:
            w = w.masked_fill(~mask, float("-inf"))
        w = w.softmax(-1).nan_to_num(0.0)
        return self.o((w @ v).transpose(1, 2).reshape(B, Tq, D)), w


class TimmStyle(nn.Module):
    """timm's non-fused path: q multiplied by the scale *before* the matmul; forward(x, attn_mask=None)."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.dim, self.num_heads, self.scale = dim, num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        if attn_mask is not None:
            attn = attn.masked_fill(~attn_mask, float("-inf"))
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class UnscaledT5Style(nn.Module):
    """T5 folds the scale into initialisation: no 1/sqrt(d_k) at all; correct when declared (scale=1)."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.o = nn.Linear(d_model, 3 * d_model, bias=False), nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        scores = torch.matmul(q, k.transpose(3, 2))
        if mask is not None:
            scores = scores + torch.zeros_like(scores).masked_fill(~mask, torch.finfo(scores.dtype).min)
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        return self.o(torch.matmul(w, v).transpose(1, 2).reshape(B, T, D)), w


class PackedInPlaceScale(nn.Module):
    """Scales the q slice of a packed (3, B, H, T, d) projection in place: k, in the same storage, is not scaled.
    Also returns its (k, v) cache, shaped (2, B, H, T, d), beside the output and the weights."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).contiguous()
        q, k, v = qkv[0], qkv[1], qkv[2]
        q.mul_(q.shape[-1] ** -0.5)
        w = q @ k.transpose(-2, -1)
        if mask is not None:
            w = w.masked_fill(~mask, float("-inf"))
        w = w.softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(B, T, D)), w, torch.stack((k, v))


class NormInFloat32(nn.Module):
    """A bfloat16 layer that keeps its (small) LayerNorm in float32, as mixed-precision code does."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.norm = nn.LayerNorm(d_model)
        self.attn = __import__("correct").MultiHeadAttention(d_model, num_heads).to(torch.bfloat16)

    def forward(self, x):
        return self.attn(self.norm(x.float()).to(torch.bfloat16))


CORRECT = {
    "packed q scaled in place, returns its kv cache": lambda: (PackedInPlaceScale(64, 4), dict(seq_len=16)),
    "nn.MultiheadAttention with add_bias_kv": lambda: (nn.MultiheadAttention(24, 3, add_bias_kv=True,
                                                                              batch_first=True), {}),
    "nn.MultiheadAttention with add_zero_attn": lambda: (nn.MultiheadAttention(24, 3, add_zero_attn=True,
                                                                               batch_first=True), {}),
    "bfloat16 layer with a float32 norm": lambda: (NormInFloat32(32, 4), {}),
    "T5-style in float16 with additive finfo.min masks, causal": lambda: (UnscaledT5Style(24, 3).half(),
                                                                          dict(scale=1.0, causal=True)),
    "einsum function": lambda: (einsum_attention, {}),
    "chunked online softmax": lambda: (chunked_online_attention, {}),
    "chunked online softmax, causal by mask": lambda: (chunked_online_attention, dict(causal=True)),
    "torch F.scaled_dot_product_attention": lambda: (F.scaled_dot_product_attention, {}),
    "torch F.scaled_dot_product_attention, causal by mask": lambda: (F.scaled_dot_product_attention, dict(causal=True)),
    "fused SDPA module": lambda: (FusedSDPA(24, 3), {}),
    "fused SDPA module, causal by mask": lambda: (FusedSDPA(24, 3), dict(causal=True)),
    "nanoGPT CausalSelfAttention": lambda: (NanoGPTAttention(24, 3), dict(causal=True)),
    "rotary + fused causal": lambda: (RotaryCausal(24, 4), dict(causal=True)),
    "ALiBi causal": lambda: (ALiBiCausal(24, 4), dict(causal=True)),
    "QK-norm + grouped-query": lambda: (QKNormGQA(32, 4), {}),
    "timm-style q * scale": lambda: (TimmStyle(24, 3), {}),
    "T5-style, scale=1 declared": lambda: (UnscaledT5Style(24, 3), dict(scale=1.0)),
    "nn.MultiheadAttention": lambda: (nn.MultiheadAttention(24, 3, batch_first=True), {}),
    "nn.MultiheadAttention, seq-first, causal by mask": lambda: (nn.MultiheadAttention(24, 3), dict(causal=True)),
    "reference in bfloat16": lambda: (__import__("correct").MultiHeadAttention(32, 4).to(torch.bfloat16), {}),
    "reference in float16, causal": lambda: (__import__("correct").MultiHeadAttention(32, 4, causal=True).half(),
                                             dict(causal=True)),
    "reference in float64": lambda: (__import__("correct").MultiHeadAttention(32, 4).double(), {}),
}


def _on(device, layer, kw):
    if isinstance(layer, nn.Module):
        return layer.to(device), kw
    return layer, {**kw, "device": device}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_layers_never_seen_before_pass(name, device):
    seed_rng(0)
    layer, kw = _on(device, *CORRECT[name]())
    report = diagnostics.audit(layer, **kw)
    assert report.passed, str(report)
    # the only finding a correct layer may get: NaN on a row with no key (nn.MultiheadAttention's behaviour)
    assert set(report.fired()) <= {"fully_masked_rows"}, str(report)
    assert "could not handle" not in str(report)


# ---- broken, unlike the catalog ----------------------------------------------------------------------


def einsum_without_scale(q, k, v, mask=None):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k)  # BUG: no 1/sqrt(d)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


class LeakBehindCleanWeights(nn.Module):
    """Returns causal weights that look right, but computes the output from unmasked ones (an inspection
    path that differs from the fast path, as in transformers PR #30652)."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.inner = NanoGPTAttention(d_model, num_heads)
        self.d_model, self.num_heads, self.causal = d_model, num_heads, True

    def forward(self, x):
        a = self.inner
        B, T, C = x.shape
        q, k, v = (t.view(B, T, a.n_head, -1).transpose(1, 2) for t in a.c_attn(x).split(C, 2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        shown = scores.masked_fill(a.bias[:, :, :T, :T] == 0, float("-inf")).softmax(-1)
        used = scores.softmax(-1)  # BUG: the mask never reaches the values
        return a.c_proj((used @ v).transpose(1, 2).reshape(B, T, C)), shown


def online_softmax_without_rescale(q, k, v, mask=None, chunk=3):
    """The chunked kernel above, forgetting to rescale the accumulated sum when the running max grows."""
    scale = q.shape[-1] ** -0.5
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)  # noqa: E741
    acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    for start in range(0, k.shape[-2], chunk):
        s = (q @ k[..., start:start + chunk, :].transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[..., start:start + chunk], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - safe)
        l = l + p.sum(-1, keepdim=True)  # BUG (missing: * exp(m - m_new))  # noqa: E741
        acc = acc * torch.exp(m - safe) + p @ v[..., start:start + chunk, :]
        m = m_new
    return acc / l.clamp_min(1e-30)


def transposed_padding_mask(q, k, v, mask=None):
    """Reads the mask as (Tk, Tq): square masks broadcast silently, so padding masks rows, not keys."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask.transpose(-2, -1), float("-inf"))  # BUG
    return scores.softmax(-1).nan_to_num(0.0) @ v


def naive_exp_half(q, k, v, mask=None):
    """exp(s) / sum exp(s) without subtracting the row max, no scale, in float16: overflows to inf/inf."""
    s = q @ k.transpose(-2, -1)
    p = torch.exp(s)  # BUG
    if mask is not None:
        p = p * mask
    return (p / p.sum(-1, keepdim=True)) @ v


class HeadsSplitWithoutTranspose(nn.Module):
    """view(B, H, T, d) straight from (B, T, D): each 'head' holds a slice of positions."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        w = self.qkv.weight.split(D)
        b = self.qkv.bias.split(D)
        q, k, v = (F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), w, b))
        q, k, v = (x.reshape(B, self.num_heads, x.shape[1], -1) for x in (q, k, v))  # BUG: no transpose
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(B, Tq, D))


def contrast_sharpened_attention(q, k, v, mask=None, strength=2.0):
    """Pushes the output away from the plain mean of the (allowed) values, to 'sharpen' it:
    out = w @ v + strength * (w @ v - mean v). Identical values still come out unchanged and the softmax it
    runs is a distribution, but the effective weights (1 + strength) w - strength / Tk go negative, so the
    output leaves the values' range. Caught only by output_variance's value-range check (`_bound_check`)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    allowed = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.expand_as(scores)
    w = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    mean = allowed.to(v.dtype) / allowed.sum(-1, keepdim=True).clamp_min(1)  # uniform over the allowed keys
    return w @ v + strength * (w @ v - mean @ v)  # BUG


def negative_weight_attention(q, k, v, mask=None, delta=1e-3):
    """Moves each row's least-attended (allowed) key's weight, and `delta` more, onto its most-attended key:
    rows still sum to 1 and the output stays within the values' range, but one weight per row is -delta
    (ten times float32's allowance). Caught only by weight_row_sums' negative-weight check."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = scores.softmax(-1).nan_to_num(0.0)
    most = w.argmax(-1, keepdim=True)  # (B, H, Tq, 1)
    least = torch.where(w > 0, w, torch.inf).argmin(-1, keepdim=True)  # masked keys keep their zero
    shift = torch.where(w.gather(-1, least) > 0, w.gather(-1, least) + delta, 0)  # a zero-sum move per row
    w = w.scatter_add(-1, most, shift).scatter_add(-1, least, -shift)  # BUG
    return w @ v, w


class DiagonalBlockedFirstRowKept(NanoGPTAttention):
    """nanoGPT with tril(diagonal=-1), each token blocked from itself, and position 0 let through to its own
    key so that no row is empty (the NaN 'fixed'). Nothing leaks from the future, identical tokens still
    give identical outputs and every row is a distribution, so only causal_alignment's diagonal branch (one
    stream, weights observed) sees it. With a safe softmax instead (row 0 all zeros), weight_row_sums and
    output_variance would fire too."""

    def __init__(self, n_embd, n_head, block_size=64):
        super().__init__(n_embd, n_head, block_size)
        allowed = torch.tril(torch.ones(block_size, block_size), diagonal=-1)  # BUG: j < i, the diagonal blocked
        allowed[0, 0] = 1
        self.bias.copy_(allowed.view(1, 1, block_size, block_size))


class SeesOneTokenAhead(NanoGPTAttention):
    """nanoGPT with tril(diagonal=1): each query also sees the very next token, an off-by-one causal mask.
    Only the token right after each cut moves past outputs, so future_leakage must hold row c itself."""

    def __init__(self, n_embd, n_head, block_size=64):
        super().__init__(n_embd, n_head, block_size)
        self.bias.copy_(torch.tril(torch.ones(block_size, block_size), diagonal=1).view(1, 1, block_size, block_size))  # BUG


# name: (broken layer and audit options, detectors that must fail, its correct twin audited the same way)
BROKEN = {
    "einsum without scale": (lambda: (einsum_without_scale, dict(d_model=64, num_heads=2)), {"softmax_saturation"},
                             lambda: einsum_attention),
    "leak behind clean weights": (lambda: (LeakBehindCleanWeights(24, 3), dict(causal=True)), {"future_leakage"},
                                  lambda: NanoGPTAttention(24, 3)),
    "online softmax without rescale": (lambda: (online_softmax_without_rescale, {}), {"output_variance"},
                                       lambda: chunked_online_attention),
    "padding mask read transposed": (lambda: (transposed_padding_mask, {}), {"mask_honoured"},
                                     lambda: einsum_attention),
    "naive exp in float16": (lambda: (naive_exp_half, dict(d_model=128, num_heads=2, dtype=torch.float16)),
                             {"finite_output"}, lambda: F.scaled_dot_product_attention),
    "heads split without transpose": (lambda: (HeadsSplitWithoutTranspose(24, 3), {}), {"query_locality"},
                                      lambda: FusedSDPA(24, 3)),
    "causal mask one token too wide": (lambda: (SeesOneTokenAhead(24, 3), dict(causal=True)), {"future_leakage"},
                                       lambda: NanoGPTAttention(24, 3)),
    # each caught by one branch only (see BRANCH_ONLY below)
    "output pushed out of the values' range": (lambda: (contrast_sharpened_attention, {}), {"output_variance"},
                                               lambda: einsum_attention),
    "negative weights summing to 1": (lambda: (negative_weight_attention, {}), {"weight_row_sums"},
                                      lambda: einsum_attention),
    "causal mask blocking the diagonal, first row kept": (lambda: (DiagonalBlockedFirstRowKept(24, 3),
                                                                   dict(causal=True)), {"causal_alignment"},
                                                          lambda: NanoGPTAttention(24, 3)),
}


def _broken_and_twin(make, make_twin):
    """The broken layer (with its audit options) and its correct twin, each built from seed 0: where both
    are modules with the same parameters, the twin is the same layer with the bug taken out, not later draws."""
    seed_rng(0)
    layer, kw = make()
    seed_rng(0)
    return layer, kw, make_twin()


def _same_weights(layer, twin) -> bool | None:
    """True or False where both are modules with the same parameter names and shapes; None otherwise."""
    if not (isinstance(layer, nn.Module) and isinstance(twin, nn.Module)):
        return None
    mine, theirs = layer.state_dict(), twin.state_dict()
    if {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}:
        return None
    return all(torch.equal(mine[k], theirs[k]) for k in mine if mine[k].is_floating_point()
               and k in dict(layer.named_parameters()))


def test_twins_are_built_from_the_broken_layers_seed():
    """Every broken module with a like-shaped correct twin shares its weights: the twin tests compare the
    same layer with and without its bug."""
    pairs = {**{n: (m, t) for n, (m, _, t) in BROKEN.items()}, **{n: (m, t) for n, (m, _, t) in SECOND_CHAPTER.items()}}
    same = {name: _same_weights(*_broken_and_twin(make, make_twin)[::2]) for name, (make, make_twin) in pairs.items()}
    compared = {name: ok for name, ok in same.items() if ok is not None}
    assert compared, "no broken module has a like-shaped twin: the check compared nothing"
    assert all(compared.values()), f"twins with other weights than their broken layer: {compared}"


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_layers_never_seen_before_are_caught(name):
    make, must_fire, _ = BROKEN[name]
    torch.manual_seed(0)
    layer, kw = make()
    report = diagnostics.audit(layer, **kw)
    assert not report.passed, str(report)
    assert must_fire <= {d for d, v in report.fired().items() if v == "fail"}, str(report)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_the_correct_twin_of_each_broken_layer_passes_with_the_same_options(name):
    make, must_fire, make_twin = BROKEN[name]
    _, kw, twin = _broken_and_twin(make, make_twin)
    report = diagnostics.audit(twin, **kw)
    assert report.passed and not (must_fire & set(report.fired())), str(report)


# name in BROKEN: (the one detector that fails, the message of the branch that must catch it)
BRANCH_ONLY = {
    "output pushed out of the values' range": ("output_variance", "outputs leave the range of the values"),
    "negative weights summing to 1": ("weight_row_sums", "attention weights are not a distribution"),
    "causal mask blocking the diagonal, first row kept": ("causal_alignment",
                                                          "a query gives zero weight to its own position"),
}


@pytest.mark.parametrize("name", sorted(BRANCH_ONLY))
def test_branches_no_catalog_entry_reaches_catch_their_layer_alone(name):
    """The value-range check of output_variance, the negative-weight check of weight_row_sums and the
    diagonal branch of causal_alignment: each is the only thing that fails its layer."""
    make, _, _ = BROKEN[name]
    detector, message = BRANCH_ONLY[name]
    torch.manual_seed(0)
    layer, kw = make()
    report = diagnostics.audit(layer, **kw)
    assert report.fired() == {detector: "fail"}, str(report)
    result = report.result(detector)
    assert result.message.startswith(message), result.message
    if detector == "weight_row_sums":  # the rows sum to 1: only the negative weights are reported
        assert "negative" in result.evidence and "do not sum to 1" not in result.evidence, result.evidence


def test_leak_behind_clean_weights_shows_clean_weights():
    """The weights it returns pass every weight check: only the output-based probe sees the leak."""
    torch.manual_seed(0)
    report = diagnostics.audit(LeakBehindCleanWeights(24, 3), causal=True)
    assert report.result("weight_row_sums").verdict == "pass"
    assert report.result("future_leakage").verdict == "fail"


def test_declared_scale_is_what_the_temperature_is_judged_against():
    torch.manual_seed(0)
    layer = UnscaledT5Style(24, 3)
    assert diagnostics.audit(layer, scale=1.0).result("softmax_saturation").verdict == "pass"
    undeclared = diagnostics.audit(layer).result("softmax_saturation")
    assert undeclared.verdict == "fail" and "too sharp" in undeclared.message


def test_temperature_is_measured_through_float16_additive_masks():
    """Masked logits at float16's -65504 are rounding noise; the fit must use only the attended ones."""
    torch.manual_seed(0)
    layer = UnscaledT5Style(24, 3).half()
    declared = diagnostics.audit(layer, scale=1.0, causal=True).result("softmax_saturation")
    assert declared.verdict == "pass", declared.message
    assert diagnostics.audit(layer, causal=True).result("softmax_saturation").verdict == "fail"


def test_weights_are_told_apart_from_a_returned_cache():
    torch.manual_seed(0)
    report = diagnostics.audit(PackedInPlaceScale(64, 4), seq_len=16)  # head_dim 16 == seq_len
    assert report.weights_source == "returned weights" and report.weights.shape == (2, 4, 16, 16)
    assert report.result("softmax_saturation").verdict == "pass", report.result("softmax_saturation").evidence


# ---- the second chapter's families (issue 9): broken and correct twins, unlike the reference -----------------
# Each family is caught in float32 and bfloat16, at torch's default and at GPT-2's std-0.02 initialisation
# (modules); each twin passes with the same options in the same settings.


def keys_centred_over_the_batch(q, k, v, mask=None):
    """A BatchNorm-like centring of the keys over dim 0, the batch: each sequence now depends on the others."""
    k = k - k.mean(dim=0, keepdim=True)  # BUG
    return einsum_attention(q, k, v, mask)


def scores_from_the_values(q, k, v, mask=None):
    """q @ v^T where q @ k^T was meant: weights still sum to 1, the keys are never read."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, v) / math.sqrt(q.shape[-1])  # BUG
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v), weights


def softmax_twice(q, k, v, mask=None):
    """A helper returned probabilities; the caller normalised them again."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probabilities = scores.softmax(dim=-1).nan_to_num(0.0)
    weights = probabilities.softmax(dim=-1)  # BUG
    return torch.einsum("bhqk,bhkd->bhqd", weights, v)


class _Softmax(torch.autograd.Function):
    """A hand-written softmax over the last dim; `exact=False` is the classic wrong backward (the Jacobian
    taken as the identity)."""

    @staticmethod
    def forward(ctx, scores, exact):
        w = scores.softmax(dim=-1)
        ctx.save_for_backward(w)
        ctx.exact = exact
        return w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        if not ctx.exact:
            return grad, None  # BUG
        return w * (grad - (grad * w).sum(-1, keepdim=True)), None


def custom_softmax_attention(q, k, v, mask=None, exact=True):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.einsum("bhqk,bhkd->bhqd", _Softmax.apply(scores, exact), v)


def custom_softmax_wrong_backward(q, k, v, mask=None):
    return custom_softmax_attention(q, k, v, mask, exact=False)


class RotaryDecoder(nn.Module):
    """Causal, with separate (query, key, value) inputs as in cached decoding, rotary positions and torch's
    fused SDPA: the queries are the last Tq of Tk positions. `offset=False` rotates them as positions 0..Tq-1."""

    causal = True

    def __init__(self, d_model, num_heads, offset=True):
        super().__init__()
        self.d_model, self.num_heads, self.offset = d_model, num_heads, offset
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        Tk, H = key.shape[1], self.num_heads
        q = self.q(query).view(B, Tq, H, -1).transpose(1, 2)  # (B, H, Tq, d)
        k = self.k(key).view(B, Tk, H, -1).transpose(1, 2)  # (B, H, Tk, d)
        v = self.v(value).view(B, Tk, H, -1).transpose(1, 2)
        positions = torch.arange(Tk - Tq, Tk) if self.offset else torch.arange(Tq)  # BUG when not offset
        q, k = _rotate(q, positions.to(q.device)), _rotate(k, torch.arange(Tk, device=k.device))
        allowed = __import__("correct").causal_mask(Tq, Tk, align="bottom_right", device=q.device)  # (Tq, Tk)
        allowed = allowed if mask is None else allowed & mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, Tq, d)
        return self.o(out.transpose(1, 2).reshape(B, Tq, D))


class PaddingOrCausal(NanoGPTAttention):
    """nanoGPT that takes a padding mask and combines it with its causal mask; `combine` is how."""

    causal = True

    def __init__(self, n_embd, n_head, combine="and"):
        super().__init__(n_embd, n_head)
        self.combine = combine

    def forward(self, x, mask=None):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        causal = self.bias[:, :, :T, :T] == 1  # (1, 1, T, T)
        if mask is None:
            allowed = causal
        elif self.combine == "or":
            allowed = causal | mask  # BUG: a key the padding mask allows is seen, future or not
        else:
            allowed = causal & mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class CachedRotary(nn.Module):
    """A decoder with a KV cache of its own, as tutorials write one: forward(x, kv_cache=None, use_cache=False)
    returns (out, (k, v)) when use_cache; rotary positions continue from the cache length, and new tokens are
    masked bottom-right against cached and new keys. `bug` names one step done wrong."""

    causal = True

    def __init__(self, d_model, num_heads, bug=None):
        super().__init__()
        self.d_model, self.num_heads, self.bug = d_model, num_heads, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, kv_cache=None, use_cache=False):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))  # (B, H, T, d)
        past = 0 if kv_cache is None else kv_cache[0].shape[2]
        positions = torch.arange(past, past + T, device=x.device)
        if self.bug == "positions":
            positions = torch.arange(T, device=x.device)  # BUG: new tokens rotated as if at 0..T-1
        q, k = _rotate(q, positions), _rotate(k, positions)
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], dim=2), torch.cat([kv_cache[1], v], dim=2)  # (B, H, Tk, d)
        allowed = __import__("correct").causal_mask(T, k.shape[2], align="bottom_right", device=x.device)
        if self.bug == "mask" and kv_cache is not None:
            allowed = None  # BUG: once a cache is attached, the new tokens see each other's future
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = self.out(y.transpose(1, 2).reshape(B, T, D))
        cache = (k, v)
        if self.bug == "first key" and kv_cache is None:
            cache = (k[:, :, 1:], v[:, :, 1:])  # BUG: the prefill's first key and value never reach the cache
        return (out, cache) if use_cache else out


# name: (broken layer and audit options, detector that must fail, its correct twin)
SECOND_CHAPTER = {
    "keys centred over the batch": (lambda: (keys_centred_over_the_batch, {}), "batch_independence",
                                    lambda: einsum_attention),
    "scores from the values": (lambda: (scores_from_the_values, {}), "keys_matter", lambda: einsum_attention),
    "softmax applied twice": (lambda: (softmax_twice, {}), "softmax_saturation", lambda: einsum_attention),
    "hand-written softmax with an identity backward": (lambda: (custom_softmax_wrong_backward, {}), "gradients",
                                                       lambda: custom_softmax_attention),
    "rotary decoder, queries not offset by the cache": (lambda: (RotaryDecoder(24, 3, offset=False), dict(causal=True)),
                                                        "decode_consistency", lambda: RotaryDecoder(24, 3)),
    "padding mask ORed with the causal mask": (lambda: (PaddingOrCausal(24, 3, combine="or"), dict(causal=True)),
                                               "future_leakage", lambda: PaddingOrCausal(24, 3)),
    "own cache, rotary positions restart at 0": (lambda: (CachedRotary(24, 3, bug="positions"), dict(causal=True)),
                                                 "cache_decoding", lambda: CachedRotary(24, 3)),
    "own cache, causal mask dropped with a cache": (lambda: (CachedRotary(24, 3, bug="mask"), dict(causal=True)),
                                                    "cache_decoding", lambda: CachedRotary(24, 3)),
    "own cache, first key never cached": (lambda: (CachedRotary(24, 3, bug="first key"), dict(causal=True)),
                                          "cache_decoding", lambda: CachedRotary(24, 3)),
}
SCALES = [(dtype, init) for dtype in (torch.float32, torch.bfloat16) for init in ("default", "gpt2")]


def _in_setting(layer, kw, dtype, init):
    if isinstance(layer, nn.Module):
        if init == "gpt2":
            __import__("correct").gpt2_init_(layer)
        return layer.to(dtype), kw
    return layer, {**kw, "dtype": dtype}


@pytest.mark.parametrize("dtype, init", SCALES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("name", sorted(SECOND_CHAPTER))
def test_second_chapter_families_are_caught_unlike_the_reference(name, dtype, init):
    make, detector, _ = SECOND_CHAPTER[name]
    seed_rng(0)
    layer, kw = _in_setting(*make(), dtype, init)
    report = diagnostics.audit(layer, **kw)
    assert report.result(detector).verdict == "fail", str(report)
    assert not report.passed


@pytest.mark.parametrize("dtype, init", SCALES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("name", sorted(SECOND_CHAPTER))
def test_second_chapter_twins_pass_in_the_same_settings(name, dtype, init):
    make, detector, make_twin = SECOND_CHAPTER[name]
    _, kw, twin = _broken_and_twin(make, make_twin)
    layer, kw = _in_setting(twin, kw, dtype, init)
    report = diagnostics.audit(layer, **kw)
    assert report.passed and set(report.fired()) <= {"fully_masked_rows"}, str(report)
