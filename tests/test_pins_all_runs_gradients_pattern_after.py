"""Pins for the survivors of the full mutation run over runs, gradients and attention_pattern with the earlier pins in
place (issue 37: `benchmarks/mutations.py --all --only detectors/runs.py --only detectors/gradients.py --only
detectors/pattern.py`, at dba7168). As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each
side of the comparison, guard or constant it pins), the numbers quoted as literals; each test says which mutant it
pins (its line number the run's, at dba7168). Small layers written here, one detector at small sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import MultiHeadAttention


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


# ---- gradients: the entries of a parameter the finite differences move --------------------------------------------


class Watched(MultiHeadAttention):
    """The reference (16 wide, 2 heads, seed 0) plus the mean of an `entries`-entry table added to every output; each
    float64 call records the table as it was called (`seen`, shared by the float64 copy: a class attribute), so that
    the entries the finite differences moved can be read."""

    seen: list = []

    def __init__(self, entries: int):
        torch.manual_seed(0)
        super().__init__(16, 2)
        self.table = nn.Parameter(torch.randn(entries) * 0.1)

    def forward(self, x, mask=None):
        if self.table.dtype == torch.float64:
            Watched.seen.append(self.table.detach().clone())
        out, weights = super().forward(x, mask)  # (B, T, D), (B, H, T, T)
        return out + self.table.mean(), weights


def moved_entries(entries: int) -> torch.Tensor:
    """The passing gradients verdict on a `Watched` table of `entries`, and the entries any of its calls moved."""
    Watched.seen = []
    layer = Watched(entries)
    found = verdict(layer, "gradients")
    assert found.verdict == "pass", found
    original = layer.table.detach().double()
    return torch.stack([t != original for t in Watched.seen]).any(0).nonzero().flatten()


def test_every_entry_of_a_parameter_of_at_most_512_entries_is_moved():
    """check_gradients' `if k < p.numel()` (L199, Lt->LtE): a parameter of 15 entries (no more than the 512 the finite
    differences move) is moved at every entry (torch.arange); with `<=` the golden-ratio places are taken, and 15
    places mod 15 collide whatever the offset (one entry at least never moved, so a backward wrong there alone would
    pass). Its twin, below: a larger parameter is moved at 512 spread places."""
    assert moved_entries(15).tolist() == list(range(15))


def test_a_parameter_of_1024_entries_is_moved_at_512_places_spread_over_it():
    """check_gradients' golden-ratio step (L198, x10): frac(0.618 k + r) x 1,024 for k < 512 gives 512 distinct places,
    64 +- 1 in each eighth of the table; at 6.18 the places collide (391 to 403 distinct, measured at three offsets),
    fewer entries moved. Its twin, above: a parameter of 15 entries is moved everywhere."""
    moved = moved_entries(1024)
    assert len(moved) == 512, len(moved)
    per_eighth = torch.bincount(moved // 128, minlength=8)
    assert int(per_eighth.min()) >= 60 and int(per_eighth.max()) <= 68, per_eighth


# ---- gradients: the parts of the direction left out at a kink ----------------------------------------------------


class _AbsPow(torch.autograd.Function):
    """|g| ** p (at p = 1.25 a kink at 0 whose jump stays steady over the kink rule's steps; at 1.75 one that shrinks
    2.83x), its backward a derivative of 1: a hand-written backward's mistake, along the gate alone."""

    @staticmethod
    def forward(ctx, g, p):
        return g.abs() ** p

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Gated(MultiHeadAttention):
    """The reference (16 wide, 2 heads, seed 0) plus `gates` gates |g| ** p added to every output, each g a 16-entry
    parameter initialised to 0 (at the probe point: a kink along each at p = 1.25), their backward wrong."""

    def __init__(self, gates: int, p: float = 1.25):
        torch.manual_seed(0)
        super().__init__(16, 2)
        self.p = p
        self.gates = nn.ParameterList([nn.Parameter(torch.zeros(16)) for _ in range(gates)])

    def forward(self, x, mask=None):
        out, weights = super().forward(x, mask)  # (B, T, D), (B, H, T, T)
        return out + sum(_AbsPow.apply(g, self.p) for g in self.gates), weights


@pytest.mark.parametrize("gates, named, word", [(1, "gates.0", "it"), (2, "gates.0, gates.1", "them")],
                         ids=["one", "two"])
def test_the_parts_left_out_at_a_kink_are_named_one_or_many(gates, named, word):
    """check_gradients' `'it' if len(kinked) == 1 else 'them'` (L307, Eq->NotEq): one gate with a kink at the point is
    left out as "it", two as "them"; the rest of the direction agrees and the layer passes either way."""
    found = verdict(Gated(gates), "gradients")
    assert found.verdict == "pass", found
    assert f"not differentiable at this point along {named} (its one-sided" in found.evidence, found.evidence
    assert f"a ReLU at exactly 0); without {word}, autograd gives" in found.evidence, found.evidence
    # the rest agrees: no second reading at smaller steps (L310's `and` made `or`, or `>` made `<`, would make one)
    assert "at steps 16x smaller" not in found.evidence, found.evidence



