"""Pins for the mutants of `_core.py`, `detectors/runs.py`, `detectors/weights.py` and `model/packing.py` that no test
depended on (issue 37: every mutant of these modules, `benchmarks/mutations.py --all --only ...`). As in
tests/test_pins.py, each pin has its twin on the same inputs (a case on each side), the numbers quoted as literals.

`_core.perturbed` is the probes' negative control: copies of the inputs with fresh draws at the claimed positions,
and a BlindProbe unless exactly those positions moved. Its pins call it (and `_position_change`, which measures the
move) directly on a small layer's inputs: a correct layer never trips the control, so no audit reaches its branches.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from correct import MultiHeadAttention
from diagnostics import _core
from diagnostics._core import Inputs, _position_change, perturbed
from diagnostics._errors import BlindProbe
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics._thresholds import UNCHANGED, tolerance


def _probe(d_model: int = 8, seq_len: int = 6, dtype=torch.float32) -> Probe:
    layer = MultiHeadAttention(d_model, 1 if d_model < 2 else 2).to(dtype)
    probe = Probe(make_subject(layer), causal=False, scale=None, seq_len=seq_len, seed=0)
    probe.detector = "test"
    return probe


# ---- _position_change: per position, max |new - old| in units of old's RMS, in float64 for float64 ----------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_position_change_is_measured_in_float64_for_float64_inputs_only(dtype):
    """`wide = float64 if old is float64 else float32`: a float64 change of 1e-12 (below float32's resolution of
    values near 1) reads 1e-12, not 0; a float32 input is measured in float32."""
    old = torch.ones(1, 3, 4, dtype=dtype)
    new = old.clone()
    new[0, 1, 2] += 1e-12 if dtype == torch.float64 else 0.25
    change = _position_change(new, old)
    assert change.dtype == dtype and change.shape == (1, 3), change
    assert change[0, 1].item() == pytest.approx(1e-12 if dtype == torch.float64 else 0.25, rel=1e-3, abs=0), change
    assert change[0, 0] == 0 and change[0, 2] == 0, change


@pytest.mark.parametrize("scale", [2.0, 0.0])
def test_position_change_is_relative_to_olds_rms_and_absolute_when_old_is_zero(scale):
    """`diff / (rms(old) or 1.0)`: a move of 1 against an old of RMS 2 reads 0.5; against an all-zero old (RMS 0),
    1.0, the move itself (x10 or x0.1 of the `or 1.0` would read 0.1 or 10; `and` would divide by 1 or by 0)."""
    old = torch.full((1, 3, 4), scale)
    new = old.clone()
    new[0, 2, 0] += 1.0
    change = _position_change(new, old)
    assert change[0, 2].item() == pytest.approx(0.5 if scale else 1.0), change
    assert (change[0, :2] == 0).all(), change


# ---- perturbed: fresh draws at the claimed positions, at least 1 away from the old value --------------------


def test_perturbed_replaces_the_claimed_positions_by_the_probes_float32_draws():
    """The default gain is 1 (x + 1 * (draw - x) = draw): at width 64 every claimed position holds the probe's next
    float32 draw (to rounding) (a float64 draw, or a gain of 10 or 0.1, holds other numbers), the others are kept."""
    probe, twin = _probe(64, 6), _probe(64, 6)
    base = Inputs(*probe.streams(2, 6))
    Inputs(*twin.streams(2, 6))  # the same requests, so that the twin's next generator is perturbed's
    positions = torch.arange(6) >= 4
    [changed] = perturbed(probe, base, positions, ("query",))
    draw = torch.randn((4, 64), generator=twin.generator(), dtype=torch.float32)  # 2 sequences x 2 positions
    assert torch.allclose(changed.query[:, 4:].reshape(4, 64), draw, rtol=0, atol=1e-6)  # old + (draw - old)
    assert torch.equal(changed.query[:, :4], base.query[:, :4]) and changed.key is base.key


@pytest.mark.parametrize("per_sequence", [True, False])
def test_perturbed_takes_positions_per_sequence_or_one_row_for_all(per_sequence):
    """`positions.dim() == 2`: (B, T) positions are each sequence's own; (T,) positions are every sequence's."""
    probe = _probe(8, 6)
    base = Inputs(*probe.streams(2, 6))
    if per_sequence:
        positions = torch.tensor([[False] * 5 + [True], [False] * 3 + [True] * 3])
    else:
        positions = torch.arange(6) >= 5
    [changed] = perturbed(probe, base, positions, ("key",))
    moved = (changed.key != base.key).any(-1)  # (B, T)
    assert torch.equal(moved, positions.expand(2, 6)), moved


def test_perturbed_moves_each_claimed_position_by_at_least_1_at_width_1():
    """At width 1 a fresh draw lands within 1 of the old value about half the time: such positions move by 1 more,
    away from it (`close = |delta| < 1.0`, `away = +-1`), so every claimed position moves by at least 1, and one
    that landed 1 or more away keeps its draw. x0.1 or x10 of the 1.0, `>` for `<`, `all` for `any`, or the sign
    turned would leave a position within 1 (or push a far one)."""
    probe = _probe(1, 64)
    base = Inputs(*probe.streams(2, 64))
    positions = torch.ones(64, dtype=torch.bool)
    [changed] = perturbed(probe, base, positions, ("query",))
    moved = (changed.query - base.query).abs()  # (2, 64, 1)
    assert float(moved.min()) >= 1.0 - 1e-6, moved.min()
    assert float(moved.max()) > 1.5 and float((moved < 2.0).float().mean()) > 0.5, moved  # not all pushed far


def test_perturbed_moves_the_draws_by_about_sqrt_2():
    """x + gain * (draw - x) with the default gain 1: |new - old| has the RMS of the difference of two standard
    normal draws, sqrt(2) (x10: 14, x0.1: 0.14)."""
    probe = _probe(64, 32)
    base = Inputs(*probe.streams(2, 32))
    [changed] = perturbed(probe, base, torch.ones(32, dtype=torch.bool), ("query",))
    rms = float((changed.query - base.query).square().mean().sqrt())
    assert 1.2 < rms < 1.7, rms


# ---- perturbed's control: exactly the claimed positions moved -----------------------------------------------


def _with_change(monkeypatch, change: torch.Tensor):
    monkeypatch.setattr(_core, "_position_change", lambda new, old: change.clone())


CASES = ["exact", "one claimed still", "one claimed at 10 x rounding", "one other moved"]


@pytest.mark.parametrize("case", CASES)
def test_perturbeds_control_raises_unless_exactly_the_claimed_positions_moved(monkeypatch, case):
    """The control reads `_position_change` (made here to report chosen moves): every claimed position moved by
    more than 10 x rounding (not by exactly that) and no other by anything, or a BlindProbe whose message counts
    both. (`any` for either `all` would let one claimed position stay still, or one other move.)"""
    probe = _probe(8, 6)
    base = Inputs(*probe.streams(2, 6))
    positions = torch.arange(6) >= 3
    change = torch.where(positions.expand(2, 6), 1.0, 0.0)
    if case == "one claimed still":
        change[0, 4] = 0.0
    elif case == "one claimed at 10 x rounding":  # moved means by more than that
        change[0, 4] = 10 * tolerance(UNCHANGED, torch.float32)
    elif case == "one other moved":
        change[1, 1] = 1e-3
    _with_change(monkeypatch, change)
    if case == "exact":
        perturbed(probe, base, positions, ("query",))
        return
    with pytest.raises(BlindProbe) as raised:
        perturbed(probe, base, positions, ("query",))
    expected = "changed 6 of them and 1 others" if case == "one other moved" else "changed 5 of them and 0 others"
    assert expected in str(raised.value), raised.value


# ---- _core.held: the worst held row is the first of the greatest ----------------------------------------------


@pytest.mark.parametrize("second", [0.0, 0.5])
def test_held_names_the_first_case_with_the_greatest_change(second):
    """`float(checked.max()) > worst`: where two cases' held rows change alike (here both not at all) the evidence
    names the first case's row; a second case with a greater change is named instead (`>=` would name the later of
    two equal ones)."""
    from types import SimpleNamespace

    from diagnostics._core import Case, Comparison, held

    hold = torch.ones(1, 3, dtype=torch.bool)
    first, later = torch.zeros(1, 3), torch.tensor([[0.0, second, 0.0]])
    comparison = Comparison([Case(None, hold, "first"), Case(None, hold, "second")], [first, later], 0.1, None)
    bad, worst, text, _ = held(comparison, SimpleNamespace(subject=SimpleNamespace(dtype=torch.float32)), what="rows")
    assert worst == second and bad == (second > 0.1), text
    assert (" at (b=0, t=1) second" if second else " at (b=0, t=0) first") in text, text


# ---- _core.relative_change and baseline_scale: widths, non-finite values, the scale's fallbacks -------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_relative_change_is_measured_in_float64_for_float64_outputs(dtype):
    """A float64 change of 1e-12 against values near 1 reads 1e-12 (in float32 it would round to 0); a float32
    output is measured in float32."""
    from diagnostics._core import relative_change

    old = torch.ones(1, 3, 4, dtype=dtype)
    new = old.clone()
    new[0, 1, 2] += 1e-12 if dtype == torch.float64 else 0.25
    change = relative_change(new, old)
    assert change.dtype == dtype and change[0, 1].item() == pytest.approx(1e-12 if dtype == torch.float64 else 0.25,
                                                                           rel=1e-3, abs=0), change
    assert change[0, 0] == 0 and change[0, 2] == 0, change


@pytest.mark.parametrize("case", ["zeros", "nan in both", "inf in both", "inf in one"])
def test_relative_change_reads_nan_and_inf_in_both_as_no_change_and_in_one_as_inf(case):
    """Nothing to measure against (both all zero): None. NaN, or the same inf, in both at a position: no change
    there (0), the other positions measured; inf in one only: inf (or the dtype's largest number)."""
    from diagnostics._core import relative_change

    old = torch.zeros(1, 2, 3) if case == "zeros" else torch.ones(1, 2, 3)
    new = old.clone()
    if case == "zeros":
        assert relative_change(new, old) is None
        return
    bad = {"nan in both": float("nan"), "inf in both": float("inf"), "inf in one": float("inf")}[case]
    new[0, 0, 1] = bad
    if case != "inf in one":
        old[0, 0, 1] = bad
    new[0, 1, 0] += 0.5
    change = relative_change(new, old)
    if case == "inf in one":  # nan_to_num(nan=inf) also turns inf into float32's largest, 3.4e38: as good as inf
        assert change[0, 0].item() > 1e38, change
    else:
        assert change[0, 0].item() == 0.0, change
    assert change[0, 1].item() == pytest.approx(0.5, rel=0.2), change  # against the finite values' RMS


def test_baseline_scale_of_a_float64_output_is_measured_in_float64():
    """Values of 1e-100 have that RMS in float64 (in float32 they would be 0, and the scale 0)."""
    from diagnostics._core import baseline_scale

    assert baseline_scale(torch.full((2, 3, 4), 1e-100, dtype=torch.float64)) == pytest.approx(1e-100, abs=0)


@pytest.mark.parametrize("rows", ["alike", "varying"])
def test_baseline_scale_centred_falls_back_to_the_plain_rms_only_when_the_rows_do_not_vary(rows):
    """`_rms(x, centred) or _rms(x)`: rows all alike (3.0) have no spread about their mean: the plain RMS, 3.0;
    varying rows, their spread (1.0 here), whether read from the baseline or from `scale_of`."""
    from diagnostics._core import baseline_scale

    x = torch.full((2, 4, 3), 3.0)
    if rows == "varying":
        x[:, ::2] += 1.0
        x[:, 1::2] -= 1.0
    expected = 3.0 if rows == "alike" else 1.0
    assert baseline_scale(x, centred=True) == pytest.approx(expected)
    assert baseline_scale(torch.zeros(1, 1, 3), centred=True, scale_of=x) == pytest.approx(expected)


@pytest.mark.parametrize("old_rms", [1.0, 0.0])
def test_baseline_scale_reads_the_new_output_only_where_the_baseline_is_zero(old_rms):
    """The baseline's RMS (1.0 here) even when the new output is larger (5.0); the new output's (centred, as asked:
    its rows vary by 2) only where the baseline is all zero."""
    from diagnostics._core import baseline_scale

    old = torch.full((1, 4, 3), old_rms)
    new = torch.full((1, 4, 3), 5.0)
    new[:, ::2] += 2.0
    new[:, 1::2] -= 2.0
    assert baseline_scale(old, new) == pytest.approx(1.0 if old_rms else float(new.square().mean().sqrt()))
    assert baseline_scale(old, new, centred=True) == pytest.approx(1.0 if old_rms else 2.0)


# ---- runs.JOINT = 1e-3: another row moving by more than that is joint attention, by less a memory ---------------


class LeakyMemory(torch.nn.Module):
    """A cross-attention whose memory (`context`) defaults to None yet is required, every output row plus `leak` x the
    mean of the query tokens: when one query token changes, the other rows move by about 1.17 x `leak` of the
    outputs' RMS (measured: 0.114, 0.0117, 0.00117 for leak 0.1, 0.01, 0.001)."""

    def __init__(self, leak: float, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.mha, self.leak = torch.nn.MultiheadAttention(dim, heads, batch_first=True), leak

    def forward(self, hidden_states, context=None):
        if context is None:
            raise ValueError("LeakyMemory requires context (the text tokens)")
        out = self.mha(hidden_states, context, context, need_weights=False)[0]
        return out + self.leak * hidden_states.mean(1, keepdim=True)


@pytest.mark.parametrize("leak, joint", [(3e-3, True), (3e-4, False)])
def test_runs_reads_rows_moving_by_more_than_1e_3_of_the_rms_as_joint_attention_and_less_as_a_memory(leak, joint):
    """runs._required_input: rows moving by about 3.5e-3 of the RMS when another query token changes are attended
    together (joint attention: the declaration gives `context` no tokens; at JOINT x10 = 1e-2, a memory); by about
    3.5e-4, apart (a memory: `cross=True`; at JOINT x0.1 = 1e-4, joint)."""
    import diagnostics

    result = diagnostics.audit(LeakyMemory(leak).eval(), progress=False).result("runs")
    assert result.verdict == "skip" and result.message.startswith("needs a declaration"), result
    if joint:
        assert "joint attention" in result.message and "context=x[:, :0]" in result.declaration, result
    else:
        assert "as a memory" in result.message and result.declaration == "cross=True", result


# ---- runs._needed_declaration: where every call that raised was given a mask ----------------------------------


def _sibling(name: str):
    """A test module beside this one, loaded by its path (importable under --import-mode=importlib too)."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KeepPerKey = _sibling("test_pins").KeepPerKey  # the reference taking a (B, Tk) keep mask as its undocumented `mask`


class KeepPerKeyNeedsAMask(KeepPerKey):
    """The same layer refusing a call without a mask: its own failure, whatever the convention."""

    def forward(self, x, mask=None):
        if mask is None:
            raise ValueError("a mask is required")
        return super().forward(x, mask)


@pytest.mark.parametrize("causal", [False, True])
def test_runs_names_a_declaration_where_every_call_that_raised_was_given_a_mask(causal):
    """`any(c.allowed is None for c in calls)`: audited bidirectional or causal (every call then carries the causal
    mask), the layer raises only on masks in the audit's convention and honours a (B, Tk) keep mask: a declaration to
    make (a skip), never a FAIL (before 2026-12-05 the causal audit failed it: the convention was sought only where a
    call without a mask had run; the other convention's own probe shows the layer runs). Its twin, refusing a call
    without a mask too, fails: a raise the mask's convention does not explain."""
    import diagnostics

    result = diagnostics.audit(KeepPerKey(), causal=causal, progress=False).result("runs")
    assert result.verdict == "skip" and result.message.startswith("needs a declaration, mask='key_keep'"), result
    if not causal:
        failed = diagnostics.audit(KeepPerKeyNeedsAMask(), progress=False).result("runs")
        assert failed.verdict == "fail" and failed.message.startswith("the layer raised on"), failed


class QueryKeyValueStyled(torch.nn.Module):
    """nn.MultiheadAttention behind forward(query, key, value, mask=None, style=None), raising unless `style` (a
    stream the audit leaves at None) is given; its one-stream twin takes forward(x, mask=None, style=None)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, query, key, value, mask=None, style=None):
        if style is None:
            raise ValueError("style is required")
        # summed, not averaged: given no style tokens it adds 0 (a mean would be NaN, and no call is then named)
        return self.mha(query, key, value, need_weights=False)[0] + style.sum(1, keepdim=True)


class SelfStyled(QueryKeyValueStyled):
    def forward(self, x, mask=None, style=None):
        return super().forward(x, x, x, mask, style)


@pytest.mark.parametrize("cls", [SelfStyled, QueryKeyValueStyled])
def test_runs_names_a_required_stream_only_for_a_module_given_one_stream(cls):
    """`s.form != "self_module" or not isinstance(s.layer, Module)`: the declarations `runs` writes call the layer with
    one stream x (`layer(x, style=x[:, :0], mask=mask)`), so only a one-stream module gets one (a skip); a module of
    query, key and value that raises without `style` fails (`and` would write it a one-stream declaration)."""
    import diagnostics

    result = diagnostics.audit(cls().eval(), progress=False).result("runs")
    if cls is SelfStyled:
        assert result.verdict == "skip" and result.message.startswith("needs a declaration"), result
        assert result.declaration == "call=lambda layer, x, mask: layer(x, style=x[:, :0], mask=mask)", result
    else:
        assert result.verdict == "fail" and result.message.startswith("the layer raised on"), result


# ---- model/packing.leak_source: a module whose inputs already crossed is not where the leak starts ----------


def _packed_lm(gated: bool):
    """A one-layer LM of packed documents whose attention ignores the document boundaries (a leak), its output
    passed through `gate(y, x)`, a submodule of two tensor inputs: the attention's output, which crossed, and the
    layer's input, which did not (`gated`); or not."""
    import torch.nn.functional as F

    T, D, H = 16, 32, 4

    class Gate(torch.nn.Module):
        def forward(self, y, x):
            return y * torch.sigmoid(x.mean(-1, keepdim=True))

    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
            self.gate = Gate() if gated else None

        def forward(self, x):
            B, t, _ = x.shape  # batch, sequence length
            q, k, v = self.qkv(x).view(B, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, t, d)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, t, d): documents not kept apart
            y = y.transpose(1, 2).reshape(B, t, D)
            return self.out(self.gate(y, x) if gated else y)

    class LM(torch.nn.Module):
        causal = True

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.wte, self.wpe, self.attn, self.head = (torch.nn.Embedding(64, D), torch.nn.Embedding(T, D), Leaky(),
                                                        torch.nn.Linear(D, 64))

        def forward(self, input_ids, position_ids=None):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            return self.head(self.attn(self.wte(input_ids) + self.wpe(position_ids)))

    return LM()


@pytest.mark.parametrize("gated", [True, False])
def test_packed_documents_find_the_leak_in_the_attention_not_in_a_submodule_it_feeds(gated):
    """`any(_crosses(a) for a in inputs)`: the gate, whose first input already crossed the documents, is not where
    the leak starts though its second did not (`all` would name it, a module without softmax attention, and warn
    of a mixer's state); the attention is, with or without the gate: a fail."""
    import diagnostics

    result = diagnostics.audit_model(_packed_lm(gated), packed=True, detectors=["packed_documents"]).result(
        "packed_documents")
    assert result.verdict == "fail" and result.layer == "attn", result
    assert "the leak starts in" not in result.message and "gate" not in result.message, result
