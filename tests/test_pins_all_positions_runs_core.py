"""Pins for the survivors of the full mutation runs over relative_positions, runs and `_core` (issue 37:
`benchmarks/mutations.py --all --only detectors/positions.py` (then `detectors/runs.py`, `_core.py`), at ff5444f). As
in tests/test_pins.py, each pin has its twin on the same inputs (a case on each side of the comparison, guard or
constant it pins), the numbers quoted as literals; each test says which mutant it pins (its line number the run's, at
ff5444f). Small layers written here, one detector at small sizes.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

import diagnostics


def _sibling(name: str):
    """A sibling test module loaded from its file (never imported by name: pytest runs in importlib mode in CI)."""
    spec = importlib.util.spec_from_file_location(f"_m37k_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], progress=False, **kw).result(detector)


def attention(q, k, v, mask=None):
    """Scaled dot-product attention on (B, H, Tq, d) x (B, H, Tk, d), True = may attend; returns (out, weights)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B, H, Tq, d)


def alibi(q, k, v, mask=None, *, slope=-0.5):
    """`attention` with ALiBi's bias `slope` x |i - j| added to the scores (relative positions)."""
    distance = (torch.arange(q.shape[-2]).view(-1, 1) - torch.arange(k.shape[-2]).view(1, -1)).abs()  # (Tq, Tk)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + slope * distance  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B, H, Tq, d)


# ---- relative_positions -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("queries", "named"), [(1, "1 query of its own"), (2, "2 queries of its own")])
def test_a_layer_with_queries_of_its_own_has_no_positions_to_shift_and_says_how_many(queries, named):
    """check_relative_positions' first guard (L234, never firing: the shift would be tried on a layer whose Q output
    rows are no tokens, and skipped for a shape that is no defect) and its wording (L236, `== 1` made `!= 1`): an
    attention-pooling layer with 1 and with 2 queries of its own is not applicable, in the singular and the plural;
    its twin, ALiBi over the tokens, is measured and passes."""
    pool = _sibling("test_layer_pooling_queries").AttentionPool
    found = verdict(pool(queries).eval(), "relative_positions", queries=queries)
    assert found.verdict == "skip" and found.message.startswith("not applicable: the layer attends with"), found
    assert named in found.message, found
    assert verdict(alibi, "relative_positions").verdict == "pass"


@pytest.mark.parametrize(("causal", "which"), [(False, "the output of every query by"),
                                               (True, "the output of query 11, which sees every key by")],
                         ids=["not causal", "causal"])
def test_attention_without_positions_says_which_queries_the_permutation_was_read_on(causal, which):
    """check_relative_positions' `which` (L293, the `not` dropped: a layer audited as not causal would name query 11
    alone): the permutation is read on every query of a layer audited as not causal, and on the newest one only (the
    one that sees every key) of a causal one; plain attention is not applicable either way, and says where it read."""
    found = verdict(attention, "relative_positions", causal=causal)
    assert found.verdict == "skip" and "the layer has no positional mechanism" in found.message, found
    assert which in found.message, found


def narrowing(length: int):
    """ALiBi whose output keeps one feature of each head at `length` tokens (a layer whose width follows its length)."""

    def layer(q, k, v, mask=None):
        out, weights = alibi(q, k, v, mask)
        return (out[..., :1], weights) if q.shape[-2] == length else (out, weights)

    return layer


def test_a_shifted_output_of_another_width_is_a_skip_that_says_so():
    """The shifted call's shape guard (L391, never firing: its one feature would be compared with the unshifted
    call's eight, broadcast): ALiBi whose output narrows at 17 tokens (5 of padding before 12) is not measured, and
    says why; narrowing at 18 tokens (never given) it passes."""
    narrowed = verdict(narrowing(17), "relative_positions")
    assert narrowed.verdict == "skip" and "does not match the unshifted" in narrowed.message, narrowed
    assert verdict(narrowing(18), "relative_positions").verdict == "pass"


def nan_at_the_newest(length: int | None):
    """ALiBi whose newest query's first feature is NaN: at every length (None), or at `length` tokens only."""

    def layer(q, k, v, mask=None):
        out, weights = alibi(q, k, v, mask)
        if length is None or q.shape[-2] == length:
            out = out.clone()
            out[..., -1, 0] = float("nan")
        return out, weights

    return layer


