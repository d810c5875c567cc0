"""Pins for the survivors of the full mutation run over `_thresholds.py` and `model/_causal.py` (issue 37:
`benchmarks/mutations.py --all --only _thresholds.py --only model/_causal.py`, at 1910d14). Every constant of
`_thresholds.py` was already pinned (tests/test_thresholds.py, tests/test_pins.py); the ten survivors not marked
equivalent were in `_causal._future_allowed`, which reads the mask a model passes a layer that says `is_causal = True`.
As in tests/test_pins.py, each pin has its twin on the same layer (a mask that lets a query see a later key, and one
that does not), the numbers quoted as literals; each case says which mutant it pins (its line number the run's).
No model runs: `infer_causal` on one held layer, a few milliseconds a case."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from diagnostics.model import _causal

T = 8
RUNNER = SimpleNamespace(encoder_decoder=False)
SAYS_CAUSAL = "inferred: its 1 self-attention layers say is_causal = True"


class Held(nn.Module):
    """An in-place wrapper as `infer_causal` reads it around a layer that says `is_causal = True` and was called with
    `arguments` (`call_arguments`) at length `block_size`. Its forward reads every position (x + the mean over
    positions), so where the mask decides against the layer's word, the layer is measured and is not causal."""

    def __init__(self, arguments: dict, block_size: int = T):
        super().__init__()
        self.call_arguments, self.block_size, self.d_model = arguments, block_size, 4
        self.inner = SimpleNamespace(is_causal=True)

    def is_self_attention(self) -> bool:
        return True

    def forward(self, x):
        return x + x.mean(1, keepdim=True)  # (1, T, D): the past moves with the future


def causal_under(arguments: dict, block_size: int = T) -> bool:
    """Whether the model is causal, its one layer saying so and passed `arguments`; checks how it was decided."""
    said, how = _causal.infer_causal(nn.Module(), None, RUNNER, {"a": Held(arguments, block_size)}, T=block_size,
                                     dtype=torch.float32, seed=0)
    assert how == SAYS_CAUSAL if said else how.startswith("assumed: nothing says the model is causal"), how
    return said


def lower(n: int = T, dtype=torch.bool) -> torch.Tensor:
    return torch.ones(n, n, dtype=dtype).tril().view(1, 1, n, n)  # (B, 1, T, T): query i sees keys j <= i


