"""Positions: the sinusoidal encoding (Vaswani et al. 2017, section 3.5) added to token embeddings,

    PE[t, 2i]   = sin(t / 10000^(2i / D))
    PE[t, 2i+1] = cos(t / 10000^(2i / D))

and rotary embeddings (RoPE, Su et al. 2021) applied to queries and keys inside attention: the pair
(x_i, x_{i + d/2}) of a vector at position t is turned by the angle t / 10000^(2i / d) (half-split pairing,
as in GPT-NeoX and Hugging Face's Llama), so that q_m . k_n depends on m - n only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._errors import expect


def sinusoidal_positional_encoding(seq_len: int, d_model: int, *, device=None, dtype=torch.float32) -> Tensor:
    """`(seq_len, d_model)` table to add to the token embeddings. An odd `d_model` ends on a sine column."""
    expect(seq_len >= 1 and d_model >= 1, "seq_len >= 1 and d_model >= 1", f"seq_len={seq_len}, d_model={d_model}",
           "pass positive sizes")
    t = torch.arange(seq_len, device=device, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    two_i = torch.arange(0, d_model, 2, device=device, dtype=torch.float64)  # (ceil(D/2),)
    angle = t / torch.pow(10000.0, two_i / d_model)  # (T, ceil(D/2)); float64 keeps large t accurate
    pe = torch.zeros(seq_len, d_model, device=device, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)  # ceil(D/2) sine columns
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])  # floor(D/2) cosine columns: one fewer when D is odd
    return pe.to(dtype)


def rotary(x: Tensor, positions: Tensor, *, base: float = 10000.0) -> Tensor:
    """`x` (..., T, d) turned by `positions` (T,): pairs (i, i + d/2), angle positions / base^(2i / d). An odd
    last feature is left as it is. Angles in float64, so that large positions stay accurate."""
    expect(positions.dim() == 1 and positions.numel() == x.shape[-2], f"positions of shape ({x.shape[-2]},)",
           f"positions.shape={tuple(positions.shape)}", "pass one position per token")
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / (2 * half)) if half else \
        torch.zeros(0, dtype=torch.float64, device=x.device)  # (d/2,)
    angles = positions.to(x.device, torch.float64).unsqueeze(-1) * freqs  # (T, d/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)  # (..., T, d)
