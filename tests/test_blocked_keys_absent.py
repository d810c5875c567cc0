"""blocked_keys_absent, and mask_honoured's reading of a softmax renormalised after masking: masks that mask_honoured
alone cannot judge, each bug with its correct twin on the same inputs.

mask_honoured changes the contents of the keys a mask blocks and asks that nothing move. Two bugs keep that
property and still break the mask, and one correct layer broke it under the audit's push:

- the blocked tokens' features zeroed instead of their scores blocked: their contents no longer matter, yet each
  still takes softmax weight (its key and value are the projections' biases);
- another batch row's mask applied to every row (`mask[:1]`, a broadcast over the batch): a row whose own mask keeps
  more keys loses them, which changes nothing mask_honoured changes;
- softmax, then the mask, then the weights renormalised: right in exact arithmetic, but a blocked key pushed 1000x
  takes every weight and the kept ones underflow to 0 / 0. At the inputs' own scale the blocked keys change
  nothing: a warning, not a FAIL; the same softmax masked without renormalising fails at any scale.

blocked_keys_absent compares each padded sequence with the same sequence cut to its length (the padding probe's
lengths differ between batch rows, so a row given another's mask sees the difference). The layers are written unlike
`correct/`: einsum over (B, T, H, d), a memory with a (B, Tk) keep mask, a Hugging Face-style additive mask.
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics._probe import Probe
from diagnostics._subject import make_subject


class KeepCross(nn.Module):
    """Cross-attention over a memory with a keep mask (B, Tk), True = a real token, in (B, T, H, d) with einsum.
    `how` the mask acts: "scores" (blocked before the softmax: correct), "renormalised" (the weights zeroed after
    it and renormalised: correct; "renormalised+eps" over their sum plus 1e-9), "features" (the blocked tokens' features zeroed: a bug), "row0" (row 0's mask for
    every row: a bug), "dropped" (the weights zeroed after the softmax, not renormalised: a bug)."""

    def __init__(self, d_model=16, num_heads=2, how="scores"):
        super().__init__()
        self.h, self.how = num_heads, how
        self.to_q, self.to_kv, self.to_out = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model), \
            nn.Linear(d_model, d_model)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        keep = encoder_attention_mask
        memory = encoder_hidden_states
        if keep is not None and self.how == "features":
            memory = memory * keep[..., None].to(memory.dtype)  # the bug: features zeroed, scores untouched
            keep = None
        if keep is not None and self.how == "row0":
            keep = keep[:1].expand_as(keep)  # the bug: the first sequence's mask for every sequence
        B, T, D = hidden_states.shape
        q = self.to_q(hidden_states).view(B, T, self.h, -1)
        k, v = self.to_kv(memory).view(B, memory.shape[1], 2, self.h, -1).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        if keep is not None and self.how in ("scores", "row0"):
            scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        weights = scores.softmax(-1)
        if keep is not None and self.how in ("renormalised", "renormalised+eps", "dropped"):
            weights = weights * keep[:, None, None, :]
            if self.how == "renormalised":
                weights = weights / weights.sum(-1, keepdim=True)
            elif self.how == "renormalised+eps":
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-9)
        return self.to_out(torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, D))


class AdditiveSelf(nn.Module):
    """Self-attention with a Hugging Face-style additive mask (B, 1, T, T), 0 keep and finfo.min block; `first_row`:
    the bug, the first sequence's mask added to every sequence's scores (`attention_mask[:1]`)."""

    def __init__(self, d_model=16, num_heads=2, first_row=False):
        super().__init__()
        self.h, self.first_row = num_heads, first_row
        self.qkv, self.o_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, hidden_states, attention_mask=None):
        B, T, D = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if attention_mask is not None:
            scores = scores + (attention_mask[:1] if self.first_row else attention_mask)
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, D))


CROSS = {"cross": True, "mask": "key_keep"}


def audit(layer, dtype=torch.float32, init="default", **declared):
    layer = layer.to(dtype).eval()
    if init == "gpt2":
        gpt2_init_(layer)
    return diagnostics.audit(layer, progress=False, **declared)


@pytest.mark.parametrize("bug", ["features", "row0"])
@pytest.mark.parametrize("dtype,init", [(torch.float32, "default"), (torch.bfloat16, "gpt2")])
def test_blocked_keys_that_still_count_fail_and_their_twin_passes(bug, dtype, init):
    """The bugs mask_honoured cannot see, at torch's init in float32 and at std 0.02 in bfloat16: the sequences cut
    to their lengths give other rows. The twin masks the scores: every detector passes (a query with no key to attend
    warns: a plain softmax gives it NaN)."""
    torch.manual_seed(0)
    broken = audit(KeepCross(how=bug), dtype, init, **CROSS)
    found = broken.result("blocked_keys_absent")
    assert broken.status == "failed" and found.verdict == "fail", str(broken)
    assert "rows differ from the sequence cut to" in found.evidence and "not rounding" in found.evidence \
        or dtype == torch.float32, found
    torch.manual_seed(0)
    twin = audit(KeepCross(how="scores"), dtype, init, **CROSS)
    assert twin.status == "passed" and set(twin.fired()) <= {"fully_masked_rows"}, str(twin)  # a row of -inf: NaN
    assert twin.result("blocked_keys_absent").verdict == "pass", twin.result("blocked_keys_absent")


def test_zeroed_features_pass_mask_honoured_so_only_the_cut_sequences_show_them():
    """The blocked tokens' contents cannot move anything once zeroed: mask_honoured passes, and the finding is
    blocked_keys_absent's alone, with the changed rows counted per sequence."""
    torch.manual_seed(0)
    report = audit(KeepCross(how="features"), **CROSS)
    assert report.result("mask_honoured").verdict == "pass", report.result("mask_honoured")
    assert report.fired() == {"blocked_keys_absent": "fail"}, str(report)
    assert report.result("blocked_keys_absent").message.startswith("a padded sequence's rows differ")


