"""Pins for gradient_flow's rules for parameters that get no gradient at the audit's length (issue 37: the seed-20
sample at 1a0042c left `LONGER`, `MOVED_AT_MOST` and `MOVES` of diagnostics/model/gradients.py surviving x10 and
x0.1). Each constant gets a case just inside and one just outside it, so that x10 and x0.1 each change what a test
asserts. The constants are quoted as literals on purpose (a test that read them from the module would follow a
mutated value).

- `LONGER = (64, 256, 1024)`: the lengths a parameter unused at the audit's (16) is tried at, in order, up to the
  first the model does not run at. A parameter used from length 64 is reported "from 64", one used from 65 "from
  256"; from 256 / 257: "256" / "1024"; from 1024 it is reported, from 1025 (the model runs up to 1024) it fails.
- `MOVED_AT_MOST = 16`: at each length, at most 16 parameters with no gradient are tried as top-k choices (changing
  them moves the output); 16 choices are all found at 64, a 17th at the next length, 256.
- `MOVES = 1e-6`: a change moves the output when it moves an element by more than 1e-6 x the output's RMS. A
  no-gradient parameter whose change moves the output by 3e-6 of its RMS past length 64 is a choice (warn), one
  that moves it by 3e-7 is not shown to be used (fail).

The model: token and position embeddings (1,024 positions: it does not run past that) and one bidirectional
attention layer whose output is the model's. Its extra parameters act only from a length: `late`, a bias added from
`start` on (it gets a gradient there); `picks`, an indexer's vectors, each choosing 32 of the keys for a copy of the
scores, the copies' outputs averaged (no gradient, a top-k choice: every key of a sequence of 32 or fewer);
`nudge`, added without gradient from `start` on, moving the output by `eps` x its RMS once changed. Each test runs in
well under a second on CPU.

From the seed-21 sample (000bb4a): the evidence names at most 8 such parameters and marks more with " ..."; and the
backward that finds modules whose output gets no gradient watches only outputs that carry one (an indexer's integer
top-k choice beside a zero-initialised ReZero branch, `IndexedModel`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

D, VOCAB, CONTEXT, KEYS = 16, 32, 1024, 32  # width, vocabulary, positions the model runs at, keys an indexer keeps


class LateAttention(nn.Module):
    """Single-head bidirectional attention with parameters that act only from a length (see the module docstring)."""

    def __init__(self, start: int | None = None, picks: int = 0, eps: float | None = None):
        super().__init__()
        self.start, self.eps = start, eps
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.late = nn.Parameter(torch.randn(D) * 0.1) if start is not None and eps is None else None
        self.picks = nn.ParameterList(nn.Parameter(torch.randn(D)) for _ in range(picks))
        if eps is not None:
            self.nudge = nn.Parameter(torch.full((D,), 10.0))
            self.register_buffer("nudge0", torch.full((D,), 10.0))

    def forward(self, x):
        B, T, _ = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).chunk(3, -1)  # each (B, T, D)
        scores = q @ k.transpose(-1, -2) / D ** 0.5  # (B, T, T)
        if len(self.picks) and T > KEYS:  # per pick, a copy of the scores over the KEYS keys it ranks highest
            P = len(self.picks)
            kept = (x.detach() @ torch.stack(list(self.picks)).T).topk(KEYS, 1).indices  # (B, KEYS, P): no gradient
            hidden = torch.full((B, T, P), float("-inf"), dtype=x.dtype).scatter(1, kept, 0.0)  # (B, T keys, P)
            scores = scores[:, None] + hidden.permute(0, 2, 1)[:, :, None, :]  # (B, P, T, T)
            out = self.proj((scores.softmax(-1) @ v[:, None]).mean(1))  # (B, P, T, D) -> (B, T, D)
        else:
            out = self.proj(scores.softmax(-1) @ v)  # (B, T, D)
        if self.start is not None and T >= self.start:
            if self.late is not None:
                out = out + self.late
            else:  # moves every element by eps x the output's RMS once `nudge` is changed; no gradient
                changed = (self.nudge.detach() - self.nudge0).abs().max().clamp(max=1.0)
                out = out + self.eps * out.detach().square().mean().sqrt() * changed
        return out


class LateModel(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        seed_rng(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CONTEXT, D)  # past CONTEXT tokens: IndexError
        self.attn = LateAttention(**kw)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        return self.attn(self.wte(input_ids) + self.wpe(torch.arange(T)))  # (B, T, D)


def flow(**kw):
    return diagnostics.audit_model(LateModel(**kw), detectors=["gradient_flow"]).result("gradient_flow")


# ---- LONGER = (64, 256, 1024) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("start, found", [(64, 64), (65, 256), (256, 256), (257, 1024), (1024, 1024)])
def test_a_parameter_used_from_a_length_is_found_at_the_first_of_64_256_1024_that_reaches_it(start, found):
    """Each of LONGER's lengths from both sides: a parameter used from exactly that length is found there, one used
    from the next token on at the next length (x10 or x0.1 of any of the three moves or loses the length it is found
    at: (640, ...) finds 64's at 640, (6, ...) skips to 256, (64, 2560, ...) stops at 2,560 where the model does not
    run, (64, 25, ...) finds 256's at 1024, (..., 10240) stops, (..., 102) never reaches 1,024)."""
    result = flow(start=start)
    assert result.verdict == "warn", result
    assert f"but do at {found}: used only on longer sequences" in result.message, result
    assert f"attn.late (from {found}; not at " in result.evidence, result


def test_a_parameter_used_only_past_the_last_length_the_model_runs_at_fails():
    """The twin of start=1024 just outside: from 1,025 on the model never uses it at a length it runs at (1,024 is
    the last; 2,560 raises), so it is not shown to be used: a fail naming it."""
    result = flow(start=CONTEXT + 1)
    assert result.verdict == "fail", result
    assert "attn.late" in result.evidence, result


@pytest.mark.parametrize("picks", [8, 9])
def test_the_evidence_names_8_parameters_used_from_a_length_and_marks_any_more(picks):
    """`" ..." if len(longer) > 8`: 8 top-k choices found at 64 are all named, nothing left out; a 9th is not named and
    the list ends in " ..." (`>=` would mark 8 named as if one were missing)."""
    result = flow(picks=picks)
    assert result.verdict == "warn" and f"{picks} of " in result.message, result
    last = "attn.picks.7 (from 64; not at 16)" + (" ..." if picks > 8 else "") + "; a sparse-attention indexer"
    assert last in result.evidence and "attn.picks.8" not in result.evidence, result.evidence


# ---- MOVED_AT_MOST = 16 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("picks, lengths", [(16, "64"), (17, "64, 256")])
def test_at_most_16_choices_are_tried_at_a_length_and_a_17th_at_the_next(picks, lengths):
    """16 top-k choices with no gradient are all found at 64 (at MOVED_AT_MOST // 10 = 1, one a length: the fourth
    is never tried and fails); a 17th is tried at the next length, 256 (at x10 it would be found at 64 too)."""
    result = flow(picks=picks)
    assert result.verdict == "warn", result
    assert f"{picks} of " in result.message and f"but do at {lengths}: used only" in result.message, result


# ---- MOVES = 1e-6 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps, expected", [(3e-6, "warn"), (3e-7, "fail")])
def test_a_choice_moves_the_output_by_more_than_1e_6_of_its_rms(eps, expected):
    """A no-gradient parameter that moves the output by 3e-6 of its RMS from length 64 on is a choice used there (a
    warn; at MOVES x10 = 1e-5 it would not be shown to be used: a fail); one that moves it by 3e-7, float32's rounding
    of a few ulps, is not shown to be used (a fail; at x0.1 = 1e-7 it would be a choice)."""
    result = flow(start=64, eps=eps)
    assert result.verdict == expected, result
    if expected == "warn":
        assert "but do at 64: used only" in result.message and "attn.nudge (from 64" in result.evidence, result
    else:
        assert "attn.nudge" in result.evidence, result


# ---- _loss_and_outputs: only outputs that carry a gradient are watched -------------------------------------------


class IndexedReZero(nn.Module):
    """Single-head attention whose keys an indexer chooses (a submodule returning top-k indices: no gradient; every
    key of a sequence of 32 or fewer) and, with `rezero`, a ReZero branch `alpha * adapter(x)` (alpha starts at 0, so
    the adapter's output gets a gradient of exactly 0: its parameters are not judged at this initialisation)."""

    class Indexer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D))

        def forward(self, x):
            return (x.detach() @ self.w).topk(min(KEYS, x.shape[1]), 1).indices  # (B, KEYS): integers, no gradient

    def __init__(self, rezero: bool):
        super().__init__()
        self.qkv, self.proj, self.indexer = nn.Linear(D, 3 * D), nn.Linear(D, D), self.Indexer()
        self.adapter = nn.Linear(D, D) if rezero else None
        self.alpha = nn.Parameter(torch.zeros(())) if rezero else None

    def forward(self, x):
        B, T, _ = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).chunk(3, -1)  # each (B, T, D)
        hide = torch.full((B, T), float("-inf")).scatter(1, self.indexer(x), 0.0)  # (B, T keys): 0 where chosen
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + hide[:, None, :]  # (B, T, T)
        out = self.proj(scores.softmax(-1) @ v)  # (B, T, D)
        return out + self.alpha * self.adapter(x) if self.adapter is not None else out


class IndexedModel(nn.Module):
    def __init__(self, rezero: bool):
        super().__init__()
        seed_rng(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CONTEXT, D)
        self.attn = IndexedReZero(rezero)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        return self.attn(self.wte(input_ids) + self.wpe(torch.arange(T)))  # (B, T, D)


@pytest.mark.parametrize("rezero", [True, False])
def test_an_output_without_gradient_is_not_watched_and_a_zeroed_branch_beside_it_is_still_not_judged(rezero):
    """`path not in outputs and isinstance(o, Tensor) and o.requires_grad`: the indexer's integer output is not kept
    for the backward that finds modules whose output gets no gradient, so the ReZero adapter beside it is still
    found (not judged) and only the indexer's vector is a warning, used from 64 (`or` keeps the integers, the
    backward raises, and the adapter's parameters fail as getting no gradient); without the branch, the same warning."""
    result = diagnostics.audit_model(IndexedModel(rezero), detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == "warn", result
    assert result.message.startswith(f"1 of {8 if rezero else 5} attention parameters get no gradient at this "
                                     f"length (16), but do at 64"), result
    assert result.evidence.startswith("attn.indexer.w (from 64; not at 16)") and "adapter" not in result.evidence, \
        result
