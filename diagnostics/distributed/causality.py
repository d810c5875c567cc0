"""sharded_causality: for a causal layer, changing the tokens after t alone moves no output at or before t, on any
rank. The cuts fall on shard boundaries too (the last token of rank 0's contiguous shard at 2 and 4 ranks), where a
rank that masks as if its queries started at 0, or lets keys of a later rank in, shows."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ..model._tolerance import scale_of
from ._context import CAUSAL_SHARDED, FORWARD, ShardedContext
from ._judge import token_errors, unmeasured

ID = "sharded_causality"
FIX = ("mask each rank's queries against the keys' global positions (the shard's offset in the sequence, which "
       "the keys carry round the ring), not their local indices")


@detector(ID, "for a causal sharded layer, changing tokens after t moves no output at or before t on any rank",
          fix=FIX, needs=(CAUSAL_SHARDED,), scope="sharded",
          unlocated="names the rank and token the future reached; the layer runs in other processes")
def check_sharded_causality(ctx: ShardedContext) -> DetectorResult:
    tol, B = tolerance(UNCHANGED, ctx.dtype), ctx.batch
    bad = total = 0
    worst, where, moved_own, lines, unfit = 0.0, None, True, [], []
    for W in ctx.world_sizes:
        if ctx.answers(W, FORWARD) is None:
            continue
        try:
            out = ctx.gathered(W, FORWARD).double()  # (B * (1 + cuts), T, D)
        except ValueError:
            unfit.append(f"not measured at {W} ranks (the ranks' outputs do not fit together: see sharded_output)")
            continue
        base = out[:B]
        scale = scale_of(base)
        bad_here = 0
        for i, c in enumerate(ctx.cuts, start=1):
            change = token_errors(out[i * B:(i + 1) * B], base, scale)  # (B, T)
            past = change[:, :c + 1]
            total += past.numel()
            bad_here += int((past > tol).sum())
            if float(past.max()) > worst:
                flat = int(past.argmax())
                b, t = divmod(flat, past.shape[1])
                worst, where = float(past.max()), (W, c, b, t, ctx.holder(i * B + b, t, out.shape[1], W))
            moved_own = moved_own and bool((change[:, c + 1:] > tol).any())
        bad += bad_here
        lines.append(f"{W} ranks: {bad_here} past outputs moved")
    notes = unmeasured(ctx, FORWARD) + unfit
    if not lines:
        return DetectorResult(ID, "skip", "; ".join(notes) or "not measured")
    if bad:
        W, c, b, t, rank = where
        return DetectorResult(ID, "fail", f"outputs see the future under sharding: at {W} ranks, changing the tokens "
                                          f"after {c} moves output {t}, a token of rank {rank}",
                              value=worst, threshold=tol, fix=FIX,
                              evidence=f"{bad} / {total} past outputs changed ({100 * bad / total:.1f}%); greatest "
                                       f"change {worst:.3g} of the outputs' RMS at (b={b}, t={t}) on rank {rank} of "
                                       f"{W} when only t>{c} was changed (up to {tol:.0e} allowed for "
                                       f"{dtype_name(ctx.dtype)}); " + "; ".join(lines + notes))
    if not moved_own:
        return DetectorResult(ID, "skip", "not measured: changing the later tokens did not move the later outputs")
    return DetectorResult(ID, "pass", f"no output moves when later tokens change (cuts {', '.join(map(str, ctx.cuts))}"
                                      f", at {', '.join(str(W) for W in ctx.world_sizes)} ranks)",
                          value=worst, threshold=tol, evidence="; ".join(lines + notes))
