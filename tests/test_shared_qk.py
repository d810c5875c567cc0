"""Shared-QK attention cores, `forward(qk, v)` (issue 34 "Code nobody here wrote", third-party layers).

Reformer's `FullQKAttention` (reformer-pytorch) takes its queries as its keys too, normalised, and its values apart,
and by design keeps each token from attending itself wherever another key is allowed (a token's query is most
like its own key). The audit did not know the parameter `qk`: the layer needed `d_model=` (it owns no parameters,
and no trial call gave it its `v`), and then every probe raised for the missing `v`. A parameter named `qk` is now
the query's stream, the keys made from it inside the layer; a key or value the layer requires is given the same
stream (self-attention, one stream), and such a core's width is found as other cores' are. `causal_alignment`
passes the self-exclusion only where the product before the softmax takes each token's key parallel to its query,
and only where each query attends itself exactly when no other key is allowed (under the mask and a declared
pattern). Twins on the same inputs: a causal mask that blocks the diagonal (no key left for the first token) fails;
the same self-exclusion with keys of their own projection fails, under the name `qk` too; a missing 1/sqrt(d)
fails; a lone required key (`forward(q, k)`) is a second stream to declare, never the same one silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics

SELF = -5e4  # the score a token gives its own key where any other is allowed (as Reformer's TOKEN_SELF_ATTN_VALUE)


def shared_qk_attention(qk, v, input_mask=None, *, causal=False, bug=""):
    """Attention of the queries qk over their own l2-normalised rows as keys. `bug`: "diagonal blocked" (the causal
    mask blocks each query's own key as well, so the first has none), "unscaled" (no 1/sqrt(d))."""
    B, T, d = qk.shape
    keys = F.normalize(qk, dim=-1)
    scores = qk @ keys.transpose(-2, -1)
    if bug != "unscaled":
        scores = scores * d ** -0.5
    own = torch.eye(T, dtype=torch.bool, device=qk.device)
    scores = scores.masked_fill(own, SELF)  # not itself, unless every other key is blocked (it stays above those)
    blocked = torch.finfo(scores.dtype).min
    if input_mask is not None:
        scores = scores.masked_fill(~input_mask[:, None, :], blocked)
    if causal:
        future = torch.ones(T, T, dtype=torch.bool, device=qk.device).triu(0 if bug == "diagonal blocked" else 1)
        scores = scores.masked_fill(future, blocked)
    return scores.softmax(dim=-1) @ v


class SharedQK(nn.Module):
    """The core as a module, as Reformer writes it: forward(qk, v, input_mask=None)."""

    def __init__(self, causal=False, bug=""):
        super().__init__()
        self.causal, self.bug = causal, bug

    def forward(self, qk, v, input_mask=None):
        return shared_qk_attention(qk, v, input_mask, causal=self.causal, bug=self.bug)


class SelfExcluding(SharedQK):
    """The same attention in a module that takes one stream `x` (as Reformer's wrapper around its core does): its keys
    are still its queries, which the product before the softmax shows."""

    def forward(self, x, input_mask=None):
        return shared_qk_attention(x, x, input_mask, causal=self.causal, bug=self.bug)


class OwnKeys(nn.Module):
    """A causal attention with keys of their own projection that excludes each token's own key the same way (its
    diagonal blocked, the first query left its own): not shared-QK, whatever its parameter is named."""

    def __init__(self, copied: bool = False):
        super().__init__()
        self.w_q, self.w_k = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        if copied:  # keys parallel to the queries at this initialisation, from a projection of their own
            self.w_k.load_state_dict(self.w_q.state_dict())

    def forward(self, qk, v, input_mask=None):
        T = qk.shape[1]
        scores = self.w_q(qk) @ self.w_k(qk).transpose(-2, -1) * qk.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.eye(T, dtype=torch.bool), SELF)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        return scores.masked_fill(future, torch.finfo(scores.dtype).min).softmax(-1) @ v


