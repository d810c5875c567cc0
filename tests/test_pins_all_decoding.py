"""Pins for the survivors of the full mutation run at 3057bfd (`benchmarks/mutations.py --all`, issue 37) in
`cache_decoding`: each exit where the layer's cache cannot be driven or read (a key-padding mask under a causal audit,
the full pass or the uncached prefix raising, a cache no longer returned, an output of zeros), the words of its
readings (one new token, several), and the window's roll-overs it names (`pattern_band`, the second roll-over past
seq_len). One small cached layer written here, with one fault at a time; each case beside its twin, the same layer
without the fault, on the same weights and inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics.patterns import sliding_window

D, H, T = 16, 2, 16  # d_model, heads, the audit's length


class Cached(nn.Module):
    """Causal self-attention with a cache of every key: forward(x, kv_cache=None, use_cache=False) returns the output,
    or (output, (k, v)) with use_cache; new tokens at positions past..past+t-1 see the keys j <= p (with `window`,
    p - window < j <= p). `fault` is one way it misbehaves (None: it does not)."""

    def __init__(self, fault: str | None = None, window: int | None = None):
        super().__init__()
        self.fault, self.window = fault, window
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, kv_cache=None, use_cache=False):
        B, t, _ = x.shape  # batch, new tokens
        if not use_cache and self.fault == f"raises uncached at {t} tokens" and x.abs().max() > 20:
            raise ValueError(f"refused {t} tokens at this size")  # the audit's scaled tokens, not the standard probe
        q, k, v = self.qkv(x).view(B, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, t, d)
        past = 0 if kv_cache is None else kv_cache[0].shape[2]
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], 2), torch.cat([kv_cache[1], v], 2)  # (B, H, past + t, d)
        i, j = torch.arange(past, past + t).view(-1, 1), torch.arange(k.shape[2]).view(1, -1)
        allowed = (j <= i) if self.window is None else (j <= i) & (i - j < self.window)  # (t, Tk)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, t, d)
        out = self.out(y.transpose(1, 2).reshape(B, t, D))
        if self.fault == "zeros":
            out = out * 0
        if not use_cache:
            return out
        return out, (None if self.fault == "drops its cache" and past > 0 else (k, v))


class KeyPadded(Cached):
    """The same layer taking a key-padding mask (B, Tk), True = padding, which cannot carry a causal mask."""

    def forward(self, x, key_padding_mask=None, kv_cache=None, use_cache=False):
        return super().forward(x, kv_cache, use_cache)


def built(cls=Cached, fault=None, **kw):
    torch.manual_seed(0)  # each layer and its twin share their weights
    layer = cls(fault, **kw)
    gpt2_init_(layer)  # small weights: the decoding tokens are scaled (logit_gain), the standard probe's are not
    return layer.eval()


def decoding(layer, seq_len=T, **kw):
    kw = kw or {"causal": True}
    return diagnostics.audit(layer, seq_len=seq_len, detectors=["cache_decoding"], **kw).result("cache_decoding")


def test_the_twin_decodes_through_its_cache_and_says_each_readings_tokens():
    """The layer without a fault passes; its readings say "1 new token" and "3 new tokens" (L409's `n > 1`, made
    `n < 1`, would write "1 new tokens" and "3 new token")."""
    found = decoding(built())
    assert found.verdict == "pass", found
    assert "; 1 new token at t=8: 0 / 2 rows differ" in found.evidence, found.evidence
    assert "; 3 new tokens at t=10: 0 / 6 rows differ" in found.evidence, found.evidence


def test_a_key_padding_mask_under_a_causal_audit_is_a_skip():
    """L322 (its guard never firing, its `or` made `and`): a causal audit passes its causal mask to a layer that takes
    a mask, and a key-padding mask cannot carry the causal mask of several new tokens: a skip that says so. Its twin,
    the same weights without the mask parameter, is decoded and passes."""
    found = decoding(built(KeyPadded))
    assert found.verdict == "skip" and "the layer's mask is a key-padding mask" in found.message, found
    assert decoding(built()).verdict == "pass"


@pytest.mark.parametrize(("fault", "said"), [
    ("raises uncached at 16 tokens", "the layer raised on this detector's probe (ValueError: refused 16 tokens"),
    ("raises uncached at 8 tokens", "the layer raised on this detector's probe (ValueError: refused 8 tokens"),
    ("drops its cache", "the layer stopped returning a cache after 8 tokens"),
    ("zeros", "the output is zero or non-finite everywhere"),
])
def test_a_decoding_that_cannot_be_read_is_a_skip_that_says_why(fault, said):
    """Each exit (guards made never to fire: L327 the full pass raising, L401 the uncached prefix of 8 tokens raising,
    L383 no cache returned after the prefill, L393 an output of zeros, where no change can be measured): a skip with
    its reason, never a crash or a verdict. The twin without the fault passes (above)."""
    found = decoding(built(fault=fault))
    assert found.verdict == "skip" and found.message.startswith(f"not measured: {said}"), found


@pytest.mark.parametrize(("window", "said"), [
    (8, "(the pattern's rows span 8 positions: single tokens at t=7, 8, 15, where the cache fills to 8 and where a "
        "cache of 8 slots rolls over, t=8; its second roll-over, t=16, is past seq_len 16: pass seq_len >= 17 to "
        "decode it)"),
    (7, "(the pattern's rows span 7 positions: single tokens at t=6, 7, 13, 14, 15, where the cache fills to 7 and "
        "where a cache of 7 slots rolls over, t=7 and 14)"),
    (15, "(its rows span 15 of 16 positions: no window the cache can pass at this length)"),
])
def test_the_window_the_cache_must_roll_over_is_named_with_its_roll_overs_within_seq_len(window, said):
    """`pattern_band` and the roll-overs it names: a window of 8 over 16 tokens rolls over at t=8 and again at t=16,
    which is past the audit (L421's `t < T` made `<=` would list 16; L425's `2 * band < T` made `<=` or `>` would drop
    or misplace the note); a window of 7 rolls over twice within it; a window of 15 spans all but one position, so no
    window is passed (L416's `band < T - 1` made `<=` would list roll-overs). Each layer keeps its window: all pass."""
    found = decoding(built(window=window), pattern=sliding_window(window))
    assert found.verdict == "pass", found
    assert f"under sliding_window({window}) {said}" in found.evidence, found.evidence


def test_a_pattern_at_two_tokens_has_a_band():
    """`pattern_band`'s `T < 2` (L79, made `<=`): at two tokens a window of 2 spans both, read as such (with `<=` the
    band is None and the evidence says "None of 2")."""
    found = decoding(built(window=2), seq_len=2, pattern=sliding_window(2))
    assert "(its rows span 2 of 2 positions" in found.evidence, found
