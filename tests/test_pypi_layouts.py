"""Two of the audit's blind spots that released code showed (benchmarks/pypi_bugs.py), each with a layer written
unlike ours and its buggy twin on the same inputs:

- scores laid out (B, Tq, H, Tk), the heads between the queries and the keys (timm 1.0.13's MultiQueryAttentionV2,
  `einsum('bnhk,bmk->bnhm', q, k)`): the weights were never found as (..., Tq, Tk), so a correct layer was
  inconclusive;
- a layer audited through a declared call that lays its output out anew (a sequence passed as a (B, C, T, 1) image):
  `gradients` looked for the call's output in what forward returned, did not find it, and measured nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diagnostics import audit

D, H, K = 32, 4, 8  # d_model, heads, the width of one head


class HeadsBetween(nn.Module):
    """Multi-query attention written with einsums, as timm writes it: one key and value head, H query heads, the
    scores (b, n, h, m). `axis`: the axis of the scores the softmax normalises over (-1, the keys, is right; 1 is
    the queries)."""

    def __init__(self, axis: int = -1):
        super().__init__()
        self.axis = axis
        self.query_proj = nn.Parameter(torch.randn(H, K, D) / D ** 0.5)
        self.key_proj = nn.Parameter(torch.randn(D, K) / D ** 0.5)
        self.value_proj = nn.Parameter(torch.randn(D, K) / D ** 0.5)
        self.out_proj = nn.Parameter(torch.randn(D, H, K) / (H * K) ** 0.5)

    def forward(self, x):
        q = torch.einsum("bnd,hkd->bnhk", x, self.query_proj)  # (B, T, H, K)
        k = torch.einsum("bmd,dk->bmk", x, self.key_proj)  # (B, T, K)
        v = torch.einsum("bmd,dv->bmv", x, self.value_proj)  # (B, T, K)
        attn = (torch.einsum("bnhk,bmk->bnhm", q, k) * K ** -0.5).softmax(dim=self.axis)  # (B, Tq, H, Tk)
        return torch.einsum("bnhm,bmv,dhv->bnd", attn, v, self.out_proj)  # (B, T, D)


@pytest.mark.parametrize("axis, verdict", [(-1, "pass"), (1, "fail")], ids=["over keys", "over queries"])
def test_scores_with_the_heads_between_queries_and_keys_are_read_as_weights(axis, verdict):
    torch.manual_seed(0)
    result = audit(HeadsBetween(axis), detectors=["weight_row_sums"], progress=False).result("weight_row_sums")
    assert result.verdict == verdict, result


class OneKeyHeadCross(nn.Module):
    """Cross-attention with one key and value head for H query heads, written as CoCa writes it (coca-pytorch
    0.1.0's CrossAttention): einsum('b h i d, b j d -> b h i j', q, k), scores (B, H, Tq, Tk) whose product flattens
    H x Tq rows, as the (B, Tq, H, Tk) layout above does. `axis` as HeadsBetween's; `scaled=False`: q·k unscaled."""

    def __init__(self, axis: int = -1, scaled: bool = True):
        super().__init__()
        self.axis, self.scale = axis, K ** -0.5 if scaled else 1.0
        self.to_q, self.to_kv, self.to_out = nn.Linear(D, H * K), nn.Linear(D, 2 * K), nn.Linear(H * K, D)

    def forward(self, x, context):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, H, K).transpose(1, 2) * self.scale  # (B, H, T, K)
        k, v = self.to_kv(context).chunk(2, dim=-1)  # each (B, Tm, K)
        attn = torch.einsum("b h i d, b j d -> b h i j", q, k).softmax(dim=self.axis)  # (B, H, Tq, Tm)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)  # (B, H, Tq, K)
        return self.to_out(out.transpose(1, 2).reshape(B, T, H * K))


@pytest.mark.parametrize("axis, scaled, failed", [(-1, True, None), (2, True, "weight_row_sums"),
                                                  (-1, False, "softmax_saturation")],
                         ids=["correct", "over queries", "unscaled"])
