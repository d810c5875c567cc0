"""The layer-level causes of the timm sweep's false failures (issue 33's whole-timm sweep, issue 34's layer audit),
each as a twin in plain torch: the layer's essential structure in a few lines, correct and with a real bug of the
same shape, audited on the same inputs. timm itself is not needed.

SwinV2: its continuous position bias is a ReLU MLP of the log-spaced offset, its first bias zero-initialised, so at
offset 0 every hidden unit sits exactly on the ReLU's kink: the layer is not differentiable there along that bias,
and `gradients` read the kink as a wrong backward. The check now leaves out the parts of its direction (the inputs,
each parameter) whose one-sided derivatives differ, names them, and checks the rest.

EVA (DINOv3, ViT-Medium-d RoPE, LingBot) and ViT-SRelPos: a fused qkv/proj attention whose call passes a tensor of
its own beside the tokens (timm's `rope`, the shared `shared_rel_pos` bias): `own_weights` recomputed the layer
without it and failed it. A tensor the recompute does not use now makes the check not applicable, naming it.

Gemma 4's ViT: q and k through a per-head RMSNorm (eps 1e-6, a learned gain at 1), then SDPA told `scale=1.0`: the
norm's eps spread the rows' norms by 2e-4, past the float32 rounding `softmax_saturation` allowed between normalised
rows, so q and k were not read as normalised and the layer was judged by 1/sqrt(d_k) (8x too sharp). Rows within
`NORMS_APART` of one another are normalised now; the stated scale is then the layer's own temperature.

NextViT's E-MHSA (and PVT's spatial reduction): the keys are the tokens average-pooled 4 to 1, so the gradient
checks' short probe (6 tokens) gives one key, whose softmax ignores q and k, and `parameters_used` read q's and k's
weights as unused. Parameters unused on the short probe are asked again at the audit's length.

DaViT's channel attention: softmax((q^T k) / sqrt(N)) over (B, H, d, d), between the channels of a head, not between
tokens: `output_variance` (identical tokens come out unchanged) and `own_weights` (the recompute of a token
attention) failed it. Where no softmax of the layer has an axis of the tokens' count, both say not applicable. And
the model audit no longer counts it as an attention module at all (it mixes no tokens): a module whose every observed
softmax has scores whose q·k product sums over the tokens, and (Tq, Tk) of another size, is left out with a note.

TinyViT and EfficientViT: the attention biases (a table indexed by a buffer) are cached in eval mode on the first
forward and dropped by the module's `train()`; an earlier detector's forward without autograd filled the cache, and
`gradient_flow` found the table without a gradient. It now puts the model in eval mode again (the audit's mode)
before its forward, so that such caches are computed afresh, and after it, so that none keeps its graph.
EfficientViT's attention also ends in a BatchNorm whose weight starts at 0 (`bn_weight_init=0`): every parameter
before it gets a gradient of exactly 0, by design at this initialisation; its submodules were excused as such (their
output gets none), its own bias table was not. A parameter that feeds a submodule whose output gets exactly 0 now is.
And at 64 px its last stage has a 1 x 1 window: one key, whose softmax is 1 whatever its score, so the bias table
gets no gradient there; a parameter whose module normalised every softmax over one key is not judged now either.

LeViT-S8 at 64 px: its attention downsamples (no residual around them) average near-uniformly over 64 and then 16
tokens at initialisation, so the 4 tokens of its last stage are exactly equal (the 2 x 2 grid reaches every row of
its bias table); a weighted mean of equal values is that value whatever the weights, so the bias tables get no
gradient, and the BatchNorm at weight 0 after them did not excuse them (they feed nothing before it either). A
parameter whose module's every softmax weighs values the same at every key is not judged now, and the module named.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from correct import gpt2_init_
from diagnostics import audit, audit_model

D, H = 32, 4  # d_model, heads


def split(t, heads: int):
    B, T, C = t.shape  # batch, sequence length, d_model
    return t.view(B, T, heads, C // heads).transpose(1, 2)  # (B, H, T, d)


def merge(t):
    B, h, T, d = t.shape  # batch, heads, sequence length, head width
    return t.transpose(1, 2).reshape(B, T, h * d)  # (B, T, D)


def result(layer, detector: str, dtype=torch.float32, **kw):
    return audit(layer.to(dtype), detectors=[detector], progress=False, **kw).result(detector)


# ---- SwinV2: a ReLU's kink at the probe point is not a wrong backward ---------------------------------------


class PositionMlpAttention(nn.Module):
    """SwinV2's continuous relative position bias (timm's WindowAttention.cpb_mlp) on a 1-D sequence: a ReLU MLP
    of the log-spaced offset, its first bias zero-initialised, squashed to (0, 16) and added to the scores."""

    detach_weights = False

    def __init__(self, d_model=D, n_heads=H, hidden=64):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.cpb = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads, bias=False))
        nn.init.zeros_(self.cpb[0].bias)  # timm's init: at offset 0 every unit's input is exactly 0

    def forward(self, x, mask=None):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d) each
        r = torch.arange(-(T - 1), T, dtype=x.dtype, device=x.device)  # every offset
        table = self.cpb((torch.sign(r) * torch.log2(r.abs() + 1) / 3)[:, None])  # (2T-1, H)
        pos = torch.arange(T, device=x.device)
        bias = 16 * torch.sigmoid(table[pos[None, :] - pos[:, None] + T - 1]).permute(2, 0, 1)  # (H, T, T)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        if self.detach_weights:
            weights = weights.detach()
        return self.proj(merge(weights @ v))


class PositionMlpDetached(PositionMlpAttention):
    detach_weights = True  # BUG: no gradient reaches q, k or the position bias through the weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_relu_kink_at_the_probe_point_passes_gradients_and_a_detached_softmax_beside_it_fails(dtype, seed):
    """Correct: the kink's part (the MLP's first bias) left out and named, the rest agrees to ~1e-14 (GRADIENT_
    AGREEMENT 1e-9). Detached: fails along the rest at 1e-4 or more (seeds 0-2, float32 and bfloat16)."""
    torch.manual_seed(seed)
    right = result(PositionMlpAttention(), "gradients", dtype)
    torch.manual_seed(seed)
    bug = result(PositionMlpDetached(), "gradients", dtype)
    assert right.verdict == "pass", right.evidence
    assert "not differentiable at this point along cpb.0.bias" in right.evidence, right.evidence
    assert right.value < 1e-11, right.evidence
    assert bug.verdict == "fail", bug.evidence


# ---- EVA / ViT-SRelPos: a tensor the call passes beside the tokens ---------------------------------------------


class RopeAttention(nn.Module):
    """timm's EvaAttention in a few lines: a fused qkv, rotary positions from a table the caller passes (`rope`:
    (T, 2 d), sines then cosines), the output projection."""

    __module__ = "timm.models.twin"  # read as a library's own class, every step known, as timm's EvaAttention was
    merge_wrongly = False

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.num_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, rope=None, attn_mask=None):
        q, k, v = (split(t, self.num_heads) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d) each
        if rope is not None:
            sin, cos = rope.chunk(2, -1)  # (T, d) each

            def turn(t):
                t1, t2 = t.chunk(2, -1)
                return t * cos + torch.cat((-t2, t1), -1) * sin

            q, k = turn(q), turn(k)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, T, d)
        B, h, T, d = out.shape
        # the bug: the heads merged without moving them next to their width
        merged = out.reshape(B, T, h * d) if self.merge_wrongly else merge(out)
        return self.proj(merged)


class RopeMergedWrongly(RopeAttention):
    merge_wrongly = True


def with_rope(layer, x, mask=None):
    T, d = x.shape[1], D // H
    angle = torch.arange(T, dtype=x.dtype)[:, None] * 10000 ** (-torch.arange(d // 2, dtype=x.dtype) / (d // 2))
    angle = torch.cat((angle, angle), -1)  # (T, d)
    return layer(x, rope=torch.cat((angle.sin(), angle.cos()), -1), attn_mask=mask)


def test_a_layer_given_a_tensor_of_its_own_is_not_applicable_and_a_wrong_merge_without_it_still_fails():
    """With its rotary table passed, the correct layer is not recomputed (it failed at 0.06 of the output's RMS, as
    timm's EVA did); without one, the correct layer passes and the wrongly merged twin fails, the step named."""
    torch.manual_seed(0)
    given = result(RopeAttention(), "own_weights", call=with_rope)
    assert given.verdict == "skip" and "the call passes rope" in given.message, given.message
    torch.manual_seed(0)
    right = result(RopeAttention(), "own_weights")
    torch.manual_seed(0)
    bug = result(RopeMergedWrongly(), "own_weights")
    assert right.verdict == "pass", right.evidence
    assert bug.verdict == "fail" and "merged" in bug.evidence, bug.evidence


# ---- Gemma 4's ViT: QK-norm with an eps, then scale=1 ------------------------------------------------------------


class QkNormScaleOne(nn.Module):
    """Gemma 4's vision attention in a few lines: q and k each through an RMSNorm over the head's width (a learned
    gain, at 1), then SDPA told `scale=1.0` ("since QK are normalized")."""

    def __init__(self, d_model=D, n_heads=H, eps=1e-6, normed=True):
        super().__init__()
        self.n_heads, d = n_heads, d_model // n_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = (nn.RMSNorm(d, eps=eps) if normed else nn.Identity() for _ in range(2))

    def forward(self, x, mask=None):
        q = self.q_norm(split(self.q_proj(x), self.n_heads))  # (B, H, T, d), each row of norm ~sqrt(d)
        k = self.k_norm(split(self.k_proj(x), self.n_heads))
        v = split(self.v_proj(x), self.n_heads)
        return self.o_proj(merge(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)))


