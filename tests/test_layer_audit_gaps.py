"""Gaps of the layer audit left after issue 34's first pass, each a cause fixed with its twins (the buggy layer caught,
the correct one passing on the same inputs).

(a) A mask finding's convention hint is read from a padding probe (the same keys blocked for every query). A layer
    that mixes query rows (heads merged without their transpose) honours such a mask in every convention it runs in,
    so honouring it in another says nothing: the hint's probe is first run as the audit called the layer (its own
    negative control), and where it is honoured there no convention is named.
(b) `keys_matter` on a layer given one memory stream (keys and values the same input) changes that stream alone, so
    its verdict is about the memory: it no longer says "the keys and the values" where the two were not told apart.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from correct import MultiHeadAttention

D, H = 32, 4  # d_model, heads


# ---- (a) no convention hint where the convention given is honoured --------------------------------------------


def mask_finding(layer, **kw):
    torch.manual_seed(0)
    return diagnostics.audit(layer, detectors=["mask_honoured"], **kw).result("mask_honoured")


@pytest.mark.parametrize("causal", [False, True])
def test_heads_merged_without_transpose_gets_no_convention_hint_and_its_fix_names_the_merge(causal):
    """Not causal, the causal scenario fails and the padding one passes: before, the hint's padding probe was honoured
    as allowed:Tq,Tk and the finding said "mask='allowed:Tq,Tk' declares what it does"; now it says the padding
    mask is honoured as given, and names no declaration. Causal, the hint's probe has the causal mask in it and
    fails as given too. Either way the fix shown is the merge's."""
    torch.manual_seed(0)
    result = mask_finding(VARIANTS["heads_merged_without_transpose"].build(D, H, causal=causal), causal=causal)
    assert result.verdict == "fail", result
    assert "Tq,Tk" not in result.message and "declares what it does" not in result.message, result.message
    if not causal:
        assert "so the mask's convention is not the cause" in result.message, result.message
        assert "mask=" not in result.message and "mask=" not in result.fix, result
    fix, general = result.remedy
    assert not general and "transpose(1, 2).reshape" in fix, fix


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_passes_mask_honoured_on_the_same_inputs(causal):
    torch.manual_seed(0)
    result = mask_finding(MultiHeadAttention(D, H, causal=causal), causal=causal)
    assert result.verdict == "pass", result


# ---- (b) keys_matter's words where keys and values are one input ------------------------------------------------


class MemoryAttention(nn.Module):
    """Cross-attention given its queries and one memory (`context`): keys and values both projected from it.
    `ignores_memory`: the keys and values projected from the query stream instead (the memory never read)."""

    def __init__(self, d_model=D, num_heads=H, *, ignores_memory=False):
        super().__init__()
        self.d_model, self.num_heads, self.ignores_memory = d_model, num_heads, ignores_memory
        self.q, self.kv, self.out = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, context, mask=None):
        B, T, D_ = x.shape  # batch, query length, d_model
        memory = x if self.ignores_memory else context
        S, h = memory.shape[1], self.num_heads  # memory length, heads
        q = self.q(x).view(B, T, h, D_ // h).transpose(1, 2)  # (B, h, T, d)
        k, v = self.kv(memory).view(B, S, 2, h, D_ // h).permute(2, 0, 3, 1, 4)  # (B, h, S, d) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(D_ // h)  # (B, h, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D_))


def keys_result(layer, **kw):
    torch.manual_seed(0)
    return diagnostics.audit(layer, detectors=["keys_matter"], **kw).result("keys_matter")


def test_one_memory_stream_passes_keys_matter_saying_what_was_measured():
    """Before: "the output depends on the keys and on the values", from the memory changed as a whole."""
    torch.manual_seed(0)
    found = keys_result(MemoryAttention(), cross=True)
    assert found.verdict == "pass", found
    assert found.message.startswith("the output depends on its memory (keys and values are one input here"), found
    assert "the keys and on the values" not in found.message, found
    assert "(the memory: its keys and values, one input)" in found.evidence, found.evidence


def test_one_memory_stream_never_read_fails_keys_matter_naming_the_memory():
    torch.manual_seed(0)
    found = keys_result(MemoryAttention(ignores_memory=True), cross=True)
    assert (found.verdict, found.message) == ("fail", "the output does not depend on its memory (its keys and values, "
                                                      "one input)"), found


def test_keys_and_values_given_apart_still_say_both():
    from correct import scaled_dot_product_attention as attention

    found = keys_result(attention)
    assert (found.verdict, found.message) == ("pass", "the output depends on the keys and on the values"), found
