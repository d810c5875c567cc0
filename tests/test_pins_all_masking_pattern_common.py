"""Pins for the survivors of the full mutation run over mask_honoured / fully_masked_rows (issue 37:
`benchmarks/mutations.py --all --only detectors/masking.py`, at ff5444f) and attention_pattern (`--only
detectors/pattern.py`, the same code at c4ee083); those of the shared endings (`--only detectors/_common.py`) belong
here too. As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each side of the comparison,
guard or branch it pins), the numbers quoted as literals; each test says which mutant it pins (its line number the
run's). Small layers written here, one detector at small sizes: the file runs in about two seconds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import diagnostics
from diagnostics import patterns


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


# ---- fully_masked_rows ----------------------------------------------------------------------------------------------


class WeightsMasked(nn.Module):
    """Self-attention (16 wide, 2 heads, seed 0), mask bool (B, 1, T, T), True = may attend. `where`: "before" (the
    scores, then a softmax that gives an all -inf row NaN), "after" (the weights after the softmax, with -inf: the
    bug, as tests/test_mask_controls.py's). `one_nan`: the output's first feature at t=0 NaN, the rest finite."""

    def __init__(self, where: str, one_nan: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.where, self.one_nan, self.num_heads = where, one_nan, 2
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        if mask is not None and self.where == "before":
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)  # (B, H, T, T)
        if mask is not None and self.where == "after":
            weights = weights.masked_fill(~mask, float("-inf"))  # the bug: -inf reaches the values' product
        out = self.out((weights @ v).transpose(1, 2).reshape(B, T, D))  # (B,H,T,T) x (B,H,T,d) -> (B,T,D)
        if self.one_nan:
            first = torch.zeros_like(out, dtype=torch.bool)
            first[:, 0, 0] = True
            out = torch.where(first, float("nan"), out)
        return out


def test_fully_masked_rows_blocks_the_last_key_for_the_earlier_queries_from_three_tokens_on():
    """check_fully_masked_rows' `elif T >= 3` (L335, GtE->Gt): at three tokens the queries before the last have key 2
    blocked beside the keys they attend, so the -inf applied after the softmax makes NaN in rows that have keys, a
    fail whose evidence says so (L355, the same `>= 3`; `> 3` left only the empty row at 3: a warn); at two tokens
    only the empty row is blocked, a warn. Its twin, the mask applied before the softmax, warns at both (NaN in the
    empty row only)."""
    for seq_len, after in ((3, "fail"), (2, "warn")):
        found = verdict(WeightsMasked("after"), "fully_masked_rows", seq_len=seq_len)
        assert found.verdict == after, (seq_len, found)
        assert (after == "fail") == found.evidence.endswith("and the queries before t=2 have key 2 blocked"), found
        warned = verdict(WeightsMasked("before"), "fully_masked_rows", seq_len=seq_len)
        assert warned.verdict == "warn" and warned.value == 1.0, (seq_len, warned)  # L366: the warn's value, 1.0


def test_fully_masked_rows_fails_one_nan_value_in_a_row_that_has_keys():
    """check_fully_masked_rows' `finite = isfinite(out).all(-1)` (L346, all->any): one NaN value (feature 0 at t=0,
    the rest of the row finite) in a row that has keys to attend is NaN beyond the empty row, a fail (`any` read the
    row as finite: a warn for the empty row alone), and the evidence points at it, the first such row (L354, either
    `~` dropped: the first finite row, (b=0, t=1), or the empty one, (b=0, t=8)); it names the key blocked beside the
    others from three tokens on, at 16 and not at 2 (L355: `<= 3`, `or not own`). Its twin, the same layer without
    it, warns."""
    found = verdict(WeightsMasked("before", one_nan=True), "fully_masked_rows")
    assert found.verdict == "fail" and "spreads beyond" in found.message, found
    assert found.evidence.startswith("2 output rows that have keys to attend are NaN/inf, first at (b=0, t=0)"), found
    assert found.evidence.endswith("has no key and the queries before t=15 have key 15 blocked"), found.evidence
    two = verdict(WeightsMasked("before", one_nan=True), "fully_masked_rows", seq_len=2)
    assert two.verdict == "fail" and two.evidence.endswith("when only query (b=0, t=1) has no key"), two
    assert verdict(WeightsMasked("before"), "fully_masked_rows").verdict == "warn"


# ---- attention_pattern ----------------------------------------------------------------------------------------------


def _windowed(gain: float, W: int):
    """Attention over a causal window of W keys (the query's own among them), its logits `gain` x the usual (gain 100:
    sharp, most keys' weights below float32's rounding), returning (out, weights); the audit's mask applied too."""
    def attention(q, k, v, mask=None):
        T = q.shape[-2]
        scores = gain * q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
        scores = scores.masked_fill(~((j <= i) & (i - j < W)), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        return weights @ v, weights  # (B, H, T, d)

    return attention


def test_keys_a_sharp_layer_seemed_to_ignore_are_measured_again_before_over_masking_is_said():
    """_confirmed's `suspects = ignored.any(dim=1)` (L177, any->all): sliding_window(4) at logits 100x the usual, a key
    pushed 1000x to a lower logit leaves a row whose weight on it was already below rounding unmoved: 5 of the 116
    allowed pairs, each key seen by other rows of its sequence. Each is pushed again alone, both ways, and moves: a
    pass (`all` measured again only keys no row of the sequence saw, and said over-masking). Its twin, the same sharp
    layer with a window of 3, fails as over-masking on the same inputs."""
    pattern = patterns.sliding_window(4)
    found = verdict(_windowed(100.0, 4), "attention_pattern", pattern=pattern)
    assert found.verdict == "pass" and "111 / 116 allowed pairs seen moving their row, 0 not moving" in found.evidence, \
        found
    short = verdict(_windowed(100.0, 3), "attention_pattern", pattern=pattern)
    assert short.verdict == "fail" and "(over-masking)" in short.message, short


def test_attention_pattern_of_a_layer_that_raises_is_a_skip_naming_runs():
    """_mask_mod_disagrees' `if base.record is None or not base.record.flex` (L199, or->and): a layer that raises on
    the standard probe leaves no record, so there is no FlexAttention program to compare and the detector skips,
    pointing at `runs` (`and` read the missing record's programs: the detector raised). Its twin, the same window
    that does not raise, passes."""
    def raises(q, k, v, mask=None):
        raise RuntimeError("shapes do not match")

    pattern = patterns.sliding_window(4)
    found = verdict(raises, "attention_pattern", pattern=pattern)
    assert found.verdict == "skip" and "see `runs`" in found.message, found
    assert verdict(_windowed(1.0, 4), "attention_pattern", pattern=pattern).verdict == "pass"


def test_a_wide_window_reads_in_its_second_sequence_the_edge_pairs_its_first_did_not():
    """_tests' `new = readable[b] & ~read.any(0)` (L306, drop-~ and any->all): sliding_window(12) at T = 32 has 14
    classes, 9 read per sequence; the second sequence takes first the classes whose edge pairs the first did not
    read, so that the two read 139 of the 204 edge pairs. Its twin, the window one short, fails (over-masking) on the
    same inputs."""
    pattern = patterns.sliding_window(12)
    found = verdict(_windowed(1.0, 12), "attention_pattern", pattern=pattern, seq_len=32)
    assert found.verdict == "pass" and "9 of the 14 classes r per sequence" in found.evidence \
        and "139 / 204 edge pairs read" in found.evidence, found
    short = verdict(_windowed(1.0, 11), "attention_pattern", pattern=pattern, seq_len=32)
    assert short.verdict == "fail" and "(over-masking)" in short.message, short


def _dropping(n: int):
    """sliding_window(4) attention whose sequence 0 (every even batch row: the stacked copies keep the order) ignores
    n allowed keys: query 5 + m never sees key 2 + m, m < n."""
    def attention(q, k, v, mask=None):
        B, T = q.shape[0], q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
        allowed = ((j <= i) & (i - j < 4)).expand(B, 1, T, T).clone()  # (B, 1, T, T)
        allowed[0::2, 0, 5:5 + n, 2:2 + n] &= ~torch.eye(n, dtype=torch.bool)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        return weights @ v, weights  # (B, H, T, d)

    return attention


def test_over_masking_names_up_to_three_cells_and_marks_more_with_dots():
    """_cells' `" ..." if int(mask.sum()) > limit` (L352, Gt->GtE and Gt->Lt): three over-masked pairs are named
    all three, no dots; four are named three, then " ...". Its twin, the same window ignoring no key, passes."""
    pattern = patterns.sliding_window(4)
    for n, tail in ((3, "query 7 -> key 4 in sequence 0 (the row"), (4, "query 7 -> key 4 in sequence 0 ... (the row")):
        found = verdict(_dropping(n), "attention_pattern", pattern=pattern)
        assert found.verdict == "fail" and f"{n} / 116 (query, key) pairs" in found.evidence and tail in found.evidence, \
            (n, found)
    assert verdict(_dropping(0), "attention_pattern", pattern=pattern).verdict == "pass"


class WindowedSelf(nn.Module):
    """`_windowed`'s attention as a one-stream module (16 wide, 2 heads, seed 0): query, key and value from x."""

    def __init__(self, W: int):
        super().__init__()
        torch.manual_seed(0)
        self.W, self.qkv = W, nn.Linear(16, 48)

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)  # (B, H, T, d)
        out, _ = _windowed(1.0, self.W)(q, k, v, mask)
        return out.transpose(1, 2).reshape(B, T, D)  # (B, H, T, d) -> (B, T, D)


