"""Audit one layer of your own: `python examples/audit_layer.py` (about 2 s after torch's import)."""

import diagnostics
from my_attention import MyAttention

report = diagnostics.audit(MyAttention(), causal=True)  # causal: the audit passes it causal masks
print(report)  # a line per detector, then the evidence and the fix of each finding
assert report.passed  # warnings do not fail: this layer warns that a fully masked row gives NaN
