"""`relative_positions`: the two rotary mistakes of "the world's attention layers" class 10, written in this
project's own code, each caught and located, and its correct twin (the same class, seed and weights, the step done
right) passing on the same inputs; correct rotary (both pairings), ALiBi and T5-bucket layers pass; a layer without
positions is not applicable; absolute positions inside the layer fail undeclared and are not applicable declared; a
rotary layer with no mask argument is a visible skip that says what would make it measurable.

Every layer here works on (B, T, H, d) internally, as flash-attn-style code does, so that "the head axis" is a real
axis next to the time axis.
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics._guard import seed_rng
from diagnostics.detectors import positions

DET = "relative_positions"


def frequencies(d: int) -> torch.Tensor:
    return 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # (d/2,)


def rotate(x: torch.Tensor, pairing: str, bug: str | None, start: int = 0) -> torch.Tensor:
    """x (B, T, H, d) turned by its position along T. `pairing`: "half" (pairs (m, m + d/2)) or "interleaved"
    (pairs (2m, 2m+1)); the cos/sin table is laid out to match, except under the bugs. Positions start at `start`."""
    T, d = x.shape[1], x.shape[-1]  # x: (B, T, H, d)
    angles = torch.arange(start, start + T, dtype=torch.float32).unsqueeze(-1) * frequencies(d)  # (T, d/2)
    if pairing == "interleaved" and bug != "table half-split":
        table = angles.repeat_interleave(2, dim=-1)  # (T, d): (θ0, θ0, θ1, θ1, ...), one angle per pair
    else:
        table = torch.cat([angles, angles], dim=-1)  # (T, d): (θ0, θ1, ..., θ0, θ1, ...)  # BUG table half-split
    cos, sin = table.cos()[:, None, :].to(x.dtype), table.sin()[:, None, :].to(x.dtype)  # (T, 1, d)
    if bug == "head axis":
        x1, x2 = x.chunk(2, dim=2)  # BUG head axis: pairs made across heads, (B, T, H/2, d) each
        turned = torch.cat([-x2, x1], dim=2)
    elif pairing == "interleaved":
        turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    return x * cos + turned * sin


class PositionalAttention(nn.Module):
    """Multi-head self-attention on (B, T, D) with positions inside: `kind` "rotary" (with `pairing`), "alibi"
    (-slope_h * |i - j| added to the scores), "t5" (a learned bias per bucket of j - i) or "absolute" (a learned
    embedding added to the input, absolute by design), or None. `bug`: "table half-split" (interleaved pairs, a
    half-split cos/sin table) or "head axis" (pairs made over the head axis). `mask`: bool (B, 1, T, T), True = may
    attend."""

    def __init__(self, d_model=16, num_heads=2, kind="rotary", pairing="half", bug=None, takes_mask=True):
        super().__init__()
        self.d_model, self.num_heads, self.kind, self.pairing, self.bug = d_model, num_heads, kind, pairing, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        if kind == "t5":
            self.buckets = nn.Embedding(2 * 15 + 1, num_heads)  # j - i clamped to [-15, 15]
        if kind == "absolute":
            self.position = nn.Embedding(64, d_model)
        if not takes_mask:
            self.forward = self.forward_without_mask

    def forward(self, x, mask=None):
        B, T, D = x.shape
        if self.kind == "absolute":
            x = x + self.position(torch.arange(T, device=x.device))  # (B, T, D): position t's own vector
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)  # (B, T, H, d) each
        if self.kind == "rotary":
            q, k = rotate(q, self.pairing, self.bug), rotate(k, self.pairing, self.bug)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B, H, T, T)
        i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
        if self.kind == "alibi":
            slopes = 2.0 ** (-8.0 * torch.arange(1, self.num_heads + 1) / self.num_heads)  # (H,)
            sign = -1 if self.bug == "alibi sign" else 1  # BUG alibi sign: far keys rewarded
            scores = scores - sign * slopes.view(-1, 1, 1).to(scores.dtype) * (i - j).abs().to(scores.dtype)
        if self.kind == "t5":
            if self.bug == "key position":  # BUG key position: the key's own position, not the distance
                bucket = j.clamp(max=15) + 15
            elif self.bug == "one-sided":  # BUG one-sided: every key after the query in the query's own bucket
                bucket = (j - i).clamp(-15, 0) + 15
            elif self.bug == "one past self":  # BUG one past self: every key after the query in one bucket
                bucket = (j - i).clamp(-15, 1) + 15
            else:
                bucket = (j - i).clamp(-15, 15) + 15
            scores = scores + self.buckets(bucket.expand(T, T)).permute(2, 0, 1)  # (H, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        y = scores.softmax(-1) @ v  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))

    def forward_without_mask(self, x):
        return PositionalAttention.forward(self, x)


def build(dtype=torch.float32, init="default", seed=0, **kw) -> PositionalAttention:
    seed_rng(seed)
    layer = PositionalAttention(**kw)
    if init == "gpt2":
        gpt2_init_(layer, seed=seed)
    return layer.to(dtype)


SETTINGS = [(dtype, init) for dtype in (torch.float32, torch.bfloat16) for init in ("default", "gpt2")]
BUGS = {"table half-split": {"pairing": "interleaved"}, "head axis": {"pairing": "half"}}


def ids(x):
    return str(x).replace("torch.", "")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, init", SETTINGS, ids=ids)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_rotary_mistake_is_caught(bug, dtype, init, causal):
    report = diagnostics.audit(build(dtype, init, bug=bug, **BUGS[bug]), causal=causal, detectors=[DET])
    result = report.result(DET)
    assert result.verdict == "fail" and "absolute positions" in result.message, str(report)
    assert result.value > 3 * result.threshold, result.evidence  # far past rounding (see MEASURED for the margins)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, init", SETTINGS, ids=ids)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_its_correct_twin_passes(bug, dtype, init, causal):
    """The same class, pairing, seed and setting, the rotation done right: the same inputs, a pass."""
    report = diagnostics.audit(build(dtype, init, **BUGS[bug]), causal=causal, detectors=[DET])
    assert report.result(DET).verdict == "pass", str(report)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_finding_points_at_the_rotation(bug):
    result = diagnostics.audit(build(bug=bug, **BUGS[bug]), detectors=[DET]).result(DET)
    lines = [site.line for site in result.where if site.file == __file__]
    source, first = inspect.getsourcelines(rotate)
    rotation = range(first, first + len(source))
    assert lines and lines[0] in rotation, [s.describe() for s in result.where]


def flash_style(bug=None):
    """A function on (B, T, H, d) tensors (flash-attn's layout, audited with layout="bthd") that rotates q and k
    itself, half-split pairs, over the head axis under `bug`; the queries are the last Tq of the Tk positions."""
    def attention(q, k, v, mask=None):
        d, t_q, t_k = q.shape[-1], q.shape[1], k.shape[1]
        q, k = rotate(q, "half", bug, start=t_k - t_q), rotate(k, "half", bug)  # (B, T, H, d)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)  # (B, Tq, H, d)
    return attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bug", [None, "head axis"])
def test_a_function_on_bthd_tensors_rotated_over_its_head_axis_fails_and_its_twin_passes(bug, causal):
    report = diagnostics.audit(flash_style(bug), layout="bthd", causal=causal, num_heads=2, d_model=16)
    assert report.result(DET).verdict == ("fail" if bug else "pass"), str(report)
    assert report.passed == (bug is None), str(report)


CORRECT = {"rotary, half-split": {"kind": "rotary"}, "rotary, interleaved": {"kind": "rotary", "pairing": "interleaved"},
           "alibi": {"kind": "alibi"}, "t5 buckets": {"kind": "t5"}}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, init", SETTINGS, ids=ids)
@pytest.mark.parametrize("name", sorted(CORRECT))
def test_relative_layers_pass(name, dtype, init, causal):
    report = diagnostics.audit(build(dtype, init, **CORRECT[name]), causal=causal, detectors=[DET])
    assert report.result(DET).verdict == "pass", str(report)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_relative_layers_audit_clean(name):
    report = diagnostics.audit(build(**CORRECT[name]), causal=True)
    assert report.passed and report.result(DET).verdict == "pass", str(report)


@pytest.mark.parametrize("bug", [None, "key position"])
def test_a_bias_by_absolute_key_position_fails_and_by_distance_passes(bug):
    """T5-style buckets of the key's own position instead of j - i: the same class, seed and inputs."""
    result = diagnostics.audit(build(kind="t5", bug=bug), detectors=[DET]).result(DET)
    assert result.verdict == ("fail" if bug else "pass"), str(result)
    if bug:
        site = result.where[0]  # the line that adds the bias to the scores, with the bias's own fix
        assert site.file == __file__ and "self.buckets" in site.code and "j - i" in result.remedy[0], site.describe()


@pytest.mark.parametrize("dtype, init", SETTINGS, ids=ids)
@pytest.mark.parametrize("bug", [None, "one-sided"], ids=["two-sided", "one-sided"])
def test_one_sided_buckets_in_a_bidirectional_layer_fail_and_two_sided_pass(bug, dtype, init):
    """x-transformers 0.6.6's T5 buckets (benchmarks/pypi_bugs.py, xtr_rel_pos_bucket_direction) in our own code: a
    bidirectional layer given the causal form, every key after its query in the query's own bucket. Its bias is still
    a function of j - i, so no shift moves it; on identical tokens its later keys all score as the query itself while
    the earlier ones differ. The same class, seed and inputs with two-sided buckets pass."""
    result = diagnostics.audit(build(dtype, init, kind="t5", bug=bug), detectors=[DET]).result(DET)
    assert result.verdict == ("fail" if bug else "pass"), str(result)
    if bug:
        assert "not those after it" in result.message and result.value == 0.0, result.message
        branch, site = result.where[:2]  # the branch the one-sided buckets were made in, then their clamp
        assert branch.code.startswith('elif self.bug == "one-sided":'), branch.describe()
        assert site.file == __file__ and "clamp(-15, 0)" in site.code, site.describe()


def test_later_keys_sharing_a_bucket_of_their_own_fail_too():
    """The query is left out of both sides: later keys all in bucket +1 (not the query's 0) are one-sided as well."""
    result = diagnostics.audit(build(kind="t5", bug="one past self"), detectors=[DET]).result(DET)
    assert result.verdict == "fail" and "not those after it" in result.message, str(result)


class LookAhead(PositionalAttention):
    """Bidirectional ALiBi with slopes of its own for the keys ahead, learned, initialised at `ahead` (0: one-sided
    at its initialisation only, by design; it learns the other side)."""

    def __init__(self, ahead: float):
        super().__init__(kind=None)
        self.ahead = nn.Parameter(torch.full((self.num_heads,), ahead))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B, H, T, T)
        distance = (torch.arange(T) - torch.arange(T).unsqueeze(-1)).to(scores.dtype)  # (T, T): j - i
        back = 2.0 ** -torch.arange(1, self.num_heads + 1, dtype=scores.dtype)  # (H,)
        behind, ahead = (-distance).clamp(min=0), distance.clamp(min=0)  # (T, T): how far back, how far ahead
        scores = scores - back.view(-1, 1, 1) * behind - self.ahead.view(-1, 1, 1) * ahead
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("ahead", [0.0, 1 / 64])
def test_a_look_ahead_at_zero_or_small_is_no_one_sided_finding(ahead, dtype):
    """A learned look-ahead slope at 0 is one-sided at initialisation only (the float64 copy reads it again with its
    all-zero parameters drawn); one at 1/64 of the look-back slope reads flat in bfloat16's rounding alone (read again
    in float64): neither fails. The float64 reading is made, with the zero slope drawn where it is zero (its probe
    says so); in float32 a slope of 1/64 is no one-sided reading at all, and no float64 pass is made."""
    seed_rng(0)
    result = diagnostics.audit(LookAhead(ahead).to(dtype), detectors=[DET]).result(DET)
    assert result.verdict == "pass", str(result)
    read_again = [p.label for p in result.probes if p.label.startswith("float64 copy")]
    if ahead == 0.0:
        assert read_again == ["float64 copy: 12 identical tokens, ahead drawn"], read_again
    else:
        assert read_again == (["float64 copy: 12 identical tokens"] if dtype == torch.bfloat16 else []), read_again


