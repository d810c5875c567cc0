"""Attention patterns as masks: a FlexAttention-style `mask_mod(b, h, q_idx, kv_idx) -> bool` evaluated on the
whole (B, H, Tq, Tk) grid, for the reference's `mask` argument (True = may attend).

    sliding window of W keys, the query's own included:  lambda b, h, q, kv: (kv <= q) & (q - kv < W)

The index tensors broadcast against each other, so the mask_mod runs once, on tensors, as
`torch.nn.attention.flex_attention.create_mask` evaluates it (without its vmap).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._errors import expect


def mask_from_mod(mask_mod: Callable, t_q: int, t_k: int, *, batch: int = 1, heads: int = 1,
                  align: str = "bottom_right", device=None) -> Tensor:
    """Bool (B, H, Tq, Tk), True where `mask_mod` lets query i attend key j. `bottom_right`: the queries are the
    last Tq of the Tk positions (q_idx = i + Tk - Tq, cached decoding); `top_left`: q_idx = i, as FlexAttention
    indexes them. The two agree when Tq == Tk."""
    expect(callable(mask_mod), "a mask_mod(b, h, q_idx, kv_idx) -> bool tensor", repr(mask_mod),
           "pass e.g. lambda b, h, q, kv: kv <= q")
    expect(align in ("top_left", "bottom_right"), "align 'top_left' or 'bottom_right'", repr(align),
           "pass align='bottom_right' for cached decoding, 'top_left' to match FlexAttention")
    expect(min(t_q, t_k, batch, heads) >= 1, "positive sizes", f"t_q={t_q}, t_k={t_k}, batch={batch}, heads={heads}",
           "pass sizes >= 1")
    offset = t_k - t_q if align == "bottom_right" else 0
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)  # (1, H, 1, 1)
    q = (torch.arange(t_q, device=device) + offset).view(1, 1, t_q, 1)  # (1, 1, Tq, 1)
    kv = torch.arange(t_k, device=device).view(1, 1, 1, t_k)  # (1, 1, 1, Tk)
    allowed = mask_mod(b, h, q, kv)
    expect(isinstance(allowed, Tensor) and allowed.dtype == torch.bool, "a mask_mod that returns a bool tensor",
           type(allowed).__name__ if not isinstance(allowed, Tensor) else f"dtype {allowed.dtype}",
           "return comparisons combined with & and |")
    return allowed.expand(batch, heads, t_q, t_k).clone()  # (B, H, Tq, Tk)
