"""Pins for the survivors of `benchmarks/mutations.py --all` at 3057bfd in `runs`' reading of what a layer that
raised needs (issue 37): `_required_input` (an input the audit left at None), `_given` (the call that gives it),
`_mask_hint` (the convention hint of a mask that raised). As in tests/test_pins.py each pin has its twin on the same
inputs, a case on each side of the guard it pins; each test names its mutants (line numbers the run's, at 3057bfd).
Small layers written here; the `runs` detector alone.
"""

from __future__ import annotations

import pytest
import torch

import diagnostics


def runs(layer, **kw):
    """`runs`' result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=["runs"], progress=False, **kw).result("runs")


class NeedsContext(torch.nn.Module):
    """A cross-attention whose memory (`context`) defaults to None yet is required; `backwards`: given it, the layer
    attends the wrong way round (the memory's tokens query the tokens), so its output has a row per memory token."""

    def __init__(self, backwards: bool = False, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.mha, self.backwards = torch.nn.MultiheadAttention(dim, heads, batch_first=True), backwards

    def forward(self, hidden_states, context=None):
        if context is None:
            raise ValueError("NeedsContext requires context (the text tokens)")
        if self.backwards:
            return self.mha(context, hidden_states, hidden_states, need_weights=False)[0]  # (B, Tm, D): the bug
        return self.mha(hidden_states, context, context, need_weights=False)[0]


@pytest.mark.parametrize("backwards, expected", [(True, "fail"), (False, "skip")], ids=["rows per memory token",
                                                                                        "rows per token"])
def test_a_required_input_counts_only_where_given_it_the_layer_returns_a_row_per_token(backwards, expected):
    """`_given`'s `and` (L402, made `or`: any tensor it returned would count, whatever its rows): given `context`, a
    layer whose output has a row per memory token (5) is no cross-attention of the tokens: `runs` fails it; its twin,
    a row per token, needs cross=True."""
    found = runs(NeedsContext(backwards).eval())
    assert found.verdict == expected, found
    if expected == "skip":
        assert found.message.startswith("needs a declaration") and found.declaration == "cross=True", found
    else:
        assert found.message.startswith("the layer raised on"), found


@pytest.mark.parametrize("declared, expected", [(True, "fail"), (False, "skip")], ids=["call= declared", "none"])
def test_a_declared_call_that_leaves_the_input_out_is_the_users_call_to_fix(declared, expected):
    """`_required_input`'s guard (L345, its `or`s made `and`: a declared call would be read as the audit's own): where
    the user declared how to call the layer and that call leaves `context` out, every probe raises through the user's
    call: `runs` fails, naming what it raised, and suggests no declaration of its own; the twin, audited without a
    call, needs cross=True."""
    kw = {"call": lambda layer, x, mask: layer(x)} if declared else {}
    found = runs(NeedsContext().eval(), **kw)
    assert found.verdict == expected, found
    assert bool(found.declaration) is (expected == "skip"), found


class OneTokenAlone(torch.nn.Module):
    """Attention that takes a Hugging Face-style `attention_mask` and, without one, refuses a single token (a bug of
    its own, nothing to do with masks); `refuses_masks`: it raises on every mask it is given, as a layer that takes
    masks of another shape does."""

    def __init__(self, refuses_masks: bool = False, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.mha, self.refuses_masks = torch.nn.MultiheadAttention(dim, heads, batch_first=True), refuses_masks

    def forward(self, hidden_states, attention_mask=None):
        if self.refuses_masks and attention_mask is not None:
            raise RuntimeError(f"attention_mask of shape {tuple(attention_mask.shape)} is not (batch, keys)")
        if attention_mask is None and hidden_states.shape[1] == 1:
            raise IndexError("index 1 is out of bounds for dimension 1 with size 1")
        return self.mha(hidden_states, hidden_states, hidden_states, need_weights=False)[0]


@pytest.mark.parametrize("refuses_masks, hinted", [(False, False), (True, True)], ids=["no mask raised", "masks raised"])
def test_the_mask_convention_hint_is_given_only_where_a_call_with_a_mask_raised(refuses_masks, hinted):
    """`_mask_hint`'s first guard (L461, `or` made `and`: a layer that takes a mask would get the hint whatever
    raised): a layer whose only raise is its own, at one token without a mask, fails `runs` with no word about the
    mask's convention; its twin, raising on every mask while it runs without one, fails with the hint first."""
    found = runs(OneTokenAlone(refuses_masks).eval())
    assert found.verdict == "fail", found
    assert ("the mask may be in another convention" in found.fix) is hinted, found.fix


class RaisesOnAll(torch.nn.Module):
    """A layer that raises on every call, at one token by an index error, on longer ones by one `mask_shaped` or not:
    a causal audit gives every call a mask, so none runs without one."""

    def __init__(self, mask_shaped: bool):
        super().__init__()
        self.proj, self.mask_shaped = torch.nn.Linear(32, 32), mask_shaped

    def forward(self, hidden_states, attention_mask=None):
        T = hidden_states.shape[1]
        if T == 1:
            raise IndexError("index 1 is out of bounds for dimension 1 with size 1")
        if self.mask_shaped:
            raise RuntimeError(f"The size of tensor a ({T}) must match the size of tensor b (4) at non-singleton "
                               f"dimension 3")
        raise RuntimeError("expected scalar type Float but found Double")


@pytest.mark.parametrize("mask_shaped, hinted", [(True, True), (False, False)], ids=["one about the mask", "none"])
def test_one_raise_that_reads_as_the_mask_is_enough_for_the_convention_hint(mask_shaped, hinted):
    """`_mask_hint`'s `any` (L464, made `all`: every raise would have to read as the mask's): with no call run
    without a mask, raises at T >= 2 that name a size mismatch (MASKY) beside an index error at T = 1 give the hint;
    its twin, whose raises never read as the mask's, fails without it."""
    found = runs(RaisesOnAll(mask_shaped).eval(), causal=True)
    assert found.verdict == "fail", found
    assert ("the mask may be in another convention" in found.fix) is hinted, found.fix


class MemoryOfItsOwnLength(torch.nn.Module):
    """A cross-attention whose memory is a required parameter (the audit gives it on every call: the tokens
    themselves) and that refuses a memory as long as its queries; `optional`: the memory defaults to None instead
    (then it is left out, and the layer raises for want of it)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.mha = torch.nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, hidden_states, context):
        if context is None or context.shape[1] == hidden_states.shape[1]:
            raise ValueError("context must be the text tokens, not the image's own")
        return self.mha(hidden_states, context, context, need_weights=False)[0]


class OptionalMemory(MemoryOfItsOwnLength):
    def forward(self, hidden_states, context=None):
        return super().forward(hidden_states, context)


@pytest.mark.parametrize("cls, expected", [(MemoryOfItsOwnLength, "fail"), (OptionalMemory, "skip")],
                         ids=["required: given", "optional: left at None"])
def test_a_required_memory_the_audit_gives_on_every_call_is_never_said_to_be_missing(cls, expected):
    """A required memory makes the layer a cross-attention given it on every call (`_subject`), so that the layer
    that raised with `context` given on every probe is never told "each given without `context`": `runs` fails it;
    its twin, whose `context` defaults to None and is left out, needs cross=True. (This is why `_required_input`'s
    `and` at L347 is marked equivalent in benchmarks/mutations.py: the guard above it returns for every such layer.)"""
    found = runs(cls().eval())
    assert found.verdict == expected, found
    assert ("without `context`" in found.message) is (expected == "skip"), found.message


class BlockMemory(torch.nn.Module):
    """A cross-attention that cuts its memory into blocks of 4 and says so when the memory's length is no multiple of
    4; `refuses_16`: it also refuses a memory of 16 tokens, a multiple its own rule allows."""

    def __init__(self, refuses_16: bool = False, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.mha, self.refuses_16 = torch.nn.MultiheadAttention(dim, heads, batch_first=True), refuses_16

    def forward(self, x, memory):
        n = memory.shape[1]
        assert n % 4 == 0 and not (self.refuses_16 and n == 16), f"memory length {n} must be divisible by 4"
        return self.mha(x, memory, memory, need_weights=False)[0]


@pytest.mark.parametrize("refuses_16, expected", [(False, "skip"), (True, "fail")], ids=["keeps its rule", "breaks it"])
def test_a_length_rule_on_the_keys_alone_is_read_from_the_calls_whose_keys_break_it(refuses_16, expected):
    """`_length_constraint`'s inner `or` (L446, made `and`: a refused call would need both lengths off the rule): the
    cross-attention probe with 16 queries and 19 keys is refused by the memory's rule alone, and the layer takes
    lengths that are multiples of 4: a skip naming them; its twin, refusing a memory of 16 tokens too, fails."""
    found = runs(BlockMemory(refuses_16).eval(), cross=True)
    assert found.verdict == expected, found
    if expected == "skip":
        assert found.message.startswith("the layer takes lengths that are multiples of 4 only"), found


class StatesNoRule(torch.nn.Module):
    """Refuses a single token with words that read as a rule of multiples of `w`, 0 or 1: no length breaks them."""

    def __init__(self, w: int, dim: int = 32, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.mha, self.w = torch.nn.MultiheadAttention(dim, heads, batch_first=True), w

    def forward(self, x):
        assert x.shape[1] > 1, f"sequence length {x.shape[1]} must be divisible by window size {self.w}"
        return self.mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("w, expected", [(0, "fail"), (1, "fail"), (2, "skip")])
def test_a_rule_of_multiples_of_0_or_1_is_no_rule_and_fails_where_one_of_2_is_kept(w, expected):
    """`_length_constraint`'s `w < 2` with its first `or` (L445, made `and`: "divisible by 0" would then be divided
    by): multiples of 0 or 1 name no length to refuse, so refusing T = 1 fails `runs` (never a crash); the twin on the
    same probes, words for multiples of 2, is a rule T = 1 breaks and the standard probe keeps: a skip."""
    found = runs(StatesNoRule(w).eval())
    assert found.verdict == expected, found
    assert found.message.startswith("the layer raised on" if expected == "fail" else
                                    "the layer takes lengths that are multiples of 2 only"), found