class TokenShift(PositionalAttention):
    """No mask argument, and half of each key's features from the token before it (an RWKV-style token shift, zero
    before the first): on identical tokens only key 0 differs, an edge of the sequence, no position of j - i."""

    def __init__(self):
        super().__init__(kind=None, takes_mask=False)

    def forward_without_mask(self, x):
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
        half = x.shape[-1] // 2
        return PositionalAttention.forward(self, torch.cat([x[..., :half], shifted[..., half:]], -1))


def test_an_edge_of_the_sequence_is_no_one_sided_position():
    """The varying side must be a function of j - i (`RELATIVE_ONLY`): a token shift's zero before the first token
    varies with the row, and the layer without a mask stays the skip that says no shift is possible."""
    seed_rng(0)
    result = diagnostics.audit(TokenShift(), detectors=[DET]).result(DET)
    assert result.verdict == "skip" and "no shift of its positions is possible" in result.message, str(result)


def test_one_sided_buckets_audited_as_causal_pass():
    """Where the one-sided form is right, a causal layer (its later keys are blocked), the same layer passes."""
    result = diagnostics.audit(build(kind="t5", bug="one-sided"), causal=True, detectors=[DET]).result(DET)
    assert result.verdict == "pass", str(result)


class BucketsByFlag(PositionalAttention):
    """T5 buckets chosen by a flag, as x-transformers builds them: the causal form where `causal`, the bidirectional
    one otherwise; `swapped` tests the flag the wrong way round (x-transformers 0.6.6's `if causal:` for `if not
    causal:`), so this bidirectional layer gets the causal form."""

    def __init__(self, swapped: bool):
        super().__init__(kind=None)
        self.causal, self.swapped = False, swapped
        self.buckets = nn.Embedding(2 * 15 + 1, self.num_heads)

    def bias(self, T):
        distance = torch.arange(T) - torch.arange(T).unsqueeze(-1)  # (T, T): j - i
        if self.causal != self.swapped:
            bucket = distance.clamp(-15, 0) + 15  # the causal form: every later key in the query's bucket
        else:
            bucket = distance.clamp(-15, 15) + 15
        return self.buckets(bucket).permute(2, 0, 1)  # (H, T, T)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads) + self.bias(T)  # (B, H, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("swapped", [False, True])
