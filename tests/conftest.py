"""Fixtures shared by the test modules: the audits of the catalog, computed once per session."""

from __future__ import annotations

import pytest

import buggy_variants
import diagnostics

KILL_MATRIX_SIZE = dict(d_model=32, num_heads=4)  # the configuration of the kill matrix and the teaching report


@pytest.fixture(scope="session")
def catalog_audits() -> dict[str, diagnostics.AuditReport]:
    """{variant id: audit of its layer}, each built with torch.manual_seed(0), audited as it promises
    (causal layers with causal=True). Used by the kill matrix and by the teaching report."""
    import torch

    audits = {}
    for vid, variant in buggy_variants.VARIANTS.items():
        torch.manual_seed(0)
        layer = variant.build(**KILL_MATRIX_SIZE)
        audits[vid] = diagnostics.audit(layer, causal=layer.causal)
    return audits
