"""The kill matrix: which detector catches which variant, asserted cell by cell against the catalog's
documented `expected_detectors`, with the twin cell for the correct layer built the same way."""

from __future__ import annotations

import pytest
import torch

import diagnostics
from buggy_variants import VARIANTS
from conftest import KILL_MATRIX_SIZE

CELLS = [(vid, det) for vid in sorted(VARIANTS) for det in diagnostics.DETECTORS]


@pytest.fixture(scope="module")
def reference_audits() -> dict[str, diagnostics.AuditReport]:
    """{variant id: audit of the *correct* layer configured like that variant}."""
    audits = {}
    for vid, variant in VARIANTS.items():
        torch.manual_seed(0)
        layer = variant.reference(**KILL_MATRIX_SIZE)
        audits[vid] = diagnostics.audit(layer, causal=layer.causal)
    return audits


@pytest.mark.parametrize("vid, detector", CELLS)
def test_kill_matrix_cell(vid, detector, catalog_audits):
    variant, result = VARIANTS[vid], catalog_audits[vid].result(detector)
    expected = detector in variant.expected_detectors + variant.also_detected_by
    assert result.fired == expected, (
        f"{detector} {'should' if expected else 'should not'} fire on {vid}: {result.verdict}: {result.message}\n"
        f"{result.evidence}")
    if expected:  # NaN on a row with no key is a warning by design; every other catch is a failure
        assert result.verdict == ("warn" if detector == "fully_masked_rows" else "fail"), result.message
        assert result.evidence and result.fix


@pytest.mark.parametrize("vid, detector", CELLS)
def test_kill_matrix_twin_reference_cell(vid, detector, reference_audits):
    result = reference_audits[vid].result(detector)
    assert not result.fired, f"{detector} fired on the correct layer configured like {vid}: {result.message}\n" \
                             f"{result.evidence}"


@pytest.mark.parametrize("vid", sorted(VARIANTS))
def test_audit_outcome_matches_the_catalog(vid, catalog_audits):
    report = catalog_audits[vid]
    assert report.passed == (VARIANTS[vid].expected_severity == "warn"), str(report)
    variant = VARIANTS[vid]
    assert set(report.fired()) == set(variant.expected_detectors + variant.also_detected_by), str(report)


def test_every_detector_catches_something_and_every_variant_is_caught():
    caught_by = {d for v in VARIANTS.values() for d in v.expected_detectors + v.also_detected_by}
    # finite_output catches no catalog entry (they all keep finite logits on ordinary inputs); it is
    # exercised by the never-seen float16 softmax without max-subtraction in tests/test_never_seen.py.
    assert caught_by | {"finite_output"} == set(diagnostics.DETECTORS), set(diagnostics.DETECTORS) - caught_by
    assert all(v.expected_detectors for v in VARIANTS.values())
