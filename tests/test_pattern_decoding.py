"""Cached decoding under a declared pattern (issue 19): `cache_decoding` decodes a layer with a cache of its own
through that cache while the cache fills past the window W and rolls over (t = W and 2W), and compares every row
with the full pass under the pattern. Our own cached layers, each correct one beside its broken twin on the same
weights and inputs:

- `WindowCached`: keeps every key, masks new tokens with the window by absolute position (tutorial style);
  broken: the window dropped once the cache holds keys (causal only from then on).
- `RingCached`: Mistral's rolling buffer, W slots, position p written at slot p % W, each new token attending
  every filled slot; broken: a buffer of W + 1 slots, so the window rolls over one token late.
- `MaskCached`: takes the audit's mask (the pattern's, bottom-right); broken: ignores it once the cache holds keys.

A Hugging Face sliding-window layer decoding through transformers' own sliding cache is in
tests/test_model_patterns.py (real extra)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics.patterns import chunked, sliding_window

D, H, T, W = 16, 2, 16, 4
WINDOW = sliding_window(W)
DTYPES = [torch.float32, torch.bfloat16]


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, w: int | None) -> torch.Tensor:
    """(Tq, Tk) True = may attend: causal, and with a window w the keys q - w < k <= q."""
    allowed = k_pos.view(1, -1) <= q_pos.view(-1, 1)
    return allowed if w is None else allowed & (q_pos.view(-1, 1) - k_pos.view(1, -1) < w)


class _Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def split(self, x):
        B, t, _ = x.shape  # batch, new tokens
        return self.qkv(x).view(B, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, t, d)

    def merge(self, y):
        B, _, t, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(B, t, D))  # (B, t, D)


class WindowCached(_Heads):
    """forward(x, kv_cache=None, use_cache=False) -> out, or (out, (k, v)) with use_cache: every key cached, new
    tokens at positions past..past+t-1 masked to the window against cached and new keys."""

    def __init__(self, bug: str | None = None, window: int = W):
        super().__init__()
        self.bug, self.window = bug, window

    def forward(self, x, kv_cache=None, use_cache=False):
        q, k, v = self.split(x)
        past = 0 if kv_cache is None else kv_cache[0].shape[2]
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], 2), torch.cat([kv_cache[1], v], 2)  # (B, H, past + t, d)
        w = self.window
        if self.bug == "window dropped" and past > 0:
            w = None  # BUG: once the cache holds keys, only the causal mask is kept
        allowed = window_mask(torch.arange(past, past + x.shape[1]), torch.arange(k.shape[2]), w)  # (t, Tk)
        out = self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
        return (out, (k, v)) if use_cache else out


class RingCached(_Heads):
    """Mistral's rolling buffer cache: `slots` keys and values, the key at position p kept at slot p % slots; a
    prefill is a full pass under the window, a cached call decodes its tokens one by one, each attending every
    filled slot (with W slots: exactly the window, its own key included). Cache: (k slots, v slots, tokens seen)."""

    def __init__(self, bug: str | None = None, window: int = W):
        super().__init__()
        self.window, self.slots = window, window + (1 if bug == "rolled over late" else 0)  # BUG: one slot too many

    def forward(self, x, kv_cache=None, use_cache=False):
        q, k, v = self.split(x)  # (B, H, t, d)
        B, _, t, d = q.shape
        if kv_cache is None:  # prefill: a full pass under the window
            allowed = window_mask(torch.arange(t), torch.arange(t), self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, t, d)
            ks, vs = k.new_zeros(B, H, self.slots, d), v.new_zeros(B, H, self.slots, d)
            for p in range(max(0, t - self.slots), t):
                ks[:, :, p % self.slots], vs[:, :, p % self.slots] = k[:, :, p], v[:, :, p]
            seen = t
        else:
            ks, vs, seen = kv_cache[0].clone(), kv_cache[1].clone(), kv_cache[2]
            rows = []
            for i in range(t):  # one token at a time through the ring
                p = seen + i
                ks[:, :, p % self.slots], vs[:, :, p % self.slots] = k[:, :, i], v[:, :, i]
                filled = torch.arange(self.slots) < min(p + 1, self.slots)  # (slots,)
                scores = q[:, :, i:i + 1] @ ks.transpose(-2, -1) / math.sqrt(d)  # (B, H, 1, slots)
                rows.append(scores.masked_fill(~filled, float("-inf")).softmax(-1) @ vs)  # (B, H, 1, d)
            out, seen = torch.cat(rows, 2), seen + t
        out = self.merge(out)
        return (out, (ks, vs, seen)) if use_cache else out


class MaskCached(_Heads):
    """Takes the audit's mask (True = may attend, (B, [1,] t, Tk) over cached and new keys) and a cache of every key."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug = bug

    def forward(self, x, mask=None, kv_cache=None, use_cache=False):
        q, k, v = self.split(x)
        past = 0 if kv_cache is None else kv_cache[0].shape[2]
        if kv_cache is not None:
            k, v = torch.cat([kv_cache[0], k], 2), torch.cat([kv_cache[1], v], 2)
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # (B, 1, t, Tk)
        if self.bug == "mask ignored" and past > 0:
            mask = window_mask(torch.arange(past, past + x.shape[1]), torch.arange(k.shape[2]), None)  # BUG: causal
        out = self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return (out, (k, v)) if use_cache else out


