"""A layer in place whose queries are its own is audited on them (issue 33: timm's CrossViT, CaiT/VOLO class
attention, attention-pooling heads).

CrossViT's fusion attention and CaiT's class attention take every token and return one row: the class token's query
over every token; a pooling head returns (B, D) from a learned query. Before, each was "not audited in place" and its
model inconclusive (18 + 11 + 11 timm architectures). The model's call shows how many rows the layer returns; the
wrapper keeps that number (`InPlace.own_queries`), the probes expect it and read (Q, Tk) weights. Twins on the same
inputs: the scores left unscaled, and dropout left on in eval mode, fail at that layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

D, HEADS = 16, 2


class ClassAttention(nn.Module):
    """CaiT's: the class token's query (x[:, :1]) over every token, keys and values from all; (B, 1, D) out."""

    def __init__(self, bug: str | None = None, pooled: bool = False):
        super().__init__()
        self.bug, self.pooled, self.num_heads = bug, pooled, HEADS
        self.q, self.kv, self.proj = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)
        self.latent = nn.Parameter(torch.randn(1, 1, D)) if pooled else None

    def forward(self, x):
        B, T, C = x.shape  # batch, tokens, width
        d = C // HEADS
        query = self.latent.expand(B, -1, -1) if self.pooled else x[:, :1]  # (B, 1, C)
        q = self.q(query).view(B, 1, HEADS, d).transpose(1, 2)  # (B, H, 1, d)
        k, v = self.kv(x).view(B, T, 2, HEADS, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) * (1.0 if self.bug == "unscaled" else d ** -0.5)  # (B, H, 1, T)
        w = scores.softmax(-1)
        if self.bug == "dropout in eval":
            w = torch.nn.functional.dropout(w, 0.5, training=True)
        out = self.proj((w @ v).transpose(1, 2).reshape(B, 1, C))
        return out[:, 0] if self.pooled else out  # a pooling head: (B, D)


class ClassTokenModel(nn.Module):
    """(B, 3, 8, 8) -> 16 patch tokens and a class token -> class attention -> logits from the class token."""

    def __init__(self, bug: str | None = None, pooled: bool = False):
        super().__init__()
        seed_rng(0)
        self.patch, self.attn, self.head = nn.Conv2d(3, D, 2, 2), ClassAttention(bug, pooled), nn.Linear(D, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, pixels):
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # (B, 16, D)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)  # (B, 17, D)
        out = self.attn(x)
        return self.head(out if self.attn.pooled else out[:, 0])


@pytest.mark.parametrize("pooled", [False, True], ids=["class token, (B, 1, D)", "pooling head, (B, D)"])
@pytest.mark.parametrize("bug, status, fired", [(None, "passed", None), ("unscaled", "failed", "softmax_saturation"),
                                                ("dropout in eval", "failed", "output_variance")])
def test_a_layer_with_queries_of_its_own_is_audited_in_place_on_them(bug, status, fired, pooled):
    report = diagnostics.audit_model(ClassTokenModel(bug, pooled).eval(), example=torch.randn(2, 3, 8, 8))
    layer = report.layers["attn"]
    assert "1 query of its own" in layer.layer, layer.layer
    assert layer.result("output_shape").verdict == "pass", layer.result("output_shape")
    assert layer.result("weight_row_sums").measured, layer
    assert report.status == status and layer.status == status, report
    if fired:
        assert fired in layer.fired(), layer


@pytest.mark.parametrize("pooled", [False, True], ids=["class token, (B, 1, D)", "pooling head, (B, D)"])
@pytest.mark.parametrize("bug, status", [(None, "passed"), ("unscaled", "failed")])
def test_queries_of_its_own_are_read_in_bfloat16_at_gpt2_initialisation(bug, status, pooled, std_002):
    """At the scales people train at: the projections drawn with std 0.02, the model in bfloat16."""
    model = std_002(ClassTokenModel(bug, pooled)).to(torch.bfloat16).eval()
    report = diagnostics.audit_model(model, example=torch.randn(2, 3, 8, 8, dtype=torch.bfloat16))
    layer = report.layers["attn"]
    assert layer.result("weight_row_sums").measured, layer
    assert report.status == status and layer.status == status, report
    if bug:
        assert "softmax_saturation" in layer.fired(), layer


class LabelAttention(nn.Module):
    """torchTextClassifiers' label attention in a few lines: `labels` learned queries attend the tokens through
    torch's SDPA, the (B, T) mask (1 = a real token) made a bool mask there; `inverted`: `attention_mask == 0` for
    `== 1`, so each label query attends the padding only (the bug of its 1.0.4 release)."""

    def __init__(self, inverted: bool = False, labels: int = 3):
        super().__init__()
        self.inverted, self.num_heads = inverted, HEADS
        self.queries = nn.Parameter(torch.randn(labels, D) * 0.5)
        self.k, self.v, self.proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, attention_mask=None):
        B, T, _ = x.shape  # batch, tokens, width
        q = self.queries.expand(B, -1, -1).reshape(B, -1, HEADS, D // HEADS).transpose(1, 2)  # (B, H, labels, d)
        k, v = (f(x).view(B, T, HEADS, -1).transpose(1, 2) for f in (self.k, self.v))  # (B, H, T, d)
        keep = None
        if attention_mask is not None:
            keep = (attention_mask == 0 if self.inverted else attention_mask == 1)[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # (B, H, labels, d)
        return self.proj(out.transpose(1, 2).reshape(B, -1, D))


@pytest.mark.parametrize("inverted", [False, True], ids=["== 1", "== 0"])
def test_a_mask_inverted_for_queries_of_its_own_is_located_where_it_is_made(inverted):
    """The masking ops of a layer with queries of its own are read over those queries (3 here), not the tokens':
    read over the tokens' 16, the fused call matched no (query, key) pairs and the inverted mask was located nowhere
    (torchTextClassifiers 1.0.4, pypi_bugs: at its output projection). The bug is located at the line that makes
    the mask, then the call it is given to; its twin passes on the same inputs."""
    seed_rng(0)
    report = diagnostics.audit(LabelAttention(inverted), mask="key_keep", queries=3, progress=False,
                               call=lambda layer, x, mask=None: layer(x, None if mask is None else mask.long()))
    found = report.result("mask_honoured")
    assert found.verdict == ("fail" if inverted else "pass"), found
    if inverted:
        assert [site.code.split(" = ")[0] for site in found.where[:2]] == [
            "keep", "out"], [site.code for site in found.where]
