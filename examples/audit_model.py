"""Audit a whole model: `python examples/audit_model.py`. A nanoGPT-style GPT whose block 1 forgets its causal
mask; the audit fails and names that block (about 5 s)."""

import diagnostics  # before torch: it silences torch's "Failed to initialize NumPy" where NumPy is absent
import torch
from buggy_variants import VARIANTS
from buggy_variants.teaching_model import TinyGPT, inject

torch.manual_seed(0)
model = inject(TinyGPT(), 1, VARIANTS["missing_causal_mask"])  # 3 blocks; block 1's attention is not masked
report = diagnostics.audit_model(model, torch.randint(0, 64, (2, 16)))  # example token ids (B, T)
print(report)
assert report.status == "failed" and "h.1.attn" in {finding.layer for finding in report.findings}