class QkNormNoScale(QkNormScaleOne):
    """The same norms, the scores by hand with no scale at all and no word for it."""

    def forward(self, x, mask=None):
        q = self.q_norm(split(self.q_proj(x), self.n_heads))
        k = self.k_norm(split(self.k_proj(x), self.n_heads))
        v = split(self.v_proj(x), self.n_heads)
        scores = q @ k.transpose(-2, -1)  # BUG: unit-RMS rows, no 1/sqrt(d_k): q·k grows as d_k x their cosine
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.o_proj(merge(scores.softmax(-1) @ v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("eps, gpt2", [(1e-6, False), (1e-5, False), (1e-6, True), (1e-5, True)], ids=str)
def test_qk_norm_with_an_eps_and_scale_one_passes_and_the_missing_scale_without_the_norm_fails(dtype, eps, gpt2):
    """float32 at eps 1e-5 (torch's init) and at GPT-2's init failed before; at eps 1e-4 and GPT-2's init the rows
    spread past 2% and it still fails (not covered: no library seen uses it on rows that small)."""
    def make(cls, **kw):
        torch.manual_seed(0)
        layer = cls(eps=eps, **kw)
        return gpt2_init_(layer) if gpt2 else layer

    right = result(make(QkNormScaleOne), "softmax_saturation", dtype)
    unnormed = result(make(QkNormScaleOne, normed=False), "softmax_saturation", dtype)
    no_scale = result(make(QkNormNoScale), "softmax_saturation", dtype)
    assert right.verdict == "pass" and "the scale= the layer passes" in right.evidence, right.evidence
    assert unnormed.verdict == "fail" and "too sharp" in unnormed.message, unnormed.evidence
    assert no_scale.verdict == "fail" and "too sharp" in no_scale.message, no_scale.evidence


class QkNormByHand(QkNormScaleOne):
    """Attention scale = 1.0 (since QK are normalized): Gemma 4's ViT on timm's own path without SDPA
    (`fused_attn = False`, TIMM_FUSED_ATTN=0), the scores written out unscaled, as its class docstring says."""

    def forward(self, x, mask=None):
        q = self.q_norm(split(self.q_proj(x), self.n_heads))
        k = self.k_norm(split(self.k_proj(x), self.n_heads))
        v = split(self.v_proj(x), self.n_heads)
        scores = q @ k.transpose(-2, -1)  # unit-RMS rows, no 1/sqrt(d_k), as the docstring states
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.o_proj(merge(scores.softmax(-1) @ v))


class QkNormByHandOtherWords(QkNormByHand):
    """Attention scale = 0.125, 1/sqrt(d_k) at d_k = 64: words for another number than the one applied."""


class QkNormByHandInherited(QkNormByHand):
    __doc__ = None  # the parent's words are the parent's: this class states nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gpt2", [False, True], ids=["torch-init", "std-0.02"])
def test_qk_norm_unscaled_by_hand_passes_where_its_own_docstring_states_that_scale(dtype, gpt2):
    """Unit-RMS q and k multiplied by 1 is the missing scale or Gemma 4's design: the same function, so the layer's
    own words decide. Its docstring says "scale = 1.0": its own temperature, judged by the cosine bounds (a cosine
    times d_k = 8 passes), as `scale=1.0` handed to SDPA is. The twins on the same inputs: words for another number,
    words only a parent class holds, and no words (`QkNormNoScale`) each leave it judged by 1/sqrt(d_k): 2.83x too
    sharp."""
    def run(cls):
        torch.manual_seed(0)
        layer = cls()
        return result(gpt2_init_(layer) if gpt2 else layer, "softmax_saturation", dtype)

    stated = run(QkNormByHand)
    assert stated.verdict == "pass" and "normalised" in stated.message, stated.evidence
    assert "the scale the layer states (QkNormByHand: \"Attention scale = 1.0" in stated.evidence, stated.evidence
    for twin in (QkNormByHandOtherWords, QkNormByHandInherited, QkNormNoScale):
        judged = run(twin)
        assert judged.verdict == "fail" and "2.83x too sharp" in judged.message, (twin, judged.evidence)


@pytest.mark.parametrize("written, counts", [("1.004", True), ("1.006", False)])
def test_pin_scale_words(written, counts):
    """SCALE_WORDS (5e-3) from both sides: a docstring stating the scale as 1.004 states the 1 applied (a rounding's
    distance); as 1.006 it states another number, and the unscaled scores are judged by 1/sqrt(d_k)."""
    stated = type("QkNormWritten", (QkNormByHand,), {"__doc__": f"QK-norm attention. Attention scale = {written}."})
    torch.manual_seed(0)
    found = result(stated(), "softmax_saturation", torch.float32)
    assert (found.verdict == "pass") is counts, found.evidence
    assert ("2.83x too sharp" in found.message) is not counts, found.message


# ---- NextViT: keys pooled from the tokens ---------------------------------------------------------------------


class PooledKeys(nn.Module):
    """NextViT's EfficientAttention in a few lines: queries from every token, keys and values from the tokens
    average-pooled `ratio` to 1 and normalised (its `sr` and `norm`)."""

    values_from_keys = False

    def __init__(self, d_model=D, n_heads=H, ratio=4):
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d_model, d_model) for _ in range(4))
        self.sr, self.norm = nn.AvgPool1d(ratio, ratio), nn.LayerNorm(d_model)

    def forward(self, x):
        q = split(self.q(x), self.n_heads)  # (B, H, T, d)
        pooled = self.norm(self.sr(x.transpose(1, 2)).transpose(1, 2))  # (B, T // ratio, D)
        k = split(self.k(pooled), self.n_heads)  # (B, H, T // ratio, d)
        v = split((self.k if self.values_from_keys else self.v)(pooled), self.n_heads)
        return self.proj(merge(torch.nn.functional.scaled_dot_product_attention(q, k, v)))


