"""An HTML report of one audit: `python examples/html_report.py [PATH]` writes audit.html (or PATH)."""

import sys

import diagnostics
from my_attention import MyAttention

path = sys.argv[1] if len(sys.argv) > 1 else "audit.html"
diagnostics.audit(MyAttention(), causal=True).to_html(path)  # findings, evidence, fixes, a heatmap of the weights
print(f"wrote {path}")
