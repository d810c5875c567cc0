"""A causal model whose input is no sequence (a waveform, as Mimi's and Voxtral's audio encoders take) cannot have its
causality measured through that input: the audit is inconclusive, and says what to audit instead, the part that
holds its attention layers given a sequence of embeddings (issue 33: "inconclusive only with the reason and what to
pass"). The advice is checked by following it: the stack so audited passes, and with its causal mask forgotten fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from correct import MultiHeadAttention
from diagnostics._guard import seed_rng

D, HEADS, STRIDE = 16, 2, 4


class Stack(nn.Module):
    """Two causal self-attention blocks over (B, T, D) embeddings; `causal=False` forgets the mask (a real bug)."""

    def __init__(self, causal: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(MultiHeadAttention(D, HEADS, causal=causal) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


class WaveEncoder(nn.Module):
    """(B, 1, samples) -> a strided convolution's frames (B, samples / 4, D) -> the stack: a waveform in, no tokens."""

    def __init__(self, causal: bool = True):
        super().__init__()
        seed_rng(0)
        self.frames = nn.Conv1d(1, D, STRIDE, STRIDE)
        self.encoder_transformer = Stack(causal)

    def forward(self, input_values):
        return self.encoder_transformer(self.frames(input_values).transpose(1, 2))


WAVE = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(0))
EMBEDDINGS = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(1))


def test_a_causal_model_fed_a_waveform_names_the_stack_to_audit_with_a_sequence():
    report = diagnostics.audit_model(WaveEncoder(), example=WAVE, causal=True)
    assert report.status == "inconclusive", report
    reason = report.status_reason
    assert "its causality was not measured" in reason and "not a sequence" in reason, reason
    assert "audit_model(model.encoder_transformer, example=" in reason and "causal=True" in reason, reason


@pytest.mark.parametrize("causal", [True, False])
def test_following_the_advice_measures_causality_and_catches_a_forgotten_mask(causal):
    """The stack the advice names, given embeddings: the correct one passes, the one without its mask fails."""
    stack = WaveEncoder(causal).encoder_transformer
    report = diagnostics.audit_model(stack, example=EMBEDDINGS, causal=True)
    prefix = report.result("prefix_causality")
    if causal:
        assert report.status == "passed" and prefix.verdict == "pass", report
    else:
        assert report.status == "failed" and prefix.verdict == "fail", report
