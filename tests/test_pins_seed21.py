"""Pins for the survivors of the seed-21 mutation sample at 000bb4a (issue 37: `benchmarks/mutations.py --seed 21`)
in keys_matter's gains, decode_consistency's cache plan, gradients' kink rule, batch_independence's second twin call
and packed_documents' search for where a leak starts. As in tests/test_pins.py, each pin has its twin on the same
inputs (a case on each side), and the constants are quoted as literals (a test that read them from the module would
follow a mutated value).

- keys_matter pushes the keys 1e6-fold (100-fold in float16): a correct layer whose keys act only faintly (W_Q
  scaled down to 3e-14 in float32, 3e-13 in bfloat16, every other projection the identity, d_model 1, two tokens)
  moves its output when its keys are pushed 1e6-fold and by exactly 0 when they are pushed 1e5-fold (measured, W_Q
  from 1e-15 to 0.56 in quarter decades: a push of G moves a float32 layer from W_Q = 1e-14 x 1e6 / G, a bfloat16 one
  from 1e-13 x 1e6 / G; both twins sit half a decade inside). The same weights with keys projected from the query
  stream (the catalog's keys_from_query_stream) fail. A larger push (x10) changes no verdict: EQUIVALENT, with the
  measurement, in benchmarks/mutations.py; float16's 100 x0.1 is killed by the suite's float16 audits.
- `_cache_plan(T, band)`: the token counts of the cached calls cover the T positions exactly, each call at least one
  token, the tokens at W - 1, W, 2W - 1 and 2W decoded alone where they are inside the sequence.
- gradients' `KINK_STEADY = 2.0`: a part of the direction whose jump, read at three steps 2x apart, stays within 2x is
  a kink at the point (left out, named); one whose jump shrinks more is judged. A gate |g| ** p at g = 0 has a jump
  that shrinks as h ** (p - 1): 1.41x over the three steps at p = 1.25 (a kink), 2.83x at p = 1.75 (judged).
- batch_independence's second seeded twin call raising is a skip naming the layer's error, not our error.
- packed_documents reads only a module's tensors of one entry per row and position when it looks for where a leak
  starts, and names that module beside the layer reported only where they differ.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from correct import MultiHeadAttention
from diagnostics.detectors.decoding import _cache_plan

# ---- keys_matter's key gain: 1e6 (float32, bfloat16) -------------------------------------------------------------


def _faint_keys(cls, w_q: float, dtype):
    """d_model 1, one head: W_Q = w_q, W_K = W_V = W_O = 1, no biases: the scores are w_q x q x k, so the keys move
    the output only when pushed far enough that w_q x k is past the softmax's rounding."""
    layer = cls(1, 1)
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.tensor([[w_q], [1.0], [1.0]]))
        layer.qkv.bias.zero_()
        layer.out.weight.fill_(1.0)
        layer.out.bias.zero_()
    return layer.to(dtype)


@pytest.mark.parametrize("dtype, w_q", [(torch.float32, 3e-14), (torch.bfloat16, 3e-13)], ids=["float32", "bfloat16"])
def test_keys_matter_pushes_keys_far_enough_to_move_a_layer_whose_keys_barely_act(dtype, w_q):
    """Pushed 1e6-fold the faint keys move the output (pass); 1e5-fold (the gain x0.1) they would move it by exactly 0
    and the correct layer would fail. Its keyless twin fails whatever the push."""
    right = diagnostics.audit(_faint_keys(MultiHeadAttention, w_q, dtype), seq_len=2,
                              detectors=["keys_matter"]).result("keys_matter")
    keyless = diagnostics.audit(_faint_keys(VARIANTS["keys_from_query_stream"].cls, w_q, dtype), seq_len=2,
                                detectors=["keys_matter"]).result("keys_matter")
    assert right.verdict == "pass" and "changing every key" in right.evidence, right.evidence
    assert keyless.verdict == "fail" and keyless.message == "the output does not depend on the keys", keyless


# ---- decode_consistency's cache plan ------------------------------------------------------------------------------


