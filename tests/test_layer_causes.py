"""Issue 34's causes 2 and 3 on layers written unlike ours, with the pins of the constants and verdict branches they
added (issue 37's rule: a case just inside and one just outside, in every dtype the constant is read in).

Cause 2, the temperature of normalised q and k: QK-norm and cosine attention (Swin v2's learned logit scale,
Restormer's learned temperature, nGPT's sqrt(d_k)) are judged by the logits their cosine can reach
(`COSINE_FLAT` to `COSINE_SHARP`), not by 1/sqrt(d_k); too flat and too sharp are told apart in words and fixes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from correct import gpt2_init_
from diagnostics import audit
from diagnostics.detectors.temperature import COSINE_FLAT, COSINE_SHARP

D, H = 32, 4  # d_model, heads
D_K = D // H  # the width of one head


def split(t, heads: int):
    B, T, C = t.shape  # batch, sequence length, d_model
    return t.view(B, T, heads, C // heads).transpose(1, 2)  # (B, H, T, d)


def merge(t):
    B, h, T, d = t.shape  # batch, heads, sequence length, head width
    return t.transpose(1, 2).reshape(B, T, h * d)  # (B, T, D)


def temperature(make, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return audit(make().to(dtype), detectors=["softmax_saturation"], **kw).result("softmax_saturation")


# ---- cause 2: the temperature of normalised q and k ----------------------------------------------------------


class CosineAttention(nn.Module):
    """Swin Transformer v2's scaled cosine attention: cosine similarity times a learned per-head logit scale, log(10)
    at init, clamped at log(100) before exp()."""

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(n_heads, 1, 1)))

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d) each
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)  # (B, H, Tq, Tk) cosines
        attn = attn * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        if mask is not None:
            attn = attn.masked_fill(~mask, float("-inf"))
        return self.proj(merge(attn.softmax(-1) @ v))


class Restormer(nn.Module):
    """Restormer's multi-Dconv head transposed attention, its temperature a learned per-head parameter at 1."""

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.temperature = nn.Parameter(torch.ones(n_heads, 1, 1))

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * self.temperature  # (B, H, Tq, Tk)
        if mask is not None:
            attn = attn.masked_fill(~mask, float("-inf"))
        return self.proj(merge(attn.softmax(dim=-1) @ v))


class NormalisedFixed(nn.Module):
    """q and k l2-normalised, then SDPA with a fixed scale of the layer's own (`scale`, a class attribute: nGPT's
    sqrt(d_k) by default)."""

    scale: float | None = None

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        scale = math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)))


def fixed(scale: float):
    return type(f"NormalisedTimes{scale:g}", (NormalisedFixed,), {"scale": scale})


class NormalisedStandardScale(NormalisedFixed):
    scale = 1 / math.sqrt(D_K)  # BUG: 1/sqrt(d_k) kept after the norm: a cosine / sqrt(8), nearly uniform weights


class Unnormalised(NormalisedFixed):
    """The same layer with q and k left as projected: 1/sqrt(d_k) is then the right scale."""

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        scale = 1 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)))


class MissingScale(Unnormalised):
    scale = 1.0  # BUG: no 1/sqrt(d_k)


class DividedByDk(Unnormalised):
    scale = 1.0 / D_K  # BUG: divided by d_k, not its square root


@pytest.mark.parametrize("make", [CosineAttention, Restormer, NormalisedFixed], ids=lambda m: m.__name__)
def test_qk_norm_with_a_temperature_of_its_own_passes(make):
    result = temperature(make)
    assert result.verdict == "pass" and "normalised" in result.message, f"{result.message}\n{result.evidence}"
    assert COSINE_FLAT <= result.value <= COSINE_SHARP
    assert audit(make()).passed


def test_the_standard_scale_after_the_norm_is_too_flat_and_told_so():
    result = temperature(NormalisedStandardScale)
    assert result.verdict == "fail" and "too flat for normalised q and k" in result.message, result.message
    assert "not by 1/sqrt(d_k)" in result.fix and "sharp" not in result.message, result.fix
    assert "scale=" not in result.fix  # no declaration under which this bug would pass


def test_unnormalised_layers_are_still_judged_by_one_over_sqrt_d_k_and_the_two_directions_read_apart():
    assert temperature(Unnormalised).verdict == "pass"
    sharp, flat = temperature(MissingScale), temperature(DividedByDk)
    assert sharp.verdict == "fail" and "2.83x too sharp" in sharp.message and "unscaled" in sharp.fix, sharp
    assert flat.verdict == "fail" and "2.83x too flat" in flat.message and "divided by d_k = 8" in flat.fix, flat
    assert sharp.fix != flat.fix


def test_a_declared_scale_is_still_what_normalised_q_and_k_are_judged_against():
    """The user's word wins: declared, the factor is compared with it, the normalised reading is not used."""
    assert temperature(CosineAttention, scale=10.0).verdict == "pass"
    declared = temperature(CosineAttention, scale=1 / math.sqrt(D_K))
    assert declared.verdict == "fail" and "too sharp" in declared.message and "normalised" not in declared.message


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


class RMSQKNorm(nn.Module):
    """QK-norm as Flux, SD3 and Qwen write it: an RMSNorm over each head's q and k (unit RMS, every row of norm
    sqrt(d_k)), then SDPA's own 1/sqrt(d_k); `unscaled`: the scores written out with the scale left out (the bug);
    `stated`: SDPA told scale=1 in so many words (vit-pytorch's NaViT: the layer's own temperature)."""

    unscaled = stated = False

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.q_norm, self.k_norm = nn.RMSNorm(d_model // n_heads, eps=1e-6), nn.RMSNorm(d_model // n_heads, eps=1e-6)

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.unscaled:
            scores = q @ k.transpose(-2, -1)  # BUG: no 1/sqrt(d_k) after the norm
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            return self.proj(merge(scores.softmax(-1) @ v))
        scale = 1.0 if self.stated else None
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)))


