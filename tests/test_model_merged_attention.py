"""A merged self- and cross-attention: one softmax over the layer's own keys and its memory's together (issue 33:
T5Gemma 2's decoder, transformers 5.25, `T5Gemma2MergedAttention`: keys [k(x); k(memory)], its mask (B, 1, T, T + M),
causal over the first T columns).

The in-place audit read it as a cross-attention (it is given `encoder_hidden_states`): its probes changed one query
and watched the other rows (`query_locality`, every query being a key here too), and gave it lengths its (T, T + M)
mask could not take (`runs`): the correct model FAILED (this test's model: `runs`). A mask spanning both streams
(T + M at length T, T - 1 + M at T - 1) now says the layer is not audited in place, with the reason; the model-level
checks still run through it. Twin: the same model whose layer 1 forgets the causal mask over its own keys still fails,
at that layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import diagnostics

D, HEADS, MEMORY, VOCAB = 16, 2, 6, 32


class MergedAttention(nn.Module):
    """Attention of x's queries over [x's keys; the memory's keys], values likewise, under one additive mask."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, D // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states, merged_attention_mask):
        B, T, _ = hidden_states.shape  # batch, sequence length, d_model
        both = torch.cat([hidden_states, encoder_hidden_states], dim=1)  # (B, T + M, D)
        q = self.q_proj(hidden_states).view(B, T, HEADS, -1).transpose(1, 2)  # (B, H, T, d)
        k, v = (p(both).view(B, both.shape[1], HEADS, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + merged_attention_mask  # (B, H, T, T + M)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
        return self.o_proj(out)


class MergedLM(nn.Module):
    """A causal LM whose layers attend their own past and a learned memory of MEMORY positions at once.
    `leaky_layer`: the index of a layer given no causal mask over its own keys (the bug)."""

    def __init__(self, leaky_layer: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.memory = nn.Parameter(torch.randn(1, MEMORY, D) * 0.5)
        self.layers = nn.ModuleList([MergedAttention() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)
        self.leaky_layer = leaky_layer

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, D)
        B, T, _ = x.shape
        memory = self.memory.expand(B, MEMORY, D)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, T): True above the diagonal
        own = torch.zeros(T, T).masked_fill(future, -math.inf)
        causal = torch.cat([own, torch.zeros(T, MEMORY)], dim=1).expand(B, 1, T, T + MEMORY)  # (B, 1, T, T + M)
        open_ = torch.zeros(B, 1, T, T + MEMORY)
        for i, layer in enumerate(self.layers):
            x = x + layer(hidden_states=x, encoder_hidden_states=memory,
                          merged_attention_mask=open_ if i == self.leaky_layer else causal)
        return self.head(x)


def _audit(leaky_layer=None):
    torch.manual_seed(0)
    model = MergedLM(leaky_layer).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    return diagnostics.audit_model(model, ids, causal=True)


def test_a_merged_self_and_cross_attention_is_not_audited_in_place_and_says_why():
    report = _audit()
    assert report.status == "inconclusive", str(report)  # failed before: runs at both layers
    assert not report.findings, str(report)
    said = [n for n in report.notes if n.startswith("layers.0 not audited in place")]
    assert said and "a merged self- and cross-attention" in said[0], report.notes


def test_a_merged_attention_without_its_causal_mask_still_fails_at_that_layer():
    report = _audit(leaky_layer=1)
    assert report.status == "failed", str(report)
    assert ("layers.1", "prefix_causality") in {(f.layer, f.detector) for f in report.findings}, str(report)
