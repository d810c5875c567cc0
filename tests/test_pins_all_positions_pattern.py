"""Pins for the survivors of the full mutation run over relative_positions and attention_pattern (issue 37:
`benchmarks/mutations.py --all --only detectors/positions.py --only detectors/pattern.py`, at 824d172). As in
tests/test_pins.py, each pin has its twin on the same inputs (a case on each side of the comparison, guard or constant
it pins), the numbers quoted as literals; each test says which mutant it pins (its line number the run's, at 824d172).
Small function layers written here, one detector at small sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics import patterns


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


def attention(q, k, v, mask=None):
    """Scaled dot-product attention on (B, H, Tq, d) x (B, H, Tk, d), True = may attend; returns (out, weights)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B, H, Tq, d)


# ---- attention_pattern: _run --------------------------------------------------------------------------------------


def test_the_pattern_copies_are_split_so_that_a_calls_scores_stay_under_2_to_the_24():
    """_run's `heads = s.num_heads or 1` (L132; `and` makes it 1 for every layer with heads): the copies per call are
    2^24 // (B x heads x Tq x Tk). sliding_window(4) at T = 256 reads 6 classes; with 32 heads a copy's scores are
    2 x 32 x 256^2 = 2^22 elements, so 4 copies a call: 8 sequences, then 4 (heads counted as 1: all 6 in one call of
    12). Its twin, the same layer with 1 head: 2^17 a copy, the 6 copies in one call."""
    batches = []

    def counting(q, k, v, mask=None):
        if q.shape[-2] == 256:
            batches.append(q.shape[0])
        return attention(q, k, v, mask)

    pattern = patterns.sliding_window(4)
    many = verdict(counting, "attention_pattern", seq_len=256, num_heads=32, d_model=32, pattern=pattern)
    assert many.verdict == "pass" and "6 copies" in many.evidence, many
    assert batches == [2, 2, 8, 4], batches  # the detector's baseline, the probe's own, then the copies
    batches.clear()
    one = verdict(counting, "attention_pattern", seq_len=256, num_heads=1, d_model=1, pattern=pattern)
    assert one.verdict == "pass" and batches == [2, 2, 12], (one, batches)


def test_a_pattern_output_that_loses_the_batch_is_a_skip_that_says_so():
    """_run's per-row guard (L143-144: `and` made `or` in either place, or the guard never firing): a layer that
    returns one sequence where it was given two has no row per batch element, a skip that says so; the same layer
    keeping its batch passes."""

    def dropped(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)
        return out[:1], weights[:1]

    window = patterns.sliding_window(4)
    lost = verdict(dropped, "attention_pattern", pattern=window)
    assert lost.verdict == "skip" and "has no row per query and batch element" in lost.message, lost
    assert verdict(attention, "attention_pattern", pattern=window).verdict == "pass"


class SharedMemory(nn.Module):
    """Attention m(query, key, value, mask=None) over (B, T, D) that takes one memory as both key and value, as
    torch's MultiheadAttention packs its key and value projections when `key is value`: given a value that is not its
    key it refuses (the packed path is the only one it has). `slope`: a distance bias slope x |i - j| (ALiBi's for
    slope < 0), none by default."""

    def __init__(self, d_model=8, slope=0.0, *, self_only=False):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv, self.slope = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model), slope
        self.self_only = self_only  # self-attention only: the query must be the memory too

    def forward(self, query, key, value, mask=None):
        if value is not key:
            raise ValueError("one memory only: pass value=key")
        if self.self_only and query is not key:
            raise ValueError("self-attention only: pass query=key=value")
        k, v = self.kv(key).chunk(2, dim=-1)  # (B, Tk, D) each, one packed projection
        q = self.q(query)
        distance = (torch.arange(q.shape[-2]).view(-1, 1) - torch.arange(k.shape[-2]).view(1, -1)).abs()  # (Tq, Tk)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.slope * distance  # (B, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask.view(-1, *mask.shape[-2:]), float("-inf"))
        return scores.softmax(-1) @ v  # (B, Tq, D)


def test_the_pattern_copies_keep_a_memory_that_is_both_key_and_value_one_tensor():
    """_run's `V = K if base.one_stream or base.value is base.key` (L158; `and` concatenates the copies' values apart
    from their keys: the same numbers, another tensor): a layer that takes one memory as key and value (it reads
    `value is key`, as torch's MultiheadAttention does) is measured and passes; the same layer refuses a value that is
    a copy of its key, which is what the copies would give it."""
    layer = SharedMemory()
    found = verdict(layer, "attention_pattern", pattern=patterns.sliding_window(4))
    assert found.verdict == "pass", found
    x = torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match="one memory only"):
        layer(x, x, x.clone())