@pytest.mark.parametrize("dtype,init", [(torch.float32, "default"), (torch.bfloat16, "gpt2")])
def test_another_rows_additive_mask_fails_and_its_own_passes(dtype, init):
    """The same finding on a self-attention with an additive (B, 1, T, T) mask that reads the first sequence's
    rows for every sequence; the twin reads its own."""
    torch.manual_seed(0)
    broken = audit(AdditiveSelf(first_row=True), dtype, init, mask="additive")
    assert broken.status == "failed" and broken.result("blocked_keys_absent").verdict == "fail", str(broken)
    torch.manual_seed(0)
    twin = audit(AdditiveSelf(), dtype, init, mask="additive")
    assert twin.status == "passed" and set(twin.fired()) <= {"fully_masked_rows"}, str(twin)  # a row of -inf: NaN


def test_a_softmax_renormalised_after_masking_warns_where_only_the_push_moves_it():
    """Right in exact arithmetic: no FAIL. Pushed 1000x, a blocked key takes every weight and the kept ones underflow
    (0 / 0); mask_honoured reads the same scenarios at the inputs' own scale on the layer's float64 copy, where
    nothing moves, and warns with both readings. blocked_keys_absent passes."""
    torch.manual_seed(0)
    report = audit(KeepCross(how="renormalised"), **CROSS)
    honoured = report.result("mask_honoured")
    assert report.status == "passed" and honoured.verdict == "warn", str(report)
    assert "only when pushed 1000x; at the inputs' own scale they change nothing" in honoured.message
    assert "at the inputs' own scale on a float64 copy, 0 / " in honoured.evidence, honoured
    assert "(x1)" in honoured.evidence and "allowed for float64" in honoured.evidence, honoured
    assert report.result("blocked_keys_absent").verdict == "pass"


def test_an_epsilon_in_the_renormalisation_leaves_blocked_keys_a_share_and_fails():
    """`w * m / (w.sum() + 1e-9)`: the blocked keys stay in the normaliser through the epsilon, a 1e-9 share of the
    output (and of the gradient), which float64 reads: mask_honoured and gradients fail, a finding about a real
    dependence, not the push's."""
    torch.manual_seed(0)
    report = audit(KeepCross(how="renormalised+eps"), **CROSS)
    assert report.result("mask_honoured").verdict == "fail", report.result("mask_honoured")
    assert report.result("gradients").verdict == "fail", report.result("gradients")


@pytest.mark.parametrize("dtype,init", [(torch.float32, "default"), (torch.bfloat16, "gpt2")])
def test_the_same_softmax_masked_without_renormalising_fails_at_any_scale(dtype, init):
    """The twin of the test above on the same inputs: the kept weights sum to less than one, so blocked keys move
    the kept rows at the inputs' own scale too, and mask_honoured fails; so does blocked_keys_absent. At std 0.02 in
    bfloat16 that move is below the layer's tolerance unless pushed: the second reading is float64's, whose is not."""
    torch.manual_seed(0)
    report = audit(KeepCross(how="dropped"), dtype, init, **CROSS)
    assert report.result("mask_honoured").verdict == "fail", report.result("mask_honoured")
    assert report.result("blocked_keys_absent").verdict == "fail", report.result("blocked_keys_absent")


