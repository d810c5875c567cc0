"""A broken layer that gives NaN only at a longer length is blamed on itself, not on the layer before it.

`gradient_flow` tries parameters that get no gradient at the audit's length (16) at longer ones (64, 256, 1024):
a sparse-attention indexer that keeps 32 keys chooses every key of a short sequence and acts only past 32 tokens.
Found by the transformers sweep's injected bugs (HY-V4, 2026-12-04): with a softmax over the queries in its second
layer, the model's output is NaN at 64 tokens (a key no query chose is a column of -inf), so the first layer's
indexer got a NaN gradient there and was reported unused, a FAIL at the correct first layer. A non-finite output at
the longer length now measures nothing about those parameters; it is the finding, at the first attention module whose
output is not finite. The correct twin (the same model with both softmaxes over the keys) keeps its warning: its
indexers are used from 64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

D, VOCAB, CONTEXT, KEYS = 16, 32, 1024, 32  # width, vocabulary, positions, keys each layer's indexer keeps


class IndexedAttention(nn.Module):
    """Single-head attention over the keys its indexer keeps (the top 32 by a learned score, the sum of `picks`
    vectors' scores: no gradient, and every key of a sequence of 32 or fewer). `bug`: None, correct; "queries", the
    softmax over the queries, which gives NaN in the columns of keys no query may attend, and so in every output row;
    "rows", the indexer's mask applied to the queries as well, filled with -inf, which gives NaN in the rows of the
    queries not kept (none at 32 tokens or fewer), the other rows finite."""

    def __init__(self, bug: str | None = None, picks: int = 1):
        super().__init__()
        self.qkv, self.proj, self.bug = nn.Linear(D, 3 * D), nn.Linear(D, D), bug
        self.picks = nn.ParameterList([nn.Parameter(torch.randn(D)) for _ in range(picks)])

    def forward(self, x):
        B, T, _ = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).chunk(3, -1)  # each (B, T, D)
        score = sum(x.detach() @ w for w in self.picks)  # (B, T)
        chosen = score.topk(min(KEYS, T), 1).indices  # (B, KEYS): integers, no gradient
        hide = torch.full((B, T), float("-inf")).scatter(1, chosen, 0.0)[:, None, :]  # (B, 1, T keys): 0 where kept
        if self.bug == "rows":  # only kept tokens may query too: the rows of the others are all -inf
            hide = hide + hide.transpose(1, 2)  # (B, T queries, T keys)
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + hide  # (B, T queries, T keys)
        return x + self.proj(scores.softmax(-2 if self.bug == "queries" else -1) @ v)  # (B, T, D)


class TwoLayers(nn.Module):
    def __init__(self, bug: str | None, picks: int = 1):
        super().__init__()
        seed_rng(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CONTEXT, D)
        self.layers = nn.ModuleList([IndexedAttention(None, picks), IndexedAttention(bug, picks)])

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return x  # (B, T, D)


@pytest.mark.parametrize("bug, picks", [(None, 1), ("queries", 1), ("rows", 1), ("queries", 2)],
                         ids=["correct", "softmax_over_queries", "fully_masked_rows", "four_parameters"])
def test_a_nan_at_a_longer_length_is_the_broken_layers_finding_not_unused_parameters_before_it(bug, picks):
    """The finding names the first attention module with any non-finite output (the masked rows' layer gives NaN in
    some rows only), and its evidence names at most 4 of the parameters not judged (2 and 4 here: all named)."""
    report = diagnostics.audit_model(TwoLayers(bug, picks), detectors=["gradient_flow"])
    flow = report.result("gradient_flow")
    if bug is None:  # correct: both indexers act from 64 on, a warning that says so
        assert report.status == "passed", report
        assert flow.verdict == "warn" and "but do at 64: used only on longer sequences" in flow.message, flow
        return
    assert flow.verdict == "fail", flow
    assert flow.layer == "layers.1", flow  # not layers.0, whose indexer got a NaN gradient at 64
    assert flow.message == "the model's output is not finite on a plain input of 64 tokens, first at layers.1", flow
    names = ", ".join(f"layers.{i}.picks.{j}" for i in range(2) for j in range(picks))
    assert flow.evidence == (f"(out ** 2).sum() is not finite at length 64, where {2 * picks} of {8 + 2 * picks} "
                             f"attention parameters that get no gradient at length 16 would be tried ({names}): not "
                             f"judged"), flow


def test_the_broken_layer_alone_is_named_by_the_whole_audit():
    """The whole model audit of the bug: every finding with a layer names the second layer (the sweep's "caught at
    the right layer"); the first layer's in-place parameters_used is left to gradient_flow, with a note."""
    report = diagnostics.audit_model(TwoLayers("queries"))
    assert report.status == "failed", report
    assert {f.layer for f in report.findings if f.layer} == {"layers.1"}, report.findings
    assert any(n.startswith("layers.0: parameters_used not run in place: layers.0.picks.0 (not measured: the model's "
                            "output is not finite at length 64, first at layers.1)") for n in report.notes), report.notes
