"""Byte-patch cross-attention (issue 33: BLT, transformers 5.25, `BltCrossAttention`, modeling_blt.py:341): queries
from `hidden_states`, keys and values from `cross_attention_states`, under the model's additive mask over the memory.
BLT's local encoder gives its patches' slots (cross_attn_k = 2 per patch, 34 at 16 bytes) the bytes as memory; its
local decoder gives the bytes the slots, byte i attending its own patch's slots only.

The correct model failed three ways, each a cause of the audit's, none of the model's:
- `cross_attention_states` was not read as a memory: the layer was audited as a self-attention whose keys and values
  the probes never reached (`output_variance`, `attention_pattern` failed at the encoder's cross-attention);
- read as one, every probe gave the memory as many tokens as the queries (2T), longer than the mask the model passed
  over the memory (T), which varies along it (`runs` failed): a layer whose memory is shorter is probed at its
  length; a memory longer than held, or one whose cut leaves a query row none of its keys (the decoder's byte i,
  whose slots 2i and 2i + 1 are cut off at any length) is a probe the layer as held cannot take, skipped with the
  reason (it made `gradients` fail on the additive mask's rounding, finfo.min + q.k being finfo.min);
- the config's sliding window (the self-attention's) was declared for the cross-attention too, on both sides as it
  says is_causal = False, and measured over the memory's positions (`attention_pattern` failed as over-masking).
Twins, the same model with one bug: the encoder's cross-attention without its scale, the decoder's
ignoring its mask (it sees later bytes' slots), and the self-attention ignoring its window still fail, at that layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import diagnostics

D, HEADS, SLOTS, VOCAB, WINDOW, T = 16, 2, 2, 32, 4, 12


class Config:
    """What the layers' Hugging Face config says of them: BLT's local encoder config's window, read by every layer
    built from it, the cross-attention's included."""

    sliding_window = WINDOW


class WindowedSelfAttention(nn.Module):
    """Causal self-attention over the last config.sliding_window bytes (keys i - w < j <= i). `bug`: the window
    ignored (causal only)."""

    def __init__(self, bug: bool = False):
        super().__init__()
        self.config, self.bug = Config(), bug
        self.qkv, self.o_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, hidden_states):
        B, Tq, _ = hidden_states.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(hidden_states).view(B, Tq, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        i, j = torch.arange(Tq).unsqueeze(-1), torch.arange(Tq)  # (T, 1), (T,)
        allowed = (j <= i) & ((j > i - WINDOW) | self.bug)  # (T, T)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(D // HEADS)).masked_fill(~allowed, -math.inf)  # (B, H, T, T)
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, Tq, D))


