"""Sinusoidal positional encoding (Vaswani et al. 2017, section 3.5).

    PE[t, 2i]   = sin(t / 10000^(2i / D))
    PE[t, 2i+1] = cos(t / 10000^(2i / D))
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
