"""`eval_determinism`: two eval-mode calls on the same input give the same output."""

from __future__ import annotations

import torch

from .._core import Case, Comparison, Inputs, expand_rows, held, not_run, relative_change, skip
from .._probe import Probe
from .._registry import DETECTORS, detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, tolerance
from ._common import invariance_locator, judge, no_rows, result
from ._stacked import other_sequence_changed


STATE_FIX = ("a state kept between calls (a cache made on the first) must give what the first call computed: the "
             "cached path returns the cached value as the path that made it returns it, never added to again")


@detector("eval_determinism", "two eval-mode calls on the same input give the same output",
          targets=("dropout left on in eval mode",), fix="F.dropout(weights, p, training=self.training)",
          locate=invariance_locator("the first op whose output differs between two eval-mode calls on the same input",
                                    same_input=True, state_fix=STATE_FIX))
def check_eval_determinism(probe: Probe) -> DetectorResult:
    """First on batch_independence's call (the standard probe's batch with sequence 1 changed, seeded apart from
    the standard probe): sequence 0, the same input in a second call, came out the same, and no call more is made.
    Where it moved (randomness, a layer that mixes the batch, or another path's rounding), the standard probe once
    more, as it was called, and the verdict is that call's."""
    det, base = "eval_determinism", probe.base()
    if not base.ok:
        return not_run(det, base)
    B, t_q = base.query.shape[0], base.query.shape[probe.subject.time_dim]
    if base.output.out.dim() < 3:
        return skip(det, no_rows(probe, base.output.out))
    tol = tolerance(UNCHANGED, probe.subject.dtype)
    changed, other = other_sequence_changed(probe)
    if other.ok and other.output.out.shape == base.output.out.shape and base.output.out.shape[0] == B > 1:
        change = relative_change(other.output.out, base.output.out, centred=True)
        rows = change.shape[-1] if change is not None else t_q  # t_q, or the queries of its own it keeps
        first = torch.zeros(B, rows, dtype=torch.bool)
        first[0] = True
        if change is not None and not bool((change[expand_rows(first, change)] > tol).any()):
            comparison = Comparison([Case(changed, first, "in a second call (batch_independence's: sequence 1 "
                                                          "changed, sequence 0 the same input)")], [change], tol, other)
            _, worst, text, _ = held(comparison, probe, what="outputs of sequence 0")
            return result(det, "pass", "eval-mode calls are deterministic", value=worst, threshold=tol,
                          evidence=text)
    # observed like the standard probe, so that both calls take the same path (nn.MultiheadAttention has a
    # fused fast path for inference without grad, which rounds differently in float16)
    again = probe.call(base.query, base.key, base.value, base.allowed, label="the standard probe, again",
                       observe=True)
    if not again.ok:
        return not_run(det, again)
    change = relative_change(again.output.out, base.output.out, centred=True)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
    everywhere = torch.ones(B, probe.subject.own_queries or t_q, dtype=torch.bool)  # its rows: T, or its queries
    comparison = Comparison([Case(Inputs(base.query, base.key, base.value), everywhere,
                                  "between two eval-mode calls on the same input")], [change], tol, again)
    bad, worst, text, _ = held(comparison, probe, what="outputs")
    return judge(det, bad > 0, "two eval-mode calls on the same input differ (randomness left on, or a state one "
                               "call leaves for the next)",
                  "eval-mode calls are deterministic", value=worst, threshold=comparison.tol, evidence=text,
                  replay=(comparison,))


__all__ = ["DETECTORS"]
