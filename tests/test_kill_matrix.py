"""The kill matrix: which detector catches which variant, asserted cell by cell against the catalog's
documented `expected_detectors`, with the twin cell for the correct layer built the same way.

The documented matrix (the teaching report's) is float32 at torch's default initialisation, and must match
exactly. In the five other settings people train in, {float32, bfloat16, float16} x {default, GPT-2's
std-0.02 initialisation}, every expected detector fires, nothing outside `expected_detectors +
also_detected_by` fires, and the correct twin fires nothing. The default run sweeps the documented setting and
bfloat16 at GPT-2's initialisation (the scale people train at); the other four are marked `slow` (CI's slow step,
or `pytest --slow`), since the catch tests (tests/test_detectors_catch.py) draw every dtype and initialisation too.

The sharded chapter (`buggy_variants._sharded`, layers split across forked ranks) has rows of its own: each variant
at 2 and 4 ranks fires exactly its expected and documented detectors, the first naming the variant's cause, and its
correct twin on the same layer and inputs fires nothing (slow: about a minute of forked groups).
"""

from __future__ import annotations

import pytest
import torch

import diagnostics
from buggy_variants import VARIANTS
from buggy_variants._sharded import SHARDED_VARIANTS
from buggy_variants.teaching_report import KILL_MATRIX_SIZE
from buggy_variants.teaching_sharded import audit_sharded_variant, sharded_chapter_html
from correct import gpt2_init_
from diagnostics._guard import seed_rng
from diagnostics._html import escape
from diagnostics.distributed import SHARDED_DETECTORS, distributed_available
from diagnostics.distributed.pytest_plugin import one_group_at_a_time

CELLS = [(vid, det) for vid in sorted(VARIANTS) for det in diagnostics.DETECTORS]
DOCUMENTED, TRAINING = (torch.float32, "default"), (torch.bfloat16, "gpt2")  # the two settings of the default run
SETTINGS = [pytest.param(dtype, init, id=f"{str(dtype).replace('torch.', '')}-{init}",
                         marks=() if (dtype, init) in (DOCUMENTED, TRAINING) else (pytest.mark.slow,))
            for dtype in (torch.float32, torch.bfloat16, torch.float16) for init in ("default", "gpt2")]


def build(make, dtype, init):
    seed_rng(0)
    layer = make(**KILL_MATRIX_SIZE)
    if init == "gpt2":
        gpt2_init_(layer)
    return layer.to(dtype)


def twin_audit(reference_audit, vid, dtype, init) -> diagnostics.AuditReport:
    """The audit of the *correct* layer configured like variant `vid`, built like its cell (`build`) and audited as
    the variant promises; once per reference configuration (conftest's `reference_audit`)."""
    variant = VARIANTS[vid]

    def audit():
        layer = build(variant.reference, dtype, init)
        return diagnostics.audit(layer, **variant.audit_kwargs(layer))

    return reference_audit(variant, ("kill matrix", str(dtype), init), audit)


@pytest.fixture(scope="module")
def reference_audits(reference_audit) -> dict[str, diagnostics.AuditReport]:
    """{variant id: audit of the *correct* layer configured like that variant}, float32 and torch's init."""
    return {vid: twin_audit(reference_audit, vid, torch.float32, "default") for vid in VARIANTS}


@pytest.mark.parametrize("vid, detector", CELLS)
def test_kill_matrix_cell(vid, detector, catalog_audits):
    variant, result = VARIANTS[vid], catalog_audits[vid].result(detector)
    expected = detector in variant.expected_detectors + variant.also_detected_by
    assert result.fired == expected, (
        f"{detector} {'should' if expected else 'should not'} fire on {vid}: {result.verdict}: {result.message}\n"
        f"{result.evidence}")
    if expected:  # a variant whose only fault is NaN on a row with no key warns by design; every other catch fails
        assert result.verdict == variant.expected_severity, result.message
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