@pytest.mark.parametrize(("length", "expected"), [(None, "pass"), (17, "skip")], ids=["always", "shifted only"])
def test_a_nan_where_both_calls_have_it_is_no_change_and_one_the_shift_made_is_a_skip(length, expected):
    """The non-finite guard of the shifted call (L393, either `all` made `any`): ALiBi whose newest output is NaN in
    one feature at every length has it at the same place in both calls (no change: a pass, where `isfinite(base).any()`
    would skip); NaN at 17 tokens only (5 of padding before 12), the real tokens' outputs are partly non-finite where
    the unshifted ones are finite: a skip that says so (where `not isfinite(real).any()` would read the NaN as a
    change and fail positions)."""
    found = verdict(nan_at_the_newest(length), "relative_positions")
    assert found.verdict == expected, found
    if expected == "skip":
        assert "outputs are non-finite once 5 padding tokens blocked by the mask come before them" in found.message


TOL = float(torch.tensor(2e-5, dtype=torch.float32))  # SHIFT_MOVES' float32 2e-5, as the float32 change is compared


def step_above(x: float) -> float:
    return float(torch.nextafter(torch.tensor(x), torch.tensor(1.0)))


def exact(moved: float, *, noisy: bool = False, raising: bool = False, flag: bool = False):
    """A function on (B, H, T, 4) whose outputs ignore the tokens, their centred RMS exactly 1 (feature 0 is +2 over
    the first half of the real tokens and -2 over the rest, the others 0): the permuted copy of the stacked call (its
    second pair of sequences) has feature 0 negated, so positions are seen; at 17 tokens (5 of padding before 12)
    the newest query's feature 1 moves from 0 by `moved` (the change read is that number, exactly) where the mask
    blocks the padding for it, and, `noisy`, its feature 2 by 1 from the second such call on (`raising`: that call
    raises instead; `flag`: wherever a mask is given, whatever it blocks)."""
    calls = []

    def layer(q, k, v, mask=None):
        N, H, T, d = q.shape
        first = 5 if T == 17 else 0  # the real tokens after the padding
        out = torch.zeros_like(q)
        out[:, :, first:, 0] = torch.where(torch.arange(T - first) < (T - first) // 2, 2.0, -2.0)
        if T == 12 and N == 6:
            out[2:4, ..., 0] *= -1
        if T == 17:
            calls.append(N)
            if mask is not None and (flag or not bool(mask[..., -1, 0].any())):
                out[..., -1, 1] = moved
            if raising and len(calls) > 1:
                raise RuntimeError("a second call of 17 tokens")
            if noisy and len(calls) > 1:
                out[..., -1, 2] = 1.0
        return out

    return layer


def test_a_shift_that_moves_an_output_by_exactly_shift_moves_passes_and_one_float32_step_more_fails():
    """`bad = change > tol` (L402, `>` made `>=`): torch compares the float32 change with SHIFT_MOVES rounded to
    float32, so an exact hit is a float32 number a layer can give: a move of exactly the tolerance is rounding (a
    pass), one float32 step more depends on absolute positions (a fail)."""
    at = verdict(exact(TOL), "relative_positions", d_model=8, num_heads=2)
    assert at.verdict == "pass" and at.value == TOL, at
    above = verdict(exact(step_above(TOL)), "relative_positions", d_model=8, num_heads=2)
    assert above.verdict == "fail" and above.message.startswith("the outputs depend on absolute positions"), above


def test_a_shifted_call_that_moves_some_outputs_is_called_again_before_it_is_blamed():
    """The second shifted call, the randomness control (L409, `bad.any()` made `all()`: called only where every real
    output moved): 4 outputs of 48 moved by the shift (the newest of each sequence and head), and the same shifted input gives another output in its second
    call, a skip that names the randomness; its twin, the same move in every call, depends on absolute positions."""
    noisy = verdict(exact(1.0, noisy=True), "relative_positions", d_model=8, num_heads=2)
    assert noisy.verdict == "skip" and "the same shifted input gave outputs 1 of their RMS apart" in noisy.message
    steady = verdict(exact(1.0), "relative_positions", d_model=8, num_heads=2)
    assert steady.verdict == "fail" and "4 / 48 outputs of the real tokens changed" in steady.evidence, steady


@pytest.mark.parametrize(("declared", "said"), [({"positions": "relative"}, '; positions="relative" says they are relative'),
                                                ({}, "")], ids=["declared", "undeclared"])
def test_a_shift_that_moves_a_layer_declared_relative_says_what_declared_it(declared, said):
    """The finding's wording (L430, `kind == "relative"` made `!=`): a layer whose shift moves its outputs, declared
    relative, says that the declaration does; undeclared, the message ends at the move."""
    found = verdict(exact(1.0), "relative_positions", d_model=8, num_heads=2, **declared)
    assert found.verdict == "fail", found
    assert found.message == f"the outputs depend on absolute positions: shifting every position by 5 moves them{said}"


def test_a_second_shifted_call_that_raises_leaves_the_first_reading_standing():
    """The randomness control's call that raised (L415, `and` made `or`: the output of a call that raised would be
    read; L416, `== "positions"` made `!=`: a layer shifted through padding would be shifted through positions it
    cannot take; L556, `or` made `and`: the mask-as-flag call, which raises too, would be read): the control and
    the flag check are then left out and the first reading stands, a fail, as its twin's that never raises."""
    raised = verdict(exact(1.0, raising=True), "relative_positions", d_model=8, num_heads=2)
    steady = verdict(exact(1.0), "relative_positions", d_model=8, num_heads=2)
    assert raised.verdict == steady.verdict == "fail", (raised, steady)
    assert raised.evidence == steady.evidence, (raised, steady)


@pytest.mark.parametrize(("moved", "flag", "expected"), [(1.0, True, "skip"), (1.0, False, "fail"), (0.0, True, "pass")],
                         ids=["flag", "read", "unmoved"])
def test_a_shift_that_moves_some_outputs_through_a_mask_read_as_a_flag_is_the_masks_finding(moved, flag, expected):
    """The mask-as-flag check after a move (L421, `bad.any()` made `all()`, `and` made `or`, or `== "padding"` made
    `!=`; L423, the guard never firing): 4 outputs of 48 move at 17 tokens wherever a mask is given, so with the
    padding's mask opened they move the same: the mask is read only as a flag, a skip that says so; its twin, moving
    only where the mask blocks the padding, depends on absolute positions. Moving nothing, the layer passes: it
    reads no mask either, but the check is made only after a move."""
    found = verdict(exact(moved, flag=flag), "relative_positions", d_model=8, num_heads=2)
    assert found.verdict == expected, found
    assert ("reads its mask only as a flag" in found.message) == (expected == "skip"), found


class OneHead(torch.nn.Module):
    """Self-attention m(x, mask=None) on (B, T, D) with one head, its scores (B, T, T) (three axes), plus the distance
    bias `slope` x |i - j| (ALiBi's for slope < 0); the mask bool (B, 1, T, T), True = may attend."""

    def __init__(self, slope: float, d_model: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.slope = torch.nn.Linear(d_model, 3 * d_model), slope

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, D) each
        distance = (torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)).abs()  # (T, T)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D) + self.slope * distance  # (B,T,D) x (B,D,T) -> (B,T,T)
        if mask is not None:
            scores = scores.masked_fill(~mask.view(B, T, T), float("-inf"))
        return scores.softmax(-1) @ v  # (B, T, D)


