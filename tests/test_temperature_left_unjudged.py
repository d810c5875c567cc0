"""Where `softmax_saturation` cannot vouch for a temperature, it says "not measured", never "pass" (a review of the
temperature beside relative position terms, and of softmaxes over projections).

- 1/sqrt(parts x d_k) beside position terms is also 1/sqrt(d_model) where the scores sum as many products as the layer
  has heads: the whole-width bug read as a convention passed. Now it is not measured, naming the scale to declare.
- A failure's fix and the sites the localiser points at name the factor the verdict judged by.
- Each term added to q·k is read with a free factor of its own: a position term left unscaled, or x100, read as a
  right one and passed. Now q·k's own factor is judged (a wrong one fails) and the rest is not measured.
- Attention pooling whose queries are the layer's parameters (`F.linear(k, self.query)`, `k @ self.query.T`) is a
  softmax over a projection, as a token learner's is: excused as "not applicable", it passed with its scale missing
  or x100. And q·k multiplied and summed by hand was read as a linear attention's kernel. Both are now not measured.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics.detectors.temperature import scale_fix


def _sibling(name: str):
    """A test module of this folder, loaded from its file (the suite also runs under --import-mode=importlib)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"unjudged_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


xl = _sibling("test_temperature_relative_terms")
D, HEADS, d_k = xl.D, xl.HEADS, xl.d_k  # 2 heads of 8: q·k and one position term are 2 products, as many as heads


class ScaledTerms(xl.RelativeShiftAttention):
    """Transformer-XL whose content term is multiplied by `content` and position term by `position` (the sum of
    both by `content` where `position` is None, as XLNet scales)."""

    def __init__(self, content: float, position: float | None = None):
        super().__init__()
        self.content, self.position = content, position

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d_k).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        r = self.pos(xl.sinusoids(torch.arange(T - 1, -T, -1), D).to(x.dtype)).view(2 * T - 1, HEADS, d_k)
        content = (q + self.u[:, None]) @ k.transpose(-2, -1)  # (B, H, T, T)
        position = xl.relative_shift((q + self.v[:, None]) @ r.permute(1, 2, 0))  # (B, H, T, T)
        if self.position is None:
            scores = (content + position) * self.content
        else:
            scores = content * self.content + position * self.position
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def _temperature(layer, dtype=torch.float32, init=None, **options):
    torch.manual_seed(0)
    if init is not None:
        init(layer)
    report = diagnostics.audit(layer.to(dtype), **options)
    return report, report.result("softmax_saturation")


INITS = {"default": None, "std 0.02": lambda layer: layer.apply(
    lambda m: nn.init.normal_(m.weight, std=0.02) if isinstance(m, nn.Linear) else None)}


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_whole_width_bug_is_not_passed_as_two_products_per_head_and_declaring_the_scale_decides_it(dtype, init):
    report, whole = _temperature(ScaledTerms(D ** -0.5), dtype, INITS[init])  # 1/sqrt(d_model) = 1/sqrt(2 x d_k)
    assert whole.verdict == "skip" and "whole-width bug" in whole.message and "scale=" in whole.message, whole
    assert not report.passed, str(report)
    _, declared = _temperature(ScaledTerms(D ** -0.5), dtype, INITS[init], scale=d_k ** -0.5)
    assert declared.verdict == "fail" and "too flat" in declared.message, declared
    # its twin on the same inputs, scaled by 1/sqrt(d_k): passed (its position product scaled as q·k is)
    report, right = _temperature(ScaledTerms(d_k ** -0.5), dtype, INITS[init])
    assert right.verdict == "pass" and "whole-width" not in right.message, right
    assert not [f for f in report.findings if f.verdict == "fail"], str(report)