class PatchCrossAttention(nn.Module):
    """BLT's cross-attention: queries from hidden_states, keys and values from cross_attention_states, the model's
    additive mask (0 allowed, finfo.min blocked, as transformers builds it) over the memory. `bug`: "missing_scale"
    (q.k not divided by sqrt(d)) or "mask_ignored"."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.config, self.is_causal, self.bug = Config(), False, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, cross_attention_states, attention_mask):
        B, Tq, Tk = hidden_states.shape[0], hidden_states.shape[1], cross_attention_states.shape[1]  # batch, lengths
        q = self.q_proj(hidden_states).view(B, Tq, HEADS, -1).transpose(1, 2)  # (B, H, Tq, d)
        k, v = (p(cross_attention_states).view(B, Tk, HEADS, -1).transpose(1, 2)
                for p in (self.k_proj, self.v_proj))  # (B, H, Tk, d)
        scores = q @ k.transpose(-2, -1) / (1 if self.bug == "missing_scale" else math.sqrt(D // HEADS))  # (B,H,Tq,Tk)
        if self.bug != "mask_ignored":
            scores = scores + attention_mask
        weights = scores.softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, Tq, D))


class ByteLM(nn.Module):
    """BLT in miniature, each byte its own patch (as BLT's tiny config patches them): a windowed causal self-attention
    over the bytes; each byte's SLOTS slots attend the bytes up to theirs (the local encoder's cross-attention, 2T
    queries over T bytes); each byte attends its own slots only (the local decoder's, T queries over 2T slots)."""

    def __init__(self, *, encoder_bug: str | None = None, decoder_bug: str | None = None,
                 window_ignored: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.self_attn = WindowedSelfAttention(window_ignored)
        self.to_slots = nn.Linear(D, SLOTS * D)
        self.encoder_cross = PatchCrossAttention(encoder_bug)
        self.decoder_cross = PatchCrossAttention(decoder_bug)

    def forward(self, input_ids):
        x = self.embed(input_ids)  # (B, T, D)
        B, Tx, _ = x.shape
        x = x + self.self_attn(x)
        slots = self.to_slots(x).view(B, Tx * SLOTS, D)  # (B, 2T, D): slot SLOTS * i + s is byte i's
        byte = torch.arange(Tx * SLOTS) // SLOTS  # (2T,): the byte of each slot
        blocked = torch.finfo(x.dtype).min
        up_to = torch.where(torch.arange(Tx) <= byte.unsqueeze(-1), 0.0, blocked).to(x.dtype)  # (2T, T)
        slots = slots + self.encoder_cross(slots, cross_attention_states=x,
                                           attention_mask=up_to.expand(B, 1, Tx * SLOTS, Tx))
        own = torch.where(byte == torch.arange(Tx).unsqueeze(-1), 0.0, blocked).to(x.dtype)  # (T, 2T)
        x = x + self.decoder_cross(x, cross_attention_states=slots, attention_mask=own.expand(B, 1, Tx, Tx * SLOTS))
        return self.head(x)


def _audit(**bugs):
    torch.manual_seed(0)
    model = ByteLM(**bugs).eval()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    return diagnostics.audit_model(model, ids, causal=True)


def _located(report) -> set:
    return {(f.layer, f.detector) for f in report.findings if f.verdict == "fail"}


def test_a_memory_named_cross_attention_states_is_attended_and_probed_at_its_length():
    report = _audit()
    assert not _located(report), str(report)  # failed before: output_variance, attention_pattern; then runs
    encoder = report.layers["encoder_cross"]
    assert encoder.status == "passed", str(encoder)
    assert "memory cross_attention_states" in encoder.layer, encoder.layer
    assert encoder.seq_len == T, encoder.seq_len  # the memory's length, not the slots' 2T


def test_a_cross_attention_whose_mask_the_cut_leaves_a_query_no_key_is_not_probed_and_says_why():
    report = _audit()
    decoder = report.layers["decoder_cross"]
    # failed before: attention_pattern (the config's window); with that fixed, gradients on the rows the cut masked
    assert decoder.status == "inconclusive", str(decoder)
    assert not decoder.findings, str(decoder)
    assert "keep none of the keys" in str(decoder), str(decoder)


def test_a_configs_window_is_the_self_attentions_not_the_cross_attentions():
    report = _audit()
    for layer in ("encoder_cross", "decoder_cross"):
        assert report.layers[layer].result("attention_pattern").verdict == "skip", str(report.layers[layer])
    assert report.result("sliding_window").verdict == "pass", str(report)  # the self-attention's, measured
    assert report.layers["self_attn"].result("attention_pattern").verdict == "pass", str(report)


def test_a_cross_attention_over_cross_attention_states_without_its_scale_still_fails_there():
    report = _audit(encoder_bug="missing_scale")
    assert report.status == "failed", str(report)
    assert _located(report) == {("encoder_cross", "softmax_saturation")}, str(report)


def test_a_cross_attention_that_ignores_its_mask_over_the_memory_still_fails_there():
    report = _audit(decoder_bug="mask_ignored")  # byte i sees every byte's slots: later bytes leak in
    assert report.status == "failed", str(report)
    assert ("decoder_cross", "prefix_causality") in _located(report), str(report)


def test_the_self_attention_that_ignores_the_configs_window_still_fails_there():
    report = _audit(window_ignored=True)
    assert report.status == "failed", str(report)
    assert {layer for layer, _ in _located(report)} == {"self_attn"}, str(report)