class RMSQKNormUnscaled(RMSQKNorm):
    unscaled = True


class RMSQKNormStated(RMSQKNorm):
    stated = True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make, verdict", [(RMSQKNorm, "pass"), (RMSQKNormUnscaled, "fail")],
                         ids=["scaled", "scale missing"])
@pytest.mark.parametrize("init", ["default", "gpt2"])
def test_q_and_k_at_unit_rms_are_judged_by_one_over_sqrt_d_k(make, verdict, dtype, init):
    """Rows of norm sqrt(d_k) (RMS_NORMED) take the scaled dot product's convention: the missing scale, a cosine times
    d_k, is 2.83x too sharp, where the cosine bounds (0.5 to 100) let it pass; at torch's init and at GPT-2's
    (std 0.02, where the norm's eps weighs most)."""
    def built():
        return gpt2_init_(make()) if init == "gpt2" else make()

    result = temperature(built, dtype)
    assert result.verdict == verdict, f"{result.message}\n{result.evidence}"
    assert "normalised" not in result.message  # judged by 1/sqrt(d_k), not as a temperature of the layer's own
    if verdict == "fail":
        assert "2.83x too sharp" in result.message, result.message


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
def test_a_scale_the_layer_passes_itself_at_unit_rms_is_its_own_temperature(dtype):
    """NaViT's form: scale=1 given to SDPA after the RMSNorm, the layer's own words, judged by the cosine bounds (a
    cosine times 8 passes); the twin that leaves the scale out of scores it writes itself is the bug above."""
    result = temperature(RMSQKNormStated, dtype)
    assert result.verdict == "pass" and "normalised" in result.message, f"{result.message}\n{result.evidence}"
    assert "the scale= the layer passes" in result.evidence, result.evidence


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=str)
@pytest.mark.parametrize("gain, verdict", [(0.99, "fail"), (0.95, "pass")], ids=["1% off", "5% off"])
def test_pin_rms_normed(gain, verdict, dtype):
    """RMS_NORMED (0.02) from both sides: the unscaled layer with its norms' gain at 0.99 (rows 1% off sqrt(d_k)) is
    still judged by 1/sqrt(d_k) and fails; at 0.95 (5% off: a trained gain) its temperature is its own, a cosine times
    0.95^2 x 8 = 7.2, within the cosine bounds: it passes. Not in float64, where the norm's eps spreads the rows' norms
    by more than float64's equal-norm tolerance, so no RMSNorm layer reads as normalised at all."""
    class Gained(RMSQKNormUnscaled):
        def __init__(self):
            super().__init__()
            with torch.no_grad():
                self.q_norm.weight.fill_(gain), self.k_norm.weight.fill_(gain)

    result = temperature(Gained, dtype)
    assert result.verdict == verdict, f"{result.message}\n{result.evidence}"
    assert ("normalised" in result.message) is (verdict == "pass"), result.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale, verdict", [(0.9 * COSINE_FLAT, "fail"), (1.1 * COSINE_FLAT, "pass"),
                                            (0.9 * COSINE_SHARP, "pass"), (1.1 * COSINE_SHARP, "fail")])
def test_pin_the_cosine_bounds(scale, verdict, dtype):
    """COSINE_FLAT and COSINE_SHARP, 10% either side, in each dtype (the bound is read in float64 from the observed
    call: bfloat16 moved it by under 1% where measured)."""
    result = temperature(fixed(scale), dtype)
    assert result.verdict == verdict and "normalised" in result.message, f"{result.message}\n{result.evidence}"
    assert result.value == pytest.approx(scale, rel=0.02)
    if verdict == "fail":
        assert ("too flat" if scale < 1 else "too sharp") in result.message


# ---- cause 3: sparsity by design -------------------------------------------------------------------------------


class TopKAttention(nn.Module):
    """Explicit Sparse Transformer (Zhao et al. 2019): each query keeps only its `topk` largest scores, the rest set to
    -inf before the softmax; its own position is dropped whenever it is not among them."""

    def __init__(self, d_model=D, n_heads=H, topk=4):
        super().__init__()
        self.n_heads, self.topk = n_heads, topk
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def scores(self, q, k, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        scores = self.scores(q, k, mask)
        kth = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).values[..., -1:]  # (B, H, Tq, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
        return self.proj(merge(scores.softmax(-1) @ v))


class TopKDiagonalMasked(TopKAttention):
    def scores(self, q, k, mask):
        scores = super().scores(q, k, mask)
        t_q, t_k = scores.shape[-2:]
        own = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(t_k - t_q)  # BUG: diagonal included
        return scores.masked_fill(own, float("-inf"))


def test_top_k_attention_is_not_failed_for_dropping_its_own_position():
    """The top-k form (`top_k`: every row keeps min(k, allowed) weights) makes causal_alignment not applicable, with
    the reason; the same layer with its diagonal masked keeps one key fewer in every row and still fails."""
    report = audit(TopKAttention(), causal=True)
    alignment = report.result("causal_alignment")
    assert alignment.verdict == "skip" and "keeps only the 4 largest weights" in alignment.message, alignment
    assert "causal_alignment" not in report.fired() and report.result("future_leakage").verdict == "pass"
    broken = audit(TopKDiagonalMasked(), causal=True).result("causal_alignment")
    assert broken.verdict == "fail" and "own position" in broken.message, broken


