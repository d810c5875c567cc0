"""Pins for the numbers and branches that `benchmarks/mutations.py` found no test depending on (issue 37): for each,
a case just inside and one just outside, so that the constant tenfold either way, a comparison turned, or a guard
that never fires fails a test here. As in tests/test_thresholds.py, constants are quoted as literals on purpose (a
test that read them from the module would follow a mutated constant); each test says which constant or branch it
pins. Tiny layers and sizes: the file runs in a few seconds, and every mutant's test selection runs it first.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from correct import MultiHeadAttention
from diagnostics import patterns
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._common import logit_gain
from diagnostics.detectors._mask_hints import honoured_conventions
from diagnostics.detectors._stacked import PADDED, decoding_calls, decoding_inputs, stacked_baseline

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


def newest_key_opens_past(threshold: float):
    """A top-left mask (the newest query does not see the newest key), except that every output moves once the
    newest key averages more than `threshold` in absolute value: the misalignment shows only to a push that stays
    below it."""

    def layer(q, k, v, mask=None):
        out, weights = attention(q, k, v, allowed=top_left)
        opened = (k[..., -1, :].abs().float().mean(-1) - threshold).clamp_min(0)  # (B, H)
        return out + opened[..., None, None].to(out.dtype), weights

    return layer


def test_causal_alignment_pushes_the_newest_key_100x_both_ways():
    """NEWEST_KEY_GAINS = (100, -100): a gate at 0.3 x 100 opens (the newest query moves: pass), one at 3 x 100 stays
    shut (the top-left mask's finding). Tenfold gains open the second, a tenth leaves the first shut."""
    opens = verdict(newest_key_opens_past(INSIDE * 100), "causal_alignment", causal=True)
    shut = verdict(newest_key_opens_past(OUTSIDE * 100), "causal_alignment", causal=True)
    assert opens.verdict == "pass", opens
    assert shut.verdict == "fail" and shut.message.startswith("the newest query does not see the newest key"), shut


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
    out, weights = attention(call.query, call.key, call.value, call.allowed)
    torch.testing.assert_close(call.output.weights, weights)
    torch.testing.assert_close(call.output.out, out)

    def shared_weights(q, k, v, mask=None):  # one (H, Tq, Tk) map for the whole batch: not split along it
        out, w = attention(q, k, v, mask)
        return out, w[0]

    whole = stacked_baseline(probe_of(shared_weights, 8, causal=False), PADDED)
    assert whole.output.out.shape[0] == B and whole.output.weights is None
