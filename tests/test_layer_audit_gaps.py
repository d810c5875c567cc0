"""Gaps of the layer audit left after issue 34's first pass, each a cause fixed with its twins (the buggy layer caught,
the correct one passing on the same inputs).

(a) A mask finding's convention hint is read from a padding probe (the same keys blocked for every query). A layer
    that mixes query rows (heads merged without their transpose) honours such a mask in every convention it runs in,
    so honouring it in another says nothing: the hint's probe is first run as the audit called the layer (its own
    negative control), and where it is honoured there no convention is named.
"""

from __future__ import annotations

import pytest
import torch

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
