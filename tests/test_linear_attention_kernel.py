"""A linear attention's softmaxes are feature maps, not a temperature: its weights, read through the values, are no
softmax's output (issue 34; found as a regression by `python benchmarks/pypi_bugs.py`, 2026-12-05).

Efficient attention (Shen et al.) normalises q over its features and k over the tokens, each a projection of the
tokens, and its weights are q's features times k's: since e953aa7 `softmax_saturation` said "not measured" for every
softmax over a projection (learned-query pooling's is one too, and its temperature is a q·k's), which left
linear-attention-transformer 0.17.2 (the fixed release of `lat_causal_d_inv`) inconclusive where it had passed. The
two differ in what the softmax is: pooling's output *is* the weights, a linear attention's are a product of two
feature maps, no softmax's rows. So a layer whose weights, read through the values, match no softmax's output is not
applicable; one whose softmax is its weights stays not measured (tests/test_temperature_relative_terms.py's token
learner). Twins: the same layer multiplying by its normaliser instead of dividing (0.17.1's bug) fails
`weight_row_sums` (float32) or `output_variance` (bfloat16) on the same inputs; `_a_softmax_is` pinned on both sides of SOFTMAX_IS_WEIGHTS.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._observe import SoftmaxCall
from diagnostics.detectors.temperature import _a_softmax_is

D, H = 32, 4


class CausalLinearAttention(nn.Module):
    """Causal linear attention in the style of linear-attention-transformer: q normalised over its features (a
    softmax), k made positive (exp), each query's output the running sum of k_j v_j over the keys up to it divided by
    q . (the running sum of k_j): `divides=False` multiplies by that normaliser instead (the 0.17.1 bug, in this
    file's own words), so the weights' rows no longer sum to 1."""

    def __init__(self, divides: bool = True):
        super().__init__()
        self.d_model, self.num_heads, self.divides = D, H, divides
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.to_out = nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, H, D // H).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        q, k = q.softmax(dim=-1) * (D // H) ** -0.5, k.exp()  # (B, H, T, d): feature maps
        context = torch.einsum("bhnd,bhne->bhnde", k, v).cumsum(dim=2)  # (B, H, T, d, d): keys up to each query
        normaliser = torch.einsum("bhnd,bhnd->bhn", k.cumsum(dim=2), q)  # (B, H, T)
        out = torch.einsum("bhnd,bhnde->bhne", q, context)
        out = out / normaliser[..., None] if self.divides else out * normaliser[..., None]
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_attentions_feature_maps_have_no_temperature_and_it_passes(dtype):
    torch.manual_seed(0)
    report = diagnostics.audit(CausalLinearAttention().to(dtype), causal=True)
    temperature = report.result("softmax_saturation")
    assert temperature.verdict == "skip" and temperature.message.startswith("not applicable: the weights"), temperature
    assert "no softmax's output" in temperature.message, temperature
    assert report.result("weight_row_sums").verdict == "pass", str(report)
    assert report.status == "passed", str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_normaliser_multiplied_instead_of_divided_fails_on_the_same_inputs(dtype):
    torch.manual_seed(0)
    report = diagnostics.audit(CausalLinearAttention(divides=False).to(dtype), causal=True)
    # float32: its weights are read through the values and their rows do not sum to 1; bfloat16: they rebuild the
    # output only within its rounding and are not read, and identical values do not come out unchanged
    failed = {f.detector for f in report.findings if f.verdict == "fail"}
    assert failed & {"weight_row_sums", "output_variance"}, str(report)
    assert report.status == "failed", str(report)


# ---- _a_softmax_is: a row of the weights within SOFTMAX_IS_WEIGHTS (2e-2) of a softmax's row ----------------------


def _record(out: torch.Tensor):
    return SimpleNamespace(softmaxes=[SoftmaxCall(input=out.log(), output=out, dim=-1)])


@pytest.mark.parametrize("moved, found", [(0.01, True), (0.03, False)], ids=["within", "beyond"])
def test_a_softmax_is_the_weights_only_within_the_bound(moved, found):
    """The weights a softmax's output with one weight of each row moved by `moved` (a rounding the bound allows, 0.01;
    more than it, 0.03): the softmax is the weights only in the first case (x10 or x0.1 of the bound flips one)."""
    torch.manual_seed(0)
    out = torch.randn(2, 3, 8, 8).softmax(-1)  # (B, H, Tq, Tk)
    weights = out.clone()
    weights[..., 0] += moved
    assert _a_softmax_is(_record(out), weights) is found


def test_a_softmax_laid_out_keys_first_is_read_transposed_and_one_of_another_shape_is_not():
    torch.manual_seed(0)
    out = torch.randn(2, 5, 8).softmax(-2)  # (B, Tk, Tq): normalised over the keys, laid out keys first
    assert _a_softmax_is(_record(out), out.transpose(-1, -2))
    assert not _a_softmax_is(_record(torch.randn(2, 8, 4).softmax(-1)), out.transpose(-1, -2))
