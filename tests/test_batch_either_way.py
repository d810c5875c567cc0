"""`batch_independence` both ways (issue 34; found by the review of the per-query tables, 2026-12-07).

The check changed sequence 1 alone and held sequence 0. A layer that reads the first sample for every sample (its
keys and values broadcast from row 0: `k[:1].expand_as(k)`, a batch-wide tensor's row 0 taken for all) leaves sequence
0 exactly as it is, so it passed, and so did the whole audit. Now, where that direction holds, sequence 0 is changed
alone in a call of its own and every other sequence held. Twins on the same inputs: the correct layer passes either
way; the layer that broadcasts the first sample's keys fails, sited at the broadcast.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS = 32, 4


class FirstSampleKeys(nn.Module):
    """Self-attention; `bug`: every sample attends the first sample's keys and values."""

    def __init__(self, bug: bool = False):
        super().__init__()
        self.bug, self.d_model, self.num_heads = bug, D, HEADS
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        if self.bug:
            k, v = k[:1].expand_as(k), v[:1].expand_as(v)  # the first sample's, for every sample
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_layer_that_reads_the_first_sample_for_every_sample_fails_and_its_twin_passes(dtype, init, std_002):
    results = {}
    for bug in (False, True):
        torch.manual_seed(0)
        layer = FirstSampleKeys(bug)
        if init == "std 0.02":
            std_002(layer)
        results[bug] = diagnostics.audit(layer.to(dtype)).result("batch_independence")
    assert results[False].verdict == "pass" and "(either way)" in results[False].message, results[False]
    assert results[True].verdict == "fail" and "(on the first)" in results[True].message, results[True]
    assert "when only sequence 0 changed" in results[True].evidence, results[True]


def test_the_first_sample_broadcast_is_sited_at_its_line():
    torch.manual_seed(0)
    report = diagnostics.audit(FirstSampleKeys(True))
    assert report.status == "failed", str(report)
    where = [f"{w.file.rsplit('/', 1)[-1]}:{w.line}" for w in report.result("batch_independence").where]
    line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "# the first sample" in text)
    assert where and where[0] == f"test_batch_either_way.py:{line}", where