def fixed_batch(q, k, v, mask=None):
    """The reference for batches of 2 only (a layer traced or compiled for one batch size)."""
    if q.shape[0] != 2:
        raise RuntimeError(f"compiled for a batch of 2, got {q.shape[0]}")
    return attention(q, k, v, mask)


def test_a_layer_that_raises_on_the_stacked_pattern_copies_is_a_skip_that_names_the_raise():
    """_run's `if not call.ok` on the copies' call (L160, the guard never firing: the detector would read the output
    of a call that raised): a layer that takes a batch of 2 only runs the baseline and raises on the 12 stacked
    sequences, a skip that names the raise; the reference passes."""
    window = patterns.sliding_window(4)
    raised = verdict(fixed_batch, "attention_pattern", pattern=window)
    assert raised.verdict == "skip" and "the layer raised on this detector's probe" in raised.message, raised
    assert "compiled for a batch of 2, got 12" in raised.message, raised
    assert verdict(attention, "attention_pattern", pattern=window).verdict == "pass"


# ---- relative_positions: the shift within the layer's context -------------------------------------------------------


class Alibi(nn.Module):
    """Self-attention m(x, mask=None) on (B, T, D) with ALiBi's bias -0.5 |i - j| (relative positions), declaring a
    context of `context` tokens (`context_length`, which bounds every probe) where given."""

    def __init__(self, context: int | None = None, d_model: int = 8, num_heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.num_heads = nn.Linear(d_model, 3 * d_model), num_heads
        if context is not None:
            self.context_length = context

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        distance = (torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)).abs()  # (T, T)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) - 0.5 * distance  # (B, H, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)  # (B, T, D)


@pytest.mark.parametrize(("context", "seq_len", "shift", "rows"),
                         [(None, 16, 5, 24), (64, 16, 5, 24), (17, 16, 5, 24), (14, 14, 2, 24), (12, 12, 1, 22),
                          (4, 4, 1, 6)])
def test_the_shift_and_the_tokens_fit_within_the_layers_context(context, seq_len, shift, rows):
    """check_relative_positions' sizes (L237-241): T = min(seq_len, 12) real tokens after P = 5, unless the layer's
    context is shorter than T + P: then P = context - T, and where that leaves none, T = context - 1 after P = 1.
    A context of 64 leaves the shift at 5 (`T + P < limit` would shift by 52), one of 14 makes it 2 (`P > 1` would
    make it 1), one of 12 leaves 11 real tokens after 1 (22 rows of 2 sequences), one of 4 leaves the 3 tokens the
    permutation needs, measured (`T <= 3` would skip)."""
    found = verdict(Alibi(context), "relative_positions", seq_len=seq_len)
    assert found.verdict == "pass", found
    assert found.message.startswith(f"shifting every position by {shift} (padding)"), found
    assert found.evidence.startswith(f"0 / {rows} outputs of the real tokens changed"), found


def test_a_context_of_3_tokens_leaves_no_room_for_the_shift_and_says_so():
    """`if T < 3` (L241, the guard never firing): a context of 3 leaves T = 2 real tokens after P = 1, too few for the
    permutation around the newest key; a skip that says so. Its twin, a context of 4, is measured (above)."""
    found = verdict(Alibi(3), "relative_positions", seq_len=3)
    assert found.verdict == "skip", found
    assert "the layer's context (context_length=3) leaves no room to shift 3 tokens" in found.message, found
    assert verdict(Alibi(4), "relative_positions", seq_len=4).verdict == "pass"


# ---- relative_positions: what its finding follows from --------------------------------------------------------------


def alibi(q, k, v, mask=None, *, twice=False, drift=0.0, slope=-0.5):
    """Attention on (B, H, Tq, d) with ALiBi's bias `slope` x |i - j| (-0.5: ALiBi's sign); `twice`: a second softmax over the weights (the
    keys the mask blocks get weight back: exp(0)); `drift`: each output row moved by `drift` x its index (absolute
    positions). Returns (out, weights)."""
    distance = (torch.arange(q.shape[-2]).view(-1, 1) - torch.arange(k.shape[-2]).view(1, -1)).abs()  # (Tq, Tk)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + slope * distance  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1)
    weights = weights.softmax(-1) if twice else weights
    return weights @ v + drift * torch.arange(q.shape[-2]).view(-1, 1), weights  # (B, H, Tq, d)


