"""Every release of a package, one user's layer built on each: the audit's verdict against a plain check.

    python benchmarks/pypi_releases.py [--population NAME ...] [--releases V ...] [--sample N --seed S] [--jobs N]
                                       [--cache DIR] [--offline]

benchmarks/pypi_bugs.py audits the releases on either side of a bug someone found; this audits a population nobody
chose, every release a package ever published, with the same layer a user would write on it, and asks on each
release whether the audit's verdict agrees with a plain script (no diagnostics) that checks the property directly.
A release where they disagree is a false FAIL or a false PASS to study; the rate of agreement is the figure.

Populations (`POPULATIONS`):
- `rotary`: a causal block (a (B, T) key mask, True = keep) whose q and k rotary-embedding-torch turns, through the
  API each release has (`apply_rotary_emb` on the first, `rotate_queries_or_keys` after); the plain check: q·k of the
  turned q and k does not move when every position is shifted by 5 (a rotation depends on j - i only);
- `xpos`: the same block with xPos (`use_xpos=True`, `rotate_queries_and_keys`), on the releases that have it; the
  same plain check (xPos scales q and k by inverse decays, so q·k still depends on j - i only);
- `rotary_cache`: a causal block with a KV cache that turns q and k at their offset
  (`rotate_queries_or_keys(t, offset=...)`), on the releases whose API takes one; the plain check: a token turned
  at offsets 8, 9, 10 one after another is turned as a fresh embedding turns it alone;
- `x_transformers`: x-transformers' `Attention(32, dim_head=8, heads=4, causal=True)` with its (B, T) keep mask, as
  each release makes it (744 releases: `--sample N --seed S` draws N of them); the plain check: no output moves when
  only later tokens change, no kept output moves when only the padding changes, and every output is finite (a padded
  query still has the kept keys). The audit checks
  more than that (the temperature, the weights, the gradients): where it fails a release the check passes, the
  finding is read on the release by hand and said in the docs, true or false;
- `x_transformers_t5`: x-transformers' `Attention(32, dim_head=4, heads=8)`, not causal, given the T5 bias its Encoder
  makes (`RelativePositionBias(causal=False)`), with its (B, T) keep mask, on the releases that have both; the plain
  check: the bias of (i, j) a function of j - i, spread on both sides of a query (not every later key in the query's
  own bucket: x-transformers 0.6.6), no kept output moved by the padding, every output finite;
- `x_transformers_alibi`: x-transformers' `Attention(32, dim_head=8, heads=4, causal=True)` given the ALiBi bias its
  layers make (`AlibiPositionalBias`), with its keep mask; the plain check: the bias at 12, 16 and 12 tokens again
  equal to a fresh bias's (a cache made at one length and read at another), of i - j over the past keys and not
  rewarding distance; then the layer runs, and `CAUSAL_AND_PADDING`;
- `local_attention`: local-attention's bucketed `LocalAttention(window_size=4, causal=True, look_backward=1)` called
  on (B, H, T, d) tensors, as its own LocalTransformer calls it, with its keep mask; the check: the output shaped as
  the input, 9 tokens run or refused by a check that names the multiple, then causal and the padding honoured on 16.

Each release is downloaded with `pip download --no-deps` into the cache pypi_bugs.py uses, audited in its own
subprocess (pypi_bugs.audit_release), and the plain check runs in that process after the audit. A release that does
not build here, or has no such API, is not run (said why), never counted.
"""

from __future__ import annotations

import argparse
import datetime
import random
import re
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pypi_bugs  # noqa: E402 -- its sibling: the download, the unpacking and the audit in a subprocess

