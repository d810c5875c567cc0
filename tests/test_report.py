"""The reports read as documents: the teaching report of `pytest --html` (a section per variant with its
diff and two heatmaps, the kill matrix, extra table columns) and `AuditReport.to_html`, both offline."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import diagnostics
import correct
from buggy_variants import VARIANTS
from correct import MultiHeadAttention

pytest_plugins = ["pytester"]

RAISES = {"non_contiguous_view"}  # its forward raises: the report shows the error instead of its heatmap
FETCHING = {("script", "src"), ("link", "href"), ("img", "src"), ("iframe", "src"), ("source", "src"),
            ("video", "src"), ("audio", "src"), ("embed", "src"), ("object", "data"), ("image", "href"),
            ("use", "href"), ("image", "xlink:href"), ("use", "xlink:href")}


class Page(HTMLParser):
    """What the tests look at in a page: the variant sections, the kill matrix, and every link or resource."""

    def __init__(self, text: str):
        super().__init__()
        self.attributes: list[tuple[str, str, str]] = []  # (tag, name, value) of every attribute
        self.external: list[tuple[str, str, str]] = []  # what a browser would fetch from elsewhere
        self.scripts = 0
        self.sections: dict[str, dict] = {}  # id -> {"svg": count, "errors": [text], "add": n, "del": n, "text": str}
        self.matrix_detectors: list[str] = []
        self.matrix_rows: dict[str, list[str]] = {}  # variant id -> the verdicts in its row
        self._section = self._error = self._det = self._row = None
        self._matrix = False
        self.feed(text)
        self.close()

    @property
    def links(self) -> list[str]:
        return [value for tag, name, value in self.attributes if name in ("src", "href", "data", "xlink:href")]

    def handle_starttag(self, tag, attrs):
        self.attributes += [(tag, name, value) for name, value in attrs]
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        for name in ("src", "href", "data", "xlink:href"):
            if name not in attrs:
                continue
            value = (attrs[name] or "").strip().lower()
            remote = value.startswith(("http:", "https:", "//"))
            if (tag, name) in FETCHING and (remote or tag in ("script", "link")):
                self.external.append((tag, name, value))
        self.scripts += tag == "script"
        if tag == "section" and "variant" in classes:
            self._section = self.sections[attrs["id"]] = {"svg": 0, "errors": [], "add": 0, "del": 0, "text": ""}
        if self._section is not None:
            self._section["svg"] += tag == "svg" and "heatmap" in classes
            self._section["add"] += "add" in classes
            self._section["del"] += "del" in classes
            if "error-note" in classes:
                self._error = ""
        if tag == "table" and "kill-matrix" in classes:
            self._matrix = True
        if self._matrix and tag == "th" and "det" in classes:
            self._det = ""
        if self._matrix and tag == "a":  # the variant's name in the first cell of its row
            self._row = attrs["href"].removeprefix("#variant-")
            self.matrix_rows[self._row] = []
        if self._matrix and tag == "td" and classes and classes[0].startswith("k-"):
            self.matrix_rows[self._row].append(classes[0].removeprefix("k-"))

    def handle_endtag(self, tag):
        if tag == "figure" and self._error is not None:
            self._section["errors"].append(self._error)
            self._error = None
        if tag == "section":
            self._section = None
        if tag == "table":
            self._matrix = False
        if tag == "th" and self._det is not None:
            self.matrix_detectors.append(self._det.strip())
            self._det = None

    def handle_data(self, data):
        if self._det is not None:
            self._det += data
        if self._section is not None:
            self._section["text"] += data
        if self._error is not None:
            self._error += data


def test_every_variant_has_a_section_with_its_diff_both_heatmaps_readings_and_fix(teaching_report_html,
                                                                                   catalog_audits):
    page = Page(teaching_report_html)
    assert set(page.sections) == {f"variant-{vid}" for vid in VARIANTS}
    for vid, variant in VARIANTS.items():
        section = page.sections[f"variant-{vid}"]
        if vid in RAISES:
            assert section["svg"] == 1, f"{vid}: the reference's heatmap only"
            assert len(section["errors"]) == 1 and "RuntimeError" in section["errors"][0], vid
        else:
            assert section["svg"] == 2 and not section["errors"], f"{vid}: {section['svg']} heatmaps, an error"
        assert section["add"] >= 1 and section["del"] >= 1, f"{vid}: the diff shows no changed line"
        text = " ".join(section["text"].split())
        assert variant.fix in text and variant.title in text, vid
        for finding in catalog_audits[vid].findings:
            assert finding.detector in text and " ".join(finding.evidence.split()) in text, (vid, finding.detector)


def test_decoding_variants_show_the_full_pass_and_cached_decoding_side_by_side(teaching_report_html):
    """The reference's decoded rows are its full pass's (to rounding); the variant's are not: read from the page
    (its text, table cells joined)."""
    page = Page(teaching_report_html)
    decoding = [vid for vid, v in VARIANTS.items() if "decode_consistency" in v.expected_detectors]
    assert decoding, "the catalog has decoding variants"
    for vid, variant in VARIANTS.items():
        text = " ".join(page.sections[f"variant-{vid}"]["text"].split())
        if vid not in decoding:
            assert "Full pass against cached decoding" not in text, vid
            continue
        assert "Full pass against cached decoding" in text, vid
        readings = {(who, n): float(d) for who, n, d in re.findall(r"(reference|variant)\s*last (\d+) of 16\s*([\d.e+-]+)", text)}
        assert {n for _, n in readings} == {"1", "3", "11"}, (vid, readings)
        assert all(d <= 1e-5 for (who, _), d in readings.items() if who == "reference"), (vid, readings)
        assert max(d for (who, _), d in readings.items() if who == "variant") > 1e-2, (vid, readings)


def test_the_kill_matrix_lists_every_variant_and_every_detector_with_its_verdict(teaching_report_html,
                                                                                  catalog_audits):
    page = Page(teaching_report_html)
    assert page.matrix_detectors == [*diagnostics.DETECTORS, "caught"]
    assert list(page.matrix_rows) == list(VARIANTS)
    for vid, verdicts in page.matrix_rows.items():
        assert verdicts == [r.verdict for r in catalog_audits[vid].results], vid
    section_links = {link for link in page.links if link.startswith("#variant-")}
    assert section_links == {f"#{sid}" for sid in page.sections}


def test_the_teaching_report_opens_offline(teaching_report_html):
    page = Page(teaching_report_html)
    assert page.external == [] and page.scripts == 0
    assert not [link for link in page.links if not link.startswith("#")], "every link stays in the page"
    ids = {value for tag, name, value in page.attributes if name == "id"} | {"results-table"}  # pytest-html's
    assert {link.removeprefix("#") for link in page.links} <= ids, "every link has its target"


PRIVATE = re.compile(r"(?<![\w.])_[A-Za-z]\w*(?=\.)|(?<=\.)_[A-Za-z]\w*")  # `_sdpa.x`, `obj._helper`: not for a student


def _private_names(fix: str) -> list[str]:
    """What a fix line calls that a student cannot import: private modules and helpers, and `correct.x` for
    an x that `correct` does not export."""
    private = PRIVATE.findall(fix)
    missing = [f"correct.{name}" for name in re.findall(r"\bcorrect\.(\w+)", fix) if name not in correct.__all__]
    return private + missing


@pytest.mark.parametrize("vid", list(VARIANTS))
def test_every_fix_uses_only_public_importable_code(vid):
    fix = VARIANTS[vid].fix
    assert not _private_names(fix), f"{vid}: {fix!r} names {_private_names(fix)}"


def test_the_private_name_check_sees_private_helpers():
    """The twin: the same check flags the fixes the report used to show."""
    assert _private_names("return _sdpa.safe_softmax(scores)") == ["_sdpa"]
    assert _private_names("causal = correct._sdpa.causal_mask(t_q, t_k)") == ["_sdpa", "correct._sdpa"]
    assert _private_names("causal = correct.safe_softmax(scores)") == ["correct.safe_softmax"]
    assert _private_names("return torch.softmax(scores, dim=-1).masked_fill(m, 0.0)") == []


def test_the_offline_check_sees_what_a_browser_would_fetch():
    """The twin of the offline tests: the same check flags a page that does reach out."""
    page = Page('<script src="app.js"></script><link href="https://cdn.example/s.css" rel="stylesheet">'
                '<img src="//example.org/x.png"><a href="https://example.org">a link is not a fetch</a>')
    assert [tag for tag, _, _ in page.external] == ["script", "link", "img"]


def test_audit_report_to_html_of_a_correct_layer_shows_its_weights_and_every_detector(tmp_path):
    torch.manual_seed(0)
    report = diagnostics.audit(MultiHeadAttention(32, 4))
    path = tmp_path / "audit.html"
    report.to_html(path)
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert text.count('<svg class="heatmap"') == 1
    assert "No findings" in text and "PASSED" in text
    for detector in diagnostics.DETECTORS:
        assert f"<code>{detector}</code>" in text, detector
    assert page.external == [] and page.scripts == 0 and page.links == []


def test_audit_report_to_html_of_a_layer_that_raises_shows_the_finding_and_no_heatmap(tmp_path, catalog_audits):
    report = catalog_audits["non_contiguous_view"]
    path = tmp_path / "audit.html"
    report.to_html(path)
    text = path.read_text(encoding="utf-8")
    assert report.weights is None and "<svg" not in text and "No weights to show" in text
    assert "FAILED" in text and 'class="finding fail"' in text and "view size is not compatible" in text


INNER_TESTS = """
import pytest
import torch

