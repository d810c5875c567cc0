"""Pins for the numbers and branches that `benchmarks/mutations.py` found no test depending on (issue 37): for each,
a case just inside and one just outside, so that the constant tenfold either way, a comparison turned, or a guard
that never fires fails a test here. As in tests/test_thresholds.py, constants are quoted as literals on purpose (a
test that read them from the module would follow a mutated constant); each test says which constant or branch it
pins. Tiny layers and sizes: the file runs in a few seconds, and every mutant's test selection runs it first.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from buggy_variants.teaching_model import ProtocolGPT, TinyGPT, inject
from correct import MultiHeadAttention, gpt2_init_
from diagnostics import patterns
from diagnostics._guard import seed_rng
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._common import logit_gain
from diagnostics.detectors._stacked import PADDED, decoding_calls, decoding_inputs, stacked, stacked_baseline
from diagnostics.model import _causal
from diagnostics.model.window import declared_pattern

INSIDE, OUTSIDE = 0.3, 3.0  # twins' distance from a gain: 10x either way crosses one of them


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


def attention(q, k, v, mask=None, *, allowed=None):
    """Scaled dot-product attention on (B, H, Tq, d) x (B, H, Tk, d), returning (out, weights); `allowed(Tq, Tk)`,
    a bool mask of its own, replaces the one passed."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    mask = allowed(q.shape[-2], k.shape[-2]) if allowed is not None else mask
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B, H, Tq, d)


def top_left(t_q, t_k):
    """Query i sees keys j <= i: right while Tq == Tk, wrong for the last Tq of Tk positions (cached decoding)."""
    return torch.ones(t_q, t_k, dtype=torch.bool).tril()


def windowed(W: int):
    """The reference under its own sliding window of W keys (whatever mask it is passed)."""
    return lambda q, k, v, mask=None: attention(q, k, v, allowed=lambda t_q, t_k: patterns.sliding_window(W)
                                                .allowed(1, t_q, t_k)[0])


class OneStream(nn.Module):
    """Self-attention called as m(x, mask=None) (one input stream) over the reference's weights, returning its
    weights; `mixes="mean"`: the running mean of the tokens instead (causal, no softmax, no weights); `mixes=None`: a
    projection of each token alone, which takes a mask and mixes no tokens."""

    def __init__(self, d_model=16, num_heads=2, *, mixes="attention"):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.mixes = d_model, num_heads, mixes
        self.attn = MultiHeadAttention(d_model, num_heads)

    def forward(self, x, mask=None):
        if self.mixes == "attention":
            return self.attn(x, x, x, mask)
        if self.mixes == "mean":
            x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)  # (B, T, D)
        return self.attn.out(x)


# ---- causal_alignment: the one-stream guard, NEWEST_KEY_GAINS ------------------------------------------------


def test_causal_alignment_skips_a_one_stream_layer_without_weights_and_judges_one_with_them():
    """Pins the `weights is None` guard: one stream and no weights, a key cannot change without its query."""
    blind = verdict(OneStream(mixes="mean"), "causal_alignment", causal=True)
    assert (blind.verdict, blind.message) == ("skip", "not measured: one input stream and no weights: a key cannot "
                                                      "change without its query"), blind
    seen = verdict(OneStream(), "causal_alignment", causal=True)
    assert seen.verdict == "pass", seen


def newest_key_opens_past(threshold: float, *, signed: bool = False):
    """A top-left mask (the newest query does not see the newest key), except that every output moves once the newest
    key averages more than `threshold` in absolute value, or (`signed`) once the newest query's logit for it exceeds
    `threshold`: the misalignment shows only to a push that stays below it."""

    def layer(q, k, v, mask=None):
        out, weights = attention(q, k, v, allowed=top_left)
        if signed:
            reach = (q[..., -1, :].float() * k[..., -1, :].float()).sum(-1) / math.sqrt(q.shape[-1])  # (B, H)
        else:
            reach = k[..., -1, :].abs().float().mean(-1)  # (B, H)
        return out + (reach - threshold).clamp_min(0)[..., None, None].to(out.dtype), weights

    return layer


def test_causal_alignment_pushes_the_newest_key_100x_both_ways():
    """NEWEST_KEY_GAINS = (100, -100), one copy each of the same draw, so that one of them raises the newest logit:
    a gate on that logit at 0.3 x 100 opens in every row of the probe (pass; measured: with either gain at 10 it
    does not, a finding), one at 3 x 100 stays shut; a gate on the key's size at 3 x 100 stays shut too (the
    top-left mask's finding), where either gain at 1000 opens it."""
    opens = verdict(newest_key_opens_past(INSIDE * 100, signed=True), "causal_alignment", causal=True)
    assert opens.verdict == "pass", opens
    for shut in (newest_key_opens_past(OUTSIDE * 100, signed=True), newest_key_opens_past(OUTSIDE * 100)):
        found = verdict(shut, "causal_alignment", causal=True)
        assert found.verdict == "fail" and found.message.startswith("the newest query does not see the newest"), found


# ---- mask_honoured: the guard of a layer that mixes no tokens ------------------------------------------------


def test_mask_honoured_skips_a_one_stream_layer_that_mixes_no_tokens_and_judges_one_that_does():
    alone = verdict(OneStream(mixes=None), "mask_honoured")
    assert alone.verdict == "skip" and "the layer mixes no tokens" in alone.message, alone
    assert verdict(OneStream(), "mask_honoured").verdict == "pass"


# ---- ENTROPY_ROWS: the rows the logit gain reads ------------------------------------------------------------


