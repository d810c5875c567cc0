"""Tolerances per dtype, and how far correct layers stay from them.

Measured with `python benchmarks/margins.py --seeds 10` (CPU, seq_len 16): the reference (causal and not)
and nn.MultiheadAttention at torch's default and at GPT-2's std-0.02 initialisation, and torch's
F.scaled_dot_product_attention, 10 seeds per dtype; "measured" is the largest value a correct layer
produced, the margin is threshold / measured. On CUDA, fused kernels may
round differently per batch row; the half-precision thresholds leave room for that (not measured here).
"""

from __future__ import annotations

import torch

# "Unchanged" outputs (future_leakage, mask_honoured, query_locality, eval_determinism): largest
# |difference| / RMS of the baseline output about its mean (diagnostics/_core.py), so the same number holds
# at default and at std-0.02 initialisation. Correct layers compute the compared rows from identical numbers
# and masked keys get exactly zero weight, so they measured 0 at every dtype and both inits (margin: exact).
UNCHANGED = {
    torch.float64: 1e-10,  # measured 0
    torch.float32: 1e-5,  # measured 0 (torch.testing's float32 atol)
    torch.float16: 2e-3,  # measured 0; one rounding of a ~1 output is 4.9e-4
    torch.bfloat16: 1.6e-2,  # measured 0; one rounding of a ~1 output is 3.9e-3 (torch's bf16 rtol)
}

# |row sum - 1| of the attention weights (weight_row_sums), and how negative a weight may be; the same
# bound serves output_variance, whose deviation (relative to the output's RMS) is the row-sum error times
# the value.
ROW_SUM = {
    torch.float64: 1e-9,  # measured 4.4e-16 (row sums), 1.9e-15 (output_variance)
    torch.float32: 1e-4,  # measured 1.6e-7 (margin 639x), 7.6e-7 (output_variance, 132x)
    torch.float16: 5e-3,  # measured 3.7e-4 (margin 14x; output_variance 5.4e-4, 9x): weights rounded by <= 4.9e-4
    torch.bfloat16: 3e-2,  # measured 2.4e-3 (margin 12x; output_variance 0): each weight rounded by <= 3.9e-3
}

# output_variance: how far the output for identical value rows may lie from the output for that one token alone,
# relative to the output's RMS (the row-sum bound, as the deviation is the row-sum error times the value), except in
# bfloat16, where the two calls' different shapes round apart: at small widths (an ad-hoc grid in issue 21's sixth
# round: 1-3 heads of width 1-6, seq_len 2-8, 4 seeds, both inits; 768 correct layers, the reference and
# nn.MultiheadAttention) correct layers measured up to 0.0289, and 0.0333 on a draw of an exploring CI seed (1010),
# over ROW_SUM's 0.03; the variants output_variance must catch measured 0.165 at least on the same grid (no softmax,
# d_model 1). float16 measured up to 2.5e-3 there (margin 2x).
CONVEX = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 6e-2,  # margin 1.8x over 0.0333, 2.75x under the smallest catch (0.165)
}

# The softmax temperature: the applied scale divided by the expected one must lie in
# [1 / SCALE_RATIO, SCALE_RATIO]. Correct layers measured |ratio - 1| <= 2.1e-8 at every dtype (the fit
# runs on the float32 logits); the smallest bug it must catch, a missing scale at d_k = 2 (or a sqrt(D)
# scale with 2 heads), is a ratio of sqrt(2) = 1.41 (or 0.71).
SCALE_RATIO = 1.25


# The largest values correct layers produced (benchmarks/margins.py), quoted in results as their margin.
MEASURED_ROW_SUM = {torch.float64: 4.4e-16, torch.float32: 1.6e-7, torch.float16: 3.7e-4, torch.bfloat16: 2.4e-3}
MEASURED_SCALE_ERROR = 2.1e-8


def tolerance(table: dict, dtype: torch.dtype) -> float:
    return table.get(dtype, table[torch.float32])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
