"""sharded_large_logits: with every weight scaled up (logits of several hundred, past float32's exp range), the
float32 sharded output still equals the unsharded one. A log-sum-exp merge that exponentiates the partial
normalisers instead of their differences overflows there: rows become NaN or 0 only with large logits."""

from __future__ import annotations

import torch

from .._registry import detector
from .._result import DetectorResult
from ._causes import Cause
from ._context import LARGE, LOGIT_SCALE, ShardedContext
from ._judge import forward_holds, judged, verdict

ID = "sharded_large_logits"
# `python benchmarks/sharded_cost.py --margins` (ring, Ulysses, head parallel; causal and not; 5 seeds; 2 and 4 ranks;
# float32): at logits in the hundreds the correct forms' error reached 3.6 x the unsharded layer's own (ring, not
# causal, seed 4), so the model audit's 10 x left a margin of 2.8x only; 30 x leaves 7.4x (2.21e-5 against 1.63e-4).
# The overflowing merge gives NaN or 0 rows (an error of inf or ~1), which no multiple hides.
LARGE_FUDGE = 30.0
FIX = ("merge the partial results in log space: new = logaddexp(lse, part_lse); out = out * exp(lse - new) + "
       "part * exp(part_lse - new) (each factor the exp of a difference <= 0)")


@detector(ID, f"with every weight scaled by {LOGIT_SCALE:g} (float32 logits in the hundreds), the sharded output still "
              "equals the unsharded output", fix=FIX, scope="sharded", targets=("log-sum-exp merge overflowing",),
          unlocated="names the rows that became NaN or 0; the layer runs in other processes")
def check_large_logits(ctx: ShardedContext) -> DetectorResult:
    measured, notes, _ = judged(ctx, LARGE, fudge=LARGE_FUDGE)
    failed = next((p for p in measured if not p.ok), None)
    cause = None if failed is None else _overflow(ctx, failed)
    return verdict(ID, measured, notes, ok_text=f"the sharded output holds with weights x{LOGIT_SCALE:g} in float32",
                   fail_text="with large logits the sharded output differs from the unsharded output", fix=FIX,
                   cause=cause)


def _overflow(ctx: ShardedContext, p) -> Cause:
    rows = p.test.abs().amax(dim=-1)  # (B, T)
    dead = ~torch.isfinite(p.test).all(dim=-1) | (rows <= 1e-6 * p.target.abs().amax(dim=-1))  # NaN/inf or 0
    where = ("only with large logits" if forward_holds(ctx, p.W)
             else "(the output differs at ordinary logits too: see sharded_output)")
    if bool(dead.any()):
        return Cause(f"{int(dead.sum())} / {dead.numel()} output rows became NaN, inf or 0 {where}: the log-sum-exp "
                      f"merge overflows", FIX)
    return Cause(f"the rows stay finite but drift {where}: a merge that loses precision when logits are large", FIX)
