"""Pins for the survivors of the full mutation run over the small detectors and their shared probes (issue 37:
`benchmarks/mutations.py --all --only detectors/keys.py --only detectors/batch.py --only detectors/weights.py --only
detectors/determinism.py --only detectors/shape.py --only detectors/finite.py --only detectors/locality.py --only
detectors/_stacked.py`, pinned to one commit; then `--only detectors/decoding.py`). As in tests/test_pins.py, each pin has its twin on the same inputs (a
case on each side of the comparison, guard or constant it pins), the numbers quoted as literals; each test says which
mutant it pins. Small layers written here, audits of one detector at small sizes: the file runs in a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

import diagnostics
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._stacked import PADDED, _made, stacked_baseline
from diagnostics.detectors.decoding import _cache_plan


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


def attention(q, k, v, mask=None):
    """Scaled dot-product attention on (B, H, Tq, d) x (B, H, Tk, d), returning (out, weights)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B, H, Tq, d)


def probe_of(layer, seq_len: int, *, causal: bool = False) -> Probe:
    return Probe(make_subject(layer, d_model=16, num_heads=2), causal=causal, scale=None, seq_len=seq_len, seed=0)


# ---- _stacked.stacked_baseline: an output not split along the stacked batch is left whole -----------------------


def time_first(q, k, v, mask=None):
    """The reference with its output's time axis first: (T, H, B, d), not split along the batch."""
    out, weights = attention(q, k, v, mask)  # (B, H, T, d)
    return out.transpose(0, 2), weights  # (T, H, B, d)


def test_a_stacks_baseline_leaves_an_output_whole_whose_first_axis_does_not_split_into_its_copies():
    """stacked_baseline's `out.dim() and out.shape[0] % copies == 0`: the padding stack of a non-causal function holds
    3 copies; a time-first output at T = 8 (8 % 3 = 2) is left whole, (8, 2, 6, 8), where `or` would cut the first
    of 3 uneven chunks, (3, 2, 6, 8). Its twin, the batch-first reference on the same probe, is split: copy 0's batch
    of 2."""
    probe = probe_of(time_first, 8)
    call = stacked_baseline(probe, PADDED)
    assert _made(probe, PADDED).copies == 3
    assert tuple(call.output.out.shape) == (8, 2, 6, 8), call.output.out.shape
    assert tuple(stacked_baseline(probe_of(attention, 8), PADDED).output.out.shape) == (2, 2, 8, 8)


# ---- batch_independence: the branch after a seeded twin of the standard probe -------------------------------------


def zero_without_grad(q, k, v, mask=None):
    """The reference under grad mode (the standard probe, observed), zero without it (the seeded plain calls):
    sequence 0 moves between the two, and the seeded twin of the standard probe is zero everywhere."""
    out, weights = attention(q, k, v, mask)
    return (out if torch.is_grad_enabled() else torch.zeros_like(out)), weights


def test_batch_independence_skips_where_the_seeded_twin_and_the_changed_call_are_zero_everywhere():
    """The guard `change is None` after the standard probe is called again, seeded (L63): the changed call and the
    twin are both zero, so no change can be measured between them: skipped (never firing, the check indexes None and
    errs). Its twin, the reference itself, passes."""
    found = verdict(zero_without_grad, "batch_independence")
    assert (found.verdict, found.message) == ("skip", "not measured: the output is zero or non-finite everywhere, so "
                                                      "a change cannot be measured"), found
    assert verdict(attention, "batch_independence").verdict == "pass"


class NoisyAt:
    """The reference plus 1e-2 of a fresh draw from a generator of its own (the audit's seeding does not reach it) at
    the positions `at` of every sequence: randomness one seed does not pin down."""

    def __init__(self, at):
        self.at, self.gen = at, torch.Generator().manual_seed(0)

    def __call__(self, q, k, v, mask=None):
        out, weights = attention(q, k, v, mask)  # (B, H, T, d)
        noise = torch.zeros_like(out)
        noise[:, :, self.at] = 1e-2 * torch.randn(noise[:, :, self.at].shape, generator=self.gen)
        return out + noise, weights


