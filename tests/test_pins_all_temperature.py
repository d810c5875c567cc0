"""Pins for the survivors of the full mutation run (`benchmarks/mutations.py --all --only detectors/temperature.py`,
issue 37) in `softmax_saturation`: the weights fit of a function's returned weights, what counts as an exponential of
q·k scores (a temperature to judge) against a kernel's feature map (none), where a factor the layer states excuses
its temperature, which reading is reported, and the normalised-q-and-k rules. Small layers written here; each case
has its twin on the same inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diagnostics import audit
from diagnostics.detectors.temperature import _log_weight_scale

D, H = 32, 4  # d_model, heads
D_K = D // H


def split(t):
    B, T, C = t.shape  # batch, sequence length, d_model
    return t.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, d)


def merge(t):
    B, h, T, d = t.shape  # batch, heads, sequence length, head width
    return t.transpose(1, 2).reshape(B, T, h * d)  # (B, T, D)


def saturation(layer, **kw):
    torch.manual_seed(0)
    return audit(layer, detectors=["softmax_saturation"], **kw).result("softmax_saturation")


# ---- _log_weight_scale: the fit of log w against q·k -------------------------------------------------------------


def test_the_weights_fit_needs_four_weights_and_keys_that_differ():
    """Four positive weights (one query row of two keys, two rows) are fitted: the slope is the scale, 0.5 here; three
    are not (`ok.sum() < 4`: `<= 4` would refuse four). Keys all equal make q·k constant along each row, so nothing
    is fitted and nothing is divided by zero (`denom > 0`: `>= 0` divides by it)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 2, 4, dtype=torch.float64), torch.randn(1, 1, 2, 4, dtype=torch.float64)
    w = torch.softmax(0.5 * q @ k.transpose(-2, -1), -1)
    [(slope, d_k)] = _log_weight_scale(w, q, k)
    assert slope == pytest.approx(0.5) and d_k == 4
    three = w.clone()
    three[0, 0, 1, 1] = 0  # its log is -inf: dropped
    assert _log_weight_scale(three, q, k) == []
    same = k[:, :, :1].expand(1, 1, 2, 4)
    assert _log_weight_scale(torch.softmax(0.5 * q @ same.transpose(-2, -1), -1), q, same) == []


# ---- _exponents_over: a kernel's feature map has no temperature, a softmax written by hand has one ---------------


class PerformerAttention(nn.Module):
    """FAVOR+ positive random features (Performer): phi(x) = exp(x W^T - |x|^2 / 2), W a buffer of random features;
    the attention is phi(q) (phi(k)^T v) over phi(q) . sum phi(k): a kernel, no softmax, no temperature. The exponent
    is over a product of q with a buffer, and a difference of two tensors made from q alone: not q·k."""

    def __init__(self, features: int = 16):
        super().__init__()
        self.n_heads = H
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D) for _ in range(3))
        self.to_out = nn.Linear(D, D)
        self.register_buffer("features", torch.randn(features, D_K))

    def phi(self, x):
        x = x * x.shape[-1] ** -0.25
        return torch.exp(x @ self.features.T - (x * x).sum(-1, keepdim=True) / 2)  # (B, H, T, m)

    def forward(self, x):
        q, k, v = (split(f(x)) for f in (self.to_q, self.to_k, self.to_v))  # (B, H, T, d) each
        q, k = self.phi(q), self.phi(k)
        kv = torch.einsum("bhtm,bhte->bhme", k, v)
        z = 1 / torch.einsum("bhtm,bhm->bht", q, k.sum(2))
        return self.to_out(merge(torch.einsum("bhtm,bhme,bht->bhte", q, kv, z)))