class FixedLength(nn.Module):
    """Self-attention with a learned position embedding of exactly `t` positions: it raises at any other length."""

    def __init__(self, d_model=16, t=16):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(t, d_model))
        self.attn = AdditiveSelf(d_model)

    def forward(self, x, attention_mask=None):
        return self.attn(x + self.pos, attention_mask)


def test_a_layer_that_takes_one_length_only_is_not_measured_never_failed():
    torch.manual_seed(0)
    found = audit(FixedLength(), mask="additive", seq_len=16).result("blocked_keys_absent")
    assert found.verdict == "skip" and "raised on the sequences cut to" in found.message, found


class Tokenwise(nn.Module):
    """Takes a mask and mixes no tokens: nothing the padding could reach."""

    def __init__(self, d_model=16):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, attention_mask=None):
        return self.proj(x)


def test_a_layer_the_padding_cannot_reach_is_not_measured_by_the_cut_sequences():
    """Its rows equal the cut sequences' trivially: the control (the same inputs with nothing blocked) moves no
    row, so the agreement proves nothing and the detector says so."""
    found = audit(Tokenwise(), mask="additive").result("blocked_keys_absent")
    assert found.verdict == "skip" and "proves nothing about the mask" in found.message, found


class TokenwiseZeroed(Tokenwise):
    """Mixes no tokens, and zeroes its padded queries' outputs under a keep mask (B, T): only those rows differ with
    a mask that blocks nothing."""

    def forward(self, x, mask=None):
        return self.proj(x) if mask is None else self.proj(x) * mask[..., None]


