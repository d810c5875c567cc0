"""sharded_lengths: a sequence length the world size does not divide is handled (the output equals the unsharded
one) or refused with an error, never silently wrong: padding added to make the shards even and left unmasked, or a
tail dropped, changes every row and raises nothing."""

from __future__ import annotations

import torch

from .._registry import detector
from .._result import DetectorResult
from ..model._tolerance import scale_of
from ._causes import Cause
from ._context import UNEVEN, ShardedContext
from ._judge import Parity, named, parity, token_errors

ID = "sharded_lengths"
FIX = ("refuse a length the world size does not divide with an error, or pad it and mask the padding (keys) and drop "
       "its rows (queries)")


@detector(ID, "a length the world size does not divide is handled exactly or refused with an error, never silently "
              "wrong", fix=FIX, scope="sharded", targets=("unmasked padding to an even shard",),
          unlocated="names the world size and the length; the layer runs in other processes")
def check_sharded_lengths(ctx: ShardedContext) -> DetectorResult:
    refused, handled, wrong, lines, cause = [], [], [], [], None
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
        cause = cause or (None if p.ok else _unmasked_padding(ctx, W, p))
        lines.append(f"length {t}: " + p.evidence)
    evidence = "; ".join(lines)
    if wrong:
        return DetectorResult(ID, "fail", f"a length the world size does not divide gives a wrong output without an "
                                          f"error (at {', '.join(map(str, wrong))} ranks)"
                              + (f": {cause.text}" if cause else ""), evidence=evidence, fix=cause.fix if cause else FIX,
                              extras=named(cause))
    if not refused and not handled:
        return DetectorResult(ID, "skip", evidence)
    how = " and ".join(x for x in (f"refused at {', '.join(map(str, refused))} ranks" if refused else "",
                                   f"handled exactly at {', '.join(map(str, handled))} ranks" if handled else "") if x)
    return DetectorResult(ID, "pass", f"a length the world size does not divide is {how}", evidence=evidence)


def _unmasked_padding(ctx: ShardedContext, W: int, p: Parity) -> Cause | None:
    """The cause where the evidence shows it: the output equals the unsharded layer's on the sequence padded with zero
    tokens to a length W (or the zigzag's 2W) divides, cut back to the length: the padding attended as keys."""
    layer = ctx.golden_layer if ctx.golden_layer is not None else ctx.layer
    x = ctx.job_input(UNEVEN, W).double() if ctx.golden_layer is not None else ctx.job_input(UNEVEN, W)
    B, t, D = x.shape
    scale = scale_of(p.target)
    for pieces in (W, 2 * W):
        padded = -(-t // pieces) * pieces
        try:
            with torch.no_grad():
                out = layer(torch.cat([x, x.new_zeros(B, padded - t, D)], dim=1))
        except Exception:  # a layer that cannot take the padded length says nothing here
            return None
        out = (out[0] if isinstance(out, (tuple, list)) else out)[:, :t].double()
        if float(token_errors(p.test, out, scale).max()) <= p.allowed:
            return Cause(f"the output at length {t} equals the unsharded layer's on the sequence padded with "
                         f"{padded - t} zero token{'s' if padded - t != 1 else ''} to {padded}: the padding is attended as keys, unmasked",
                         "mask the padding's keys (and drop its rows), or refuse a length the world size does not "
                         "divide with an error")
    return None
