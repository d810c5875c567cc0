"""sharded_train_draws: a layer that promises its train-mode draws are the unsharded layer's (`draws_like_unsharded`)
returns, every rank seeded as the unsharded layer is, the unsharded layer's train-mode output. A dropout drawn from
another stream than the one the unsharded layer draws from (a stream of its own seeded alike on every rank, say, as a
model-parallel tracker's is) keeps the replicas agreeing (`sharded_train_replicas` passes) and still drops other units
than the unsharded layer would: a run sharded and a run on one device part from their first training step.

The tolerance: `DRAWS_FUDGE` x how far the sharded output already is from the unsharded one in eval mode (the
rounding of the sum over ranks), with the layer audit's `UNCHANGED` floor; a mask drawn elsewhere moves about p of
the entries by their whole size (dropped, or scaled by 1 / (1 - p)).
"""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ..model._tolerance import scale_of, worst_change
from ._context import FORWARD, FULL_OUTPUT, PROMISED_DRAWS, TRAIN, ShardedContext
from ._judge import unmeasured

ID = "sharded_train_draws"
# Measured (tests/test_kill_matrix.py's dropout_stream_of_its_own row and its twin, float32, p = 0.1, seeds 0 and 1):
# the twin, HeadParallelAttention's dropout from the shared stream against OutputDropout, stayed 1.96e-7 (2 ranks) to
# 3.98e-7 (4 ranks) of the outputs' RMS from the unsharded layer, the eval-mode spread 2.1e-7: the floor 1e-5 rules,
# a margin of 25x; a mask drawn from another stream moved the output 2.57-2.59 of its RMS.
DRAWS_FUDGE = 10.0
FIX = ("draw the dropout of the region every rank holds alike from the stream the unsharded layer draws from (the "
       "default generator, seeded alike on every rank), in the same order and shape as the unsharded layer")


@detector(ID, "in train mode, every rank seeded as the unsharded layer is, the sharded output is the unsharded layer's "
              "train-mode output (a layer that promises to draw like it)", fix=FIX,
          needs=(FULL_OUTPUT, PROMISED_DRAWS), scope="sharded", targets=("dropout drawn from the wrong RNG stream",),
          unlocated="names the seed and the world size; the layer runs in other processes")
def check_train_draws(ctx: ShardedContext) -> DetectorResult:
    floor, lines, bad, worst, allowed_seen = tolerance(UNCHANGED, ctx.dtype), [], [], 0.0, 0.0
    for W in ctx.world_sizes:
        answers, forward = ctx.answers(W, TRAIN), ctx.answers(W, FORWARD)
        if answers is None or forward is None:
            continue
        rows = slice(0, ctx.batch)
        spread = worst_change(forward[0][rows].double(), ctx.reference(FORWARD, W).same[rows].double(),
                              scale_of(ctx.reference(FORWARD, W).same[rows].double()))
        allowed = max(floor, DRAWS_FUDGE * spread)
        allowed_seen = max(allowed_seen, allowed)
        for seed, answer, expected in zip(ctx.train_seeds, answers[0], ctx.train_references):
            change = (worst_change(answer.double(), expected.double(), scale_of(expected.double()))
                      if answer.shape == expected.shape else float("inf"))
            worst = max(worst, change)
            if change > allowed:
                bad.append((W, seed))
            lines.append(f"{W} ranks, seed {seed}: rank 0's train-mode output {change:.3g} of the outputs' RMS from "
                         f"the unsharded layer's (allowed {allowed:.2g}: {DRAWS_FUDGE:g} x the eval-mode spread "
                         f"{spread:.2g}, at least {floor:.0e} for {dtype_name(ctx.dtype)})")
    notes = unmeasured(ctx, TRAIN)
    if not lines:
        return DetectorResult(ID, "skip", "; ".join(notes) or "not measured")
    evidence = "; ".join(lines + notes)
    if bad:
        return DetectorResult(ID, "fail", "in train mode the sharded layer draws other masks than the unsharded layer "
                              "under the same seed (at " + ", ".join(f"{W} ranks, seed {s}" for W, s in bad[:4])
                              + "): its dropout draws from another stream than the unsharded layer's", value=worst,
                              threshold=allowed_seen, evidence=evidence, fix=FIX,
                              extras={"cause": "another stream than the unsharded layer's"})  # what it reads
    return DetectorResult(ID, "pass", "in train mode the sharded layer draws what the unsharded layer draws under the "
                          "same seed", value=worst, threshold=allowed_seen, evidence=evidence)