def test_a_jump_read_once_sends_the_check_to_smaller_steps_where_a_wrong_backward_still_fails():
    """check_gradients' first reading of a jump (L284 through `jump(every, steady=False)`, L261's drop-not: that
    reading made under the steady rule): a wrong backward of |g| ** 1.75 at g = 0 has a jump at the step, which
    shrinks 2.83x over eps / 4, / 8, / 16 (no kink at the point: nothing is left out); read once, unsteadied, it
    sends the check to steps 16x smaller (a kink crossed within the step would be rarer there), where the wrong
    backward disagrees as much and fails, saying so (under the steady rule nothing jumped: no such reading), with
    the first reading's bar. Its twin, at p = 1.25 (a kink at the point): the gate is left out and the rest passes (above)."""
    found = verdict(Gated(1, p=1.75), "gradients")
    assert found.verdict == "fail" and "not differentiable" not in found.evidence, found
    assert "; at steps 16x smaller (a kink crossed within the step is rarer there)" in found.evidence, found.evidence
    # the verdict keeps the first reading where the smaller steps disagree too (L323, `<=` made `>=`: the second)
    assert f"(up to {found.threshold:.2g} allowed: 1e-09, or 30x" in found.evidence, found.evidence
    assert found.threshold > 1e-9, found  # the noise's bar at the step (2.3e-9), the bare 1e-9 at the smaller ones


def kink_at_the_point(kinked: bool):
    """SDPA (the mask taken) plus, in float64, 1e-3 x the sum of relu(q - q0), q0 the first float64 query it is given
    that requires grad (the gradients check's probe point; the forward before it that reads the tokens' gain, at their
    plain size, takes none): along the inputs, the only part of a function's direction, a kink at the point
    (one-sided derivatives 0 and 1; 1e-3 so that its square's term in (out ** 2).sum(), unequal on the two sides and
    linear in the step, stays under the disagreement it makes). `kinked=False`: SDPA alone."""
    first = []

    def attend(q, k, v, mask=None):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d)
        if not kinked or q.dtype != torch.float64:
            return out
        if not first and q.requires_grad:
            first.append(q.detach().clone())
        if not first:
            return out
        return out + 1e-3 * torch.relu(q - first[0]).sum()

    return attend


def test_a_layer_with_a_kink_at_the_point_along_every_part_of_the_direction_is_a_skip():
    """check_gradients' `if not rest` (L298, the guard never firing: the check would go on along an empty direction,
    read a disagreement of 0 and pass): a function, whose direction is the inputs alone, with a ReLU at exactly 0
    along them, is not measured, and says so. Its twin, SDPA alone, passes."""
    found = verdict(kink_at_the_point(True), "gradients")
    assert found.verdict == "skip" and found.message.startswith("not measured: the layer is not differentiable"), found
    assert "not differentiable at this point along the inputs" in found.evidence, found.evidence
    assert verdict(kink_at_the_point(False), "gradients").verdict == "pass"


# ---- gradients: the finite differences' step ---------------------------------------------------------------------


class _ScaledBackward(torch.autograd.Function):
    """The identity forward; the backward multiplies the gradient by `factor` (a backward off by a chosen error)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def offset_off_by(error: float):
    """Scaled dot-product attention (True = may attend) whose outputs sit at 1000 (+ 1000 to every value: the loss
    (out ** 2).sum() is then ~1e8, its rounding large beside its changes), its backward off by `error`."""
    def attend(q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
        weights = scores.softmax(-1)
        return _ScaledBackward.apply(weights @ v + 1000.0, 1.0 + error), weights  # (B, H, Tq, d)
    return attend


def test_a_small_backward_error_on_large_outputs_is_not_lost_in_the_finite_differences_noise():
    """check_gradients' step `eps = 1e-4` (L235, x0.1): outputs at 1000 make the finite differences' rounding large;
    at steps from 1e-4 down to 2.5e-5 their noise allows 3.4e-8 of |grad| |u|, and a backward off by 2e-5 (1.6e-6 of
    |grad| |u|) fails; at steps 10x smaller the rounding is 10x larger relative to the change and the noise allowance
    (measured: 4.1e-6) passes it. Its twin, the same layer with its true backward, passes."""
    wrong = verdict(offset_off_by(2e-5), "gradients")
    assert wrong.verdict == "fail" and 1e-6 < wrong.value < 3e-6 and wrong.threshold < 1e-7, wrong
    right = verdict(offset_off_by(0.0), "gradients")
    assert right.verdict == "pass", right