_ROTARY = """
import inspect
import torch
import rotary_embedding_torch as R

XPOS = {xpos}
if XPOS and "use_xpos" not in inspect.signature(R.RotaryEmbedding).parameters:
    raise LookupError("no xPos in this release (RotaryEmbedding takes no use_xpos)")
rot = R.RotaryEmbedding(8, **({{"use_xpos": True}} if XPOS else {{}}))

def rotate(q, k):  # q and k (B, H, T, 8) turned at positions 0 .. T-1, through the API the release has
    if XPOS:
        return rot.rotate_queries_and_keys(q, k)
    if hasattr(rot, "rotate_queries_or_keys"):
        return rot.rotate_queries_or_keys(q), rot.rotate_queries_or_keys(k)
    n = q.shape[-2]  # the first releases: the frequencies of the positions, then apply_rotary_emb on (B, T, d)
    freqs = rot(torch.arange(n), cache_key=n)
    return tuple(R.apply_rotary_emb(freqs, t.flatten(0, 1)).view_as(t) for t in (q, k))
""" + pypi_bugs.ROTARY_BLOCK.format(make="rot", rotate="q, k = rotate(q, k)").replace("{", "{{").replace("}", "}}")
"""The rotary and xpos populations' layer: pypi_bugs.py's rotary block (the one its rotary cases build), turning q
and k through whichever API the release has."""

_ROTARY_CACHE = """
import inspect
import rotary_embedding_torch as R

if "offset" not in inspect.signature(R.RotaryEmbedding.rotate_queries_or_keys if hasattr(R.RotaryEmbedding,
        "rotate_queries_or_keys") else (lambda t: t)).parameters:
    raise LookupError("no offset in this release (rotate_queries_or_keys takes none)")

def made():  # for the plain check: a fresh embedding's turn at an offset
    rot = R.RotaryEmbedding(8)
    return lambda t, offset: rot.rotate_queries_or_keys(t, offset=offset)
""" + pypi_bugs.ROTARY_CACHE_BLOCK
"""The rotary_cache population's layer: pypi_bugs.py's KV-cache block, on the releases whose API takes an offset."""

AT_ANY_OFFSET = """
import torch
scope = {}
exec(BUILD, scope)
rotate_at = scope["made"]()
x = torch.randn(1, 1, 1, 8)
for offset in (8, 9, 10):  # one token at a time, as decoding through a cache turns it
    again, fresh = rotate_at(x, offset), scope["made"]()(x, offset)
    moved = ((again - fresh).abs().max() / fresh.abs().max()).item()
    assert moved < 1e-5, (f"a token at position {offset} turned after others differs from one turned alone by "
                          f"{moved:.2e}")
"""
"""The plain check of the cache population: a token turned at an offset, after tokens turned at other offsets, is
turned as a fresh rotary embedding turns it (no diagnostics)."""

_XTR_DEPS = (pypi_bugs.EINOPS, pypi_bugs.ENTMAX, "einx==0.4.3", "frozendict==2.5.1", "loguru==0.7.3", "packaging==24.2",
             "torch-einops-utils==0.2.0", "numpy==2.4.6")  # what its releases import, early and late

_XTR = """
from x_transformers.x_transformers import Attention
layer = Attention(32, dim_head=8, heads=4, causal=True)  # forward(x, context=None, mask=None, ...): (B, T) keep mask
declarations = dict(causal=True, mask="key_keep")
"""