def test_the_picture_of_a_one_stream_layer_leaves_out_only_each_tokens_own_key():
    """dependency_map's `measurable = (rows != keys) if base.one_stream` (L418, NotEq->Eq): a one-stream layer's token
    is its query too, so the picture of its finding measures every cell but the diagonal (`==` measured the diagonal
    alone). Its twin, the same window as a function of three streams, measures every cell; both fail (a window of 3
    under sliding_window(4))."""
    pattern = patterns.sliding_window(4)
    one = verdict(WindowedSelf(3), "attention_pattern", pattern=pattern)
    picture = one.extras["dependency_map"]
    rows = torch.arange(picture.measurable.shape[0]).view(-1, 1) + picture.q0
    keys = torch.arange(picture.measurable.shape[1]).view(1, -1) + picture.k0
    assert one.verdict == "fail" and torch.equal(picture.measurable, rows != keys), one
    three = verdict(_windowed(1.0, 3), "attention_pattern", pattern=pattern)
    assert three.verdict == "fail" and bool(three.extras["dependency_map"].measurable.all()), three


def test_a_layer_blind_to_one_class_of_keys_is_over_masking_not_a_skip():
    """_measure's `if not any(bool(m.any()) for m in moved)` (L496, any->all): sliding_window(4) reads 6 classes; a
    layer that never sees the keys j % 6 == 5 moves no row in that copy and rows in the others, so the detector
    measures and fails it as over-masking (`all` skipped it as not responding). Its twin, the same window seeing
    every key, passes."""
    def blind(q, k, v, mask=None):
        T = k.shape[-2]
        seen = (torch.arange(T) % 6 != 5).view(1, 1, 1, T)  # (1, 1, 1, Tk)
        mask = seen if mask is None else mask & seen
        return _windowed(1.0, 4)(q, k, v, mask)

    pattern = patterns.sliding_window(4)
    found = verdict(blind, "attention_pattern", pattern=pattern)
    assert found.verdict == "fail" and "(over-masking)" in found.message, found
    assert verdict(_windowed(1.0, 4), "attention_pattern", pattern=pattern).verdict == "pass"


