"""A temperature beside relative position terms added to q·k (issue 33 "Every architecture", issue 34 cause 9).

Transformer-XL's attention (XLNet, the Conformers of wav2vec2, FastSpeech 2 and Parakeet) scores
(q + u)·k + shift((q + v)·r): q·k plus a term of the queries and the relative distances, moved into place by the
relative shift, then scaled. DeBERTa's (SEW-D's) adds c2p and p2c, products of the queries (keys) and position
embeddings gathered by distance, each divided, like q·k, by sqrt(3 d_k). VITS and Inkling add a bias computed from the
tokens. The temperature's fit of the softmax's input against q·k allows a bias the same in both batch halves, which
none of those terms is, so `softmax_saturation` measured nothing and 13 correct transformers model types stayed
inconclusive. The observer now records the sums on the way from q·k to the softmax (`_observe.Sum`), and the fit reads
each term that is added to q·k beside it, free (a bias: its own factor is not the temperature), so that q·k's factor
is judged. Twins on the same inputs: q·k left unscaled, or scaled twice, fails; a layer that scores positions only
(no q·k) is not judged as having a temperature; a softmax over a projection plus such a term is not read as q·k.
A right factor on q·k alone is no pass: each term's own factor is free in the fit, so a term scaled wrong reads the
same. Where a term is itself a product of q·k's width, read through moves and constant factors (the relative shift, a
gather, a mask filled in, x scale), the factor it reaches the scores with is judged against q·k's (`_observe.
_term_ratios`): 1 in Transformer-XL's and DeBERTa's scores, so the correct layers pass and a position term scaled
wrong fails; a term that is no such product stays not measured (tests/test_temperature_left_unjudged.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics

D, HEADS, SPAN, TAPS = 16, 2, 4, 5
d_k = D // HEADS  # the width of one head


def sinusoids(distances: torch.Tensor, width: int) -> torch.Tensor:
    """(P, width) sinusoidal embeddings of the distances (a table made without gradients, as Transformer-XL's)."""
    freq = 1.0 / 10000 ** (torch.arange(0, width, 2, dtype=torch.float32) / width)
    angle = distances.float()[:, None] * freq[None, :]  # (P, width / 2)
    return torch.cat([angle.sin(), angle.cos()], -1)


def relative_shift(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, 2T - 1) scores over the distances T - 1, ..., -(T - 1) to (B, H, T, T) scores over the keys, row i's
    column j holding distance i - j: Transformer-XL's trick of a zero column and a refold, which slides each row by
    one more place than the row above it."""
    B, H, T, P = x.shape
    x = F.pad(x, (1, 0)).reshape(B, H, P + 1, T)  # (B, H, 2T, T): the rows refolded
    return x[:, :, 1:].reshape(B, H, T, P)[..., :T]


class RelativeShiftAttention(nn.Module):
    """Transformer-XL's attention without memory. `bug`: "unscaled" (q·k and the position term not multiplied by
    1/sqrt(d_k)), "scaled twice", "positions only" (the content term left out: no q·k at all), or None. `each`: the
    scale multiplies each term before the sum (Parakeet's and wav2vec2-Conformer's), not the sum (XLNet's)."""

    def __init__(self, bug: str | None = None, each: bool = False):
        super().__init__()
        self.bug, self.each = bug, each
        self.qkv, self.pos, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.u, self.v = nn.Parameter(torch.randn(HEADS, d_k)), nn.Parameter(torch.randn(HEADS, d_k))

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, d_k).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        distances = torch.arange(T - 1, -T, -1)  # T - 1, ..., -(T - 1)
        r = self.pos(sinusoids(distances, D).to(x.dtype)).view(2 * T - 1, HEADS, d_k).transpose(0, 1)  # (H, 2T-1, d_k)
        scale = {"unscaled": 1.0, "scaled twice": 1 / d_k}.get(self.bug, 1 / math.sqrt(d_k))
        content = (q + self.u[:, None]) @ k.transpose(-2, -1)  # (B,H,T,d_k) x (B,H,d_k,T) -> (B,H,T,T)
        position = relative_shift((q + self.v[:, None]) @ r.transpose(-2, -1))  # (B,H,T,2T-1) -> (B,H,T,T)
        if self.bug == "positions only":
            scores = position * scale
        elif self.each:
            scores = content * scale + position * scale
        else:
            scores = (content + position) * scale
        out = scores.softmax(-1) @ v  # (B, H, T, d_k)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


