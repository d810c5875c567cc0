"""Ids the model audit draws stay inside the table of the input they are drawn for (issue 33: on CUDA, an id out of an
embedding's range is a device-side assert that ends the process, where the CPU raises IndexError and the audit went
on: Dia's encoder ids were drawn from its decoder's vocabulary, LUKE was run past its position table).

A model with two id inputs of different vocabularies, its entity table declared before its token table: the audit read
the main input's vocabulary from the model's first nn.Embedding, the entities' 500, and drew token ids up to 499 for
a table of 50. It reads the table the main ids reach now. Twin: the same model with the scale left out of its
attention still fails there, and no id it is given is out of range either.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics

D, HEADS, TOKENS, ENTITIES = 16, 2, 50, 500


class Attention(nn.Module):
    def __init__(self, scaled: bool = True):
        super().__init__()
        self.num_heads, self.scaled = HEADS, scaled
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, width
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d)
        scores = q @ k.transpose(-2, -1)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        if self.scaled:
            scores = scores / math.sqrt(D // HEADS)
        return self.proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, D))


class EntityLM(nn.Module):
    """Tokens (vocabulary 50) and entities (vocabulary 500) as two id inputs, the entities' table declared first; the
    entities' mean is added to every token, one attention block, logits over the tokens."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.entities = nn.Embedding(ENTITIES, D)
        self.tokens = nn.Embedding(TOKENS, D)
        self.attn = Attention(scaled)
        self.head = nn.Linear(D, TOKENS)

    def forward(self, input_ids, entity_ids):
        x = self.tokens(input_ids) + self.entities(entity_ids).mean(1, keepdim=True)  # (B, T, D)
        return self.head(x + self.attn(x))


@pytest.fixture
def out_of_range(monkeypatch):
    """Every embedding call given an id outside its table, as (the largest id, the table's rows)."""
    seen, embedding = [], F.embedding

    def checked(input, weight, *args, **kwargs):
        if input.numel() and (int(input.max()) >= weight.shape[0] or int(input.min()) < 0):
            seen.append((int(input.max()), weight.shape[0]))
        return embedding(input, weight, *args, **kwargs)

    monkeypatch.setattr(F, "embedding", checked)
    return seen


def _audit(scaled: bool):
    torch.manual_seed(0)
    model = EntityLM(scaled).eval()
    gen = torch.Generator().manual_seed(1)
    example = {"input_ids": torch.randint(TOKENS, (2, 16), generator=gen),
               "entity_ids": torch.randint(ENTITIES, (2, 3), generator=gen)}
    return diagnostics.audit_model(model, example)


def test_no_id_the_audit_draws_is_out_of_its_inputs_table(out_of_range):
    report = _audit(scaled=True)
    assert not out_of_range, out_of_range[:3]  # before: token ids up to 499 for a table of 50, every drawn sequence
    assert report.status == "passed", str(report)


def test_the_same_model_without_its_scale_still_fails_with_every_id_in_range(out_of_range):
    report = _audit(scaled=False)
    assert not out_of_range, out_of_range[:3]
    assert report.status == "failed", str(report)
    assert "attn" in {f.layer for f in report.findings}, str(report)


class PositionLM(nn.Module):
    """Tokens with a learned position table of `block_size` = 300 rows (its declared context) and one attention
    block; `unused`: the attention holds a gate it never applies (no gradient at any length, the bug)."""

    block_size = 300

    def __init__(self, unused: bool = False):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(TOKENS, D), nn.Embedding(self.block_size, D)
        self.attn = Attention()
        if unused:
            self.attn.gate = nn.Parameter(torch.ones(D))
        self.head = nn.Linear(D, TOKENS)

    def forward(self, input_ids):
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("unused", [False, True])
def test_longer_lengths_tried_stay_within_the_declared_context(out_of_range, unused):
    torch.manual_seed(0)
    model = PositionLM(unused).eval()
    report = diagnostics.audit_model(model, torch.randint(TOKENS, (2, 16), generator=torch.Generator().manual_seed(1)))
    assert not out_of_range, out_of_range[:3]  # before: 1,024 positions for a table of 300 (gradient_flow's LONGER)
    assert report.status == ("failed" if unused else "passed"), str(report)
    if unused:
        assert report.result("gradient_flow").verdict == "fail", str(report)
