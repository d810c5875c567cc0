"""Scaled dot-product attention, step by step.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V        (Vaswani et al. 2017, eq. 1)

Each step is a small function so that `MultiHeadAttention` can expose it as an overridable method and a
broken variant can replace exactly one of them. The mask convention is the one of
`torch.nn.functional.scaled_dot_product_attention`: a boolean mask holds True where a query *may attend*;
a float mask is added to the scores (0 keeps, -inf blocks).

Legend:  Tq, Tk = query and key lengths; d_k = query/key width; d_v = value width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._errors import expect


def causal_mask(t_q: int, t_k: int, *, align: str = "top_left", device=None) -> Tensor:
    """Boolean `(t_q, t_k)` mask, True where query i may attend key j.

    `top_left` lets query i see keys j <= i; it is what `F.scaled_dot_product_attention(is_causal=True)`
    builds. `bottom_right` lets query i see keys j <= i + (t_k - t_q): the queries are the *last* t_q
    positions of the sequence. That is what cached decoding needs: with a KV cache of t_k - 1 past keys
    and one new query (t_q = 1), top-left lets the new token see only key 0, bottom-right lets it see
    all t_k keys. The two agree when t_q == t_k.
    """
    expect(align in ("top_left", "bottom_right"), "align 'top_left' or 'bottom_right'", repr(align),
           "pass align='bottom_right' for cached decoding, 'top_left' to match torch's is_causal")
    expect(t_q >= 1 and t_k >= 1, "t_q >= 1 and t_k >= 1", f"t_q={t_q}, t_k={t_k}", "pass positive lengths")
    offset = 0 if align == "top_left" else t_k - t_q
    i = torch.arange(t_q, device=device).unsqueeze(-1)  # (Tq, 1)
    j = torch.arange(t_k, device=device)  # (Tk,)
    return j <= i + offset  # (Tq, Tk)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Ranks, widths and lengths that attention needs, with the fix for each mismatch."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        expect(x.dim() >= 2, f"{name} of shape (..., T, d)", f"{name}.shape={tuple(x.shape)}",
               "add a sequence dimension, e.g. x.unsqueeze(-2)")
    expect(q.size(-1) == k.size(-1), "q and k with the same last dimension d_k",
           f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}", "project queries and keys to the same width")
    expect(k.size(-2) == v.size(-2), "k and v with the same length Tk",
           f"k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}", "pass one value per key")
    expect(q.dtype == k.dtype == v.dtype, "q, k, v of one dtype",
           f"{q.dtype}, {k.dtype}, {v.dtype}", "cast them to one dtype, e.g. .to(q.dtype)")


def check_mask(mask: Tensor | None, scores_shape: torch.Size) -> None:
    """A mask must be boolean or floating and broadcast to the scores `(..., Tq, Tk)`."""
    if mask is None:
        return
    expect(mask.dtype == torch.bool or mask.is_floating_point(),
           "a bool mask (True = may attend) or a float additive mask", f"dtype {mask.dtype}",
           "use mask.bool() for a 0/1 mask; an integer mask is ambiguous")
    # by hand: torch.broadcast_shapes imports torch.fx.experimental.symbolic_shapes and sympy (~0.3 s) on first use
    fits = mask.dim() <= len(scores_shape) and all(m in (1, s) for m, s in zip(reversed(mask.shape),
                                                                                reversed(scores_shape)))
    expect(fits, f"a mask broadcastable to the scores {tuple(scores_shape)} (..., Tq, Tk)",
           f"mask.shape={tuple(mask.shape)}",
           "a padding mask over keys is (B, 1, 1, Tk); a per-query mask is (B, 1, Tq, Tk)")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16/bfloat16 attention is computed in float32 and rounded once, as fused kernels accumulate."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def scores(q: Tensor, k: Tensor) -> Tensor:
    acc = accumulation_dtype(q.dtype)  # half-precision logits would be off by ~1e-3 * |logit| before softmax
    return q.to(acc) @ k.to(acc).transpose(-2, -1)  # (..., Tq, d_k) x (..., d_k, Tk) -> (..., Tq, Tk)


def apply_mask(scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        # -inf before softmax gives the blocked keys exactly zero weight.
        return scores.masked_fill(~mask, fill)  # (..., Tq, Tk)
    return scores + mask  # additive float mask: 0 keeps, -inf blocks


def safe_softmax(scores: Tensor) -> Tensor:
    """Softmax over keys; a row whose every key is blocked gets zero weights instead of NaN.

    Plain softmax of an all -inf row is 0/0 = NaN, which then poisons the output and the gradients.
    torch's SDPA returns zeros there (the "safe softmax" of pytorch/pytorch#131060); so do we.
    """
    weights = torch.softmax(scores, dim=-1)  # (..., Tq, Tk), each row sums to 1 over keys
    fully_masked = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., Tq, 1)
    return weights.masked_fill(fully_masked, 0.0)


def weight_values(weights: Tensor, v: Tensor) -> Tensor:
    out = weights @ v.to(weights.dtype)  # (..., Tq, Tk) x (..., Tk, d_v) -> (..., Tq, d_v)
    return out.to(v.dtype)  # the one rounding to half precision, at the end


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, is_causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns `(out, weights)`: out `(..., Tq, d_v)`, weights `(..., Tq, Tk)`.

    q `(..., Tq, d_k)`, k `(..., Tk, d_k)`, v `(..., Tk, d_v)`. `mask` broadcasts to `(..., Tq, Tk)`:
    bool True = may attend, float = added to the scores. `is_causal=True` adds a top-left causal mask,
    as torch's SDPA does; for cached decoding (Tq < Tk) pass `causal_mask(Tq, Tk, align="bottom_right")`
    as the mask instead. `scale` defaults to 1/sqrt(d_k). float16/bfloat16 inputs are computed in float32
    and the result rounded once.
    """
    check_qkv(q, k, v)
    t_q, t_k = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale

    s = scores(q, k) * scale  # (..., Tq, Tk); 1/sqrt(d_k) keeps the logits' variance ~1 as d_k grows
    check_mask(mask, s.shape)
    if is_causal:
        s = apply_mask(s, causal_mask(t_q, t_k, align="top_left", device=q.device))
    s = apply_mask(s, mask)
    weights = safe_softmax(s)  # (..., Tq, Tk)
    return weight_values(weights, v), weights.to(q.dtype)  # (..., Tq, d_v), (..., Tq, Tk)