class DisentangledAttention(nn.Module):
    """DeBERTa's disentangled attention: q·k plus content-to-position (q·R_k at distance i - j) and position-to-content
    (k·R_q at distance j - i) terms, gathered from products with SPAN * 2 relative embeddings, each of the three
    divided by sqrt(3 d_k). `bug`: "unscaled" (q·k alone left undivided), "scaled twice" (q·k divided twice).
    `in_place`: the terms accumulated in place, then added to q·k in place (SEW-D's `score += ...`)."""

    def __init__(self, bug: str | None = None, in_place: bool = False):
        super().__init__()
        self.bug, self.in_place = bug, in_place
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))
        self.pos_q, self.pos_k = nn.Linear(D, D), nn.Linear(D, D)
        self.rel = nn.Parameter(torch.randn(2 * SPAN, D))

    def heads(self, x):  # (B, T, D) -> (B * H, T, d_k)
        B, T, _ = x.shape
        return x.view(B, T, HEADS, d_k).transpose(1, 2).reshape(B * HEADS, T, d_k)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))  # (B*H, T, d_k)
        scale = math.sqrt(3 * d_k)  # three terms summed, each of the variance of one dot product
        apart = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T): i - j
        rel_k = self.heads(self.pos_k(self.rel)[None]).repeat(B, 1, 1)  # (B*H, 2 SPAN, d_k)
        rel_q = self.heads(self.pos_q(self.rel)[None]).repeat(B, 1, 1)
        c2p = (q @ rel_k.transpose(-1, -2)).gather(-1, (apart + SPAN).clamp(0, 2 * SPAN - 1).expand(B * HEADS, T, T))
        p2c = (k @ rel_q.transpose(-1, -2)).gather(-1, (-apart + SPAN).clamp(0, 2 * SPAN - 1).T
                                                   .expand(B * HEADS, T, T)).transpose(-1, -2)  # row i, key j
        content = q @ k.transpose(-1, -2)  # (B*H, T, d_k) x (B*H, d_k, T) -> (B*H, T, T)
        content = {"unscaled": content, "scaled twice": content / scale / scale}.get(self.bug, content / scale)
        if self.in_place:
            terms = c2p / scale
            terms += p2c / scale
            scores = content.clone()
            scores += terms
        else:
            scores = content + (c2p / scale + p2c / scale)
        out = scores.softmax(-1) @ v  # (B*H, T, d_k)
        return self.out(out.view(B, HEADS, T, d_k).transpose(1, 2).reshape(B, T, D))