def spread_logits(spread):
    """A function whose logits have `spread(row)` as the standard deviation over the keys of row `row` (its index in
    the flattened (B, H, Tq) rows), whatever q and k: fixed draws, standardised per row."""

    def layer(q, k, v, mask=None):
        B, H, T, _ = q.shape
        z = torch.randn(B, H, T, k.shape[-2], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        z = (z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True)  # each row: mean 0, std 1
        rows = torch.arange(B * H * T, dtype=torch.float64).view(B, H, T, 1)
        weights = (spread(rows) * z).to(q.dtype).softmax(-1)
        return weights @ v, weights

    return layer


def test_the_logit_gain_reads_the_first_512_rows():
    """ENTROPY_ROWS = 512: rows spread 1e-4 x (1 + row), 640 of them (B 2 x H 2 x T 160): the median of the first
    512 is 1e-4 x 256 (torch's median of an even count: the lower middle), of all 640 it would be 1e-4 x 320, of
    the first 51 1e-4 x 26."""
    probe = Probe(make_subject(spread_logits(lambda r: 1e-4 * (1 + r)), d_model=16, num_heads=2), causal=False,
                  scale=None, seq_len=160, seed=0)
    assert logit_gain(probe) == pytest.approx(math.sqrt(2.0 / (1e-4 * 256)), rel=1e-6)


# ---- the shared probes (_stacked.py) ----------------------------------------------------------------------


def faint(q, k, v, mask=None):
    """The reference with logits spread by about 0.05 (queries x 0.05): the decoding checks' gain is well above 1."""
    return attention(0.05 * q, k, v, mask)


def probe_of(layer, seq_len: int, *, causal: bool = True) -> Probe:
    return Probe(make_subject(layer, d_model=16, num_heads=2), causal=causal, scale=None, seq_len=seq_len, seed=0)


@pytest.mark.parametrize("seq_len", [2, 3, 16])
def test_decoding_tokens_are_scaled_by_the_logit_gain_from_3_tokens(seq_len):
    """decoding_inputs: `logit_gain` times the probe's draws from T = 3 on, unscaled at T = 2."""
    probe = probe_of(faint, seq_len)
    x = decoding_inputs(probe)
    g = logit_gain(probe) if seq_len >= 3 else 1.0
    assert g > 3 if seq_len >= 3 else g == 1.0  # about sqrt(2 / 0.05) = 6.3 (4.2-6.0 here): scaled and unscaled differ
    again = probe_of(faint, seq_len)
    B, T = again.BATCH, again.t
    drawn = [again.make(B, T) for _ in range(3)]  # the draws decoding_inputs scales, in its order
    for got, want in zip((x.query, x.key, x.value), drawn):
        torch.testing.assert_close(got, g * want)


@pytest.mark.parametrize("seq_len", [2, 3])
def test_decoding_makes_its_partial_calls_from_3_tokens(seq_len):
    """_decoding_calls: the full pass, then one call per split (decode_splits(3) = [1, 2, 2]) from T = 3 on; the full
    pass alone at T = 2."""
    calls = decoding_calls(probe_of(attention, seq_len))
    assert [n for n, _ in calls] == ([3, 1, 2, 2] if seq_len == 3 else [2])
    assert all(c.ok for _, c in calls)


def test_a_stacks_baseline_is_copy_0_of_the_stacked_call_weights_included():
    """stacked_baseline: the output and weights split along the stacked batch, copy 0 kept; weights not split along
    it are dropped (not this copy's)."""
    probe = probe_of(attention, 8, causal=False)
    call = stacked_baseline(probe, PADDED)
    B = probe.BATCH
    assert call.output.out.shape[0] == B and call.output.weights is not None and call.output.weights.shape[0] == B
    # the call's mask is the audit's (B, Tq, Tk); the layer was given it as (B, 1, Tq, Tk), broadcast over heads
    out, weights = attention(call.query, call.key, call.value, call.allowed[:, None])
    torch.testing.assert_close(call.output.weights, weights)
    torch.testing.assert_close(call.output.out, out)

    def shared_weights(q, k, v, mask=None):  # one (H, Tq, Tk) map for the whole batch: not split along it
        out, w = attention(q, k, v, mask)
        return out, w[0]

    whole = stacked_baseline(probe_of(shared_weights, 8, causal=False), PADDED)
    assert whole.output.out.shape[0] == B and whole.output.weights is None


# ---- attention_pattern: its budgets of copies, the decoding branch, one-stream pairs --------------------------


def test_the_full_pass_reads_every_class_up_to_9_and_9_classes_above():
    """MAX_COPIES = 9: sliding_window(7)'s widest row spans 7 keys, p = 7 + 2 = 9 classes, each read in every
    sequence; sliding_window(8) has p = 10, of which 9 per sequence are read."""
    narrow = verdict(attention, "attention_pattern", pattern=patterns.sliding_window(7))
    wide = verdict(attention, "attention_pattern", pattern=patterns.sliding_window(8))
    assert narrow.verdict == wide.verdict == "pass", (narrow, wide)
    assert "9 copies, each sequence's keys j % 9 == r changed (every class r < 9;" in narrow.evidence, narrow
    assert "9 copies, each sequence's keys j % 10 == r changed (9 of the 10 classes r per sequence" in wide.evidence


def test_a_decoder_is_measured_decoding_in_2_classes_and_a_bidirectional_layer_is_not():
    """DECODE_COPIES = 2, and check_attention_pattern's branch: a causal audit of a layer with a separate query
    measures the last 16 // 3 = 5 queries over 16 keys too, in 2 of the 9 classes (sliding_window(7)); a layer
    audited as not causal is not measured decoding."""
    pattern = patterns.sliding_window(7)
    decoder = verdict(attention, "attention_pattern", pattern=pattern, causal=True)
    assert decoder.verdict == "pass" and decoder.message.endswith("(and while decoding)"), decoder
    assert ("2 copies, each sequence's keys j % 9 == r changed (2 of the 9 classes r per sequence" in decoder.evidence
            and "the last 5 of 16 positions querying" in decoder.evidence), decoder
    plain = verdict(attention, "attention_pattern", pattern=pattern)
    assert plain.verdict == "pass" and not plain.message.endswith("(and while decoding)"), plain
    assert "querying" not in plain.evidence, plain


def test_a_decoder_that_fails_the_full_pass_is_judged_on_it():
    """check_attention_pattern: a finding of the full pass is the verdict (the decoding measurement is not made): a
    window of 8 keys where 7 are declared leaks at every row, decoding or not."""
    found = verdict(windowed(8), "attention_pattern", pattern=patterns.sliding_window(7), causal=True)
    assert found.verdict == "fail", found
    assert found.message == "outputs depend on keys the declared pattern blocks (leakage): sliding_window(7)", found
    assert "querying" not in found.evidence, found


def test_a_one_stream_layer_counts_the_pairs_of_its_own_class_as_not_measurable():
    """_read: a one-stream layer's perturbed token is its query too, so the cells (i, j) with j % p == i % p are read
    by no copy. sliding_window(7) at T = 16, p = 9: classes 0-6 hold two positions (r and r + 9), 7 and 8 one, so
    14 rows x 2 + 2 rows x 1 = 30 pairs per sequence, 60 in the probe's 2 sequences."""
    result = verdict(OneStream(), "attention_pattern", pattern=patterns.sliding_window(7))
    assert result.verdict == "pass", result
    assert "; 60 pairs not measurable (a one-stream layer's own position moves with its query)" in result.evidence


# ---- output_variance with keys of the layer's own -----------------------------------------------------------------


class MemorySlots(nn.Module):
    """forward(query, key, value, mask=None): attention over 2 learned key/value slots prepended to the keys;
    `dim`: the axis the softmax normalises (-1: the keys; -2: the queries, a bug); `returns_weights`: also return
    the weights over the input's keys (the slots' columns dropped: rows then sum to less than 1)."""

    def __init__(self, dim=-1, d_model=8, num_heads=2, slots=2, returns_weights=False):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.dim, self.returns_weights = d_model, num_heads, dim, returns_weights
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.mem_k, self.mem_v = (nn.Parameter(torch.randn(num_heads, slots, d_model // num_heads)) for _ in range(2))

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        H = self.num_heads
        split = lambda t: t.view(B, t.shape[1], H, -1).transpose(1, 2)  # (B, T, D) -> (B, H, T, d)
        q, k, v = split(self.q(query)), split(self.k(key)), split(self.v(value))
        k = torch.cat([self.mem_k.expand(B, -1, -1, -1), k], 2)  # (B, H, n + Tk, d)
        v = torch.cat([self.mem_v.expand(B, -1, -1, -1), v], 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, n + Tk)
        if mask is not None:
            s = s.masked_fill(~nn.functional.pad(mask, (k.shape[-2] - mask.shape[-1], 0), value=True), float("-inf"))
        w = s.softmax(dim=self.dim)
        out = self.o((w @ v).transpose(1, 2).reshape(B, Tq, D))
        return (out, w[..., -key.shape[1]:]) if self.returns_weights else out  # the input's Tk keys: the last columns


class MemorySlotsWithoutMask(MemorySlots):
    """MemorySlots called as forward(query, key, value): weight_row_sums reads its standard (observed) call."""

    def forward(self, query, key, value):
        return super().forward(query, key, value)


def test_output_variance_fails_learned_keys_under_a_softmax_over_the_queries_and_passes_it_over_the_keys():
    """output_variance's learned-keys branch (`_judged_with_learned_keys`): the weights over the input's and the
    layer's keys must come from a softmax over the keys."""
    queries = verdict(MemorySlots(dim=-2), "output_variance")
    assert queries.verdict == "fail", queries
    assert queries.message.endswith("the softmax does not normalise over the keys"), queries
    keys = verdict(MemorySlots(dim=-1), "output_variance")
    assert keys.verdict == "pass", keys


# ---- CONVEX per dtype: output_variance -------------------------------------------------------------------------

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
CONVEX = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 6e-2}


def rows_summing_to(total: float):
    """The reference with every row of weights scaled to sum to `total`: identical value rows come out x `total`."""

    def layer(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)
        return out * total, weights * total

    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_output_variance_allows_a_quarter_of_convex_and_fails_three_times_it(dtype):
    """The reading is the row-sum error times |v| / RMS(v), between 1 and sqrt(d) = 2.8 times it (d = 8): a layer off by
    3x CONVEX reads 3-8.5x it (fails, and would pass at 10x CONVEX; its float64 copy reads the same, so the replay
    does not excuse it), one off by a quarter of it over sqrt(d) stays inside (tests/test_thresholds.py's twin sits
    on ROW_SUM, over which a tenfold CONVEX passes nothing new)."""
    tol = CONVEX[dtype]
    inside = verdict(rows_summing_to(1 + 0.25 * tol / math.sqrt(8)), "output_variance", dtype=dtype)
    outside = verdict(rows_summing_to(1 + 3 * tol), "output_variance", dtype=dtype)
    assert inside.verdict == "pass", inside
    assert outside.verdict == "fail" and outside.threshold == pytest.approx(tol), outside
    assert 3 * tol * 0.9 < outside.value < 10 * tol, outside


# ---- the model wing: where a layer's window is read ---------------------------------------------------------------


@pytest.mark.parametrize("idx, expected", [
    (0, ("sliding_window(4)", "config.layer_types[0] = 'sliding_attention', config.sliding_window = 4")),
    (1, None),  # a full-attention layer of a config that also names a window and a chunk
    (2, ("chunked(8)", "config.layer_types[2] = 'chunked_attention', config.attention_chunk_size = 8")),
    (3, ("sliding_window(4)", "config.sliding_window = 4")),  # past the list: the config's own window
])
def test_a_layers_pattern_is_read_from_its_own_entry_of_config_layer_types(idx, expected):
    """declared_pattern: config.layer_types[layer_idx] says which of the config's patterns the layer has, for an
    index inside the list only."""
    config = SimpleNamespace(layer_types=["sliding_attention", "full_attention", "chunked_attention"],
                             sliding_window=4, attention_chunk_size=8)
    declared = declared_pattern(SimpleNamespace(config=config, layer_idx=idx))
    assert (None if declared is None else (str(declared.pattern), declared.source)) == expected


class CacheDropped(ProtocolGPT):
    """A decoder with the Hugging Face keyword protocol that, asked for its cache, returns None in its place."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        return (out[0], None) if use_cache else out


@pytest.mark.parametrize("model, expected", [(ProtocolGPT, "pass"), (CacheDropped, "skip")], ids=["cache", "none"])
def test_cache_parity_is_not_measured_on_a_model_that_returns_no_cache(model, expected):
    """check_cache_parity's guard: no cache with use_cache=True is a visible skip (its twin, the same decoder with
    its cache, passes)."""
    seed_rng(0)
    found = diagnostics.audit_model(model(n_layer=1, d_model=16, num_heads=2), detectors=["cache_parity"])
    result = found.result("cache_parity")
    assert result.verdict == expected, result
    if expected == "skip":
        assert result.message == "not measured: the model returned no cache with use_cache=True", result


def test_weight_row_sums_judges_the_weights_a_layer_returns_before_its_learned_keys():
    """check_weight_row_sums' first line: the layer's learned keys are read only where it returns no weights. Weights
    returned over the input's keys alone (the slots' share dropped) are judged as returned: not a distribution; the
    same layer returning none is judged on its observed softmax over the keys and the slots."""
    returned = verdict(MemorySlotsWithoutMask(returns_weights=True), "weight_row_sums")
    assert returned.verdict == "fail" and returned.message.endswith("(returned weights)"), returned
    observed = verdict(MemorySlotsWithoutMask(), "weight_row_sums")
    assert observed.verdict == "pass" and "2 learned key/value slots" in observed.message, observed


def test_a_window_one_too_short_is_over_masking_and_the_declared_one_is_read_unmoved_where_it_blocks():
    """_read: a row that does not move when its one allowed key in a copy changed ignores that key (over-masking,
    once confirmed); rows that do not move where every key changed is blocked count as blocked pairs read unmoved."""
    short = verdict(windowed(6), "attention_pattern", pattern=patterns.sliding_window(7))
    assert short.verdict == "fail", short
    assert short.message == "outputs ignore keys the declared pattern allows (over-masking): sliding_window(7)", short
    right = verdict(attention, "attention_pattern", pattern=patterns.sliding_window(7))
    allowed = [{j for j in range(16) if 0 <= i - j < 7} for i in range(16)]
    blocked = 2 * sum(16 - len(a) for a in allowed)  # the probe's 2 sequences
    # read: a blocked key whose class (j % 9) holds none of the row's allowed keys (in its copy the row meets none)
    read = 2 * sum(j not in a and all(x % 9 != j % 9 for x in a) for a in allowed for j in range(16))
    assert right.verdict == "pass" and f"{read} / {blocked} blocked pairs measured unmoved" in right.evidence, right


@pytest.mark.parametrize("seq_len, how", [(16, "between two sequences of other lengths (right-padded)"),
                                          (3, "between two sequences of other lengths (right-padded)"),
                                          (2, "between two other inputs")], ids=["16", "3", "2"])
def test_batch_invariance_pads_the_other_sequences_from_3_tokens_where_the_model_takes_a_padding_mask(seq_len, how):
    """check_batch_invariance: a model that takes an attention mask is measured between right-padded sequences of
    other lengths from 3 tokens on (one padded token fewer than a third of them, one padded token), between other
    inputs below that and in a model that takes no mask; the audit of batch_invariance alone makes its own
    single-sequence forward (cache_parity's is not there to reuse)."""
    seed_rng(0)
    report = diagnostics.audit_model(ProtocolGPT(n_layer=1, d_model=16, num_heads=2), seq_len=seq_len,
                                     detectors=["batch_invariance"])
    result = report.result("batch_invariance")
    assert (result.verdict, result.message) == ("pass", f"a sequence alone gives its output {how}"), result


def test_batch_invariance_of_a_model_without_a_padding_mask_is_measured_between_other_inputs():
    seed_rng(0)
    result = diagnostics.audit_model(TinyGPT(n_layer=1, d_model=16, num_heads=2),
                                     detectors=["batch_invariance"]).result("batch_invariance")
    assert (result.verdict, result.message) == ("pass", "a sequence alone gives its output between two other inputs")


# ---- gradients: a disagreement of exactly 0 ---------------------------------------------------------------------


def test_gradients_words_an_exact_agreement_of_zero():
    """check_gradients' digits: a layer whose output is 0 everywhere has gradient 0 and finite differences 0, a
    disagreement of exactly 0 (whose log10 would raise): a pass that says so; the reference's is above 0."""
    zero = verdict(lambda q, k, v, mask=None: (0 * attention(q, k, v, mask)[0], None), "gradients")
    assert zero.verdict == "pass" and zero.value == 0.0 and "disagreement 0 of |grad|" in zero.evidence, zero
    assert verdict(attention, "gradients").value > 0


def test_a_findings_picture_is_32_keys_by_32_rows_around_its_first_cell():
    """PICTURE_CELLS = 32: at 40 tokens, the picture of a window one too long is measured on 32 of the 40 keys and
    rows (one copy of the batch per key: its cost bound), where 3.2 would draw 3 and 320 all 40."""
    found = verdict(windowed(8), "attention_pattern", pattern=patterns.sliding_window(7), seq_len=40)
    assert found.verdict == "fail", found
    assert tuple(found.extras["dependency_map"].declared.shape) == (32, 32), found.extras


# ---- output_shape: which call with Tq != Tk it reads ------------------------------------------------------------


def rows_per_key(q, k, v, mask=None):
    """The reference, except that given fewer queries than keys it returns a row per key (its keys as queries)."""
    return attention(k, k, v) if q.shape[-2] != k.shape[-2] else attention(q, k, v, mask)


@pytest.mark.parametrize("seq_len, read", [
    (4, "query length 3, memory length 4: output (2, 2, 4, 8), expected (2, 2, 3, 8)"),
    (3, "query length 2, memory length 3: output (2, 2, 3, 8), expected (2, 2, 2, 8)"),
    (2, "query length 2, memory length 5: output (2, 2, 5, 8), expected (2, 2, 2, 8)")])
def test_output_shape_reads_decodings_last_call_from_3_tokens_and_a_longer_memory_below(seq_len, read):
    """check_output_shape: for a causal layer from 3 tokens on (`T >= 3`: at 3 and above it, 4), decode_consistency's
    last call (the newest T - 1 queries over every key); below that (no partial calls), a memory 3 tokens longer
    than the queries."""
    wrong = verdict(rows_per_key, "output_shape", causal=True, seq_len=seq_len)
    assert wrong.verdict == "fail" and read in wrong.evidence, wrong
    assert verdict(attention, "output_shape", causal=True, seq_len=seq_len).verdict == "pass"


@pytest.mark.parametrize("broken", [False, True], ids=["reference", "missing causal mask"])
def test_gradient_flow_fails_a_model_whose_layer_reads_the_future_and_passes_its_twin(broken):
    """check_gradient_flow's finding: past outputs send gradient to later inputs in a decoder with one layer's
    causal mask missing; none in the reference."""
    seed_rng(0)
    model = TinyGPT(n_layer=2, d_model=16, num_heads=2)
    if broken:
        inject(model, 1, VARIANTS["missing_causal_mask"])
    result = diagnostics.audit_model(model, detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == ("fail" if broken else "pass"), result
    if broken:
        assert result.message.startswith("the gradient lets the future in"), result


class Measured(nn.Module):
    """An in-place wrapper as `infer_causal` reads it (`inner`, `is_self_attention()`, `d_model`, `block_size`)
    around `f(x)` on (1, T, D); `says`: the wrapped layer's own `is_causal` (None: it carries none)."""

    def __init__(self, f, *, self_attention: bool = True, block_size: int = 8, says=None):
        super().__init__()
        self.f, self.self_attention, self.d_model, self.block_size = f, self_attention, 4, block_size
        self.inner = SimpleNamespace(is_causal=says) if says is not None else SimpleNamespace()

    def is_self_attention(self) -> bool:
        return self.self_attention

    def forward(self, x):
        return self.f(x)


def prefix_sums(x):
    return x.cumsum(1)  # position t reads positions <= t: masks the future


def whole_mean(x):
    return x + x.mean(1, keepdim=True)  # every position reads every other: the past moves


def last_reads_itself(x):
    """Position t's own input only at 0..T/2 and at T-1; zero in between: of the later outputs, only the last moves."""
    keep = torch.ones(x.shape[1], 1)
    keep[x.shape[1] // 2 + 1:-1] = 0
    return x * keep


def first_reads_last(x):
    """Each position its own input, position 0 also the last one: of the past outputs, only the first moves."""
    out = x.clone()
    out[:, 0] += x[:, -1]
    return out


@pytest.mark.parametrize("f, expected", [
    (prefix_sums, True), (whole_mean, False), (torch.zeros_like, None),  # zeros: nothing later moved, not measured
    (last_reads_itself, True),  # one later output moving is enough to measure
    (first_reads_last, False),  # one past output moving is enough to see the future read
    (lambda x: (x,), None),  # not a tensor
    (lambda x: x.sum(), None), (lambda x: x.sum(-1)[0], None),  # fewer than 2 dimensions
    (lambda x: x.cumsum(1).sum(-1), None),  # (1, T): no features to compare per position (it raised IndexError)
    (lambda x: torch.cat([x, x[:, :1]], 1), None),  # not T positions
])
def test_masks_future_needs_one_later_output_moved_and_no_earlier_one(f, expected):
    """model/_causal.py `masks_future`: its two `.any()`s (any -> all), the comparisons against UNCHANGED, the
    output-kind guard."""
    assert _causal.masks_future(Measured(f), 8, 4, torch.float32, 0) is expected


RUNNER = SimpleNamespace(encoder_decoder=False)


def inferred(wrappers: dict, *, causal=None, model=None, runner=RUNNER):
    return _causal.infer_causal(model if model is not None else nn.Module(), causal, runner, wrappers, T=8,
                                dtype=torch.float32, seed=0)


def test_a_model_is_causal_when_more_than_half_its_measured_layers_mask_the_future():
    """model/_causal.py `infer_causal`'s majority rule (`2 * masking > measured`, `masking < measured` naming the
    layers that do not): 2 of 3 is causal and names the third; 3 of 3 names none; 1 of 2 and 0 of 2 are not."""
    two_of_three = inferred({"a": Measured(prefix_sums), "b": Measured(prefix_sums), "c": Measured(whole_mean)})
    assert two_of_three == (True, "measured: 2 of 3 attention layers mask the future themselves (c does not: "
                                  "audited as causal)")
    assert inferred({"a": Measured(prefix_sums), "b": Measured(prefix_sums)}) == (
        True, "measured: 2 of 2 attention layers mask the future themselves")
    for wrappers in ({"a": Measured(prefix_sums), "b": Measured(whole_mean)},
                     {"a": Measured(whole_mean), "b": Measured(whole_mean)}):
        said, how = inferred(wrappers)
        assert said is False and how.startswith("assumed: nothing says the model is causal"), how


def test_only_self_attention_layers_at_the_models_length_are_measured():
    """`infer_causal`'s `is_self_attention() and block_size == T`: a cross-attention layer and one captured at
    another length are not measured (here they would outvote the one that is)."""
    others = {"x": Measured(whole_mean, self_attention=False), "y": Measured(whole_mean, block_size=6)}
    assert inferred({"a": Measured(prefix_sums), **others})[0] is True
    assert inferred(others)[0] is False


def test_layers_that_all_say_is_causal_make_the_model_causal_and_some_or_none_do_not():
    """`own and all(is_causal is True)`: every self-attention layer saying so is causal; one of two saying so is
    not (measured instead); no self-attention layer at all is not."""
    assert inferred({"a": Measured(whole_mean, says=True), "b": Measured(whole_mean, says=True)}) == (
        True, "inferred: its 2 self-attention layers say is_causal = True")
    assert inferred({"a": Measured(whole_mean, says=True), "b": Measured(whole_mean)})[0] is False
    assert inferred({"x": Measured(prefix_sums, self_attention=False)})[0] is False


ENC_DEC = SimpleNamespace(encoder_decoder=True, takes=lambda name: name == "decoder_input_ids")


def test_an_encoder_decoder_is_causal_unless_all_its_decoder_self_attention_layers_say_is_causal_false():
    """`infer_causal`'s encoder-decoder branch: all decoder layers `is_causal = False` overrule the family; one
    of two does not; encoder layers saying it do not; nor does it overrule a `causal=` the caller gave."""
    said = inferred({"model.decoder.0": Measured(prefix_sums, says=False),
                     "model.decoder.1": Measured(prefix_sums, says=False)}, runner=ENC_DEC)
    assert said == (False, "inferred: an encoder-decoder whose 2 decoder self-attention layers say is_causal = False "
                           "(a non-autoregressive decoder)")
    mixed = {"model.decoder.0": Measured(whole_mean, says=False), "model.decoder.1": Measured(whole_mean)}
    assert inferred(mixed, runner=ENC_DEC)[0] is True
    assert inferred({"model.encoder.0": Measured(whole_mean, says=False)}, runner=ENC_DEC)[0] is True
    decoder_says_no = {"model.decoder.0": Measured(whole_mean, says=False)}
    assert inferred(decoder_says_no, runner=ENC_DEC, causal=True) == (True, "as given")
    declares = SimpleNamespace(config=SimpleNamespace(is_decoder=True))  # declared otherwise than by its family
    assert inferred(decoder_says_no, runner=ENC_DEC, model=declares) == (True, "inferred: config.is_decoder")


def test_an_encoder_decoder_without_decoder_inputs_is_not_declared_causal():
    """`declared_causal`'s encoder-decoder branch needs decoder inputs to be what changes: a model whose config says
    is_encoder_decoder but whose forward takes no decoder_input_ids (FastSpeech 2: its decoder reads the encoder's
    output stretched by durations) generates nothing token by token, so nothing declares it causal and its layers are
    measured (before: assumed causal, and its bidirectional decoder failed future_leakage). Twin: one that takes them
    is declared causal."""
    no_decoder_inputs = SimpleNamespace(encoder_decoder=True, takes=lambda name: False)
    assert _causal.declared_causal(nn.Module(), None, no_decoder_inputs) == (None, "")
    assert _causal.declared_causal(nn.Module(), None, ENC_DEC) == (
        True, "inferred: an encoder-decoder, whose decoder is causal (the decoder inputs are what changes)")


def test_a_config_that_says_is_decoder_false_declares_nothing():
    """`declared_causal`'s `config is not None and config.is_decoder is True`."""
    not_decoder = SimpleNamespace(config=SimpleNamespace(is_decoder=False))
    assert _causal.declared_causal(not_decoder, None, RUNNER) == (None, "")
    assert _causal.declared_causal(SimpleNamespace(config=SimpleNamespace(is_decoder=True)), None, RUNNER)[0] is True


def one_batch_size(f):
    """`f` raising on any batch but the audit's own (2): the stacked full pass of decoding raises, nothing else."""
    def layer(q, k, v, mask=None):
        if q.shape[0] != Probe.BATCH:
            raise ValueError("one batch size only")
        return f(q, k, v, mask)
    return layer


def test_output_shape_of_a_decoder_whose_full_pass_raised_is_read_on_a_memory_3_tokens_longer():
    """check_output_shape's `len(decoded) > 1`: decoding's calls are only its full pass when that raised; then the
    shape is still measured, on a memory 3 tokens longer (not skipped on the full pass that raised)."""
    assert verdict(one_batch_size(attention), "output_shape", causal=True).verdict == "pass"
    wrong = verdict(one_batch_size(rows_per_key), "output_shape", causal=True)
    assert wrong.verdict == "fail" and "query length 16, memory length 19" in wrong.evidence, wrong


class MaskRaises(nn.Module):
    """The reference, raising RuntimeError("boom") (no word of masks) when given `key_padding_mask`, or always."""

    def __init__(self, *, always: bool = False):
        super().__init__()
        self.d_model, self.num_heads, self.always = 16, 2, always
        torch.manual_seed(0)
        self.inner = MultiHeadAttention(16, 2)

    def forward(self, x, key_padding_mask=None):
        if key_padding_mask is not None or self.always:
            raise RuntimeError("boom")
        return self.inner(x)


def test_runs_hints_at_the_mask_convention_when_only_calls_with_a_mask_raised():
    """runs' `_mask_hint`: calls without a mask ran (`not s.raised`), so the convention the audit gave is named in
    the fix even though the error says nothing of masks; a layer raising on every call gets no such hint."""
    masked_only = verdict(MaskRaises(), "runs")
    assert masked_only.verdict == "fail" and masked_only.fix.startswith("the audit gave `key_padding_mask` as "
                                                                        "key_padding"), masked_only.fix
    always = verdict(MaskRaises(always=True), "runs")
    assert always.verdict == "fail" and always.fix.startswith("make the layer run on every input"), always.fix


class KeepPerKey(nn.Module):
    """The reference taking a (B, Tk) keep mask (True = attend) as its undocumented `mask`: the audit's default
    (B, 1, Tq, Tk) mask makes it raise."""

    def __init__(self):
        super().__init__()
        self.d_model, self.num_heads = 16, 2
        torch.manual_seed(0)
        self.inner = MultiHeadAttention(16, 2)

    def forward(self, x, mask=None):
        return self.inner(x, mask=None if mask is None else mask[:, None, None, :])


def test_runs_names_the_declaration_a_layer_raising_only_on_the_default_mask_needs():
    """runs' `_needed_declaration`: calls without a mask ran (`not shape.raised`) and the mask in another
    convention is honoured, so runs is a skip naming it; declared, runs passes."""
    needed = verdict(KeepPerKey(), "runs")
    assert needed.verdict == "skip" and needed.message.startswith("needs a declaration, mask='key_keep'"), needed
    assert verdict(KeepPerKey(), "runs", mask="key_keep").verdict == "pass"


def correct_then_sharpened(gain: float):
    """The reference's attention averaged with a second one whose q·k is scaled by `gain` / sqrt(d_k): two softmaxes,
    the first one right."""
    def layer(q, k, v, mask=None):
        out, _ = attention(q, k, v, mask)
        weights = (gain * q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)  # (B, H, Tq, Tk)
        return (out + weights @ v) / 2
    return layer


def test_softmax_saturation_judges_the_worst_of_a_layers_softmaxes():
    """check_softmax_saturation's `max(rows, key=|log(|ratio| or 1e-300)|)`: the second softmax 1.5x too sharp
    (SCALE_RATIO 1.25 exceeded) fails although the first one is right; both right passes."""
    assert verdict(correct_then_sharpened(1.0), "softmax_saturation").verdict == "pass"
    sharp = verdict(correct_then_sharpened(1.5), "softmax_saturation")
    assert sharp.verdict == "fail" and sharp.value == pytest.approx(1.5, rel=1e-3), sharp


@pytest.mark.parametrize("seq_len, second_column", [(10, True), (9, False)])
def test_sliding_window_reads_column_w_minus_1_where_a_row_past_its_window_exists(seq_len, second_column):
    """check_sliding_window's `s > 0 and s + w >= T`: beside column 0, column w - 1 is read where a row past its window
    exists (s + w < T: T = 10 for w = 5), and not where none does (T = 9)."""
    seed_rng(0)
    window = diagnostics.audit_model(ProtocolGPT(sliding_window=5), detectors=["sliding_window"],
                                     seq_len=seq_len).result("sliding_window")
    assert window.verdict == "pass" and "s=0: t=0..4 moved" in window.evidence, window
    assert ("s=4: t=4..8 moved" in window.evidence) is second_column, window.evidence


def test_eval_determinism_reads_batch_independences_second_call_where_sequence_0_held():
    """check_eval_determinism: a layer whose sequence 0 did not move when sequence 1 changed (`B > 1`, no change
    `> tol` in row 0) is judged on that second call, as its evidence says; a layer that mixes the batch is not
    (its verdict comes from a call of its own)."""
    held = verdict(attention, "eval_determinism")
    assert held.verdict == "pass" and "in a second call (batch_independence's" in held.evidence, held

    def mixes_the_batch(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)  # (B, H, Tq, d)
        return out + out.mean(0, keepdim=True), weights

    mixed = verdict(mixes_the_batch, "eval_determinism")
    assert mixed.verdict == "pass" and "batch_independence's" not in mixed.evidence, mixed


# ---- seed 777's survivors: batch_independence, mask_honoured, fully_masked_rows, output_variance -------------------


class RaisesUnderGrad(OneStream):
    """OneStream, raising where grad mode is on (`raises`): the standard probe's call (observed, under grad mode)
    raises, batch_independence's seeded second call does not."""

    def __init__(self, raises=True):
        super().__init__()
        self.raises = raises

    def forward(self, x, mask=None):
        if self.raises and torch.is_grad_enabled():
            raise RuntimeError("no grad mode here")
        return super().forward(x, mask)


@pytest.mark.parametrize("raises", [True, False])
def test_batch_independence_is_not_run_when_the_standard_probe_raised_and_judged_when_it_did_not(raises):
    """check_batch_independence's first guard (`not standard.ok`): without it the check would go on to the second
    call, which runs, and read an output the standard probe never gave."""
    found = verdict(RaisesUnderGrad(raises), "batch_independence")
    if raises:
        assert (found.verdict, found.message) == ("skip", "not measured: the layer raised on this detector's probe "
                                                          "(RuntimeError: no grad mode here); see `runs`"), found
    else:
        assert found.verdict == "pass", found


def test_batch_independence_skips_an_output_whose_first_axis_is_not_the_batch_and_judges_one_whose_is():
    """check_batch_independence's shape guard, `old.shape != new.shape or old.shape[0] != B`: the two calls' outputs
    have one shape (16, 2, 2, 8), whose first axis is the time, not the batch of 2: skipped (with `and`, judged along
    the wrong axis); its twin, the same output untransposed, passes."""

    def time_first(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)  # (B, H, T, d)
        return out.transpose(0, 2), weights  # (T, H, B, d)

    skipped = verdict(time_first, "batch_independence")
    assert (skipped.verdict, skipped.message) == ("skip", "not measured: the output (16, 2, 2, 8) does not keep the "
                                                          "batch"), skipped
    assert verdict(attention, "batch_independence").verdict == "pass"


def own_window(W: int, *, honours_mask: bool = True):
    """The reference under its own window (|i - j| < W) as well as the mask it is passed (`honours_mask`), or in place
    of it: key 0 is out of reach of the queries from t = W on, though the padding mask lets them attend it."""

    def layer(q, k, v, mask=None):
        i, j = torch.arange(q.shape[-2]).unsqueeze(-1), torch.arange(k.shape[-2])
        window = (i - j).abs() < W  # (Tq, Tk)
        allowed = window if mask is None or not honours_mask else mask & window
        return attention(q, k, v, allowed=lambda t_q, t_k: allowed)

    return layer


@pytest.mark.parametrize("honours_mask", [True, False])
def test_mask_honoured_passes_a_layer_whose_own_window_keeps_some_queries_from_key_0_and_fails_it_maskless(
        honours_mask):
    """allowed_key_reading: the control (key 0 changed alone) reads as moved where ANY row that may attend key 0
    moved. A layer with a window of its own (W = 4) moves the rows t < 4 only: with `.all()` the control reads as not
    moved, and the padding mask looks backwards (a fail). Its twin ignores the mask (the window alone): it fails
    because blocked keys move outputs."""
    found = verdict(own_window(4, honours_mask=honours_mask), "mask_honoured")
    if honours_mask:
        assert found.verdict == "pass", found
    else:
        assert found.verdict == "fail" and found.message.startswith("outputs depend on keys the mask blocks"), found


def test_fully_masked_rows_warns_with_the_one_empty_row_as_its_value_and_fails_nan_beyond_it():
    """check_fully_masked_rows' warning: a plain softmax gives NaN in the one query with no key (b=0, t=8), value 1.0
    over a threshold of 0.0; the twin whose mask reaches the output after the softmax fails."""
    warned = verdict(attention, "fully_masked_rows")
    assert (warned.verdict, warned.value, warned.threshold) == ("warn", 1.0, 0.0), warned

    def after_softmax(q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        weights = scores.softmax(-1)
        weights = weights if mask is None else weights.masked_fill(~mask, float("-inf"))  # the bug
        return weights @ v, weights

    failed = verdict(after_softmax, "fully_masked_rows")
    assert failed.verdict == "fail" and failed.message == "NaN spreads beyond the query whose every key is masked"


class ShortRaises(OneStream):
    """OneStream raising on a call of one token (`raises`), as a layer that needs two to build its positions might."""

    def __init__(self, raises=True):
        super().__init__()
        self.raises = raises

    def forward(self, x, mask=None):
        if self.raises and x.shape[1] < 2:
            raise ValueError("needs at least 2 tokens")
        return super().forward(x, mask)


@pytest.mark.parametrize("raises", [True, False])
def test_output_variance_is_not_run_when_its_one_token_call_raised_and_judged_when_it_did_not(raises):
    """check_output_variance's guard on its two calls (`for c in (call, reference): if not c.ok`): the identical
    tokens run, the one token alone raises: not run, with the error (without the guard, its missing output raised)."""
    found = verdict(ShortRaises(raises), "output_variance")
    if raises:
        assert (found.verdict, found.message) == ("skip", "not measured: the layer raised on this detector's probe "
                                                          "(ValueError: needs at least 2 tokens); see `runs`"), found
    else:
        assert found.verdict == "pass", found


class Residual(nn.Module):
    """x + attention(x): a block whose output carries each query; `variant`: the attention of buggy_variants."""

    def __init__(self, variant=None):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads = 16, 2
        self.attn = (VARIANTS[variant].cls if variant else MultiHeadAttention)(16, 2)

    def forward(self, x, mask=None):
        out, _ = self.attn(x, x, x, mask)
        return x + out


@pytest.mark.parametrize("variant", [None, "no_softmax"])
def test_output_variance_judges_a_residual_block_on_its_attentions_output(variant):
    """_judged_inside: a residual block's output differs between identical tokens by the query it carries; its
    attention's own output (the add's operand) is compared with that for one token alone, when the two operands
    have the same batch and width (`alone.inner.shape[::2] != block.inner.shape[::2]`: otherwise the output's fail
    stands). The correct attention passes; without a softmax it fails inside the block."""
    found = verdict(Residual(variant), "output_variance")
    if variant is None:
        assert (found.verdict, found.message) == ("pass", "identical value rows come out unchanged"), found
    else:
        assert found.verdict == "fail" and found.message.startswith("the attention inside the block does not output "
                                                                    "a convex combination of the values"), found


def test_future_leakage_reads_a_padding_mask_once_for_a_function_and_once_for_a_module():
    """padded_cut_cases: a causal audit's cut under the padding mask is one of the stack's cases for a module, and
    not for a function (`form == "function"`), which future_leakage probes in its own call: one reading each."""
    for layer in (attention, OneStream()):
        found = verdict(layer, "future_leakage", causal=True)
        assert found.verdict == "pass" and found.evidence.count("a padding mask:") == 1, found.evidence


def test_undeclared_causality_is_not_run_when_the_standard_probe_raised():
    """check_undeclared_causality's first guard (`not base.ok`): otherwise it reads no weights and says so."""

    def raises(q, k, v, mask=None):
        raise RuntimeError("always")

    found = verdict(raises, "undeclared_causality")
    assert (found.verdict, found.message) == ("skip", "not measured: the layer raised on this detector's probe "
                                                      "(RuntimeError: always); see `runs`"), found
    assert verdict(attention, "undeclared_causality").verdict == "pass"


# ---- seed 777's sample, the rest: the gradient probe's padding mask, attention_pattern's zero output ---------------


def softmax_then_mask(q, k, v, mask=None):
    """The mask applied after the softmax normalised over every key: a blocked key gets no weight but still moves
    the others' through the normalisation, so it receives gradient."""
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)
    weights = weights if mask is None else weights.masked_fill(~mask, 0.0)  # the bug
    return weights @ v, weights


@pytest.mark.parametrize("seq_len", [2, 3])
def test_gradients_check_a_padded_key_from_3_tokens(seq_len):
    """_gradient_probe's `T >= 3` (T = min(seq_len, GRADIENT_TOKENS)): from 3 tokens the gradient probe blocks the
    last key and checks it gets exactly zero gradient, so masking after the softmax fails at 3 (with `T > 3` it would
    pass) while the reference passes and says what it checked; at 2 tokens no key is padded (every query keeps a
    choice of keys only from 3) and both pass."""
    bug = verdict(softmax_then_mask, "gradients", seq_len=seq_len)
    right = verdict(attention, "gradients", seq_len=seq_len)
    assert right.verdict == "pass", right
    if seq_len == 3:
        assert bug.verdict == "fail" and bug.message.startswith("masked keys receive gradient"), bug
        assert right.evidence.endswith("keys a padding mask blocks get exactly zero gradient"), right.evidence
    else:
        assert bug.verdict == "pass" and "padding mask" not in right.evidence, (bug, right.evidence)


def test_attention_pattern_skips_an_output_that_is_zero_everywhere_and_judges_the_same_weights_output():
    """attention_pattern's `_run`: `if not scale > 0` (the baseline's output is zero or non-finite everywhere) skips
    with the reason, where a change measured against a zero scale would read every row as unmoved (or divide by 0);
    the same weights with their output kept pass."""

    def zero(q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)
        return out * 0, weights

    window = patterns.sliding_window(4)
    skipped = verdict(zero, "attention_pattern", pattern=window)
    assert (skipped.verdict, skipped.message) == ("skip", "not measured: the output is zero or non-finite everywhere "
                                                          "on this probe, so a change cannot be measured against it")
    assert verdict(attention, "attention_pattern", pattern=window).verdict == "pass"


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min], ids=["-inf", "finfo.min"])
def test_the_logit_gain_reads_only_the_keys_a_causal_row_weighs(fill):
    """_logit_gain's `seen = w > 0`: a causal probe's future keys get weight exactly 0. Masked with -inf, their
    logits are not finite and are dropped either way; masked with float32's finfo.min (as Hugging Face layers do),
    their logits are finite, and only the zero weight keeps them out of the spread (with `w >= 0` the spread is
    ~1e38 and the gain 1). Both read the spread of the keys each row weighs: logits spread about 0.02, gain ~10."""

    def layer(q, k, v, mask=None):
        B, H, T, _ = q.shape
        z = torch.randn(B, H, T, k.shape[-2], generator=torch.Generator().manual_seed(0))
        scores = (0.02 * z).to(q.dtype)
        scores = scores if mask is None else scores.masked_fill(~mask, fill)
        weights = scores.softmax(-1)
        return weights @ v, weights

    gain = logit_gain(probe_of(layer, 16))
    assert 7 < gain < 14, gain  # sqrt(2 / 0.02) = 10, read over each causal row's own keys


def test_a_wide_patterns_classes_are_chosen_for_the_pairs_at_each_end_of_a_rows_keys():
    """_edges: the edge pairs are the two keys on either side of each change along a row, (j, j + 1) where the
    declared mask differs. sliding_window(8) at T = 16 has p = 10 classes, more than MAX_COPIES = 9, so the
    classes are chosen for the edge pairs they read: 2 per row for rows 0-7 and 15 (one change), 4 for rows 8-14, 46
    per sequence, 92 in the probe's two; the chosen copies read nearly all of them, and the reference passes."""
    declared = patterns.sliding_window(8).allowed(1, 16, 16)[0]
    edges = sum(len({key for j in range(15) if declared[row, j] != declared[row, j + 1] for key in (j, j + 1)})
                for row in range(16))
    assert edges == 46
    found = verdict(attention, "attention_pattern", pattern=patterns.sliding_window(8))
    read = re.search(r"(\d+) / (\d+) edge pairs read", found.evidence)
    assert found.verdict == "pass" and read is not None, found
    assert int(read.group(2)) == 2 * edges and int(read.group(1)) >= 0.9 * 2 * edges, read.group(0)


@pytest.mark.parametrize("causal", [False, True])
def test_future_leakages_padded_cut_rides_the_padding_stack_for_a_module_only(causal):
    """padded_cut_cases' guard `not causal or t < 2 or form == "function"`: a causal audit of a module adds its cut
    under the padding mask to the PADDED stack's call (3 copies -> 4); a function's is probed in a call of its own
    (`_padded`), so its stack stays at 3 copies (with the last `or` made `and`, a copy nobody reads: a forward's
    worth of cost, no verdict). Not causal: 3 for both."""
    copies = {name: stacked(probe_of(layer, 16, causal=causal), PADDED, "mask_honoured").copies
              for name, layer in (("function", attention), ("module", OneStream()))}
    assert copies == {"function": 3, "module": 4 if causal else 3}, copies


class OwnPositionBlocked(nn.Module):
    """One-stream self-attention over 2 heads of x itself, causal, with the diagonal blocked from row 1 on (`blocked`;
    row 0 keeps its one key): each later query gives its own position weight 0."""

    def __init__(self, blocked=True):
        super().__init__()
        self.d_model, self.num_heads, self.blocked = 16, 2, blocked

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        heads = x.view(B, T, 2, 8).transpose(1, 2)  # (B, H, T, d)
        keep = torch.ones(T, T, dtype=torch.bool).tril(-1 if self.blocked else 0)
        keep[0, 0] = True
        # keys of their own (the channels rolled): keys parallel to the queries would be shared-QK attention, whose
        # self-exclusion (the first query left its own key) is by design
        out, weights = attention(heads, heads.roll(1, dims=-1), heads, allowed=lambda t_q, t_k: keep)
        return out.transpose(1, 2).reshape(B, T, 16), weights


@pytest.mark.parametrize("blocked", [True, False])
def test_causal_alignment_counts_the_queries_that_give_their_own_position_no_weight(blocked):
    """check_causal_alignment's one-stream branch: the diagonal blocked for 15 of 16 queries in 2 sequences x 2
    heads fails with the count of those queries, 60 of 64 (`diag <= 0` in the evidence; `>= 0` would count all 64);
    the diagonal kept passes."""
    found = verdict(OwnPositionBlocked(blocked), "causal_alignment", causal=True)
    if blocked:
        assert found.verdict == "fail" and found.message == "a query gives zero weight to its own position", found
        assert found.evidence.startswith("60 / 64 queries give their own position weight 0"), found.evidence
    else:
        assert found.verdict == "pass", found


# ---- softmax_saturation: the cosine bounds, quoted ----------------------------------------------------------------


@pytest.mark.parametrize("scale, expected", [(0.45, "fail"), (0.55, "pass"), (90.0, "pass"), (110.0, "fail")])
def test_normalised_q_and_k_pass_between_a_cosine_logit_of_0_5_and_100(scale, expected):
    """COSINE_FLAT = 0.5 and COSINE_SHARP = 100, quoted (tests/test_layer_causes.py pins them 10% either side but
    reads them from the module, so it follows a mutated bound): a cosine times 0.45 is too flat, 0.55 and 90 pass,
    110 is too sharp; tenfold or a tenth of either bound moves one of the four. Float32 (the bound is not per dtype;
    the layer's own test runs every dtype)."""
    from test_layer_causes import fixed, temperature

    found = temperature(fixed(scale), torch.float32)
    assert found.verdict == expected and "normalised" in found.message, found
    if expected == "fail":
        assert ("too flat" if scale < 1 else "too sharp") in found.message, found


# ---- parameters_used: a dead row, not a dead column -----------------------------------------------------------------


class FeatureDropped(nn.Module):
    """A projection before the reference attention, with feature 0 dropped: of its output (`where="row"`: row 0 of the
    projection's weight reaches nothing, a finding) or of its input (`where="column"`: column 0 of the weight gets
    no gradient, but every output feature is still made of the others)."""

    def __init__(self, where):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.where = 16, 2, where
        self.proj, self.attn = nn.Linear(16, 16), MultiHeadAttention(16, 2)

    def forward(self, x, mask=None):
        keep = torch.ones(16, dtype=x.dtype, device=x.device)
        keep[0] = 0
        y = self.proj(x * keep if self.where == "column" else x)
        y = y * keep if self.where == "row" else y
        return self.attn(y, y, y, mask)


@pytest.mark.parametrize("where", ["row", "column"])
def test_parameters_used_finds_a_weight_row_that_reaches_nothing_not_a_column_its_input_never_fills(where):
    """structural_zeros' `dead = ~nonzero.any(1)`: a row of exact zero gradient is an output feature that reaches
    nothing (fail, named by its row); a column of zeros is an input feature the probe's tokens leave at 0, and each
    row still reaches the output (pass; with `.all(1)` every row holding one zero would read as dead)."""
    found = verdict(FeatureDropped(where), "parameters_used")
    if where == "row":
        assert found.verdict == "fail" and "proj.weight" in found.message + found.evidence, found
    else:
        assert found.verdict == "pass", found


def test_normalised_q_and_ks_evidence_quotes_the_layers_own_entropy_as_the_expected_one():
    """_judged_cosine's `_entropy_text(base, 1.0, ...)`: for normalised q and k the temperature is the layer's own, so
    the entropy "at the expected scale" is the layer's (ratio 1: softmax(log w) = w); at 10 it would quote a flatter
    one. Swin v2's cosine attention (tests/test_layer_causes.py) passes with both 1.07 nats."""
    from test_layer_causes import CosineAttention, temperature

    found = temperature(CosineAttention, torch.float32)
    entropies = re.search(r"mean weight entropy (\S+) nats, (\S+) at the expected scale", found.evidence)
    assert found.verdict == "pass" and entropies is not None, found
    assert entropies.group(1) == entropies.group(2), entropies.group(0)


# ---- seed 777's survivors left at 54bd110: output_variance's learned-keys verdict, positions_mixed's guard -------


class FusedSlots(MemorySlots):
    """MemorySlots through torch's fused SDPA, the 2 slots never attended (their mask columns False) and the mask
    passed as is or inverted (`inverted`, the bug): inverted, the last causal query is allowed no key at all and
    SDPA gives it a zero output, which lies outside the range of the values for a feature whose values are all of
    one sign."""

    def __init__(self, inverted=False):
        super().__init__()
        self.inverted = inverted

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        split = lambda t: t.view(B, t.shape[1], self.num_heads, -1).transpose(1, 2)  # (B, T, D) -> (B, H, T, d)
        q, k, v = split(self.q(query)), split(self.k(key)), split(self.v(value))
        k = torch.cat([self.mem_k.expand(B, -1, -1, -1), k], 2)  # (B, H, n + Tk, d)
        v = torch.cat([self.mem_v.expand(B, -1, -1, -1), v], 2)
        if mask is not None:
            mask = nn.functional.pad(~mask if self.inverted else mask, (k.shape[-2] - mask.shape[-1], 0), value=False)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, Tq, D))


