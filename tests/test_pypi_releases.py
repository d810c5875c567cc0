"""benchmarks/pypi_releases.py (every release of a package, a user's layer on each, the audit against a plain
check): its plain check, its table and its totals here, without the network."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


def _benchmark():
    name = "pypi_releases_benchmark"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "pypi_releases.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _benchmark()


def checked(check: str, build: str, fails: str | None) -> None:
    """Run a population's plain `check` on a `build`: it passes where `fails` is None, else its assertion matches
    `fails` (every plain check is earned both ways)."""
    scope = {"BUILD": build}
    if fails is None:
        exec(check, scope)
    else:
        with pytest.raises(AssertionError, match=fails):
            exec(check, scope)

_TURN = """
import torch
def table(n):
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    return (torch.arange(n).float()[:, None] * inv).repeat_interleave(2, -1)
def turn(x, partner):
    a = table(x.shape[-2])
    return x * a.cos() + partner(x) * a.sin()
def interleaved(x):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), -1).flatten(-2)
def halves(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)
def rotate(q, k):
    return turn(q, {partner}), turn(k, {partner})
"""


@pytest.mark.parametrize("partner, holds", [("interleaved", True), ("halves", False)])
def test_the_plain_check_passes_a_rotation_and_fails_a_mispaired_one(partner, holds):
    """The check is earned both ways: a rotation paired as its table is holds; the same table turned with the halves'
    partner (rotary-embedding-torch 0.0.11's mistake) does not, by far more than the check's bound."""
    torch.manual_seed(0)
    checked(bench.RELATIVE, _TURN.format(partner=partner), None if holds else "q·k moved by")


def test_populations_build_what_the_check_and_the_audit_read():
    for population in bench.POPULATIONS.values():
        code = compile(population.build, population.name, "exec")
        assert {"layer", "declarations"} <= set(code.co_names), population.name
        compile(population.check, population.name, "exec")
        assert population.deps and population.holds


def test_versions_are_ordered_by_number_and_read_from_the_cache_offline(tmp_path):
    for v in ("0.10.0", "0.2.1", "0.9.1", "0.2.10"):
        (tmp_path / f"pkg-{v}").mkdir()
        (tmp_path / f"pkg-{v}" / "UNPACKED").write_text("x")
    (tmp_path / "pkg-0.3.0").mkdir()  # downloaded, never unpacked: not a release of the cache
    assert bench.versions("pkg", tmp_path, offline=True) == ["0.2.1", "0.2.10", "0.9.1", "0.10.0"]


def test_agreement_table_and_totals():
    """A pass where the property holds and a fail where it does not agree; a pass where it does not (a false PASS)
    and an inconclusive do not; a release that did not build is not run and not counted."""
    population = bench.POPULATIONS["rotary"]
    rows = [bench.Row("1.0", {"status": "passed", "confirmed": "yes"}),
            bench.Row("1.1", {"status": "failed", "fired": {"relative_positions": "fail"},
                              "confirmed": "no (AssertionError: q·k moved by 7.6e-01)",
                              "sites": [["relative_positions", "/x/rotary.py", 37, []]]}),
            bench.Row("1.2", {"status": "passed", "confirmed": "no (AssertionError: q·k moved by 1e-02)"}),
            bench.Row("1.3", {"status": "inconclusive", "confirmed": "yes"}),
            bench.Row("1.4", {"status": "did not build", "error": "LookupError: no xPos"}),
            bench.Row("1.5", {"status": "failed", "confirmed": "no (EinopsError: pattern b n (d r))"})]
    assert [r.agrees for r in rows[:4]] == [True, True, False, False] and not rows[4].run
    assert not rows[5].run  # the plain check raised, not asserted: the build does not fit that release's API
    text = bench.table(population, rows)
    assert "| 1.1 | no: AssertionError: q·k moved by 7.6e-01 | failed (relative_positions) | yes | " \
           "relative_positions@rotary.py:37 |" in text
    assert "| 1.2 |" in text and "**no**" in text and "not run: LookupError: no xPos" in text
    assert "| 1.5 | not run: the plain check raised: EinopsError" in text
    assert bench.totals(population, rows) == ("- rotary: 4 of 6 releases run; the audit agrees with the plain check "
                                              "on 2 of 4: 1 of the 2 where it holds passed, 1 of the 2 where it "
                                              "does not failed")


_MADE = """
import torch
def made():
    cache, inv = dict(), 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    def rotate_at(x, offset):
        key = {key}
        if key not in cache:
            cache[key] = ((torch.arange(x.shape[-2]) + offset).float()[:, None] * inv).repeat_interleave(2, -1)
        a = cache[key]
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return x * a.cos() + torch.stack((-x2, x1), -1).flatten(-2) * a.sin()
    return rotate_at
"""


@pytest.mark.parametrize("key, holds", [("(x.shape[-2], offset)", True), ("x.shape[-2]", False)])
def test_the_cache_check_passes_a_table_keyed_by_offset_and_fails_one_keyed_by_length(key, holds):
    torch.manual_seed(0)
    checked(bench.AT_ANY_OFFSET, _MADE.format(key=key), None if holds else "turned after others differs")


_ATTENTION = """
import torch
from torch import nn

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).chunk(3, -1)
        s = q @ k.transpose(1, 2) / 32 ** 0.5
        t = x.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril({diagonal})
        if mask is not None and {honoured}:
            allowed = allowed & mask[:, None, :]{queries_too}
        return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v

