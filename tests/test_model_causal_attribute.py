"""A layer that says `is_causal = True` while its model passes it a 4-D mask that lets queries see later keys is not
causal (issue 33: LightGlue, transformers 5.25, whose attention copies Llama's `self.is_causal = True` and is always
given its keypoints' (B, 1, 1, T) padding mask; Hugging Face's eager and sdpa paths apply `is_causal` only where no
mask is given). Inferred causal from the attribute, its correct layers failed future_leakage, causal_alignment and
gradients. The model's own mask decides: a (B, 1, T, T) causal mask still makes the model causal. Twin: the
bidirectional model with the scale left out of its attention still fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS, VOCAB = 16, 2, 40


class FlaggedAttention(nn.Module):
    """Self-attention under the mask its model passes (bool, True = may attend), with Llama's `is_causal = True`."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.num_heads, self.scaled, self.is_causal = HEADS, scaled, True
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, attention_mask):
        B, T, _ = hidden_states.shape  # batch, sequence length, width
        q, k, v = (p(hidden_states).view(B, T, HEADS, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, T, d)
        scores = q @ k.transpose(-2, -1)  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
        if self.scaled:
            scores = scores / math.sqrt(D // HEADS)
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:  # additive: 0 where a key may be attended, very negative where not
            scores = scores + attention_mask
        return self.o_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, D))


class MaskedEncoder(nn.Module):
    """Two blocks; `causal`: the model passes them a (B, 1, T, T) causal mask, else a (B, 1, 1, T) one of all keys."""

    def __init__(self, causal: bool, scaled: bool = True, blocked: float | None = None):
        super().__init__()
        self.causal_mask, self.blocked = causal, blocked  # not `causal`: a model attribute the audit reads as a declaration
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Module() for _ in range(2)])
        for block in self.blocks:
            block.attn = FlaggedAttention(scaled)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids):
        B, T = input_ids.shape
        if self.causal_mask:
            mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril().expand(B, 1, T, T)
        else:
            mask = torch.ones(B, 1, 1, T, dtype=torch.bool, device=input_ids.device)
        if self.blocked is not None:  # the same mask, additive, its blocked keys given `blocked`
            mask = torch.zeros(mask.shape, device=input_ids.device).masked_fill(~mask, self.blocked)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block.attn(x, attention_mask=mask)
        return self.head(x)


def _audit(causal: bool, scaled: bool = True, blocked: float | None = None):
    torch.manual_seed(0)
    model = MaskedEncoder(causal, scaled, blocked).eval()
    return diagnostics.audit_model(model, torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("causal", [False, True])
def test_the_mask_the_model_passes_decides_over_the_layers_is_causal(causal):
    report = _audit(causal)
    assert report.causal is causal, (report.causal, report.causal_source)  # before: True for both
    assert report.status == "passed", str(report)  # before: future_leakage failed the bidirectional one


def test_the_bidirectional_model_without_its_scale_still_fails():
    report = _audit(causal=False, scaled=False)
    assert report.causal is False, report.causal_source
    assert report.status == "failed", str(report)
    assert "blocks.1.attn" in {f.layer for f in report.findings}, str(report)


@pytest.mark.parametrize("blocked", [torch.finfo(torch.float32).min, -10000.0, -1e9])
@pytest.mark.parametrize("causal", [False, True])
def test_an_additive_mask_blocks_a_key_whatever_very_negative_value_it_gives_it(causal, blocked):
    """-10000.0 is older Hugging Face code's blocked key (BERT's, T5's -1e9): its softmax weight, exp(-10000), is 0 in
    every float. It was read as "allowed" (only values below half the dtype's minimum counted as blocked), so a
    causal model's own causal mask made its `is_causal` layers read as not causal, and causality was measured
    instead of read; the bidirectional model's all-keys mask still allows the future."""
    report = _audit(causal, blocked=blocked)
    assert report.causal is causal, (report.causal, report.causal_source)
    said = report.causal_source.startswith("inferred: its 2 self-attention layers say is_causal = True")
    assert said is causal, report.causal_source  # before: -10000.0 and -1e9 measured, not read
    assert report.status == "passed", str(report)


@pytest.mark.parametrize("future, allowed", [(0.0, True), (-5.0, True), (-100.0, False), (-10000.0, False),
                                             (torch.finfo(torch.float32).min, False)])
def test_a_future_key_counts_as_allowed_unless_its_additive_bias_puts_it_under_float32s_resolution(future, allowed):
    """The rule itself, at both sides of its bound, log(float32 eps) = -15.9: exp(-5) = 0.7% of a key of bias 0 is a
    future the model lets through; exp(-100) is none."""
    from types import SimpleNamespace

    from diagnostics.model._causal import _future_allowed

    T = 5
    mask = torch.zeros(1, 1, T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), future)
    wrapper = SimpleNamespace(block_size=T, call_arguments={"attention_mask": mask})
    assert _future_allowed(wrapper) is allowed, (future, mask[0, 0])