class ConvThenCausal(nn.Module):
    """A causal depth-wise convolution (row i reads rows i-2..i), then causal self-attention (24 wide, 2 heads, seed
    0); `leaks`: each output row then adds the next row's output, a leak one key into the future that no mask shows.
    24 wide so that no axis of the convolution's (B, C, T) tensors is mistaken for the 16 positions."""

    def __init__(self, leaks: bool):
        super().__init__()
        torch.manual_seed(0)
        self.leaks, self.num_heads = leaks, 2
        self.conv = nn.Conv1d(24, 24, 3, groups=24)
        self.qkv, self.out = nn.Linear(24, 72), nn.Linear(24, 24)

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, d_model
        h = self.conv(nn.functional.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2)  # (B, T, D), causal
        q, k, v = self.qkv(h).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)  # (B,H,T,d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B, H, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))
        return out + out.roll(-1, dims=1) if self.leaks else out  # row i takes row i + 1: the leak


def test_a_leak_past_a_causal_convolution_is_found_where_it_enters_not_at_the_convolution():
    """_measure's rows to hold when a copy's leaking key needed no bisecting (L513 `meets = (...).any(-1)`, any->all;
    L514 `hold = ~meets & ~(...)`, each `~` dropped): the rows held are those that meet no key the pattern lets
    them see, less the perturbed token's own row. The convolution moves rows i..i+2 when key i changes, rows causal()
    lets see it, so the first op moving a held row is the roll (held: the rows before the key). `all` (no row meets
    every key) and the first `~` dropped held the rows after the key, pointing at the convolution; the second `~`
    dropped held only the perturbed row, which meets its own key, and pointed nowhere. Its twin, without the leak,
    passes on the same inputs."""
    found = verdict(ConvThenCausal(leaks=True), "attention_pattern", pattern=patterns.causal())
    assert found.verdict == "fail" and "(leakage)" in found.message, found
    assert [s.code for s in found.where][:1] == ["return out + out.roll(-1, dims=1) if self.leaks else out  "
                                                 "# row i takes row i + 1: the leak"], [s.code for s in found.where]
    assert verdict(ConvThenCausal(leaks=False), "attention_pattern", pattern=patterns.causal()).verdict == "pass"
