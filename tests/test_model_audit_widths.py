"""An attention layer that returns another width than it takes (issue 33): Zamba2's shared transformer block gives its
attention the hidden states and the original embeddings side by side, [x; e], 2D wide, and its output projection
returns D. Audited in place, `output_shape` expected the width it takes and failed the correct model ("output (2, 16,
32), expected (2, 16, 64)"). In place, the model's own call is the convention: the width it returned there is the one
the probes must find (`InPlace.returned_width`).

Twins on one small causal LM built that way: correct, it passes (it failed output_shape before); with the layer's
1/sqrt(d) left out it still fails there, at that layer only.
"""

from __future__ import annotations

import torch
from torch import nn

import diagnostics

D, H, V = 32, 4, 64  # model width, heads, vocabulary


class ConcatAttention(nn.Module):
    """Causal self-attention over [x; e] (B, T, 2D), returning (B, T, D): Zamba2's shared attention's shapes."""

    scaled = True

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(2 * D, D) for _ in range(3))
        self.out = nn.Linear(D, D)

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape  # batch, sequence length, 2D
        q, k, v = (p(hidden_states).view(B, T, H, D // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
        if self.scaled:
            scores = scores / (D // H) ** 0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=hidden_states.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class Unscaled(ConcatAttention):
    scaled = False  # BUG: q·k reaches the softmax without its 1/sqrt(d)


class SharedLM(nn.Module):
    """Two blocks, each attention given [x; the embeddings], forward(input_ids) -> logits."""

    causal = True

    def __init__(self, attention: type = ConcatAttention):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(16, D)
        self.attn = nn.ModuleList([ConcatAttention(), attention()])
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, input_ids):
        e = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))  # (B, T, D)
        x = e
        for attn, norm in zip(self.attn, self.norms):
            x = x + attn(torch.cat([norm(x), e], dim=-1))  # (B, T, 2D) in, (B, T, D) out
        return self.head(x)


def audit(attention: type):
    return diagnostics.audit_model(SharedLM(attention), seq_len=8)


def test_a_layer_returning_another_width_than_it_takes_is_held_to_the_width_its_model_got():
    report = audit(ConcatAttention)
    assert list(report.layers) == ["attn.0", "attn.1"], str(report)
    shape = report.layers["attn.1"].result("output_shape")
    assert shape.verdict == "pass" and "(2, 8, 32)" in shape.message, shape  # was: fail, expected (2, 8, 64)
    assert report.status == "passed", str(report)


def test_the_same_layer_missing_its_scale_still_fails_there():
    report = audit(Unscaled)
    assert report.status == "failed", str(report)
    assert {f.layer for f in report.findings if f.verdict == "fail"} == {"attn.1"}, report.findings