def test_a_shift_through_padding_that_the_mask_lets_in_follows_from_mask_honoured_and_absolute_positions_do_not():
    """ShiftReplay.consequence_of (L155, `==` made `!=`: the padding method's finding would name no cause): a second
    softmax gives the padding the mask blocks weight back, so the shift through left padding moves the real tokens
    and mask_honoured fails too: the finding says it follows from mask_honoured. Its twin, a layer that honours its
    mask and adds absolute positions to its outputs, fails alone, with no such note."""
    report = diagnostics.audit(lambda q, k, v, mask=None: alibi(q, k, v, mask, twice=True),
                               detectors=["relative_positions", "mask_honoured"])
    found = report.result("relative_positions")
    assert report.result("mask_honoured").verdict == "fail", report.result("mask_honoured")
    assert found.verdict == "fail" and found.message.endswith("(a consequence of mask_honoured)"), found
    report = diagnostics.audit(lambda q, k, v, mask=None: alibi(q, k, v, mask, drift=0.1),
                               detectors=["relative_positions", "mask_honoured"])
    found = report.result("relative_positions")
    assert report.result("mask_honoured").verdict == "pass", report.result("mask_honoured")
    assert found.verdict == "fail" and found.message.endswith("moves them"), found


# ---- relative_positions: the left padding's mask --------------------------------------------------------------------


def alibi_strict(q, k, v, mask=None):
    """ALiBi (above) refusing a mask that leaves a query no key (as layers that check their masks do)."""
    if mask is not None and not bool(mask.any(-1).all()):
        raise ValueError("a query that sees no key")
    return alibi(q, k, v, mask)


def alibi_key_padding(q, k, v, key_padding_mask=None, *, slope=-0.5):
    """ALiBi taking torch's key padding mask ((B, Tk), True = padding), refusing one that pads every key."""
    if key_padding_mask is None:
        return alibi(q, k, v, slope=slope)
    if bool(key_padding_mask.all(-1).any()):
        raise ValueError("a sequence that is all padding")
    return alibi(q, k, v, ~key_padding_mask[:, None, None, :], slope=slope)


@pytest.mark.parametrize("causal", [False, True], ids=["not causal", "causal"])
@pytest.mark.parametrize("layer", [alibi_strict, alibi_key_padding], ids=["allowed", "key_padding"])
def test_the_left_padding_leaves_every_query_a_key(layer, causal):
    """_shift_mask (L206-209): the real queries are blocked from the P padding keys, the padding queries see every key
    (causally, those before them), so no row is fully blocked; a key-padding layer audited as not causal gets one row
    for every query, the padding blocked for all. A layer that refuses a query with no key is measured, causal or not,
    with either convention (`!=`, `or` or a dropped `not` there would block every key for the padding queries of one
    of the four); the shift then passes (ALiBi)."""
    found = verdict(layer, "relative_positions", causal=causal)
    assert found.verdict == "pass" and found.message.startswith("shifting every position by 5 (padding)"), found


def test_a_key_padding_layer_not_causal_is_read_in_one_call_so_a_flipped_alibi_is_found():
    """_shift_mask's `convention == "key_padding"` (L206, `!=`: the padding queries would see every key, a mask a
    (B, Tk) key padding mask cannot hold, so the layer would be called one query at a time and the record would hold
    no (B x 2, H, 17, 17) scores to read the distance bias from): a key-padding layer audited as not causal gets one
    row for every query, one call; ALiBi's sign flipped (+0.5 |i - j|) is found there; its twin, the right sign
    (-0.5), passes (above)."""
    flipped = verdict(lambda q, k, v, key_padding_mask=None: alibi_key_padding(q, k, v, key_padding_mask, slope=0.5),
                      "relative_positions")
    assert flipped.verdict == "fail" and flipped.message.startswith("the position bias rewards distance"), flipped
    assert verdict(alibi_key_padding, "relative_positions").verdict == "pass"


# ---- relative_positions: the stacked call's guards ------------------------------------------------------------------


