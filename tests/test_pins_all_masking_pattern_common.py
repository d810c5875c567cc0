"""Pins for the survivors of the full mutation run over mask_honoured / fully_masked_rows, attention_pattern and the
detectors' shared endings (issue 37: `benchmarks/mutations.py --all --only detectors/masking.py`, then
`--only detectors/pattern.py` and `--only detectors/_common.py`, at ff5444f). As in tests/test_pins.py, each pin has
its twin on the same inputs (a case on each side of the comparison, guard or branch it pins), the numbers quoted as
literals; each test says which mutant it pins (its line number the run's, at ff5444f). Small layers written here, one
detector at small sizes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import diagnostics


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


# ---- mask_honoured: read_as_flag ------------------------------------------------------------------------------------


class Flagged(nn.Module):
    """Self-attention (16 wide, 2 heads, seed 0), mask bool (B, 1, T, T), True = may attend. `reads`: "values" applies
    the mask (correct); "causal flag" applies a causal mask whenever one is given, its values unread (Whisper's
    `is_causal=mask is not None`); `needs_mask`: a call without a mask raises."""

    def __init__(self, reads: str, needs_mask: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.reads, self.needs_mask, self.num_heads = reads, needs_mask, 2
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        if mask is None and self.needs_mask:
            raise ValueError("this layer needs a mask")
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
        allowed = torch.ones(T, T, dtype=torch.bool)  # (Tq, Tk)
        if mask is not None:
            allowed = allowed & (mask if self.reads == "values" else j <= i)
        scores = scores.masked_fill(~allowed, float("-inf"))  # -inf before softmax: blocked keys get exactly 0
        weights = torch.where(allowed.any(-1, keepdim=True), scores.softmax(-1), 0.0)  # (B, H, T, T)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))  # (B,H,T,T) x (B,H,T,d) -> (B,T,D)


def _past_hidden(b, h, q, kv):
    """A declared pattern that already blocks keys 1..7 (the past-key scenario's, at T = 16) for every query."""
    return (kv == 0) | (kv > 7)


def test_a_past_key_mask_the_declared_pattern_already_holds_is_no_evidence_of_a_flag():
    """read_as_flag's `if bool((opened == blocked).all()): continue` (L187, Eq->NotEq): under a pattern that blocks
    keys 1..7 for every query, the past-key mask adds nothing to what the audit passes, so the opened mask is the
    blocked one and its call proves nothing: the causal-flag layer fails (it lets later queries see keys 1..7) with
    the general finding, not the flag's (`!=` read the same mask twice and, no mask giving other outputs, said flag).
    Its twin, the layer reading the mask's values, passes on the same inputs."""
    found = verdict(Flagged("causal flag"), "mask_honoured", pattern=_past_hidden)
    assert found.verdict == "fail" and "past-key" in found.message and "flag" not in found.message, found
    assert not found.extras.get("read_as_flag"), found
    assert verdict(Flagged("values"), "mask_honoured", pattern=_past_hidden).verdict == "pass"


def test_a_flag_layer_that_raises_without_a_mask_is_not_called_a_flag():
    """read_as_flag's `if not all(c.ok and shape == ... for c in calls)` (L193, all->any and and->or): the causal-flag
    layer that raises when called without a mask fails on the past-key mask, and the flag, which rests on the call
    without a mask, is not claimed (`any` went on with the failed call, `or` read its missing output: the detector
    raised). Its twin, the same layer reading the mask's values, passes."""
    found = verdict(Flagged("causal flag", needs_mask=True), "mask_honoured")
    assert found.verdict == "fail" and "past-key" in found.message and "flag" not in found.message, found
    assert verdict(Flagged("values", needs_mask=True), "mask_honoured").verdict == "pass"


class Gated(Flagged):
    """`Flagged` whose output, given a mask, is zero in each sequence whose inputs stay within 100 in size: the probe's
    baseline and an opened mask's call give zeros everywhere, a key pushed 1000x opens its sequence."""

    def forward(self, x, mask=None):
        out = super().forward(x, mask)  # (B, T, D)
        return out if mask is None else out * (x.abs().amax(dim=(1, 2), keepdim=True) > 100)


def test_a_flag_is_not_read_from_an_opened_mask_whose_outputs_are_zero_everywhere():
    """read_as_flag's `if same is None or switched is None` (L197, or->and): the gated layer fails (its held rows open
    with the pushed keys), and its baseline and its call with an opened mask are zero everywhere, so that the two
    cannot be compared (`same` is None) while the call without a mask can: no flag is claimed (`and` read the
    missing comparison: the detector raised). Its twin, the layer without the gate, passes on the same inputs."""
    found = verdict(Gated("causal flag"), "mask_honoured")
    assert found.verdict == "fail" and "padding" in found.message and "flag" not in found.message, found
    assert verdict(Flagged("causal flag"), "mask_honoured").message.startswith("the mask's content is ignored")
    assert verdict(Flagged("values"), "mask_honoured").verdict == "pass"


def test_the_padding_stack_holds_no_mask_honoured_copies_at_one_token():
    """padded_key_cases' `if probe.t < 2 or not takes_mask` (L285, or->and): at one token mask_honoured does not
    apply, and weight_row_sums reads the padding stack's baseline alone: its call is the 2 sequences of the batch (the
    blocked-key copy and the key-0 control made it 6). Its twin, two tokens, the same function: the stack holds
    mask_honoured's two copies (6 sequences); both pass."""
    batches = []

    def attention(q, k, v, mask=None):
        batches.append(q.shape[0])
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
        weights = scores.softmax(-1)
        return weights @ v, weights  # (B, H, Tq, d)

    for seq_len, stacked in ((1, 2), (2, 6)):
        batches.clear()
        found = verdict(attention, "weight_row_sums", seq_len=seq_len)
        assert found.verdict == "pass" and batches == [2, stacked], (seq_len, found, batches)
