"""A layer that refuses a batch larger than its own limit: the audit's stacking, not attention, is what it refuses.

The audit stacks a baseline and its perturbations along the batch (copies of the standard probe's 2 rows), so that a
comparison is one call. A layer that holds a cache of `max_batch_size` rows (the Llama reference's `Attention`, most
decoding layers written for serving) raises on such a stack. Before, a correct one failed `runs` ("batch size 6
exceeds max_batch_size 4"), or, where the rows of a mask went in one batch row at a time in another convention, was
named `mask='allowed:Tq,Tk'` as the declaration it needed, and under that declaration failed `runs` still. Now a stack
the layer refuses is made in parts of the standard probe's batch (`Probe._in_batches`), and `runs` says so.

The layers are of our own writing in that shape; each bug test has its twin on the same inputs. A layer that refuses
a batch of one too (a batch size fixed in the code) still fails `runs`: its parts raise as well.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
import diagnostics._probe


class CachedAttention(nn.Module):
    """Multi-head self-attention with a key cache preallocated for `max_batch_size` rows, which it checks; the mask is
    bool (B, 1, Tq, Tk), True = may attend (the audit's default). `fixed_batch`: reshapes to that batch size (a
    constant where `B` belongs), so that it runs at no other batch."""

    def __init__(self, d_model: int = 32, heads: int = 4, max_batch_size: int = 2, std: float | None = None,
                 fixed_batch: int | None = None):
        super().__init__()
        self.heads, self.fixed_batch = heads, fixed_batch
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))
        self.register_buffer("cache_k", torch.zeros(max_batch_size, 8, d_model))
        if std is not None:  # the scale people train at
            for p in self.parameters():
                nn.init.normal_(p, std=std)

    def scores_to_weights(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        if B > self.cache_k.shape[0]:
            raise ValueError(f"batch size {B} exceeds max_batch_size {self.cache_k.shape[0]}")
        rows = self.fixed_batch or B
        q, k, v = (p(x).view(rows, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = self.scores_to_weights(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), mask)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, T, D))


class MaskAfterSoftmax(CachedAttention):
    """The bug: the mask applied to the weights after the softmax, so blocked keys still take weight from the rest."""

    def scores_to_weights(self, scores, mask):
        weights = scores.softmax(-1)
        return weights if mask is None else weights.masked_fill(~mask, 0.0)


CASES = [pytest.param(limit, dtype, std, id=f"max_batch={limit}-{str(dtype)[6:]}-std={std}")
         for limit, dtype, std in ((2, torch.float32, None), (4, torch.float32, None), (2, torch.bfloat16, 0.02))]


def audited(cls, limit, dtype, std, **kw):
    torch.manual_seed(0)
    layer = cls(max_batch_size=limit, std=std).to(dtype)
    return diagnostics.audit(layer, seq_len=16, dtype=dtype, **kw)


@pytest.mark.parametrize("limit, dtype, std", CASES)
def test_a_correct_layer_with_a_batch_limit_passes_and_runs_says_how_it_was_called(limit, dtype, std):
    report = audited(CachedAttention, limit, dtype, std)
    runs = report.result("runs")
    assert report.status == "passed", report.summary()
    assert runs.verdict == "pass", runs
    assert "exceeds max_batch_size" in runs.message, runs.message
    assert "made 2 rows of the probe at a time" in runs.message, runs.message
    assert report.result("mask_honoured").verdict == "pass"


@pytest.mark.parametrize("limit, dtype, std", CASES)
def test_a_mask_after_softmax_behind_a_batch_limit_fails_mask_honoured(limit, dtype, std):
    report = audited(MaskAfterSoftmax, limit, dtype, std)
    assert report.result("mask_honoured").verdict == "fail", report.result("mask_honoured")
    assert report.result("runs").verdict == "pass", report.result("runs")
    assert report.status == "failed"


@pytest.mark.parametrize("causal", [False, True])
def test_the_twins_on_the_same_inputs_under_a_causal_audit(causal):
    good = audited(CachedAttention, 2, torch.float32, None, causal=causal)
    bad = audited(MaskAfterSoftmax, 2, torch.float32, None, causal=causal)
    assert good.status == "passed", good.summary()
    assert bad.status == "failed" and bad.result("mask_honoured").verdict == "fail", bad.summary()


def test_parts_stand_for_the_batch_only_where_a_row_alone_comes_out_the_same():
    """A batch size written into the layer as a constant (2, the standard probe's own) behind a limit of 2: the
    stack's parts would run, but its first row alone (a batch of one, reshaped into nonsense) does not come out as in
    the part, so the parts stand for nothing and the stack's exception stands: `runs` fails, with no word of parts.
    Its twin on the same inputs, the limit without the constant, passes (above)."""
    torch.manual_seed(0)
    report = diagnostics.audit(CachedAttention(max_batch_size=2, fixed_batch=2), seq_len=16)
    runs = report.result("runs")
    assert runs.verdict == "fail", runs
    assert "exceeds max_batch_size 2" in runs.evidence and "rows of the probe at a time" not in runs.message, runs
    torch.manual_seed(0)
    twin = diagnostics.audit(CachedAttention(max_batch_size=2), seq_len=16)
    assert twin.result("runs").verdict == "pass" and "rows of the probe at a time" in twin.result("runs").message


def test_a_layer_that_refuses_the_parts_too_fails_runs():
    """A limit below the standard probe's batch: the stack's parts raise as well, the exception stands."""
    torch.manual_seed(0)
    report = diagnostics.audit(CachedAttention(max_batch_size=1), seq_len=16)
    runs = report.result("runs")
    assert runs.verdict == "fail", runs
    assert "exceeds max_batch_size 1" in runs.evidence
    assert "rows of the probe at a time" not in runs.message


class ZeroOutput(CachedAttention):
    """Its output projection zero-initialised (DiT's adaLN-Zero, ControlNet's zero convolutions): every output is 0."""

    def __init__(self, **kw):
        super().__init__(**kw)
        nn.init.zeros_(self.o_proj.weight), nn.init.zeros_(self.o_proj.bias)


def test_a_zero_output_behind_a_batch_limit_is_measured_as_without_one():
    """A row alone and the same row in a part are both zeros, against which no change can be measured: equal, they
    agree (review D1: they were read as disagreeing, and the correct layer failed `runs` on its limit)."""
    torch.manual_seed(0)
    limited = diagnostics.audit(ZeroOutput(max_batch_size=2), seq_len=16)
    torch.manual_seed(0)
    free = diagnostics.audit(ZeroOutput(max_batch_size=64), seq_len=16)
    assert limited.status == free.status == "passed", limited
    assert "rows of the probe at a time" in limited.result("runs").message


class RaisesEverywhere(nn.Module):
    d_model = 32

    def forward(self, x, mask=None):
        raise RuntimeError("broken on every call")


@pytest.mark.parametrize("layer", [lambda: CachedAttention(max_batch_size=64), RaisesEverywhere],
                         ids=["no batch limit", "broken on every call"])
def test_the_parts_cost_nothing_where_no_batch_limit_is_hit(layer, monkeypatch):
    """The same audit with the parts taken away costs as many calls (review D3: a layer that raised on every call paid
    a call per stacked probe for parts that raised too)."""
    torch.manual_seed(0)
    report = diagnostics.audit(layer(), seq_len=16)
    monkeypatch.setattr(diagnostics._probe.Probe, "_in_batches", lambda *a: None)
    torch.manual_seed(0)
    without = diagnostics.audit(layer(), seq_len=16)
    assert report.forward_passes == without.forward_passes and report.status == without.status, \
        (report.forward_passes, without.forward_passes)
