"""Pins for the survivors of the full mutation run (`benchmarks/mutations.py --all --only detectors/parameters.py`,
issue 37) in `parameters_used`. As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each
side of the rule), and the rules are quoted here, not read from the module (a test that read them would follow a
mutated value).

- `_shift_inert` compares the scores of the calls before and after the change pairwise, so only when the layer took
  as many softmax passes both times: a layer whose parameter decides how many passes it takes (a halting threshold)
  is not explained as a per-row shift by its first pass alone.
- `kept_copy` finds a copy only as a whole block of a stack of such blocks (a fused projection's rows: the used
  parameter's row count a multiple of the copy's), and never in the parameter itself.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics.detectors.parameters import _scores, _shift_inert, kept_copy

# ---- _shift_inert: the scores are paired call for call, so only when there are as many calls -------------------


class Halting(nn.Module):
    """Self-attention of width 4 whose parameter `p` (read through .detach(): a gradient of exactly zero) shifts every
    score of a row by p x 0.025, which the softmax removes. `halting`: where |p| > 1 the layer attends a second time
    (a second softmax pass over the same scores), so the number of passes depends on p."""

    def __init__(self, halting: bool):
        super().__init__()
        self.halting = halting
        torch.manual_seed(0)
        self.qkv = nn.Linear(4, 12).double()
        self.p = nn.Parameter(torch.tensor([0.1], dtype=torch.float64))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)  # (B, T, 4) each
        scores = q @ k.transpose(-2, -1) / 2 + self.p.detach() * 0.025  # (B,T,4) x (B,4,T) -> (B,T,T)
        out = scores.softmax(-1) @ v
        if self.halting and float(self.p.detach().abs().sum()) > 1.0:
            out = scores.softmax(-1) @ out  # a second hop
        return out


class Called:
    """What `_shift_inert` reads of a subject: its layer, and a call on (query, key, value, allowed)."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, q, k, v, allowed):
        return self.layer(q)


