"""The reports read as documents: the teaching report of `pytest --html` (a section per variant with its
diff and two heatmaps, the kill matrix, extra table columns) and `AuditReport.to_html`, both offline."""

from __future__ import annotations

import base64
import html
import inspect
import json
import linecache
import re
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import diagnostics
import correct
from diagnostics import _html
from buggy_variants import VARIANTS, teaching_report
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


@pytest.fixture(scope="module", name="page")
def teaching_page(teaching_report_html) -> Page:
    """`page`: the teaching report parsed once: the tests only read it (parsing the whole catalog's page took 1.2 s)."""
    return Page(teaching_report_html)


def test_every_variant_has_a_section_with_its_diff_both_heatmaps_readings_and_fix(catalog_audits, page):
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
            evidence = teaching_report.fold_repeats(finding.evidence)
            assert finding.detector in text and " ".join(evidence.split()) in text, (vid, finding.detector)


def test_decoding_variants_show_the_full_pass_and_cached_decoding_side_by_side(page):
    """The reference's decoded rows are its full pass's (to rounding); the variant's are not: read from the page
    (its text, table cells joined)."""
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


def test_the_kill_matrix_lists_every_variant_and_every_detector_with_its_verdict(catalog_audits, page):
    assert page.matrix_detectors == [*diagnostics.DETECTORS, "caught"]
    assert list(page.matrix_rows) == list(VARIANTS)
    for vid, verdicts in page.matrix_rows.items():
        assert verdicts == [r.verdict for r in catalog_audits[vid].results], vid
    section_links = {link for link in page.links if link.startswith("#variant-")}
    assert section_links == {f"#{sid}" for sid in page.sections}


INLINE_IMAGE = "data:image/png;base64,"  # a heatmap's cells: an image inside the page, nothing fetched


def test_the_teaching_report_opens_offline(page):
    assert page.external == [] and page.scripts == 0
    assert not [link for link in page.links if not link.startswith(("#", INLINE_IMAGE))], "every link stays in the page"
    ids = {value for tag, name, value in page.attributes if name == "id"} | {"results-table"}  # pytest-html's
    assert {link.removeprefix("#") for link in page.links if link.startswith("#")} <= ids, "every link has its target"


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
    page = Page(f'<svg><image href="{INLINE_IMAGE}AAAA"/><image href="https://example.org/x.png"/></svg>')
    assert page.external == [("image", "href", "https://example.org/x.png")]  # a data: URL is not a fetch


def _png_pixels(url: str) -> list[list[str]]:
    """The "#rrggbb" pixels of a PNG data: URL as `_html.png_data_url` writes it (8-bit RGB, one IDAT, filter 0),
    read back independently of the writer: the length-type-data-CRC chunks, zlib, and the rows."""
    data = base64.b64decode(url.removeprefix(INLINE_IMAGE))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind], at = body, at + 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    raw, row = zlib.decompress(chunks[b"IDAT"]), 1 + 3 * width
    assert len(raw) == height * row and all(raw[r * row] == 0 for r in range(height))
    return [["#" + raw[r * row + 1 + 3 * c:r * row + 4 + 3 * c].hex() for c in range(width)] for r in range(height)]


def _images(svg: str) -> list[str]:
    return re.findall(rf'<image [^>]*href="({re.escape(INLINE_IMAGE)}[^"]+)"', svg)


# ---- the teaching report as a reader sees it: its marks, its one style, its citations, a narrow window ----------


def _style(page: str) -> str:
    return "".join(re.findall(r"<style[^>]*>(.*?)</style>", page, re.S))


def _rule(style: str, selector: str) -> str:
    """The declarations of the rule whose selector list is exactly `selector`, '' when there is none."""
    for selectors, body in re.findall(r"([^{}]+)\{([^}]*)\}", style):
        if selector in [s.strip() for s in selectors.split(",")]:
            return body
    return ""


def _css_string(value: str) -> str:
    """A CSS string's text: `\2190 ` is U+2190 (one whitespace after a hex escape belongs to it)."""
    return re.sub(r"\\([0-9a-fA-F]{1,6})[ \t\n]?|\\(.)", lambda m: chr(int(m[1], 16)) if m[1] else m[2], value)


def _block(page: str, element_id: str) -> str:
    """The HTML of the <section> with this id."""
    start = page.index(f'id="{element_id}"')
    return page[start:page.index("</section>", start)]


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


