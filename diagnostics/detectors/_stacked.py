"""Probes several detectors read. Stacked probes: one call of the layer on a baseline and the perturbations of several detectors, each detector's
cases in copies of the batch of their own, so that the baseline (a forward pass of work per comparison) is paid
once. query_locality and keys_matter share the baseline with separate query, key and value streams; mask_honoured
and future_leakage that with a padding mask (weight_row_sums reads its baseline's weights); decode_consistency's
full pass is the baseline of future_leakage's cuts without a mask. And decode_consistency's partial calls after
it, whose last (the newest queries over every key) is output_shape's call with Tq != Tk for a causal layer. And
batch_independence's call with sequence 1 changed, whose sequence 0 (the standard probe's input in a second call) is
eval_determinism's first reading.

A detector reads the same numbers whichever detectors run: a stack's recipe is fixed (its baseline, then every
registered detector's cases, in the order the detector modules register them), drawn from the stack's own random
stream and called once per audit (`Probe.shared`), also when only one of its readers is chosen. What a detector
reads is a `Comparison` of its own cases against the shared baseline: its verdict, its evidence and its localiser
see only those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .._core import Case, Comparison, Inputs, compared, perturbed, stacked_call
from .._probe import Call, Probe
from .._result import DetectorResult
from .._subject import Output
from ._common import logit_gain, perturbation_gains


@dataclass(frozen=True)
class Stack:
    """A stacked probe: `baseline(probe) -> Inputs` and, per detector, `cases(probe, base) -> (cases, label)`;
    `label(probe) -> str`, what the baseline copy is where a reader reads it as a probe of its own (the call's label
    names it first)."""

    name: str
    baseline: Callable = field(repr=False)
    cases: dict[str, Callable] = field(default_factory=dict, repr=False)
    label: Callable | None = field(default=None, repr=False)


def stack(name: str, baseline: Callable, *, label: Callable | None = None) -> Stack:
    return Stack(name, baseline, label=label)


def stacked_cases(into: Stack, det: str):
    """Register the decorated `(probe, base) -> (list[Case], label)` as `det`'s part of the stack `into`."""
    def register(builder: Callable) -> Callable:
        if det in into.cases:
            raise ValueError(f"{det!r} has cases in the stack {into.name!r} already")
        into.cases[det] = builder
        return builder

    return register


def stacked(probe: Probe, of: Stack, det: str) -> Comparison | DetectorResult:
    """`det`'s cases compared with the stack's baseline, from the one call of the stack (made on first use); the
    skip every reader gets when that call raised or cannot be compared."""
    made = _made(probe, of)
    whole = made.whole
    if isinstance(whole, DetectorResult):
        return replace(whole, detector=det)
    start, stop = made.parts[det]
    return replace(whole, cases=whole.cases[start:stop], changes=whole.changes[start:stop], first=1 + start,
                   copies=made.copies)


def stacked_baseline(probe: Probe, of: Stack) -> Call:
    """The stack's call as far as its baseline goes (copy 0 of the batch: its inputs, mask and output), for a reader
    with no cases of its own; the call itself where it raised. An output not split along the stacked batch is left
    whole (copy 0's part cannot be told): its shape says so to the reader."""
    made = _made(probe, of)
    base, call, copies = made.base, made.call, made.copies
    if not call.ok:
        return call
    B = base.query.shape[0]
    out, weights = call.output.out, call.output.weights
    if out.dim() and out.shape[0] % copies == 0:
        out = out.chunk(copies)[0]
    if weights is not None and weights.dim() and weights.shape[0] % copies == 0:
        weights = weights.chunk(copies)[0]
    elif weights is not None:
        weights = None  # not split along the batch: not this copy's
    t_q, t_k = base.query.shape[probe.subject.time_dim], base.key.shape[probe.subject.time_dim]
    return Call(base.query, base.key, base.value, probe.allowed(B, t_q, t_k, base.extra), Output(out, weights), None,
                label=call.label, parts=call.parts)


