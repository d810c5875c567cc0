"""The sharded audit, a wing of its own: `audit_sharded(layer, sharded)` runs a layer split across processes (ring
attention, Ulysses, head parallel, or any form of one's own) on forked ranks in a gloo group, at each world size, and
judges it against its unsharded self with the detectors registered here (`SHARDED_DETECTORS`, with the same
`@detector` as the layer and model detectors, on a `ShardedContext`).

    _ranks.py     starting the ranks: fork, file store, timeouts, results home, nothing left behind
    layouts.py    how a sequence is cut: contiguous, zigzag, striped
    _context.py   what the detectors are judged on; the jobs every rank runs
    _judge.py     the parity rule and its evidence        _causes.py   naming the cause of a difference
    runs.py output.py agreement.py replicas.py draws.py causality.py documents.py data_parallel.py logits.py
    lengths.py heads.py gradients.py
                  the sharded detectors
    _audit.py     audit_sharded()                         _report.py   ShardedReport
    pytest_plugin.py  the `sharded_audit` fixture         __main__.py  `python -m diagnostics.distributed`

`MODULES` lists the detector modules, in the order the detectors run and are reported. The public names load on first
use (PEP 562), the detector modules with them, so that loading the pytest plugin of this wing imports no torch.
"""

from __future__ import annotations

import importlib

MODULES = ("runs", "output", "agreement", "replicas", "draws", "causality", "documents", "data_parallel", "logits",
           "lengths", "heads", "gradients")

# public name -> the module that defines it
_WHERE = {"LAYOUTS": ".layouts", "SHARDED_DETECTORS": "../_registry", "ShardedAuditError": "._report",
          "ShardedReport": "._report", "TEMP_PREFIX": "._ranks", "audit_sharded": "._audit",
          "distributed_available": "._ranks", "shard_positions": ".layouts"}

__all__ = ["LAYOUTS", "MODULES", "SHARDED_DETECTORS", "ShardedAuditError", "ShardedReport", "TEMP_PREFIX",
           "audit_sharded", "distributed_available", "shard_positions"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module("._audit", __name__)  # which registers the detectors before anything reads them
    if name == "SHARDED_DETECTORS":
        from .._registry import SHARDED_DETECTORS as value
    else:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