def test_a_positional_layer_that_raises_on_the_stacked_call_is_a_skip_that_names_the_raise():
    """`if not stacked.ok` (L267, the guard never firing: the output of a call that raised would be read): ALiBi for
    batches of 2 only raises on the 3 x 2 sequences of the permuted call, a skip that names the raise; the same
    layer at any batch passes."""
    def strict_batch(q, k, v, mask=None):
        if q.shape[0] != 2:
            raise RuntimeError(f"compiled for a batch of 2, got {q.shape[0]}")
        return alibi(q, k, v, mask)

    raised = verdict(strict_batch, "relative_positions")
    assert raised.verdict == "skip" and "compiled for a batch of 2, got 6" in raised.message, raised
    assert verdict(alibi, "relative_positions").verdict == "pass"


def test_a_positional_output_that_loses_the_batch_is_a_skip_that_says_so():
    """The stacked call's shape guard (L270: the guard never firing, or either `or` made `and`): ALiBi returning one
    sequence where it was given six has no row per query and batch element, a skip that says so; keeping its batch it
    passes."""
    def dropped(q, k, v, mask=None):
        out, weights = alibi(q, k, v, mask)
        return out[:1], weights[:1]

    lost = verdict(dropped, "relative_positions")
    assert lost.verdict == "skip" and "has no row per query and batch element" in lost.message, lost
    assert verdict(alibi, "relative_positions").verdict == "pass"


def test_a_positional_output_of_zeros_is_a_skip_that_says_so():
    """`if not scale > 0` (L274: the guard never firing, or `>=`): ALiBi times 0 has an output of zeros everywhere,
    against which no change can be measured, a skip that says so; times 1 it passes."""
    zero = verdict(lambda q, k, v, mask=None: (0 * alibi(q, k, v, mask)[0], None), "relative_positions")
    assert zero.verdict == "skip" and "the output is zero or non-finite everywhere" in zero.message, zero
    assert verdict(lambda q, k, v, mask=None: (alibi(q, k, v, mask)[0], None), "relative_positions").verdict == "pass"


def test_a_positional_layer_with_dropout_left_on_is_a_skip_that_says_so():
    """The randomness control (L277, the guard never firing): ALiBi with dropout on its weights in every call gives
    two copies of one input in one call different outputs, a skip that names it; with the dropout off it passes."""
    def dropping(q, k, v, mask=None, *, p=0.5):
        out, weights = alibi(q, k, v, mask)
        weights = torch.nn.functional.dropout(weights, p, training=p > 0)
        return weights @ v, weights

    noisy = verdict(dropping, "relative_positions")
    assert noisy.verdict == "skip" and "two copies of the same input in one call differ by" in noisy.message, noisy
    assert verdict(lambda q, k, v, mask=None: dropping(q, k, v, mask, p=0.0), "relative_positions").verdict == "pass"


def test_a_positional_layer_that_raises_on_the_shifted_call_is_a_skip_that_names_the_raise():
    """The shifted call that raised (L332's `and`, L356's guard): ALiBi refusing 17 tokens (5 of padding before 12)
    is measured up to the shift, then a skip that names the raise; refusing 18 it passes."""
    def refusing(length):
        def layer(q, k, v, mask=None):
            if q.shape[-2] == length:
                raise RuntimeError(f"no {length} tokens")
            return alibi(q, k, v, mask)
        return layer

    raised = verdict(refusing(17), "relative_positions")
    assert raised.verdict == "skip" and "the layer raised on this detector's probe" in raised.message, raised
    assert "no 17 tokens" in raised.message, raised
    assert verdict(refusing(18), "relative_positions").verdict == "pass"


def test_a_memory_that_is_both_key_and_value_stays_one_tensor_through_the_shift():
    """A defect the full run found (L246, then `V = K if (one or v is k)` at L260, whose `and` survived: `v is k` was
    never true there): the probe's tokens were scaled by the logit gain one stream at a time, so a memory that is both
    key and value became two tensors, and a layer that takes one memory (it reads `value is key`, as torch's
    MultiheadAttention does) raised: "the layer raised" instead of a reading. Scaled as they are shared, the layer
    without positions is not applicable (measured: the permutation moved nothing) and with ALiBi's bias it is
    measured through left padding, and passes."""
    plain = verdict(SharedMemory(), "relative_positions")
    assert plain.verdict == "skip" and plain.message.startswith("not applicable: the layer has no positional"), plain
    alibi_memory = verdict(SharedMemory(slope=-0.5), "relative_positions")
    assert alibi_memory.verdict == "pass", alibi_memory
    assert alibi_memory.message.startswith("shifting every position by 5 (padding)"), alibi_memory


