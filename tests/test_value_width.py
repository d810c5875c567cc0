"""A function whose values must be as wide as its queries and keys: the audit's identity-values reading is its own.

To read the weights of a function that exposes none, the audit calls it with the identity as values (v[j] = e_j, as
wide as the keys are many), so that its output is its weights. sinkhorn-transformer's `LocalAttention` (0.5.9,
benchmarks/pypi_bugs.py's `sinkhorn_local_unscaled`) reshapes its values by the queries' width and raises there;
that raise counted as a `runs` failure of a correct layer. Now it is a reading not taken (the weights are read one key
at a time instead), and no probe of the layer failed.

Layers of our own writing in that shape: causal attention whose softmax is written out (no softmax over (Tq, Tk) scores to
observe) and which merges its values by q's width; the twin masks after normalising.
"""

from __future__ import annotations

import math

import pytest
import torch

import diagnostics


def bucketed(bug: bool):
    def attention(q, k, v, mask=None):
        """Causal attention over (B, H, T, d), its values reshaped by the queries' width (d_v = d_k assumed). `bug`:
        the causal mask applied to the weights after they are normalised, so that rows no longer sum to 1."""
        B, H, Tq, d = q.shape
        Tk = k.shape[-2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        allowed = allowed if mask is None else mask & allowed
        # the softmax written out, as a bucketed layer's over its (W, look-around) blocks is not one over (Tq, Tk)
        # scores: none is observed, and the weights are read through the values
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        if bug:
            weights = (e / e.sum(-1, keepdim=True)).masked_fill(~allowed, 0.0)
        else:
            e = e.masked_fill(~allowed, 0.0)
            weights = e / e.sum(-1, keepdim=True)
        values = v.reshape(B * H, Tk, d)  # by q's width: values of another width raise here
        return (weights.reshape(B * H, Tq, Tk) @ values).reshape(B, H, Tq, d)

    return attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_as_wide_as_the_queries_are_no_failure_of_the_layer(dtype):
    report = diagnostics.audit(bucketed(bug=False), causal=True, dtype=dtype)
    assert report.result("runs").verdict == "pass", report.result("runs")
    assert report.result("weight_row_sums").verdict == "pass", report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_twin_masking_after_the_normalisation_fails_on_its_row_sums(dtype):
    report = diagnostics.audit(bucketed(bug=True), causal=True, dtype=dtype)
    assert report.result("runs").verdict == "pass", report.result("runs")
    assert report.result("weight_row_sums").verdict == "fail", report
