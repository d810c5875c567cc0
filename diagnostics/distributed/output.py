"""sharded_output: the sharded layer's output equals the unsharded layer's on the same input, at every world size (the
float64-golden rule of the model audit); when it does not, the cause is named where the evidence shows it
(`_causes`: a bias added on every rank, tokens or heads in another order, offsets restarting on every rank)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from ._causes import named_cause
from ._context import FORWARD, ShardedContext
from ._judge import judged, verdict

ID = "sharded_output"
FIX = "compare the sharded layer with the unsharded one step by step on the ranks whose tokens differ"


@detector(ID, "the sharded layer's output equals the unsharded layer's, at every world size", fix=FIX, scope="sharded",
          targets=("bias added on every rank", "layout order not undone", "heads reordered after the all-to-all",
                   "positions restarting on every rank", "log-sum-exp merge wrong", "fused QKV cut in contiguous rows"),
          unlocated="names the cause and the ranks whose tokens differ; the sharded layer runs in other processes, "
                    "where no tracer follows it")
def check_sharded_output(ctx: ShardedContext) -> DetectorResult:
    rows = slice(0, ctx.batch)  # the example; the copies after it are the causality check's
    measured, notes, unfit = judged(ctx, FORWARD, rows=rows)
    if unfit:
        return DetectorResult(ID, "fail", f"the ranks' outputs do not fit together at {unfit[0]}",
                              evidence="; ".join(unfit), fix="return the output of the rank's own shard, (B, T_r, D) "
                                                              "for a shard of T_r tokens, or the whole (B, T, D)")
    failed = next((p for p in measured if not p.ok), None)
    cause = None
    if failed is not None:
        cause = named_cause(ctx, failed.W, failed.test, failed.target, ctx.job_input(FORWARD, failed.W)[rows],
                            failed.allowed, float(failed.target.square().mean().sqrt()) or 1.0)
    return verdict(ID, measured, notes, ok_text="the sharded output equals the unsharded output",
                   fail_text="the sharded output differs from the unsharded output", fix=FIX, cause=cause)