def test_scores_of_one_key_head_keep_the_heads_before_the_queries(axis, scaled, failed):
    """Its scores were taken for the (B, Tq, H, Tk) layout (the rows alone cannot tell them apart), so no weights
    were found and the correct layer was inconclusive. At the audit's Tq = Tk, the axis just before the keys as long
    as them is the queries'."""
    torch.manual_seed(0)
    report = audit(OneKeyHeadCross(axis, scaled), progress=False)
    if failed is None:
        assert report.passed and report.result("weight_row_sums").verdict == "pass", report
    else:
        assert report.result(failed).verdict == "fail", report


class ImageAttention(nn.Module):
    """Self-attention over the pixels of a (B, C, H, W) image, one head, as diffusion U-Nets write it. `detach_keys`:
    the buggy twin, whose keys are cut from the graph, so autograd disagrees with finite differences."""

    def __init__(self, detach_keys: bool = False):
        super().__init__()
        self.detach_keys = detach_keys
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        B, C, Hi, Wi = x.shape  # batch, channels, height, width
        t = x.flatten(2).transpose(1, 2)  # (B, T, C)
        q, k, v = self.qkv(t).chunk(3, dim=-1)  # each (B, T, C)
        k = k.detach() if self.detach_keys else k
        out = (q @ k.transpose(1, 2) / C ** 0.5).softmax(-1) @ v  # (B, T, T) x (B, T, C) -> (B, T, C)
        return self.out(out).transpose(1, 2).reshape(B, C, Hi, Wi)


AS_IMAGE = dict(call=lambda layer, x: layer(x.transpose(1, 2)[..., None])[..., 0].transpose(1, 2))  # (B, C, T, 1)


@pytest.mark.parametrize("detach_keys, verdict", [(False, "pass"), (True, "fail")], ids=["correct", "keys detached"])
def test_gradients_are_measured_through_a_declared_call_that_lays_the_output_out_anew(detach_keys, verdict):
    torch.manual_seed(0)
    result = audit(ImageAttention(detach_keys), detectors=["gradients"], progress=False, **AS_IMAGE).result("gradients")
    assert result.verdict == verdict, result


class HeldCausalMask(nn.Module):
    """A causal layer written as xformers 0.0.3 wrote ScaledDotProduct: the causal mask registered in __init__ (and
    None where no length is given), forward(q, k, v, att_mask=None). `always`: apply the held mask on every call (the
    fix, 0.0.4); else only merged into a mask that is passed (the bug: without one, the future is attended)."""

    def __init__(self, seq_len: int = 64, always: bool = True):
        super().__init__()
        self.always = always
        if seq_len is not None:
            mask = torch.ones(seq_len, seq_len).tril()  # 1 = may attend
            self.register_buffer("mask", mask)
        else:
            self.mask = None

    def forward(self, q, k, v, att_mask=None):
        T = q.shape[-2]  # sequence length; q, k, v: (B, T, d)
        if self.mask is not None and (self.always or att_mask is not None):
            att_mask = self.mask[:T, :T].bool() if att_mask is None else att_mask & self.mask[:T, :T].bool()
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, T, T)
        if att_mask is not None:
            scores = scores.masked_fill(~att_mask, float("-inf"))
        return scores.softmax(-1) @ v


def test_a_held_causal_mask_the_call_never_applies_is_located_where_made_and_read():
    torch.manual_seed(0)
    result = audit(HeldCausalMask(always=False), causal=True, d_model=16, detectors=["future_leakage"],
                   progress=False).result("future_leakage")
    assert result.verdict == "fail"
    made, read = result.where[0], result.where[1]
    assert "register_buffer" in made.code and made.op == "made before the call", result.where
    assert "self.mask" in read.code and read.op == "reads it", result.where


def test_the_same_layer_applying_its_held_mask_on_every_call_passes():
    torch.manual_seed(0)
    result = audit(HeldCausalMask(always=True), causal=True, d_model=16, detectors=["future_leakage"],
                   progress=False).result("future_leakage")
    assert result.verdict == "pass", result