CAUSAL_AND_PADDING = """
import torch
scope = {}
exec(BUILD, scope)
layer = scope["layer"].eval()

def out(x, mask=None):
    with torch.no_grad():
        got = layer(x) if mask is None else layer(x, mask=mask)
    return got[0] if isinstance(got, tuple) else got

x = torch.randn(2, 12, 32)
later = x.clone()
later[:, 8:] = torch.randn(2, 4, 32)  # only tokens 8.. change
base = out(x)
moved = ((base[:, :8] - out(later)[:, :8]).abs().max() / base.abs().max()).item()
assert moved < 1e-5, f"outputs before token 8 moved by {moved:.2e} when only later tokens changed"
right = torch.ones(2, 12, dtype=torch.bool)
right[:, 10:] = False  # the last two tokens are padding
kept = out(x, right)
assert bool(torch.isfinite(kept[:, :10]).all()), "the kept tokens' outputs are not finite"
# a padded query after the kept tokens still has them to attend: its row is finite too (NaN there reaches the kept
# tokens of the next layer, through its values)
assert bool(torch.isfinite(kept).all()), "the padded tokens' outputs are not finite"
left = torch.ones(2, 12, dtype=torch.bool)
left[:, :2] = False  # the first two tokens are padding, which every later query would see were it not masked
padded = x.clone()
padded[:, :2] = torch.randn(2, 2, 32)  # only the padding changes
kept = out(x, left)
moved = ((kept[:, 2:] - out(padded, left)[:, 2:]).abs().max() / kept[:, 2:].abs().max()).item()
assert moved < 1e-5, f"the kept outputs moved by {moved:.2e} when only the padding changed"
"""
"""The plain check of the x-transformers population: causal (no output moves when only later tokens change), its key
mask honoured (no kept output moves when only the padding before them changes: padding after them, which a causal
layer never sees, would prove nothing) and every output finite with the padding after the kept tokens (a padded query
there still has the kept keys)."""

