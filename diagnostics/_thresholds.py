"""Tolerances per dtype, and how far correct layers stay from them (measured, see benchmarks/margins.py).

Each table maps a dtype to the largest deviation a correct layer may show. The measured column is the
largest value seen on correct layers (the reference, torch's SDPA, nn.MultiheadAttention and the
never-seen correct layers of tests/test_never_seen.py) over 200 seeds at seq_len 16 on CPU, from
`python benchmarks/margins.py`; the margin is threshold / measured.
"""

from __future__ import annotations

import torch

# "Unchanged" outputs (future leakage, masked keys, query locality, determinism, identical values):
# largest |difference| / max(1, |output|). Correct layers compute the compared rows from identical
# numbers, so they are usually bit-identical; fused kernels may block differently per batch row.
UNCHANGED = {
    torch.float64: 1e-10,  # measured 0 (margin: exact)
    torch.float32: 1e-5,  # measured <= 1.2e-7 (margin >= 80x)
    torch.float16: 2e-3,  # half: one rounding of a ~1 output is 4.9e-4
    torch.bfloat16: 1.6e-2,  # bfloat16: one rounding of a ~1 output is 3.9e-3
}

# |row sum - 1| of the attention weights, and how negative a weight may be.
ROW_SUM = {
    torch.float64: 1e-9,  # measured 4.4e-16
    torch.float32: 1e-4,  # measured <= 4.8e-7 (margin >= 200x)
    torch.float16: 5e-3,  # Tk weights each rounded by <= 4.9e-4 relative
    torch.bfloat16: 3e-2,
}

# The softmax temperature: the applied scale divided by the expected one must lie in
# [1 / SCALE_RATIO, SCALE_RATIO]. Correct layers measure 1 within 1e-6 (float32), 1e-3 (half); the
# smallest bug it must catch, a missing scale at d_k = 2, is a ratio of sqrt(2) = 1.41.
SCALE_RATIO = 1.25


def tolerance(table: dict, dtype: torch.dtype) -> float:
    return table.get(dtype, table[torch.float32])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