@pytest.mark.parametrize("dtype, init", SETTINGS)
@pytest.mark.parametrize("vid", sorted(VARIANTS))
def test_kill_matrix_holds_in_every_dtype_and_initialisation(vid, dtype, init, catalog_audits):
    variant = VARIANTS[vid]
    if (dtype, init) == DOCUMENTED:  # the very audit catalog_audits made (the same build, seed and options)
        report = catalog_audits[vid]
    else:
        layer = build(variant.build, dtype, init)
        report = diagnostics.audit(layer, **variant.audit_kwargs(layer))
    fired = set(report.fired())
    missing = set(variant.expected_detectors) - fired
    assert not missing, f"{vid} ({dtype}, {init} init): {sorted(missing)} did not fire\n{report}"
    unexpected = fired - set(variant.expected_detectors + variant.also_detected_by)
    assert not unexpected, f"{vid} ({dtype}, {init} init): {sorted(unexpected)} fired unexpectedly\n{report}"
    assert report.status == ("passed" if variant.expected_severity == "warn" else "failed"), str(report)
    if vid in PATTERN_FINDINGS:
        assert_pattern_finding(report, vid)


# The pattern variants (chapter 3): the finding attention_pattern makes, and the cells of its picture that show it
PATTERN_FINDINGS = {
    "window_one_too_long": ("leakage",), "window_one_too_short": ("over-masking",),
    "window_on_both_sides": ("leakage",), "chunk_boundary_one_late": ("leakage", "over-masking"),
    "documents_not_masked": ("leakage",), "causal_prefix": ("over-masking",),
    "window_dropped_with_cache": ("leakage",),  # while decoding: the last Tq positions querying all Tk keys
}
CELLS_OF = {"leakage": "leak", "over-masking": "over"}


def assert_pattern_finding(report, vid):
    """attention_pattern's message names each finding of the variant, and its picture (the measured dependency
    pattern beside the declared one) shows cells of that kind and no other difference."""
    __tracebackhide__ = True
    result = report.result("attention_pattern")
    for finding in PATTERN_FINDINGS[vid]:
        assert f"({finding})" in result.message, (vid, result.message)
    picture = result.extras.get("dependency_map")
    assert picture is not None, f"{vid}: no picture\n{report}"
    counts = picture.counts()
    shown = {kind for kind in ("leak", "over") if counts[kind]}
    assert shown == {CELLS_OF[f] for f in PATTERN_FINDINGS[vid]}, (vid, counts)


def test_every_pattern_variant_has_its_finding_named():
    assert {vid for vid, v in VARIANTS.items() if "attention_pattern" in v.expected_detectors} == set(PATTERN_FINDINGS)


@pytest.mark.parametrize("dtype, init", SETTINGS)
@pytest.mark.parametrize("vid", sorted(VARIANTS))
def test_twin_reference_passes_in_every_dtype_and_initialisation(vid, dtype, init, reference_audit):
    """The twin of the test above: the correct layer, built, initialised and audited the same way."""
    report = twin_audit(reference_audit, vid, dtype, init)
    assert report.status == "passed" and not report.findings, str(report)
    assert all(r.measured for r in report.results if not r.message.startswith("not applicable")), str(report)


def test_every_detector_catches_something_and_every_variant_is_caught():
    caught_by = {d for v in VARIANTS.values() for d in v.expected_detectors + v.also_detected_by}
    # finite_output catches no catalog entry (they all keep finite logits on ordinary inputs); it is
    # exercised by the never-seen float16 softmax without max-subtraction in tests/test_never_seen.py.
    # cache_decoding needs a self-attention module with a cache of its own, which the reference (query, key,
    # value) layer is not: it is exercised by the never-seen CachedRotary layers in tests/test_never_seen.py.
    # parameters_used catches no catalog entry: every variant keeps each weight in use (a detached softmax's q and
    # k weights get no gradient, but the forward still reads them: that is the gradients detector's finding); it is
    # exercised by the unused projections of tests/test_parameters.py.
    # relative_positions catches no catalog entry (the reference's rotary is relative, and no variant breaks it): its
    # rotary mistakes are the layers of tests/test_relative_positions.py.
    # undeclared_causality only warns, about layers audited as not causal that mask by position themselves
    # (tests/test_causality_hint.py).
    unexercised = {"finite_output", "cache_decoding", "parameters_used", "relative_positions", "undeclared_causality"}
    assert caught_by | unexercised == set(diagnostics.DETECTORS), set(diagnostics.DETECTORS) - caught_by
    assert all(v.expected_detectors for v in VARIANTS.values())