@pytest.mark.parametrize(("slope", "expected"), [(0.5, "fail"), (-0.5, "pass")], ids=["flipped", "alibi"])
def test_a_flipped_alibi_whose_scores_have_three_axes_is_read(slope, expected):
    """_scores_seen's `x.dim() >= 3` (L460, made `> 3`: a single-head layer's (B, T, T) softmax input would not be
    read, and a bias that rewards distance would pass): ALiBi's sign flipped in a one-head module fails, its twin
    with ALiBi's sign passes."""
    found = verdict(OneHead(slope), "relative_positions")
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message.startswith("the position bias rewards distance"), found


def sdpa_alibi(slope: float, *, sink: bool = False, first_alone: bool = False):
    """ALiBi through torch's fused attention on (B, H, T, d): the distance bias slope x |i - j| as its float mask (the
    passed bool mask folded in as -inf). `sink`: a key and value of zeros appended to every sequence (an attention
    sink, bias 0, never blocked), so the fused call's keys are one more than its queries; `first_alone`: a fused call
    on the first sequence alone before the batched one (a summary the layer keeps; here unused)."""

    def layer(q, k, v, mask=None):
        B, H, T, d = q.shape
        distance = (torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)).abs().to(q.dtype)  # (T, T)
        bias = (slope * distance).expand(B, 1, T, T)
        if mask is not None:
            bias = bias.masked_fill(~mask.view(-1, 1, T, T), float("-inf"))
        if sink:
            k, v = (torch.cat([x, x.new_zeros(B, H, 1, d)], dim=2) for x in (k, v))  # (B, H, T + 1, d)
            bias = torch.cat([bias, bias.new_zeros(B, 1, T, 1)], dim=-1)  # (B, 1, T, T + 1)
        if first_alone:
            torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=bias[:1])  # (1, H, T, d)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    return layer