def test_a_failures_fix_and_sites_name_the_factor_the_verdict_judged_by():
    report, flat = _temperature(ScaledTerms(0.5 * d_k ** -0.5))  # half of 1/sqrt(d_k): nearer 1/sqrt(2 d_k)
    expected = f"{d_k ** -0.5:.4g}"
    assert flat.verdict == "fail" and f"expected {expected}" in flat.evidence, flat
    assert f"multiply q·k by {expected} (1/sqrt(d_k) = 1/sqrt({d_k}))" in flat.fix, flat.fix
    said = [s.note for s in flat.where if "expected" in s.note]
    assert said and all(f"expected {expected}" in n for n in said), said
    # the fix said as the reading chosen, where 1/sqrt(parts x d_k) is the one (DeBERTa's three products)
    fix = scale_fix(2 / math.sqrt(3 * 64), 1 / math.sqrt(3 * 64), 64, 768, 12, parts=3)
    assert "multiply q·k by 0.07217 (1/sqrt(3 x d_k) = 1/sqrt(192)" in fix, fix
    assert "multiply q·k by 0.125 (1/sqrt(d_k) = 1/sqrt(64))" in scale_fix(0.0625, 0.125, 64, 768, 12), "the twin"


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_position_term_scaled_wrong_is_not_passed_where_q_k_is_scaled_right(dtype, init):
    for position in (1.0, 100.0, -d_k ** -0.5):  # the position term unscaled, x100 or subtracted: not passed, and
        # not failed either (designs scale such terms differently: SAM's are unscaled), the ratio said
        report, wrong = _temperature(ScaledTerms(d_k ** -0.5, position), dtype, INITS[init])
        # (in bfloat16 at torch's initialisation, an unscaled term can move q·k's fit to 0.28, 1/sqrt(2 d_k) or the
        # whole-width bug: then not measured, the scale to declare named)
        assert wrong.verdict == "skip" and not report.passed, (wrong, str(report))
        assert "times q·k's factor" in wrong.message or (dtype == torch.bfloat16 and "whole-width" in wrong.message), \
            wrong
    # the twin with q·k itself unscaled fails on the same inputs: q·k's own factor is still judged
    _, unscaled = _temperature(ScaledTerms(1.0, d_k ** -0.5), dtype, INITS[init])
    assert unscaled.verdict == "fail" and "too sharp" in unscaled.message, unscaled
    # and the right layer, each product scaled by 1/sqrt(d_k), passes
    report, right = _temperature(ScaledTerms(d_k ** -0.5, d_k ** -0.5), dtype, INITS[init])
    assert right.verdict == "pass" and not [f for f in report.findings if f.verdict == "fail"], str(report)


SLOTS = 3


class LearnedQueryPool(nn.Module):
    """Attention pooling with SLOTS learned queries, the query a parameter used as it is (timm's AttentionPoolLatent,
    Set Transformer's PMA): scores = query · k(x) * scale over the tokens. `how` multiplies them: "linear" or
    "matmul"."""

    def __init__(self, scale: float, how: str):
        super().__init__()
        self.scale, self.how = scale, how
        self.query = nn.Parameter(torch.randn(SLOTS, D))
        self.k, self.v, self.o = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        k, v = self.k(x), self.v(x)  # (B, T, D)
        s = F.linear(k, self.query) if self.how == "linear" else k @ self.query.T  # (B, T, SLOTS)
        return self.o((s.transpose(1, 2) * self.scale).softmax(-1) @ v)  # (B, SLOTS, D)


