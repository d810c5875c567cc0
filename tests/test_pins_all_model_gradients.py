"""Pins for the survivors of the full mutation run over the model audit's gradient_flow (issue 37:
`benchmarks/mutations.py --all --only model/gradients.py`, at 54d657d). As in tests/test_pins_all_model_small.py,
each pin has its twin on the same inputs (a case on each side of the comparison, guard or constant it pins), the
numbers quoted as literals; each test says which mutant it pins (its line number the run's, at 54d657d). Small
models (two blocks, 16 wide), gradient_flow alone, so the file runs in a few seconds.
"""

from __future__ import annotations

import pytest
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng
from test_model_gradient_flow_causes import IDS, TinyInitAttention, TinyInitModel


def flow(model, **kw):
    """gradient_flow's result on `model` (the audit's defaults otherwise)."""
    return diagnostics.audit_model(model, example=IDS, detectors=["gradient_flow"], **kw).result("gradient_flow")


# ---- squared ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bug", [False, True])
def test_a_float64_model_with_outputs_below_float32s_range_is_measured_in_float64(bug):
    """squared's `t if t.dtype == torch.float64 else t.float()` (L100, Eq->NotEq): a float64 model's outputs are kept
    in float64. TinyInitModel at std 1e-25 in float64 returns ~1.6e-49, below float32's smallest denormal (1.4e-45):
    cast to float32 they are all 0, every module's output would get a gradient of exactly 0 and the audit would skip
    the model as not measured ("2 modules whose output the model sends no gradient"). Kept in float64, the correct
    model passes and its twin with blocks.1's scores detached fails there."""
    result = flow(TinyInitModel(bug, init=1e-25).double())
    if bug:
        assert result.verdict == "fail" and result.layer == "blocks.1", result
        assert "blocks.1.q.weight" in result.evidence and "blocks.0." not in result.evidence, result
    else:
        assert result.verdict == "pass" and result.message.startswith("all 16 attention parameters"), result


class ReluInputModel(nn.Module):
    """An embedding through a ReLU (about half its entries exactly 0, none of its rows all 0), one attention block
    (TinyInitAttention: separate q, k, v; `bug`: its scores detached) and a head, at PyTorch's default init."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.attn, self.head = nn.Embedding(32, 16), TinyInitAttention(bug=bug), nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.emb(input_ids).relu()
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("bug", [False, True])
def test_a_weight_is_excused_for_an_input_that_is_all_zero_not_one_with_some_zeros(bug):
    """_loss_and_outputs' `not bool(x.ne(0).any())` (L121, any->all): a weight with no gradient is by design only
    where its module's input is exactly 0 everywhere (DETR's zero queries). The ReLU'd embedding has zeros in about
    half its entries: with `all`, some zero would excuse the detached scores' q and k weights, and the evidence
    would name only their biases. The twin, the same model with its scores kept, passes."""
    result = flow(ReluInputModel(bug))
    if bug:
        assert result.verdict == "fail" and result.message.startswith("4 of 8 attention parameters"), result
        assert "attn.q.weight" in result.evidence and "attn.k.weight" in result.evidence, result
    else:
        assert result.verdict == "pass", result
