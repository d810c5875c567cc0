"""Detectors for silent attention mistakes, and `audit()` that runs them on any attention layer.

    import diagnostics
    report = diagnostics.audit(my_layer, causal=True)
    print(report)                      # a table of detectors, verdicts and evidence
    report.raise_for_findings()        # or diagnostics.assert_attention_ok(my_layer, causal=True)

`DETECTORS` is the registry: each entry has an id, the property it checks, the mistakes it targets and the
fix. `diagnostics` knows no implementation: it never imports `buggy_variants`.
"""

from . import adapters
from ._audit import AttentionAuditError, AuditReport, assert_attention_ok, audit
from ._detectors import DETECTORS
from ._errors import AuditUsageError
from ._result import Detector, DetectorResult, Finding

__all__ = [
    "DETECTORS",
    "AttentionAuditError",
    "AuditReport",
    "AuditUsageError",
    "Detector",
    "DetectorResult",
    "Finding",
    "adapters",
    "assert_attention_ok",
    "audit",
]