def test_pin_top_k_reads_the_form_of_every_row():
    """`top_k` on (B, H, T, T) causal weights and the keys each query may attend (`causal_room`): each branch just
    inside and just outside."""
    from diagnostics.detectors.causal import causal_room
    from diagnostics.detectors.causal import top_k as top_k_in

    def top_k(w, allowed):
        return top_k_in(w, causal_room(w, allowed))

    T = 6
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def weights(keep):  # keep: (T, T) bool, the kept keys of each query, uniform over them
        w = keep.double()
        return (w / w.sum(-1, keepdim=True).clamp_min(1)).expand(2, 3, T, T)

    last_k = (torch.arange(T)[None, :] > torch.arange(T)[:, None] - 3) & causal  # the 3 newest keys of each query
    assert top_k(weights(last_k), None) == 3  # min(3, allowed) in every row, fewer than allowed in some
    assert top_k(weights(causal), None) is None  # dense: no row keeps fewer than allowed
    off_diagonal = causal & ~torch.eye(T, dtype=torch.bool)
    assert top_k(weights(off_diagonal), None) is None  # one fewer than allowed in every row, none in the first
    uneven = last_k.clone()
    uneven[4, 0] = True  # one row keeps 4 where the others keep 3
    assert top_k(weights(uneven), None) is None
    padded = torch.ones(2, T, T, dtype=torch.bool)
    padded[:, :, 0] = False  # the first key blocked for everyone: the allowed count is the mask's
    keep = last_k & padded[0]
    keep[0, 0] = False
    assert top_k(weights(keep).clone().nan_to_num(0.0), padded) == 3


