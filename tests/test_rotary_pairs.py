"""A rotary embedding whose pairs disagree is found at the line that made the wrong pairing.

`x * cos + partner(x) * sin` is a rotation only where `partner` turns each feature with the feature the cos/sin table
pairs it with, and any factor multiplied in besides (xPos's decay) is the same for both features of a pair. Two
releases of rotary-embedding-torch broke each (0.0.11's `rotate_half` joined interleaved pairs as halves; 0.7.0's xPos
scale was laid out in halves beside an interleaved table: benchmarks/pypi_bugs.py). `relative_positions` caught both,
but its site was the `cat` that assembled the rotated features, lines from the mistake (and, for a causal layer taking a
key mask, no site at all: its traces were of per-query copies that no cut lines up). Now the first site is the op that
made the partner or the factor (`detectors/_rotary.py`), read from the traced values: the table's pairs from its equal
columns, the partner as a signed permutation of x's features.

Layers of our own writing: a causal block with a (B, T) key mask, its table interleaved or in halves, its partner
either way, an optional xPos factor; each correct combination passes, each mismatched one fails at its own line, in
float32 and in bfloat16 at std 0.02.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


def table(t: int, d: int, layout: str) -> torch.Tensor:
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.arange(t).float()[:, None] * inv  # (T, d/2)
    return freqs.repeat_interleave(2, -1) if layout == "interleaved" else torch.cat([freqs, freqs], -1)  # TABLE


def partner(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "interleaved":
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((-x2, x1), -1).flatten(-2)  # PARTNER interleaved
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)  # PARTNER halves


def decay(t: int, d: int, layout: str) -> torch.Tensor:
    base = (torch.arange(0, d, 2).float() + 0.4 * d) / (1.4 * d)  # xPos's per-pair decay, one value a pair
    power = (torch.arange(t).float() - t // 2)[:, None] / 8
    scale = base ** power  # (T, d/2)
    return scale.repeat_interleave(2, -1) if layout == "interleaved" else torch.cat([scale, scale], -1)  # FACTOR


class RotaryBlock(nn.Module):
    """Causal self-attention, its own triangle and a (B, T) key mask, True = keep (no attribute says it is causal);
    q and k turned by `table_layout` cos/sin and `partner_layout` pairs, and with `xpos` (a factor laid out in
    `xpos`) scaled by it (q) and by its inverse (k)."""

    def __init__(self, d_model=32, heads=4, table_layout="interleaved", partner_layout="interleaved", xpos=None):
        super().__init__()
        self.h, self.table, self.partner, self.xpos = heads, table_layout, partner_layout, xpos
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        angles = table(T, D // self.h, self.table)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        s = decay(T, D // self.h, self.xpos).to(x.dtype) if self.xpos else None
        q = q * cos * (1 if s is None else s) + partner(q, self.partner) * sin * (1 if s is None else s)
        k = k * cos * (1 if s is None else 1 / s) + partner(k, self.partner) * sin * (1 if s is None else 1 / s)
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(o.transpose(1, 2).reshape(B, T, D))


def line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


CASES = {  # id: (RotaryBlock keywords, the line its first site must be: None for a correct layer)
    "interleaved, correct": (dict(), None),
    "halves, correct (Llama's)": (dict(table_layout="halves", partner_layout="halves"), None),
    "xPos interleaved, correct": (dict(xpos="interleaved"), None),
    "partner in halves, table interleaved (rotary-embedding-torch 0.0.11)":
        (dict(partner_layout="halves"), ("partner", "PARTNER halves")),
    "partner interleaved, table in halves": (dict(table_layout="halves"), ("partner", "PARTNER interleaved")),
    "xPos factor in halves, table interleaved (rotary-embedding-torch 0.7.0)":
        (dict(xpos="halves"), ("decay", "FACTOR")),
}
FUNCTIONS = {"partner": partner, "decay": decay}


def _audit(kw, dtype=torch.float32, init=None):
    torch.manual_seed(0)
    layer = RotaryBlock(**kw)
    if init is not None:
        init(layer)
    return diagnostics.audit(layer.to(dtype), progress=False, causal=True, mask="key_keep", dtype=dtype,
                             detectors=["relative_positions"]).result("relative_positions")


@pytest.mark.parametrize("case", list(CASES))
def test_a_mismatched_pairing_fails_at_the_line_that_made_it_and_its_twin_passes(case):
    kw, at = CASES[case]
    found = _audit(kw)
    if at is None:
        assert found.verdict == "pass", found
        return
    assert found.verdict == "fail", found
    fn, marker = at
    first = found.where[0]
    assert first.line == line_of(FUNCTIONS[fn], marker) and first.file == __file__, found.where
    assert "pair" in first.note and first.fix, first


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_in_bfloat16_at_std_0_02(case, std_002):
    kw, at = CASES[case]
    found = _audit(kw, dtype=torch.bfloat16, init=std_002)
    assert found.verdict == ("pass" if at is None else "fail"), found
    if at is not None:
        fn, marker = at
        assert found.where[0].line == line_of(FUNCTIONS[fn], marker), found.where


def test_the_pairs_are_read_from_the_table_and_the_partner_from_the_values():
    """The readings the site rests on, on their own: the table's pairs from equal columns, the partner as a signed
    permutation, neither from a name."""
    from diagnostics.detectors._rotary import _signed_permutation, pairs_of

    assert pairs_of(table(6, 8, "interleaved").cos()) == [1, 0, 3, 2, 5, 4, 7, 6]
    assert pairs_of(table(6, 8, "halves").cos()) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert pairs_of(torch.ones(6, 8)) is None  # a constant pairs nothing one to one
    x = torch.randn(3, 6, 8)
    assert _signed_permutation(x, partner(x, "interleaved")) == ([1, 0, 3, 2, 5, 4, 7, 6], [-1, 1] * 4)
    assert _signed_permutation(x, partner(x, "halves")) == ([4, 5, 6, 7, 0, 1, 2, 3], [-1] * 4 + [1] * 4)
    assert _signed_permutation(x, 2 * x) is None  # a scaled copy is no permutation
    assert pairs_of(torch.tensor(1.0)) is None and _signed_permutation(torch.tensor(1.0), torch.tensor(1.0)) is None


class AbsoluteInside(RotaryBlock):
    """The same block with a sinusoid added to q and k by absolute position (a learned-embedding habit carried into
    a layer meant to be relative): no rotation to pair, so the site is the add, found by lining up the shifted call's
    ops with the plain one's. The causal masks reach this layer a copy per query; the shift is traced with the keys
    at once (before, its copies lined up no op, and the failure had no site)."""

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        pos = table(T, D // self.h, "halves").sin().to(x.dtype)
        q, k = q + pos, k + pos  # ABSOLUTE
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(o.transpose(1, 2).reshape(B, T, D))


def test_absolute_positions_inside_a_key_mask_layer_are_found_at_the_add():
    torch.manual_seed(0)
    found = diagnostics.audit(AbsoluteInside(), progress=False, causal=True, mask="key_keep",
                              detectors=["relative_positions"]).result("relative_positions")
    assert found.verdict == "fail", found
    assert found.where and found.where[0].line == line_of(AbsoluteInside.forward, "# ABSOLUTE"), found.where
    assert _audit({}).verdict == "pass"  # the twin: the same block turning q and k instead, on the same seed


# ---- styles the first version of the localiser misread (a review's layers, written again here) -----------------


class Styled(nn.Module):
    """Causal self-attention with a full (B, 1, T, T) mask, q and k made by `turn(q, k, T)`; `absolute`: a sinusoid
    added to q and k by position after turning them (a bug no rotation explains)."""

    def __init__(self, d_model=32, heads=4, absolute=False):
        super().__init__()
        self.h, self.absolute = heads, absolute
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.w = nn.Parameter(torch.randn(d_model // heads) * 0.5)  # a QK-norm's weight, one value per feature

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        q, k = self.turn(q, k, T)
        if self.absolute:
            pos = table(T, D // self.h, "halves").sin()
            q, k = q + pos, k + pos  # ABSOLUTE
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(o.transpose(1, 2).reshape(B, T, D))


class NormedFirst(Styled):
    """Gemma's QK-norm (RMS, then `* (1 + w)`) before a correct half-split rotation: (1 + w) differs inside the
    pairs and is multiplied in before the rotation, never one of its factors."""

    def turn(self, q, k, T):
        a = table(T, q.shape[-1], "halves")
        normed = [t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.w) for t in (q, k)]
        return tuple(t * a.cos() + partner(t, "halves") * a.sin() for t in normed)


class NormedMispaired(NormedFirst):
    """The same norm (Qwen's `* w`), then a partner in halves beside an interleaved table."""

    def turn(self, q, k, T):
        a = table(T, q.shape[-1], "interleaved")
        normed = [t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w for t in (q, k)]
        return tuple(t * a.cos() + partner(t, "halves") * a.sin() for t in normed)


class Unsigned(Styled):
    """The interleaved pairs swapped without the minus sign: (x2, x1), no turn."""

    def turn(self, q, k, T):
        a = table(T, q.shape[-1], "interleaved")

        def swap(x):
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            return torch.stack((x2, x1), -1).flatten(-2)  # NO MINUS
        return tuple(t * a.cos() + swap(t) * a.sin() for t in (q, k))


class HalfWidthTable(Styled):
    """GPT-J's way: cos and sin made at half width, repeated after (`repeat_interleave(2)`), the partner in halves."""

    def turn(self, q, k, T):
        half = table(T, q.shape[-1], "interleaved")[:, ::2]
        cos, sin = half.cos().repeat_interleave(2, -1), half.sin().repeat_interleave(2, -1)
        return tuple(t * cos + partner(t, "halves") * sin for t in (q, k))


class ScalarBlend(Styled):
    """No rotation: q and k blended with a learned 0-dim angle (`q * phi.cos() + k * phi.sin()`), the absolute bug
    beside it: the localiser reads a 0-dim cos as no table."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.phi = nn.Parameter(torch.tensor(0.3))

    def turn(self, q, k, T):
        return q * self.phi.cos() + k * self.phi.sin(), k


@pytest.mark.parametrize("layer, first", [
    (lambda: NormedFirst(absolute=True), (lambda: Styled.forward, "# ABSOLUTE")),
    (lambda: NormedMispaired(), (lambda: partner, "PARTNER halves")),
    (lambda: Unsigned(), (lambda: Unsigned.turn, "# NO MINUS")),
    (lambda: HalfWidthTable(), (lambda: partner, "PARTNER halves")),
    (lambda: ScalarBlend(absolute=True), (lambda: Styled.forward, "# ABSOLUTE")),
], ids=["a norm's weight before the rotation is no factor of it", "a mispaired partner after a norm",
        "a partner without the minus sign", "a table made at half width", "a 0-dim angle costs no site"])
def test_the_first_site_is_the_line_that_broke_the_rotation(layer, first):
    torch.manual_seed(0)
    found = diagnostics.audit(layer(), progress=False, causal=True,
                              detectors=["relative_positions"]).result("relative_positions")
    assert found.verdict == "fail", found
    fn, marker = first
    assert found.where and found.where[0].line == line_of(fn(), marker), found.where
    assert not any("factor of the rotated features" in site.note for site in found.where), found.where


def test_their_correct_twins_pass():
    torch.manual_seed(0)
    for layer in (NormedFirst(), HalfWidthTable.__base__()):
        found = diagnostics.audit(layer, progress=False, causal=True, detectors=["relative_positions"])
        assert found.result("relative_positions").verdict in ("pass", "skip"), found
