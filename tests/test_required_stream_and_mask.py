"""A layer that requires its second stream and a mask over that stream's tokens together (`runs`'
`_required_input`): no declaration of the audit's passes both, so the audit is inconclusive and says why, where it
used to fail `runs`. Twin: the same layer reading the mask over its queries instead raises with both given, and
still fails.

Written in the style of diffusers' Lumina processor (its text mask `attention_mask.bool().view(B, 1, 1, -1)`, read
with no check for None) and Mochi's (the text mask indexed per sequence), on a module that leaves the attention to
its processor as diffusers' Attention does; no diffusers needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


class TextMaskedProcessor:
    """Image tokens attend text tokens (`encoder_hidden_states`), the text's padding given as `attention_mask`
    (B, Tm), 1 = keep; both required. `over_queries`: the bug, the mask read over the image tokens."""

    def __init__(self, over_queries=False):
        self.over_queries = over_queries

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, image tokens, width
        Tm = encoder_hidden_states.shape[1]  # raises on None, as Lumina's to_k(encoder_hidden_states) does
        # raises on None too; Lumina's view: any mask of B x Tm entries
        keep = attention_mask.bool().view(B, 1, T, 1) if self.over_queries else attention_mask.bool().view(B, 1, 1, -1)
        q = attn.to_q(hidden_states).view(B, T, attn.heads, D // attn.heads).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(encoder_hidden_states).view(B, Tm, attn.heads, D // attn.heads).transpose(1, 2)
                for f in (attn.to_k, attn.to_v))  # (B, H, Tm, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # (B, H, T, d)
        return attn.to_out(out.transpose(1, 2).reshape(B, T, D))


class TextMaskedAttention(nn.Module):
    """diffusers' layout: the module holds the projections, its processor computes the attention."""

    def __init__(self, dim=32, heads=4, over_queries=False):
        super().__init__()
        self.heads, self.processor = heads, TextMaskedProcessor(over_queries)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


def _runs(report):
    return next(r for r in report.results if r.detector == "runs")


def test_a_layer_requiring_its_stream_and_a_mask_over_it_is_inconclusive_saying_so():
    torch.manual_seed(0)
    report = diagnostics.audit(TextMaskedAttention(), progress=False)
    assert report.status == "inconclusive", report.status_reason
    assert _runs(report).verdict == "skip"
    assert "requires both" in _runs(report).message and "`attention_mask`" in _runs(report).message
    assert "runs: not measured" in report.status_reason, report.status_reason


def test_the_same_layer_reading_that_mask_over_its_queries_still_fails_runs():
    torch.manual_seed(0)
    report = diagnostics.audit(TextMaskedAttention(over_queries=True), progress=False)
    assert report.status == "failed" and _runs(report).verdict == "fail", report.status_reason


@pytest.mark.parametrize("name", ["Attention+LuminaAttnProcessor2_0", "attention_processor:MochiAttention"])
def test_diffusers_layers_requiring_their_text_stream_and_its_mask_are_inconclusive_not_failed(name):
    pytest.importorskip("diffusers", reason="diffusers is not installed (the zoo extra)")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sweep_diffusers as sd

    report = diagnostics.audit(sd.diffusers_build(name), progress=False)
    assert report.status == "inconclusive" and "requires both" in _runs(report).message, report.status_reason