class HandWrittenBaddbmm(PerformerAttention):
    """A softmax written by hand (exp / sum) over scores made by baddbmm(bias, q, k^T), its bias q's own relative
    logits (made from q: three operands, the first two from the inputs): an exponential of q·k, a temperature to
    judge, which nothing here fits (no softmax op, no fused call)."""

    def __init__(self):
        super().__init__()
        self.relative = nn.Parameter(0.1 * torch.randn(D_K, 1))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (split(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        q3, k3 = q.reshape(B * H, T, D_K), k.reshape(B * H, T, D_K)
        scores = torch.baddbmm((q3 @ self.relative).expand(B * H, T, T), q3, k3.transpose(1, 2), alpha=D_K ** -0.5)
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        return self.to_out(merge((e / e.sum(-1, keepdim=True)).view(B, H, T, T) @ v))


def test_a_kernels_exponential_has_no_temperature_and_a_softmax_written_by_hand_has_one():
    """Only an exponential over a product of two tensors both made from the inputs (q·k) keeps a temperature to
    judge: the Performer's exp over q times a buffer, less q * q summed (one tensor twice: `len({...}) >= 2` counts
    distinct tensors), is a kernel's feature map, no softmax normalising it (not applicable). Its twin, a softmax
    written by hand over baddbmm(bias, q, k^T) (three operands, two made from the inputs), is not excused: not
    measured, the audit not passed."""
    kernel = saturation(PerformerAttention())
    assert kernel.verdict == "skip" and kernel.message.startswith("not applicable"), kernel.message
    assert "weights read through the values, the output of to_v" in kernel.message
    hand = saturation(HandWrittenBaddbmm())
    assert hand.verdict == "skip" and hand.message.startswith("not measured"), hand.message


class Gated:
    """Mixed into a layer: its tokens times a learned scale held as its log, exp(log_scale), before its projections
    (a temperature kept positive that way): an exponential over a parameter, no product of two inputs, beside the
    layer's own."""

    def gated(self, x):
        if not hasattr(self, "log_scale"):
            self.log_scale = nn.Parameter(torch.full((D,), -0.1))
        return x * torch.exp(self.log_scale)


class GatedHandWritten(Gated, HandWrittenBaddbmm):
    def forward(self, x):
        return super().forward(self.gated(x))


class GatedPerformer(Gated, PerformerAttention):
    def forward(self, x):
        return super().forward(self.gated(x))


def test_one_exponential_of_q_k_among_others_keeps_the_temperature_to_judge():
    """`_exponents_over`'s outer `any` (L153 at 3057bfd, made `all`: every exponential would have to be over q·k): a
    softmax written by hand over q·k beside a decay gate's exp over a projection is still a temperature, not
    measured (never excused); its twin, the Performer's kernel beside the same gate, is not applicable."""
    hand, kernel = saturation(GatedHandWritten()), saturation(GatedPerformer())
    assert hand.verdict == "skip" and hand.message.startswith("not measured"), hand.message
    assert kernel.verdict == "skip" and kernel.message.startswith("not applicable"), kernel.message
    assert "a kernel's (linear attention)" in kernel.message, kernel.message


class SoftmaxFeatures(PerformerAttention):
    """Efficient attention (Shen et al.): q normalised by a softmax over its features, k by one over the tokens, then
    the kernel q (k^T v): softmaxes over projections, the weights a kernel made of them."""

    def forward(self, x):
        q, k, v = (split(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        q, k = q.softmax(-1), k.softmax(-2)
        return self.to_out(merge(q @ (k.transpose(-2, -1) @ v)))


class GatedSoftmaxFeatures(Gated, SoftmaxFeatures):
    def forward(self, x):
        return super().forward(self.gated(x))


@pytest.mark.parametrize("make", [SoftmaxFeatures, GatedSoftmaxFeatures], ids=["alone", "beside a gate's exp"])
def test_softmaxes_over_projections_are_said_as_such_beside_any_other_exponential(make):
    """`_exponents_over`'s last `any` (L155 at 3057bfd, made `all`: every exponential would have to normalise): the
    softmax feature maps of efficient attention are "projections", said as softmaxes normalising a projection of the
    tokens, alone and beside a decay gate's exp; the Performer's exp alone is a kernel's feature map (the test above)."""
    found = saturation(make())
    assert found.verdict == "skip" and "softmax normalises a projection of the tokens" in found.message, found


# ---- a factor the layer states excuses its temperature only beside a declared scale ------------------------------


class GainOnQ(nn.Module):
    """Unnormalised q multiplied by a gain the layer states (`q_scale`, sqrt(2)), then SDPA given 1/sqrt(d_k)."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.scaling, self.q_scale = H, D_K ** -0.5, 2.0 ** 0.5
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(F.scaled_dot_product_attention(q * self.q_scale, k, v, scale=self.scaling)))


def test_a_stated_gain_counts_only_beside_a_declared_scale():
    """Audited with its scale declared, the gain the layer states beside it is its own temperature: it passes. With
    none declared, 1/sqrt(d_k) is the rule and the gain makes it 1.41x too sharp (`probe.scale is not None and ...`:
    either `or` would look the gain up without a declared scale and pass it)."""
    torch.manual_seed(0)
    layer = GainOnQ()
    declared = saturation(layer, scale=layer.scaling)
    assert declared.verdict == "pass" and "GainOnQ.q_scale" in declared.message, declared.message
    plain = saturation(layer)
    assert plain.verdict == "fail" and "1.41x too sharp" in plain.message, plain.message


# ---- the reading reported: the worst, and a temperature of 0 ------------------------------------------------------


class Chained(nn.Module):
    """One softmax of q·k per factor in `factors`, each times 1/sqrt(d_k) (the second over the first's output)."""

    def __init__(self, factors):
        super().__init__()
        self.n_heads, self.factors = H, factors
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        for f in self.factors:
            v = (q @ k.transpose(-2, -1) * (f / math.sqrt(D_K))).softmax(-1) @ v
        return self.proj(merge(v))


@pytest.mark.parametrize("factors", [(1.0, 1.2), (1.2, 1.0)], ids=["worst second", "worst first"])
def test_the_reading_furthest_from_the_rule_is_the_one_reported(factors):
    """Two softmaxes, both inside SCALE_RATIO: the pass reports the ratio furthest from 1 (1.2), whichever comes
    first (the key's `abs(ratio) or 1e-300`: `and` would tie every reading inside and report the first)."""
    result = saturation(Chained(factors))
    assert result.verdict == "pass" and result.value == pytest.approx(1.2, rel=1e-5), (result.value, result.message)


@pytest.mark.parametrize("factor, verdict", [(0.0, "fail"), (1.0, "pass")], ids=["temperature 0", "1/sqrt(d_k)"])
def test_a_temperature_of_zero_is_too_flat_not_a_crash(factor, verdict):
    """q·k multiplied by 0 (every weight equal) fails as too flat; it crashed the detector (1 / ratio) before. The
    twin, the same layer at 1/sqrt(d_k), passes."""
    result = saturation(Chained((factor,)))
    assert result.verdict == verdict, result.message
    if verdict == "fail":
        assert result.message.startswith("softmax is flat, every weight equal"), result.message


# ---- normalised q and k: the cosine reading, alone and beside an unnormalised one ---------------------------------


class Normalised(nn.Module):
    """q and k l2-normalised, SDPA given `scale` (a temperature of the layer's own; sqrt(d_k): nGPT's); `then`: a
    second attention over its output with unnormalised q and k times `then` / sqrt(d_k) (None: none)."""

    def __init__(self, scale: float, then: float | None = None):
        super().__init__()
        self.n_heads, self.scale, self.then = H, scale, then
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=self.scale)
        if self.then is not None:
            out = (q @ k.transpose(-2, -1) * (self.then / math.sqrt(D_K))).softmax(-1) @ out
        return self.proj(merge(out))


@pytest.mark.parametrize("scale, verdict", [(0.0, "fail"), (math.sqrt(D_K), "pass")], ids=["0", "sqrt(d_k)"])
def test_a_cosine_times_zero_is_too_flat_not_a_crash(scale, verdict):
    """Normalised q and k at a temperature of 0 reach logits of 0 (`b > 0` guards both logs of `outside`: `>=` would
    divide by zero and take log(0)); its twin at sqrt(d_k) passes."""
    result = saturation(Normalised(scale))
    assert result.verdict == verdict and "normalised" in result.message, result.message
    if verdict == "fail":
        assert result.message.startswith("softmax is too flat for normalised q and k"), result.message


@pytest.mark.parametrize("scale, then, verdict, said", [
    (math.sqrt(D_K), 1.0, "pass", "q and k are normalised"),
    (math.sqrt(D_K), 1.5, "fail", "softmax is 1.50x too sharp"),
    (150.0, 1.0, "fail", "softmax is too sharp for normalised q and k"),
    (150.0, 1.3, "fail", "softmax is too sharp for normalised q and k"),
], ids=["both inside", "the unnormalised one out", "the cosine out", "both out, the cosine further"])
def test_the_reading_furthest_outside_decides_between_a_cosine_and_a_ratio(scale, then, verdict, said):
    """A cosine reading and a 1/sqrt(d_k) one in one layer: the one furthest outside its bounds is judged. A cosine
    inside is 0 outside (`if b > 0 else math.inf`: `b < 0` would make it infinitely out and pass the 1.5x one); a
    cosine of 150 is log(150 / 100) out (`if b > 0 else 0.0`: `b < 0` would make it 0, the 1.3x one judged); a ratio
    inside is 0 out (`abs(ratio) or 1e-300`: `and` would put every ratio 690 out, judged before the cosine of 150)."""
    result = saturation(Normalised(scale, then))
    assert result.verdict == verdict and result.message.startswith(said), result.message


class Spread(nn.Module):
    """q and k l2-normalised, then query row t multiplied by a gain rising from 1 to 1 + `spread` over the tokens
    (its rows' norms `spread` apart), SDPA given sqrt(d_k)."""

    def __init__(self, spread: float):
        super().__init__()
        self.n_heads, self.spread = H, spread
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        gain = torch.linspace(1, 1 + self.spread, q.shape[2], dtype=q.dtype).unsqueeze(-1)  # (T, 1)
        q, k = F.normalize(q, dim=-1) * gain, F.normalize(k, dim=-1)
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, scale=math.sqrt(D_K))))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("spread, verdict", [(0.01, "pass"), (0.03, "fail")], ids=["1% apart", "3% apart"])
def test_pin_norms_apart(spread, verdict, dtype):
    """NORMS_APART (0.02) from both sides: query rows 1% apart are normalised, judged by the cosine bounds (a cosine
    times 2.84 passes); 3% apart they are not, judged by 1/sqrt(d_k) (8x too sharp). Not in bfloat16, where ROW_SUM's
    0.03 is the larger and decides."""
    torch.manual_seed(0)
    result = saturation(Spread(spread).to(dtype))
    assert result.verdict == verdict and ("normalised" in result.message) is (verdict == "pass"), result.message


class PerHead(nn.Module):
    """Normalised q and k, each head's scores a 2-D mm of its (T, d) rows, times `scale`, softmaxed by hand per head."""

    def __init__(self, scale: float):
        super().__init__()
        self.n_heads, self.scale = H, scale
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        out = torch.stack([torch.stack([(torch.mm(q[b, h], k[b, h].T) * self.scale).softmax(-1) @ v[b, h]
                                        for h in range(H)]) for b in range(q.shape[0])])  # (B, H, T, d)
        return self.proj(merge(out))


@pytest.mark.parametrize("scale, verdict", [(math.sqrt(D_K), "pass"), (1 / math.sqrt(D_K), "fail")],
                         ids=["sqrt(d_k)", "1/sqrt(d_k)"])
def test_normalised_rows_of_a_2d_matmul_are_read_as_normalised(scale, verdict):
    """Scores of 2-D (T, d) operands are read for their rows' norms as batched ones are (`m.a.dim() >= 2`: `> 2` would
    judge these by 1/sqrt(d_k), 8x too sharp): a cosine times sqrt(d_k) passes; its twin, 1/sqrt(d_k) kept after the
    norm, is too flat."""
    result = saturation(PerHead(scale))
    assert result.verdict == verdict and "normalised q and k" in result.message + result.evidence.replace(
        "q and k reach q·k normalised", "normalised q and k"), result.message
    if verdict == "fail":
        assert result.message.startswith("softmax is too flat for normalised q and k"), result.message


class UnitRmsQueries(nn.Module):
    """q normalised to unit RMS (rows of norm sqrt(d_k)), k l2-normalised (norm 1), SDPA given `scale`: a cosine times
    scale x sqrt(d_k), a temperature of the layer's own (only q and k both at unit RMS take 1/sqrt(d_k))."""

    def __init__(self, scale: float):
        super().__init__()
        self.n_heads, self.scale = H, scale
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        q, k = F.normalize(q, dim=-1) * math.sqrt(D_K), F.normalize(k, dim=-1)
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, scale=self.scale)))


