"""The trace follows what is written in place into a tensor, through a view as well (`_tracing.ancestors`).

Found in transformers' Longformer and LED (issue 33's sweep): their banded scores are computed by a product of q and k
(an einsum over chunks), then copied slice by slice into a new tensor of zeros (`scores[:, :3, :, w:] = chunks[...]`),
whose producer alone reads no input. The trace lost the product there, so `softmax_saturation` said "every softmax
normalises a projection of the tokens ... with no product of two activations", a reason that was not so. Twins on the
same q and k: the scores computed in place and the same scores computed plainly; both reach the product, and a
softmax of a projection that is written in place the same way still reaches none.
"""

from __future__ import annotations

import math

import pytest
import torch

from diagnostics._subject import make_subject
from diagnostics._tracing import ancestors, trace_call


def banded(q, k, v, mask=None, *, in_place: bool = True, product: bool = True):
    """Scores of each query over its own key and the one before (B, H, T, 2), a softmax over those two, and the
    weighted values. `in_place`: the two columns copied into a new_zeros by slices, as Longformer writes its band;
    `product`: the scores q·k (else a projection of q alone, its sum with a shifted copy of itself)."""
    s = (q * k).sum(-1) / math.sqrt(q.shape[-1]) if product else q.sum(-1)  # (B, H, T)
    before = torch.cat([torch.full_like(s[..., :1], float("-inf")), s[..., :-1]], -1)  # (B, H, T): key t - 1
    if in_place:
        scores = torch.zeros(*s.shape, 2, dtype=s.dtype)  # (B, H, T, 2), made from no input (`s.new_zeros` reads s)
        scores[..., 0] = before
        scores[..., 1] = s
    else:
        scores = torch.stack([before, s], -1)
    w = scores.softmax(-1)  # (B, H, T, 2)
    v_before = torch.cat([torch.zeros_like(v[..., :1, :]), v[..., :-1, :]], -2)  # (B, H, T, d)
    return w[..., :1] * v_before + w[..., 1:] * v, None


@pytest.mark.parametrize("product", [True, False], ids=["q·k", "projection"])
@pytest.mark.parametrize("in_place", [True, False], ids=["written in place", "computed"])
def test_a_softmax_over_scores_written_in_place_reaches_the_product_they_were_copied_from(in_place, product):
    subject = make_subject(lambda q, k, v, mask=None: banded(q, k, v, mask, in_place=in_place, product=product),
                           d_model=8, num_heads=2)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    trace = trace_call(subject, q, k, v, None)
    softmax = next(op for op in trace.ops if op.short == "_softmax")
    reached = [trace.ops[i] for i in ancestors(trace, softmax)]
    multiplied = [op for op in reached if op.short == "mul" and len(op.sources) == 2]  # q * k: two inputs
    assert bool(multiplied) == product, [op.short for op in reached]
    if product:
        assert {"query", "key"} <= set(multiplied[0].sources)
