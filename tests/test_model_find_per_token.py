"""A softmax that weighs each token's own items is not attention (issue 33: GLM-5's hyper-connections in
transformers 5.25 keep 4 streams per token, (B, S, 4, D), and mix them with a Sinkhorn-normalised softmax over
(B, S, 4, 4): observed as a softmax over (Tq, Tk) scores, they were audited as attention, could not be audited in
place, and left the correct model inconclusive). Such scores begin with the input's (batch, tokens) and none of
their last two axes counts the tokens. Twins: an attention with as many heads as the tokens the finder watches (8),
whose (B, H, Tq, Tk) scores also begin with (batch, 8), is still found and audited, and without its scale fails there.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, STREAMS, VOCAB = 16, 8, 4, 40  # 8 heads: as many as the tokens the finder watches


class StreamMix(nn.Module):
    """Hyper-connection-like, as GLM-5's: one projection of each token's 4 streams gives a gate per stream and a 4 x 4
    matrix, split apart; the matrix's softmax mixes the token's streams, the gates weigh them."""

    def __init__(self):
        super().__init__()
        self.fn = nn.Linear(STREAMS * D, STREAMS + STREAMS * STREAMS, bias=False)

    def forward(self, streams):  # (B, S, N, D)
        B, S = streams.shape[:2]
        gate, comb = self.fn(streams.reshape(B, S, -1)).split([STREAMS, STREAMS * STREAMS], dim=-1)
        comb = torch.softmax(comb.view(B, S, STREAMS, STREAMS) * 0.5, dim=-1)
        # (B, S, N, N) x (B, S, N, D): each token's streams mixed, no token with another
        return torch.sigmoid(gate).unsqueeze(-1) * (comb @ streams)


class ManyHeads(nn.Module):
    """Causal self-attention, 8 heads of 2: at 8 tokens its (B, H, Tq, Tk) scores begin with (batch, tokens) too."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.scaled = scaled
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        scores = q @ k.transpose(-2, -1)  # (B, H, Tq, d) x (B, H, d, Tk) -> (B, H, Tq, Tk)
        if self.scaled:
            scores = scores / math.sqrt(D // HEADS)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # (Tq, Tk)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))  # (B, H, Tq, d) -> (B, Tq, D)


class StreamModel(nn.Module):
    def __init__(self, scaled: bool = True):
        super().__init__()
        self.causal = True
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Module() for _ in range(2)])
        for block in self.blocks:
            block.mix, block.attn = StreamMix(), ManyHeads(scaled)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids):
        streams = self.embed(input_ids).unsqueeze(2).expand(-1, -1, STREAMS, -1)  # (B, S, N, D)
        for block in self.blocks:
            streams = block.mix(streams)
            streams = streams + block.attn(streams.mean(2)).unsqueeze(2)
        return self.head(streams.mean(2))


def _audit(scaled: bool):
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    return diagnostics.audit_model(StreamModel(scaled).eval(), ids)


@pytest.mark.parametrize("scaled", [True, False])
def test_a_softmax_over_each_tokens_own_streams_is_not_audited_as_attention(scaled):
    report = _audit(scaled)
    found = {f.path for f in report.found}
    assert found == {"blocks.0.attn", "blocks.1.attn"}, found  # before: blocks.*.mix too, not audited in place
    said = [n for n in report.notes if n.startswith("blocks.0.mix not audited as attention")]
    assert said and "one 4 x 4 distribution for each of the" in said[0], report.notes
    assert report.status == ("passed" if scaled else "failed"), str(report)
    assert scaled or {f.layer for f in report.findings} >= {"blocks.0.attn", "blocks.1.attn"}, str(report)


@pytest.mark.parametrize("scores, projected, x, per_token", [
    ((1, 8, 4, 4), True, (1, 8, 4, 16), True),  # hyper-connections: each token's 4 streams, from a projection
    ((1, 8, 4, 4), False, (1, 8, 4, 16), False),  # axial attention along a map's rows: q·k of two activations
    ((1, 8, 2, 5), True, (1, 8, 16), False),  # Longformer's bands, (B, T, H, 2w + 1): other tokens
    ((1, 8, 2, 12), True, (1, 8, 16), False),  # deformable attention's sampling points: other tokens
    ((1, 8, 8, 8), True, (1, 8, 8, 16), False),  # as many streams as tokens: cannot be told apart, audited
])
def test_which_scores_weigh_each_tokens_own_items(scores, projected, x, per_token):
    """The rule at each edge that the whole transformers population showed: its first form (any scores that begin
    with (batch, tokens) and count no tokens in their last two axes) took Longformer's, LED's and three DETR
    models' attention for per-token weights and left them unaudited (Longformer then read as one attention layer)."""
    from diagnostics.model._find import _per_token

    assert _per_token(scores, projected, torch.zeros(x)) is per_token


@pytest.mark.parametrize("scaled", [True, False])
def test_the_streams_rule_holds_in_bfloat16_at_std_0_02(scaled):
    """The scale people train at, as Hugging Face's `_init_weights` sets it: matrices drawn at std 0.02, biases 0, and
    the whole model in bfloat16; the same ids."""
    torch.manual_seed(0)
    model = StreamModel(scaled).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    report = diagnostics.audit_model(model.to(torch.bfloat16), ids)
    assert {f.path for f in report.found} == {"blocks.0.attn", "blocks.1.attn"}, report.found
    assert report.status == ("passed" if scaled else "failed"), str(report)
    assert scaled or {f.layer for f in report.findings} >= {"blocks.0.attn", "blocks.1.attn"}, str(report)