def test_the_flag_that_chose_the_one_sided_form_is_the_first_site(swapped):
    """The site of a one-sided bias is the `if` that chose it (`_tracing.branch_of`), then the clamp; its twin with
    the flag tested the right way passes."""
    seed_rng(0)
    result = diagnostics.audit(BucketsByFlag(swapped), detectors=[DET]).result(DET)
    assert result.verdict == ("fail" if swapped else "pass"), str(result)
    if swapped:
        first, second = result.where[:2]
        assert first.code == "if self.causal != self.swapped:" and "else branch" not in first.note, first.describe()
        assert "clamp(-15, 0)" in second.code, second.describe()


class LoggedBuckets(BucketsByFlag):
    """One-sided buckets made in the `if` branch of a debugging flag, whose other branch sets another attribute: no
    branch chose between two ways of making the buckets (`_tracing.branch_of` counts plain names only)."""

    def __init__(self):
        super().__init__(swapped=False)
        self.debug = True

    def bias(self, T):
        if self.debug:
            bucket = (torch.arange(T) - torch.arange(T).unsqueeze(-1)).clamp(-15, 0) + 15  # BUG: the causal form
            self.last_buckets = bucket  # kept for plotting
        else:
            self.skipped = 1
        return self.buckets(self.last_buckets).permute(2, 0, 1)