@pytest.mark.parametrize("inverted", [False, True])
def test_output_variance_fails_a_fused_call_with_learned_keys_whose_output_leaves_the_values_range(inverted):
    """_judged_with_learned_keys' last verdict (`if bad: ... "fail"`): at a fused call only its output can be judged,
    and a query left with no key comes out as zeros, outside the range of its values (measured: 2 of 256 outputs,
    0.052 of the values' RMS; the twin with the mask as given: 3.2e-7, within float32's 1e-4)."""
    found = verdict(FusedSlots(inverted), "output_variance", causal=True)
    assert "judged on the output of the fused attention call" in found.evidence, found
    if inverted:
        assert (found.verdict, found.message) == ("fail", "the output is not a convex combination of the values and "
                                                          "the learned slots"), found
    else:
        assert found.verdict == "pass", found


class GatedHeads(nn.Module):
    """forward(query, key, value, mask=None): the weighted sum by bmm over (B * H, T, d), viewed back as (B, H, T, d),
    heads merged with their transpose, or without it (`merged_wrong`, the bug), then gated by a sigmoid of the query
    (so identical value rows come out differing by query, and the layer is judged on its weighted sum)."""

    def __init__(self, merged_wrong=False, split_wrong=False, by_position=False, position_feature=False, d_model=12,
                 num_heads=3):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.merged_wrong = d_model, num_heads, merged_wrong
        self.split_wrong, self.by_position, self.position_feature = split_wrong, by_position, position_feature
        self.q, self.k, self.v, self.gate, self.o = (nn.Linear(d_model, d_model) for _ in range(5))

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        H, d = self.num_heads, D // self.num_heads
        fold = lambda t: t.view(B, t.shape[1], H, d).transpose(1, 2).reshape(B * H, t.shape[1], d)
        if self.split_wrong:  # the bug: (B, T, D) read straight as (B, H, T, d), positions scrambled with heads
            fold = lambda t: t.reshape(B, H, t.shape[1], d).reshape(B * H, t.shape[1], d)
        q, k, v = fold(self.q(query)), fold(self.k(key)), fold(self.v(value))
        if self.by_position:  # values told apart by their position, computed (as values rotated by position are)
            v = v * (1 + 0.1 * torch.arange(v.shape[1], dtype=v.dtype, device=v.device))[:, None]
        if self.position_feature:  # each value carries its position as one more feature, read back after the sum
            where = torch.arange(v.shape[1], dtype=v.dtype, device=v.device) / v.shape[1]  # (Tk,)
            v = torch.cat([v, where[None, :, None].expand(v.shape[0], -1, 1)], -1)  # (B * H, Tk, d + 1)
        s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d)  # (B * H, Tq, Tk)
        if mask is not None:
            s = s.masked_fill(~mask.expand(B, H, Tq, k.shape[1]).reshape(B * H, Tq, -1), float("-inf"))
        y = torch.bmm(s.softmax(-1), v)  # (B * H, Tq, d), or d + 1 with the position feature
        if self.position_feature:
            y = y[..., :d] * (1 + y[..., d:])  # scaled by the mean position attended
        y = y.view(B, H, Tq, d)  # a view whose axis 1 is the heads, not the positions
        y = y.reshape(B, Tq, D) if self.merged_wrong else y.transpose(1, 2).reshape(B, Tq, D)
        return self.o(y * torch.sigmoid(self.gate(query)))