class ByHand(nn.Module):
    """One head of self-attention whose q·k is multiplied and summed by hand (no matmul), times `scale`."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        s = (self.q(x)[:, :, None, :] * self.k(x)[:, None, :, :]).sum(-1) * self.scale  # (B, T, T)
        return self.o(s.softmax(-1) @ self.v(x))


@pytest.mark.parametrize("how", ["linear", "matmul"])
def test_learned_query_pooling_is_not_excused_as_a_projection_with_its_scale_missing_or_x100(how):
    for scale in (1.0, 100.0):
        report, wrong = _temperature(LearnedQueryPool(scale, how), queries=SLOTS, d_model=D)
        assert wrong.message.startswith("not measured") and "not applicable" not in wrong.message, wrong
        assert not report.passed, str(report)
    # its twin, scaled by 1/sqrt(D), on the same inputs: not failed, and as unjudged
    report, right = _temperature(LearnedQueryPool(D ** -0.5, how), queries=SLOTS, d_model=D)
    assert right.message.startswith("not measured"), right
    assert not [f for f in report.findings if f.verdict == "fail"], str(report)


def test_q_k_by_hand_counts_as_a_product_and_is_not_called_a_linear_attention():
    for scale in (1.0, 100.0):
        report, wrong = _temperature(ByHand(scale))
        assert wrong.message.startswith("not measured") and "not applicable" not in wrong.message, wrong
        assert not report.passed, str(report)
    report, right = _temperature(ByHand(D ** -0.5))
    assert right.message.startswith("not measured") and "linear attention" not in right.message, right
    assert not [f for f in report.findings if f.verdict == "fail"], str(report)


RETURN_WEIGHTS = "return the weights as (out, weights)"


class TokenBias(nn.Module):
    """q·k / sqrt(d_k) plus a bias per key projected from its token by a weight (a learned factor, no dot product of
    q·k's width): a term beside q·k whose own factor is not judged."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.bias = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, HEADS)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d_k).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        bias = self.bias(x).transpose(1, 2)[:, :, None, :].expand(B, HEADS, T, T)  # (B, H, T, T): key j's own
        scores = q @ k.transpose(-2, -1) * d_k ** -0.5 + bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("layer", ["a bias from the tokens", "learned-query pooling", "no attention"])
def test_an_unjudged_temperature_says_what_to_do_and_no_weights_seen_asks_for_them(layer):
    """The inconclusive status says what would measure the layer. A temperature no declaration measures (terms beside
    q·k, a softmax over a projection) says "nothing to declare" and what to check by hand, not "return the weights or
    use a softmax" to a layer whose softmax weights were measured (transformers' XLNet, Parakeet, Inkling and MGP-STR
    read so); a layer whose weights were not seen at all is still asked to return them."""
    subject = {"a bias from the tokens": lambda: TokenBias(),
               "learned-query pooling": lambda: LearnedQueryPool(D ** -0.5, "matmul"),
               "no attention": lambda: nn.Linear(D, D)}[layer]()
    torch.manual_seed(0)
    report = diagnostics.audit(subject, d_model=D, **({"queries": SLOTS} if layer == "learned-query pooling" else {}))
    reason = report.status_reason
    assert report.status == "inconclusive" and "the attention itself was not measured" in reason, reason
    if layer == "no attention":
        assert RETURN_WEIGHTS in reason.lower() and "Nothing to declare" not in reason, reason
        return
    assert report.result("weight_row_sums").verdict == "pass", report.result("weight_row_sums")
    assert "Nothing to declare" in reason and RETURN_WEIGHTS not in reason.lower(), reason
    assert ("relative positions" if layer == "a bias from the tokens" else "a parameter of the layer") in reason, reason


@pytest.mark.parametrize("side", [0.9, 1.1], ids=["inside", "outside"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_position_term_is_judged_against_q_k_s_factor_by_the_scale_ratio_from_both_sides(side, dtype):
    """The pin of the term's bound: a position product at 0.9 x SCALE_RATIO times q·k's factor passes, at 1.1 x it is
    not measured (and so at the reciprocals: too flat a term)."""
    from diagnostics._thresholds import SCALE_RATIO
    for ratio in (side * SCALE_RATIO, 1 / (side * SCALE_RATIO)):
        report, result = _temperature(ScaledTerms(d_k ** -0.5, ratio * d_k ** -0.5), dtype, INITS["std 0.02"])
        expected = "pass" if side < 1 else "skip"
        assert result.verdict == expected, (ratio, result)
        if expected == "skip":
            assert "reaches the scores at" in result.message and "times q·k's factor" in result.message, result


class TermDesigns(xl.RelativeShiftAttention):
    """Transformer-XL variants a review built: `design` "typo" (the position product reads the keys instead of the
    positions: q·k counted twice, shifted, a bug), "gate" (the position term times a learned scalar, 0.1: its factor is
    learned), "keys scaled" (q·k's keys times 1.89, the position keys not: Gemma's audio attention), "unscaled term"
    (q scaled before q·k only, the position term from the unscaled q: SAM's decomposed terms, in one dimension), "key
    bias" (a logit of each key, k·w with w a vector of the layer's per head, in place of the position term)."""

    def __init__(self, design: str):
        super().__init__()
        self.design = design
        self.gate = nn.Parameter(torch.tensor(0.1))
        self.w = nn.Parameter(torch.randn(HEADS, d_k, 1))

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d_k).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        r = self.pos(xl.sinusoids(torch.arange(T - 1, -T, -1), D).to(x.dtype)).view(2 * T - 1, HEADS, d_k)
        r = r.permute(1, 2, 0)  # (H, d_k, 2T - 1)
        s = d_k ** -0.5
        if self.design == "typo":  # BUG: the keys, padded to 2T - 1, read where the positions belong
            r = F.pad(k.transpose(-2, -1), (0, T - 1))
        if self.design == "keys scaled":
            content = q @ (k * 1.89).transpose(-2, -1) * s
        elif self.design == "unscaled term":
            content = (q * s) @ k.transpose(-2, -1)
        else:
            content = q @ k.transpose(-2, -1) * s
        position = xl.relative_shift(q @ r)  # (B, H, T, T)
        if self.design == "key bias":  # (B, H, T, 1) -> each key's own logit, (B, H, T, T)
            position = (k @ self.w).transpose(-2, -1).expand(B, HEADS, T, T)
        position = position * (self.gate if self.design == "gate" else 1.0 if self.design == "unscaled term" else s)
        return self.out(((content + position).softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("design", ["typo", "gate", "keys scaled", "unscaled term", "key bias"])
def test_terms_scaled_otherwise_by_design_are_not_failed_and_a_typo_is_not_passed(design):
    """Only a position product of q·k's own queries (or keys) with tokens-free positions, at q·k's factor, is vouched
    for: a learned gate, keys scaled apart, or an unscaled term beside a pre-scaled q are designs (not failed); the
    keys read for the positions are no position product (not passed)."""
    scale = {"keys scaled": 1.89 * d_k ** -0.5}.get(design)
    report, result = _temperature(TermDesigns(design), **({"scale": scale} if scale else {}))
    assert result.verdict == "skip", result
    assert not [f for f in report.findings if f.verdict == "fail" and f.detector == "softmax_saturation"], str(report)
    if design == "key bias":  # no table over positions: not called a relative-position product
        assert "relative-position product" not in result.message, result


class TwoTerms(xl.RelativeShiftAttention):
    """Transformer-XL's content and position terms at 1/sqrt(d_k), beside a third: `third` "c2p" (q against a second
    position table, multiplied by `factor` x 1/sqrt(d_k): DeBERTa-style, a position product) or "token bias" (a bias
    per key projected from its token: no product, its factor learned)."""

    def __init__(self, third: str, factor: float = 1.0):
        super().__init__()
        self.third, self.factor = third, factor
        self.pos2, self.bias = nn.Linear(D, D, bias=False), nn.Linear(D, HEADS)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d_k).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        table = xl.sinusoids(torch.arange(T - 1, -T, -1), D).to(x.dtype)  # (2T - 1, D)
        r, r2 = (p(table).view(2 * T - 1, HEADS, d_k).permute(1, 2, 0) for p in (self.pos, self.pos2))
        s = d_k ** -0.5
        scores = q @ k.transpose(-2, -1) * s + xl.relative_shift((q + self.v[:, None]) @ r) * s
        if self.third == "c2p":
            scores = scores + xl.relative_shift(q @ r2) * (self.factor * s)
        else:  # (B, H, T, T): key j's own logit
            scores = scores + self.bias(x).transpose(1, 2)[:, :, None, :].expand(B, HEADS, T, T)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("third, factor, expected", [("c2p", 1.0, "pass"), ("c2p", 10.0, "skip"),
                                                     ("token bias", 1.0, "skip")],
                         ids=["two position terms at q·k's factor", "the second x10", "a bias beside"])
def test_every_term_beside_q_k_is_read_and_one_unread_leaves_the_temperature_unjudged(third, factor, expected):
    """The terms' reading in `check_softmax_saturation` (its `all` at L244 at 3057bfd, made `any`: one term read
    would be enough, and max() met the unread one's None; its `r <= 0` at L248 made `r >= 0`: the first term read
    would be the worst): two position products at q·k's factor pass; the second at 10x it is not measured, whatever
    the first reads; a position product beside a bias from the tokens (a factor of its own, not read) is not
    measured either, and says the fit leaves it free."""
    report, result = _temperature(TwoTerms(third, factor))
    assert result.verdict == expected, result
    if third == "token bias":
        assert "the fit leaves free" in result.message, result.message
    elif expected == "skip":
        assert "reaches the scores at" in result.message, result.message


@pytest.mark.parametrize("layer, said", [
    (lambda: ScaledTerms(d_k ** -0.5, d_k ** -0.5), "the 1 product added to q·k"),
    (lambda: TwoTerms("c2p"), "the 2 products added to q·k"),
    (lambda: TokenBias(), "the term added to it before the softmax"),
    (lambda: TwoTerms("token bias"), "the 2 terms added to it before the softmax")],
    ids=["one product", "two products", "one term", "two terms"])
def test_the_terms_beside_q_k_are_counted_in_the_words(layer, said):
    """The count of terms in what the verdict says (L259 and L266 at 3057bfd, each `> 1` made `>= 1` or `< 1`: one
    term read as several, or several as one): one position product passes saying "the 1 product", two say "the 2
    products"; one unread term is "the term", two (a position product beside a token bias) "the 2 terms"."""
    _, result = _temperature(layer())
    assert said in (result.evidence if result.verdict == "pass" else result.message), (result.message,
                                                                                        result.evidence)
