"""A looped model's finding is at the layer where the change first shows, cycle by cycle (issue 33: HRM).

HRM (transformers 5.25's hrm_text) runs its layers in cycles: layer 0, layer 1, layer 0 again, layer 1 again. The
model-level checks name the first attention layer whose outputs differ between two runs, and they joined every call
of a layer: a looped layer's outputs were (B, cycles x T), which the checks reading (B, T) skipped (the finding had
no layer), and where they did not, layer 0 moved in its second cycle and was named for a bug in layer 1 (the
sweep's injected bugs, "elsewhere"). Each call is now taken in its round (the layer's first, second, ... call of a
forward), in the order the calls were made: layer 1's first cycle moves before layer 0's second. The correct twin
passes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

D, HEADS, VOCAB, CONTEXT, CYCLES = 16, 2, 32, 64, 2  # width, heads, vocabulary, positions, cycles


class CausalAttention(nn.Module):
    """Causal multi-head self-attention; `leaks`: no causal mask (the bug)."""

    def __init__(self, leaks: bool):
        super().__init__()
        self.qkv, self.proj, self.leaks = nn.Linear(D, 3 * D), nn.Linear(D, D), leaks

    def forward(self, x):
        B, T, _ = x.shape  # batch, tokens, width
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)  # (B, H, T, T)
        if not self.leaks:
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class Looped(nn.Module):
    """Two causal layers run in `CYCLES` cycles over the same hidden states (HRM's kind); `leaks`: layer 1 has no
    causal mask."""

    causal = True

    def __init__(self, leaks: bool):
        super().__init__()
        seed_rng(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CONTEXT, D)
        self.layers = nn.ModuleList([CausalAttention(False), CausalAttention(leaks)])

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for _ in range(CYCLES):
            for layer in self.layers:
                x = x + layer(x)
        return x  # (B, T, D)


@pytest.mark.parametrize("leaks", [False, True], ids=["correct", "layer_1_unmasked"])
def test_a_looped_models_leak_is_named_at_the_layer_it_starts_in(leaks):
    report = diagnostics.audit_model(Looped(leaks), detectors=["prefix_causality", "packed_documents"])
    prefix = report.result("prefix_causality")
    if not leaks:
        assert report.status == "passed", report
        assert prefix.verdict == "pass", prefix
        return
    assert prefix.verdict == "fail", prefix
    assert prefix.layer == "layers.1", prefix  # not None (cycles joined, skipped) nor layers.0 (its second cycle)
    assert prefix.message.endswith("the change first appears at layers.1"), prefix