def build(cls, bug=None, *, dtype=torch.float32, init="default", **kw):
    torch.manual_seed(0)  # the broken layer and its twin share their weights
    layer = cls(bug, **kw)
    if init == "gpt2":
        gpt2_init_(layer)
    return layer.to(dtype).eval()


def decoding(layer, pattern=WINDOW, **kw):
    report = diagnostics.audit(layer, pattern=pattern, seq_len=T, detectors=["cache_decoding"], **kw)
    return report.result("cache_decoding")


TWINS = {  # name: (class, bug, the step where the broken twin first differs)
    "window dropped once the cache holds keys": (WindowCached, "window dropped", f"1 new token at t={W}"),
    "ring buffer rolled over one token late": (RingCached, "rolled over late", f"1 new token at t={W}"),
    "the pattern's mask ignored once the cache holds keys": (MaskCached, "mask ignored", f"1 new token at t={W}"),
}


@pytest.mark.parametrize("name", TWINS)
def test_a_window_lost_with_the_cache_fails_at_the_step_it_diverges_and_its_twin_passes(name):
    cls, bug, step = TWINS[name]
    bad = decoding(build(cls, bug))
    assert bad.verdict == "fail", (bad.message, bad.evidence)
    assert bad.message.endswith(f"under sliding_window({W}) differs from the full pass (from the {step})"), bad.message
    good = decoding(build(cls))
    assert good.verdict == "pass", (good.message, good.evidence)
    # the plan decodes single tokens where the window fills and where a W-slot cache rolls over, t = W and 2W
    assert f"single tokens at t={W - 1}, {W}, {2 * W - 1}, {2 * W}" in good.evidence, good.evidence
    assert f"rolls over, t={W} and {2 * W}" in good.evidence and "3+1+1+2+1+1+7 tokens" in good.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("init", ["default", "gpt2"])
def test_the_ring_twins_at_every_dtype_and_init(dtype, init):
    bad = decoding(build(RingCached, "rolled over late", dtype=dtype, init=init))
    good = decoding(build(RingCached, dtype=dtype, init=init))
    assert bad.verdict == "fail" and f"t={W})" in bad.message, (bad.message, bad.evidence)
    assert good.verdict == "pass", (good.message, good.evidence)


def test_a_window_lost_with_the_cache_is_located_at_its_mask():
    """At the first step that differs, the op that built the mask the new token used (the causal comparison alone,
    the window never applied) and the attention call it was applied in."""
    bad = decoding(build(WindowCached, "window dropped"))
    assert [s.function for s in bad.where] == ["window_mask", "WindowCached.forward"], [f"{s}: {s.code}" for s in bad.where]
    assert "k_pos.view(1, -1) <= q_pos.view(-1, 1)" in bad.where[0].code and "blocked (query, key) pairs open" in \
        bad.where[0].note, bad.where[0]


def test_a_pattern_that_sees_the_future_does_not_decode_and_says_why():
    both_sides = sliding_window(W) | (lambda b, h, q, kv: (kv > q) & (kv - q < W))
    r = decoding(build(WindowCached), pattern=both_sides)
    assert r.verdict == "skip" and "blocks the future" in r.message, r.message
    assert decoding(build(WindowCached), pattern=None).verdict == "skip"  # neither causal nor a pattern


def test_a_chunked_layer_decodes_across_its_chunk_boundaries():
    class ChunkCached(WindowCached):
        def forward(self, x, kv_cache=None, use_cache=False):
            q, k, v = self.split(x)
            past = 0 if kv_cache is None else kv_cache[0].shape[2]
            if kv_cache is not None:
                k, v = torch.cat([kv_cache[0], k], 2), torch.cat([kv_cache[1], v], 2)
            qp, kp = torch.arange(past, past + x.shape[1]).view(-1, 1), torch.arange(k.shape[2]).view(1, -1)
            allowed = (kp <= qp) & (qp // W == kp // W)
            if self.bug == "chunk dropped" and past > 0:
                allowed = kp <= qp  # BUG: the chunk boundary forgotten with a cache
            out = self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
            return (out, (k, v)) if use_cache else out

    bad, good = decoding(build(ChunkCached, "chunk dropped"), chunked(W)), decoding(build(ChunkCached), chunked(W))
    assert bad.verdict == "fail" and f"t={W})" in bad.message, bad.message
    assert good.verdict == "pass", (good.message, good.evidence)
