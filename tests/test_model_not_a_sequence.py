"""A causal model whose input is no sequence (a waveform, as Mimi's and Voxtral's audio encoders take) cannot have its
causality measured through that input: the audit is inconclusive, and says what to audit instead, the part that
holds its attention layers given a sequence of embeddings (issue 33: "inconclusive only with the reason and what to
pass"). The advice is checked by following it: the stack so audited passes, and with its causal mask forgotten fails.
"""

from __future__ import annotations

import re

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


class Codec(nn.Module):
    """A waveform through an encoder stack and a decoder stack (a codec's encode and decode), under `self.model`: two
    stacks, each named, the wrapper that takes the waveform not."""

    def __init__(self):
        super().__init__()
        seed_rng(0)
        self.model = nn.Module()
        self.model.frames = nn.Conv1d(1, D, STRIDE, STRIDE)
        self.model.encoder_transformer, self.model.decoder_transformer = Stack(), Stack()

    def forward(self, input_values):
        m = self.model
        return m.decoder_transformer(m.encoder_transformer(m.frames(input_values).transpose(1, 2)))


class Flat(nn.Module):
    """The layers' list on the model itself, after its front end: no part takes their sequence alone."""

    def __init__(self):
        super().__init__()
        seed_rng(0)
        self.frames = nn.Conv1d(1, D, STRIDE, STRIDE)
        self.layers = Stack().layers

    def forward(self, input_values):
        x = self.frames(input_values).transpose(1, 2)
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


WAVE = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(0))
EMBEDDINGS = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(1))
ADVICE = re.compile(r"audit_model\(model\.([\w.]+), example=<\(B, T, (\d+)\) embeddings>, causal=True\)")


@pytest.mark.parametrize("model, parts", [(WaveEncoder, ["encoder_transformer"]),
                                          (Codec, ["model.encoder_transformer", "model.decoder_transformer"]),
                                          (Flat, [])], ids=["one stack", "two stacks, wrapped", "flat"])
def test_a_causal_model_fed_a_waveform_names_each_stack_that_takes_a_sequence(model, parts):
    report = diagnostics.audit_model(model(), example=WAVE, causal=True)
    assert report.status == "inconclusive", report
    reason = report.status_reason
    assert "its causality was not measured" in reason and "not a sequence" in reason, reason
    assert [p for p, _ in ADVICE.findall(reason)] == parts, reason
    assert all(int(d) == D for _, d in ADVICE.findall(reason)), reason
    if not parts:
        assert "no part of the model takes its attention layers' sequence alone" in reason, reason


@pytest.mark.parametrize("causal", [True, False])
def test_following_the_advice_measures_causality_and_catches_a_forgotten_mask(causal):
    """The part the advice names for the correct model, read from its report and given embeddings: there the correct
    stack passes, and the same part of the model whose mask is forgotten fails (whose own audit already fails: its
    layers are audited in place as causal)."""
    (path, width), = ADVICE.findall(diagnostics.audit_model(WaveEncoder(), example=WAVE, causal=True).status_reason)
    report = diagnostics.audit_model(WaveEncoder(causal).get_submodule(path), example=torch.randn(2, 16, int(width),
                                     generator=torch.Generator().manual_seed(1)), causal=True)
    prefix = report.result("prefix_causality")
    if causal:
        assert report.status == "passed" and prefix.verdict == "pass", report
    else:
        assert report.status == "failed" and prefix.verdict == "fail", report