def test_an_if_that_chose_nothing_is_no_site():
    seed_rng(0)
    result = diagnostics.audit(LoggedBuckets(), detectors=[DET]).result(DET)
    assert result.verdict == "fail" and "clamp(-15, 0)" in result.where[0].code, result.where


class KeyMaskBuckets(BucketsByFlag):
    """BucketsByFlag as x-transformers 0.6.6's Attention writes it: a (B, T) key mask, True = keep, filled into the
    scores in place (`dots.masked_fill_`), after which the scores' producer is the fill, not the sum with the bias."""

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        dots = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads) + self.bias(T)  # (B, H, T, T)
        if mask is not None:
            dots.masked_fill_(~mask[:, None, None, :], float("-inf"))
        return self.out((dots.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def test_a_key_mask_layers_one_sided_buckets_are_sited_at_the_flag():
    """The site is read from what reaches the scores forward (`positions._reaches_scores`): walked back from the
    softmax, an in-place fill hid the bias behind it, and the finding had no site."""
    seed_rng(0)
    result = diagnostics.audit(KeyMaskBuckets(swapped=True), mask="key_keep", detectors=[DET]).result(DET)
    assert result.verdict == "fail", str(result)
    assert result.where and result.where[0].code == "if self.causal != self.swapped:", result.where


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("dtype, init", SETTINGS, ids=ids)
@pytest.mark.parametrize("bug", [None, "alibi sign"], ids=["correct", "sign flipped"])
def test_an_alibi_bias_that_rewards_distance_fails_and_its_twin_passes(bug, dtype, init, causal):
    """ALiBi's slopes with the wrong sign (attention-gym#86): still relative, so the shift cannot see it; on identical
    tokens the scores are a line in |i - j| whose slope must be negative in every head."""
    result = diagnostics.audit(build(dtype, init, kind="alibi", bug=bug), detectors=[DET], causal=causal).result(DET)
    if bug is None:
        assert result.verdict == "pass", result
    else:
        assert result.verdict == "fail" and "rewards distance" in result.message, result
        assert "slope * (j - i)" in result.fix, result.fix
        # below float64 the line is read again on the float64 copy, where a linear bias stays a line
        assert (dtype == torch.float64) != ("on the float64 copy of the layer" in result.evidence), result.evidence
        marker = next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "# BUG alibi sign" in line)
        lines = [site.line for site in result.where if site.file == __file__]
        assert lines and min(abs(n - marker) for n in lines) <= 1, [site.describe() for site in result.where]


def test_a_layer_without_positions_is_not_applicable():
    report = diagnostics.audit(build(kind=None))
    result = report.result(DET)
    assert result.verdict == "skip" and result.message.startswith("not applicable: the layer has no positional"), \
        result.message
    assert report.passed and diagnostics.audit(build(kind=None), strict=True).result(DET).verdict == "skip"


@pytest.mark.parametrize("causal", [False, True])
def test_declared_relative_positions_that_the_layer_lost_fail_and_its_rotary_twin_passes(causal):
    # a rotation that cancels in q·k (open_lm#4: rotary applied over the head axis of every head alike) leaves the
    # layer with no positions: legitimate undeclared, a finding once positions="relative" says they are promised
    lost = diagnostics.audit(build(kind=None), positions="relative", causal=causal, detectors=[DET]).result(DET)
    assert lost.verdict == "fail" and 'positions="relative" is declared' in lost.message, lost.message
    assert "sequence axis" in lost.fix, lost.fix
    twin = diagnostics.audit(build(kind="rotary"), positions="relative", causal=causal, detectors=[DET]).result(DET)
    assert twin.verdict == "pass", twin.message


def test_declared_relative_positions_in_bfloat16_below_rounding_are_a_visible_skip_not_a_finding():
    result = diagnostics.audit(build(torch.bfloat16, kind=None), positions="relative", detectors=[DET]).result(DET)
    assert result.verdict == "skip" and result.message.startswith("not measured:") and "float32" in result.message, \
        result.message


def test_absolute_positions_fail_undeclared_and_are_not_applicable_declared():
    layer = build(kind="absolute")
    result = diagnostics.audit(layer, detectors=[DET]).result(DET)
    assert result.verdict == "fail" and 'positions="absolute"' in result.remedy[0], str(result)
    layer.position_embedding_type = "absolute"  # Hugging Face's name for the declaration
    declared = diagnostics.audit(layer, detectors=[DET]).result(DET)
    assert declared.verdict == "skip" and "absolute by design" in declared.message, declared.message


def test_a_rotary_layer_without_a_mask_is_a_visible_skip():
    result = diagnostics.audit(build(takes_mask=False), detectors=[DET]).result(DET)
    assert result.verdict == "skip" and not result.message.startswith("not applicable"), result.message
    assert "no shift of its positions is possible" in result.message and "mask argument" in result.message


class MaskAsFlag(PositionalAttention):
    """Whisper's SDPA path: any mask given makes the layer causal, its values never read (a flag, not a mask)."""

    def forward(self, x, mask=None):
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()  # (Tq, Tk), True = may attend
        return super().forward(x, None if mask is None else causal.expand(x.shape[0], 1, T, T))


def test_a_mask_read_as_a_flag_is_mask_honoureds_finding_not_a_position_and_the_call_without_it_passes():
    """Audited as a user first does, the left padding is attended (the mask's values are never read): no position is
    measured through it, so relative_positions is a visible skip that names the flag and mask_honoured, whose finding
    it is (tests/test_mask_as_flag.py), with the fix naming call= without the mask, not positions="absolute"; audited
    through that call, the same layer passes (its positions cannot be shifted without a mask: a visible skip). A
    layer that applies its mask and has absolute positions is not read as a flag."""
    torch.manual_seed(0)
    report = diagnostics.audit(MaskAsFlag())
    result = report.result(DET)
    assert result.verdict == "skip" and "only as a flag" in result.message and "mask_honoured" in result.message, result
    masked = report.result("mask_honoured")
    assert masked.verdict == "fail" and "only as a flag" in masked.message, masked
    assert "call=" in masked.remedy[0] and "positions=" not in masked.remedy[0], masked.remedy
    assert [f.detector for f in report.findings] == ["mask_honoured"], report.findings
    torch.manual_seed(0)
    unmasked = diagnostics.audit(MaskAsFlag(), call=lambda layer, x: layer(x))
    assert unmasked.passed and not unmasked.fired(), str(unmasked)  # positions: a visible skip without a mask
    absolute = diagnostics.audit(build(kind="absolute"), detectors=[DET]).result(DET)
    assert absolute.verdict == "fail" and "flag" not in absolute.message, absolute


def test_randomness_left_on_is_not_read_as_a_position():
    class Noisy(PositionalAttention):
        def forward(self, x, mask=None):
            out = super().forward(x, mask)
            return torch.nn.functional.dropout(out, 0.5, training=True)  # left on in eval mode

    torch.manual_seed(0)
    result = diagnostics.audit(Noisy(), detectors=[DET]).result(DET)
    assert result.verdict == "skip" and "randomness" in result.message, result.message


def test_the_audit_costs_two_calls_more_with_positions_and_one_without():
    def passes(layer):
        return diagnostics.audit(layer, detectors=["softmax_saturation"]).forward_passes, \
            diagnostics.audit(layer, detectors=["softmax_saturation", DET]).forward_passes

    plain, more = passes(build(kind="rotary"))
    assert more - plain == 2
    plain, more = passes(build(kind=None))
    assert more - plain == 1


# ---- margins: measured on the correct layers and the broken ones, every setting --------------------------------

MEASURED = {  # dtype: (largest reading of a correct layer, smallest of a broken one), `python <this file>`
    torch.float32: (1.86e-6, 2.1),
    torch.bfloat16: (9.81e-2, 2.1),
    torch.float16: (9.49e-3, 2.1),
}


def measure_margins(seeds=range(5), dtypes=(torch.float32, torch.bfloat16, torch.float16)):
    """{dtype: (largest correct reading, smallest broken reading)} over seeds, both inits, causal and not."""
    out = {}
    for dtype in dtypes:
        good, bad = 0.0, math.inf
        for seed in seeds:
            for init in ("default", "gpt2"):
                for causal in (False, True):
                    for kw in CORRECT.values():
                        r = diagnostics.audit(build(dtype, init, seed, **kw), causal=causal, detectors=[DET],
                                              seed=seed).result(DET)
                        good = max(good, r.value if r.value is not None else math.inf)
                    for bug, kw in BUGS.items():
                        r = diagnostics.audit(build(dtype, init, seed, bug=bug, **kw), causal=causal, detectors=[DET],
                                              seed=seed).result(DET)
                        bad = min(bad, r.value if r.value is not None else 0.0)
        out[dtype] = (good, bad)
    return out


def thorough() -> bool:
    """The deeper run: the thorough (or explore) Hypothesis profile, or ATTENTION_TESTS_EVERY_SITE=1."""
    return (settings().max_examples > settings.get_profile("default").max_examples
            or os.environ.get("ATTENTION_TESTS_EVERY_SITE") == "1")


def test_the_measured_margins_hold():
    if not thorough():
        pytest.skip("the margins' measurement (5 seeds x 2 inits x 3 dtypes x 12 layers, ~15 s): under "
                    "--hypothesis-profile=thorough or ATTENTION_TESTS_EVERY_SITE=1")
    for dtype, (good, bad) in measure_margins().items():
        tol = positions.shift_tolerance(dtype)
        assert good < tol < bad, (dtype, good, tol, bad)
        assert good <= 1.5 * MEASURED[dtype][0] and bad >= MEASURED[dtype][1] / 1.5, (dtype, good, bad, MEASURED[dtype])


ONE_SIDED_MEASURED = {  # dtype: (smallest flat-side ratio of a correct layer, largest of the one-sided twin)
    torch.float32: (0.344, 0.0),
    torch.bfloat16: (0.339, 0.0),
    torch.float16: (0.344, 0.0),
}


def measure_one_sided(seeds=range(5), dtypes=(torch.float32, torch.bfloat16, torch.float16), lengths=(8, 12)):
    """{dtype: (smallest correct ratio, largest one-sided ratio)}: `positions.one_sided`'s reading (the flat side's
    spread over the other's, on identical tokens) of the correct layers and the one-sided T5 twin, read from the
    observed scores with no bound, over seeds, both inits and two lengths."""
    from diagnostics._observe import Observer

    out = {}
    for dtype in dtypes:
        good, bad = math.inf, 0.0
        for seed in seeds:
            for init in ("default", "gpt2"):
                for name, kw in [*CORRECT.items(), ("one-sided", {"kind": "t5", "bug": "one-sided"})]:
                    layer = build(dtype, init, seed, **kw)
                    for T in lengths:
                        token = torch.randn(2, 1, layer.d_model, generator=torch.Generator().manual_seed(seed))
                        with torch.enable_grad(), Observer() as observer:
                            layer(token.expand(2, T, layer.d_model).to(dtype))
                        read = positions._flat_side(positions._scores_seen(observer.record, 1, 2, T)[0], math.inf)
                        if name == "one-sided":
                            bad = max(bad, read[0] if read else math.inf)
                        else:
                            good = min(good, read[0] if read else 0.0)
        out[dtype] = (good, bad)
    return out


def test_the_one_sided_margins_hold():
    if not thorough():
        pytest.skip("the one-sided reading's margins (5 seeds x 2 inits x 3 dtypes x 5 layers x 2 lengths): under "
                    "--hypothesis-profile=thorough or ATTENTION_TESTS_EVERY_SITE=1")
    for dtype, (good, bad) in measure_one_sided().items():
        bound = positions.one_sided_bound(dtype)
        assert bad <= bound < good, (dtype, bad, bound, good)
        assert good >= ONE_SIDED_MEASURED[dtype][0] / 1.5, (dtype, good, ONE_SIDED_MEASURED[dtype])


if __name__ == "__main__":
    for dtype, (good, bad) in measure_one_sided().items():
        bound = positions.one_sided_bound(dtype)
        print(f"one-sided, {dtype}: correct at least {good:.3g} ({good / bound:.3g}x the bound {bound:.2g}), "
              f"the one-sided twin at most {bad:.3g}")
    for dtype, (good, bad) in measure_margins().items():
        tol = positions.shift_tolerance(dtype)
        print(f"{dtype}: correct at most {good:.3g} (margin {tol / good if good else math.inf:.3g}x), "
              f"broken at least {bad:.3g} ({bad / tol:.3g}x the threshold {tol:.2g})")


# ---- real layers: Hugging Face's rotary and T5 layers, timm's rotary attention (the `real` extra) ------------------

HF = {  # class: (module, config class, config, constructor keywords, causal, scale)
    "LlamaAttention": ("llama", "LlamaConfig", {"num_key_value_heads": 2}, {"layer_idx": 0}, True, None),
    "GPTNeoXAttention": ("gpt_neox", "GPTNeoXConfig", {}, {"layer_idx": 0}, True, None),
    "GPTJAttention": ("gptj", "GPTJConfig", {"rotary_dim": 4}, {"layer_idx": 0}, True, None),
    "FalconAttention": ("falcon", "FalconConfig", {}, {"layer_idx": 0}, True, None),
    "PhiAttention": ("phi", "PhiConfig", {}, {"layer_idx": 0}, True, None),
    "T5Attention": ("t5", "T5Config", {"d_kv": 8, "d_ff": 64, "num_layers": 1},
                    {"has_relative_attention_bias": True, "layer_idx": 0}, False, 1.0),
}
SIZES = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 64,
         "max_position_embeddings": 64, "n_embd": 32, "n_head": 4, "n_layer": 1, "n_positions": 64, "d_model": 32,
         "num_heads": 4}


