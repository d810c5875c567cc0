"""Pins for the survivors of the full mutation run over the model wing's padding, cache, causality, runs and backends
modules (issue 37: `benchmarks/mutations.py --all --only model/padding.py --only model/cache.py --only
model/causality.py --only model/runs.py --only model/backends.py`, at 1910d14). As in tests/test_pins.py, each pin
has its twin on the same inputs (a case on each side of the comparison, guard or constant it pins), the numbers
quoted as literals; each test says which mutant it pins (its line number the run's, at 1910d14). Small models (one
block, 16 wide), one detector each, so the file runs in a few seconds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants.teaching_model import ProtocolGPT, TinyGPT
from correct import MultiHeadAttention
from diagnostics._guard import seed_rng
from diagnostics.model.cache import schedules


def model_result(model, detector: str, **kw):
    """The one detector's result on `model` (the audit's defaults otherwise)."""
    return diagnostics.audit_model(model, detectors=[detector], **kw).result(detector)


# ---- cache_parity -----------------------------------------------------------------------------------------------


class LastLogits(ProtocolGPT):
    """ProtocolGPT (one block, 16 wide, seed 0) with its cache, returning the logits of the last position only when
    `last` ((B, vocab): one output per sequence, as a classifier's), else every position's."""

    def __init__(self, last: bool):
        torch.manual_seed(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)
        self.last = last

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        logits, cache = out if use_cache else (out, None)
        logits = logits[:, -1] if self.last else logits  # (B, vocab) or (B, T, vocab)
        return (logits, cache) if use_cache else logits


@pytest.mark.parametrize("last, expected", [(True, "skip"), (False, "pass")])
def test_cache_parity_skips_a_model_with_no_output_per_position_and_measures_one_with(last, expected):
    """check_cache_parity's `if not per_position(full, T)` (L55, guard-never): a model that returns one output per
    sequence has no positions to compare; without the guard its cached steps' outputs, joined along the positions,
    would be called a cache bug ("cached decoding returns (1, 448)": seven steps' 64 logits). Its twin, the same
    model returning every position's logits, passes."""
    result = model_result(LastLogits(last), "cache_parity")
    assert result.verdict == expected, result
    if last:
        assert result.message.startswith("not applicable: the model's output (1, 64) has no sequence dimension"), result


@pytest.mark.parametrize("last, expected", [(True, "skip"), (False, "pass")])
def test_padding_invariance_skips_a_model_with_no_output_per_position_and_measures_one_with(last, expected):
    """check_padding_invariance's `if not per_position(ref, L)` (L53, guard-never): the same two models; without the
    guard the padded rows' outputs are cut along the vocabulary, as if it were the positions, and the detector
    crashes on the shapes."""
    result = model_result(LastLogits(last), "padding_invariance")
    assert result.verdict == expected, result
    if last:
        assert result.message.startswith("not applicable: the model's output (1, 64) has no sequence dimension"), result


def test_the_uneven_schedule_is_three_steps_of_at_least_a_token_at_every_length_from_5():
    """A defect the run's L39 survivor showed (fixed): `[a, b, T - a - b] if T - a - b > 0 else [a, T - a]` held an
    else no length reaches (T - a - b is about 4T / 9 - 5 / 3, at least 1 from T = 5), so `> 0` and `>= 0` could not
    differ; the dead branch is gone. Pinned here where it was read: every length from 5 to 4,096 gets three steps of
    at least a token that add up to T; below 5 there is no uneven schedule."""
    for T in range(5, 4097):
        plan = schedules(T)["uneven"]
        assert len(plan) == 3 and min(plan) >= 1 and sum(plan) == T, (T, plan)
    assert all("uneven" not in schedules(T) for T in range(1, 5))


class CopiedOnceRaises(list):
    """A cache (a list of per-layer lists) whose first deep copy of the run raises, as a cache holding something
    that cannot be copied would, and whose later copies succeed: `raised` is shared by every copy."""

    raised = [False]

    def __deepcopy__(self, memo):
        if not self.raised[0]:
            self.raised[0] = True
            raise TypeError("cannot copy this cache yet")
        return CopiedOnceRaises(copy.deepcopy(list(self), memo))


class FirstCopyRaises(ProtocolGPT):
    """ProtocolGPT (one block, 16 wide, seed 0) returning its cache as a `CopiedOnceRaises`."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)
        CopiedOnceRaises.raised = [False]

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        return (out[0], CopiedOnceRaises(out[1])) if use_cache else out


@pytest.mark.parametrize("seq_len", [7, 8])
def test_a_cache_whose_first_copy_raises_is_prefilled_again_by_the_next_schedule(seq_len):
    """check_cache_parity's `if i == 0 and shared is None` (L78, and->or): only a prefill is kept for the next
    schedule. At 7 tokens the prefill is one token, as the steps of 3's first step; the first copy of the steps of 1's
    cache raises, so the steps of 3 prefill again and every schedule matches (with `or`, the copy after the second
    step of 1 would be kept as if it were the prefill's: the steps of 3 would go on from two tokens cached, at one
    token's output, and fail). Its twin at 8 tokens (a prefill of 2, no schedule's step of 1 kept) passes both ways."""
    model = FirstCopyRaises()
    result = model_result(model, "cache_parity", seq_len=seq_len)
    assert result.verdict == "pass", result
    assert CopiedOnceRaises.raised[0], "the cache was never copied"


# ---- padding_invariance: an encoder-decoder's encoder padded ----------------------------------------------------


class _Seq2SeqConfig:
    is_encoder_decoder = True
    vocab_size = 64


class Seq2Seq(nn.Module):
    """A one-layer encoder-decoder (16 wide, 2 heads, seed 0) without Hugging Face: the encoder's self-attention
    under its padding mask, the decoder's causal self-attention, and cross-attention to the encoder's real positions.
    `bug`: "ignored": the encoder's self-attention is given no mask (its real positions read the padding);
    "row 0 only": it masks the padding of the batch's first row only (a row index gone wrong), "slight": the encoder
    adds 1e-3 x the mean of every position's embedding, padding included (below bfloat16's rounding); None: correct."""

    causal = True

    def __init__(self, bug: str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.config, self.bug = _Seq2SeqConfig(), bug
        self.embed, self.pos = nn.Embedding(64, 16), nn.Embedding(32, 16)
        self.encoder_attn, self.decoder_attn, self.cross_attn = (MultiHeadAttention(16, 2) for _ in range(3))
        self.head = nn.Linear(16, 64)
        self.to(dtype)

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None):
        (B, S), T = input_ids.shape, decoder_input_ids.shape[1]  # batch, encoder and decoder lengths
        keep = torch.ones(B, S, dtype=torch.bool) if attention_mask is None else attention_mask.bool()  # (B, S)
        e = self.embed(input_ids) + self.pos(torch.arange(S))  # (B, S, D)
        if self.bug == "slight":
            e = e + 1e-3 * e.mean(1, keepdim=True)  # BUG: every position reads the padding's embeddings
        seen = keep.clone()
        if self.bug == "ignored":
            seen[:] = True  # BUG: no padding masked
        elif self.bug == "row 0 only":
            seen[1:] = True  # BUG: only the first row's padding masked
        e = e + self.encoder_attn(e, mask=seen[:, None, None, :])[0]
        d = self.embed(decoder_input_ids) + self.pos(torch.arange(T))  # (B, T, D)
        dkeep = torch.ones(B, T, dtype=torch.bool) if decoder_attention_mask is None else decoder_attention_mask.bool()
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & dkeep[:, None, None, :]  # (B, 1, T, T)
        d = d + self.decoder_attn(d, mask=allowed)[0]
        d = d + self.cross_attn(d, e, e, mask=keep[:, None, None, :])[0]
        return self.head(d)  # (B, T, vocab)


class Seq2SeqWithoutEncoderMask(Seq2Seq):
    """The same model, whose forward takes no padding mask for its encoder (the encoder's ids are never padded)."""

    def forward(self, input_ids, decoder_input_ids=None, decoder_attention_mask=None):
        return super().forward(input_ids, None, decoder_input_ids, decoder_attention_mask)


def seq2seq_padding(bug: str | None, dtype: torch.dtype = torch.float32, *, encoder_length: int = 16,
                    model: type = Seq2Seq):
    """padding_invariance on `model(bug, dtype)`, given an example of encoder ids (2 x `encoder_length`) and decoder
    ids (2 x 16), seed 0."""
    gen = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(64, (2, encoder_length), generator=gen),
               "decoder_input_ids": torch.randint(64, (2, 16), generator=gen)}
    return model_result(model(bug, dtype), "padding_invariance", example=example)


ENCODER_PADDED = "the encoder's ids right-padded by 4 (12 real), pad contents "


def test_an_encoder_that_reads_its_padding_fails_at_its_attention_and_the_correct_one_passes():
    """check_padding_invariance's `if not encoder.ok` (L85, drop-not) and `first = first or encoder.at` (L87, or->and:
    the layer the encoder's change first shows in is the finding's, where the decoder's own padding moved nothing),
    and `_encoder_padding`'s test of an encoder-decoder taking both masks (L144-L146: with any part of it turned,
    no encoder padding is measured and the bug passes). The twin, the same model masking its encoder's padding,
    passes with the encoder's padding in its message and evidence."""
    broken = seq2seq_padding("ignored")
    assert (broken.verdict, broken.layer) == ("fail", "encoder_attn"), broken
    assert broken.message == "padding changes the outputs at real tokens (encoder padding); first at encoder_attn"
    correct = seq2seq_padding(None)
    assert correct.verdict == "pass" and correct.message.endswith("; and by padding the encoder's ids"), correct
    assert ENCODER_PADDED + "2: error" in correct.evidence, correct.evidence


def test_an_encoder_whose_padding_moves_one_padded_row_of_two_fails():
    """`_encoder_padding`'s `ok = all(r[0] for r in results)` (L162, all->any): the encoder masks the first row's
    padding only, so only the second pad contents move the outputs; one row moved is a failure. Its twin, the
    correct model, above."""
    result = seq2seq_padding("row 0 only")
    assert result.verdict == "fail" and "(encoder padding)" in result.message, result
    first, second = (result.evidence.split(ENCODER_PADDED + n + ": error ")[1].split(" ")[0] for n in "12")
    assert float(first) < 1e-5 < float(second), result.evidence


@pytest.mark.parametrize("bug, expected", [("slight", "fail"), (None, "pass")])
def test_in_bfloat16_the_encoders_padding_is_judged_again_in_the_float64_copy(bug, expected):
    """check_padding_invariance's float64 re-run of the encoder's padding (L101, drop-not) and `_encoder_padding`'s
    `if not golden.rechecks` (L171, drop-not: the re-run is made at a low precision, not at float32). In bfloat16 an
    encoder reading 1e-3 of its padding's embeddings stays under the dtype's rounding and fails in the float64 copy;
    its twin, the correct model, passes the float64 copy too, which its evidence says."""
    result = seq2seq_padding(bug, torch.bfloat16)
    assert result.verdict == expected, result
    assert ENCODER_PADDED + "2 in the float64 copy" in result.evidence, result.evidence
    if bug:
        assert result.message.startswith("padding changes the outputs at real tokens (encoder padding) in the "
                                         "model's float64 copy"), result


def test_at_float32_the_slight_encoder_bug_fails_as_it_is():
    """The same slight bug in float32 moves the outputs past float32's floor (1e-5): it fails as measured, the float32
    model's padding not run again in the float64 copy."""
    result = seq2seq_padding("slight")
    assert result.verdict == "fail" and "in the float64 copy" not in result.message + result.evidence, result


@pytest.mark.parametrize("encoder_length, padded", [(3, True), (2, False)])
def test_the_encoders_ids_are_padded_from_3_tokens_on(encoder_length, padded):
    """`_encoder_padding`'s `ids.shape[1] >= 3` (L146, GtE->Gt): three encoder ids are padded by one (two real
    left); two are not padded (one pad would leave one real token). The decoder's own padding is measured either way."""
    result = seq2seq_padding(None, encoder_length=encoder_length)
    assert result.verdict == "pass", result
    assert ("the encoder's ids right-padded by 1 (2 real)" in result.evidence) is padded, result.evidence
    assert result.message.endswith("; and by padding the encoder's ids") is padded, result


def test_an_encoder_decoder_taking_no_encoder_mask_has_only_its_decoder_padded():
    """`_encoder_padding`'s `runner.encoder_decoder and ... and runner.takes("attention_mask") and isinstance(ids,
    ...)` (L144 and L145, and->or: with either `and` turned, an encoder-decoder taking decoder masks is padded on its
    encoder without an argument to mask it, and the call raises): a model whose forward takes no `attention_mask`
    has nothing to mask its encoder's padding with, so only its decoder is padded and judged. Its twin, the model
    taking both masks, has its encoder padded too (above)."""
    result = seq2seq_padding(None, model=Seq2SeqWithoutEncoderMask)
    assert result.verdict == "pass", result
    assert "encoder" not in result.message + result.evidence, result


# ---- batch_invariance -------------------------------------------------------------------------------------------


class Stretched(TinyGPT):
    """TinyGPT (one block, 16 wide, seed 0) whose output, when `stretch`, repeats each token's logits for a duration
    read from the token (1 + id % 2 frames), the batch's rows padded to the longest, as FastSpeech 2's length
    regulator does: a row's length in a batch is the batch's longest. Without `stretch`: one output per token."""

    def __init__(self, stretch: bool):
        seed_rng(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)
        self.stretch = stretch

    def forward(self, input_ids):
        logits = super().forward(input_ids)  # (B, T, vocab)
        if not self.stretch:
            return logits
        durations = 1 + input_ids % 2  # (B, T): each token's frames
        rows = [row.repeat_interleave(d, dim=0) for row, d in zip(logits, durations)]
        return nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (B, longest, vocab)


@pytest.mark.parametrize("stretch, expected", [(True, "skip"), (False, "pass")])
def test_batch_invariance_skips_a_model_whose_output_length_depends_on_its_batch(stretch, expected):
    """check_batch_invariance's `if out[1:2].shape != alone.shape` (L208, guard-never): the sequence gives 26 frames
    alone and 27 (another row's length) in the batch: no row-by-row comparison, a skip that says so (without the
    guard the detector crashes on the shapes). Its twin, the same model with one output per token, passes."""
    result = model_result(Stretched(stretch), "batch_invariance")
    assert result.verdict == expected, result
    if stretch:
        assert result.message.startswith("not measured: the sequence's output is (26, 64) alone and (27, 64) in the "
                                         "batch"), result


# ---- model_runs -------------------------------------------------------------------------------------------------


class Tower(nn.Module):
    """A module posing as a Hugging Face model (its class from transformers, a config and a main input): a model a
    user can audit alone; `inner`: another such model inside it."""

    main_input_name = "input_ids"

    def __init__(self, inner: bool = False):
        super().__init__()
        self.config = object()
        self.attn = MultiHeadAttention(16, 2)
        self.inner = Tower() if inner else None

    def forward(self, input_ids):
        raise ValueError("expected token embeddings")


class Projection(nn.Module):
    """A layer posing as Hugging Face, with a config but no main input (CLAP's projections): no model of its own."""

    def __init__(self):
        super().__init__()
        self.config = object()
        self.proj = nn.Linear(16, 16)


Tower.__module__ = Projection.__module__ = "transformers.models.tower.modeling_tower"


class Towers(nn.Module):
    """`n` towers beside a projection, the first holding a tower of its own; the forward raises on the token ids the
    audit builds (it wants pixels too, as CLIP's does)."""

    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.projection = nn.Embedding(64, 16), Projection()
        for i in range(n):
            setattr(self, f"tower_{i}", Tower(inner=i == 0))

    def forward(self, input_ids):
        raise ValueError("expected pixel_values beside the ids")


def test_model_runs_names_the_one_model_a_model_is_made_of_and_audits_two_tower_by_tower():
    """check_model_runs' `if len(held) == 1`: the one model inside is named, the outermost only (not tower_0's own
    inner tower) and not a layer with a config but no main input (the projection); of two, each is audited on its own
    (`_towers`), and the skip is not the report's."""
    result = model_result(Towers(1), "model_runs")
    assert result.verdict == "skip", result
    assert result.message.endswith("or audit the model it is made of on its own (model.tower_0)"), result.message
    report = diagnostics.audit_model(Towers(2), detectors=["model_runs"])
    assert report.notes[0].startswith("audited tower by tower"), report.notes
    assert report.status_reason.startswith("inconclusive: tower_0 could not be audited on its own"), report