@pytest.mark.parametrize("at", [slice(0, 1), slice(None)])
def test_batch_independence_calls_randomness_at_one_position_of_sequence_0_randomness(at):
    """check_batch_independence's third reading, `(change[...] > tol).any()` against the seeded twin (L65): noise at
    position 0 alone moves one row of sequence 0 between calls, enough to call the second twin and skip (with `all`,
    every row would have to move, and the one moved row fails the layer as mixing the batch); noise at every position
    skips too."""
    found = verdict(NoisyAt(at), "batch_independence")
    assert (found.verdict, found.message) == ("skip", "not measured: two calls on the same batch differ, so a change "
                                                      "between calls cannot be attributed to the other sequence (see "
                                                      "eval_determinism)"), found


# ---- keys_matter: its draws are independent ---------------------------------------------------------------------


class KeysIgnored:
    """Scores from the values instead of the keys (q @ v^T: the keys ignored), recording the keys of every stacked
    call's baseline copy (its first 2 sequences: the probe's batch), keys_matter's draws and their null twins."""

    def __init__(self, ignores: bool = True):
        self.ignores, self.baselines = ignores, []

    def __call__(self, q, k, v, mask=None):
        if q.shape[0] > 2:
            self.baselines.append(k[:2].clone())
        return attention(q, v if self.ignores else k, v, mask)


def distinct(tensors: list[torch.Tensor]) -> int:
    kept: list[torch.Tensor] = []
    for t in tensors:
        if not any(t.shape == o.shape and torch.equal(t, o) for o in kept):
            kept.append(t)
    return len(kept)


@pytest.mark.parametrize("ignores", [True, False])
def test_keys_matter_reads_the_shared_stack_once_and_then_draws_afresh(ignores):
    """check_keys_matter's `if draw == 0:` (L57): the first draw is the stack shared with query_locality, every later
    draw a baseline of its own, so a layer that ignores its keys is found over 3 independent draws, 3 distinct
    baselines (with `!=` the first draw is fresh and the next two read the one stack: 2 baselines, though the evidence
    says 3 independent draws). Its twin, the reference, passes on the stack alone: one baseline."""
    layer = KeysIgnored(ignores)
    found = verdict(layer, "keys_matter")
    if ignores:
        assert (found.verdict, found.message) == ("fail", "the output does not depend on the keys"), found
        assert "over 3 independent draws" in found.evidence, found
    else:
        assert found.verdict == "pass" and "independent draws" not in found.evidence, found
    assert distinct(layer.baselines) == (3 if ignores else 1), len(layer.baselines)


