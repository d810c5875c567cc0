"""sharded_heads_per_rank: the audit is run with at least two heads a rank at every world size. With one head a
rank, heads that come back from the all-to-all in another order (a transposed (rank, head) layout) land exactly where
they belong, so the bug cannot show: a warning about the audit's reach, not a finding about the layer."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from ._context import KNOWN_HEADS, ShardedContext

ID = "sharded_heads_per_rank"
FIX = "audit with num_heads >= 2 x the largest world size (or smaller world sizes), so that each rank holds two heads"


@detector(ID, "each rank holds at least two heads at every world size audited (else a head permutation is invisible)",
          fix=FIX, needs=(KNOWN_HEADS,), scope="sharded",
          unlocated="a warning about the audit's settings, not about a line of the layer")
def check_heads_per_rank(ctx: ShardedContext) -> DetectorResult:
    H = ctx.num_heads
    per_rank = {W: H / W for W in ctx.world_sizes}
    evidence = ", ".join(f"{W} ranks: {H}/{W} = {h:g} heads a rank" for W, h in per_rank.items())
    few = [W for W, h in per_rank.items() if h < 2]
    if few:
        return DetectorResult(ID, "warn", f"fewer than two heads a rank at {', '.join(map(str, few))} ranks: a head "
                                          f"permutation after the all-to-all could not show there", value=min(
                                              per_rank.values()), threshold=2.0, evidence=evidence, fix=FIX)
    return DetectorResult(ID, "pass", f"at least two heads a rank at every world size ({H} heads)",
                          value=min(per_rank.values()), threshold=2.0, evidence=evidence)
