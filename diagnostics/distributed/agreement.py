"""sharded_ranks_agree: a layer that returns the whole output on every rank (takes="full") returns the same one on
every rank: a rank that disagrees feeds the next layer another input than its peers (and data-parallel replicas drift)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ..model._tolerance import scale_of, worst_change
from ._context import FORWARD, FULL_OUTPUT, ShardedContext
from ._judge import unmeasured

ID = "sharded_ranks_agree"
FIX = "finish with a collective that leaves every rank the same tensor (an all-reduce or all-gather), in one order"


@detector(ID, "every rank returns the same whole output (a layer that takes the whole sequence)", fix=FIX,
          needs=(FULL_OUTPUT,), scope="sharded",
          unlocated="names the ranks that disagree; the layer runs in other processes")
def check_ranks_agree(ctx: ShardedContext) -> DetectorResult:
    tol, worst, lines, bad = tolerance(UNCHANGED, ctx.dtype), 0.0, [], []
    for W in ctx.world_sizes:
        answers = ctx.answers(W, FORWARD)
        if answers is None:
            continue
        base = answers[0].double()
        scale = scale_of(base)
        changes = [worst_change(a.double(), base, scale) if a.shape == base.shape else float("inf")
                   for a in answers[1:]]
        off = [r for r, c in enumerate(changes, start=1) if c > tol]
        worst = max([worst, *changes])
        bad += [(W, r) for r in off]
        lines.append(f"{W} ranks: {len(off)} / {W - 1} ranks differ from rank 0"
                     + (f" (rank {max(range(1, W), key=lambda r: changes[r - 1])} by {max(changes):.3g} of the "
                        f"outputs' RMS)" if changes else ""))
    notes = unmeasured(ctx, FORWARD)
    if not lines:
        return DetectorResult(ID, "skip", "; ".join(notes) or "not measured")
    evidence = "; ".join(lines + notes) + f" (up to {tol:.0e} allowed for {dtype_name(ctx.dtype)})"
    if bad:
        return DetectorResult(ID, "fail", "the ranks return different outputs: " +
                              ", ".join(f"rank {r} at {W} ranks" for W, r in bad[:6]), value=worst, threshold=tol,
                              evidence=evidence, fix=FIX)
    return DetectorResult(ID, "pass", "every rank returns the same output", value=worst, threshold=tol,
                          evidence=evidence)