def stacked_inputs(probe: Probe, of: Stack) -> Inputs:
    """The stack's baseline inputs (copy 0 of the batch), its extra mask included: what `stacked_baseline`'s call was
    given before the audit's own masks (causal, a declared pattern) were added."""
    return _made(probe, of).base


@dataclass
class _Made:
    """The one call of a stack: its baseline, the call, every case compared with the baseline (or the skip), where
    each reader's cases are (their indices among the cases), and the copies of the batch the call holds."""

    base: Inputs
    call: Call
    whole: Comparison | DetectorResult
    parts: dict[str, tuple[int, int]]
    copies: int


def _made(probe: Probe, of: Stack) -> _Made:
    return probe.shared(of.name, lambda: _call(probe, of))


def _call(probe: Probe, of: Stack) -> _Made:
    base: Inputs = of.baseline(probe)
    cases: list[Case] = []
    parts: dict[str, tuple[int, int]] = {}
    labels = [of.label(probe)] if of.label is not None else []
    for det, builder in of.cases.items():
        mine, label = builder(probe, base)
        parts[det] = (len(cases), len(cases) + len(mine))
        cases += mine
        labels.append(label)
    readers = tuple((det, 1 + start, 1 + stop) for det, (start, stop) in parts.items())
    call = stacked_call(probe, base, cases, label="; ".join(label for label in labels if label), parts=readers)
    return _Made(base, call, compared(probe, call, base, cases), parts, 1 + len(cases))


def separate_streams(probe: Probe) -> Inputs:
    """Query, key and value drawn apart (key and value one stream where the layer takes one memory)."""
    B, T = probe.BATCH, probe.t
    q = probe.make(B, T)
    k, v = probe.make(B, T), probe.make(B, T)  # key and value inputs apart, even for modules
    return Inputs(q, k, v) if getattr(probe.subject, "separate_value", True) else Inputs(q, k, k)


SEPARATE_STREAMS = stack("separate streams", separate_streams)
"""query_locality's and keys_matter's: one query changed; the keys of one sequence and the values of another."""



def padded(probe: Probe) -> Inputs:
    """A padding mask (trailing keys blocked for every query, key 0 always kept: see `Probe.padding`) on the streams of
    `Probe.streams` (one stream for self forms and causal audits)."""
    B, T = probe.BATCH, probe.t
    pad = probe.padding(B, T, T)  # (B, Tq, Tk)
    return Inputs(*probe.streams(B, T), pad)


PADDED = stack("padding mask", padded)
"""mask_honoured's padding scenario (its padded keys changed, and key 0 alone) and, for a causal audit, future_leakage's
cut at 0 under a padding mask."""