@pytest.mark.parametrize(("slope", "confirmed"), [(-0.5, False), (0.5, True)], ids=["alibi", "flipped"])
def test_the_float64_copy_is_called_only_to_confirm_a_distance_reward_found_below_float64(slope, confirmed):
    """`if rewarded and s.dtype != torch.float64` (L348; `or` would call the float64 copy on every audit below
    float64): ALiBi in float32 passes and never runs in float64; its sign flipped, the reward read in float32 is read
    again on the float64 copy, which the evidence quotes."""
    seen = set()

    def layer(q, k, v, mask=None):
        seen.add(q.dtype)
        return alibi(q, k, v, mask, slope=slope)

    found = verdict(layer, "relative_positions")
    assert (torch.float64 in seen) == confirmed, seen
    assert found.verdict == ("fail" if confirmed else "pass"), found
    assert ("on the float64 copy of the layer" in found.evidence) == confirmed, found


def test_a_causal_audit_gives_one_stream_so_a_self_attention_only_layer_is_measured():
    """`cross = s.separate_kv and not probe.causal` (L245, `not` dropped: causal audits would get a query apart from
    the memory): audited as causal, a layer taking (query, key, value) gets one stream, as every causal probe is, so
    one that takes self-attention only (query is key is value) is measured, and with ALiBi passes; audited as not
    causal the same layer gets a query of its own and refuses it, a skip that names the raise."""
    causal = verdict(SharedMemory(slope=-0.5, self_only=True), "relative_positions", causal=True)
    assert causal.verdict == "pass" and causal.message.startswith("shifting every position by 5 (padding)"), causal
    both = verdict(SharedMemory(slope=-0.5, self_only=True), "relative_positions")
    assert both.verdict == "skip" and "self-attention only" in both.message, both


# ---- pattern._tests: every class where the budget allows; a one-stream layer's own class left out ------------------


@pytest.mark.parametrize("budget", [3, 4, 5])
def test_the_pattern_probe_reads_every_class_exactly_where_the_budget_holds_them(budget):
    """`_tests`' `p <= budget` (L299 at 3057bfd, made `<`, survived the --all run): a causal window of 2 over 8 tokens
    has p = 4 classes (its widest row + 2); a budget of 4 or 5 reads every class in order, and every edge pair; a
    budget of 3 reads the three classes that read the most edge pairs, and says not every pair was read."""
    from diagnostics.detectors.pattern import _tests

    T, W = 8, 2
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    declared = ((j <= i) & (i - j < W)).expand(1, T, T).clone()  # (B, Tq, Tk)
    tests = _tests(declared, budget, one_stream=False)
    assert tests.p == 4 and tests.every == (budget >= 4), tests
    assert tests.residue[:, 0].tolist() == ([0, 1, 2, 3] if budget >= 4 else [1, 2, 0]), tests
    assert (tests.edges, tests.edges_read) == ((26, 26) if budget >= 4 else (26, 21)), tests


@pytest.mark.parametrize("one_stream", [True, False])
def test_a_one_stream_layer_reads_no_pair_in_its_own_class(one_stream):
    """`_tests`' `residue != residue` for one stream (L298 at 3057bfd, made `==`, survived the --all run): a one-stream
    layer's copy changes query i's own token with the keys of its class, so none of those pairs can be read: of the 26
    edge pairs of a causal window of 2 over 8 tokens, the 7 on the diagonal's class go (19 left); given its keys apart
    (its twin), all 26 are read. With `==` the one-stream layer would read the 7 only."""
    from diagnostics.detectors.pattern import _tests

    T, W = 8, 2
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    declared = ((j <= i) & (i - j < W)).expand(1, T, T).clone()
    assert _tests(declared, 4, one_stream=one_stream).edges == (19 if one_stream else 26)


@pytest.mark.parametrize("measured, extras", [(None, {}), ("no picture", {}), ("a picture", {"dependency_map": "map"})])
def test_a_pattern_finding_carries_its_picture_only_where_one_was_measured(measured, extras):
    """`_picture`'s `m is not None and m.picture is not None` (L596 at 3057bfd, `and` made `or`, survived the --all
    run): a FlexAttention finding made without a measurement (None) and a measurement whose picture's calls failed
    (picture None) carry no `dependency_map` in their extras, which the HTML report would draw empty (with `or`, the
    first raises and the second carries None); one with its picture carries it."""
    from types import SimpleNamespace

    from diagnostics.detectors.pattern import _picture

    m = None if measured is None else SimpleNamespace(picture=None if measured == "no picture" else "map")
    assert _picture(m) == extras
