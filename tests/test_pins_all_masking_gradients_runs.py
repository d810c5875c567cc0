"""Pins for the survivors of the full mutation run over mask_honoured / fully_masked_rows, gradients and runs (issue
37: `benchmarks/mutations.py --all --only detectors/masking.py --only detectors/gradients.py --only
detectors/runs.py`, at 824d172). As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each
side of the comparison, guard or constant it pins), the numbers quoted as literals; each test says which mutant it
pins (its line number the run's, at 824d172). Small layers written here, one detector at small sizes.
"""

from __future__ import annotations

import pytest
import torch

import diagnostics
from correct import MultiHeadAttention


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


# ---- gradients: non-finite outputs and gradients ------------------------------------------------------------------


class _NanGradient(torch.autograd.Function):
    """The identity, whose backward writes NaN into the first entry of the gradient: the output stays finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad


class Poisoned(MultiHeadAttention):
    """The reference (16 wide, 2 heads, seed 0) with one non-finite value: `where` = "output" multiplies the output's
    first entry by NaN (its gradient NaN too, through the product), "written" overwrites that entry with NaN (the
    gradient of an overwritten entry is 0: every gradient finite), "gradient" leaves the output finite and makes the
    backward write NaN; None: the reference."""

    def __init__(self, where: str | None):
        torch.manual_seed(0)
        super().__init__(16, 2)
        self.where = where

    def forward(self, x, mask=None):
        out, weights = super().forward(x, mask)  # (B, T, D), (B, H, T, T)
        if self.where == "output":
            first = torch.zeros_like(out, dtype=torch.bool)
            first.view(-1)[0] = True
            out = out * torch.where(first, float("nan"), 1.0)
        elif self.where == "written":
            out = out.clone()
            out.view(-1)[0] = float("nan")
        elif self.where == "gradient":
            out = _NanGradient.apply(out)
        return out, weights


def test_gradients_says_the_output_is_nan_where_one_output_value_is_and_its_twin_passes():
    """check_gradients' `if not bool(torch.isfinite(out).all())` (L172, all->any): one NaN output value (its gradients
    NaN through the product) is an output that is NaN on an ordinary input (with `any`, only an output NaN
    everywhere would be, and this one would read as NaN gradients alone). Its twin, the reference, passes."""
    found = verdict(Poisoned("output"), "gradients")
    assert found.verdict == "fail" and found.message.startswith("the output is NaN or inf on an ordinary input"), found
    assert "1 non-finite output values" in found.evidence, found.evidence
    assert verdict(Poisoned(None), "gradients").verdict == "pass"


def test_gradients_says_the_gradients_are_nan_where_the_output_is_finite():
    """The same line, drop-not: a finite output whose backward writes NaN fails on its gradients, not on its output
    (with the `not` dropped, a finite output would be called NaN). Its twin, above: a NaN output is named."""
    found = verdict(Poisoned("gradient"), "gradients")
    assert found.verdict == "fail" and found.message == "gradients are NaN or inf on an ordinary input", found


def test_gradients_fails_a_nan_written_over_an_output_value_whose_gradients_stay_finite():
    """A defect the run's L172 pins led to (fixed): a NaN written over one output value has gradient 0, so every
    gradient was finite, the finite differences read NaN, and `rel > limit` (False for NaN) passed the layer with
    "disagreement nan". The output is now checked as the gradients are. Its twins: the NaN that reaches the gradients
    says so too, and the reference passes (above)."""
    written = verdict(Poisoned("written"), "gradients")
    assert written.verdict == "fail" and written.message == "the output is NaN or inf on an ordinary input", written
    assert "1 non-finite output values" in written.evidence, written.evidence
    spread = verdict(Poisoned("output"), "gradients")
    assert spread.message == "the output is NaN or inf on an ordinary input, and so are its gradients", spread