layer = Attention()
"""


@pytest.mark.parametrize("diagonal, queries_too, honoured, fails", [
    (0, "", True, None),
    (1, "", True, "only later tokens changed"),
    (0, " & mask[:, :, None]", True, "padded tokens' outputs are not finite"),
    (0, "", False, "only the padding changed"),
], ids=["correct", "sees the next token", "padded queries masked too (x-transformers 0.0.29)", "its mask ignored"])
def test_the_causal_and_padding_check_is_earned_both_ways(diagonal, queries_too, honoured, fails):
    """Its mask ignored moves the kept outputs only where the padding comes before them (a causal layer never sees
    padding after them: that half of the check could not fail)."""
    torch.manual_seed(0)
    build = _ATTENTION.format(diagonal=diagonal, queries_too=queries_too, honoured=honoured)
    checked(bench.CAUSAL_AND_PADDING, build, fails)


_LOCAL_LIKE = """
import torch
MASK = "{mask_name}"

def layer(q, k, v, mask=None):
    t = q.shape[-2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = torch.ones(t, t, dtype=torch.bool).tril({diagonal})
    if mask is not None and {honoured}:
        allowed = allowed & mask[:, None, None, :]
    return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
"""


@pytest.mark.parametrize("mask_name, diagonal, honoured, fails", [
    ("mask", 0, True, None),
    ("input_mask", 0, True, None),
    ("mask", 1, True, "only later tokens changed"),
    ("input_mask", 0, False, "only the padding changed"),
], ids=["correct", "correct, its mask named input_mask", "sees the next token", "its mask ignored"])
def test_the_local_attention_check_is_earned_both_ways(mask_name, diagonal, honoured, fails):
    torch.manual_seed(0)
    build = _LOCAL_LIKE.format(mask_name=mask_name, diagonal=diagonal, honoured=honoured)
    checked(bench.LOCAL_CAUSAL_AND_PADDING, build, fails)


_LENGTHS = """
import torch
MASK = "mask"

def layer(q, k, v, mask=None):
    if q.shape[-2] % 4:
        {refusal}
    allowed = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    w = (q @ k.transpose(-1, -2)).masked_fill(~allowed, -1e9)
    return (w.softmax(-1) @ v){reshape}
"""


@pytest.mark.parametrize("refusal, reshape, fails", [
    ("assert False, 'sequence length must be divisible by window size 4'", "", None),
    ("raise ValueError('a multiple of 4 is needed')", "", None),
    ("return undefined_name", "", "9 tokens raised NameError"),
    ("assert False", "", "refused without a rule"),
    ("pass", ".flatten(0, 1)", "came back as"),
], ids=["refused by its own check", "refused by a ValueError naming the multiple",
        "a NameError (local-attention 1.5.2)", "an assertion naming nothing",
        "(B x H, T, d) returned (local-attention 1.1.0)"])
def test_the_local_attention_check_reads_lengths_and_shapes(refusal, reshape, fails):
    torch.manual_seed(0)
    checked(bench.LOCAL_CAUSAL_AND_PADDING, _LENGTHS.format(refusal=refusal, reshape=reshape), fails)


_BIASED = """
import torch
from torch import nn

class Bias(nn.Module):  # a T5-style bias per head, by bucket of j - i, through the later API: forward(i, j)
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(31, 8)

    def forward(self, i, j):
        d = torch.arange(j) - torch.arange(i)[:, None]  # (i, j): j - i
        return self.table({bucket} + 15).permute(2, 0, 1)  # (H, i, j)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.rel_pos = nn.Linear(32, 96), Bias()

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 8, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # (B, 8, T, 4)
        s = q @ k.transpose(-2, -1) / 2 + self.rel_pos(T, T)
        if mask is not None and {honoured}:
            s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32)