import buggy_variants
import diagnostics

@pytest.fixture(scope="session")
def catalog_audits():
    # Two variants keep the run short: the report covers the audits this session made.
    audits = {}
    for vid in ("missing_scale", "non_contiguous_view"):
        torch.manual_seed(0)
        audits[vid] = diagnostics.audit(buggy_variants.VARIANTS[vid].build(d_model=32, num_heads=4))
    return audits

@pytest.mark.parametrize("vid", ["missing_scale", "non_contiguous_view"])
@pytest.mark.parametrize("detector", ["softmax_saturation"])
def test_caught(catalog_audits, vid, detector):
    assert catalog_audits[vid].result(detector).verdict == "fail"

def test_unrelated():
    pass
"""


# What a project's conftest needs for the teaching report: the suite's own conftest does the same.
INNER_CONFTEST = """
from buggy_variants import teaching_report

def pytest_configure(config):
    teaching_report.register(config)
"""


def _run_inner(pytester, *args):
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    return pytester.runpytest(*args)


def test_pytest_html_report_has_variant_and_detector_columns_and_the_teaching_report(pytester):
    pytest.importorskip("pytest_html", reason="pytest-html is not installed: pip install -e '.[test]'")
    result = _run_inner(pytester, "--html=report.html", "--self-contained-html")
    result.assert_outcomes(passed=2, failed=1)  # non_contiguous_view: its layer never runs, saturation skips
    text = (pytester.path / "report.html").read_text(encoding="utf-8")
    page = Page(text)
    assert set(page.sections) == {"variant-missing_scale", "variant-non_contiguous_view"}
    assert list(page.matrix_rows) == ["missing_scale", "non_contiguous_view"]
    assert page.external == [], "nothing fetched: no <script src>, no <link href>, no remote src"
    # a reader sees pytest-html's totals first, then the teaching report, then the results table
    totals = text.index('<p class="run-count">')
    assert re.search(r'<span class="passed">2 Passed,</span>', text[totals:text.index('id="teaching-report"')])
    assert totals < text.index('id="teaching-report"') < text.index('<table id="results-table">')

    head = text[text.index('<thead id="results-table-head">'):]
    assert head.index(">Variant</th>") < head.index(">Detector</th>") < head.index(">Duration</th>")
    blob = next(value for tag, name, value in page.attributes if name == "data-jsonblob")
    rows = {nodeid: "".join(runs[0]["resultsTableRow"]) for nodeid, runs in json.loads(blob)["tests"].items()}
    caught = rows["test_inner.py::test_caught[softmax_saturation-missing_scale]"]
    assert '<td class="col-variant"><a href="#variant-missing_scale">missing_scale</a></td>' in caught
    assert '<td class="col-detector">softmax_saturation</td>' in caught
    assert '<td class="col-variant"></td><td class="col-detector"></td>' in rows["test_inner.py::test_unrelated"]


def test_without_pytest_html_the_suite_runs_and_writes_no_report(pytester):
    result = _run_inner(pytester, "-p", "no:html")
    result.assert_outcomes(passed=2, failed=1)
    assert not list(pytester.path.glob("*.html"))

