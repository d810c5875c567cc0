"""A value an earlier call made, read back from a cache under a key that does not hold what it was made from, is
found at the line that handed it back.

rotary-embedding-torch 0.2.6 cached its frequencies under the length alone (`freqs:{seq_len}`), so a decoding step
of one token at offset 9 got the table made for offset 8 (benchmarks/pypi_bugs.py `rotary_cache_key_offset`).
`cache_decoding` caught it; its site was the `cos` that read the stale table, in another function, the key's line only
among its callers. No op of the decoding call made that table: the trace now follows such an input back to the user
function that returned it (`_tracing.made_before`), and that return, with the line that asked for it, comes first.

Layers of our own writing: a causal block with a KV cache whose rotary table is cached in a dict keyed by the length
alone (the bug) or by the length and the offset (its twin), in float32 and in bfloat16 at std 0.02.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


class Rotary(nn.Module):
    def __init__(self, dim=8, keyed_by_offset=True):
        super().__init__()
        self.inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        self.cache, self.keyed_by_offset = {}, keyed_by_offset

    def angles(self, n, offset):
        key = (n, offset) if self.keyed_by_offset else n
        if key not in self.cache:
            t = torch.arange(offset, offset + n).float()
            self.cache[key] = torch.cat([t[:, None] * self.inv] * 2, -1)
        return self.cache[key]  # HANDED BACK

    def turn(self, x, offset):
        a = self.angles(x.shape[-2], offset)  # ASKED FOR
        x1, x2 = x.chunk(2, -1)
        return x * a.cos().to(x.dtype) + torch.cat((-x2, x1), -1) * a.sin().to(x.dtype)


class CachedBlock(nn.Module):
    """Causal self-attention with a KV cache (returned as (k, v)), q and k turned at their positions."""

    def __init__(self, dim=32, heads=4, keyed_by_offset=True):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.rot = Rotary(dim // heads, keyed_by_offset)

    def forward(self, x, mask=None, cache=None):  # mask: (B, 1, Tq, Tk) bool, True = may attend
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        past = 0 if cache is None else cache[0].shape[-2]
        q, k = self.rot.turn(q, past), self.rot.turn(k, past)
        if cache is not None:
            k, v = torch.cat((cache[0], k), -2), torch.cat((cache[1], v), -2)
        if mask is None:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(b, t, -1)), (k, v)


def line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _audit(keyed_by_offset, dtype=torch.float32, init=None):
    torch.manual_seed(0)
    layer = CachedBlock(keyed_by_offset=keyed_by_offset)
    if init is not None:
        init(layer)
    return diagnostics.audit(layer.to(dtype), progress=False, causal=True, dtype=dtype,
                             detectors=["cache_decoding"]).result("cache_decoding")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16 at std 0.02"])
def test_a_cached_value_under_too_short_a_key_is_found_where_it_is_handed_back(dtype, std_002):
    init = std_002 if dtype == torch.bfloat16 else None
    assert _audit(True, dtype, init).verdict == "pass"  # the twin: keyed by the length and the offset
    found = _audit(False, dtype, init)
    assert found.verdict == "fail", found
    first = found.where[0]
    assert first.line == line_of(Rotary.angles, "# HANDED BACK") and first.file == __file__, found.where
    assert any(line == line_of(Rotary.turn, "# ASKED FOR") for _, line, _ in first.callers), first.callers
    assert "cache" in first.note and "offset" in first.fix, first
    assert found.where[1].op == "aten.cos", found.where  # then the op that read it


class TableOnce(Rotary):
    """The table made once in __init__ for 64 positions, kept as a plain attribute and handed out by a getter;
    `offset_ignored`: the bug, the rows sliced from 0 whatever the offset."""

    def __init__(self, dim=8, offset_ignored=False):
        super().__init__(dim)
        self.offset_ignored = offset_ignored
        t = torch.arange(64).float()
        self._table = torch.cat([t[:, None] * self.inv] * 2, -1)

    def angles(self, n, offset):
        start = 0 if self.offset_ignored else offset
        return self.table()[start:start + n]  # SLICED

    def table(self):
        return self._table


class PairCache(Rotary):
    """(cos, sin) cached together, a tuple handed back by a getter, under the length alone."""

    def pair(self, n, offset):
        if n not in self.cache:
            a = torch.cat([(torch.arange(offset, offset + n).float())[:, None] * self.inv] * 2, -1)
            self.cache[n] = (a.cos(), a.sin())
        return self.cache[n]  # THE PAIR HANDED BACK

    def turn(self, x, offset):
        cos, sin = self.pair(x.shape[-2], offset)
        x1, x2 = x.chunk(2, -1)
        return x * cos.to(x.dtype) + torch.cat((-x2, x1), -1) * sin.to(x.dtype)


def _with(rotary) -> CachedBlock:
    torch.manual_seed(0)
    layer = CachedBlock()
    layer.rot = rotary
    return layer


def test_a_table_both_calls_read_is_no_stale_value_and_its_wrong_slice_is_the_site():
    """A table made once, that the full pass reads too, is not a cache's stale value: the slice that ignores the
    offset is the first site (before the review's fix, the getter's `return` was, with a cache key's fix)."""
    found = diagnostics.audit(_with(TableOnce(offset_ignored=True)), progress=False, causal=True,
                              detectors=["cache_decoding"]).result("cache_decoding")
    assert found.verdict == "fail", found
    assert found.where[0].line == line_of(TableOnce.angles, "# SLICED"), found.where
    assert not any("key a cached value" in site.fix for site in found.where), found.where
    twin = diagnostics.audit(_with(TableOnce()), progress=False, causal=True, detectors=["cache_decoding"])
    assert twin.result("cache_decoding").verdict == "pass"


def test_a_cached_pair_is_followed_to_where_it_is_handed_back():
    found = diagnostics.audit(_with(PairCache()), progress=False, causal=True,
                              detectors=["cache_decoding"]).result("cache_decoding")
    assert found.verdict == "fail", found
    assert found.where[0].line == line_of(PairCache.pair, "# THE PAIR HANDED BACK"), found.where