def test_a_fused_call_whose_keys_outnumber_its_queries_is_not_read_as_square():
    """_scores_seen's guard on a fused call (L463, its second or third `or` made `and`: keys one more than the
    queries would be read as a square, and the reading raise): ALiBi through a fused call with a sink key appended
    is not read there, and passes; its twin without the sink is read: its sign flipped, it fails."""
    found = verdict(sdpa_alibi(-0.5, sink=True), "relative_positions")
    assert found.verdict == "pass", found
    flipped = verdict(sdpa_alibi(0.5), "relative_positions")
    assert flipped.verdict == "fail" and flipped.message.startswith("the position bias rewards distance"), flipped


@pytest.mark.parametrize(("slope", "expected"), [(0.5, "fail"), (-0.5, "pass")], ids=["flipped", "alibi"])
def test_a_fused_call_of_one_sequence_before_the_batched_one_is_passed_over(slope, expected):
    """_scores_seen's guard on a fused call (L463, its first `or` made `and`: a fused call of the stacked call's length
    but one sequence would be read, its rows past the first copy empty, and nothing judged): a layer that attends
    its first sequence alone before the whole batch is read on the batched call: ALiBi's sign flipped fails, and
    its twin with ALiBi's sign passes."""
    found = verdict(sdpa_alibi(slope, first_alone=True), "relative_positions")
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message.startswith("the position bias rewards distance"), found


def sdpa_alibi_2d(slope: float):
    """ALiBi through torch's fused attention with one (T, T) float mask for the whole batch: the distance bias
    slope x |i - j|, the first sequence's bool mask folded in as -inf (the audit's masks are alike over the batch)."""

    def layer(q, k, v, mask=None):
        T = q.shape[-2]
        bias = slope * (torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)).abs().to(q.dtype)  # (T, T)
        if mask is not None:
            bias = bias.masked_fill(~mask.reshape(-1, T, T)[0], float("-inf"))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    return layer


@pytest.mark.parametrize(("slope", "expected"), [(0.5, "fail"), (-0.5, "pass")], ids=["flipped", "alibi"])
def test_a_fused_calls_mask_of_fewer_axes_than_its_scores_is_broadcast(slope, expected):
    """_scores_seen's `f.attn_mask.dim() <= x.dim()` (L467, made `>=`: a (T, T) mask under (B, H, T, T) scores would
    not be read, and a flipped bias pass): ALiBi's sign flipped in a (T, T) float mask fails, its twin passes."""
    found = verdict(sdpa_alibi_2d(slope), "relative_positions")
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message.startswith("the position bias rewards distance"), found


@pytest.mark.parametrize(("slope", "expected"), [(0.5, "fail"), (-0.5, "pass")], ids=["flipped", "alibi"])
def test_a_window_of_two_keys_is_enough_to_read_the_distance(slope, expected):
    """distance_reward's `count >= 2` (L488, made `> 2`: rows that see two keys would be too few, and a window of 2
    never read): under a declared sliding_window(2) every row sees its own key and the one before, a line of two
    points; ALiBi's sign flipped fails, its twin passes."""
    found = verdict(lambda q, k, v, mask=None: alibi(q, k, v, mask, slope=slope), "relative_positions",
                    pattern=diagnostics.patterns.sliding_window(2))
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message.startswith("the position bias rewards distance"), found


def test_a_flag_is_not_sought_where_the_pattern_already_blocks_the_padding():
    """_mask_is_a_flag's first test (L553, `==` made `!=`): under a declared sliding_window(1) every real query sees
    its own key alone, so the padding's mask and the mask opened to the padding are the same, and no call can tell a
    flag from a mask: the move stands, a fail; without the window the same layer's mask is found to be a flag (the
    test above)."""
    found = verdict(exact(1.0, flag=True), "relative_positions", d_model=8, num_heads=2,
                    pattern=diagnostics.patterns.sliding_window(1))
    assert found.verdict == "fail" and found.message.startswith("the outputs depend on absolute positions"), found