class TalkingHeads(nn.Module):
    """Talking-heads attention (Shazeer et al. 2020), einsum style: the heads' scaled q·k mixed across heads by a
    learned (H, H) matrix before the softmax, the weights mixed again after it."""

    def __init__(self, d_model=D, n_heads=H, scale=True):
        super().__init__()
        self.n_heads, self.scale = n_heads, scale
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.pre_softmax = nn.Parameter(torch.eye(n_heads) + 0.1 * torch.randn(n_heads, n_heads))
        self.post_softmax = nn.Parameter(torch.eye(n_heads) + 0.1 * torch.randn(n_heads, n_heads))

    def logits(self, dots):
        return torch.einsum("bhij,hk->bkij", dots, self.pre_softmax)  # (B, H, Tq, Tk), heads mixed

    def forward(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        dots = torch.einsum("bhid,bhjd->bhij", q, k)  # (B, H, Tq, Tk)
        if self.scale:
            dots = dots / math.sqrt(q.shape[-1])
        dots = self.logits(dots)
        if mask is not None:
            dots = dots.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("bhij,hk->bkij", dots.softmax(-1), self.post_softmax)
        return self.proj(merge(torch.einsum("bhij,bhjd->bhid", attn, v)))


class TalkingHeadsSquashed(TalkingHeads):
    """Not a linear mix: the mixed logits squashed by tanh, which no factor times the mix reproduces."""

    def logits(self, dots):
        return 3 * torch.tanh(super().logits(dots))


def test_talking_heads_temperature_is_read_through_the_layers_own_mix():
    """Before: no softmax of q·k seen, inconclusive for the correct layer and the unscaled one alike."""
    torch.manual_seed(0)
    report = audit(TalkingHeads(), causal=True)
    result = report.result("softmax_saturation")
    assert result.verdict == "pass" and "talking heads" in result.evidence, result
    assert report.status == "passed" and result.value == pytest.approx(1.0, abs=1e-3)
    torch.manual_seed(0)
    unscaled = audit(TalkingHeads(scale=False), causal=True).result("softmax_saturation")
    assert unscaled.verdict == "fail" and "2.83x too sharp" in unscaled.message, unscaled


def test_pin_the_talking_heads_fit_reads_only_a_linear_mix():
    """`_fit_mixed_heads` just outside: the mix squashed by tanh fits no factor times the matrix, so the temperature is
    not measured (the skip of old), never read from a fit that does not hold."""
    torch.manual_seed(0)
    result = audit(TalkingHeadsSquashed(), causal=True, detectors=["softmax_saturation"]).result("softmax_saturation")
    assert result.verdict == "skip", result


# ---- noticed along the way ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", [1.0, 0.125])
def test_the_weights_of_a_fused_call_are_recomputed_with_the_kernels_own_scale(pre):
    """`fused_weights` recomputes softmax(q k^T * scale) from the q and k the kernel was given: a constant q was
    multiplied by before the call is in q already (it was counted twice: 0.13 off at pre = 0.125)."""
    from diagnostics._observe import Observer, fused_weights

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with torch.enable_grad(), Observer() as observer:
        F.scaled_dot_product_attention(q * pre, k, v, scale=1.0)
    true = ((q * pre) @ k.transpose(-2, -1)).double().softmax(-1)  # (1, 2, 5, 5)
    assert torch.allclose(fused_weights(observer.record.fused[0]), true, atol=1e-6)


# ---- cause 8: a length the layer states it refuses is no defect ---------------------------------------------
class BlockwiseAttention(nn.Module):
    """Causal attention computed in blocks of W tokens (block-sparse kernels, bucketed local attention), so it takes
    lengths that are multiples of W and says so with its own check, as local-attention does."""

    def __init__(self, d_model: int = D, heads: int = H, window: int = 4):
        super().__init__()
        self.d_model, self.heads, self.window = d_model, heads, window
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def check(self, T: int) -> None:
        assert T % self.window == 0, f"sequence length {T} must be divisible by window size {self.window}"

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        self.check(T)
        q, k, v = (split(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))  # 3 x (B, H, T, d)
        return self.out(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class BlockwiseReshaped(BlockwiseAttention):
    """Its twin that states nothing: the blocks are a reshape that fails at other lengths with torch's message (as
    sinkhorn-transformer's LocalAttention does, whose library pads the input first)."""

    def check(self, T: int) -> None:
        torch.zeros(T).view(T // self.window, self.window)  # (T / W, W): raises unless W divides T


class SqueezedAtOne(BlockwiseAttention):
    """A real bug that raises at one length only: `squeeze()` takes the token axis too when T = 1."""

    def check(self, T: int) -> None:
        x = torch.zeros(2, T, 3).squeeze()  # (2, T, 3), and (2, 3) at T = 1
        torch.cat([x, torch.zeros(2, T, 3)], dim=-1)  # RuntimeError at T = 1: not as many dimensions


class HardCodedLength(BlockwiseAttention):
    """A length hard-coded in a reshape: it runs at the audit's 16 tokens and at no other length."""

    def check(self, T: int) -> None:
        torch.zeros(T).view(4, 4)


class NameErrorOffBlocks(BlockwiseAttention):
    """local-attention 1.5.2's fault: at a length no multiple of its window, the padding branch reads a name it never
    set (a NameError, a fault of the code at those lengths, not a rule)."""

    def check(self, T: int) -> None:
        if T % self.window:
            return padded  # noqa: F821 -- the fault itself


def test_a_length_the_layer_refuses_by_its_rule_is_skipped_not_failed():
    """local-attention 1.0.2 (benchmarks/pypi_bugs.py, local_rel_pos_unset's fixed release) asserts that T is a
    multiple of its window: `runs` failed it for the T = 1 probes. The stated rule makes those probes a skip that
    names it; the twin that refuses the same lengths by a failing reshape, stating nothing (sinkhorn_local_unscaled's
    fixed release), is measured: it runs at every multiple of 4 up to 2T and raises at others, a skip that says so."""
    torch.manual_seed(0)
    stated = audit(BlockwiseAttention(), causal=True)
    runs = stated.result("runs")
    assert runs.verdict == "skip" and "multiples of 4 only" in runs.message and "refused only T = 1" in runs.message
    assert stated.status == "passed", str(stated)
    torch.manual_seed(0)
    unstated = audit(BlockwiseReshaped(), causal=True)
    runs = unstated.result("runs")
    assert runs.verdict == "skip" and "multiples of 4 only, as measured" in runs.message, runs
    assert "T = 4, 8, 16, 20, 32) and raised at T = 1, 17, 18, 19, in line" in runs.message, runs
    assert "refused only T = 1 " in runs.message, runs
    assert unstated.status == "passed", str(unstated)


class SpectralMixOddLengths(BlockwiseAttention):
    """A real bug at odd lengths: a spectral mix whose inverse FFT is not told the length (`irfft(rfft(x))` without
    n = T gives T - 1 values back at odd T), raising a broadcast mismatch there and nothing else at even T."""

    def check(self, T: int) -> None:
        x = torch.zeros(1, T, 2)
        x + torch.fft.irfft(torch.fft.rfft(x, dim=1), dim=1)


class KeysSplitByQueries(nn.Module):
    """Cross-attention in blocks of 4 whose keys are split by the query length (`Tq // 4` where `Tk // 4` is meant):
    it runs wherever Tq = Tk is a multiple of 4 and at no Tq != Tk, multiples or not."""

    def __init__(self, d_model: int = D, heads: int = H):
        super().__init__()
        self.d_model, self.heads = d_model, heads
        self.q, self.out = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)

    def forward(self, x, memory):
        Tq = x.shape[1]
        memory.reshape(memory.shape[0], Tq // 4, 4, -1, memory.shape[-1]).flatten(1, 3)  # BUG: Tq for Tk
        q = split(self.q(x), self.heads)
        k, v = (split(t, self.heads) for t in self.kv(memory).chunk(2, dim=-1))
        return self.out(merge(F.scaled_dot_product_attention(q, k, v)))


class BlocksOnTwoLines(KeysSplitByQueries):
    """Its correct twin: queries and keys each split into blocks of 4 by their own length, on lines of their own, so a
    length of the queries and one of the keys are refused in two lines."""

    def forward(self, x, memory):
        x.reshape(x.shape[0], x.shape[1] // 4, 4, x.shape[-1])  # the queries in blocks of 4
        memory.reshape(memory.shape[0], memory.shape[1] // 4, 4, memory.shape[-1])  # the keys in blocks of 4
        q = split(self.q(x), self.heads)
        k, v = (split(t, self.heads) for t in self.kv(memory).chunk(2, dim=-1))
        return self.out(merge(F.scaled_dot_product_attention(q, k, v)))


def test_a_cross_attention_splitting_queries_and_keys_on_lines_of_their_own_has_its_rule_measured():
    """The refusals of the keys' length alone come from the keys' line, those of both lengths from the queries': one
    line for each kind of call, and the audit's Tk = T + 3 probe is skipped with T = 1, not failed."""
    torch.manual_seed(0)
    found = audit(BlocksOnTwoLines(), cross=True)
    runs = found.result("runs")
    assert runs.verdict == "skip" and "multiples of 4 only, as measured" in runs.message, runs
    assert found.status == "passed", str(found)


@pytest.mark.parametrize("layer, expected", [(BlockwiseReshaped, "skip"), (lambda: SqueezedAtOne(), "fail")],
                         ids=["blocks of 4", "squeeze at T = 1"])
def test_the_measured_rule_holds_in_bfloat16_at_std_002(layer, expected):
    """At the scales people train at (bfloat16, std-0.02 initialisation): the blocks' rule is measured the same, and
    the squeeze at T = 1 still fails."""
    torch.manual_seed(0)
    found = audit(gpt2_init_(layer()).to(torch.bfloat16), causal=True)
    runs = found.result("runs")
    assert runs.verdict == expected, str(found)
    if expected == "skip":
        assert "multiples of 4 only, as measured" in runs.message and found.status == "passed", str(found)


@pytest.mark.parametrize("layer, kw", [(SqueezedAtOne, {"causal": True}), (HardCodedLength, {"causal": True}),
                                       (NameErrorOffBlocks, {"causal": True}),
                                       (SpectralMixOddLengths, {"causal": True}), (KeysSplitByQueries, {"cross": True})],
                         ids=["squeeze at T = 1", "a hard-coded length", "a NameError", "a broadcast mismatch",
                              "cross-attention's keys split by Tq"])
def test_a_raise_no_length_rule_explains_still_fails(layer, kw):
    """Twins of the measured rule on the same audit: a layer raising at T = 1 alone runs at T + 1 (no W holds), a
    hard-coded length refuses T + W, a NameError and a broadcast mismatch are no split of the length, and a
    cross-attention that runs only at Tq = Tk refuses Tq = T, Tk = T + W: `runs` fails each."""
    torch.manual_seed(0)
    found = audit(layer(), **kw)
    assert found.result("runs").verdict == "fail" and found.status == "failed", str(found)


# ---- cause 9: the line that left a value unmade, before the line that read it ------------------------------
class OptionalBias(nn.Module):
    """A layer with an optional learned bias on the scores, set in __init__ only when asked for (local-attention
    1.0.1's `self.rel_pos`, benchmarks/pypi_bugs.py local_rel_pos_unset) and read on every call."""

    def __init__(self, d_model: int = D, heads: int = H, bias: bool = False):
        super().__init__()
        self.d_model, self.heads = d_model, heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        if bias:
            self.score_bias = nn.Parameter(torch.zeros(heads, 1, 1))

    def forward(self, x):
        q, k, v = (split(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))  # 3 x (B, H, T, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        if self.score_bias is not None:
            scores = scores + self.score_bias
        return self.out(merge(scores.softmax(dim=-1) @ v))


class MisspeltBias(OptionalBias):
    """Its twin whose attribute is set on every path, and read under another (misspelt) name."""

    def __init__(self, d_model: int = D, heads: int = H):
        super().__init__(d_model, heads, bias=False)
        self.score_bias = None

    def forward(self, x):
        if self.score_bais is not None:
            return x
        return super().forward(x)


def test_an_attribute_set_only_under_a_condition_is_located_at_that_condition():
    """`runs` points first at the `if` in __init__ under which alone the attribute is assigned (the fix goes just
    before it), then at the line that read it; an attribute assigned on every path but read misspelt has no such
    line, and the finding points at the read only."""
    torch.manual_seed(0)
    report = audit(OptionalBias())
    runs = report.result("runs")
    first, second = runs.where[0], runs.where[1]
    assert first.function == "OptionalBias.__init__" and first.code == "if bias:", first
    assert "self.score_bias is assigned only under this condition" in first.note
    assert second.function == "OptionalBias.forward" and "self.score_bias" in second.code
    assert first.fix.startswith("set self.score_bias (to None, or its default) before this condition")
    assert "fix:      set self.score_bias (to None, or its default) before this condition" in str(report)
    torch.manual_seed(0)
    misspelt = audit(MisspeltBias()).result("runs")
    assert misspelt.verdict == "fail" and [s.function for s in misspelt.where] == ["MisspeltBias.forward"]


# ---- cause 3: bucketed local attention, whose weights are (windows, W, look-around) ------------------------
class BucketedLocalAttention(nn.Module):
    """Causal local attention over buckets of W tokens, each query seeing its own bucket and the one before it, W
    keys back at most (local-attention's LocalAttention, `forward(q, k, v)` on (B, T, d)): its softmax is over
    (B, windows, W, 2W) scores, so no (Tq, Tk) weights are ever formed. `project`: an output projection after the
    weighted sum."""

    def __init__(self, window: int = 4, project: bool = False):
        super().__init__()
        self.window = window
        self.out = nn.Linear(16, 16) if project else nn.Identity()

    def look_back(self, t):
        """(B, n, W, ...) buckets -> (B, n, 2W, ...): the previous bucket (padding before the first), then this one."""
        pad = F.pad(t, (0, 0) * (t.dim() - 2) + (1, 0), value=-1.0)  # (B, n + 1, W, ...)
        return torch.cat([pad[:, :-1], pad[:, 1:]], dim=2)

    def blocked(self, pos, kpos):
        """(1, n, W, 2W): True where a query may not attend a key: the future, and keys more than W back."""
        future = kpos[:, :, None, :] > pos[..., None]
        too_far = kpos[:, :, None, :] < pos[..., None] - self.window
        return future | too_far

    def weights(self, dots, blocked):
        return dots.masked_fill(blocked, float("-inf")).softmax(dim=-1)

    def forward(self, q, k, v):
        B, T, d = q.shape  # batch, sequence length, width
        W = self.window
        assert T % W == 0, f"sequence length {T} must be divisible by window size {W}"
        n = T // W  # buckets
        bq, bk, bv = (t.reshape(B, n, W, d) for t in (q, k, v))  # (B, n, W, d)
        bk, bv = self.look_back(bk), self.look_back(bv)  # (B, n, 2W, d)
        pos = torch.arange(T, dtype=q.dtype).reshape(1, n, W)  # each query's position
        kpos = self.look_back(pos.unsqueeze(-1)).squeeze(-1)  # (1, n, 2W): each looked-at key's (-1: padding)
        dots = torch.einsum("bnid,bnjd->bnij", bq, bk) / math.sqrt(d)  # (B, n, W, 2W)
        dots = dots.masked_fill(kpos[:, :, None, :] < 0, float("-inf"))  # the padding before the first bucket
        out = torch.einsum("bnij,bnjd->bnid", self.weights(dots, self.blocked(pos, kpos)), bv)  # (B, n, W, d)
        return self.out(out.reshape(B, T, d))


class BucketedMaskAfterSoftmax(BucketedLocalAttention):
    """Its twin that blocks the future after the softmax: the rows no longer sum to 1."""

    def weights(self, dots, blocked):
        return dots.softmax(dim=-1).masked_fill(blocked, 0.0)


def test_bucketed_local_attention_weights_are_read_through_the_values():
    """local-attention 1.2.2 and 1.0.2 (benchmarks/pypi_bugs.py's fixed releases) were inconclusive: their weights,
    (windows, W, look-around), were never measured. Read one key at a time through the values (the output is
    linear in them), the correct layer's rows sum to 1 and it passes; its twin, masking after the softmax, fails
    weight_row_sums on the same inputs. Both were inconclusive (weight_row_sums not measured) before."""
    torch.manual_seed(0)
    correct = audit(BucketedLocalAttention(), causal=True, d_model=16)
    sums = correct.result("weight_row_sums")
    assert sums.verdict == "pass" and "one key at a time" in sums.message, sums
    assert correct.status == "passed", str(correct)
    torch.manual_seed(0)
    buggy = audit(BucketedMaskAfterSoftmax(), causal=True, d_model=16)
    assert buggy.result("weight_row_sums").verdict == "fail" and buggy.status == "failed", str(buggy)


def test_pin_weights_are_not_read_through_values_a_projection_follows():
    """The reading is taken only where the standard output is the read weights applied to the standard values: an
    output projection after the weighted sum breaks that, and the weights are not read through the values (never a
    fail). They are read by tagging the tokens instead (diagnostics/_layout.py: the buckets' rows and keys matched to
    their tokens), and pass."""
    torch.manual_seed(0)
    sums = audit(BucketedLocalAttention(project=True), causal=True, d_model=16).result("weight_row_sums")
    assert "one key at a time" not in sums.message, sums
    assert sums.verdict == "pass" and "tagging the tokens" in sums.message, sums


# ---- cause 9: the line that made a parameter an op raised on, before the op ----------------------------------
class MemoryKeys(nn.Module):
    """Grouped-query attention with learned memory key/values prepended to every sequence's (x-transformers'
    num_mem_kv with kv_heads): the memory is made in __init__ with one head per key/value head."""

    def __init__(self, d_model: int = D, heads: int = H, kv_heads: int = 2, memory: int = 2):
        super().__init__()
        self.heads, self.kv_heads, d = heads, kv_heads, d_model // heads
        self.q, self.kv = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * kv_heads * d)
        self.out = nn.Linear(d_model, d_model)
        self.mem_k = nn.Parameter(torch.randn(self.memory_heads(), memory, d))
        self.mem_v = nn.Parameter(torch.randn(kv_heads, memory, d))

    def memory_heads(self) -> int:
        return self.kv_heads

    def forward(self, x):
        B = x.shape[0]
        q = split(self.q(x), self.heads)  # (B, H, T, d)
        k, v = (split(t, self.kv_heads) for t in self.kv(x).chunk(2, dim=-1))  # (B, G, T, d) each
        k = torch.cat((self.mem_k.expand(B, -1, -1, -1), k), dim=-2)  # (B, G, M + T, d)
        v = torch.cat((self.mem_v.expand(B, -1, -1, -1), v), dim=-2)
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))  # (B, H, M + T, d)
        return self.out(merge(F.scaled_dot_product_attention(q, k, v)))


class MemoryKeysPerQueryHead(MemoryKeys):
    """Its twin that makes the memory keys with one head per query head (x-transformers 1.27.7's bug)."""

    def memory_heads(self) -> int:
        return self.heads


def test_a_parameter_made_in_init_that_an_op_raised_on_is_located_where_it_is_made():
    """`runs` points first at the line of __init__ that made the parameter the raising op was given (computed from it
    alone, beside the call's keys), then at the op: x-transformers 1.27.7 (pypi_bugs xtr_mem_kv_grouped_heads) raised
    in torch.cat at line 900 and was fixed where mem_k is made (791); before, only the cat was shown. The correct twin,
    with one memory head per key/value head, passes on the same inputs."""
    torch.manual_seed(0)
    correct = audit(MemoryKeys())
    assert correct.result("runs").verdict == "pass" and correct.status == "passed", str(correct)
    torch.manual_seed(0)
    runs = audit(MemoryKeysPerQueryHead()).result("runs")
    assert runs.verdict == "fail", runs
    made, raised = runs.where[0], runs.where[1]
    assert made.function == "MemoryKeys.__init__" and made.code.startswith("self.mem_k = nn.Parameter("), made
    assert "self.mem_k, of shape (4, 2, 8)" in made.note and made.fix.startswith("make self.mem_k with the sizes")
    assert raised.function == "MemoryKeys.forward" and raised.code.startswith("k = torch.cat(")


class BucketedWindowAnd(BucketedLocalAttention):
    """Its twin that combines the two conditions with & (local-attention 1.2.1's exact window): the mask blocks
    nothing, and the future is attended."""

    def blocked(self, pos, kpos):
        future = kpos[:, :, None, :] > pos[..., None]
        too_far = kpos[:, :, None, :] < pos[..., None] - self.window
        return future & too_far


def test_a_mask_on_bucketed_scores_that_blocks_nothing_is_located_where_it_is_built():
    """The scores of bucketed local attention are (B, windows, W, look-around), so their masking ops are not read as
    (query, key) pairs and future_leakage pointed at the softmax ("no masking op reaches it": pypi_bugs
    local_exact_window_and, fixed at line 150, shown at 171). A mask there that blocks nothing at all is now shown
    first at the line that built it (the `&`), then where it is applied; the correct twin passes on the same inputs."""
    torch.manual_seed(0)
    correct = audit(BucketedLocalAttention(), causal=True, d_model=16)
    assert correct.status == "passed", str(correct)
    torch.manual_seed(0)
    leak = audit(BucketedWindowAnd(), causal=True, d_model=16).result("future_leakage")
    assert leak.verdict == "fail", leak
    built, applied = leak.where[0], leak.where[1]
    assert built.function == "BucketedWindowAnd.blocked" and built.code == "return future & too_far", built
    assert "builds a mask that blocks nothing" in built.note and "combine them with |" in built.fix
    assert applied.code.startswith("return dots.masked_fill(blocked"), applied


# ---- cause 3: linear attention, whose weights are never formed --------------------------------------------
class CausalLinearAttention(nn.Module):
    """Causal linear attention ("Transformers are RNNs"): features elu(x) + 1 of q and k, running sums of k v^T and
    of k, out_i = phi(q_i) . S_i / phi(q_i) . z_i. No (Tq, Tk) weights and no softmax: its weights,
    phi(q_i) . phi(k_j) / sum_j' phi(q_i) . phi(k_j'), are a kernel's."""

    def __init__(self, d_model: int = D, n_heads: int = H):
        super().__init__()
        self.n_heads = n_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.to_out = nn.Linear(d_model, d_model)

    def normalise(self, numerator, denominator):
        return numerator / denominator.unsqueeze(-1)

    def forward(self, x):
        q, k, v = (split(f(x), self.n_heads) for f in (self.to_q, self.to_k, self.to_v))  # (B, H, T, d) each
        q, k = F.elu(q) + 1, F.elu(k) + 1  # positive features
        S = torch.einsum("bhtd,bhte->bhtde", k, v).cumsum(2)  # (B, H, T, d, d): sum over j <= t of k_j v_j^T
        z = k.cumsum(2)  # (B, H, T, d): sum over j <= t of k_j
        numerator = torch.einsum("bhtd,bhtde->bhte", q, S)  # (B, H, T, d)
        denominator = torch.einsum("bhtd,bhtd->bht", q, z)  # (B, H, T)
        return self.to_out(merge(self.normalise(numerator, denominator)))


class CausalLinearTimesNormaliser(CausalLinearAttention):
    """Its twin that multiplies by the normaliser (linear-attention-transformer 0.17.1's bug)."""

    def normalise(self, numerator, denominator):
        return numerator * denominator.unsqueeze(-1)


class HandWrittenSoftmax(CausalLinearAttention):
    """A softmax written by hand (exp / sum) over unscaled scores: no softmax op, a temperature to judge; its weights
    are read through its value projection as a linear attention's are."""

    def forward(self, x):
        q, k, v = (split(f(x), self.n_heads) for f in (self.to_q, self.to_k, self.to_v))  # (B, H, T, d) each
        T = x.shape[1]
        scores = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1e9)
        e = torch.exp(scores - scores.amax(-1, keepdim=True))  # (B, H, T, T)
        return self.to_out(merge(e / e.sum(-1, keepdim=True) @ v))


def test_linear_attention_weights_are_read_through_its_value_projection():
    """linear-attention-transformer 0.17.2 (pypi_bugs lat_causal_d_inv's fixed release) was inconclusive: no weights,
    no softmax. Its value projection's output replaced one key at a time (the output projection's input read), the
    correct layer's weights sum to 1 and it passes, the temperature not applicable (a kernel has none); its twin,
    which multiplies by the normaliser, fails weight_row_sums on the same inputs. Both were inconclusive before."""
    torch.manual_seed(0)
    correct = audit(CausalLinearAttention(), causal=True)
    sums, temperature = correct.result("weight_row_sums"), correct.result("softmax_saturation")
    assert sums.verdict == "pass" and "the output of to_v, one key at a time" in sums.message, sums
    assert temperature.verdict == "skip" and "not applicable" in temperature.message, temperature
    assert correct.status == "passed", str(correct)
    torch.manual_seed(0)
    buggy = audit(CausalLinearTimesNormaliser(), causal=True)
    assert buggy.result("weight_row_sums").verdict == "fail" and buggy.status == "failed", str(buggy)


def test_pin_a_softmax_written_by_hand_keeps_its_temperature_to_judge():
    """The temperature is not applicable only where no exponential ran on (Tq, Tk) scores: a softmax written by hand
    (exp / sum) over unscaled scores is not excused as a kernel (its weights, read, sum to 1), so the audit stays
    inconclusive, never passed."""
    torch.manual_seed(0)
    report = audit(HandWrittenSoftmax(), causal=True)
    assert report.result("weight_row_sums").verdict == "pass", report.result("weight_row_sums")
    assert report.result("softmax_saturation").message.startswith("not measured"), report.result("softmax_saturation")
    assert report.status != "passed", str(report)


class CachedAlibi(nn.Module):
    """Causal attention with an ALiBi bias built on the first call from per-head slopes and cached in a buffer that
    __init__ sets to None (x-transformers 0.27's AlibiPositionalBias): the bias is made in forward."""

    def __init__(self, d_model: int = D, heads: int = H):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, heads + 1).view(heads, 1, 1), persistent=False)
        self.register_buffer("bias", None, persistent=False)

    def padding(self, bias) -> int:
        return self.heads - bias.shape[0]  # heads left without a bias (none here)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        if self.bias is None or self.bias.shape[-1] < T:
            bias = torch.arange(T) * self.slopes  # (H, 1, T): the slope times the key's position
            bias = F.pad(bias, (0, 0, 0, 0, 0, self.padding(bias)))
            self.register_buffer("bias", bias, persistent=False)
        q, k, v = (split(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))  # (B, H, T, d) each
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.bias[..., :T]).masked_fill(~causal, -1e9)
        return self.out(merge(scores.softmax(-1) @ v))