@pytest.mark.parametrize("merged_wrong", [False, True])
def test_output_variance_reads_only_views_whose_axis_1_is_the_positions(merged_wrong):
    """positions_mixed: the merge that moves heads into positions is a float view or reshape of 3 or more axes, its
    axis 1 the positions (`not out.is_floating_point() or out.dim() < 2 or out.shape[1] != T: continue`). The view
    of the weighted sum as (B, H, T, d) has the heads on axis 1; they differ and the positions in its input do not,
    but it moves no head into a position: read as one (the guard's last `or` made `and`), the correct gated layer is
    no longer judged on its weighted sum. Its twin, heads merged without their transpose before the gate, is judged
    on its output and fails (with the float or 3-axis views skipped, it passed)."""
    found = verdict(GatedHeads(merged_wrong), "output_variance")
    if merged_wrong:
        assert found.verdict == "fail" and found.message.startswith("the output is not a convex combination"), found
    else:
        assert found.verdict == "pass" and "judged on weights @ values" in found.message, found


@pytest.mark.parametrize("split_wrong, by_position, position_feature",
                         [(False, False, False), (True, False, False), (False, True, False), (False, False, True)])
def test_output_variance_fails_positions_split_into_heads_by_a_reshape_and_passes_values_computed_by_position(
        split_wrong, by_position, position_feature):
    """positions_split: a view or reshape feeding the weighted sum whose input is the same at every position and
    whose output is not moved data between positions and heads (`reshape(B, H, T, d)` of (B, T, D), the bug): the
    gated layer's output fail stands, its site that reshape. Values made to differ by position by arithmetic (a
    factor per position, as rotated values are) are no such op: the twin passes, judged on its weighted sum. Nor is
    a concatenation that changes the shape (`_reshaped` reads views and reshapes only: its first `or` made `and`, a
    `cat` of each value with its position as one more feature was read as a split, and the correct layer failed)."""
    found = verdict(GatedHeads(split_wrong=split_wrong, by_position=by_position, position_feature=position_feature),
                    "output_variance")
    if split_wrong:
        assert found.verdict == "fail" and found.message.startswith("the output is not a convex combination"), found
        sites = found.where
        assert sites and "t.reshape(B, H, t.shape[1], d)" in sites[0].code, sites
    else:
        assert found.verdict == "pass" and "judged on weights @ values" in found.message, found


