"""A layer audited in place takes the width its model passes it, whatever its projections read.

DAB-DETR's decoder cross-attention (transformers 5.25.0) takes queries and keys 2 x hidden wide, [content;
position], projected outside it, and values hidden wide; its only nn.Linear, the output projection, reads the values'
width. The layer audit's check that d_model is a width the layer's projections take (a user's `--d-model 30` on a
32-wide layer) refused it in place ("expected d_model to match the width of the layer's projections ... pass the
layer's width, d_model=32"), so the sweep's model was inconclusive with a fix no model audit can take. In place, the
width is the one the model's own call gave the layer (`InPlace.width_from_call`): not checked against the projections.
The twin with the scale dropped fails at that layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

D, VOCAB, CONTEXT, HEADS = 16, 32, 64, 2  # values' width, vocabulary, positions, heads


class ConcatAttention(nn.Module):
    """Multi-head attention whose queries and keys are [content; position] (2D wide, given), its values the content
    half (D wide); `scaled` False drops the 1/sqrt(d) of the scores (the bug)."""

    def __init__(self, scaled: bool):
        super().__init__()
        self.output_proj, self.scaled = nn.Linear(D, D), scaled
        self.embed_dim = 2 * D  # the width of the queries and keys it is given, as DabDetrAttention's

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape  # batch, tokens, 2D
        q = k = hidden_states.view(B, T, HEADS, -1).transpose(1, 2)  # (B, H, T, 2D / H)
        v = hidden_states[..., :D].reshape(B, T, HEADS, -1).transpose(1, 2)  # (B, H, T, D / H)
        scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if self.scaled else 1.0)  # (B, H, T, T)
        return self.output_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))  # (B, T, D)


class ConcatModel(nn.Module):
    def __init__(self, scaled: bool):
        super().__init__()
        seed_rng(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CONTEXT, D)
        self.content, self.position = nn.Linear(D, D), nn.Linear(D, D)
        self.attn = ConcatAttention(scaled)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        pos = self.wpe(torch.arange(input_ids.shape[1]))  # (T, D)
        h = torch.cat([self.content(x), self.position(pos).expand_as(x)], -1)  # (B, T, 2D)
        return x + self.attn(h)


@pytest.mark.parametrize("scaled", [True, False], ids=["correct", "missing_scale"])
def test_a_layer_given_queries_wider_than_its_projections_is_audited_in_place(scaled):
    report = diagnostics.audit_model(ConcatModel(scaled))
    assert "attn" in report.layers, report.notes  # audited in place, not "not audited in place: expected d_model"
    assert not any("to match the width of the layer's projections" in n for n in report.notes), report.notes
    if scaled:
        assert report.status == "passed", report
    else:
        assert report.status == "failed", report
        assert {f.layer for f in report.findings if f.layer} == {"attn"}, report.findings
        assert "softmax_saturation" in {f.detector for f in report.findings}, report.findings
