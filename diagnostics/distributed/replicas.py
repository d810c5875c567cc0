"""sharded_train_replicas: in train mode, with every rank seeded alike (a data-parallel replica's training step), a layer
that returns the whole output on every rank returns the same one on each. A dropout of the replicated region drawn
from a per-rank stream (the model-parallel stream, right for the heads' own region) gives every rank another mask:
the ranks' activations part from their first training step, and nothing raises."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ..model._tolerance import scale_of, worst_change
from ._context import FULL_OUTPUT, TRAIN, ShardedContext
from ._judge import unmeasured

ID = "sharded_train_replicas"
FIX = ("draw the randomness of the replicated region (dropout after the all-reduce) from the stream every rank shares, "
       "seeded alike; keep per-rank streams for the region each rank holds alone (its heads)")


@detector(ID, "in train mode with every rank seeded alike, every rank returns the same whole output (a layer that "
              "takes the whole sequence and draws at random)", fix=FIX, needs=(FULL_OUTPUT,), scope="sharded",
          targets=("dropout drawn from the wrong RNG stream",),
          unlocated="names the ranks that part; the layer runs in other processes")
def check_train_replicas(ctx: ShardedContext) -> DetectorResult:
    tol, lines, bad, random, worst = tolerance(UNCHANGED, ctx.dtype), [], [], False, 0.0
    for W in ctx.world_sizes:
        answers = ctx.answers(W, TRAIN)
        if answers is None:
            continue
        (first, second), others = answers[0], answers[1:]
        scale = scale_of(first.double())
        random = random or any(worst_change(b.double(), a.double(), scale) > tol for a, b in answers)
        changes = [worst_change(a.double(), first.double(), scale) if a.shape == first.shape else float("inf")
                   for a, _ in others]
        worst = max([worst, *changes])
        off = [r for r, c in enumerate(changes, start=1) if c > tol]
        bad += [(W, r) for r in off]
        lines.append(f"{W} ranks: {len(off)} / {W - 1} ranks differ from rank 0 under the same seed"
                     + (f" (by up to {max(changes):.3g} of the outputs' RMS)" if off else ""))
    notes = unmeasured(ctx, TRAIN)
    if not lines:
        return DetectorResult(ID, "skip", "; ".join(notes) or "not measured")
    if not random:
        return DetectorResult(ID, "skip", "not applicable: the sharded layer draws nothing at random in train mode "
                                          "(two seeds gave the same output)")
    evidence = "; ".join(lines + notes) + f" (up to {tol:.0e} allowed for {dtype_name(ctx.dtype)})"
    if bad:
        return DetectorResult(ID, "fail", "in train mode the ranks part under the same seed: "
                              + ", ".join(f"rank {r} at {W} ranks" for W, r in bad[:6])
                              + ": the replicated region draws from a per-rank stream", value=worst, threshold=tol,
                              evidence=evidence, fix=FIX, extras={"cause": "a per-rank stream"})  # what it reads
    return DetectorResult(ID, "pass", "in train mode every rank returns the same output under the same seed",
                          value=worst, threshold=tol, evidence=evidence)