def test_a_shift_is_read_only_where_the_change_leaves_as_many_softmax_passes_as_before():
    """The draw (seed 0: +1.54) takes p from 0.1 to 1.64, past the halting threshold: one pass before, two after
    (checked here: the negative control). Those scores cannot be paired, so the shift is not explained (False); the
    same layer without the second hop is a plain per-row shift (True). `not before and len(before) != len(after)`
    pairs the first passes and calls the halting layer inert."""
    x = torch.randn(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    halting, plain = Called(Halting(halting=True)), Called(Halting(halting=False))
    assert len(_scores(halting, (x, x, x), None)) == 1
    with torch.no_grad():
        halting.layer.p.fill_(1.64)
    assert len(_scores(halting, (x, x, x), None)) == 2  # the change really adds a pass
    with torch.no_grad():
        halting.layer.p.fill_(0.1)
    assert _shift_inert(halting, "p", (x, x, x), None, torch.Generator().manual_seed(0)) is False
    assert _shift_inert(plain, "p", (x, x, x), None, torch.Generator().manual_seed(0)) is True
    assert float(halting.layer.p.detach()) == 0.1  # restored afterwards


# ---- kept_copy: a whole block of a stack, never the parameter itself --------------------------------------------


def test_a_copy_is_a_block_of_a_stack_whose_rows_it_divides():
    """rows 0-1 of a (6, 2) weight (three blocks of two rows) are a kept copy; the same rows of a (5, 2) weight are
    not (five rows are no stack of two-row projections). `tensor.shape[0] < kept.shape[0] and tensor.shape[0] %
    kept.shape[0]` would split the five rows into blocks and call them one."""
    w = torch.arange(12.0).reshape(6, 2)
    assert kept_copy("a", {"fused": w, "a": w[:2].clone()}, {"a"}) == "rows 0-1 of fused"
    assert kept_copy("a", {"fused": w[:5], "a": w[:2].clone()}, {"a"}) == ""


def test_a_parameter_is_never_a_copy_of_itself():
    """Named apart from the unused ones or not, the parameter itself is not where its values are kept; a used
    parameter of the same values is. `other == name and tensor.dim() != kept.dim()` would return its own name."""
    w = torch.arange(6.0).reshape(3, 2)
    assert kept_copy("a", {"a": w}, set()) == ""
    assert kept_copy("a", {"a": w, "used": w.clone()}, set()) == "used"


def test_a_parameter_of_other_dimensions_is_skipped_even_where_the_rest_of_its_shape_agrees():
    """A 0-dim parameter (a scalar gate) beside an unused bias: both shapes have no dimension past the first, so only
    `tensor.dim() != kept.dim()` skips the scalar (joined to the next test by `and`, its first dimension is read:
    an IndexError). A bias of the same length as the unused one, and its values, is a copy."""
    b = torch.arange(3.0)
    assert kept_copy("b", {"gate": torch.tensor(2.0), "b": b}, {"b"}) == ""
    assert kept_copy("b", {"gate": torch.tensor(2.0), "used": b.clone(), "b": b}, {"b"}) == "used"


# ---- a scalar gate at zero is drawn too (its fan-in is 1) -------------------------------------------------------


class ScalarGated(nn.Module):
    """x + tanh(alpha) * attention(x), with alpha a 0-dim parameter at 0 (Flamingo's gated cross-attention writes
    it as a one-element vector; a scalar is as common): everything behind the gate gets a gradient of exactly 0 at
    initialisation. `unread`: one more projection that the code never reads (the bug)."""

    def __init__(self, unread: bool, d_model=8, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(d_model, num_heads, batch_first=True)
        self.alpha = nn.Parameter(torch.zeros(()))
        if unread:
            self.extra_proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        y, _ = self.attn(x, x, x, attn_mask=None if mask is None else ~mask, need_weights=False)
        return x + torch.tanh(self.alpha) * y


@pytest.mark.parametrize("unread", [False, True], ids=["every projection read", "one never read"])
def test_a_zero_scalar_gate_is_drawn_and_the_attention_behind_it_is_used(unread):
    """The all-zero parameters are drawn at N(0, 1) / sqrt(fan-in), a fan-in of 1 for a parameter of fewer than two
    dimensions (`p.dim() > 1`): the scalar gate opens, and what is behind it moves the output (pass); a projection
    never read stays unused, named alone (fail). `p.dim() < 1` reads the last dimension of the 0-dim gate (an
    IndexError: the audit's own error)."""
    found = diagnostics.audit(ScalarGated(unread), detectors=["parameters_used"]).result("parameters_used")
    if unread:
        assert (found.verdict, found.message) == ("fail", "the output does not depend on extra_proj.weight, "
                                                          "extra_proj.bias"), found
    else:
        assert found.verdict == "pass", found
        assert "zero gradient only while alpha is all zeros" in found.evidence, found.evidence


# ---- no gradient at all: a skip that says so ----------------------------------------------------------------------


class Detached(nn.Module):
    """Self-attention whose output is detached from the graph (`detached`: an inference-only wrapper's
    `.detach()`), or not."""

    def __init__(self, detached: bool, d_model=8, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.detached = nn.MultiheadAttention(d_model, num_heads, batch_first=True), detached

    def forward(self, x, mask=None):
        y, _ = self.attn(x, x, x, attn_mask=None if mask is None else ~mask, need_weights=False)
        return y.detach() if self.detached else y


@pytest.mark.parametrize("detached", [False, True], ids=["attached", "detached"])
def test_an_output_without_a_gradient_is_a_skip_that_says_so(detached):
    """No grad_fn on the float64 copy's output: the parameters' gradients say nothing, a skip naming why (a guard
    that never fired would read the gradients of nothing: the audit's own error); the same layer attached passes."""
    found = diagnostics.audit(Detached(detached), detectors=["parameters_used"]).result("parameters_used")
    if detached:
        assert found.verdict == "skip" and "no gradient reaches the float64 copy's output" in found.message, found
    else:
        assert found.verdict == "pass", found


# ---- the zeros are drawn only where there are some: the probes listed are the calls made ---------------------------


class Unread(nn.Module):
    """A fused qkv projection and an output projection (no parameter all zeros as nn.Linear draws them, or the output
    bias zero-initialised: `zero_bias`), and one more projection the code never reads (the bug)."""

    def __init__(self, zero_bias: bool, d_model=8, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.h = num_heads
        self.qkv, self.out, self.extra_proj = (nn.Linear(d_model, n * d_model) for n in (3, 1, 1))
        if zero_bias:
            nn.init.zeros_(self.out.bias)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("zero_bias", [False, True], ids=["no zeros", "a zero bias"])
def test_the_gradients_are_taken_again_with_the_zeros_drawn_only_where_a_parameter_is_all_zeros(zero_bias):
    """Both fail naming the projection never read. The float64 forward and backward passes the result lists: the
    gradient checks' shared one (6 tokens), the audit's length again for what is unused on it (16), and, only where
    some parameter is all zeros, the short one again with it drawn (`not unused and not zeros` would take that one
    with nothing to draw, and list it)."""
    found = diagnostics.audit(Unread(zero_bias), detectors=["parameters_used"]).result("parameters_used")
    assert (found.verdict, found.message) == ("fail", "the output does not depend on extra_proj.weight, "
                                                      "extra_proj.bias"), found
    passes = [p.label for p in found.probes if p.label.startswith("float64 copy, forward and backward")]
    short, full = "float64 copy, forward and backward (B=2, T=6)", "float64 copy, forward and backward (B=2, T=16)"
    assert passes == [short, full] + ([short] if zero_bias else []), passes


# ---- an output not finite in one place is a skip, not only one not finite anywhere --------------------------------


class FirstRowBlocked(nn.Module):
    """Self-attention that blocks every key of query 0 itself (a padding rule gone wrong): filled with -inf the
    softmax of that row is 0 / 0, NaN in that row only (`fill="-inf"`); filled with -1e9 it is uniform, finite."""

    def __init__(self, fill: str, d_model=8, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.fill = num_heads, float(fill)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.h)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        blocked = torch.zeros(T, T, dtype=torch.bool)
        blocked[0] = True
        if mask is not None:
            blocked = blocked | ~mask
        y = scores.masked_fill(blocked, self.fill).softmax(-1) @ v  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("fill", ["-inf", "-1e9"])
def test_an_output_with_one_row_not_finite_is_a_skip(fill):
    """NaN in one row of the float64 copy's output makes its gradients say nothing: a skip that says so (`.any()`
    for `.all()` would read them: one finite entry is enough for it). Filled finitely, the same layer passes."""
    found = diagnostics.audit(FirstRowBlocked(fill), detectors=["parameters_used"]).result("parameters_used")
    if fill == "-inf":
        assert found.verdict == "skip" and "the output is not finite on an ordinary input" in found.message, found
    else:
        assert found.verdict == "pass", found


# ---- the evidence's words agree in number with what they name ------------------------------------------------------


class Attention(nn.Module):
    """Self-attention of width 8, two heads, a fused qkv and an output projection; the layers below add one thing."""

    def __init__(self, d_model=8, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.h = num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def heads(self, x):
        B, T, D = x.shape  # batch, tokens, width
        return self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each

    def merge(self, y):
        B, H, T, d = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, H * d))  # (B, T, D)

    def forward(self, x, mask=None):
        q, k, v = self.heads(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class SideGated(Attention):
    """attention(x) + tanh(alpha) * side(x), alpha a zero scalar: the side projection (`bias`: with its bias) gets a
    gradient of exactly 0 until alpha is drawn."""

    def __init__(self, bias: bool):
        super().__init__()
        self.alpha, self.side = nn.Parameter(torch.zeros(())), nn.Linear(8, 8, bias=bias)

    def forward(self, x, mask=None):
        return super().forward(x, mask) + torch.tanh(self.alpha) * self.side(x)


class ZeroResidual(Attention):
    """x + attention(x) with the output projection zero-initialised, weight and bias (DiT's adaLN-Zero): the layer
    starts as the identity, and everything before the projection gets a gradient of exactly 0 until it is drawn."""

    def __init__(self):
        super().__init__()
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, mask=None):
        return x + super().forward(x, mask)


class DetachedGains(Attention):
    """attention(x) + sum_i x . p_i, each p_i read through .detach(): used, its gradient cut. `first_zero`: the first
    token's output set to exactly 0 (a slot the layer leaves empty), so the output has zeros, yet is not all zeros."""

    def __init__(self, n: int, first_zero: bool = False):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(8)) for _ in range(n)])
        self.first_zero = first_zero

    def forward(self, x, mask=None):
        out = super().forward(x, mask) + sum((x @ p.detach()).unsqueeze(-1) for p in self.ps)  # (B, T, D)
        return out * (torch.arange(x.shape[1]) > 0).unsqueeze(-1) if self.first_zero else out