@pytest.mark.parametrize("scale, verdict", [(1.0, "pass"), (0.1, "fail")], ids=["1", "0.1"])
def test_only_q_and_k_both_at_unit_rms_take_one_over_sqrt_d_k(scale, verdict):
    """q at unit RMS and k of norm 1: judged by the cosine bounds (`all` of q and k at unit RMS: `any` would judge
    scale 1 by 1/sqrt(d_k), 2.83x too sharp): a logit of 2.83 passes; its twin at 0.1, 0.28, is too flat."""
    result = saturation(UnitRmsQueries(scale))
    assert result.verdict == verdict and "normalised" in result.message, result.message
    assert result.value == pytest.approx(scale * math.sqrt(D_K), rel=1e-3)


# ---- a factor the layer states, a split scale: the tolerances on their numbers ----------------------------------


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # unit RMS over each head's width


class Stated(nn.Module):
    """SDPA given the declared scale 1/sqrt(d_k) (`scaling`), q multiplied by `applied` first; the layer holds `value`
    under `name`; `normed`: q and k RMS-normalised before (QK-norm)."""

    def __init__(self, applied: float, name: str, value: float, normed: bool = False):
        super().__init__()
        self.n_heads, self.scaling, self.normed = H, D_K ** -0.5, normed
        self.applied = (applied,)  # not a float attribute: only `name` states a number
        setattr(self, name, value)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        if self.normed:
            q, k = _rms(q), _rms(k)
        return self.proj(merge(F.scaled_dot_product_attention(q * self.applied[0], k, v, scale=self.scaling)))