class PooledValuesFromKeys(PooledKeys):
    values_from_keys = True  # BUG: the values from the key projection: W_v is never used


def test_pooled_keys_use_q_and_k_at_the_audits_length_and_an_unused_value_projection_still_fails():
    """At 6 tokens the correct layer has one key and failed (q and k: gradient exactly 0); at the audit's 16 tokens,
    4 keys, it passes, saying so; W_v unused fails at every length."""
    torch.manual_seed(0)
    right = result(PooledKeys(), "parameters_used")
    torch.manual_seed(0)
    bug = result(PooledValuesFromKeys(), "parameters_used")
    assert right.verdict == "pass" and "zero gradient at 6 tokens but not at 16" in right.evidence, right.evidence
    assert bug.verdict == "fail" and "v.weight" in bug.message and "q.weight" not in bug.message, bug.message


# ---- DaViT: attention between channels ------------------------------------------------------------------------


class ChannelAttention(nn.Module):
    """DaViT's channel attention (timm's davit.ChannelAttention) in a few lines: each head's d channels attend to one
    another, their scores summed over the tokens."""

    __module__ = "timm.models.twin"  # read as a library's own class, every step known, as timm's was
    channels = True
    merge_wrongly = False

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.num_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, N, C = x.shape  # batch, tokens, channels
        q, k, v = (split(t, self.num_heads) for t in self.qkv(x).chunk(3, -1))  # (B, H, N, d) each
        if self.channels:
            attn = ((q * N ** -0.5).transpose(-1, -2) @ k).softmax(-1)  # (B, H, d, N) x (B, H, N, d) -> (B, H, d, d)
            out = (attn @ v.transpose(-1, -2)).transpose(-1, -2)  # (B, H, N, d)
        else:
            attn = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)  # (B, H, N, N)
            out = attn @ v
        # the bug of the token twin: the heads merged without moving them next to their width
        return self.proj(out.reshape(B, N, C) if self.merge_wrongly else merge(out))