class ClosedGates(Attention):
    """attention(x) x (relu(g_1) + ...), each g_i a per-feature gate at -0.01: closed by the ReLU, so the output is
    all zeros and (out ** 2).sum() flat; drawn at random, a gate opens."""

    def __init__(self, n: int):
        super().__init__()
        self.gates = nn.ParameterList([nn.Parameter(torch.full((8,), -0.01)) for _ in range(n)])

    def forward(self, x, mask=None):
        return super().forward(x, mask) * sum(F.relu(g) for g in self.gates)


class ScaledBeforeNorm(Attention):
    """Cosine attention with a learned gain on q (`both`: on q and k) applied before the l2 norm that removes it."""

    def __init__(self, both: bool):
        super().__init__()
        self.s_q = nn.Parameter(torch.full((2, 1, 4), 2.0))
        self.s_k = nn.Parameter(torch.full((2, 1, 4), 2.0)) if both else None

    def forward(self, x, mask=None):
        q, k, v = self.heads(x)
        q, k = q * self.s_q, k if self.s_k is None else k * self.s_k  # SCALED BEFORE THE NORM
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=4.0))


class KeptCopies(Attention):
    """The reference with the query projection's weight (`both`: and the key projection's) kept as nn.Linear copies
    of its rows of qkv, unused (diffusers' fuse_projections)."""

    def __init__(self, both: bool):
        super().__init__()
        for i, name in enumerate(("q_proj", "k_proj")[:1 + both]):
            setattr(self, name, nn.Linear(8, 8, bias=False))
            with torch.no_grad():
                getattr(self, name).weight.copy_(self.qkv.weight[8 * i:8 * (i + 1)])