@pytest.mark.parametrize("T, band, plan", [
    (4, 3, [2, 1, 1]),  # the last single step (t = W = 3) ends the sequence: no remainder, no empty call
    (5, 3, [2, 1, 1, 1]),  # t = 2W - 1 = 5 is past the end: left out; a remainder of one token
    (6, 3, [2, 1, 1, 1, 1]),  # t = 2W - 1 = 5 inside, t = 2W = 6 at the end: left out
    (7, 3, [2, 1, 1, 1, 1, 1]),  # every step inside; t = 4 between them as a call of its own
    (16, 4, [3, 1, 1, 2, 1, 1, 7]),  # several tokens at once between W and 2W - 1, then the remainder
    (10, 8, [7, 1, 1, 1]),
    (16, None, [8, 1, 1, 3, 3]),  # no pattern: half, 1, 1, 3, the rest
])
def test_cache_plan_covers_the_sequence_once_and_decodes_the_window_edges_alone(T, band, plan):
    """`if t < at or t >= T: continue` (a step at or past the end is left out: `and` would step past the end) and
    `[T - at] if at < T` (no call of zero tokens when the steps end the sequence: `<=` adds one)."""
    got = _cache_plan(T, band)
    assert got == plan, got
    assert sum(got) == T and min(got) >= 1, got
    if band is not None:
        starts = [sum(got[:i]) for i in range(len(got))]
        alone = {t for t, n in zip(starts, got) if n == 1}
        edges = {t for t in (band - 1, band, 2 * band - 1, 2 * band) if t < T}
        assert edges <= alone, (edges, alone)


# ---- gradients' kink rule: KINK_STEADY = 2.0 ------------------------------------------------------------------


class _AbsPow(torch.autograd.Function):
    """|g| ** p, its backward correct or (`wrong`) a derivative of 1: a hand-written backward's mistake."""

    @staticmethod
    def forward(ctx, g, p, wrong):
        ctx.save_for_backward(g)
        ctx.p, ctx.wrong = p, wrong
        return g.abs() ** p

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        d = torch.ones_like(g) if ctx.wrong else ctx.p * g.abs() ** (ctx.p - 1) * g.sign()
        return grad * d, None, None


class GatedAttention(nn.Module):
    """Self-attention (fused qkv, SDPA, output projection) plus a gate |g| ** p added to every output, g a parameter
    initialised to 0: at the probe point the gate's part of the direction has the jump of |g| ** p at 0."""

    def __init__(self, p: float, wrong: bool, d_model: int = 16, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.p, self.wrong, self.heads = p, wrong, heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.gate = nn.Parameter(torch.zeros(d_model))

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D)) + _AbsPow.apply(self.gate, self.p, self.wrong)


@pytest.mark.parametrize("p", [1.25, 1.75])
def test_gradients_reads_a_jump_steady_within_2x_as_a_kink_and_judges_one_that_shrinks_more(p):
    """With the gate's backward wrong (autograd disagrees with the finite differences along the gate alone): at p =
    1.25 its jump stays within 1.41x over eps / 4, / 8, / 16, a kink at the point: the gate is left out and named,
    the rest agrees (at KINK_STEADY x0.1 = 0.2 no part is a kink: fail); at p = 1.75 it shrinks 2.83x, no kink: the
    wrong backward fails (at x10 = 20 it would be read as a kink and pass). The correct gate passes at both."""
    right = diagnostics.audit(GatedAttention(p, wrong=False), detectors=["gradients"]).result("gradients")
    wrong = diagnostics.audit(GatedAttention(p, wrong=True), detectors=["gradients"]).result("gradients")
    assert right.verdict == "pass" and "along gate" not in right.evidence, right.evidence
    if p < 1.5:
        assert wrong.verdict == "pass", wrong.evidence
        assert "not differentiable at this point along gate" in wrong.evidence, wrong.evidence
    else:
        assert wrong.verdict == "fail" and "along gate" not in wrong.evidence, wrong.evidence


# ---- batch_independence: the second seeded twin call ----------------------------------------------------------


class MixingWithNoise:
    """Scaled dot-product attention plus the batch's mean (mixing) and a fresh draw of 1e-2 on every call (randomness
    the audit's seed pins down); raises on call `raise_on`. Calls: the standard probe, the changed batch, the seeded
    twin (which differs from the standard probe: the noise), and, sequence 0 still moving, a second seeded twin."""

    def __init__(self, raise_on: int | None = None):
        self.raise_on, self.calls = raise_on, 0

    def __call__(self, q, k, v, mask=None):
        self.calls += 1
        if self.calls == self.raise_on:
            raise ValueError("the layer's own error")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, d)
        return out + out.mean(0, keepdim=True) + 1e-2 * torch.randn(out.shape)