def decode_splits(T: int) -> list[int]:
    """How many of the last queries each partial call of decode_consistency takes: three calls at every length."""
    return [min(n, T - 1) for n in (1, 3, T - T // 3)]


def decoding_inputs(probe: Probe) -> Inputs:
    """decode_consistency's tokens: scaled by `logit_gain`, so that attention is neither uniform (std-0.02 weights)
    nor one-hot (rounding-bound); one stream for modules (a causal audit's self-attention), three for a function
    (as `Probe.streams` draws them for it with cross=True). Unscaled below 3 tokens, where no decoding check reads
    them (LONGER) and future_leakage's one perturbed position is its only response: a query over two keys scaled to
    a logit spread of ~2 may give its own key ~1% of its weight, and the perturbation may then take the rest, its
    output staying within rounding. Measured on the reference, a one-stream wrapper of it, nn.MultiheadAttention and
    F.scaled_dot_product_attention (1-8 heads of width 1-64, float32, bfloat16 and float16, torch's and GPT-2's init,
    seeds 0-5): scaled, 34 of 888 at T = 2 did not respond (none unscaled), and none of 1776 at T = 3 and 4."""
    B, T = probe.BATCH, probe.t
    g = logit_gain(probe) if T >= 3 else 1.0
    if probe.subject.form == "function":
        return Inputs(g * probe.make(B, T), g * probe.make(B, T), g * probe.make(B, T))
    x = g * probe.make(B, T)
    return Inputs(x, x, x)


DECODING = stack("decoding's full pass", decoding_inputs, label=lambda probe: f"the full pass, {probe.t} tokens")
"""decode_consistency's full pass (copy 0: the rows its partial calls must give; their keys and values) and, for a
causal audit, future_leakage's cuts without a mask. Made for causal audits only (all its readers need one)."""


def decoding_calls(probe: Probe) -> list[tuple[int, Call]]:
    """decode_consistency's calls, made once per audit: [(T, the full pass over T tokens: the baseline copy of the
    DECODING stack), then (n, the last n queries over all T keys) for each split], up to the first that raises. The
    partial calls need a query apart from its keys (a layer given one stream has none): none on such a layer, nor
    below 3 tokens (decode_consistency's LONGER)."""
    return probe.shared("decoding", lambda: _decoding_calls(probe))


def _decoding_calls(probe: Probe) -> list[tuple[int, Call]]:
    s, B, T = probe.subject, probe.BATCH, probe.t
    full = stacked_baseline(probe, DECODING)
    calls = [(T, full)]
    q, k, v = full.query, full.key, full.value
    t = s.time_dim
    for n in decode_splits(T) if full.ok and s.separate_kv and T >= 3 else ():
        tail = q.narrow(t, T - n, n).clone()
        calls.append((n, probe.call(tail, k, v, probe.allowed(B, n, T), label=f"the last {n} queries over {T} keys")))
        if not calls[-1][1].ok:
            break
    return calls


def other_sequence_changed(probe: Probe) -> tuple[Inputs, Call]:
    """batch_independence's call, which eval_determinism reads too: the standard probe's batch with sequence 1 changed
    (every position of every stream), in a call of its own (`seeded_call`), and its inputs. Made once per audit; the
    standard probe must have run."""
    return probe.shared("sequence 1 changed", lambda: _other_sequence_changed(probe))


def _other_sequence_changed(probe: Probe) -> tuple[Inputs, Call]:
    standard = probe.base()
    base = Inputs(standard.query, standard.key, standard.value)
    other = torch.zeros(probe.BATCH, probe.t, dtype=torch.bool)
    other[1:] = True  # every position of every sequence but the first
    # pushed hard (perturbation_gains): a correct layer's sequence 1 moves far above rounding whatever the initialisation
    # (at d_model 1 in bfloat16 a fresh draw moved it by less than the tolerance), and sequence 0 holds however hard
    [changed] = perturbed(probe, base, other, ("query", "key", "value"), gains=perturbation_gains(probe))
    return changed, seeded_call(probe, changed, standard.allowed, "the standard probe, sequence 1 changed")


def first_sequence_changed(probe: Probe) -> tuple[Inputs, Call]:
    """batch_independence's call the other way: the standard probe's batch with sequence 0 changed alone (every
    position of every stream, pushed as hard), in a call of its own."""
    standard = probe.base()
    base = Inputs(standard.query, standard.key, standard.value)
    first = torch.zeros(probe.BATCH, probe.t, dtype=torch.bool)
    first[0] = True
    [changed] = perturbed(probe, base, first, ("query", "key", "value"), gains=perturbation_gains(probe))
    return changed, seeded_call(probe, changed, standard.allowed, "the standard probe, sequence 0 changed")


def seeded_call(probe: Probe, x: Inputs, allowed, label: str) -> Call:
    """A plain call with the layer's randomness seeded from the audit's own seed for these calls, one draw for every
    call so seeded (the audit restores the RNG). Not `Probe.seed`: a user who seeded torch with it just before the
    audit (seed 0 is both defaults) would give the unseeded standard probe the same draw, and randomness would hide."""
    probe.seed_layer_rng(SEEDED_CALLS ^ probe.seed)
    return probe.call(x.query, x.key, x.value, allowed, label=label)


SEEDED_CALLS = 0x5EED_CA11_0F_5EC5  # knob: a salt for the seeded calls' draw, no threshold (x10, x0.1: no verdict moves)
"""Mixed into the audit's seed for `seeded_call`: a seed nobody passes to torch.manual_seed by hand."""