class CachedAlibiWrongAxis(CachedAlibi):
    """Its twin that counts the heads from the wrong axis (x-transformers 0.27.0's `bias.shape[1]`)."""

    def padding(self, bias) -> int:
        return self.heads - bias.shape[1]


def test_a_tensor_computed_from_the_layers_state_that_an_op_raised_on_is_located_where_computed():
    """The bias the raising add was given was computed in the call from the layer's slopes alone and cached in a
    buffer that __init__ sets to None: `runs` points first where it was computed (the pad, the line before the
    cache), not at __init__'s `register_buffer("bias", None)`. x-transformers 0.27.0 (pypi_bugs
    xtr_alibi_unalibied_heads): the pad at 273, one line from the fix; it was __init__'s line 248 before."""
    torch.manual_seed(0)
    assert audit(CachedAlibi(), causal=True).status == "passed"
    torch.manual_seed(0)
    runs = audit(CachedAlibiWrongAxis(), causal=True).result("runs")
    assert runs.verdict == "fail" and runs.where[0].code.startswith("bias = F.pad(bias"), runs.where


class DynamicConvBeside(nn.Module):
    """Attention beside a dynamic convolution whose kernel taps are a softmax over a projection's output (ConvBERT's
    span-based convolution, transformers 5.25: `torch.softmax(self.conv_kernel_layer(x).reshape(-1, kernel, 1),
    dim=1)`); that softmax has no 1/sqrt(d_k) and was read as unscaled q·k ("4.00x too sharp" on the correct model).
    `scaled`: False, the attention's own 1/sqrt(d_k) missing, the bug that must still fail."""

    def __init__(self, scaled: bool = True, kernel: int = 3):
        super().__init__()
        self.num_heads, self.scaled, self.kernel = H, scaled, kernel
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.key_conv = nn.Conv1d(D, D, 1)  # ConvBERT's span-based keys (a depthwise-separable convolution there)
        self.conv_kernel_layer = nn.Linear(D, H * kernel)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (split(t, H) for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) * (D_K ** -0.5 if self.scaled else 1.0)  # (B, H, T, T)
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        # the keys' span convolution, channels first, times the tokens: (B, T, D) laid out (B, D, T) in memory, whose
        # projection runs as a plain matrix product (aten.mm), as ConvBERT's does
        conv_in = torch.multiply(self.key_conv(x.transpose(1, 2)).transpose(1, 2), x)  # (B, T, D)
        taps = self.conv_kernel_layer(conv_in).reshape(-1, self.kernel, 1)  # (B x T x H, kernel, 1), as ConvBERT
        taps = torch.softmax(taps, dim=1).view(B, T, H, self.kernel)  # (B, T, H, kernel)
        # each head's kernel applied to the values of its own token's neighbourhood, per channel
        padded = F.pad(split(v.transpose(1, 2).reshape(B, T, D), 1).transpose(1, 2).reshape(B, T, D),
                       (0, 0, self.kernel // 2, self.kernel // 2))  # (B, T + kernel - 1, D)
        windows = padded.unfold(1, self.kernel, 1).view(B, T, H, D_K, self.kernel)  # (B, T, H, d, kernel)
        conv = (windows * taps.unsqueeze(3)).sum(-1).reshape(B, T, D)  # (B, T, D)
        return self.out(attended + conv)


def test_a_softmax_over_a_projection_beside_attention_has_no_temperature_to_judge():
    torch.manual_seed(0)
    right = audit(DynamicConvBeside(), detectors=["softmax_saturation"]).result("softmax_saturation")
    torch.manual_seed(0)
    wrong = audit(DynamicConvBeside(scaled=False), detectors=["softmax_saturation"]).result("softmax_saturation")
    assert right.verdict == "pass", right.evidence  # failed before: the taps' softmax read as q·k multiplied by 1
    assert wrong.verdict == "fail" and "too sharp" in wrong.message, wrong.evidence
