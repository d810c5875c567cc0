"""Issue 34's cause 9 for the softmax axis: where the axis is set away from the line that runs the softmax (an
`nn.Softmax(dim=2)` made in `__init__` and called as `self.softmax(scores)`, as fastNLP 0.5.0 and pytorch-nlp 0.1.0
released it; a `dim=self.axis` stored in `__init__`), the finding points at the line that set it first, then at the
softmax. Each layer has its twin with the axis over the keys, which passes on the same inputs."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from diagnostics import audit

D, H = 32, 4  # d_model, heads


class SoftmaxModule(nn.Module):
    """Written as fastNLP's DotAttention is: the softmax is a module made in __init__, its axis given there."""

    def __init__(self, axis: int):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.softmax = nn.Softmax(dim=axis)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B, H, T, T)
        return self.out((self.softmax(scores) @ v).transpose(1, 2).reshape(B, T, D))


class AxisAttribute(nn.Module):
    """The axis stored on the layer and read where the softmax runs."""

    def __init__(self, axis: int):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.axis = axis

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        weights = (q @ k.transpose(-1, -2) / (D // H) ** 0.5).softmax(dim=self.axis)  # (B, H, T, T)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


def _line(cls, text: str) -> int:
    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _row_sums(make, axis):
    torch.manual_seed(0)
    return audit(make(axis), detectors=["weight_row_sums"], progress=False).result("weight_row_sums")


@pytest.mark.parametrize("make, made", [(SoftmaxModule, "self.softmax = nn.Softmax(dim=axis)"),
                                        (AxisAttribute, "self.axis = axis")], ids=["module", "attribute"])
def test_a_softmax_axis_set_in_init_is_located_where_it_is_set_then_where_it_runs(make, made):
    result = _row_sums(make, 2)  # over the queries of (B, H, Tq, Tk)
    assert result.verdict == "fail"
    first, then = result.where[0], result.where[1]
    assert (first.line, first.op) == (_line(make, made), "made before the call"), result.where
    assert "softmax" in then.code and "_softmax" in then.op, result.where
    assert "dim=-1" in result.fix


@pytest.mark.parametrize("make", [SoftmaxModule, AxisAttribute], ids=["module", "attribute"])
def test_the_same_layers_over_the_keys_pass(make):
    assert _row_sums(make, -1).verdict == "pass"
