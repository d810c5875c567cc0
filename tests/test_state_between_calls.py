"""A layer whose first call leaves a state its later calls read: localised at the line of the later calls' own path.

PaLM-pytorch 0.2.0's `palm_lite` caches its ALiBi bias on the first call, and on every later call returns the scores
plus the cached bias, which its caller adds to the scores again: logits 2 x q.k + bias from the second call on
(benchmarks/pypi_bugs.py's `palm_alibi_cached_twice`, from the release). `eval_determinism` fails it (two calls on the
same input differ), but every call the locator traced was a later one, alike, so it pointed nowhere. Now the layer is
put back as it came to the audit (`Probe.as_given`), its first and second call are traced, and the site is the line of
the second call's own path that made the value that moved (then the op that consumed it). And the audit leaves the
cache unmade, as it found it.

The layer here is of our own writing in that shape; its twin caches right, on the same inputs.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import diagnostics


class CachedBias(nn.Module):
    """A distance bias, made on the first call and cached (None until then). `bug`: the cached path returns the
    scores plus the bias, as PaLM-lite's did."""

    def __init__(self, heads: int, bug: bool):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.register_buffer("bias", None, persistent=False)

    def forward(self, scores):
        i, j = scores.shape[-2:]
        if self.bias is not None and self.bias.shape[-1] >= j:
            if self.bug:
                return scores + self.bias[..., :i, :j]
            return self.bias[..., :i, :j]
        slopes = 2.0 ** -torch.arange(1, self.heads + 1, dtype=scores.dtype, device=scores.device)
        distance = (torch.arange(j, device=scores.device) - torch.arange(i, device=scores.device)[:, None]).abs()
        self.register_buffer("bias", -slopes[:, None, None] * distance, persistent=False)
        return self.bias


class BiasedSelfAttention(nn.Module):
    def __init__(self, d_model: int = 32, heads: int = 4, bug: bool = False):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.bias = CachedBias(heads, bug)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores + self.bias(scores)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def _line_of(function, text: str) -> int:
    source, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(source) if text in line)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_read_wrong_from_the_second_call_is_found_at_the_cached_path(dtype):
    torch.manual_seed(0)
    layer = BiasedSelfAttention(bug=True).to(dtype)
    report = diagnostics.audit(layer, dtype=dtype)
    found = report.result("eval_determinism")
    assert found.verdict == "fail", found
    assert "a state one call leaves for the next" in found.message
    lines = [site.line for site in found.where]
    assert lines[:2] == [_line_of(CachedBias.forward, "return scores + self.bias"),
                         _line_of(BiasedSelfAttention.forward, "scores = scores + self.bias(scores)")], \
        [site.describe() for site in found.where]
    assert layer.bias.bias is None, "the audit left the cache its calls made"
    assert "state kept between calls" in found.where[0].fix, found.where[0].fix  # its cause, not dropout's


