"""Weights over a layer's own partition of the tokens, read back to (B, H, Tq, Tk) by tagging the tokens.

vit-pytorch's ScalableViT cuts its feature map into windows inside the layer, `(b x y) h (w1 w2) d`: its softmax
runs over (B x windows, H, w x w, w x w), none of whose axes is the tokens', and its weights were read nowhere (the
audit inconclusive: "the attention itself was not measured"). Where heads and windows were as many as the blocks of
consecutive tokens a probe makes (4 heads, windows of 3 on 6 x 6), `block_diagonal` read the heads as blocks: right
row sums, wrong layout. Now the tokens are tagged (diagnostics/_layout.py): call c moves the tokens whose number has
bit c set, each row of the queries and of the values changes in the calls that spell its token's number, and one call
that moves another pattern checks the reading; a block reading is checked by that call too.

The layers here are of our own writing: a (B, C, H, W) map with 1x1-convolution projections and windows cut inside
(audited through `adapters.image`, as the README says for such layers), correct and with a causal mask left inside
each window (an encoder's bug the weights show: `undeclared_causality`), and a routing that sorts tokens by their
content before bucketing (the tags move the routing: no reading, never a wrong one). Each in float32 and in bfloat16
at std 0.02.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics import adapters
from diagnostics._probe import Probe
from diagnostics._subject import make_subject


class WindowedMap(nn.Module):
    """Attention within windows of `window_size` x `window_size` of a (B, C, H, W) map, cut and merged back by the
    layer itself (ScalableViT's partition). `causal_inside`: the bug, a causal mask over each window's tokens."""

    def __init__(self, dim: int = 32, heads: int = 4, window_size: int = 3, causal_inside: bool = False):
        super().__init__()
        self.heads, self.window_size, self.causal_inside = heads, window_size, causal_inside
        self.to_q, self.to_k, self.to_v = (nn.Conv2d(dim, dim, 1, bias=False) for _ in range(3))
        self.to_out = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        B, C, height, width = x.shape
        w, H = self.window_size, self.heads
        assert height % w == 0 and width % w == 0, \
            f"height ({height}) or width ({width}) of feature map is not divisible by the window size ({w})"

        def windows(t):  # (B, C, height, width) -> (B x windows, H, w x w, C / H)
            t = t.view(B, H, C // H, height // w, w, width // w, w).permute(0, 3, 5, 1, 4, 6, 2)
            return t.reshape(-1, H, w * w, C // H)

        q, k, v = windows(self.to_q(x)), windows(self.to_k(x)), windows(self.to_v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // H)
        if self.causal_inside:
            scores = scores.masked_fill(torch.ones(w * w, w * w, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).view(B, height // w, width // w, H, w, w, C // H)
        return self.to_out(out.permute(0, 3, 6, 1, 4, 2, 5).reshape(B, C, height, width))


SETTINGS = [pytest.param(torch.float32, None, id="float32"), pytest.param(torch.bfloat16, 0.02, id="bfloat16-std0.02")]


def built(layer: nn.Module, dtype, std):
    if std is not None:
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, std)
    return layer.to(dtype)


def audited(make, dtype=torch.float32, std=None, seq_len=None):
    torch.manual_seed(0)
    layer = built(make(), dtype, std)
    return diagnostics.audit(adapters.image(layer), progress=False, dtype=dtype,
                             seq_len=seq_len or adapters.image_seq_len(layer))


def same_window(side: int, w: int) -> torch.Tensor:
    """(T, T) bool: tokens of one window of the side x side map (row-major tokens)."""
    r, c = torch.arange(side * side) // side, torch.arange(side * side) % side
    cell = (r // w) * (side // w) + c // w
    return cell[:, None] == cell[None, :]


@pytest.mark.parametrize("heads, window, side", [(4, 3, 6), (2, 2, 4), (4, 4, 8)],
                         ids=["4 heads, 4 windows of 9 (heads were read as blocks)", "2 heads, windows of 4",
                              "4 heads, 4 windows of 16"])
@pytest.mark.parametrize("dtype, std", SETTINGS)
def test_windows_cut_inside_the_layer_are_read_at_their_tokens_and_pass(heads, window, side, dtype, std):
    report = audited(lambda: WindowedMap(heads=heads, window_size=window), dtype, std, seq_len=side * side)
    sums = report.result("weight_row_sums")
    assert report.status == "passed" and "tagging the tokens" in sums.message, str(report)
    torch.manual_seed(0)
    layer = built(WindowedMap(heads=heads, window_size=window), dtype, std)
    probe = Probe(make_subject(adapters.image(layer), dtype=dtype), causal=False, scale=None, seq_len=side * side,
                  seed=0)
    weights, source = probe.recovered_weights()  # (B, H, T, T): each weight at its query's and its key's token
    assert weights is not None and "tagging the tokens" in source, source
    weights = weights.float()
    assert weights.shape == (2, heads, side * side, side * side), weights.shape
    inside = same_window(side, window)
    assert bool((weights[..., ~inside] == 0).all()) and bool((weights[..., inside] > 0).all())


@pytest.mark.parametrize("dtype, std", SETTINGS)
def test_a_causal_mask_left_in_each_window_is_seen_in_the_weights(dtype, std):
    """A causal mask inside each window of a layer audited as attending both ways: `undeclared_causality` (a hint,
    never a failure) reads the future blocked in every window from the weights at their tokens and names it; with the
    weights unread it could not be seen. Its twin on the same inputs passes without the hint (above)."""
    report = audited(lambda: WindowedMap(heads=4, window_size=3, causal_inside=True), dtype, std, seq_len=36)
    hint = report.result("undeclared_causality")
    assert hint.verdict == "warn" and "it masks the future itself" in hint.message, str(report)
    twin = audited(lambda: WindowedMap(heads=4, window_size=3), dtype, std, seq_len=36)
    assert twin.result("undeclared_causality").verdict == "pass", str(twin)


class SortedBuckets(nn.Module):
    """Tokens sorted by a score of their content, then attended in buckets of 4 and put back (a content routing, as
    Sinkhorn's sort net and Reformer's hashing are): moving a token moves the route, so no tag reading holds."""

    def __init__(self, d_model: int = 32, heads: int = 2, bucket: int = 4):
        super().__init__()
        self.heads, self.bucket = heads, bucket
        self.qkv, self.score, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, 1), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        assert T % self.bucket == 0, f"sequence {T} needs to be divisible by bucket size {self.bucket}"
        order = self.score(x).squeeze(-1).argsort(-1)  # (B, T)
        sorted_x = x.gather(1, order[..., None].expand(B, T, D))
        q, k, v = (t.view(B, T // self.bucket, self.bucket, self.heads, -1).transpose(2, 3)
                   for t in self.qkv(sorted_x).chunk(3, -1))  # (B, buckets, H, bucket, d)
        weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)
        out = (weights @ v).transpose(2, 3).reshape(B, T, D)
        # a nonlinearity before the output projection: the weights cannot be read through the values either
        return self.out(nn.functional.gelu(torch.empty_like(out).scatter(1, order[..., None].expand(B, T, D), out)))


def test_a_routing_by_content_is_not_read_by_tags():
    """The check call moves the route: its rows do not change where the numbers predict, and no weights are read from
    tags (never a wrong reading). A layer of its kind stays as it was, its weights unmeasured."""
    torch.manual_seed(0)
    sums = diagnostics.audit(SortedBuckets(), progress=False).result("weight_row_sums")
    assert sums.verdict == "skip" and "tagging" not in sums.message, sums
