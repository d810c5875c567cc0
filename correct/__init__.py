"""The reference: scaled dot-product and multi-head attention that are provably right.

Checked by `tests/test_correct.py` against `torch.nn.functional.scaled_dot_product_attention` and
`torch.nn.MultiheadAttention` given the same weights, in float64 as the golden run.
"""

from ._errors import AttentionUsageError
from ._init import gpt2_init_
from ._mha import MultiHeadAttention
from ._patterns import mask_from_mod
from ._positional import sinusoidal_positional_encoding
from ._sdpa import causal_mask, scaled_dot_product_attention

__all__ = [
    "AttentionUsageError",
    "MultiHeadAttention",
    "causal_mask",
    "gpt2_init_",
    "mask_from_mod",
    "scaled_dot_product_attention",
    "sinusoidal_positional_encoding",
]