@pytest.mark.parametrize("bug", [True, False], ids=["cached path wrong", "twin"])
def test_the_cache_read_wrong_is_found_in_bfloat16_at_gpt2_initialisation(bug):
    """At std 0.02 the scores are small beside the bias, and the second call's doubled scores still move the output
    far past bfloat16's rounding; its twin moves nothing (it may stay inconclusive there: a bias beside a q.k that
    small hides the softmax's factor in bfloat16, which softmax_saturation says)."""
    torch.manual_seed(0)
    layer = BiasedSelfAttention(bug=bug)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.02)
    found = diagnostics.audit(layer.to(torch.bfloat16), dtype=torch.bfloat16).result("eval_determinism")
    assert found.verdict == ("fail" if bug else "pass"), found
    if bug:
        assert [site.line for site in found.where][:1] == [_line_of(CachedBias.forward, "return scores + self.bias")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_twin_that_caches_the_bias_alone_passes(dtype):
    torch.manual_seed(0)
    layer = BiasedSelfAttention(bug=False).to(dtype)
    report = diagnostics.audit(layer, dtype=dtype)
    assert report.passed, report
    assert layer.bias.bias is None


class LengthCachedBias(nn.Module):
    """A per-key distance bias cached at the length of the call that made it. `bug`: "shorter" reuses a cache as
    long as it is no longer than the keys (x-transformers 0.17.2's `<= j` for `>= j`: a cache made at one token then
    broadcasts one column over every later call); "once" makes it on the first call alone and slices it on the keys
    only (0.28.2's: a later call with fewer queries raises)."""

    def __init__(self, heads: int, bug: str | None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.register_buffer("bias", None, persistent=False)

    def forward(self, scores):
        i, j = scores.shape[-2:]
        slopes = 2.0 ** -torch.arange(1, self.heads + 1, dtype=scores.dtype, device=scores.device)
        if self.bug == "once":
            if self.bias is None:
                distance = torch.arange(j, device=scores.device) - torch.arange(i, device=scores.device)[:, None]
                self.register_buffer("bias", slopes[:, None, None] * distance, persistent=False)
            return scores + self.bias[..., :j]  # made once
        reuse = self.bias is not None and (self.bias.shape[-1] <= j if self.bug == "shorter" else self.bias.shape[-1] >= j)
        if reuse:
            return scores + self.bias[..., :j]  # reused
        self.register_buffer("bias", slopes[:, None, None] * torch.arange(j, device=scores.device), persistent=False)
        return scores + self.bias


class CausalLengthCached(nn.Module):
    """Causal attention, its future filled with -finfo.max (lucidrains' `max_neg_value`), plus the cached bias."""

    def __init__(self, d_model: int = 32, heads: int = 4, bug: str | None = None):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.bias = LengthCachedBias(heads, bug)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = self.bias(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, -torch.finfo(scores.dtype).max)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def test_a_cache_rebuilt_at_another_length_is_found_where_it_is_read():
    """The cache the audit's T = 1 call made, reused by every later call: two calls on the same input differ. The
    locator traces the first call as the layer came and one as the audit's calls left it; the scores filled with
    -finfo.max had made every score's scale 1e38, so no op moved (no site); the fill is no scale now."""
    torch.manual_seed(0)
    report = diagnostics.audit(CausalLengthCached(bug="shorter"), causal=True)
    found = report.result("eval_determinism")
    assert found.verdict == "fail", found
    assert [site.line for site in found.where][:1] == [_line_of(LengthCachedBias.forward, "# reused")], \
        [site.describe() for site in found.where]


def test_a_cache_made_once_is_replayed_as_the_calls_left_it():
    """A raise that depends on the cache an earlier call made (a bias of 16 queries added to one query's scores, which
    it broadcasts to 16 rows): replayed on the layer as it came, as the audit now leaves it, the call makes its own
    cache and runs, so `runs` pointed nowhere; replayed as the audit's calls left it, it raises where it did."""
    torch.manual_seed(0)
    layer = CausalLengthCached(bug="once")
    runs = diagnostics.audit(layer, causal=True).result("runs")
    assert runs.verdict == "fail", runs
    assert _line_of(CausalLengthCached.forward, ".reshape(B, T, D)") in [site.line for site in runs.where], \
        [site.describe() for site in runs.where]
    assert layer.bias.bias is None, "the replay left the cache set"


def test_their_twin_that_caches_by_length_passes():
    torch.manual_seed(0)
    report = diagnostics.audit(CausalLengthCached(bug=None), causal=True)
    assert report.passed, report


class RebuiltAtEachLength(nn.Module):
    """A distance bias cached at the length it was made at and rebuilt whenever the length changes; `bug`: the cached
    path adds it twice. In self-attention that takes a (B, 1, Tq, Tk) mask."""

    def __init__(self, d_model: int = 32, heads: int = 4, bug: bool = True):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.register_buffer("bias", None, persistent=False)

    def biased(self, scores):
        T = scores.shape[-1]
        if self.bias is None or self.bias.shape[-1] != T:
            slopes = 2.0 ** -torch.arange(1, self.heads + 1, dtype=scores.dtype)
            position = torch.arange(T)
            self.bias = (-slopes[:, None, None] * (position[None] - position[:, None]).abs()).to(scores.dtype)
            return scores + self.bias
        return scores + self.bias + self.bias if self.bug else scores + self.bias  # the cached path

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = self.biased(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def test_a_cache_the_audit_left_at_another_length_is_read_on_the_state_the_first_call_leaves():
    """The audit's last calls left the cache at another length, so a call as they left it rebuilds it and agrees with
    the first: the locator traces the second call on the state the first left before it turns to what the audit
    left (a review found no site here)."""
    torch.manual_seed(0)
    found = diagnostics.audit(RebuiltAtEachLength()).result("eval_determinism")
    assert found.verdict == "fail", found
    assert [site.line for site in found.where][:1] == [_line_of(RebuiltAtEachLength.biased, "+ self.bias + self.bias")]


def test_its_twin_rebuilt_at_each_length_and_read_right_passes():
    torch.manual_seed(0)
    report = diagnostics.audit(RebuiltAtEachLength(bug=False))
    assert report.result("eval_determinism").verdict == "pass" and report.passed, report
