"""Modules that are not token attention (issue 33, cause 5): an MoE router or a gate, softmax(x W) over (B, T,
experts), runs a softmax over (.., Tq, Tk)-shaped scores like attention does, and was audited as attention (ZAYA's
`mlp.gate`: output_shape, softmax_saturation and gradients failed on the correct model). Its softmax normalises a
product with a weight of the model over that weight's outputs, one distribution per token over the experts: it mixes
no tokens, and is now left out of the attention layers with a note saying why (`ModuleWatch.routers`).

Twins on one small causal LM whose blocks hold an attention layer and a dense mixture of experts behind such a router:
the correct one passes (it failed at the routers before); the same model with block 1's attention missing its
1/sqrt(d) still fails at that attention; and an attention layer of the same class whose scores are taken against its
key projection's weight instead of the keys (its softmax then runs over a weight's outputs too) is still audited as
attention, being of the kind of the attention beside it, and fails. Each with the gate's nn.Linear with a bias too:
softmax(x W + c), whose product and bias are one op (addmm on a contiguous input), not the mm the rule first read
(the correct model then failed at its routers again: output_shape, softmax_saturation, gradients).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, H, E, V = 32, 4, 4, 64  # width, heads, experts, vocabulary


class Attention(nn.Module):
    """Causal multi-head self-attention over (B, T, D), written out: q·k / sqrt(d), the causal mask, a softmax."""

    scaled, keys_from_weight = True, False

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, width
        q, v = (p(x).view(B, T, H, D // H).transpose(1, 2) for p in (self.q, self.v))  # (B, H, T, d)
        if self.keys_from_weight:  # BUG: the key projection's weight taken for the keys, its D rows as D "keys"
            scores = q.transpose(1, 2).reshape(B, T, D) @ self.k.weight.t()  # (B, T, D): one head, over D "keys"
            return self.out(scores.softmax(-1) @ self.v.weight)  # (B, T, D)
        k = self.k(x).view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
        scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
        if self.scaled:
            scores = scores / (D // H) ** 0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


class Unscaled(Attention):
    scaled = False  # BUG: q·k reaches the softmax without its 1/sqrt(d)


class KeysFromWeight(Attention):
    keys_from_weight = True


class Experts(nn.Module):
    """A dense mixture of experts behind a router: softmax(x W_gate) over the experts, (B, T, E), weighs each
    expert's output per token (ZAYA's router, without its top-k)."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=bias)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x):
        probs = self.gate(x).softmax(-1)  # (B, T, E): one distribution per token, over the experts
        return sum(probs[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, attention: type, gate_bias: bool = False):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(D), attention(), nn.LayerNorm(D)
        self.moe = Experts(gate_bias)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    """A two-block causal LM, forward(input_ids) -> logits; `second`: block 1's attention class; `gate_bias`: the
    routers' gates with a bias."""

    causal = True

    def __init__(self, second: type = Attention, gate_bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(16, D)
        self.blocks = nn.ModuleList([Block(Attention, gate_bias), Block(second, gate_bias)])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def audit(second: type, gate_bias: bool = False):
    return diagnostics.audit_model(MoELM(second, gate_bias), seq_len=8)


@pytest.mark.parametrize("gate_bias", [False, True])
def test_an_moe_router_is_not_audited_as_attention_and_the_model_passes(gate_bias):
    report = audit(Attention, gate_bias)
    assert list(report.layers) == ["blocks.0.attn", "blocks.1.attn"], str(report)  # was: blocks.*.moe too
    assert report.status == "passed", str(report)  # was: failed at blocks.0.moe and blocks.1.moe
    said = [n for n in report.notes if n.startswith("blocks.0.moe not audited as attention")]
    assert said and "over that weight's 4 outputs" in said[0] and "MoE router" in said[0], report.notes


@pytest.mark.parametrize("gate_bias", [False, True])
def test_beside_the_routers_an_attention_missing_its_scale_still_fails_there(gate_bias):
    report = audit(Unscaled, gate_bias)
    assert report.status == "failed", str(report)
    assert {f.layer for f in report.findings if f.verdict == "fail"} == {"blocks.1.attn"}, report.findings


@pytest.mark.parametrize("gate_bias", [False, True])
@pytest.mark.parametrize("second", [KeysFromWeight])
def test_an_attention_whose_softmax_runs_over_its_key_weight_is_still_audited_as_attention(second, gate_bias):
    """Its softmax runs over a weight's outputs as a router's does, but its class is the attention's beside it: a layer
    that lost its keys, audited in its place (and failed there), not a router left out."""
    report = audit(second, gate_bias)
    assert "blocks.1.attn" in report.layers, str(report)
    assert not any(n.startswith("blocks.1.attn not audited") for n in report.notes), report.notes
    assert report.status == "failed", str(report)
    assert "blocks.1.attn" in {f.layer for f in report.findings if f.verdict == "fail"}, report.findings
