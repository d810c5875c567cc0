"""`batch_independence`: each sequence's output depends on that sequence only."""

from __future__ import annotations

from dataclasses import replace

import torch

from .._core import Case, Comparison, Inputs, expand_rows, not_run, relative_change, skip
from .._probe import Probe
from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, tolerance
from ._common import invariance_locator, judge_held, no_rows, perturbation_gains
from ._stacked import first_sequence_changed, other_sequence_changed, seeded_call


@detector("batch_independence", "each sequence's output depends on that sequence only: changing another "
          "sequence of the batch, in a separate call, moves nothing",
          targets=("batch and sequence axes mixed (permute or transpose over dim 0)", "normalisation over the batch",
                   "a mask or cache broadcast across sequences"),
          fix="keep the batch axis apart: merge heads with x.transpose(1, 2).reshape(B, T, D), reduce over "
              "dim=-1, never over dim 0 (a layer written for sequence-first (T, B, D) tokens attends across the "
              "batch when given (B, T, D), exactly as this bug does: see docs/auditing-a-layer.md on layouts)",
          locate=invariance_locator("the first op whose output for one sequence moves when only another changes"))
def check_batch_independence(probe: Probe) -> DetectorResult:
    """Two separate calls, so that a layer that mixes the batch is not compared with itself mixed the same way
    (every other invariance check stacks its probes along the batch of one call): the standard probe, and the
    same batch with sequence 1 changed."""
    det, s, B, T = "batch_independence", probe.subject, probe.BATCH, probe.t
    standard = probe.base()
    if not standard.ok:
        return not_run(det, standard)
    base = Inputs(standard.query, standard.key, standard.value)
    # seeded (one draw of any randomness for every seeded call) and not observed: where the standard probe (observed,
    # under grad mode) took another path (nn.MultiheadAttention's inference fast path rounds differently) and sequence
    # 0 moves by that rounding, the seeded twin below is a plain call too, and the changed call is judged against it
    changed, changed_call = other_sequence_changed(probe)

    def call(x: Inputs, label: str):
        return seeded_call(probe, x, standard.allowed, label)

    if not changed_call.ok:
        return not_run(det, changed_call)
    old, new = standard.output.out, changed_call.output.out
    if old.shape != new.shape or old.shape[0] != B:
        return skip(det, f"the output {tuple(old.shape)} does not keep the batch")
    if old.dim() < 3:
        return skip(det, no_rows(probe, old))
    change = relative_change(new, old, centred=True)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a change cannot be measured")
    first = torch.zeros(B, change.shape[-1], dtype=torch.bool)  # its rows: T, or the queries of its own it keeps
    first[0] = True
    tol = tolerance(UNCHANGED, s.dtype)
    if bool((change[expand_rows(first, change)] > tol).any()):
        # sequence 0 moved: mixing, or randomness (or the other path's rounding), which would read as mixing and is
        # not ours to judge. The same batch again, seeded and called as the changed call was (only a moved layer pays
        # it): the same numbers as the standard probe, a deterministic layer that mixes; other numbers, and the
        # changed call is judged against this twin, and a second twin tells randomness that one seed pins down from
        # what it does not
        again = call(base, "the standard probe again, seeded")
        if not again.ok:
            return not_run(det, again)
        if not torch.equal(old.nan_to_num(), again.output.out.nan_to_num()):
            old = again.output.out
            change = relative_change(new, old, centred=True)
            if change is None:
                return skip(det, "the output is zero or non-finite everywhere, so a change cannot be measured")
            if bool((change[expand_rows(first, change)] > tol).any()):
                twin = call(base, "the standard probe again, seeded, a second time")
                if not twin.ok:
                    return not_run(det, twin)
                if not torch.equal(old.nan_to_num(), twin.output.out.nan_to_num()):
                    return skip(det, "two calls on the same batch differ, so a change between calls cannot be "
                                     "attributed to the other sequence (see eval_determinism)")
    comparison = Comparison([Case(changed, hold=first, move=~first, when=f"when only sequence 1 changed "
                                  f"(x{perturbation_gains(probe)[0]:g}, a separate call)")], [change], tol, changed_call, base)
    verdict = judge_held(det, comparison, probe, what="outputs of sequence 0",
                         fail_message="a sequence's output depends on another sequence of the batch",
                         pass_message="each sequence's output depends on that sequence only")
    if verdict.verdict != "pass":
        return verdict
    # the other way too: sequence 0 changed, the others held (a layer that reads the first sample's keys for every
    # sample, or broadcasts row 0 of a batch-wide tensor, leaves sequence 0 alone and moves the rest)
    moved_first, first_call = first_sequence_changed(probe)
    if not first_call.ok:
        return not_run(det, first_call)
    again = relative_change(first_call.output.out, old, centred=True)
    if again is None or first_call.output.out.shape != old.shape:
        return verdict

    def the_other_way(change_back):
        back = Comparison([Case(moved_first, hold=~first, move=first, when=f"when only sequence 0 changed "
                                f"(x{perturbation_gains(probe)[0]:g}, a separate call)")], [change_back], tol,
                          first_call, base)
        return judge_held(det, back, probe, what="outputs of the other sequences",
                          fail_message="a sequence's output depends on another sequence of the batch (on the first)",
                          pass_message="each sequence's output depends on that sequence only (either way)")

    other_way = the_other_way(again)
    if other_way.verdict == "fail":  # judged against the standard probe seeded and called as this call was (a path
        # that rounds otherwise under observation, nn.MultiheadAttention's fast path, moves nothing then)
        twin = call(base, "the standard probe again, seeded")
        if not twin.ok:
            return not_run(det, twin)
        again = relative_change(first_call.output.out, twin.output.out, centred=True)
        if again is None:
            return verdict
        other_way = the_other_way(again)
    return other_way if other_way.verdict == "fail" else replace(
        verdict, message="each sequence's output depends on that sequence only (either way)",
        evidence=f"{verdict.evidence}; {other_way.evidence}")