class Memory(torch.nn.Module):
    """Cross-attention given queries and one memory stream (forward(hidden_states, key_value_states)): its keys and
    values are one input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, hidden_states, key_value_states, mask=None):
        return self.mha(hidden_states, key_value_states, key_value_states, need_weights=False)[0]


@pytest.mark.parametrize("layer", ["one memory stream", "key and value apart"])
def test_keys_matter_packs_keys_and_values_into_sequences_of_one_copy_only_where_both_are_inputs(layer):
    """_plan's `1 < len(streams) <= B` (L134, `B >= len(streams)` at 1cf8d3b): at 16 positions a layer given key and
    value apart has the keys of sequence 0 and the values of sequence 1 changed in one copy, and says so; a layer given
    one memory stream has its keys changed in every sequence, and says that (at 1cf8d3b it was packed too, and its
    evidence named sequence 0 of a change made in both: the run's `B <= len(streams)` mutant gave the right text)."""
    if layer == "one memory stream":
        found = verdict(Memory(), "keys_matter")
        assert found.verdict == "pass" and found.evidence.startswith("changing every key (x1e+06) moved"), found
    else:
        found = verdict(attention, "keys_matter")
        assert found.verdict == "pass", found
        assert found.evidence.startswith("changing every key of sequence 0 (x1e+06) moved"), found.evidence
        assert "; changing every value of sequence 1 (x1000) moved" in found.evidence, found.evidence


# ---- weight_row_sums: weights that do not split into the batch -------------------------------------------------


def one_map(q, k, v, mask=None, *, shared: bool = True):
    """Attention whose softmax is taken over sequence 0's first head only (`shared`), that one (1, 1, T, T) map
    weighing every sequence's and head's values; or over every sequence and head (its twin)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = (scores[:1, :1] if shared else scores).softmax(-1)
    return weights @ v  # (B, H, Tq, d)


@pytest.mark.parametrize("shared", [True, False])
def test_weight_row_sums_skips_weights_that_do_not_split_into_the_batch(shared):
    """check_weight_row_sums' guard `weights.numel() % (B * T * t_k)` (L60): the observed softmax output (1, 1, 16, 16)
    holds 256 weights, not a multiple of the 2 x 16 x 16 a batch of 2 needs: skipped (never firing, the reshape
    raises: an error). Its twin, one map per sequence and head, is judged and passes."""
    found = verdict(lambda q, k, v, mask=None: one_map(q, k, v, mask, shared=shared), "weight_row_sums")
    if shared:
        assert (found.verdict, found.message) == ("skip", "not measured: weights of shape (1, 1, 16, 16) do not split "
                                                          "into batch 2"), found
    else:
        assert found.verdict == "pass" and found.message.startswith("all 64 weight rows sum to 1"), found


# ---- decode_consistency and the cached-decoding plan (detectors/decoding.py, run whole at 1cf8d3b) -----------------


def causal(q, k, v, mask=None, *, zero: bool = False):
    """The reference under a bottom-right causal mask of its own (right while decoding); `zero`: its output zeroed."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    out, weights = attention(q, k, v, torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q))
    return (torch.zeros_like(out) if zero else out), weights


@pytest.mark.parametrize("zero", [True, False])
def test_decode_consistency_skips_an_output_that_is_zero_everywhere(zero):
    """check_decode_consistency's guard `change is None` (L248): a causal layer whose output is zero everywhere gives
    no scale to measure the partial calls against: skipped (never firing, `None > tol` raises: an error). Its twin,
    the same layer unzeroed, passes."""
    found = verdict(lambda q, k, v, mask=None: causal(q, k, v, mask, zero=zero), "decode_consistency", causal=True)
    if zero:
        assert (found.verdict, found.message) == ("skip", "not measured: the output is zero or non-finite everywhere, "
                                                          "so a difference cannot be measured"), found
    else:
        assert found.verdict == "pass", found


@pytest.mark.parametrize("band, plan", [(14, [13, 1, 1, 1]), (15, [8, 1, 1, 3, 3])])
def test_the_cache_plan_steps_across_a_window_only_where_its_rows_span_fewer_than_t_minus_1_positions(band, plan):
    """_cache_plan's `band < T - 1` (L55): at T = 16 rows that span 14 positions leave a window to pass (a prefill of
    13, then the tokens at t = 13, 14 and 15 alone); rows that span 15 leave none, and the plan is the default one
    (half, then 1, 1 and 3, then the rest), as without a pattern (with `<=`: [14, 1, 1])."""
    assert _cache_plan(16, band) == plan
    assert _cache_plan(16, None) == [8, 1, 1, 3, 3]


def raises_without_a_mask(q, k, v, mask=None):
    """The attention above, except that it refuses a call without a mask (as the standard probe of a layer audited not
    causal makes: it passes none)."""
    if mask is None:
        raise ValueError("this layer needs its mask")
    return attention(q, k, v, mask)


@pytest.mark.parametrize("raises", [False, True])
def test_undeclared_causality_says_the_standard_probe_raised_where_it_did(raises):
    """check_undeclared_causality's `if not base.ok` (L269 at 3057bfd, the guard never firing: the weights of a call
    that raised are None, and the skip would say "no (Tq, Tk) weights were returned or observed", blaming the layer's
    weights for its error): a layer whose standard probe raises is not run, and the skip names the error and `runs`.
    Its twin, the same attention taking every call, is measured and passes (no triangle of zeros)."""
    found = verdict(raises_without_a_mask if raises else attention, "undeclared_causality")
    if raises:
        assert found.verdict == "skip", found
        assert found.message == ("not measured: the layer raised on this detector's probe (ValueError: this layer "
                                 "needs its mask); see `runs`"), found.message
    else:
        assert found.verdict == "pass", found