# ---- runs: _needed_declaration ------------------------------------------------------------------------------------


def keep_per_key():
    """tests/test_pins.py's KeepPerKey: the reference taking a (B, Tk) keep mask as its undocumented `mask`, so the
    audit's default (B, 1, Tq, Tk) mask makes it raise, and given as key_keep it runs and honours it."""
    return _sibling("test_pins").KeepPerKey()


class KeepPerKeyOfTwo(torch.nn.Module):
    """KeepPerKey that also refuses a batch of one (a layer compiled for batches of 2), mask or not."""

    def __init__(self):
        super().__init__()
        self.inner = keep_per_key()
        self.d_model, self.num_heads = 16, 2

    def forward(self, x, mask=None):
        if x.shape[0] == 1:
            raise RuntimeError("compiled for a batch of 2")
        return self.inner(x, mask)


def test_runs_fails_a_layer_that_also_raised_without_a_mask_and_names_the_declaration_for_one_that_did_not():
    """_needed_declaration's `any(c.allowed is None for c in calls)` (L287, made `all`: one call without a mask that
    raised is enough to show the mask is not all that differs): the layer raising on the default mask and on B=1
    without one fails; its twin, raising on the mask alone, is a skip that names key_keep."""
    found = verdict(KeepPerKeyOfTwo(), "runs")
    assert found.verdict == "fail" and "B=1: RuntimeError: compiled for a batch of 2" in found.evidence, found
    twin = verdict(keep_per_key(), "runs")
    assert twin.verdict == "skip" and twin.message.startswith("needs a declaration, mask='key_keep'"), twin


# ---- runs: _length_constraint -------------------------------------------------------------------------------------


def blockwise(batch_of_two: bool, window: int = 4):
    """tests/test_layer_causes.py's BlockwiseAttention (lengths that are multiples of 4 only, as its own assertion
    says); `batch_of_two`: it also refuses a batch of one, with an error that names no multiple."""
    base = _sibling("test_layer_causes").BlockwiseAttention

    class Blockwise(base):
        def forward(self, x):
            if batch_of_two and x.shape[0] == 1:
                raise RuntimeError("compiled for a batch of 2")
            return super().forward(x)

    torch.manual_seed(0)
    return Blockwise(window=window)


@pytest.mark.parametrize(("batch_of_two", "expected"), [(True, "fail"), (False, "skip")], ids=["also B=1", "lengths"])
def test_runs_skips_refused_lengths_only_where_every_raise_states_the_rule(batch_of_two, expected):
    """_length_constraint's `not all(stated)` (L425, made `any`: one raise that states the rule would be enough, and
    the others' missing rule read): a layer that refuses T = 1 by its stated rule and B = 1 by another error fails;
    its twin, refusing T = 1 alone, is a skip that names the multiple."""
    found = verdict(blockwise(batch_of_two), "runs", causal=True)
    assert found.verdict == expected, found
    if expected == "skip":
        assert found.message.startswith("the layer takes lengths that are multiples of 4 only"), found


# ---- runs: _required_input ----------------------------------------------------------------------------------------


def leaky_memory(one_token_alone: bool):
    """tests/test_pins_small.py's LeakyMemory (leak 3e-4: a memory it attends apart), whose `context` defaults to None
    yet is required; `one_token_alone`: a single token without context attends itself instead (so the T=1 probe
    runs while the others raise)."""
    base = _sibling("test_pins_small").LeakyMemory

    class Memory(base):
        def forward(self, hidden_states, context=None):
            if context is None and one_token_alone and hidden_states.shape[1] == 1:
                context = hidden_states
            return super().forward(hidden_states, context)

    return Memory(3e-4).eval()