def test_the_control_reads_the_kept_rows_only():
    """Pin (the control): the padded queries' own rows move when nothing is blocked (their outputs are no longer
    zeroed), but no kept row does: the padding cannot reach them, and the detector says so instead of passing."""
    found = audit(TokenwiseZeroed(), mask="key_keep").result("blocked_keys_absent")
    assert found.verdict == "skip" and "proves nothing about the mask" in found.message, found


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("t", [4, 5, 8, 16, 33])
def test_the_padding_probes_lengths_differ_between_rows(seed, t):
    """From Tk = 4 on (two lengths between Tk // 2 and Tk - 1) each batch row keeps its own number of keys, so
    that a layer reading another row's mask is given one it does not honour; every row keeps key 0."""
    probe = Probe(make_subject(KeepCross(), **CROSS), causal=False, scale=None, seq_len=t, seed=seed)
    pad = probe.padding(probe.BATCH, t, t)
    lengths = pad[:, 0].sum(-1)
    assert len(set(lengths.tolist())) == probe.BATCH, lengths
    assert bool(((lengths >= t // 2) & (lengths <= t - 1)).all()) and bool(pad[:, :, 0].all())
    assert bool((pad == pad[:, :1]).all())  # the same keys for every query of a row


class RenormalisedPooled(KeepCross):
    """The renormalised softmax (correct) beside a branch that pools every memory token, the mask never read there:
    the padding reaches each output at any scale (a bug)."""

    def __init__(self):
        super().__init__(how="renormalised")

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        pooled = encoder_hidden_states.mean(1, keepdim=True)  # the bug: padded tokens pooled too
        return super().forward(hidden_states, encoder_hidden_states, encoder_attention_mask) + 0.1 * pooled


def test_a_renormalised_softmax_whose_padding_also_leaks_at_the_inputs_own_scale_fails():
    """The warning's twin (pin: `_pushed_only` reads the held rows at gain 1 and names no warning where they move):
    pushed, its held rows go non-finite as the correct one's do, but at the inputs' own scale they move too."""
    torch.manual_seed(0)
    report = audit(RenormalisedPooled(), **CROSS)
    assert report.result("mask_honoured").verdict == "fail", report.result("mask_honoured")


class Pooled(nn.Module):
    """Attention pooling: one output per sequence, (B, D), the mask over its tokens honoured."""

    def __init__(self, d_model=16):
        super().__init__()
        self.inner = AdditiveSelf(d_model)

    def forward(self, x, attention_mask=None):
        return self.inner(x, attention_mask).mean(1)


class ChannelsFirst(AdditiveSelf):
    """Returns (B, D, T): no row per token along the time axis the audit reads."""

    def forward(self, hidden_states, attention_mask=None):
        return super().forward(hidden_states, attention_mask).transpose(1, 2)


class FixedRows(AdditiveSelf):
    """Pads its output to 16 rows whatever the length: the cut sequences' outputs have no row per token."""

    def forward(self, hidden_states, attention_mask=None):
        out = super().forward(hidden_states, attention_mask)
        return torch.nn.functional.pad(out, (0, 0, 0, 16 - out.shape[1]))


class Silent(AdditiveSelf):
    """Returns zeros of the queries' shape: no change can be measured against it."""

    def forward(self, hidden_states, attention_mask=None):
        return torch.zeros_like(hidden_states)


@pytest.mark.parametrize("layer, t, says", [
    (Pooled, 16, "has no row per query and batch element (see output_shape)"),
    (ChannelsFirst, 12, "has no row per query and batch element (see output_shape)"),  # (B, 16, 12): 16 is no T
    (FixedRows, 16, "of the sequences cut to"),
    (Silent, 16, "zero or non-finite everywhere"),
], ids=["pooled", "channels first", "fixed rows", "zeros"])
def test_outputs_without_rows_to_compare_are_not_measured(layer, t, says):
    """Pins (the shape guards of check_blocked_keys_absent): an output with no row per token, of the padded call or
    of a cut one, or one with nothing to measure against, is a skip that says so, never a comparison of other axes."""
    torch.manual_seed(0)
    found = audit(layer(), mask="additive", seq_len=t).result("blocked_keys_absent")
    assert found.verdict == "skip" and says in found.message, found


def test_at_two_tokens_both_sequences_keep_one_key_and_are_named_together():
    """Pin (the evidence's plural): below seq_len 4 the lengths may coincide; at 2 both rows keep key 0 alone, one
    cut call serves both, and the evidence names them together."""
    torch.manual_seed(0)
    found = audit(KeepCross(), seq_len=2, **CROSS).result("blocked_keys_absent")
    assert found.verdict == "pass" and "sequences 0, 1 (1 of 2 keys kept): 0 / 2 rows differ" in found.evidence, found


def test_the_evidence_counts_the_rows_that_differ_per_sequence():
    """Pin (the counts and the plural of the evidence): the twin's rows differ nowhere, the bug's everywhere, each
    sequence named with the keys it keeps."""
    torch.manual_seed(0)
    twin = audit(KeepCross(), **CROSS).result("blocked_keys_absent")
    torch.manual_seed(0)
    bug = audit(KeepCross(how="features"), **CROSS).result("blocked_keys_absent")
    assert re.findall(r"sequence (\d) \((\d+) of 16 keys kept\): 0 / \2 rows differ", twin.evidence), twin.evidence
    assert re.findall(r"sequence (\d) \((\d+) of 16 keys kept\): \2 / \2 rows differ", bug.evidence), bug.evidence
    assert "sequences" not in twin.evidence  # one sequence per length: the lengths differ


def _line_of(text: str) -> int:
    """The line of this file that holds `text` (KeepCross's code)."""
    lines, start = inspect.getsourcelines(KeepCross)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("how, first, then", [
    ("features", "memory = memory * keep", "weights = scores.softmax(-1)"),
    ("row0", "keep = keep[:1].expand_as(keep)", "scores = scores.masked_fill(~keep"),
], ids=["features zeroed", "row 0's mask"])
def test_its_finding_points_at_the_line_that_breaks_the_mask_and_its_twin_has_none(how, first, then):
    """The line that makes the wrong value first (the features zeroed; the mask's rows cut to the first), then the
    op that consumes it (the softmax that no mask reaches; the fill with row 0's mask); before, `unlocated`. The
    correct twin on the same inputs: no finding."""
    torch.manual_seed(0)
    found = diagnostics.audit(KeepCross(how=how), progress=False, **CROSS).result("blocked_keys_absent")
    assert found.verdict == "fail", found
    lines = [site.line for site in found.where]
    assert lines[0] == _line_of(first) and _line_of(then) in lines[1:], [site.describe() for site in found.where]
    assert found.where[0].fix, found.where[0]
    torch.manual_seed(0)
    twin = diagnostics.audit(KeepCross(), progress=False, **CROSS).result("blocked_keys_absent")
    assert twin.verdict == "pass" and not twin.where, twin


class PaddedSelf(nn.Module):
    """Self-attention over (B, T, H, d) with a key padding mask (B, T), True = padding, written five ways:
    `features`: the padded tokens' features zeroed as well (harmless where the scores block them too; the bug where
    they do not, `scores=False`); `row0`: the bug, row 0's mask for every sequence, taken as `mask[:1]` before or
    after a shared mask of ones (`shared_first`); `per_sequence`: each sequence attended apart, by its own row;
    `mean_values`: the bug, the mean of every value (the padded ones too) added to each."""

    def __init__(self, d_model=32, num_heads=2, *, features=False, scores=True, row0=False, shared_first=False,
                 per_sequence=False, mean_values=False):
        super().__init__()
        self.h, self.features, self.scores, self.row0, self.mean_values = num_heads, features, scores, row0, mean_values
        self.shared_first, self.per_sequence = shared_first, per_sequence
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.register_buffer("shared", torch.ones(1, 1, 1, 64, dtype=torch.bool))

    def attend(self, x, keep):
        B, T, D = x.shape
        if self.features:
            x = x * keep[..., None].to(x.dtype)  # the padded tokens' features zeroed
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).unbind(2)
        if self.mean_values:
            v = v + v.mean(1, keepdim=True)  # the bug: the mean of every value, the padded ones too, in each
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // self.h)
        if self.scores:
            pad = keep[:1, None, None, :] if self.row0 else keep[:, None, None, :]  # the bug: row 0's for all
            shared = self.shared[..., :T]
            s = s.masked_fill(~(shared & pad if self.shared_first else pad & shared), float("-inf"))
        return self.out(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, D))

    def forward(self, hidden_states, key_padding_mask=None):
        keep = ~key_padding_mask
        if not self.per_sequence:
            return self.attend(hidden_states, keep)
        return torch.cat([self.attend(hidden_states[b:b + 1], keep[b:b + 1]) for b in range(keep.shape[0])])


def _sites(**kw) -> tuple[str, list]:
    torch.manual_seed(0)
    found = diagnostics.audit(PaddedSelf(**kw), progress=False, detectors=["blocked_keys_absent"]).result(
        "blocked_keys_absent")
    lines, start = inspect.getsourcelines(PaddedSelf)
    return found.verdict, [lines[site.line - start].strip() for site in found.where]


@pytest.mark.parametrize("shared_first", [False, True], ids=["mask & shared", "shared & mask"])
def test_the_row_picker_is_named_first_whichever_operand_it_is(shared_first):
    verdict, sites = _sites(row0=True, shared_first=shared_first)
    assert verdict == "fail" and sites[0].startswith("pad = keep[:1, None, None, :]"), sites
    assert _sites(shared_first=shared_first)[0] == "pass"  # the twin, each row by its own mask


def test_features_zeroed_beside_masked_scores_are_not_named_for_another_bug():
    """The scores are masked, so zeroing the features too is harmless: the row-0 bug's line leads, not theirs."""
    verdict, sites = _sites(features=True, row0=True)
    assert verdict == "fail" and sites[0].startswith("pad = keep[:1") and not any(
        s.startswith("x = x * keep") for s in sites), sites
    assert _sites(features=True)[0] == "pass"


@pytest.mark.parametrize("d_model", [16, 32], ids=["width = seq_len", "width 32"])
def test_features_zeroed_with_no_mask_on_the_scores_are_named_first_at_any_width(d_model):
    """(B, T, D) with D = T = 16 is shaped like scores; it is named because no op masks the scores at all."""
    verdict, sites = _sites(d_model=d_model, features=True, scores=False)
    assert verdict == "fail" and sites[0].startswith("x = x * keep"), sites


def test_a_sequence_masked_by_its_own_row_in_a_loop_is_no_row_picker():
    """`keep[b:b + 1]` for sequence b alone is that sequence's own mask: with the row-0 bug absent nothing fails, and
    the loop's slices are never named (the review's layer had them named for an unrelated bug)."""
    verdict, sites = _sites(per_sequence=True, features=True, scores=False)
    assert verdict == "fail" and not any("keep[b:b + 1]" in s for s in sites), sites
    assert _sites(per_sequence=True)[0] == "pass"


@pytest.mark.parametrize("per_sequence", [True, False], ids=["a loop over the sequences", "the batch at once"])
def test_a_loop_over_the_sequences_is_read_by_row_and_its_masks_are_not_blamed_for_another_bug(per_sequence):
    """Each fill of the loop masks its own sequence: none is read against another's mask (before, sequence 0's fill
    was said to block pairs sequence 1 may attend, and later sequences' fills came after "the" softmax). The bug, the
    padded values' mean in every value, fails either way; no site blames the mask."""
    verdict, sites = _sites(per_sequence=per_sequence, mean_values=True)
    assert verdict == "fail", sites
    torch.manual_seed(0)
    found = diagnostics.audit(PaddedSelf(per_sequence=per_sequence, mean_values=True), progress=False,
                              detectors=["blocked_keys_absent", "mask_honoured"])
    notes = [site.note for r in found.findings for site in r.where]
    assert not any("may be attended" in n or "after the softmax" in n for n in notes), notes


class CausalPadded(nn.Module):
    """Causal self-attention, GPT-2's way (a lower-triangular buffer, sliced; `is_causal` says it builds it), with a
    key padding mask (B, T), 1 = keep, combined with it; `row`: the bug, that batch row's mask for every sequence
    (`mask[:1]`, `mask[-1:]`)."""

    is_causal = True

    def __init__(self, d_model=16, num_heads=2, row=None):
        super().__init__()
        self.h, self.row = num_heads, row
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.register_buffer("bias", torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64))

    def forward(self, x, attention_mask):
        B, T, D = x.shape
        keep = attention_mask.bool()
        keep = keep if self.row is None else keep[self.row:][:1]  # the bug: one row's mask for all
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).unbind(2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D // self.h)
        s = s.masked_fill(~(self.bias[:, :, :T, :T] & keep[:, None, None, :]), float("-inf"))
        return self.out(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, D))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("row", [None, 0, -1], ids=["correct", "row 0's mask", "the last row's mask"])