READING = re.compile(r'<tr><td><code>([^<]+)</code></td><td><span class="verdict v-\w+">\w+</span></td>'
                     r"<td>.*?</td><td class=\"num\">.*?</td><td class=\"num\">.*?</td><td>(.*?)</td><td>.*?</td></tr>")
CITED = re.compile(r'where: <code>([^<]*):(\d+)</code> <code>([^<]*)</code>')
HIGHLIGHT = re.compile(r'<span class="(?:add|ctx) hit" title="the audit points here: ([^"]*)">([^<]*)</span>')


def test_the_css_string_reader_reads_escapes():
    """The twin of the arrow test: the reader decodes what a browser decodes, and shows the old bug as a bug."""
    assert _css_string(r"  \2190  the audit") == "  ← the audit"
    assert _css_string(r'a \"b\" \2190') == 'a "b" ←'
    old = "  \x02190 the audit"  # the old style wrote "\2190" in a plain Python string, where "\2" is \x02
    assert not _css_string(old).strip().startswith("←")


def test_highlighted_diff_lines_end_with_an_arrow_and_the_page_has_no_control_characters(teaching_report_html):
    content = re.search(r'content:\s*"((?:[^"\\]|\\.)*)"', _rule(_style(teaching_report_html), ".am pre.diff .hit::after"))
    assert content, "a highlighted line says that the audit points there"
    assert _css_string(content[1]).strip().startswith("← the audit points here"), _css_string(content[1])
    control = re.findall(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", teaching_report_html)
    assert not control, f"control characters in the page: {sorted(set(control))}"


def test_the_readings_cite_the_line_the_diff_highlights(teaching_report_html, catalog_audits):
    """Where the diff highlights a line for a detector, that detector's reading cites that very line (file, number,
    code), also when the op ran in a helper the variant's line calls (a mask builder in `correct`)."""
    highlighted, through_helper = 0, []
    for vid, variant in VARIANTS.items():
        section = _block(teaching_report_html, f"variant-{vid}")
        cited = {det: CITED.search(evidence) for det, evidence in READING.findall(section)}
        source = Path(inspect.getsourcefile(variant.cls)).resolve()
        for detectors, line in HIGHLIGHT.findall(section):
            code = " ".join(html.unescape(line)[1:].split())  # the diff's line, its +/space marker dropped
            for detector in detectors.split(", "):
                where = cited.get(detector)
                assert where, f"{vid}: {detector} is highlighted in the diff but its reading cites no line"
                path, number, cited_code = where[1], int(where[2]), " ".join(html.unescape(where[3]).split())
                assert Path(path).resolve() == source, f"{vid}: {detector} cites {path}, the diff shows {source.name}"
                assert cited_code == code, f"{vid}: {detector} cites {cited_code!r}, the diff highlights {code!r}"
                assert " ".join(linecache.getline(str(source), number).split()) == code, (vid, detector, number)
                highlighted += 1
                first = catalog_audits[vid].result(detector).where[0]
                if Path(first.file).resolve() != source:
                    through_helper.append(vid)
    assert highlighted, "some diff line is highlighted"
    assert through_helper, "some highlighted line is the caller of a helper where the op ran"


def test_fold_repeats_folds_one_repeated_exception_and_keeps_the_rest():
    evidence = "a: E: x; b (det): E: x; c: F: y (5 calls in all)"
    assert (teaching_report.fold_repeats(evidence) ==
            "raised on 2 probes: E: x (the probes: a; b (det)); c: F: y (5 calls in all)")
    once = "a: E: x; c: F: y (2 calls in all)"
    assert teaching_report.fold_repeats(once) == once
    assert teaching_report.fold_repeats("12 / 60 rows changed") == "12 / 60 rows changed"


def test_a_layer_that_raises_everywhere_quotes_its_exception_once(teaching_report_html, catalog_audits):
    for vid in RAISES:
        section = _block(teaching_report_html, f"variant-{vid}")
        error = _text(re.search(r'class="error-note">.*?<pre>(.*?)</pre>', section, re.S)[1])  # in the heatmap's place
        runs = catalog_audits[vid].result("runs")
        evidence = _text(dict(READING.findall(section))["runs"])
        assert evidence.count(error) == 1, f"{vid}: the exception is quoted {evidence.count(error)} times"
        assert f"raised on {int(runs.value)} probes: {error}" in evidence, evidence


def _tables(fragment: str) -> list[tuple[dict, list[str]]]:
    """Every <table>: its attributes and the classes of the elements around it, innermost first."""

    class Tables(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.found = [], []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "table":
                self.found.append((attrs, [c for _, cls in reversed(self.stack) for c in cls]))
            if tag not in ("br", "img", "input", "meta", "link", "col", "rect", "path", "hr"):
                self.stack.append((tag, (attrs.get("class") or "").split()))

        def handle_endtag(self, tag):
            while self.stack:
                if self.stack.pop()[0] == tag:
                    break

    parser = Tables()
    parser.feed(fragment)
    return parser.found


def test_every_table_of_the_teaching_report_has_the_one_style(teaching_report_html):
    """The kill matrix has its own grid; every other table (readings, decoding, the model chapter's) is the shared
    `results` table, styled by the page's rules and not by attributes of its own."""
    style = _style(teaching_report_html)
    tables = _tables(teaching_report_html[teaching_report_html.index('id="teaching-report"'):])
    chapter = _tables(_block(teaching_report_html, "model-chapter"))
    assert len(tables) > len(chapter) > 0, "the sections and the model chapter have tables"
    for attrs, _ in tables:
        classes = (attrs.get("class") or "").split()
        assert not {"style", "border"} & set(attrs), f"a table styled apart: {attrs}"
        assert "kill-matrix" in classes or "results" in classes, f"a table outside the report's style: {attrs}"
        assert all(re.search(rf"\.{c}\b", style) for c in classes), f"a table class no rule styles: {classes}"


def test_the_model_chapter_spells_out_what_it_refers_to(teaching_report_html):
    chapter = _block(teaching_report_html, "model-chapter")
    assert "docstring" not in _text(chapter), "the reader of a report has no docstring at hand"
    row = next(r for r in re.findall(r"<tr>.*?</tr>", chapter) if "<code>cache_parity</code>" in r)
    if "skip" in row:  # TinyGPT takes no cache: the reading says what a model needs to take part
        assert all(word in _text(row) for word in ("input_ids", "past_key_values", "use_cache")), _text(row)


def test_cache_parity_rows_carry_pass_and_fail_marks_that_agree_with_the_numbers(teaching_report_html):
    chapter = _block(teaching_report_html, "model-chapter")
    table = chapter[chapter.index("Cache parity"):]
    marks = {"pass": 0, "fail": 0}
    rows = re.findall(r"<tr>(.*?)</tr>", table)[1:]  # below its header
    assert rows, "the cache-parity table has rows"
    for row in rows:
        cells = re.findall(r"<td>(.*?)</td>", row)[1:]  # the correct model's, then the broken one's
        assert len(cells) == 2, row
        for cell in cells:
            verdict = re.search(r'class="verdict v-(pass|fail)"', cell)
            error, allowed = map(float, re.search(r"([\d.e+-]+) \(allowed ([\d.e+-]+) ?\)", _text(cell)).groups())
            assert verdict, f"no pass/fail mark: {_text(cell)}"
            assert (verdict[1] == "pass") == (error <= allowed), _text(cell)
            marks[verdict[1]] += 1
    assert marks["pass"] and marks["fail"], f"the correct decoder passes and the broken one fails somewhere: {marks}"


def _clamp_at(expression: str, width: float) -> float:
    """The px value of a CSS clamp(min, preferred, max) whose terms are sums of px and vw, at a window width."""
    def value(term: str) -> float:
        return sum(float(n) * (width / 100 if unit == "vw" else 1)
                   for n, unit in re.findall(r"([\d.]+)\s*(px|vw)", term))
    low, preferred, high = (value(t) for t in expression.split(","))
    return min(max(preferred, low), high)


def test_the_teaching_report_fits_a_narrow_window(teaching_report_html):
    """Below pytest-html's 800 px the report stays inside the window: it is never wider than the window, wide
    tables scroll inside their own box, pictures shrink, and the text scales with the window."""
    style = _style(teaching_report_html)
    report = _rule(style, ".am.teaching")
    assert re.search(r"max-width:[^;]*100vw", report), f"the report may grow wider than the window: {report!r}"
    assert re.search(r"overflow-x:\s*auto", _rule(style, ".am .wide")), "wide tables scroll in a box of their own"
    fragment = teaching_report_html[teaching_report_html.index('id="teaching-report"'):]
    for attrs, around in _tables(fragment):
        assert "wide" in around, f"a table outside a scrolling box: {attrs}"
    assert re.search(r"max-width:\s*100%", _rule(style, ".am.teaching svg")), "pictures shrink to the window"
    svgs = re.findall(r"<svg[^>]*>", fragment)
    assert svgs and all("viewBox=" in svg for svg in svgs), "a picture without a viewBox cannot shrink"
    size = re.search(r"font-size:\s*clamp\(([^)]*)\)", report)
    assert size, "the text size follows the window"
    narrow, wide = _clamp_at(size[1], 700), _clamp_at(size[1], 1400)
    assert 12 <= narrow < wide <= 18, (narrow, wide)


def test_in_a_narrow_window_each_reading_is_a_card_labelled_with_the_table_s_column_names(teaching_report_html):
    """Seven columns do not fit 700 px: below the breakpoint each reading is a card, its cells labelled with the
    names of the readings table's own header (read from the page, so a reordered table fails here)."""
    style = _style(teaching_report_html)
    media = re.search(r"@media \(max-width: (\d+)px\) \{(.*?)\n\}", style, re.S)
    assert media and int(media[1]) >= 700, "a narrow-window layout that applies at 700 px"
    fragment = teaching_report_html[teaching_report_html.index('id="teaching-report"'):]
    header = re.search(r'<div class="wide readings"><table class="results"><thead><tr>(.*?)</tr>', fragment)
    assert header, "the readings tables sit in a .readings box"
    names = [_text(th) for th in re.findall(r"<th>(.*?)</th>", header[1])]
    assert len(names) > 3, names
    assert re.search(r"\.readings thead \{ display: none", media[2]), "the cards replace the header row"
    for i, name in enumerate(names[3:], 4):  # the first three make the card's first line, unlabelled
        assert re.search(rf'\.readings td:nth-child\({i}\)[^{{]*::before \{{ content: "{name}: "', media[2]), (i, name)
    readings = fragment.count('<table class="results"><thead><tr><th>detector</th>')
    assert readings == fragment.count('<div class="wide readings"><table class="results">'), "every readings table"


def test_audit_report_to_html_of_a_correct_layer_shows_its_weights_and_every_detector(tmp_path):
    torch.manual_seed(0)
    report = diagnostics.audit(MultiHeadAttention(32, 4))
    path = tmp_path / "audit.html"
    report.to_html(path)
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert text.count('<svg class="heatmap"') == 1
    # its cells are one image of a pixel per weight, in the weight's colour (read back from the PNG)
    weights = _html.first_map(report.weights)
    cells, bar = map(_png_pixels, _images(text))
    vmax = _html.scale_max(weights)
    assert cells == [[_html.colour(v, vmax) for v in row] for row in weights.tolist()]
    assert len(bar) == 1 and bar[0][0] != bar[0][-1]  # the colour bar, light to dark
    assert "No findings" in text and "PASSED" in text
    for detector in diagnostics.DETECTORS:
        assert f"<code>{detector}</code>" in text, detector
    assert page.external == [] and page.scripts == 0 and all(link.startswith(INLINE_IMAGE) for link in page.links)
    # a phone lays it out at its own width, and the messages' `code` is set as code, not raw backticks (issue 35)
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in text
    title = re.search(r"<h1>(.*?)</h1>", text).group(1)
    assert "<code>d_model</code>" in title and "`" not in title, title
    # the subtitle says what the audit did in words, not internal fields (issue 18, item 8)
    assert not re.search(r"\b(form|takes_mask|pass_causal_mask)=", text) and "the layer takes a mask" in text


def test_audit_report_to_html_of_a_layer_that_raises_shows_the_finding_and_no_heatmap(tmp_path, catalog_audits):
    report = catalog_audits["non_contiguous_view"]
    path = tmp_path / "audit.html"
    report.to_html(path)
    text = path.read_text(encoding="utf-8")
    assert report.weights is None and "<svg" not in text and "No weights to show" in text
    assert "FAILED" in text and 'class="finding fail"' in text and "view size is not compatible" in text


# ---- the picture of a pattern finding: the declared pattern beside the measured one -----------------------------

PATTERN_VARIANTS = sorted(vid for vid, v in VARIANTS.items() if v.pattern is not None)


def test_a_pattern_finding_shows_the_declared_and_measured_grids_in_the_text_report(catalog_audits):
    text = str(catalog_audits["window_one_too_long"])
    lines = text.splitlines()
    at = next(n for n, line in enumerate(lines) if line.startswith("  pattern:  sliding_window(4) declared"))
    assert lines[at + 1].split() == ["declared", "measured"]
    assert lines[at + 2].split() == ["0123456789012345"] * 2  # a ruler of the keys' last digits over each grid
    rows = {int(line.split()[0]): line.split()[1:] for line in lines[at + 3:at + 19]}
    assert rows[0] == ["#...............", "#..............."]
    assert rows[4] == [".####...........", "L####..........."]  # the key 4 back: blocked, and seen
    assert rows[15] == ["............####", "...........L####"]
    assert "L blocked but seen (leak) (12)" in lines[at + 19] and "O " not in lines[at + 19]


def test_the_picture_of_over_masking_marks_the_allowed_keys_no_row_moved_for(catalog_audits):
    picture = catalog_audits["causal_prefix"].result("attention_pattern").extras["dependency_map"]
    kinds = picture.kinds()
    # prefix_lm(5): queries 0..3 may see the later prefix keys, and the causal prefix ignores them
    assert [kinds[0][j] for j in range(5)] == ["seen", "over", "over", "over", "over"]
    assert kinds[4][:5] == ["seen"] * 5 and picture.counts()["leak"] == 0
    assert picture.counts()["over"] == 4 + 3 + 2 + 1  # the upper triangle of the prefix
    assert "O allowed but unseen (over-masked) (10)" in str(catalog_audits["causal_prefix"])


def test_a_picture_cell_is_read_from_three_facts():
    """The one reading both reports draw (`DependencyMap.kinds`), on a hand-made map with every kind."""
    t = lambda rows: torch.tensor(rows, dtype=torch.bool)  # noqa: E731
    m = diagnostics._result.DependencyMap("p", 0, 3, 0, 0, declared=t([[1, 0, 1]]), moved=t([[1, 1, 0]]),
                                          measurable=t([[1, 1, 1]]))
    assert m.kinds() == [["seen", "leak", "over"]]
    m = diagnostics._result.DependencyMap("p", 0, 2, 0, 0, declared=t([[0, 1]]), moved=t([[0, 0]]),
                                          measurable=t([[1, 0]]))
    assert m.kinds() == [["blocked", "unmeasured"]] and m.counts()["unmeasured"] == 1


def test_a_passing_pattern_audit_draws_no_picture():
    torch.manual_seed(0)
    layer = VARIANTS["window_one_too_long"].reference(32, 4)
    report = diagnostics.audit(layer, **VARIANTS["window_one_too_long"].audit_kwargs(layer))
    assert report.passed and all("dependency_map" not in r.extras for r in report.results)
    assert "pattern:" not in str(report)


def test_audit_report_to_html_draws_the_pattern_finding_as_svg_offline(tmp_path, catalog_audits):
    report = catalog_audits["chunk_boundary_one_late"]
    path = tmp_path / "audit.html"
    report.to_html(path)
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert text.count('<svg class="pattern"') == 1 and page.external == [] and page.scripts == 0
    svg = text[text.index('<svg class="pattern"'):]
    svg = svg[:svg.index("</svg>")]
    picture = report.result("attention_pattern").extras["dependency_map"]
    counts = picture.counts()
    declared, measured = map(_png_pixels, _images(svg))  # the two grids, a pixel per cell
    colours = _html.CELL_COLOURS
    # the measured grid colours each differing cell, and both grids outline it
    assert sum(row.count(colours["leak"]) for row in measured) == counts["leak"] > 0
    assert sum(row.count(colours["over"]) for row in measured) == counts["over"] > 0
    outlines = re.findall(r'<path d="([^"]*)" stroke="#1a1a1a"', svg)
    assert len(outlines) == 2 and [d.count("z") for d in outlines] == [counts["leak"] + counts["over"]] * 2
    assert declared == [[colours["seen" if a else "blocked"] for a in row] for row in picture.declared.tolist()]
    # chunks start one late: query 5, the first of the second chunk, still sees keys 1..4
    q, k = 5 - picture.q0, 1 - picture.k0
    assert declared[q][k] == colours["blocked"] and measured[q][k] == colours["leak"]
    assert "blocked but seen (leak): " in svg and "allowed but unseen (over-masked): " in svg  # the legend


@pytest.mark.parametrize("vid", PATTERN_VARIANTS)
def test_each_pattern_variant_s_section_shows_its_picture(vid, teaching_report_html, page):
    section = page.sections[f"variant-{vid}"]["text"]
    assert "The pattern, declared and measured" in section and f"pattern={VARIANTS[vid].pattern}" in section
    start = teaching_report_html.index(f'id="variant-{vid}"')
    end = teaching_report_html.index("</section>", start)
    assert teaching_report_html.count('<svg class="pattern"', start, end) == 1


def test_only_the_pattern_variants_have_a_picture(teaching_report_html):
    sections = re.split(r'<section class="variant" id="variant-', teaching_report_html)[1:]
    drawn = {chunk.split('"', 1)[0] for chunk in sections if '<svg class="pattern"' in chunk.split("</section>")[0]}
    assert drawn == set(PATTERN_VARIANTS)


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
    print(f"output of the test of {vid}")
    assert catalog_audits[vid].result(detector).verdict == "fail"

def test_unrelated():
    print("output of a passed test")
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
    # a passed test's captured output is left out, a failed one's kept
    logs = {nodeid: "".join(runs[0]["log"]) for nodeid, runs in json.loads(blob)["tests"].items()}
    assert logs["test_inner.py::test_unrelated"] == teaching_report.PASSED_LOG
    assert "output of a passed test" not in text and "output of the test of missing_scale" not in text
    assert "output of the test of non_contiguous_view" in logs["test_inner.py::test_caught[softmax_saturation-non_contiguous_view]"]
    # the head finished after pytest-html wrote it (issue 35): a viewport, failures first, a narrow window's rules
    head = text[:text.index("</head>")]
    assert head.count('<meta name="viewport" content="width=device-width, initial-scale=1">') == 1
    assert head.rindex("<style") > head.index("min-width: 800px"), "after pytest-html's styles, to override them"
    assert 'url.searchParams.set("visible", "failed,error,xpassed,rerun")' in head


def test_finishing_the_page_adds_its_head_once_and_leaves_other_pages_alone():
    page = '<html><head><style>body { min-width: 800px; }</style></head><body><table id="results-table"></table></body>'
    finished = teaching_report.finish_page(page)
    assert finished == page.replace("</head>", teaching_report.PAGE_HEAD + "</head>")
    assert teaching_report.finish_page(finished) == finished  # once
    assert teaching_report.finish_page("<p>no head</p>") == "<p>no head</p>"
    assert "body { min-width: 0; }" in teaching_report.PAGE_HEAD and '"collapsed", "all"' in teaching_report.PAGE_HEAD


@pytest.mark.slow  # two worker processes, each importing torch: about 10 s
def test_under_pytest_xdist_the_report_keeps_its_columns_and_the_controller_audits_the_catalog(pytester):
    """The suite runs a worker per core. The report is written by xdist's controller, which runs no fixture: the
    Variant and Detector cells travel with each test's report, and the teaching report audits the whole catalog
    itself (the two-variant `catalog_audits` of the inner session ran in the workers)."""
    pytest.importorskip("pytest_html", reason="pytest-html is not installed: pip install -e '.[test]'")
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: pip install -e '.[test]'")
    result = _run_inner(pytester, "--html=report.html", "--self-contained-html", "--numprocesses=2")
    result.assert_outcomes(passed=2, failed=1)
    assert "2 workers" in result.stdout.str()
    text = (pytester.path / "report.html").read_text(encoding="utf-8")
    page = Page(text)
    assert set(page.sections) == {f"variant-{vid}" for vid in VARIANTS}
    blob = next(value for tag, name, value in page.attributes if name == "data-jsonblob")
    rows = {nodeid: "".join(runs[0]["resultsTableRow"]) for nodeid, runs in json.loads(blob)["tests"].items()}
    caught = rows["test_inner.py::test_caught[softmax_saturation-missing_scale]"]
    assert '<td class="col-variant"><a href="#variant-missing_scale">missing_scale</a></td>' in caught
    assert '<td class="col-detector">softmax_saturation</td>' in caught


def test_without_pytest_html_the_suite_runs_and_writes_no_report(pytester):
    result = _run_inner(pytester, "-p", "no:html")
    result.assert_outcomes(passed=2, failed=1)
    assert not list(pytester.path.glob("*.html"))