@pytest.mark.parametrize(("one_token_alone", "expected"), [(True, "fail"), (False, "skip")], ids=["T=1 ran", "none ran"])
def test_runs_names_a_required_input_only_where_every_probe_of_its_own_raised(one_token_alone, expected):
    """_required_input's first guard (L339: `all` made `any`, or either `or` made `and`): a layer that ran on one of
    runs' probes without the stream (T=1) raised on the others for another reason than a missing input: a fail; its
    twin, raising on every probe without `context`, is a skip that names cross=True."""
    found = verdict(leaky_memory(one_token_alone), "runs")
    assert found.verdict == expected, found
    if expected == "skip":
        assert found.message.startswith("needs a declaration") and found.declaration == "cross=True", found


def test_runs_skips_lengths_refused_by_a_rule_of_multiples_of_2():
    """_length_constraint's `w < 2` (L428, made `<= 2`: a rule of even lengths would be read as no rule): blocks of
    2 tokens refuse T = 1 only, by their stated rule, a skip that names it, as blocks of 4 are (the test above)."""
    found = verdict(blockwise(False, window=2), "runs", causal=True)
    assert found.verdict == "skip" and found.message.startswith("the layer takes lengths that are multiples of 2 only")


class Misstated(torch.nn.Module):
    """tests/test_layer_causes.py's BlockwiseAttention whose own check states a rule of multiples of `w` but refuses
    what `refuses(B, T)` says: a length the rule allows, or one it does not name."""

    def __init__(self, refuses, w: int = 4):
        super().__init__()
        self.inner, self.refuses, self.w = blockwise(False), refuses, w
        self.d_model, self.heads = self.inner.d_model, self.inner.heads

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        assert not self.refuses(B, T), f"sequence length {T} must be divisible by window size {self.w}"
        return self.inner(x)


@pytest.mark.parametrize(("refuses", "w"), [(lambda B, T: B == 1, 4), (lambda B, T: T == 1, 3)],
                         ids=["B=1 at a multiple", "a rule the standard probe breaks"])
def test_runs_fails_a_stated_rule_that_the_layer_does_not_keep(refuses, w):
    """_length_constraint's second guard (L428, its second or third `or` made `and`; L429, `all` made `any`: one
    refused length off the rule would be enough): a rule of multiples of 4 that
    refused T = 16 at B = 1, or a rule of multiples of 3 stated by a layer that ran the standard probe at T = 16, is
    no rule the layer keeps: the raises fail (the docstring: "a refused length that is a multiple of W ... still
    fail"); its twin, refusing T = 1 alone by a rule of 4, is a skip (the tests above)."""
    found = verdict(Misstated(refuses, w), "runs", causal=True)
    assert found.verdict == "fail" and found.message.startswith("the layer raised on"), found


class BiasOnZeros(OneHead):
    """OneHead whose distance bias starts from zeros, as torch's SDPA reference writes `attn_bias = torch.zeros(L,
    S)`: the keys' positions added to it, then the queries' taken away, then the slope (a flipped ALiBi for
    slope > 0): the first (T, T) op made of positions alone has the zeros among its ancestors, beside the positions."""

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, D) each
        positions = torch.arange(T, dtype=x.dtype)
        bias = torch.zeros(T, T, dtype=x.dtype) + positions.view(1, -1)  # (T, T): key j's position
        bias = (bias - positions.view(-1, 1)).abs() * self.slope  # slope x |i - j|
        scores = q @ k.transpose(-2, -1) / math.sqrt(D) + bias
        if mask is not None:
            scores = scores.masked_fill(~mask.view(B, T, T), float("-inf"))
        return scores.softmax(-1) @ v  # (B, T, D)


def test_a_flipped_bias_begun_on_zeros_is_located_where_the_positions_enter_it():
    """`_constant`'s `all` (L775 at 3057bfd, made `any`: one op of zeros before it would make the bias a constant, and
    every op of it would be passed over): the flipped bias built on torch.zeros(T, T) is located at the line that
    adds the keys' positions to the zeros, the first of it made of positions; the zeros alone are no site. Its twin
    with ALiBi's sign passes."""
    found = diagnostics.audit(BiasOnZeros(0.5), detectors=["relative_positions"], progress=False).result(
        "relative_positions")
    assert found.verdict == "fail" and found.message.startswith("the position bias rewards distance"), found
    assert found.where and "torch.zeros(T, T, dtype=x.dtype) + positions.view(1, -1)" in found.where[0].code, \
        found.where
    twin = diagnostics.audit(BiasOnZeros(-0.5), detectors=["relative_positions"], progress=False)
    assert twin.result("relative_positions").verdict == "pass", twin.result("relative_positions")