@pytest.mark.parametrize("layer, verdict, words", [
    (SideGated(bias=False), "pass", "side.weight: zero gradient only while alpha is all zeros (zero-initialised"),
    (SideGated(bias=False), "pass", "so used: with it drawn at random, it moves the output"),
    (SideGated(bias=True), "pass", "so used: with it drawn at random, they move the output"),
    (ZeroResidual(), "pass", "zero gradient only while out.weight, out.bias are all zeros"),
    (ZeroResidual(), "pass", "so used: with them drawn at random, they move the output"),
    (DetachedGains(1), "pass", "ps.0: the output depends on it, yet autograd gives it no gradient: its gradient is "
                               "cut"),
    (DetachedGains(2), "pass", "ps.0, ps.1: the output depends on them, yet autograd gives them no gradient: their "
                               "gradient is cut"),
    (DetachedGains(1, first_zero=True), "pass", "ps.0: the output depends on it, yet autograd gives it no gradient: "
                                                "its gradient is cut"),
    (ClosedGates(1), "fail", "gates.0: zero gradient because the output is zero everywhere on this probe (the loss, "
                             "(out ** 2).sum(), is flat there), and changing it moves the output, so used"),
    (ClosedGates(2), "fail", "gates.0, gates.1: zero gradient because the output is zero everywhere on this probe "
                             "(the loss, (out ** 2).sum(), is flat there), and changing them moves the output"),
    (ScaledBeforeNorm(both=False), "fail", "the output does not depend on the size of s_q (a scale multiplying the "
                                           "activations: growing it by a factor"),
    (ScaledBeforeNorm(both=False), "fail", "so a normalisation after it divides it back out"),
    (ScaledBeforeNorm(both=True), "fail", "the output does not depend on the size of s_q, s_k (a scale multiplying "
                                          "the activations: growing them by a factor"),
    (KeptCopies(both=False), "warn", "q_proj.weight is a copy of rows 0-7 of qkv.weight"),
], ids=["one gated", "one gated, drawn", "two gated", "two zeros", "two zeros, drawn", "one cut", "two cut",
        "one cut, a zero slot", "one flat", "two flat", "one size",
        "one size, the norm", "two sizes", "one copy"])