@pytest.mark.parametrize("by_position", [False, True])
def test_output_variance_says_whether_positions_came_apart_in_the_values_or_after_the_weighted_sum(by_position):
    """_judged_at_weighted_sum's evidence: causal weights differ by query, so values told apart by position make the
    weighted sum itself differ between identical tokens ("apart already in the values it weights"); with identical
    values and queries of their own (cross-attention) the sum is the same everywhere and the positions come apart
    after it, at the gate ("computed from the weighted sum"). `apart.index > op.index` made `>=` called the first
    kind the second."""
    found = verdict(GatedHeads(by_position=by_position), "output_variance", **({"causal": True} if by_position else {}))
    assert found.verdict == "pass" and "judged on weights @ values" in found.message, found
    already = "the positions are apart already in the values it weights" in found.evidence
    assert already == by_position and (", computed from the weighted sum" in found.evidence) != by_position, \
        found.evidence


class PositionAdded(nn.Module):
    """OneStream's attention with a learned position added to its output (`added`, the bug: the output then reads
    something besides the weighted sum of the values); without it, the reference."""

    def __init__(self, added=True, d_model=16, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.added = d_model, num_heads, added
        self.attn = MultiHeadAttention(d_model, num_heads)
        self.position = nn.Parameter(torch.randn(64, d_model))

    def forward(self, x, mask=None):
        out, weights = self.attn(x, x, x, mask)
        if self.added:
            out = out + self.position[: x.shape[1]]  # (B, T, D) + (T, D): differs between positions
        return out, weights


@pytest.mark.parametrize("added", [False, True])
def test_output_variance_says_where_positions_come_apart_after_the_weighted_sum_and_reads_no_flattening_as_a_merge(
        added):
    """A learned position added to the attention's output: a transform after the weighted sum, judged on that sum
    (a pass), whose evidence names where the positions come apart (`positions_apart`: the first op after the sum
    whose output differs along an axis of T, the add; with its `and` made `or`, the first with such an axis, the sum
    itself, "apart already in the values"). With d_model == seq_len == 16, the output projection's flattening view
    (B * T, D) has as many features on its axis 1 as there are positions: no merge of heads into positions
    (`positions_mixed` reads views of 3 or more axes; with 2 it failed this layer, blaming `self.out(x)`)."""
    found = verdict(PositionAdded(added), "output_variance")
    assert found.verdict == "pass", found
    if added:
        assert "judged on weights @ values" in found.message, found
        assert re.search(r"the positions come apart at \S+:\d+ \(add\), computed from the weighted sum",
                         found.evidence), found.evidence


def heads_last(q, k, v, mask=None):
    """The reference returning its output as (B, T, H, d): not the query's (B, H, T, d) layout."""
    out, weights = attention(q, k, v, mask)
    return out.transpose(1, 2), weights


class HeadsUnmerged(OneStream):
    """OneStream returning its heads unmerged, (B, H, T, d): an output of 4 axes."""

    def forward(self, x, mask=None):
        B, T, D = x.shape
        H = self.num_heads
        split = lambda t: t.view(B, T, H, D // H).transpose(1, 2)  # (B, T, D) -> (B, H, T, d)
        q, k, v = map(split, self.attn.qkv(x).chunk(3, dim=-1))
        return attention(q, k, v, mask)[0]


class Squeezed(OneStream):
    """OneStream whose output is `.squeeze()`d: (B, T, D) as it should be, but (B, D) for one token."""

    def forward(self, x, mask=None):
        return super().forward(x, mask)[0].squeeze()


@pytest.mark.parametrize("layer, expected", [
    (heads_last, "output shape (2, 16, 2, 8) is not the query's"),
    (attention, None),
    (HeadsUnmerged(), "output shapes (2, 2, 16, 8) and (2, 2, 1, 8) do not allow the comparison"),
    (Squeezed(), "output shapes (2, 16, 16) and (2, 16) do not allow the comparison"),
    (OneStream(), None),
], ids=["function-heads-last", "function", "module-unmerged", "module-squeezed", "module"])
def test_output_variance_skips_an_output_it_cannot_compare_row_by_row_and_judges_one_it_can(layer, expected):
    """check_output_variance's two shape guards: a function's output not in the query's shape, a module's output
    not (B, T, D) like its one-token reference: skipped, saying the shapes (never guessed into a verdict, nor a
    crash of the comparison); their twins in the right shape are judged, and pass."""
    found = verdict(layer, "output_variance", **({"d_model": 16, "num_heads": 2} if callable(layer)
                                                 and not isinstance(layer, nn.Module) else {}))
    if expected is None:
        assert found.verdict == "pass", found
    else:
        assert (found.verdict, found.message) == ("skip", f"not measured: {expected}"), found


@pytest.mark.parametrize("zeroed", [True, False])
def test_output_variance_does_not_measure_a_layer_whose_output_projection_starts_at_zero(zeroed):
    """check_output_variance's `if change is None` guard: a zero-initialised output projection (modded-nanogpt's
    c_proj, DiT's adaLN-Zero, ControlNet's zero convolutions) makes the output zero everywhere, and no difference
    from the one-token output can be measured against zero: skipped, saying so (with the guard gone the comparison
    raised). Its twin, the same layer with the projection as drawn, is measured and passes. The zeros are frozen here:
    the audit measures a copy with trainable all-zero parameters drawn (tests/test_zero_gates.py), frozen ones stay."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2)
    if zeroed:
        with torch.no_grad():
            layer.out.weight.zero_()
            layer.out.bias.zero_()
        layer.out.requires_grad_(False)
    found = verdict(layer, "output_variance")
    if zeroed:
        assert (found.verdict, found.message) == ("skip", "not measured: the expected output is zero everywhere, so "
                                                          "a difference cannot be measured against it"), found
    else:
        assert found.verdict == "pass", found


def unnormalised(q, k, v, mask=None):
    """Attention without its softmax, as a function: (B, H, T, d) in, (B, H, T, d) out."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores @ v, scores


@pytest.mark.parametrize("form", ["module", "function"])
def test_output_variance_names_the_worst_output_row_by_its_own_axes(form):
    """check_output_variance's evidence names where the greatest difference is, by the axes of the comparison: a
    module's output rows are (b, t), a function's (b, h, t) (its `change.dim() == 2` turned, a module's worst row was
    named by a head it does not have)."""
    if form == "module":
        found = verdict(VARIANTS["no_softmax"].build(d_model=16, num_heads=2), "output_variance")
        where = r"\(b=\d+, t=\d+\)"
    else:
        found = verdict(unnormalised, "output_variance", d_model=16, num_heads=2)
        where = r"\(b=\d+, h=\d+, t=\d+\)"
    assert found.verdict == "fail", found
    assert re.search(r"greatest difference \S+ at " + where + " ", found.evidence), found.evidence


class PositionConcatenated(nn.Module):
    """Self-attention over each token concatenated with a learned feature of its position (coordinates appended to
    a point's features, as set and point-cloud transformers do): the query, key and value projections read
    [x; p]. No residual, no output projection reading the query. `softmax=False`: the scores weight the values
    as they are (the bug)."""

    def __init__(self, d_model=16, num_heads=2, features=4, softmax=True):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.softmax = d_model, num_heads, softmax
        self.position = nn.Parameter(torch.randn(64, features))
        self.q, self.k, self.v = (nn.Linear(d_model + features, d_model) for _ in range(3))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        xp = torch.cat([x, self.position[:T].expand(B, T, -1)], -1)  # (B, T, D + features)
        split = lambda t: t.view(B, T, self.num_heads, -1).transpose(1, 2)  # (B, H, T, d)
        q, k, v = split(self.q(xp)), split(self.k(xp)), split(self.v(xp))
        y, weights = attention(q, k, v, mask) if self.softmax else unnormalised(q, k, v, mask)
        return y.transpose(1, 2).reshape(B, T, D), weights


@pytest.mark.parametrize("softmax", [True, False])
def test_output_variance_reads_no_concatenation_of_the_query_with_a_feature_of_its_own_as_an_output_that_reads_it(
        softmax):
    """query_concat: the attention's output beside its query is a concatenation of the query and a tensor computed
    from the keys or values (Luong's [context; query]); the query beside a learned position feature is the layer's
    input, not its output (`and` made `or`: that concatenation was judged as Luong's, and its position rows, which
    differ by design, failed the correct layer). Judged on its weighted sum, it passes, and the same layer without
    its softmax still fails."""
    found = verdict(PositionConcatenated(softmax=softmax), "output_variance")
    if softmax:
        assert found.verdict == "pass" and "judged on weights @ values" in found.message, found
    else:
        assert found.verdict == "fail", found
    assert "concatenation" not in found.message, found


class TopLeftMHA(nn.Module):
    """torch's MultiheadAttention given a causal mask built top-left for each call (the bug once queries are fewer
    than keys), whatever mask it is passed."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, query, key, value, mask=None):
        allowed = torch.ones(query.shape[1], key.shape[1], dtype=torch.bool).tril()
        return self.mha(query, key, value, attn_mask=~allowed)


@pytest.mark.parametrize("top_left", [False, True])
def test_decode_consistency_reads_a_float64_copy_before_failing_in_bfloat16(top_left):
    """Heads of width 1 in bfloat16 (an explore draw of CI: torch's MHA at d_model 4 in 4 heads, GPT-2's init, seq_len
    7, seed 6789) round the partial calls apart from the full pass by 0.032, past bfloat16's 0.03: the float64 copy on
    the same inputs reads 5e-16, so the difference is rounding and the layer passes (it failed before). Twin: the
    same layer with its causal mask built top-left differs in float64 too, and fails."""
    seed_rng(6789)
    mha = nn.MultiheadAttention(4, 4, batch_first=True)
    gpt2_init_(mha, seed=6789)
    layer = (TopLeftMHA(mha) if top_left else mha).to(torch.bfloat16)
    found = diagnostics.audit(layer, seq_len=7, seed=6789, causal=True).result("decode_consistency")
    assert found.verdict == ("fail" if top_left else "pass"), found
    said = "not rounding" if top_left else "the bfloat16 difference is rounding"
    assert "a float64 copy of the layer on the same inputs measured" in found.evidence and said in found.evidence, \
        found.evidence