def declared(layer):
    return saturation(layer, scale=layer.scaling)


@pytest.mark.parametrize("value, verdict", [(round(2 ** 0.5, 6), "pass"), (2 ** 0.5 * (1 + 6e-6), "fail")],
                         ids=["3e-7 off", "6e-6 off"])
def test_pin_a_stated_gain_within_one_in_a_million(value, verdict):
    """Unnormalised q times sqrt(2), the layer stating `q_scale`: a number 3e-7 off (rounded to six decimals) is the
    factor (rel_tol 1e-6 in the look-up: 1e-7 would miss it, 1.41x too sharp; and in taking it once, not squared:
    1e-7 would square it, 1.41x too flat); one 6e-6 off is not (1e-5 would take it)."""
    result = declared(Stated(2 ** 0.5, "q_scale", value))
    assert result.verdict == verdict, result.message
    assert ("Stated.q_scale" in result.message) is (verdict == "pass"), result.message
    if verdict == "fail":
        assert "1.41x too sharp" in result.message, result.message


D_SCALE = D_K ** -0.5


@pytest.mark.parametrize("applied, name, value, verdict", [
    (D_SCALE * (1 + 3e-7), "scaling", D_SCALE, "fail"),
    (D_SCALE * (1 + 4e-6), "qk_scale_factor", D_SCALE * (1 + 4e-6), "pass"),
], ids=["the declared scale again, 3e-7 off", "a temperature of its own, 4e-6 off it"])
def test_pin_a_normalised_factor_that_is_the_declared_scale_again(applied, name, value, verdict):
    """QK-norm, q multiplied by a factor near the declared scale: within 1e-6 of it, it is the scale applied twice
    whatever attribute holds it (2.83x too flat; 1e-7 would take the layer's `scaling` for a temperature and pass);
    4e-6 off, a `qk_scale_factor` of that value is the layer's own temperature (1e-5 would call it the scale again)."""
    result = declared(Stated(applied, name, value, normed=True))
    assert result.verdict == verdict, result.message
    if verdict == "fail":
        assert "2.83x too flat" in result.message, result.message
    else:
        assert "normalised" in result.message and "Stated.qk_scale_factor" in result.evidence, result.evidence