class TokenMergedWrongly(ChannelAttention):
    channels, merge_wrongly = False, True  # BUG: token attention whose heads are merged without their transpose


class TokenAttention(ChannelAttention):
    channels = False


@pytest.mark.parametrize("detector", ["output_variance", "own_weights"])
def test_channel_attention_is_not_applicable_and_token_attention_merged_wrongly_still_fails(detector):
    """The channel attention failed both (identical tokens: 11.9 of the output's RMS in DaViT); the token attention
    with the same projections passes, and merged wrongly fails."""
    torch.manual_seed(0)
    channels = result(ChannelAttention(), detector)
    torch.manual_seed(0)
    right = result(TokenAttention(), detector)
    torch.manual_seed(0)
    bug = result(TokenMergedWrongly(), detector)
    assert channels.verdict == "skip" and "something else than the tokens" in channels.message, channels.message
    assert right.verdict == "pass", right.evidence
    assert bug.verdict == "fail", bug.evidence


@pytest.mark.parametrize("detector", ["output_variance", "own_weights"])
def test_channel_attention_with_as_many_heads_as_tokens_is_still_not_token_attention(detector):
    """As davit_base_fl's third stage at 64 px: 16 heads over 16 tokens (the audit's length). Read over every axis past
    the batch, the heads' 16 made the channel attention a token attention, and output_variance failed it; only the
    scores' last two axes count now. The twins at the same sizes: token attention passes, merged wrongly fails."""
    def read(cls):
        torch.manual_seed(0)
        return result(cls(d_model=64, n_heads=16), detector, seq_len=16)

    channels, right, bug = read(ChannelAttention), read(TokenAttention), read(TokenMergedWrongly)
    assert channels.verdict == "skip" and "something else than the tokens" in channels.message, channels.message
    assert right.verdict == "pass", right.evidence
    assert bug.verdict == "fail", bug.evidence


