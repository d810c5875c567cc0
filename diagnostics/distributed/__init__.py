"""The sharded audit, a wing of its own: `audit_sharded(layer, sharded)` runs a layer split across processes (ring
attention, Ulysses, head parallel, or any form of one's own) on forked ranks in a gloo group, at each world size, and
judges it against its unsharded self with the detectors registered here (`SHARDED_DETECTORS`, with the same
`@detector` as the layer and model detectors, on a `ShardedContext`).

    _ranks.py     starting the ranks: fork, file store, timeouts, results home, nothing left behind
    layouts.py    how a sequence is cut: contiguous, zigzag, striped
    _context.py   what the detectors are judged on; the jobs every rank runs
    _judge.py     the parity rule and its evidence        _causes.py   naming the cause of a difference
    runs.py output.py agreement.py causality.py logits.py lengths.py heads.py gradients.py
                  the sharded detectors
    _audit.py     audit_sharded()                         _report.py   ShardedReport
    pytest_plugin.py  the `sharded_audit` fixture         __main__.py  `python -m diagnostics.distributed`

`MODULES` lists the detector modules, in the order the detectors run and are reported.
"""

from importlib import import_module

from .._registry import SHARDED_DETECTORS

MODULES = ("runs", "output", "agreement", "causality", "logits", "lengths", "heads", "gradients")

for _name in MODULES:
    import_module(f"{__name__}.{_name}")

from ._audit import audit_sharded  # noqa: E402  (after its detectors are registered)
from ._ranks import TEMP_PREFIX, distributed_available  # noqa: E402
from ._report import ShardedAuditError, ShardedReport  # noqa: E402
from .layouts import LAYOUTS, shard_positions  # noqa: E402

__all__ = ["LAYOUTS", "MODULES", "SHARDED_DETECTORS", "ShardedAuditError", "ShardedReport", "TEMP_PREFIX",
           "audit_sharded", "distributed_available", "shard_positions"]
