"""sharded_lengths: a sequence length the world size does not divide is handled (the output equals the unsharded
one) or refused with an error, never silently wrong: padding added to make the shards even and left unmasked, or a
tail dropped, changes every row and raises nothing."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from ._context import UNEVEN, ShardedContext
from ._judge import parity

ID = "sharded_lengths"
FIX = ("refuse a length the world size does not divide with an error, or pad it and mask the padding (keys) and drop "
       "its rows (queries)")


@detector(ID, "a length the world size does not divide is handled exactly or refused with an error, never silently "
              "wrong", fix=FIX, scope="sharded", targets=("unmasked padding to an even shard",),
          unlocated="names the world size and the length; the layer runs in other processes")
def check_sharded_lengths(ctx: ShardedContext) -> DetectorResult:
    refused, handled, wrong, lines = [], [], [], []
    for W in ctx.world_sizes:
        t = ctx.job_input(UNEVEN, W).shape[1]
        failure = ctx.failure(W, UNEVEN)
        if failure is not None:
            if failure.kind == "raised":
                refused.append(W)
                lines.append(f"{W} ranks, length {t}: refused ({failure.describe()})")
            else:
                wrong.append(W)
                lines.append(f"{W} ranks, length {t}: {failure.describe()}")
            continue
        if ctx.answers(W, UNEVEN) is None:
            lines.append(f"not measured at {W} ranks, length {t} (an earlier job stopped the group)")
            continue
        try:
            p = parity(ctx, UNEVEN, W, ctx.gathered(W, UNEVEN))
        except ValueError as error:
            wrong.append(W)
            lines.append(f"{W} ranks, length {t}: the shards do not fit ({error})")
            continue
        (handled if p.ok else wrong).append(W)
        lines.append(f"length {t}: " + p.evidence)
    evidence = "; ".join(lines)
    if wrong:
        return DetectorResult(ID, "fail", f"a length the world size does not divide gives a wrong output without an "
                                          f"error (at {', '.join(map(str, wrong))} ranks)", evidence=evidence, fix=FIX)
    if not refused and not handled:
        return DetectorResult(ID, "skip", evidence)
    how = " and ".join(x for x in (f"refused at {', '.join(map(str, refused))} ranks" if refused else "",
                                   f"handled exactly at {', '.join(map(str, handled))} ranks" if handled else "") if x)
    return DetectorResult(ID, "pass", f"a length the world size does not divide is {how}", evidence=evidence)
