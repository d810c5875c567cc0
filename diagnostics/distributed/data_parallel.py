"""sharded_data_parallel: with data-parallel replicas declared beside the context parallelism (`data_parallel=`), no
replica's outputs move when only another replica's sequences change. Each replica is a group of adjacent ranks
(rank // cp its replica, rank % cp its context rank); a layer that builds its context-parallel groups with the other
arithmetic (rank % dp) rings its keys with another replica's ranks, and the finding names the replicas and ranks
(`_causes.replica_cause`)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ._causes import REPLICAS_FIX, replica_cause, replica_leaks
from ._context import DATA_PARALLEL, REPLICAS, ShardedContext
from ._judge import named, unmeasured

ID = "sharded_data_parallel"


@detector(ID, "with data-parallel replicas beside context parallelism, no replica's outputs move when only another "
              "replica's sequences change", fix=REPLICAS_FIX, needs=(DATA_PARALLEL,), scope="sharded",
          targets=("rank and sub-group arithmetic with data parallelism beside context parallelism",),
          unlocated="names the replicas and ranks that mixed; the layer runs in other processes")
def check_sharded_data_parallel(ctx: ShardedContext) -> DetectorResult:
    tol = tolerance(UNCHANGED, ctx.dtype)
    lines, first, worst = [], None, 0.0
    for W in ctx.world_sizes:
        leaks = replica_leaks(ctx, W, 0.0)
        if leaks is None:
            continue
        greatest = max([0.0] + [leak[3] for leak in leaks])
        worst = max(worst, greatest)
        over = [leak for leak in leaks if leak[3] > tol]
        lines.append(f"{W} ranks ({ctx.data_parallel} replicas x {W // ctx.data_parallel}): {len(over)} replica pairs "
                     f"mixed (greatest change {greatest:.3g} of the outputs' RMS)")
        if over and first is None:
            first = (W, over)
    notes = unmeasured(ctx, REPLICAS)
    if not lines:
        return DetectorResult(ID, "skip", "; ".join(notes) or "not measured")
    evidence = "; ".join(lines + notes) + f" (up to {tol:.0e} allowed for {dtype_name(ctx.dtype)})"
    if first is not None:
        cause = replica_cause(ctx, *first)
        return DetectorResult(ID, "fail", f"the replicas' outputs depend on each other's sequences: {cause.text}",
                              value=worst, threshold=tol, evidence=evidence, fix=cause.fix, extras=named(cause))
    return DetectorResult(ID, "pass", f"each replica's outputs depend on its own sequences only ({ctx.data_parallel} "
                                      f"replicas, at {', '.join(str(W) for W in ctx.world_sizes)} ranks)",
                          value=worst, threshold=tol, evidence=evidence)