# ---- TinyViT / EfficientViT: a bias table cached in eval mode -------------------------------------------------


class CachedBiasAttention(nn.Module):
    """timm's TinyViT attention in a few lines: a learned bias per head and offset, read through a buffer of
    indices and cached in eval mode on the first forward (the cache dropped by `train()`, as timm's is)."""

    detach_bias = False

    def __init__(self, d_model=D, n_heads=H, length=16):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.attention_biases = nn.Parameter(torch.zeros(n_heads, length))
        pos = torch.arange(length)
        self.register_buffer("attention_bias_idxs", (pos[:, None] - pos[None, :]).abs(), persistent=False)
        self.cache = {}

    def train(self, mode=True):
        super().train(mode)
        self.cache = {}
        return self

    def biases(self, T: int):
        if self.training:
            return self.attention_biases[:, self.attention_bias_idxs[:T, :T]]
        key = str(self.attention_biases.device)
        if key not in self.cache:
            self.cache[key] = self.attention_biases[:, self.attention_bias_idxs]  # (H, L, L)
        table = self.cache[key][:, :T, :T]  # (H, T, T)
        return table.detach() if self.detach_bias else table

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + self.biases(T)  # (B, H, T, T)
        return self.proj(merge(scores.softmax(-1) @ v))


class DetachedBiasAttention(CachedBiasAttention):
    detach_bias = True  # BUG: the table read through .detach() at every call: it never gets a gradient


