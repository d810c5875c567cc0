"""`eval_determinism`: two eval-mode calls on the same input give the same output."""

from __future__ import annotations

import torch

from .._core import Case, Comparison, Inputs, held, not_run, relative_change, skip
from .._probe import Probe
from .._registry import DETECTORS, detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, tolerance
from ._common import invariance_locator, judge


@detector("eval_determinism", "two eval-mode calls on the same input give the same output",
          targets=("dropout left on in eval mode",), fix="F.dropout(weights, p, training=self.training)",
          locate=invariance_locator("the first op whose output differs between two eval-mode calls on the same input", same_input=True))
def check_eval_determinism(probe: Probe) -> DetectorResult:
    det, base = "eval_determinism", probe.base()
    if not base.ok:
        return not_run(det, base)
    # observed like the standard probe, so that both calls take the same path (nn.MultiheadAttention has a
    # fused fast path for inference without grad, which rounds differently in float16)
    again = probe.call(base.query, base.key, base.value, base.allowed, label="the standard probe, again",
                       observe=True)
    if not again.ok:
        return not_run(det, again)
    B, t_q = base.query.shape[0], base.query.shape[probe.subject.time_dim]
    change = relative_change(again.output.out, base.output.out, centred=True)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
    everywhere = torch.ones(B, t_q, dtype=torch.bool)
    comparison = Comparison([Case(Inputs(base.query, base.key, base.value), everywhere,
                                  "between two eval-mode calls on the same input")], [change],
                            tolerance(UNCHANGED, probe.subject.dtype), again)
    bad, worst, text, _ = held(comparison, probe, what="outputs")
    return judge(det, bad > 0, "two eval-mode calls on the same input differ (randomness left on)",
                  "eval-mode calls are deterministic", value=worst, threshold=comparison.tol, evidence=text,
                  replay=(comparison,))


__all__ = ["DETECTORS"]