def hugging_face_layer(name: str, implementation: str, dtype, init: str):
    import importlib

    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    family, config_class, extra, build_kw, _, _ = HF[name]
    config_cls = getattr(transformers, config_class)
    accepted = set(config_cls().to_dict())
    config = config_cls(**{k: v for k, v in {**SIZES, **extra}.items() if k in accepted or k in extra},
                        attn_implementation=implementation)
    layer = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)(config, **build_kw)
    torch.manual_seed(0)
    for p in layer.parameters():  # the zoo's draw (std 0.2), or GPT-2's
        p.data.normal_(0, 0.02 if init == "gpt2" else 0.2)
    return layer.eval().to(dtype)


@pytest.mark.parametrize("init", ["zoo", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(HF))
def test_hugging_face_relative_layers_pass(name, implementation, dtype, init):
    """Measured (not merely not applicable) and passed: every rotary and T5-bias layer, as test_real_layers builds them.
    Their largest readings, over both implementations, inits and dtypes: 1.4e-6 in float32, 4.6e-2 in bfloat16."""
    layer = hugging_face_layer(name, implementation, dtype, init)
    *_, causal, scale = HF[name]
    result = diagnostics.audit(layer, causal=causal, scale=scale, detectors=[DET]).result(DET)
    assert result.verdict == "pass" and result.value < positions.shift_tolerance(dtype) / 3, str(result)


def test_timm_rotary_attention_passes_in_both_pairings():
    pytest.importorskip("torchvision", reason="timm needs torchvision: pip install -e \".[real]\"")
    timm = pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    from timm.layers import RotaryEmbeddingCat
    from timm.models.eva import EvaAttention

    assert timm.__version__

    class EvaWithRope(nn.Module):  # timm's EVA attention, its rotary table for a 1-D sequence
        def __init__(self, d_model=32, num_heads=4, rotate_half=False):
            super().__init__()
            self.d_model, self.num_heads = d_model, num_heads
            self.attn = EvaAttention(d_model, num_heads, num_prefix_tokens=0, rotate_half=rotate_half, scale_norm=False)
            self.rope = RotaryEmbeddingCat(2 * (d_model // num_heads), in_pixels=False, rotate_half=rotate_half)

        def forward(self, x, attn_mask=None):
            return self.attn(x, rope=self.rope.get_embed(shape=[x.shape[1]]).to(x.dtype), attn_mask=attn_mask)

    for rotate_half in (False, True):
        for causal in (False, True):
            torch.manual_seed(0)
            report = diagnostics.audit(EvaWithRope(rotate_half=rotate_half), causal=causal)
            assert report.passed and report.result(DET).verdict == "pass", str(report)