class Chunked(SharedQK):
    """Causal within chunks of 4 tokens, a pattern the layer builds itself: the first token of each chunk has no key
    but its own."""

    def forward(self, qk, v, input_mask=None):
        T = qk.shape[1]
        keys = F.normalize(qk, dim=-1)
        scores = (qk @ keys.transpose(-2, -1) * qk.shape[-1] ** -0.5).masked_fill(torch.eye(T, dtype=torch.bool),
                                                                                   SELF)
        i = torch.arange(T)
        blocked = (i[None, :] > i[:, None]) | (i[None, :] // 4 != i[:, None] // 4)
        return scores.masked_fill(blocked, torch.finfo(scores.dtype).min).softmax(-1) @ v


class Folded(SharedQK):
    """Two heads folded into the batch before the core, (B x H, T, d), as Reformer's wrapper hands its core."""

    def forward(self, qk, v, input_mask=None):
        B, T, D = qk.shape
        fold = lambda t: t.view(B, T, 2, D // 2).transpose(1, 2).reshape(B * 2, T, D // 2)
        mask = None if input_mask is None else input_mask.repeat_interleave(2, dim=0)
        out = shared_qk_attention(fold(qk), fold(v), mask, causal=self.causal, bug=self.bug)
        return out.view(B, 2, T, D // 2).transpose(1, 2).reshape(B, T, D)


def test_the_core_is_audited_zero_config():
    """It raised a usage error for d_model, then failed `runs` for its `v` on every probe; its mask, `input_mask`,
    is one per key by its name."""
    report = diagnostics.audit(SharedQK())
    assert report.status == "passed", report
    assert "d_model=8 chosen" in report.layer, report.layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_self_exclusion_passes_and_the_twins_fail(dtype):
    right = diagnostics.audit(SharedQK(causal=True), mask="key_keep", causal=True, dtype=dtype)
    assert right.status == "passed", right
    alignment = right.result("causal_alignment")
    assert "its keys are its queries" in alignment.message, alignment
    blocked = diagnostics.audit(SharedQK(causal=True, bug="diagonal blocked"), mask="key_keep", causal=True,
                                dtype=dtype)
    assert blocked.status == "failed", blocked
    assert blocked.result("causal_alignment").verdict == "fail", blocked.result("causal_alignment")
    unscaled = diagnostics.audit(SharedQK(causal=True, bug="unscaled"), mask="key_keep", causal=True, dtype=dtype)
    assert unscaled.result("softmax_saturation").verdict == "fail", unscaled.result("softmax_saturation")


def test_self_exclusion_is_excused_only_where_the_keys_are_the_queries():
    """Read from the product before the softmax, not from a name: the same attention given one stream `x` passes; keys
    of their own projection excluded the same way fail, under the name `qk` too, also where that projection is a copy
    of the queries' (parallel keys, made apart: review C)."""
    one_stream = diagnostics.audit(SelfExcluding(causal=True), mask="key_keep", causal=True, d_model=8, num_heads=1)
    assert one_stream.result("causal_alignment").verdict == "pass", one_stream.result("causal_alignment")
    for copied in (False, True):
        torch.manual_seed(0)
        own = diagnostics.audit(OwnKeys(copied), mask="key_keep", causal=True).result("causal_alignment")
        assert own.verdict == "fail" and own.message == "a query gives zero weight to its own position", (copied, own)


def test_a_pattern_of_its_own_and_heads_folded_into_the_batch():
    """The first token of each chunk attends itself alone: the declared pattern counts in where each query has no
    other key. Heads folded into the batch, (B x H, T, T) weights under a (B, T, T) mask, are read per sequence (the
    check crashed on them)."""
    chunks = diagnostics.patterns.Pattern(lambda b, h, q, kv: (kv <= q) & (kv // 4 == q // 4), "causal chunks of 4")
    chunked = diagnostics.audit(Chunked(), mask="key_keep", causal=True, pattern=chunks)
    assert chunked.result("causal_alignment").verdict == "pass", chunked.result("causal_alignment")
    folded = diagnostics.audit(Folded(causal=True), mask="key_keep", causal=True)
    assert folded.status == "passed", folded
    blocked = diagnostics.audit(Folded(causal=True, bug="diagonal blocked"), mask="key_keep", causal=True)
    assert blocked.result("causal_alignment").verdict == "fail", blocked.result("causal_alignment")


class CrossK(nn.Module):
    """Cross-attention whose memory is named `k`, its keys and values both made from it: forward(q, k). `bug`: the
    values projected from the queries' stream."""

    def __init__(self, bug=""):
        super().__init__()
        self.d_model, self.num_heads, self.bug = 16, 2, bug
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, q, k):
        B, Tq, D = q.shape
        split = lambda t: t.view(B, t.shape[1], 2, D // 2).transpose(1, 2)
        Q, K, V = split(self.wq(q)), split(self.wk(k)), split(self.wv(q if self.bug else k))
        w = (Q @ K.transpose(-2, -1) * (D // 2) ** -0.5).softmax(-1)
        return self.wo((w @ V).transpose(1, 2).reshape(B, Tq, D))


def test_a_lone_key_required_is_a_second_stream_never_the_same_one_silently():
    """Only a shared-QK layer's required value gets the query's stream. `forward(q, k)` says nothing of what `k` is:
    the report names the call to declare (it was audited as self-attention, and its values taken from the queries
    passed), and under the cross-attention call the bug fails."""
    torch.manual_seed(0)
    right = diagnostics.audit(CrossK())
    assert right.status == "inconclusive" and "layer(x, k=" in right.declaration, right
    torch.manual_seed(0)
    bug = CrossK(bug="values from q")
    assert diagnostics.audit(bug).status != "passed"
    declared = diagnostics.audit(bug, cross=True, call=lambda layer, x, memory: layer(x, k=memory))
    assert declared.status == "failed", declared


class ValuesFromQK(SharedQK):
    """The core with its values read from `qk` instead of `v` (a typo its one-stream probes cannot see)."""

    def forward(self, qk, v, input_mask=None):
        return shared_qk_attention(qk, qk, input_mask, causal=self.causal, bug=self.bug)


def test_its_values_are_changed_apart_from_its_queries():
    """Given one stream, `v` is the same tokens as `qk`, and a core that read its values from `qk` passed (review C):
    `keys_matter` moves token 0's values alone through `v`, and the other rows must move."""
    right = diagnostics.audit(SharedQK()).result("keys_matter")
    assert right.verdict == "pass" and "its `v`" in right.evidence, right
    wrong = diagnostics.audit(ValuesFromQK()).result("keys_matter")
    assert wrong.verdict == "fail", wrong
