"""sharded_runs: every rank of every group finishes every job: a rank that raises, hangs or exits is named with its
error (the check of a length the world size does not divide excepted: refusing it is right, see `sharded_lengths`)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from ._context import UNEVEN, ShardedContext

ID = "sharded_runs"
FIX = "make every rank run the layer to the end: see the rank's exception (or why it hung) in the evidence"


@detector(ID, "every rank of the sharded layer runs to the end of every check, at every world size", fix=FIX,
          scope="sharded", unlocated="the rank's own exception names the line (quoted in the evidence)")
def check_sharded_runs(ctx: ShardedContext) -> DetectorResult:
    failures = [(W, f) for W in ctx.world_sizes for f in ctx.failures.get(W, []) if f.job != UNEVEN]
    if not failures:
        groups = sum(len(ctx.groups.get(W, [])) for W in ctx.world_sizes)
        return DetectorResult(ID, "pass", f"every rank ran every check at {', '.join(map(str, ctx.world_sizes))} "
                                          f"ranks ({groups} group{'s' if groups != 1 else ''} started)")
    first_W, first = failures[0]
    cause = [f for W, f in failures if f.kind != "stopped"]
    return DetectorResult(ID, "fail", f"{first.describe()} at {first_W} ranks",
                          evidence="; ".join(f"{W} ranks: {f.describe()}" for W, f in failures)
                          + ("" if cause else "; no rank said why"), fix=FIX)