@pytest.mark.parametrize("applied", [0.0, 1.0], ids=["temperature 0", "1"])
def test_a_zero_attribute_is_no_stated_factor(applied):
    """A zero temperature beside an attribute of 0.0 whose name holds "scale" (a layer-scale init): only a positive
    number can be the layer's factor (`value > 0`: `>= 0` took the 0.0 for it and divided by the zero expected); too
    flat. Its twin at a gain of 1 passes."""
    result = declared(Stated(applied, "layer_scale_init", 0.0))
    assert result.verdict == ("fail" if applied == 0 else "pass"), result.message
    if applied == 0:
        assert result.message.startswith("softmax is flat, every weight equal"), result.message


class SplitScale(nn.Module):
    """The declared scale `scaling` applied to q and to k each, SDPA given 1 (OpenAI's privacy filter: head_dim ** -0.25
    on both): q·k multiplied by its square."""

    def __init__(self, scaling: float):
        super().__init__()
        self.n_heads, self.scaling = H, scaling
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (split(t) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(F.scaled_dot_product_attention(q * self.scaling, k * self.scaling, v, scale=1.0)))


@pytest.mark.parametrize("off, verdict", [(2e-7, "pass"), (2e-6, "fail")], ids=["2e-7 off", "2e-6 off"])
def test_pin_a_split_scale_is_d_k_to_the_minus_quarter_within_one_in_a_million(off, verdict):
    """A declared scale 2e-7 off d_k ** -0.25 (its square 4e-7 off 1/sqrt(d_k)) is the split convention (rel_tol 1e-6:
    1e-7 would judge q·k by the declared scale itself, 1.68x too flat); 2e-6 off (4e-6) it is not (1e-5 would take
    it)."""
    result = declared(SplitScale(D_K ** -0.25 * (1 + off)))
    assert result.verdict == verdict, result.message
    assert ("the square of the declared scale" in result.message) is (verdict == "pass"), result.message
    if verdict == "fail":
        assert "1.68x too flat" in result.message, result.message