class OneBlock(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.wte, self.attn, self.head = nn.Embedding(50, D), attention(), nn.Linear(D, 50)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        return self.head(x + self.attn(x))


def test_a_bias_table_cached_in_eval_mode_gets_its_gradient_and_a_detached_one_still_fails():
    """With a layer detector, batch_invariance's forwards run without autograd before gradient_flow and fill the
    cache (the correct one failed before: 1 of 5 parameters without a gradient)."""
    def flow(attention):
        torch.manual_seed(0)
        report = audit_model(OneBlock(attention), detectors=["runs", "batch_invariance", "gradient_flow"])
        return report.result("gradient_flow")

    right, bug = flow(CachedBiasAttention), flow(DetachedBiasAttention)
    assert right.verdict == "pass", right.evidence
    assert bug.verdict == "fail" and "attn.attention_biases" in bug.evidence, bug.evidence


class ZeroScale(nn.Module):
    """A per-channel gain that starts at 0 (EfficientViT's last BatchNorm, bn_weight_init=0; a zero LayerScale)."""

    def __init__(self, width=D):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return x * self.weight


class ZeroScaledBiasAttention(CachedBiasAttention):
    """The bias-table attention whose projection ends in a gain at 0."""

    def __init__(self, d_model=D, n_heads=H, length=16):
        super().__init__(d_model, n_heads, length)
        self.proj = nn.Sequential(nn.Linear(d_model, d_model), ZeroScale(d_model))


class ZeroScaledDetached(ZeroScaledBiasAttention):
    detach_bias = True  # BUG: the table read through .detach(): it feeds nothing, whatever follows


def test_a_bias_table_behind_a_zero_initialised_gain_is_not_judged_and_a_detached_one_still_fails():
    """The correct one failed before (1 of 6 parameters without a gradient: the table; the projection's weights were
    excused, their output getting none); now the table is excused with them, and the detached table, which feeds
    nothing, still fails."""
    def flow(attention):
        torch.manual_seed(0)
        return audit_model(OneBlock(attention), detectors=["gradient_flow"]).result("gradient_flow")

    right, bug = flow(ZeroScaledBiasAttention), flow(ZeroScaledDetached)
    assert right.verdict == "pass" and "not judged" in right.message, right.message
    assert bug.verdict == "fail" and "attn.attention_biases" in bug.evidence, bug.evidence


class OneKeyAttention(CachedBiasAttention):
    """The bias-table attention over a window of one token (EfficientViT's last stage at 64 px): each token attends
    only itself, and the softmax of one score is 1. Found as timm's is, by its class (no softmax over (Tq, Tk)
    shows)."""

    __module__ = "timm.models.twin"

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (split(t, self.n_heads).reshape(B, self.n_heads * T, 1, -1) for t in self.qkv(x).chunk(3, -1))
        bias = self.attention_biases[:, :1].repeat_interleave(T, 0)[:, None]  # (H*T, 1, 1)
        scores = q @ k.transpose(-2, -1) + bias  # (B, H*T, 1, 1)
        return self.proj(merge((scores.softmax(-1) @ v).view(B, self.n_heads, T, -1)))


def test_a_module_that_attends_one_key_is_not_judged_and_a_detached_table_over_many_keys_still_fails():
    """The correct one failed before: its bias table, q and k without a gradient."""
    torch.manual_seed(0)
    right = audit_model(OneBlock(OneKeyAttention), detectors=["gradient_flow"]).result("gradient_flow")
    torch.manual_seed(0)
    bug = audit_model(OneBlock(DetachedBiasAttention), detectors=["gradient_flow"]).result("gradient_flow")
    assert right.verdict == "pass" and "attend one key" in right.message, right.message
    assert bug.verdict == "fail" and "attn.attention_biases" in bug.evidence, bug.evidence


# ---- LeViT-S8: tokens averaged into one before a stage ----------------------------------------------------------


class Averaged(nn.Module):
    """The tokens pulled towards their mean, `spread` of their differences kept: what LeViT's attention downsamples
    (near-uniform attention over 64 and then 16 tokens at initialisation, no residual around them) do to the tokens
    of its last stage, whose differences reach 0 in float32 (spread 0), or ~5e-4 of them, as its middle stage's."""

    def __init__(self, spread: float):
        super().__init__()
        self.spread = spread

    def forward(self, x):
        mean = x.mean(1, keepdim=True)  # (B, 1, D)
        return mean + self.spread * (x - mean)


class AveragedBlock(OneBlock):
    def __init__(self, attention, spread: float):
        super().__init__(attention)
        self.pool = Averaged(spread)

    def forward(self, input_ids):
        x = self.pool(self.wte(input_ids))  # (B, T, D)
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_over_tokens_averaged_into_one_is_not_judged_and_a_detached_table_over_apart_ones_still_fails(seed):
    """LeViT-S8's last stage failed (4 attention-bias tables without a gradient): its attention ends in a gain at 0,
    and the table reaches nothing before it either, the values it weighs being the same at every key. Those are not
    judged now, and say why; 5e-4 apart, the correct table is judged and passes, the detached one fails."""
    def flow(attention, spread):
        torch.manual_seed(seed)
        return audit_model(AveragedBlock(attention, spread), detectors=["gradient_flow"]).result("gradient_flow")

    same = flow(ZeroScaledBiasAttention, 0.0)
    right = flow(ZeroScaledBiasAttention, 5e-4)
    bug = flow(ZeroScaledDetached, 5e-4)
    assert same.verdict == "pass" and "attn weigh values that are the same at every key" in same.message, same.message
    assert right.verdict == "pass" and "weigh values" not in right.message, right.message
    assert bug.verdict == "fail" and "attn.attention_biases" in bug.evidence, bug.evidence


@pytest.mark.slow  # a timm LeViT-S8 built at 64 px and its gradient_flow: about 3.5 s
def test_timm_levit_s8_last_stage_gets_identical_tokens_and_its_gradient_flow_passes_naming_it():
    """The cause measured on timm itself: the tokens entering LeViT-S8's last stage (2 x 2 at 64 px) are exactly
    equal, and the audit, which failed its 4 bias tables, passes naming that stage."""
    timm = pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")
    torch.manual_seed(0)
    model = timm.create_model("levit_conv_384_s8", pretrained=False, img_size=64, num_classes=10,
                              pretrained_cfg_overlay={"input_size": (3, 64, 64)}).eval()
    seen = {}
    handle = model.stages[2].blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    handle.remove()
    tokens = seen["x"].flatten(2)  # (B, C, H * W)
    assert tokens.shape[-1] == 4 and torch.equal(tokens, tokens[..., :1].expand_as(tokens))
    flow = audit_model(model, detectors=["gradient_flow"]).result("gradient_flow")
    assert flow.verdict == "pass" and "stages.2.blocks.0.attn, stages.2.blocks.1.attn" in flow.message, flow.message


class ChannelThenTokens(nn.Module):
    """DaViT's pair of blocks in a few lines: channel attention, then token attention (`tokens`), each residual. The
    head width (12) is none of the token counts the audit observes (8) or probes (16)."""

    def __init__(self, tokens, d_model=48, n_heads=4):
        super().__init__()
        self.wte, self.head = nn.Embedding(50, d_model), nn.Linear(d_model, 50)
        self.chan, self.tok = ChannelAttention(d_model, n_heads), tokens(d_model, n_heads)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        x = x + self.chan(x)
        return self.head(x + self.tok(x))


@pytest.mark.parametrize("d_model, n_heads", [(48, 4), (96, 8)])
def test_channel_attention_is_not_audited_as_attention_and_token_attention_merged_wrongly_beside_it_still_fails(
        d_model, n_heads):
    """DaViT's channel attention was found by its class and audited as a token attention (its output_variance and
    own_weights not applicable, the model inconclusive). It mixes no tokens: left out, saying why. With as many heads
    as the 8 tokens the audit observes (davit_base_fl's third stage at 64 px has 16 of each), too."""
    def audit_(tokens):
        torch.manual_seed(0)
        return audit_model(ChannelThenTokens(tokens, d_model, n_heads))

    right, bug = audit_(TokenAttention), audit_(TokenMergedWrongly)
    for report in (right, bug):
        assert [f.path for f in report.found] == ["tok"], report.found
        assert any(n.startswith(f"chan not audited as attention: its softmax runs over scores of shape (1, {n_heads}, "
                                f"12, 12)")
                   for n in report.notes), report.notes
    assert right.status == "passed", right
    assert bug.status == "failed" and "tok" in bug.layers and bug.layers["tok"].fired(), bug
