"""sharded_gradients: the gradient of the input through the sharded layer equals the unsharded layer's (a loss of
the output against one fixed random cotangent). Backward-only bugs live here: a key/value gradient sent back to the
wrong rank (the wrong ring step), a collective whose backward is not its adjoint. The parameters' gradients are not
compared (their shards' layout is the layer's own)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from ._causes import Cause
from ._context import BACKWARD, ShardedContext
from ._judge import forward_holds, judged, verdict

ID = "sharded_gradients"
FIX = ("give each collective its adjoint in the backward: a ring shift's gradient goes back to the rank the tensor "
       "came from, an all-gather's is its own slice, an all-reduce's (g) is the identity")


@detector(ID, "the gradient of the input through the sharded layer equals the unsharded layer's", fix=FIX,
          scope="sharded", targets=("key/value gradients from the wrong ring step",),
          unlocated="names the ranks whose tokens' gradients differ; the backward runs in other processes")
def check_sharded_gradients(ctx: ShardedContext) -> DetectorResult:
    measured, notes, _ = judged(ctx, BACKWARD, what="gradients")
    failed = next((p for p in measured if not p.ok), None)
    cause = None
    if failed is not None and forward_holds(ctx, failed.W):
        cause = Cause("the forward matches and the backward does not: a backward-only bug (a key/value gradient "
                      "returned to the wrong rank, a collective's backward that is not its adjoint)", FIX)
    return verdict(ID, measured, notes, ok_text="the input's gradient equals the unsharded layer's",
                   fail_text="the input's gradient through the sharded layer differs from the unsharded layer's",
                   fix=FIX, cause=cause)
