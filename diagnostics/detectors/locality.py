"""`query_locality`: each output row depends only on its own query row."""

from __future__ import annotations

import torch

from .._core import Case, Inputs, perturbed
from .._probe import Probe
from .._registry import LONG, SEPARATE_QUERY, detector
from .._result import DetectorResult
from ._common import invariance_locator, judge_held, perturbation_gains, rows
from ._stacked import SEPARATE_STREAMS, stacked, stacked_cases


@detector("query_locality", "each output row depends only on its own query row",
          targets=("self/cross-attention inputs swapped", "heads merged without transpose", "softmax over queries"),
          fix="take Q from the query stream; merge heads with x.transpose(1, 2).reshape(B, T, D)",
          needs=(SEPARATE_QUERY, LONG),
          locate=invariance_locator("the first op whose output at other positions moves when one query changes",
                                    streams=True))
def check_query_locality(probe: Probe) -> DetectorResult:
    comparison = stacked(probe, SEPARATE_STREAMS, "query_locality")
    return judge_held("query_locality", comparison, probe, what="other output rows",
                      fail_message="an output row depends on other queries than its own",
                      pass_message="each output row depends only on its own query")


@stacked_cases(SEPARATE_STREAMS, "query_locality")
def query_cases(probe: Probe, base: Inputs) -> tuple[list[Case], str]:
    """Query T // 2 changed alone, in every sequence; every other row held."""
    B, T = probe.BATCH, probe.t
    p = T // 2
    moved = torch.arange(T) == p
    # gain 1000 (100 in float16): the other rows' weights do not depend on query p in a correct layer, however hard
    # it is pushed; in a layer that mixes queries, a large change shows even where logits are tiny
    gains = perturbation_gains(probe)
    cases = [Case(x, hold=rows(B, T, ~moved), move=rows(B, T, moved), when=f"when only query t={p} changed "
                  f"(x{gain:g})") for gain, x in zip(gains, perturbed(probe, base, moved, ("query",), gains=gains))]
    return cases, f"query t={p} changed"