_XTR_T5 = """
import inspect
from torch import nn
import x_transformers.x_transformers as X
if not hasattr(X, "RelativePositionBias") or "rel_pos" not in inspect.signature(X.Attention.forward).parameters:
    raise LookupError("no T5 bias in this release that Attention takes (RelativePositionBias, forward's rel_pos)")

class Block(nn.Module):
    # bidirectional attention with the T5 bias x-transformers' Encoder makes for it (rel_pos_bias=True): 8 heads
    def __init__(self):
        super().__init__()
        self.attn = X.Attention(32, dim_head=4, heads=8)
        scale = {"scale": 4 ** 0.5} if "scale" in inspect.signature(X.RelativePositionBias).parameters else {}
        self.rel_pos = X.RelativePositionBias(causal=False, heads=8, **scale)  # as the Encoder passes dim_head ** 0.5

    def forward(self, x, mask=None):  # mask: (B, T) bool, True = keep
        out = self.attn(x, mask=mask, rel_pos=self.rel_pos)
        return out[0] if isinstance(out, tuple) else out  # (out, intermediates) in some releases

layer = Block()
declarations = dict(mask="key_keep")
"""
"""The x_transformers_t5 population's layer: x-transformers' Attention, not causal, with the T5 bias its Encoder
passes it, on the releases that have both (pypi_bugs.py's xtr_rel_pos_bucket_direction, with a mask)."""
TWO_SIDED_AND_PADDING = """
import inspect
import torch
scope = {}
exec(BUILD, scope)
layer = scope["layer"].eval()
T = 12
with torch.no_grad():  # the bias itself, through the API the release has: (.., T, T) per head
    rel = layer.rel_pos
    bias = rel(torch.zeros(1, 8, T, T)) if "qk_dots" in inspect.signature(rel.forward).parameters else rel(T, T)
bias = bias.reshape(-1, T, T).double()  # (H, T, T)
assert torch.allclose(bias[:, 1:, 1:], bias[:, :-1, :-1]), "the bias of (i, j) is no function of j - i alone"
i = T // 2
spread = lambda b: (b.amax(-1) - b.amin(-1)).max().item()
before, after = spread(bias[:, i, : i + 1]), spread(bias[:, i, i:])
assert after > 1e-3 * before and before > 1e-3 * after, (f"query {i}'s bias spreads by {before:.3g} over the keys "
                                                        f"before it and by {after:.3g} over those after it: one side "
                                                        f"all in the query's own bucket")
def out(x, mask=None):
    with torch.no_grad():
        return layer(x, mask=mask)
x = torch.randn(2, T, 32)
keep = torch.ones(2, T, dtype=torch.bool)
keep[:, -2:] = False  # the last two tokens are padding, which every query would see were it not masked
padded = x.clone()
padded[:, -2:] = torch.randn(2, 2, 32)  # only the padding changes
kept = out(x, keep)
assert bool(torch.isfinite(kept).all()), "an output is not finite with two tokens of padding"
moved = ((kept[:, :-2] - out(padded, keep)[:, :-2]).abs().max() / kept[:, :-2].abs().max()).item()
assert moved < 1e-5, f"the kept outputs moved by {moved:.2e} when only the padding changed"
"""
"""The plain check of the x_transformers_t5 population: the T5 bias a function of j - i, spread on both sides of a
query (a bidirectional layer tells apart the keys after it too), its key mask honoured and every output finite."""
_XTR_ALIBI = """
import inspect
from torch import nn
import x_transformers.x_transformers as X
if not hasattr(X, "AlibiPositionalBias") or "rel_pos" not in inspect.signature(X.Attention.forward).parameters:
    raise LookupError("no ALiBi in this release that Attention takes (AlibiPositionalBias, forward's rel_pos)")

def alibi():  # as x-transformers' AttentionLayers makes it for alibi_pos_bias=True, every head biased
    takes = inspect.signature(X.AlibiPositionalBias).parameters
    return X.AlibiPositionalBias(heads=4, **({"total_heads": 4} if "total_heads" in takes else {}))

class Block(nn.Module):
    # causal attention with ALiBi, the bias passed to Attention as the layers pass it
    def __init__(self):
        super().__init__()
        self.attn = X.Attention(32, dim_head=8, heads=4, causal=True)
        self.rel_pos = alibi()

    def forward(self, x, mask=None):  # mask: (B, T) bool, True = keep
        out = self.attn(x, mask=mask, rel_pos=self.rel_pos)
        return out[0] if isinstance(out, tuple) else out  # (out, intermediates) in some releases

layer = Block()
declarations = dict(causal=True, mask="key_keep")
"""
"""The x_transformers_alibi population's layer: x-transformers' causal Attention with the ALiBi bias its layers pass
it, on the releases that have both (the three ALiBi cases of pypi_bugs.py are releases of it)."""
_RUNS = """
try:
    layer(torch.randn(2, 12, 32))
except Exception as error:
    raise AssertionError(f"the layer raised: {type(error).__name__}: {error}")
"""
ALIBI_AND_PADDING = """
import inspect
import torch
scope = {}
exec(BUILD, scope)

def bias_of(rel, n):  # (H, n, n) through the API the release has, less each row's own value at its query: a
    # constant per row changes no softmax (ALiBi's own code adds -slope x j, the key's position alone, for that reason)
    with torch.no_grad():
        got = (rel(torch.zeros(1, 4, n, n)) if "qk_dots" in inspect.signature(rel.forward).parameters else rel(n, n))
    got = got.reshape(-1, n, n).double()
    return got - got.diagonal(0, -2, -1).unsqueeze(-1)

try:
    rel = scope["layer"].rel_pos
    first, longer, again = bias_of(rel, 12), bias_of(rel, 16), bias_of(rel, 12)
except Exception as error:
    raise AssertionError(f"the ALiBi bias raised: {type(error).__name__}: {error}")
fresh = {n: bias_of(scope["alibi"](), n) for n in (12, 16)}
for n, got in ((12, first), (16, longer), (12, again)):
    past = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.allclose(got[:, past], fresh[n][:, past]), (f"the bias at {n} tokens, after a call at another length, "
                                                             f"differs from a fresh one's (its cache)")
past = torch.ones(12, 12, dtype=torch.bool).tril()
lower = first.masked_fill(~past, 0)
assert torch.allclose(lower[:, 1:, 1:], lower[:, :-1, :-1]), "the bias over past keys is no function of i - j alone"
row = first[:, 11, :12]  # the newest query over every key: nearer keys not penalised more than farther ones
assert bool((row[:, 1:] >= row[:, :-1] - 1e-9).all()), "the bias rewards distance over the past keys"
""" + CAUSAL_AND_PADDING.replace('layer = scope["layer"].eval()\n', 'layer = scope["layer"].eval()\n' + _RUNS, 1)
"""The plain check of the x_transformers_alibi population: the ALiBi bias (less a constant per row, which no softmax
sees) at 12, 16 and 12 tokens again as a fresh bias at each (a cache made at one length read at another), a function
of i - j over the past keys that does not reward distance; then the layer runs, and is causal, its key mask honoured
and every output finite."""
_LOCAL = """
import inspect
from local_attention import LocalAttention
local = LocalAttention(window_size=4, causal=True, look_backward=1)  # forward(q, k, v, mask / input_mask=None)
MASK = next((n for n in ("mask", "input_mask") if n in inspect.signature(local.forward).parameters), None)

def layer(q, k, v, mask=None):  # on (B, H, T, d), as its own LocalTransformer calls it; a (B, T) keep mask
    return local(q, k, v, **({} if mask is None else {MASK: mask}))

declarations = dict(causal=True, mask="key_keep")
"""

