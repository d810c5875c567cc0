"""A mask read only as a flag (issue 34, cause 7): a layer that takes a mask and, whenever one is given, applies a
fixed pattern of its own (a causal mask, a window) without reading the mask's values. Whisper's SDPA path is one
(`is_causal=mask is not None`, whisper/model.py:125 in openai-whisper 20250625). Trailing padding and a causal mask block only keys such a
pattern hides anyway, so `mask_honoured` also blocks keys in the past (keys 1..cut, for every query): the layer lets
the later queries see them, and the finding says the mask's content is ignored, only its presence changes the
output, with the fix to use its values; `relative_positions`, whose left padding such a layer attends too, measures
no position through it and says so (a skip naming mask_honoured), never a positional fix.

Each flag layer has its twin on the same weights and inputs: the same layer reading its mask's values passes the
whole audit; float32 and bfloat16, torch's default initialisation and std-0.02 projections (`std_002`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics

WINDOW = 3  # the "window flag" layer's fixed window: a query sees itself and the 2 keys before it


class Masked(nn.Module):
    """Self-attention, mask bool (B, 1, T, T), True = may attend. `reads` says what the layer does with a mask:
    "values" applies it (correct), "causal flag" applies a causal mask whenever one is given (Whisper's
    `is_causal=mask is not None`), "window flag" a fixed window, "nothing" never uses it; `causal`: a causal mask
    of its own, always (and the mask's values with it)."""

    def __init__(self, d_model=16, num_heads=2, reads="values", causal=False):
        super().__init__()
        self.d_model, self.num_heads, self.reads, self.causal = d_model, num_heads, reads, causal
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        i = torch.arange(T, device=x.device).unsqueeze(-1)
        j = torch.arange(T, device=x.device)
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device)  # (Tq, Tk), True = may attend
        if self.causal:
            allowed = allowed & (j <= i)
        if mask is not None:
            if self.reads == "values":
                allowed = allowed & mask
            elif self.reads == "causal flag":
                allowed = allowed & (j <= i)  # the bug: the mask's presence switches causality on, its values unread
            elif self.reads == "window flag":
                allowed = allowed & (j <= i) & (j > i - WINDOW)  # the bug: a fixed window, the mask's values unread
        scores = scores.masked_fill(~allowed, float("-inf"))  # -inf before softmax: blocked keys get exactly 0
        # a query with no key to attend gets weight 0 everywhere, not NaN (as torch's SDPA does)
        weights = torch.where(allowed.any(-1, keepdim=True), scores.softmax(-1), 0.0)  # (B, H, T, T)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))  # (B,H,T,T) x (B,H,T,d) -> (B,T,D)


DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]
INITS = ["default", "std-0.02"]


def build(reads, dtype, init, std_002, causal=False):
    torch.manual_seed(0)  # the same weights for a flag layer and its twin
    layer = Masked(reads=reads, causal=causal)
    if init == "std-0.02":
        std_002(layer)
    return layer.to(dtype)


@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reads", ["causal flag", "window flag"])
def test_a_mask_read_only_as_a_flag_fails_mask_honoured_and_its_twin_passes_the_whole_audit(reads, dtype, init,
                                                                                            std_002):
    report = diagnostics.audit(build(reads, dtype, init, std_002), seed=3)
    found = report.result("mask_honoured")
    assert found.verdict == "fail", str(report)
    assert found.message.startswith("the mask's content is ignored; only its presence changes the output") \
        and "only as a flag" in found.message and "past-key" in found.message, found.message
    assert "with no mask they changed" in found.evidence, found.evidence
    fix, _ = found.remedy
    assert "not `mask is not None`" in fix and "positions=" not in fix, fix
    # pointed at the line that switches the fixed pattern on (its masked_fill), not a positional embedding
    assert found.where and found.where[0].function == "Masked.forward", found.where
    # the finding is mask_honoured's: relative_positions measures no position through a mask it cannot shift with
    assert report.findings[0].detector == "mask_honoured", str(report)
    positions = report.result("relative_positions")
    assert not positions.fired, positions
    twin = diagnostics.audit(build("values", dtype, init, std_002), seed=3)
    assert twin.passed and not twin.fired(), str(twin)
    assert twin.result("mask_honoured").verdict == "pass", twin.result("mask_honoured")
    assert "past-key" in twin.result("mask_honoured").message


@pytest.mark.parametrize("init", INITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_correct_causal_layer_given_padding_masks_passes(dtype, init, std_002):
    """Causal by its own mask and reading the padding's values too, or made causal by the audit's mask: both pass
    the whole causal audit, whose masks are the causal one and padding."""
    for causal in (True, False):
        report = diagnostics.audit(build("values", dtype, init, std_002, causal=causal), causal=True, seed=3)
        assert report.passed and not report.fired(), str(report)
        assert report.result("mask_honoured").verdict == "pass", report.result("mask_honoured")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_causal_audit_takes_the_causal_flag_for_the_declared_causality(dtype, std_002):
    """In a causal audit the causal mask is what the layer was declared to apply, and a layer that switches its own
    on with the mask's presence does what its model asks where the model passes it that mask alone (Whisper's
    decoder, tests/test_zoo.py): no past-key probe there, so it passes, measured (the padding scenario moved no row)."""
    flag = diagnostics.audit(build("causal flag", dtype, "std-0.02", std_002), causal=True, seed=3)
    assert flag.passed and flag.result("mask_honoured").verdict == "pass", str(flag)
    assert "past-key" not in flag.result("mask_honoured").message


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mask_ignored_altogether_is_not_called_a_flag(dtype, std_002):
    """A layer that never uses its mask: the padding moves it, and without a mask it gives the same outputs, so the
    finding is the general one (apply the mask), not the flag's."""
    found = diagnostics.audit(build("nothing", dtype, "std-0.02", std_002), seed=3).result("mask_honoured")
    assert found.verdict == "fail" and "flag" not in found.message and "padding" in found.message, found
    assert "mask is not None" not in found.remedy[0], found.remedy
