"""Shared-QK attention cores, `forward(qk, v)` (issue 34 "Code nobody here wrote", third-party layers).

Reformer's `FullQKAttention` (reformer-pytorch) takes its queries as its keys too, normalised, and its values apart,
and by design keeps each token from attending itself wherever another key is allowed (a token's query is most
like its own key). The audit did not know the parameter `qk`: the layer needed `d_model=` (it owns no parameters,
and no trial call gave it its `v`), and then every probe raised for the missing `v`. A parameter named `qk` is now
the query's stream, the keys made from it inside the layer; a key or value the layer requires is given the same
stream (self-attention, one stream), and such a core's width is found as other cores' are. `causal_alignment`
passes the self-exclusion only for a layer that says its queries are its keys, and only where each query attends
itself exactly when no other key is allowed. Twins on the same inputs: a causal mask that blocks the diagonal
(no key left for the first token) fails; the same self-exclusion in a layer whose queries are not named its keys
fails; a missing 1/sqrt(d) fails.
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
    """The same self-exclusion in a layer that takes one stream `x`: its queries are not said to be its keys."""

    def forward(self, x, input_mask=None):
        return shared_qk_attention(x, x, input_mask, causal=self.causal, bug=self.bug)


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
    assert "its queries are its keys (`qk`)" in alignment.message, alignment
    blocked = diagnostics.audit(SharedQK(causal=True, bug="diagonal blocked"), mask="key_keep", causal=True,
                                dtype=dtype)
    assert blocked.status == "failed", blocked
    assert blocked.result("causal_alignment").verdict == "fail", blocked.result("causal_alignment")
    unscaled = diagnostics.audit(SharedQK(causal=True, bug="unscaled"), mask="key_keep", causal=True, dtype=dtype)
    assert unscaled.result("softmax_saturation").verdict == "fail", unscaled.result("softmax_saturation")


def test_self_exclusion_is_excused_only_where_the_layer_says_its_queries_are_its_keys():
    one_stream = diagnostics.audit(SelfExcluding(causal=True), mask="key_keep", causal=True, d_model=8, num_heads=1)
    alignment = one_stream.result("causal_alignment")
    assert alignment.verdict == "fail" and alignment.message == "a query gives zero weight to its own position", \
        alignment