LOCAL_CAUSAL_AND_PADDING = """
import torch
scope = {}
exec(BUILD, scope)
layer, mask_name = scope["layer"], scope["MASK"]

def out(x, keep=None):
    with torch.no_grad():
        return layer(x, x, x, keep)

x = torch.randn(2, 2, 16, 8)  # (B, H, T, d), T a multiple of the window
assert out(x).shape == x.shape, f"(B, H, T, d) {tuple(x.shape)} came back as {tuple(out(x).shape)}"
try:  # a length it does not take: it runs, or says what it needs (its own check naming the multiple)
    out(x[:, :, :9])
except (AssertionError, ValueError) as error:
    assert "divisible" in str(error) or "multiple" in str(error), f"9 tokens refused without a rule: {error!r}"
except Exception as error:
    raise AssertionError(f"9 tokens raised {type(error).__name__}: {error}")
later = x.clone()
later[:, :, 8:] = torch.randn(2, 2, 8, 8)  # only tokens 8.. change
base = out(x)
moved = ((base[:, :, :8] - out(later)[:, :, :8]).abs().max() / base.abs().max()).item()
assert moved < 1e-5, f"outputs before token 8 moved by {moved:.2e} when only later tokens changed"
if mask_name is not None:
    right = torch.ones(2, 16, dtype=torch.bool)
    right[:, 14:] = False  # the last two tokens are padding
    assert bool(torch.isfinite(out(x, right)[:, :, :14]).all()), "the kept tokens' outputs are not finite"
    left = torch.ones(2, 16, dtype=torch.bool)
    left[:, :2] = False  # the first two are padding, which the next queries would see were it not masked
    padded = x.clone()
    padded[:, :, :2] = torch.randn(2, 2, 2, 8)
    kept = out(x, left)
    moved = ((kept[:, :, 2:] - out(padded, left)[:, :, 2:]).abs().max() / kept[:, :, 2:].abs().max()).item()
    assert moved < 1e-5, f"the kept outputs moved by {moved:.2e} when only the padding changed"
"""
"""The plain check of the local-attention population: its output shaped as its (B, H, T, d) input; at 9 tokens (no
multiple of its window of 4) it runs or says the multiple it needs; causal and its key mask (where its forward takes
one) honoured on 16 tokens."""

SHIFT = 5
"""The plain check's shift: every position moved by 5 (5 tokens before the 12 compared)."""

RELATIVE = f"""
import torch
scope = {{}}
exec(BUILD, scope)
rotate = scope["rotate"]
q, k, pad_q, pad_k = (torch.randn(1, 1, n, 8) for n in (12, 12, {SHIFT}, {SHIFT}))
plain = torch.einsum("bhid,bhjd->bhij", *rotate(q, k))
qs, ks = rotate(torch.cat((pad_q, q), -2), torch.cat((pad_k, k), -2))
shifted = torch.einsum("bhid,bhjd->bhij", qs[..., {SHIFT}:, :], ks[..., {SHIFT}:, :])
moved = ((plain - shifted).abs().max() / plain.abs().max()).item()
assert moved < 1e-4, f"q·k moved by {{moved:.2e}} of its largest when every position shifted by {SHIFT}"
"""
"""The plain check: asserts that q·k of the turned q and k depends on j - i only (no diagnostics)."""