def test_the_evidence_names_one_part_in_the_singular_and_several_in_the_plural(layer, verdict, words):
    """Each note of the evidence (parameters gated by zeros, cut, used only where the output is not flat, scales whose
    size the output ignores) says "it" of one parameter and "them" of several, as the message does (below): a
    `len(...) > 1` turned `>= 1` or `< 1` swaps them. An output with some exact zeros is not flat (`not out.all()`
    for `not out.any()` would call the cut gain so)."""
    found = diagnostics.audit(layer, detectors=["parameters_used"]).result("parameters_used")
    assert found.verdict == verdict, found
    assert words in found.evidence, found.evidence


@pytest.mark.parametrize("layer, message", [
    (ScaledBeforeNorm(both=False), "the output does not depend on the size of s_q: a normalisation after this scale "
                                   "divides it back out"),
    (ScaledBeforeNorm(both=True), "the output does not depend on the size of s_q, s_k: a normalisation after these "
                                  "scales divides them back out"),
    (KeptCopies(both=False), "q_proj.weight is not used: kept beside the parameter it was fused into or replaced by, "
                             "which is used (q_proj.weight is a copy of rows 0-7 of qkv.weight)"),
    (KeptCopies(both=True), "k_proj.weight, q_proj.weight are not used: kept beside the parameter they were fused "
                            "into or replaced by, which is used (k_proj.weight is a copy of rows 8-15 of qkv.weight; "
                            "q_proj.weight is a copy of rows 0-7 of qkv.weight)"),
], ids=["one size", "two sizes", "one copy", "two copies"])
def test_the_message_names_one_part_in_the_singular_and_several_in_the_plural(layer, message):
    found = diagnostics.audit(layer, detectors=["parameters_used"]).result("parameters_used")
    assert found.message == message, found


@pytest.mark.parametrize("seq_len", [6, 16])
def test_what_is_unused_is_asked_again_at_the_audits_length_only_where_the_gradient_probe_is_shorter(seq_len):
    """The gradient checks' probe is at most 6 tokens long; at an audit of 16 what it finds unused is asked again at
    16 (a layer that pools its keys sees too few on a short probe), at an audit of 6 it is not (`T <= probe.t` would
    take the same length again, and list it). Both fail naming the projection never read."""
    found = diagnostics.audit(Unread(zero_bias=False), seq_len=seq_len,
                              detectors=["parameters_used"]).result("parameters_used")
    assert (found.verdict, found.message) == ("fail", "the output does not depend on extra_proj.weight, "
                                                      "extra_proj.bias"), found
    passes = [p.label for p in found.probes if p.label.startswith("float64 copy, forward and backward")]
    assert passes == ["float64 copy, forward and backward (B=2, T=6)"] + (
        ["float64 copy, forward and backward (B=2, T=16)"] if seq_len == 16 else []), passes