def additive(allowed: torch.Tensor, blocked: float, dtype=torch.float32) -> torch.Tensor:
    """The additive form of a boolean mask: 0 where allowed, `blocked` elsewhere (Hugging Face's finfo.min)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, blocked)


LOWEST = torch.finfo(torch.float32).min


@pytest.mark.parametrize("mask, causal", [
    (lower(), True), (torch.ones(1, 1, 1, T, dtype=torch.bool), False),  # True = may attend (Hugging Face's)
    # additive (L113 `m.dtype == torch.bool` made `!=`: the float mask itself is read as "allowed", its blocked future
    # non-zero; `>` made `<`: the very negative entries are the allowed ones)
    (additive(lower(), LOWEST), True), (additive(lower(), float("-inf")), True),
    (additive(lower(), torch.finfo(torch.float16).min, torch.float16), True),
    (torch.zeros(1, 1, 1, T), False), (torch.zeros(1, 1, T, T), False),
    # integer, 0 blocks (L113 `m != 0` made `==`)
    (lower(dtype=torch.long), True), (torch.ones(1, 1, 1, T, dtype=torch.long), False),
], ids=["bool-causal", "bool-all-keys", "additive-lowest", "additive-inf", "additive-float16", "additive-zeros-row",
        "additive-zeros", "int-causal", "int-all-keys"])
def test_a_layer_saying_is_causal_is_causal_exactly_when_the_4d_mask_its_model_passes_lets_no_query_see_later(
        mask, causal):
    assert causal_under({"attention_mask": mask}) is causal


def test_an_additive_mask_blocks_from_log_float32_eps_down():
    """The additive reading's bar, `m > BLOCKED`, log(float32 eps) = -15.9 (its `>` made `>=`): future entries of
    exactly the bar block; one float32 step above it they are a bias, and a query sees a later key. (The bar was half
    the dtype's lowest value, which read older code's -10000.0 as allowing the future.)"""
    from diagnostics.model._causal import BLOCKED

    bar = float(torch.tensor(BLOCKED))  # as float32 holds it
    assert causal_under({"attention_mask": additive(lower(), bar)}) is True
    above = float(torch.nextafter(torch.tensor(bar), torch.tensor(0.0)))
    assert above > bar
    assert causal_under({"attention_mask": additive(lower(), above)}) is False


def test_a_4d_tensor_that_is_not_a_mask_does_not_overrule_the_layer():
    """`name not in MASK_NAMES or ...` (L108, its first `or` made `and`): a (B, H, T, T) position bias of zeros (T5's
    `position_bias`), which as a mask would let every query see every key, says nothing; the same tensor passed as the
    attention mask does."""
    bias = torch.zeros(1, 2, T, T)
    assert causal_under({"position_bias": bias}) is True
    assert causal_under({"attention_mask": bias}) is False


@pytest.mark.parametrize("padding", [torch.ones(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.bool), None],
                         ids=["int", "bool", "None"])
def test_a_2d_padding_mask_or_none_says_nothing_and_the_same_padding_in_4d_decides(padding):
    """`not isinstance(value, Tensor) or value.dim() != 4` (L108, its second and third `or` made `and`): a (1, T)
    padding mask of all keys (flash attention applies it and is_causal both) or a mask argument left None leaves the
    layer's word; made `and`, the first reads None.dim(), and both read the (1, T) mask as (T, T), every key allowed.
    Twin: the same padding as (1, 1, 1, T), the form the eager and sdpa paths take instead of is_causal."""
    assert causal_under({"attention_mask": padding}) is True
    if padding is not None:
        assert causal_under({"attention_mask": padding.view(1, 1, 1, T)}) is False


@pytest.mark.parametrize("shape", [(1, 1, T, T + 4), (1, 1, T, 1), (1, 1, 3, T)], ids=["more-keys", "one-key",
                                                                                         "other-queries"])
def test_a_4d_mask_over_other_keys_or_queries_than_the_layers_is_not_read(shape):
    """`value.shape[-1] != T or value.shape[-2] not in (1, T)` (L109, the `or` made `and`, and L108's fourth `or`,
    before `T < 2` went: see below): a mask over a cache's T + 4 keys, over one key, or over 3 queries is not this
    call's (T, T) and is not read (made `and`, expanding it to (T, T) raised, or read one key as every key); the twin,
    the same ones over (1, T) or (T, T), decides."""
    assert causal_under({"attention_mask": torch.ones(shape, dtype=torch.bool)}) is True
    assert causal_under({"attention_mask": torch.ones(1, 1, shape[-2] if shape[-2] in (1, T) else 1, T,
                                                      dtype=torch.bool)}) is False


@pytest.mark.parametrize("n", [1, 2], ids=["T1", "T2"])
def test_a_mask_is_read_from_the_shortest_length_where_a_later_key_exists(n):
    """`_future_allowed` read no mask at T < 2, a guard that changed no verdict (at T = 1 the one query has no later
    key, and the empty triu(1) reads False), so it went; `T < 2` made `<=` would skip T = 2, where the (1, 1, 1, 2)
    mask of all keys lets the first query see the second. Twin: the causal (1, 1, 2, 2) mask."""
    assert causal_under({"attention_mask": lower(n)}, block_size=n) is True
    assert causal_under({"attention_mask": torch.ones(1, 1, 1, n, dtype=torch.bool)}, block_size=n) is (n < 2)


# ---- masks_future: a change of exactly the tolerance is no change -----------------------------------------------


TOL = float(torch.tensor(1e-5, dtype=torch.float32))  # UNCHANGED's float32 1e-5, as the float32 change is compared


class SecondCallMoves(nn.Module):
    """A layer on (1, T, 4) whose outputs are fixed, their RMS exactly 1 (feature 0 is 2, the others 0: a quarter of
    the values), the second call's moved by `past` at position 0 and `later` at position T - 1 (feature 1, from 0: the
    change read is the number given, exactly)."""

    def __init__(self, past: float, later: float):
        super().__init__()
        self.past, self.later, self.calls = past, later, 0

    def forward(self, x):
        out = torch.zeros(1, T, 4)
        out[..., 0] = 2.0
        if self.calls:
            out[0, 0, 1], out[0, -1, 1] = self.past, self.later
        self.calls += 1
        return out


def step_above(x: float) -> float:
    return float(torch.nextafter(torch.tensor(x), torch.tensor(1.0)))


def test_a_later_output_moved_by_exactly_the_tolerance_is_not_measured_and_one_a_step_more_is():
    """masks_future's `change[c + 1:] > tol` (L95, `>` made `>=`, marked equivalent before: torch compares a float32
    change with the tolerance rounded to float32, so an exact hit is a float32 number): up to the tolerance is no
    change, so nothing later moved and nothing was measured; one float32 step more moved, the past held."""
    assert _causal.masks_future(SecondCallMoves(0.0, TOL), T, 4, torch.float32, 0) is None
    assert _causal.masks_future(SecondCallMoves(0.0, step_above(TOL)), T, 4, torch.float32, 0) is True


def test_a_past_output_moved_by_exactly_the_tolerance_still_masks_the_future_and_one_a_step_more_does_not():
    """masks_future's `change[:c + 1] > tol` (L97, `>` made `>=`, marked equivalent before): a later output moved by 1,
    the first by exactly the tolerance, masks the future; by one float32 step more it reads the future."""
    assert _causal.masks_future(SecondCallMoves(TOL, 1.0), T, 4, torch.float32, 0) is True
    assert _causal.masks_future(SecondCallMoves(step_above(TOL), 1.0), T, 4, torch.float32, 0) is False