@dataclass(frozen=True)
class Population:
    name: str
    package: str
    build: str  # defines `layer`, `declarations` and what `check` reads; raises LookupError where it does not apply
    check: str  # a plain script that asserts the property holds (exec'd with BUILD)
    holds: str  # what the check asserts, for the table
    deps: tuple[str, ...] = (pypi_bugs.EINOPS, "beartype==0.16.4")  # what rotary-embedding-torch's releases import


POPULATIONS = {p.name: p for p in (
    Population("rotary", "rotary-embedding-torch", _ROTARY.format(xpos=False), RELATIVE,
               "q·k depends on j - i only"),
    Population("xpos", "rotary-embedding-torch", _ROTARY.format(xpos=True), RELATIVE,
               "q·k depends on j - i only"),
    Population("rotary_cache", "rotary-embedding-torch", _ROTARY_CACHE, AT_ANY_OFFSET,
               "a token turned at any offset as alone"),
    Population("x_transformers", "x-transformers", _XTR, CAUSAL_AND_PADDING,
               "causal, and its key mask honoured", _XTR_DEPS),
    Population("x_transformers_t5", "x-transformers", _XTR_T5, TWO_SIDED_AND_PADDING,
               "T5 bias of j - i on both sides, key mask honoured", _XTR_DEPS),
    Population("x_transformers_alibi", "x-transformers", _XTR_ALIBI, ALIBI_AND_PADDING,
               "ALiBi as fresh at any length, causal, key mask honoured", _XTR_DEPS),
    Population("local_attention", "local-attention", _LOCAL, LOCAL_CAUSAL_AND_PADDING,
               "causal, and its key mask honoured", (pypi_bugs.EINOPS,)),
)}


@dataclass
class Row:
    version: str
    result: dict = field(default_factory=dict)
    error: str = ""  # the release could not be fetched or unpacked

    @property
    def run(self) -> bool:
        """Audited, and the plain check answered: it held, or its assertion failed (a check that raised anything
        else, an API the build does not fit, answered nothing)."""
        return not self.error and self.result.get("status") in ("passed", "failed", "inconclusive") and \
            (self.holds or self.result.get("confirmed", "").startswith("no (AssertionError"))

    @property
    def holds(self) -> bool:
        return self.result.get("confirmed") == "yes"

    @property
    def agrees(self) -> bool:
        """The audit passed where the property holds, failed where it does not (inconclusive agrees with neither)."""
        return self.result.get("status") == ("passed" if self.holds else "failed")


def version_key(version: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def versions(package: str, cache: Path, offline: bool) -> list[str]:
    """Every release of `package` on the index (`pip index versions`), oldest first; offline, those in the cache."""
    if offline:
        found = [p.name[len(package) + 1:] for p in cache.glob(f"{package}-*") if (p / "UNPACKED").exists()]
    else:
        done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package,
                               "--disable-pip-version-check"], capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("Available versions:")), "")
        if not line:
            raise RuntimeError(f"pip index versions {package} listed none: {(done.stderr or done.stdout)[-300:]}")
        found = [v.strip() for v in line.split(":", 1)[1].split(",")]
    return sorted((v for v in found if re.fullmatch(r"\d+(\.\d+)*", v)), key=version_key)


def run_release(population: Population, version: str, cache: Path, offline: bool, deps: list[Path]) -> Row:
    row = Row(version)
    try:
        root = pypi_bugs.release_dir(f"{population.package}=={version}", cache, offline)
    except (OSError, RuntimeError, ValueError) as error:
        row.error = str(error)[:200]
        return row
    case = pypi_bugs.Case(f"{population.name}-{version}", population.name, population.package, version, version,
                          "", 0, "", "", population.build, population.deps)
    row.result = pypi_bugs.audit_release(case, root, deps, confirm=population.check)
    return row