layer = Block()
"""


@pytest.mark.parametrize("bucket, honoured, fails", [
    ("d.clamp(-15, 15)", True, None),
    ("d.clamp(-15, 0)", True, "one side all in the query's own bucket"),
    ("(torch.arange(j) + 0 * d).clamp(max=15)", True, "no function of j - i"),
    ("d.clamp(-15, 15)", False, "only the padding changed"),
], ids=["correct", "one-sided (x-transformers 0.6.6)", "by the key's own position", "its mask ignored"])
def test_the_two_sided_check_is_earned_both_ways(bucket, honoured, fails):
    """The x_transformers_t5 population's plain check, on a T5-style block of our own: two-sided buckets hold; the
    causal form in a bidirectional layer, a bias of the key's position and a mask ignored each fail it."""
    torch.manual_seed(0)
    checked(bench.TWO_SIDED_AND_PADDING, _BIASED.format(bucket=bucket, honoured=honoured), fails)


_ALIBI = """
import torch
from torch import nn

class Alibi(nn.Module):  # ALiBi through the earlier API, forward(qk_dots), with a cache as x-transformers keeps one
    def __init__(self, heads=4):
        super().__init__()
        self.slopes = 2.0 ** -torch.arange(1, heads + 1).float().view(-1, 1, 1)  # (H, 1, 1)
        self.cached = None

    def forward(self, qk_dots):
        n = qk_dots.shape[-1]
        if self.cached is None or {stale}:
            distance = torch.arange(n) - torch.arange(n)[:, None]  # (n, n): j - i, <= 0 over the past keys
            self.cached = {sign} * self.slopes * distance
        return qk_dots + self.cached

def alibi():
    return Alibi()

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.rel_pos = nn.Linear(32, 96), alibi()

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # (B, 4, T, 8)
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        if mask is not None and {honoured}:
            allowed = allowed & mask[:, None, None, :]
        s = self.rel_pos(q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32)

layer = Block()
"""


@pytest.mark.parametrize("stale, sign, honoured, fails", [
    ("self.cached.shape[-1] != n", 1, True, None),
    ("self.cached.shape[-1] != n", -1, True, "rewards distance"),
    ("False", 1, True, "the ALiBi bias raised"),
    ("self.cached.shape[-1] != n", 1, False, "only the padding changed"),
], ids=["correct", "sign flipped", "a cache made at the first length", "its mask ignored"])
def test_the_alibi_check_is_earned_both_ways(stale, sign, honoured, fails):
    """The x_transformers_alibi population's plain check, on an ALiBi block of our own: the bias made again at each
    length holds; its sign flipped, a cache kept from the first length (x-transformers 0.17.2 and 0.28.2 raise so) and
    a mask ignored each fail it."""
    torch.manual_seed(0)
    checked(bench.ALIBI_AND_PADDING, _ALIBI.format(stale=stale, sign=sign, honoured=honoured), fails)
