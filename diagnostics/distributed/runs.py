"""sharded_runs: every rank of every group finishes every job: a rank that raises, hangs or exits is named with its
error (the check of a length the world size does not divide excepted: refusing it is right, see `sharded_lengths`)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from ._context import UNEVEN, ShardedContext
from ._ranks import RankFailure

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
    own = [(W, f) for W, f in failures if f.primary] or failures
    first_W, first = own[0]
    seen: dict = {}  # one line per (world size, rank, failure), with the jobs it stopped
    for W, f in own:
        seen.setdefault((W, f.rank, f.kind, f.error), []).append(f.job)
    lines = [f"{W} ranks: {RankFailure(rank, jobs[0], kind, error).describe()}"
             + (f" (and in {', '.join(map(repr, jobs[1:]))}, each in a fresh group)" if jobs[1:] else "")
             for (W, rank, kind, error), jobs in seen.items()]
    others = len(failures) - len(own)
    if others:
        lines.append(f"{others} other rank failure{'s' if others != 1 else ''} followed from these (peers lost or "
                     f"stopped)")
    return DetectorResult(ID, "fail", f"{first.describe()} at {first_W} ranks", evidence="; ".join(lines), fix=FIX)