class ShawAttention(nn.Module):
    """Shaw's relative positions as the Conformer writes them: a learned table of 2 SPAN + 1 distances, clipped, read
    per query and key (table[i - j], (T, T, d_k)) and multiplied by the query in one einsum, which torch runs as a bmm
    with the tokens as its batch ((T, B*H, d_k) against (T, d_k, T)), added to q·k, both scaled. `bug`: "unscaled",
    "scaled twice" (both terms), "term unscaled" (the position term alone left unscaled), "sample 0's keys" (the table
    replaced by the first sample's keys, read per query: every sample scored against sample 0's tokens)."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.bug = bug
        self.q, self.kv, self.out = nn.Linear(D, D, bias=False), nn.Linear(D, 2 * D, bias=False), nn.Linear(D, D)
        self.table = nn.Embedding(2 * SPAN + 1, d_k)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, HEADS, d_k).transpose(1, 2)  # (B, H, T, d_k)
        k, v = self.kv(x).view(B, T, 2, HEADS, d_k).permute(2, 0, 3, 1, 4)  # (B, H, T, d_k) each
        scale = {"unscaled": 1.0, "scaled twice": 1 / d_k}.get(self.bug, 1 / math.sqrt(d_k))
        apart = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(-SPAN, SPAN) + SPAN  # (T, T): i - j
        table = self.table(apart).to(q.dtype)  # (T, T, d_k): each (query, key) pair's distance embedding
        if self.bug == "sample 0's keys":  # a "table" of one sample's keys: no batch axis, yet made from the tokens
            table = k[0, 0][None].expand(T, T, -1)
        positions = torch.einsum("bhid,ijd->bhij", q, table)  # (B, H, T, T)
        scores = q @ k.transpose(-2, -1) * scale + positions * (1.0 if self.bug == "term unscaled" else scale)
        out = scores.softmax(-1) @ v  # (B, H, T, d_k)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


class TokenBiasedKernel(nn.Module):
    """Not attention over q·k: a dynamic convolution's taps over a window of TAPS tokens, softmax(x W + a term
    computed from the tokens): a projection's output plus a term, as the fit now reads q·k plus a term."""

    def __init__(self):
        super().__init__()
        self.taps, self.term = nn.Linear(D, TAPS, bias=False), nn.Linear(D, TAPS, bias=False)
        self.value, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        w = (self.taps(x) + self.term(x).tanh()).softmax(-1)  # (B, T, TAPS)
        v = F.pad(self.value(x), (0, 0, TAPS // 2, TAPS // 2)).unfold(1, TAPS, 1)  # (B, T, D, TAPS): each token's window
        return self.out(torch.einsum("btk,btdk->btd", w, v))


def _audit(layer, dtype, std_002, init):
    torch.manual_seed(0)
    if init == "std 0.02":
        std_002(layer)
        for p in (getattr(layer, "rel", None), getattr(getattr(layer, "table", None), "weight", None)):
            if p is not None:
                nn.init.normal_(p, std=0.02)
    return diagnostics.audit(layer.to(dtype))


LAYERS = {"Transformer-XL": lambda bug: RelativeShiftAttention(bug),
          "Transformer-XL, each term scaled": lambda bug: RelativeShiftAttention(bug, each=True),
          "DeBERTa": DisentangledAttention,
          "DeBERTa, summed in place": lambda bug: DisentangledAttention(bug, in_place=True),
          "Shaw, a table per query": ShawAttention}


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(LAYERS))
@pytest.mark.parametrize("bug", [None, "unscaled", "scaled twice"])
def test_the_temperature_of_q_k_is_judged_beside_relative_position_terms(bug, family, dtype, init, std_002):
    torch.manual_seed(0)
    report = _audit(LAYERS[family](bug), dtype, std_002, init)
    temperature = report.result("softmax_saturation")
    assert "added to q·k" in temperature.evidence, temperature
    if bug is None:  # q·k's factor right, and each position product reaches the scores with it: passed (DeBERTa's
        # 1/sqrt(3 d_k) is 1/sqrt(d_model) here, 2 heads of 8: not measured, the scale to declare named)
        assert temperature.verdict == ("skip" if family.startswith("DeBERTa") else "pass"), temperature
        assert not [f for f in report.findings if f.verdict == "fail"], str(report)
    else:
        assert temperature.verdict == "fail", temperature
        assert ("too sharp" if bug == "unscaled" else "too flat") in temperature.message, temperature


def test_deberta_reads_its_three_products_and_transformer_xl_its_own_scale():
    """DeBERTa's 1/sqrt(3 d_k) is read against the three products its scores sum, unless that is 1/sqrt(d_model) to
    within the allowed ratio (here 1/sqrt(24) against 1/sqrt(16), 2 heads of 8): then it is not measured, the scale to
    declare named, as the whole-width bug would read the same. Transformer-XL's 1/sqrt(d_k) is read as it is."""
    torch.manual_seed(0)
    for in_place in (False, True):
        torch.manual_seed(0)
        deberta = diagnostics.audit(DisentangledAttention(in_place=in_place)).result("softmax_saturation")
        assert "1/sqrt(3 x d_k) = 1/sqrt(24)" in deberta.message and "scale=" in deberta.message, deberta
    torch.manual_seed(0)
    xl = diagnostics.audit(RelativeShiftAttention()).result("softmax_saturation")
    assert xl.verdict == "pass" and "matches 1/sqrt(d_k)" in xl.message, xl
    assert "products the scores sum" not in xl.evidence and "reach the scores at 1 times q·k's factor" in xl.evidence, xl


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shaw_s_term_read_per_query_is_judged_against_q_k_s_factor_and_unscaled_is_not_passed(dtype, init, std_002):
    """Shaw's table gathered per query runs as a bmm whose batch is the tokens, its queries laid out (T, B*H, d_k):
    read as q·k's queries against a table of each token's own, the term's factor is judged (was: not measured, so the
    Conformer's correct attention stayed inconclusive). The twin with the term left unscaled, on the same inputs, is
    not passed: its factor is 2.83 times q·k's, which a design may mean (SAM's terms are unscaled), so not measured."""
    right = _audit(ShawAttention(), dtype, std_002, init).result("softmax_saturation")
    assert right.verdict == "pass" and "reach the scores at 1 times q·k's factor" in right.evidence, right
    wrong = _audit(ShawAttention("term unscaled"), dtype, std_002, init).result("softmax_saturation")
    assert wrong.verdict == "skip" and "2.83 times q·k's factor" in wrong.message, wrong
    # a table with no batch axis made from the tokens is no position table: its term is not vouched for (the trace
    # shows the keys made it), so the temperature stays not measured, never passed
    keys = _audit(ShawAttention("sample 0's keys"), dtype, std_002, init).result("softmax_saturation")
    assert keys.verdict == "skip" and "reach the scores at" not in keys.evidence, keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_layer_that_scores_positions_only_has_no_temperature_judged(dtype, std_002):
    """No q·k at all: its position term is not read as q·k (its twin with q·k, above, is judged on the same inputs)."""
    report = _audit(RelativeShiftAttention("positions only"), dtype, std_002, "std 0.02")
    assert not report.result("softmax_saturation").measured, report.result("softmax_saturation")


def test_a_softmax_over_a_projection_plus_a_token_term_is_not_read_as_q_k():
    torch.manual_seed(0)
    report = diagnostics.audit(TokenBiasedKernel())
    assert not report.result("softmax_saturation").measured, report.result("softmax_saturation")


SLOTS = 3


class TokenLearner(nn.Module):
    """MGP-STR's A3 module in this file's own words: SLOTS maps over the tokens, a softmax over the tokens of a 1x1
    convolution of them (a projection: its weight is the slots' learned queries), each slot the weighted mean of the
    tokens' features. `by_hand`: the twin whose scores are q·k of two activations, queries x W_q against keys x W_k,
    multiplied and summed by hand (no matmul) and left unscaled."""

    def __init__(self, by_hand: bool = False):
        super().__init__()
        self.by_hand = by_hand
        self.norm, self.feat = nn.LayerNorm(D), nn.Conv1d(D, D, 1, bias=False)
        if by_hand:
            self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        else:
            self.maps = nn.Conv1d(D, SLOTS, 1, bias=False)

    def forward(self, x):
        x = self.norm(x)  # (B, T, D)
        if self.by_hand:
            scores = (self.q(x)[:, :, None, :] * self.k(x)[:, None, :, :]).sum(-1)  # (B, T, T): q·k, unscaled
        else:
            scores = self.maps(x.transpose(1, 2))  # (B, SLOTS, T): one logit per slot and token
        return scores.softmax(-1) @ self.feat(x.transpose(1, 2)).transpose(1, 2)  # (B, SLOTS or T, D)


def test_a_token_learner_and_q_k_by_hand_both_stay_unjudged():
    """The token learner's softmax normalises a projection of the tokens, as learned-query attention pooling's does
    (`k @ self.query.T`, whose temperature is a q·k's): structure cannot tell them apart, so its temperature is not
    measured, never excused (MGP-STR's three A3 modules leave the model inconclusive). Its twin, q·k of two
    activations computed without a matmul (so no fit reads it), is not measured either."""
    torch.manual_seed(0)
    learner = diagnostics.audit(TokenLearner(), queries=SLOTS, d_model=D)
    temperature = learner.result("softmax_saturation")
    assert temperature.message.startswith("not measured") and "projection of the tokens" in temperature.message, \
        temperature
    assert not [f for f in learner.findings if f.verdict == "fail"], str(learner)
    torch.manual_seed(0)
    by_hand = diagnostics.audit(TokenLearner(by_hand=True), d_model=D).result("softmax_saturation")
    assert by_hand.message.startswith("not measured"), by_hand