# ---- the sharded chapter (buggy_variants._sharded): a layer split across forked ranks, audited by audit_sharded -----
SHARDED_UNEXERCISED = {  # sharded detectors no variant of the chapter trips, and where they are exercised instead
    "sharded_runs": "a rank that raises, hangs or exits (tests/test_sharded.py's failing ranks)",
    "sharded_ranks_agree": "ranks that return different wholes in eval mode (tests/test_sharded.py's Disagreeing)",
    "sharded_heads_per_rank": "only warns, about one head a rank (tests/test_sharded.py)",
}


@pytest.fixture(scope="module")
def sharded_audits():
    """{variant id: (its audit, its correct twin's)} at 2 and 4 ranks, float32 (about 55 s of forked groups under
    load), holding the machine's lock on groups so that tests/test_sharded.py's never run beside them."""
    ok, why = distributed_available()
    if not ok:
        pytest.skip(f"the sharded audit needs torch.distributed with gloo: {why}")
    with one_group_at_a_time():
        return {vid: (audit_sharded_variant(v), audit_sharded_variant(v, twin=True))
                for vid, v in SHARDED_VARIANTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("vid", sorted(SHARDED_VARIANTS))
def test_sharded_kill_matrix_row(vid, sharded_audits):
    """Exactly the expected detectors (and those also documented) fire, fail, and the first names the cause."""
    variant, (report, _) = SHARDED_VARIANTS[vid], sharded_audits[vid]
    assert set(report.fired()) == set(variant.expected_detectors + variant.also_detected_by), str(report)
    for det in variant.expected_detectors:
        result = report.result(det)
        assert result.verdict == "fail" and result.evidence and result.fix, str(report)
    assert variant.cause in report.result(variant.expected_detectors[0]).message, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("vid", sorted(SHARDED_VARIANTS))
def test_sharded_kill_matrix_twin_row(vid, sharded_audits):
    """The twin: the correct form on the same unsharded layer and inputs passes, measuring what caught the variant,
    and names no cause."""
    variant, (_, twin) = SHARDED_VARIANTS[vid], sharded_audits[vid]
    assert twin.status == "passed" and not twin.findings, str(twin)
    assert all(twin.result(det).verdict == "pass" for det in variant.expected_detectors), str(twin)
    assert variant.cause not in str(twin)


def test_every_sharded_detector_catches_something_and_every_sharded_variant_is_caught():
    caught_by = {d for v in SHARDED_VARIANTS.values() for d in v.expected_detectors + v.also_detected_by}
    assert caught_by | set(SHARDED_UNEXERCISED) == set(SHARDED_DETECTORS), set(SHARDED_DETECTORS) - caught_by
    assert not caught_by & set(SHARDED_UNEXERCISED)
    assert all(v.expected_detectors and v.cause for v in SHARDED_VARIANTS.values())


def test_the_teaching_report_has_the_sharded_chapter(teaching_report_html):
    """Drawn without its audits (the page audits it when pytest-html writes it): every entry's lesson, symptom, fix
    and the detector expected to catch it."""
    chapter = teaching_report_html[teaching_report_html.index('id="sharded-chapter"'):]
    for vid, v in SHARDED_VARIANTS.items():
        section = chapter[chapter.index(f'id="sharded-{vid}"'):].split("</section>", 1)[0]
        for text in (v.title, v.symptom, v.fix, v.expected_detectors[0], v.cause):
            assert escape(text) in section, (vid, text)


@pytest.mark.slow
def test_the_sharded_chapter_shows_the_detector_and_cause_that_caught_each_variant(sharded_audits):
    chapter = sharded_chapter_html({vid: broken for vid, (broken, _) in sharded_audits.items()})
    expected = sum(len(v.expected_detectors) for v in SHARDED_VARIANTS.values())
    assert chapter.count("k-fail expected") == expected and "missed" not in chapter
    for vid, v in SHARDED_VARIANTS.items():
        section = chapter[chapter.index(f'id="sharded-{vid}"'):].split("</section>", 1)[0]
        assert f"<code>{v.expected_detectors[0]}</code>" in section and escape(v.cause) in section, vid