def _failed(result: dict) -> str:
    failed = [d for d, v in result.get("fired", {}).items() if v == "fail"]
    return f" ({', '.join(failed)})" if failed else ""


def table(population: Population, rows: list[Row]) -> str:
    out = [f"| {population.package} | plain check: {population.holds} | audit | agree | first site |",
           "|---|---|---|---|---|"]
    for r in rows:
        if not r.run:
            why = r.error or r.result.get("error") or (f"the plain check raised: {r.result['confirmed'][4:]}" if
                                                       r.result.get("status") in ("passed", "failed", "inconclusive")
                                                       else r.result.get("status", "-"))
            out.append(f"| {r.version} | not run: {why[:160]} | - | - | - |")
            continue
        plain = "yes" if r.holds else f"no: {r.result.get('confirmed', '-')[3:].strip(' ()')[:120]}"
        sites = r.result.get("sites") or []
        first = f"{sites[0][0]}@{Path(sites[0][1]).name}:{sites[0][2]}" if sites else "-"
        out.append(f"| {r.version} | {plain} | {r.result['status']}{_failed(r.result)} | "
                   f"{'yes' if r.agrees else '**no**'} | {first} |")
    return "\n".join(out)


def totals(population: Population, rows: list[Row]) -> str:
    run = [r for r in rows if r.run]
    broken = [r for r in run if not r.holds]
    caught = [r for r in broken if r.result.get("status") == "failed"]
    fine = [r for r in run if r.holds]
    passed = [r for r in fine if r.result.get("status") == "passed"]
    return (f"- {population.name}: {len(run)} of {len(rows)} releases run; the audit agrees with the plain check on "
            f"{sum(r.agrees for r in run)} of {len(run)}: {len(passed)} of the {len(fine)} where it holds passed, "
            f"{len(caught)} of the {len(broken)} where it does not failed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", nargs="+", choices=sorted(POPULATIONS), default=sorted(POPULATIONS))
    parser.add_argument("--releases", nargs="+", metavar="V", help="these releases only")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="N releases drawn at random (with --seed) from the index's list; with --offline from the "
                             "cached releases, which is another draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="releases audited at once (one subprocess each)")
    parser.add_argument("--cache", type=Path, default=pypi_bugs.CACHE)
    parser.add_argument("--offline", action="store_true", help="use the cache only; download nothing")
    args = parser.parse_args(argv)
    start, counted = time.perf_counter(), 0
    for name in args.population:
        population = POPULATIONS[name]
        found = args.releases or versions(population.package, args.cache, args.offline)
        if args.sample and args.sample < len(found):
            found = sorted(random.Random(args.seed).sample(found, args.sample), key=version_key)
        deps = [pypi_bugs.release_dir(d, args.cache, args.offline) for d in population.deps]
        for v in found:  # fetched one by one first: pip download is not run twice at once into one cache
            try:
                pypi_bugs.release_dir(f"{population.package}=={v}", args.cache, args.offline)
            except (OSError, RuntimeError, ValueError):
                pass  # said in the row
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda v: run_release(population, v, args.cache, args.offline, deps), found))
        counted += sum(r.run for r in rows)
        print(table(population, rows))
        print()
        print(totals(population, rows))
        print()
    took = time.perf_counter() - start
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    import torch  # noqa: PLC0415 (only for the versions line; the audits ran in subprocesses)

    command = " ".join(["python benchmarks/pypi_releases.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"`{command}`: {counted} releases audited in {took:.1f} s on {datetime.date.today().isoformat()} "
          f"(torch {torch.__version__}, Python {sys.version.split()[0]}, 1 thread per audit, one subprocess each)")


if __name__ == "__main__":
    main()