# ---- _observe._log_weights_read: the log-weights fit is read only where its control reads the softmax's factor -----


@pytest.mark.parametrize(("off", "read"), [(0.01, True), (0.05, False)])
def test_the_log_weights_fit_is_read_only_where_the_softmaxs_own_output_gives_its_factor_back(off, read):
    """LOG_WEIGHTS_CONTROL (2%) from both sides: weights that are the softmax of q·k at a factor 1% off the one the
    softmax's input was fitted with are read (x0.1, 0.2%, would drop them); 5% off, they are not (x10, 20%, would read
    them). Float64 weights, so the offset is the control's only error."""
    from diagnostics._observe import LOG_WEIGHTS_CONTROL, _log_weights_read

    assert LOG_WEIGHTS_CONTROL == 0.02
    products = torch.randn(2, H, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    factor = 1 / math.sqrt(D_K)
    weights = (factor * (1 + off) * products).softmax(-1)
    assert _log_weights_read(weights, products, factor) is read


def test_weights_rounded_flat_show_no_temperature_and_weights_that_resolve_it_do():
    """The draw that made the control (a dropout left on at one head of width 1, GPT-2's init: q·k ~ 1e-9): float32
    softmax weights of q·k that small are 0.5 to the last bit, so the fit reads a factor of 0 (judged "flat, every
    weight equal" before); the same q·k x 1e8 resolve the factor, and are read."""
    from diagnostics._observe import _log_weights_read

    products = torch.randn(2, 1, 2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e-9
    for size, read in ((1.0, False), (1e8, True)):
        weights = (size * products).float().softmax(-1)
        assert _log_weights_read(weights, size * products, 1.0) is read, (size, weights)
