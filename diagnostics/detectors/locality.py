"""`query_locality`: each output row depends only on its own query row."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._core import Case, Inputs, perturbed
from .._probe import Probe
from .._registry import LONG, SEPARATE_QUERY, detector
from .._result import DetectorResult
from .._tracing import short
from ._common import base_trace, invariance_locator, judge_held, perturbation_gains, rows
from ._stacked import SEPARATE_STREAMS, stacked, stacked_cases


@detector("query_locality", "each output row depends only on its own query row",
          targets=("self/cross-attention inputs swapped", "heads merged without transpose", "softmax over queries"),
          fix="take Q from the query stream; merge heads with x.transpose(1, 2).reshape(B, T, D)",
          needs=(SEPARATE_QUERY, LONG),
          locate=invariance_locator("the first op whose output at other positions moves when one query changes",
                                    streams=True))
def check_query_locality(probe: Probe) -> DetectorResult:
    comparison = stacked(probe, SEPARATE_STREAMS, "query_locality")
    verdict = judge_held("query_locality", comparison, probe, what="other output rows",
                         fail_message="an output row depends on other queries than its own",
                         pass_message="each output row depends only on its own query")
    if verdict.verdict != "fail" or isinstance(comparison, DetectorResult):
        return verdict
    reach, where = convolved_queries(probe)
    if not reach:
        return verdict
    # the queries convolved along the sequence by design (Primer's multi-DConv-head attention, a convolutional query
    # projection): the rows the convolution mixes query p into may move; every row past its reach must not
    B, T, p = probe.BATCH, probe.t, probe.t // 2
    near = rows(B, T, (torch.arange(T) - p).abs() <= reach)
    beyond = replace(comparison, cases=[replace(c, hold=c.hold & ~near) for c in comparison.cases])
    said = (f"the queries are convolved along the sequence before the attention ({where}: {reach} token"
            f"{'s' if reach > 1 else ''} either side), so the rows within that reach of the changed query move by "
            f"design; ")
    again = judge_held("query_locality", beyond, probe, what=f"output rows more than {reach} from the changed query",
                       fail_message=f"an output row depends on queries beyond the reach ({reach}) of the convolution "
                                    f"that mixes them",
                       pass_message=f"each output row depends only on its own query and the {reach} either side that "
                                    f"the convolution along the sequence mixes into it")
    return replace(again, evidence=said + again.evidence)


def convolved_queries(probe: Probe) -> tuple[int, str]:
    """How far (in tokens, either side) the convolutions along the sequence on the queries' path mix them, summed
    over those convolutions, and where the first is (file:line), from the standard call's trace: a convolution whose
    input depends on the queries and runs along the tokens, (N, C, T) with a kernel of K > 1 (reach (K - 1) x its
    dilation; the tokens padded by the layer first, up to that reach, or by the convolution), or over a (N, C, H, W) map of the T tokens (reach (K_h - 1) x W + K_w - 1 in their flat order).
    (0, "") where there is none."""
    trace, T = base_trace(probe), probe.t
    reach, where = 0, ""
    for op in trace.ops:
        if op.short != "convolution" or "query" not in op.sources or len(op.args) < 6:
            continue
        x, w, dilation = op.args[0], op.args[1], op.args[5]
        if not isinstance(x, Tensor) or not isinstance(w, Tensor):
            continue
        if x.dim() == 3 and w.shape[-1] > 1 and T <= x.shape[-1] <= T + (w.shape[-1] - 1) * int(dilation[0]):
            step = (w.shape[-1] - 1) * int(dilation[0])  # the tokens, padded by the layer or by the convolution
        elif x.dim() == 4 and x.shape[-2] * x.shape[-1] == T and w.shape[-2] * w.shape[-1] > 1:
            step = (w.shape[-2] - 1) * int(dilation[0]) * x.shape[-1] + (w.shape[-1] - 1) * int(dilation[-1])
        else:
            continue
        reach += step
        where = where or short(op)
    return reach, where


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
