"""Masks read in the styles the library zoo and the real-bug benchmark showed (issue 17), each with its broken twin
on the same inputs:

- a key-keep (B, Tk) mask on a layer that zeroes the outputs of masked queries (x-transformers does): mask_honoured
  measures it through its allowed-key control (key 0 changed alone moves the rows that may attend it), and the same
  mask inverted on its way in fails ("the mask works the wrong way round"), though every blocked row holds still;
- a -inf mask applied to the weights after the softmax (timm#2236): NaN reaches queries that have keys to attend,
  and fully_masked_rows fails; its twin, masked before the softmax, passes; a plain softmax whose only NaN is the
  query with no key at all warns, as before.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


class ZeroedRows(nn.Module):
    """Self-attention with a key-keep mask (B, Tk), True = a real token; the outputs at padded positions are zeroed.
    `inverted`: the caller's mistake, the mask inverted on its way in."""

    def __init__(self, d_model=16, num_heads=2, inverted=False):
        super().__init__()
        self.d_model, self.num_heads, self.inverted = d_model, num_heads, inverted
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        if mask is not None and self.inverted:
            mask = ~mask
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        keep = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, Tk)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # (B, H, T, d)
        y = self.out(y.transpose(1, 2).reshape(B, T, D))
        return y if mask is None else y * mask[..., None]  # padded queries output 0


class WeightsMasked(nn.Module):
    """Encoder self-attention, mask bool (B, 1, T, T), True = may attend. `where`: "before" (the scores, then a
    softmax that gives an all -inf row NaN), "after" (the weights after the softmax, with -inf: the bug)."""

    def __init__(self, d_model=16, num_heads=2, where="before"):
        super().__init__()
        self.d_model, self.num_heads, self.where = d_model, num_heads, where
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)  # (B, H, T, T)
        if mask is not None and self.where == "before":
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        if mask is not None and self.where == "after":
            weights = weights.masked_fill(~mask, float("-inf"))  # the bug: -inf reaches the values' product
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("inverted", [False, True], ids=["correct", "inverted"])
def test_a_layer_that_zeroes_masked_rows_is_measured_and_its_inverted_twin_fails(inverted):
    torch.manual_seed(0)
    result = diagnostics.audit(ZeroedRows(inverted=inverted), mask="key_keep").result("mask_honoured")
    if not inverted:
        assert result.verdict == "pass", result
    else:
        assert result.verdict == "fail" and "wrong way round" in result.message, result
        assert "0 / " in result.evidence, result.evidence  # no row that may attend key 0 moved


@pytest.mark.parametrize("where", ["before", "after"])
def test_nan_in_rows_with_keys_to_attend_fails_and_nan_in_the_empty_row_only_warns(where):
    torch.manual_seed(0)
    result = diagnostics.audit(WeightsMasked(where=where)).result("fully_masked_rows")
    if where == "before":
        assert result.verdict == "warn", result  # only the query with no key: NaN from the softmax of -inf
    else:
        assert result.verdict == "fail" and "spreads beyond" in result.message, result
        assert "keys to attend are NaN" in result.evidence, result.evidence


class PerToken(nn.Module):
    """Each output from its own token only, the mask taken and ignored (`mixes=False`); its twin (`mixes=True`)
    is self-attention under the same (B, Tk) key-keep mask."""

    def __init__(self, d_model=16, num_heads=2, mixes=True):
        super().__init__()
        self.d_model, self.num_heads, self.mixes = d_model, num_heads, mixes
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        if not self.mixes:
            return self.out(x)
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        keep = None if mask is None else mask[:, None, None, :]
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("mixes", [True, False], ids=["attention", "per-token"])
def test_a_layer_that_mixes_no_tokens_is_not_measured_and_never_read_as_a_backwards_mask(mixes):
    """A per-token layer moves no row that may attend key 0 when key 0 changes, as an inverted mask does; but no
    changed key moves any other query at all, so the mask is not measured (neither passed nor backwards)."""
    torch.manual_seed(0)
    result = diagnostics.audit(PerToken(mixes=mixes), mask="key_keep").result("mask_honoured")
    if mixes:
        assert result.verdict == "pass", result
    else:
        assert result.verdict == "skip" and "mixes no tokens" in result.message, result