def test_in_a_causal_audit_a_row_given_either_end_rows_mask_fails_and_its_twin_passes(row, seed):
    """A causal row's kept rows never see its trailing keys, so a row given a longer row's mask shows nothing: with
    two rows, one of `mask[:1]` and `mask[-1:]` hid at every draw of the lengths. The batch reversed gives each row
    the other's place, and both bugs fail at every seed; the correct twin passes on the same inputs."""
    torch.manual_seed(0)
    found = diagnostics.audit(CausalPadded(row=row), progress=False, causal=True, mask="key_keep", seed=seed,
                              detectors=["blocked_keys_absent"]).result("blocked_keys_absent")
    assert found.verdict == ("pass" if row is None else "fail"), found


@pytest.mark.parametrize("row", [None, 0, -1], ids=["correct", "row 0's mask", "the last row's mask"])
def test_the_reversed_batch_reads_the_same_at_std_0_02_in_bfloat16(row):
    torch.manual_seed(0)
    layer = CausalPadded(row=row)
    gpt2_init_(layer)
    found = diagnostics.audit(layer.to(torch.bfloat16), progress=False, causal=True, mask="key_keep",
                              dtype=torch.bfloat16, detectors=["blocked_keys_absent"]).result("blocked_keys_absent")
    assert found.verdict == ("pass" if row is None else "fail"), found


def test_the_reversed_batch_gives_each_sequence_the_others_length():
    """The perturbation changed what it claims: in the reversed reading each batch row holds the other's sequence
    and length (the evidence lists both orders, the lengths swapped), and only a causal audit reads it."""
    torch.manual_seed(0)
    found = diagnostics.audit(CausalPadded(), progress=False, causal=True, mask="key_keep",
                              detectors=["blocked_keys_absent"]).result("blocked_keys_absent")
    plain = re.findall(r"sequence (\d) \((\d+) of \d+ keys kept\)", found.evidence)
    flipped = re.findall(r"sequence (\d) \((\d+) of \d+ keys kept, the batch reversed\)", found.evidence)
    assert len(plain) == 2 and {(str(1 - int(b)), n) for b, n in plain} == set(flipped), found.evidence
    assert len({n for _, n in plain}) == 2, found.evidence  # the two lengths differ
    torch.manual_seed(0)
    not_causal = diagnostics.audit(KeepCross(), progress=False, **CROSS, detectors=["blocked_keys_absent"])
    assert "the batch reversed" not in not_causal.result("blocked_keys_absent").evidence