@pytest.mark.parametrize("raise_on", [4, None])
def test_batch_independence_is_not_run_when_its_second_seeded_twin_raises_and_fails_the_mixing_when_it_runs(raise_on):
    """`if not twin.ok: return not_run(...)`: the fourth call raising is a skip that names the layer's error (without
    the guard the audit reads the missing output and errs); run, the mixing fails."""
    layer = MixingWithNoise(raise_on)
    result = diagnostics.audit(layer, detectors=["batch_independence"]).result("batch_independence")
    assert layer.calls == 4, layer.calls
    if raise_on:
        assert result.verdict == "skip" and result.message.startswith(
            "not measured: the layer raised on this detector's probe (ValueError: the layer's own error)"), result
    else:
        assert result.verdict == "fail", result


# ---- packed_documents: where the leak starts -------------------------------------------------------------------


def _packed_lm(kind: str, T: int = 16, D: int = 32, H: int = 8):
    """A one-layer LM of packed documents whose attention ignores the document boundaries (causal SDPA over the whole
    sequence: a leak). `kind`: "inline" (one module), "split" (its heads split by a submodule returning (B, H, T, d):
    no tensor of one entry per row and position), "core" (the SDPA in a submodule `core` returning (B, T, D))."""
    import torch.nn.functional as F

    class Split(nn.Module):
        def forward(self, t):
            B, t_, _ = t.shape  # batch, sequence length
            return t.view(B, t_, H, D // H).transpose(1, 2)  # (B, H, T, d)

    class Core(nn.Module):
        def forward(self, q, k, v):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d): documents not kept apart
            return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], D)  # (B, T, D)

    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))
            self.split = Split() if kind == "split" else None
            self.core = Core() if kind == "core" else None

        def forward(self, x):
            B, t, _ = x.shape  # batch, sequence length

            def split(z):
                return self.split(z) if self.split is not None else z.view(B, t, H, D // H).transpose(1, 2)
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))  # (B, H, T, d) each
            if self.core is not None:
                return self.out(self.core(q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d)
            return self.out(y.transpose(1, 2).reshape(B, t, D))

    class LM(nn.Module):
        causal = True

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.wte, self.wpe = nn.Embedding(64, D), nn.Embedding(T, D)
            self.attn, self.head = Leaky(), nn.Linear(D, 64)

        def forward(self, input_ids, position_ids=None):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            return self.head(self.attn(self.wte(input_ids) + self.wpe(position_ids)))

    return LM()


@pytest.mark.parametrize("kind", ["inline", "split", "core"])
def test_packed_documents_names_where_the_leak_starts_only_where_it_is_not_the_layer_it_reports(kind):
    """The documents are t = 0..4, 5..9, 10..15. `_crosses` reads only tensors of one entry per row and position
    (`t.shape[:2] != (rows, T)`): the split heads, (rows, 8, T, 4), are not read (read along the heads as if they were
    positions, they would cross document 0's five and be named where the leak starts, a module without softmax: a
    warn). `source[0] != first`: the submodule `core` where the leak starts is named beside the layer reported, and
    nothing more where they are the same module."""
    result = diagnostics.audit_model(_packed_lm(kind), packed=True, detectors=["packed_documents"]).result(
        "packed_documents")
    assert result.verdict == "fail" and result.layer == "attn", result
    at = "; the change first crosses at attn"
    assert result.message.endswith(at + (" (the leak starts in attn.core, Core)" if kind == "core" else "")), result


# ---- the seed-21 sample again, at eb6ae1f (2026-12-05): output_shape's fix for queries of the layer's own -----------


class LearnedQueries(nn.Module):
    """`queries` learned queries over the tokens, one head; one query's row is returned as (B, D)."""

    def __init__(self, queries: int, d_model: int = 16):
        super().__init__()
        self.latent = nn.Parameter(torch.randn(1, queries, d_model))
        self.kv = nn.Linear(d_model, 2 * d_model)

    def forward(self, x):
        B, T, D = x.shape  # batch, tokens, width
        k, v = self.kv(x).chunk(2, -1)  # (B, T, D) each
        weights = torch.softmax(self.latent.expand(B, -1, -1) @ k.transpose(-2, -1) / D ** 0.5, dim=-1)  # (B, Q, T)
        out = weights @ v  # (B, Q, D)
        return out[:, 0] if out.shape[1] == 1 else out


@pytest.mark.parametrize("queries, words", [(1, "1 learned query of its own"), (3, "3 learned queries of its own")])
def test_output_shape_names_one_learned_query_in_the_singular_and_more_in_the_plural(queries, words):
    """The seed-21 sample at eb6ae1f: `seen == 1` made `!=` in the fix's wording survived every test."""
    torch.manual_seed(0)
    shape = diagnostics.audit(LearnedQueries(queries)).result("output_shape")
    assert shape.verdict == "skip" and f"audit with queries={queries} " in shape.fix, shape
    assert words in shape.fix, shape.fix
