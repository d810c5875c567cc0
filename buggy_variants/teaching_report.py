"""The teaching report: the catalog as a course, written by `pytest --html=report.html --self-contained-html`.

Above pytest-html's table of results (and below its pass/fail totals): the kill matrix (variants x
detectors) and one section per variant with its lesson, the diff of its one overridden step against the
reference, heatmaps of the reference's and the variant's attention weights on the same input, the detector
readings and the fix; then the model chapter (`teaching_model`). One table style throughout, and a page that fits
a 700 px window as well as a projector (`_TEACHING_STYLE`). The test suite's conftest calls `register(config)` from
`pytest_configure`; the hooks are registered only when pytest-html writes a report, so a plain `pytest` does no
extra work. Once pytest-html has written the page, `finish_page` adds to its head what its template lacks
(`PAGE_HEAD`): a viewport, so that a phone lays it out at its own width; pytest-html's results filtered to failures
and collapsed on opening (its 905 grey "Skipped" rows came first, and rendering every row was most of the page's
render time); a title, totals and results table that wrap or scroll inside a narrow window.

This module imports both the catalog and `diagnostics` (which never imports the catalog) and needs pytest;
`buggy_variants` itself does not import it.
"""

from __future__ import annotations

import difflib
import inspect
import linecache
import os
import re
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import diagnostics
from correct import MultiHeadAttention
from diagnostics import _html
from diagnostics._html import escape
from diagnostics._result import DependencyMap

from . import VARIANTS
from ._registry import Setting, Variant, promised_pattern
from .teaching_model import model_chapter_html, wide_table
from .teaching_sharded import sharded_chapter_html

KILL_MATRIX_SIZE = dict(d_model=32, num_heads=4)  # the configuration of the kill matrix and the teaching report


def audit_catalog() -> dict[str, diagnostics.AuditReport]:
    """{variant id: audit of its layer}, each built at KILL_MATRIX_SIZE with torch.manual_seed(0), audited as
    it promises (causal layers with causal=True, a layer with a pattern of its own with `pattern=`): the suite's
    `catalog_audits`, also the report's fallback."""
    audits = {}
    for vid, variant in VARIANTS.items():
        torch.manual_seed(0)
        layer = variant.build(**KILL_MATRIX_SIZE)
        audits[vid] = diagnostics.audit(layer, **variant.audit_kwargs(layer))
    return audits


@dataclass(frozen=True)
class _Scene:
    """One way of calling a layer for the heatmaps. A variant is shown in the first scene of its kind
    (causal or not) where its `detectable_when` holds: in any other its weights would match the reference's."""

    text: str
    t_q: int
    t_k: int
    query_from: str = "tokens"  # "tokens": self-attention; "last": the last Tq tokens (KV cache); "decoder"
    padded: int = 0  # trailing positions that are padding: no query attends them, and they attend nothing

    def mask(self) -> torch.Tensor | None:
        """Bool (Tq, Tk), True = may attend, or None."""
        if not self.padded:
            return None
        keep_q = torch.arange(self.t_q) < self.t_q - self.padded  # (Tq,)
        keep_k = torch.arange(self.t_k) < self.t_k - self.padded  # (Tk,)
        return keep_q[:, None] & keep_k[None, :]  # (Tq, Tk)

    def setting(self, layer) -> Setting:
        return Setting(d_model=layer.d_model, num_heads=layer.num_heads, t_q=self.t_q, t_k=self.t_k,
                                      mask=self.mask(), self_attention=self.query_from == "tokens",
                                      causal=layer.causal, dropout=layer.dropout_p, pattern=promised_pattern(layer))

    def inputs(self, d_model: int):
        """query, key, value (B=1, T, D) and the mask (1, 1, Tq, Tk) or None, the same on every call."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.t_k, d_model, generator=g)  # (B, Tk, D): the tokens, or the encoder memory
        query = {"tokens": x, "last": x[:, -self.t_q:],
                 "decoder": torch.randn(1, self.t_q, d_model, generator=g)}[self.query_from]
        mask = self.mask()
        return query, x, x, None if mask is None else mask[None, None]


_SCENES = {
    False: (_Scene("self-attention over 16 tokens, no mask", 16, 16),
            _Scene("self-attention over 16 tokens whose last 4 are padding (bool mask, True = may attend: no "
                   "query attends a padded key, and padded queries may attend nothing)", 16, 16, padded=4),
            _Scene("cross-attention: 10 decoder queries over a 16-token encoder memory", 10, 16, "decoder"),
            _Scene("cross-attention: 16 decoder queries over a 16-token encoder memory", 16, 16, "decoder")),
    True: (_Scene("causal self-attention over 16 tokens", 16, 16),
           _Scene("causal decoding with a KV cache: the last 8 of 16 tokens query all 16 keys", 8, 16, "last"),
           _Scene("causal self-attention over 16 tokens whose last 4 are padding (a padding mask passed)", 16, 16,
                  padded=4)),
}


@dataclass
class _Pair:
    """The reference's and the variant's weights, batch 0 and head 0, on one scene's input."""

    scene: _Scene
    reference: torch.Tensor  # (Tq, Tk)
    variant: torch.Tensor | None  # None when the variant raised
    error: str = ""
    output_difference: float | None = None  # max |out_variant - out_reference| where both are finite
    nonfinite_outputs: int = 0  # output rows of batch 0 with a NaN or inf


def _runs(layer, scene) -> bool:
    query, key, value, mask = scene.inputs(layer.d_model)
    try:
        with torch.no_grad():
            layer(query, key, value, mask=mask)
        return True
    except Exception:
        return False


def _weights_pair(variant: Variant) -> _Pair:
    """Build the variant and the reference with one state_dict and run both, in eval mode, on one input."""
    with torch.random.fork_rng():  # the suite's global RNG is left as it was
        torch.manual_seed(0)
        layer = variant.build(**KILL_MATRIX_SIZE).eval()
        reference = variant.reference(**KILL_MATRIX_SIZE).eval()
        reference.load_state_dict(layer.state_dict())
        scenes = _SCENES[layer.causal]
        shown = [s for s in scenes if variant.detectable_when(s.setting(layer))] or [scenes[0]]
        scene = next((s for s in shown if _runs(layer, s)), shown[0])  # one it runs on, if there is one
        query, key, value, mask = scene.inputs(layer.d_model)
        with torch.no_grad():
            torch.manual_seed(0)
            ref_out, ref_weights = reference(query, key, value, mask=mask)
            torch.manual_seed(0)  # the same dropout draws, for the variant that keeps dropout on in eval
            try:
                out, weights = layer(query, key, value, mask=mask)
            except Exception as error:  # a variant that crashes is the lesson, not a failure of the report
                return _Pair(scene, _html.first_map(ref_weights), None, f"{type(error).__name__}: {error}")
    pair = _Pair(scene, _html.first_map(ref_weights), _html.first_map(weights),
                 nonfinite_outputs=int((~torch.isfinite(out[0])).any(dim=-1).sum()))
    if out.shape == ref_out.shape:
        both = torch.isfinite(out) & torch.isfinite(ref_out)
        pair.output_difference = (out - ref_out).abs()[both].max().item()
    return pair


def _decode_html(variant: Variant) -> str:
    """For a decoding bug: the full pass's last rows next to the same rows decoded (the last Tq queries over all
    Tk keys, as with a KV cache), in the reference and in the variant, one state_dict for both. '' otherwise."""
    if "decode_consistency" not in variant.expected_detectors:
        return ""
    with torch.random.fork_rng():  # the suite's global RNG is left as it was
        torch.manual_seed(0)
        layer = variant.build(**KILL_MATRIX_SIZE).eval()
        reference = variant.reference(**KILL_MATRIX_SIZE).eval()
        reference.load_state_dict(layer.state_dict())
        x = torch.randn(1, 16, layer.d_model, generator=torch.Generator().manual_seed(0))  # (B, T, D)
        rows, shown = [], []
        with torch.no_grad():
            for name, model in (("reference", reference), ("variant", layer)):
                full = model(x)[0]  # (1, 16, D)
                for n in (1, 3, 11):
                    step = model(x[:, -n:], x, x)[0]  # (1, n, D): the last n queries over all 16 keys
                    rows.append((name, n, float((step - full[:, -n:]).abs().max())))
                    if n == 1:
                        shown.append((name, full[0, -1, :4].tolist(), step[0, -1, :4].tolist()))
    numbers = lambda v: ", ".join(f"{x:+.3f}" for x in v)  # noqa: E731
    parity = wide_table(("layer", "queries", "max |decoded - full pass|"),
                        [(name, f"last {n} of 16", f"{difference:.3g}") for name, n, difference in rows])
    newest = wide_table(("newest token, first 4 features", "full pass", "decoded alone (Tq = 1)"),
                        [(name, f"<code>{numbers(full)}</code>", f"<code>{numbers(step)}</code>")
                         for name, full, step in shown])
    return (f'<h4>Full pass against cached decoding</h4><p class="meta">16 tokens, batch 0. Decoding runs the last '
            f'Tq queries over all 16 keys, as a KV cache does; its rows must be the full pass\'s last rows.</p>'
            f'{parity}{newest}')


def _row_sums(w: torch.Tensor) -> str:
    sums = w.sum(dim=-1)  # (Tq,)
    finite = sums[torch.isfinite(sums)]
    text = f"rows sum to {finite.min().item():.3g} … {finite.max().item():.3g}" if finite.numel() else "no row sums"
    nonfinite = sums.numel() - finite.numel()
    return text + (f", {nonfinite} rows NaN or inf" if nonfinite else "")


def _weights_html(pair: _Pair) -> str:
    """The two heatmaps on one colour scale, and a sentence on how far the variant is from the reference."""
    maps = [pair.reference] + ([] if pair.variant is None else [pair.variant])
    vmax = _html.scale_max(*maps)
    figures = [f'<figure><figcaption><b>reference</b> {tuple(pair.reference.shape)}, {_row_sums(pair.reference)}'
               f'</figcaption>{_html.heatmap_svg(pair.reference, vmax=vmax, label="reference weights")}</figure>']
    if pair.variant is None:
        figures.append(f'<figure class="error-note"><figcaption><b>variant</b>: raised instead of returning '
                       f'weights</figcaption><pre>{escape(pair.error)}</pre></figure>')
        comparison = "The variant never gets as far as returning weights: the error is the symptom."
    else:
        figures.append(f'<figure><figcaption><b>variant</b> {tuple(pair.variant.shape)}, {_row_sums(pair.variant)}'
                       f'</figcaption>{_html.heatmap_svg(pair.variant, vmax=vmax, label="variant weights")}</figure>')
        comparison = _comparison(pair)
    return (f'<p class="meta">Batch 0, head 0, on one input: {escape(pair.scene.text)}. One colour scale for both '
            f'maps; hover a map for its largest weight.</p>{"".join(figures)}<p>{comparison}</p>')


def _comparison(pair: _Pair) -> str:
    if pair.variant.shape != pair.reference.shape:
        return (f"The weights have different shapes: ({pair.reference.shape[0]} queries × {pair.reference.shape[1]} "
                f"keys) in the reference, {tuple(pair.variant.shape)} in the variant.")
    difference = (pair.variant - pair.reference).abs()
    nonfinite = int((~torch.isfinite(pair.variant)).sum())
    outputs = ("the outputs have different shapes" if pair.output_difference is None
               else f"the outputs differ by up to {pair.output_difference:.3g}")
    if nonfinite:
        return (f"{nonfinite} of the variant's weights are NaN or inf, and so are {pair.nonfinite_outputs} of its "
                f"{pair.variant.shape[0]} output rows; elsewhere {outputs}.")
    if difference.max().item() == 0:
        return f"The weights are identical: this mistake acts after them, and {outputs}."
    return f"The weights differ by up to {difference.max().item():.3g}; {outputs}."


def _method_lines(variant: Variant) -> tuple[Path, int, list[str]]:
    """The file of the variant's overridden method, its first line and its source lines."""
    source, start = inspect.getsourcelines(getattr(variant.cls, variant.step))
    return Path(inspect.getsourcefile(variant.cls)).resolve(), start, source


def _shown_site(variant: Variant, result):
    """Where a finding points in the variant's section: its first site when that line is in the variant's method;
    when the first site is in a helper the method calls (`correct/_sdpa.py`'s mask builder, say), the method's line
    that calls it, with the helper's line as the note. None when neither is in the method. The diff highlights
    this line and the readings cite it: one answer for both."""
    if not result.where:
        return None
    path, start, source = _method_lines(variant)
    first = result.where[0]
    frames = [(first.file, first.line, first.function)] + list(first.callers)
    for k, (file, line, function) in enumerate(frames):
        if Path(file).resolve() == path and start <= line < start + len(source):
            if k == 0:
                return first
            inner = f"{first.op} ran in {first.function} at {first.path}:{first.line}"
            return replace(first, file=file, line=line, function=function,
                           code=linecache.getline(file, line).strip() or first.code,
                           note="; ".join(x for x in (inner, first.note) if x), callers=tuple(frames[k + 1:]))
    return None


def _diff_html(variant: Variant, report: diagnostics.AuditReport | None = None) -> str:
    """The unified diff of the variant's overridden method against the reference's, whole methods shown; the
    lines the audit's findings point at (`_shown_site`) are highlighted, with the detectors that point there."""
    step = variant.step
    before = textwrap.dedent(inspect.getsource(getattr(MultiHeadAttention, step))).splitlines()
    _, start, source = _method_lines(variant)
    after = textwrap.dedent("".join(source)).splitlines()
    hits: dict[int, list[str]] = {}  # line of the variant's method -> the detectors that point there
    for result in report.findings if report is not None else ():
        site = _shown_site(variant, result)
        if site is not None:
            hits.setdefault(site.line, []).append(result.detector)
    lines = difflib.unified_diff(before, after, f"correct: MultiHeadAttention.{step}",
                                 f"buggy_variants: {variant.cls.__name__}.{step}",
                                 n=len(before) + len(after), lineterm="")
    kinds = {"+": "add", "-": "del", "@": "hunk", " ": "ctx"}
    spans, at = [], 0  # at: the index of the next line of the variant's method
    for i, line in enumerate(lines):
        kind = "file" if i < 2 else kinds[line[:1]]
        title = ""
        if kind in ("add", "ctx"):
            if at + start in hits:
                kind += " hit"
                title = f' title="the audit points here: {escape(", ".join(hits[at + start]))}"'
            at += 1
        spans.append(f'<span class="{kind}"{title}>{escape(line)}</span>')
    return f'<pre class="diff">{"".join(spans)}</pre>'


_PROBE_RAISED = re.compile(r"(?P<label>[^;:]+): (?P<raised>.+)")  # one "label: exception" item of `runs`' evidence


def fold_repeats(evidence: str) -> str:
    """`runs`-style evidence with one exception repeated (`a: E; b: E; c: F (20 calls in all)`) folded to
    `raised on 2 probes: E (the probes: a; b); c: F (20 calls in all)`, so that a reader sees the exception once;
    evidence with nothing repeated is returned as it is."""
    items = evidence.split("; ")
    tail = ""
    last = re.fullmatch(r"(.*?)( \(\d+ calls in all\))", items[-1])
    if last:  # the count of calls closes the last item
        items[-1], tail = last.groups()
    parsed = [_PROBE_RAISED.fullmatch(item) for item in items]
    raised = [m["raised"] for m in parsed if m]
    if not raised:
        return evidence
    common = max(dict.fromkeys(raised), key=raised.count)  # the most repeated, the first of equals
    n = raised.count(common)
    if n < 2:
        return evidence
    labels = [m["label"] for m in parsed if m and m["raised"] == common]
    folded = f"raised on {n} probes: {common} (the probes: {'; '.join(labels)})"
    out, placed = [], False
    for item, m in zip(items, parsed):
        if m and m["raised"] == common:
            if not placed:
                out.append(folded)
                placed = True
        else:
            out.append(item)
    return "; ".join(out) + tail


def _shown_result(variant: Variant, result):
    """A result as the section shows it: repeated exceptions folded, and a finding's first site the line of the
    variant's method that the diff highlights (`_shown_site`), its other sites after it."""
    site = _shown_site(variant, result) if result.fired else None
    where = result.where if site is None or site == result.where[0] else (site, *result.where)
    return replace(result, evidence=fold_repeats(result.evidence), where=where)


def _readings_html(variant: Variant, report: diagnostics.AuditReport) -> str:
    """The detectors that fired, in full; the others folded away, still one click from the reader."""
    quiet = [_shown_result(variant, r) for r in report.results if not r.fired]
    findings = [_shown_result(variant, r) for r in report.findings]
    fired = (f'<div class="wide readings">{_html.results_table(findings)}</div>' if findings
             else "<p>No detector fired.</p>")
    declared = f"with pattern={escape(variant.pattern)}, " if variant.pattern is not None else ""
    return (f'<p class="meta">{escape(report.layer)}, audited {"as causal, " if report.causal else ""}{declared}'
            f"at seq_len={report.seq_len} ({report.forward_passes} forward passes)</p>{fired}"
            f"<details><summary>The other {len(quiet)} detectors (pass or skip)</summary>"
            f'<div class="wide readings">{_html.results_table(quiet)}</div></details>')


def _pattern_html(report: diagnostics.AuditReport) -> str:
    """For a variant audited with a pattern: the finding's picture, the declared pattern beside the dependency
    pattern measured key by key, the cells that differ outlined. '' for the others."""
    findings = [r for r in report.findings if isinstance(r.extras.get("dependency_map"), DependencyMap)]
    if not findings:
        return ""
    m = findings[0].extras["dependency_map"]
    return (f'<h4>The pattern, declared and measured</h4><p class="meta">What <code>{escape(findings[0].detector)}'
            f'</code> measured: each key changed alone, and the rows that moved. Where the two grids differ, a '
            f'<span class="k-fail">red</span> cell is a key the pattern blocks that the output depends on (leakage), '
            f'an <span class="k-warn">amber</span> one a key it allows that the output ignores (over-masking), each '
            f'outlined in both grids.</p><div class="wide">{_html.dependency_html(m)}</div>')


def _section_html(variant: Variant, report: diagnostics.AuditReport) -> str:
    return f"""<section class="variant" id="variant-{escape(variant.id)}">
<h3>{escape(variant.title)} <code>{escape(variant.id)}</code></h3>
<p>{escape(variant.explanation)}</p>
<p><b>Symptom:</b> {escape(variant.symptom)}</p>
<p><b>Observable when:</b> {escape(variant.detectable_when)}</p>
<h4>The mistake: <code>{escape(variant.cls.__name__)}.{escape(variant.step)}</code> against the reference</h4>
{_diff_html(variant, report)}
<h4>Attention weights</h4>
{_weights_html(_weights_pair(variant))}
{_decode_html(variant)}
{_pattern_html(report)}
<h4>Detector readings</h4>
{_readings_html(variant, report)}
<h4>The fix</h4>
<pre class="fix">{escape(variant.fix)}</pre>
<p><a href="#kill-matrix">↑ back to the kill matrix</a></p>
</section>"""


def _kill_matrix_html(audits: dict[str, diagnostics.AuditReport]) -> str:
    """Variants x detectors: each cell the detector's verdict on that variant, its expected catches outlined."""
    detectors = list(dict.fromkeys(r.detector for report in audits.values() for r in report.results))
    described = {d.id: d.description for d in diagnostics.DETECTORS.values()}
    head = "".join(f'<th class="det" title="{escape(described.get(d, ""))}"><span>{escape(d)}</span></th>'
                   for d in detectors)
    rows = []
    for vid, report in audits.items():
        expected = VARIANTS[vid].expected_detectors
        verdicts = {r.detector: r for r in report.results}
        cells = []
        for d in detectors:
            r = verdicts.get(d)
            verdict = r.verdict if r else "skip"
            outline = (" expected" if r and r.fired else " missed") if d in expected else ""
            cells.append(f'<td class="k-{verdict}{outline}" title="{escape(r.message if r else "not run")}">'
                         f"{verdict}</td>")
        caught = "yes" if report.findings else "no"
        rows.append(f'<tr><th class="vid"><a href="#variant-{escape(vid)}">{escape(vid)}</a></th>{"".join(cells)}'
                    f'<td class="caught-{caught}">{caught}</td></tr>')
    caught = sum(bool(report.findings) for report in audits.values())
    return f"""<div class="wide"><table class="kill-matrix">
<thead><tr><th class="vid">variant</th>{head}<th class="det"><span>caught</span></th></tr></thead>
<tbody>{"".join(rows)}</tbody></table></div>
<p class="meta">{caught} of {len(audits)} variants caught by at least one detector. Cells: the detector's verdict
(<span class="k-fail">fail</span> <span class="k-warn">warn</span> <span class="k-pass">pass</span>
<span class="k-skip">skip</span>); <span class="k-fail expected">outlined</span>: a detector the catalog expects
to catch the variant (<code>expected_detectors</code>), <span class="k-pass missed">dashed</span> if it did not.
Hover a cell for the reading, a detector for what it checks.</p>"""


# The columns of the readings table (diagnostics._html.results_table), in order: in a narrow window each reading is a
# card whose values are labelled with these names.
_READING_COLUMNS = ("detector", "verdict", "reading", "value", "threshold", "evidence", "fix")

# Rules only the teaching report needs; the shared ones come from diagnostics._html.STYLE. The report is read on a
# laptop, a projector and a narrow window: the text scales with the window (13 px at 700 px, 16 px from about
# 1240 px), wide tables scroll sideways inside their own box (.wide), and the report never grows wider than the
# window, even where the host page (pytest-html's body, min-width 800px) does.
_TEACHING_STYLE = """
.am.teaching { margin: 8px 0 28px; max-width: min(1180px, calc(100vw - 24px)); box-sizing: border-box;
               font-size: clamp(13px, 0.55vw + 9.2px, 16px); overflow-wrap: break-word; }
.am.teaching h2 { font-size: 1.4em; }
.am.teaching h3 { font-size: 1.2em; }
.am.teaching h4 { font-size: 1em; }
.am.teaching pre, .am.teaching code { font-size: 0.9em; }
.am.teaching pre code, .am.teaching table code { font-size: 1em; }
.am.teaching figcaption { font-size: 0.93em; }
.am.teaching figure { max-width: 100%; }
.am.teaching svg { max-width: 100%; height: auto; }
.am .wide { max-width: 100%; overflow-x: auto; margin: 0.3em 0; }
.am table.results.compact { width: auto; }
.am span.num { white-space: nowrap; font-variant-numeric: tabular-nums; }
/* the readings' evidence (column 6) may break a long path, so that the table fits the window */
.am.teaching .readings td:nth-child(6) { overflow-wrap: anywhere; }
/* the reading, the evidence and the fix share the room left by the short columns, the evidence the most */
.am.teaching .readings td:nth-child(3) { width: 17%; }
.am.teaching .readings td:nth-child(6) { width: 38%; }
/* 18 columns: the matrix grows more slowly than the text, so that it fits a 1024 px projector without scrolling */
.am .kill-matrix { border-collapse: collapse; font-size: clamp(12px, 0.3vw + 9.5px, 14px); }
.am .kill-matrix th, .am .kill-matrix td { border: 1px solid #d8dee4; padding: 3px 4px; text-align: center;
                                           color: #1a1a1a; }
.am .kill-matrix th.vid { text-align: left; font-weight: normal; white-space: nowrap; vertical-align: bottom;
                         position: sticky; left: 0; background: #fff; }  /* the names stay while the box scrolls */
.am .kill-matrix th.det { vertical-align: bottom; padding: 6px 2px; }
.am .kill-matrix th.det span { writing-mode: vertical-rl; transform: rotate(180deg); white-space: nowrap;
                                font-weight: 600; }
.am .k-fail { background: #d73a49; color: #fff !important; }
.am .k-warn { background: #f0b400; }
.am .k-pass { background: #e8f3e8; color: #4d7a4d !important; }
.am .k-skip { background: #f3f4f6; color: #8a8f96 !important; }
.am .expected { outline: 3px solid #1a1a1a; outline-offset: -3px; font-weight: 700; }
.am .missed { outline: 2px dashed #d73a49; outline-offset: -3px; }
.am .caught-yes { font-weight: 700; }
.am .caught-no { background: #d73a49; color: #fff !important; font-weight: 700; }
.am p .k-fail, .am p .k-warn, .am p .k-pass, .am p .k-skip { padding: 0 4px; border-radius: 2px; }
.am p .expected, .am p .missed { outline-offset: 1px; }  /* in the legend the outline goes round the word */
.am section.variant, .am section.model-chapter { border-top: 2px solid #d8dee4; padding-top: 14px; margin-top: 26px; }
.am pre.diff span { display: block; }
.am pre.diff .file { color: #555; font-weight: 600; }
.am pre.diff .hunk { color: #6f42c1; }
.am pre.diff .add { background: #e6ffec; color: #116329; }
.am pre.diff .del { background: #ffebe9; color: #82071e; }
.am pre.diff .hit { outline: 2px solid #d73a49; outline-offset: -1px; font-weight: 600; }
.am pre.diff .hit::after { content: "  \\2190  the audit points here"; color: #d73a49; font-weight: 400; }
.am pre.fix { background: #e6ffec; border-color: #a6dcb4; }
.am .error-note pre { background: #ffebe9; border-color: #f5b5b0; max-width: min(520px, 100%); white-space: pre-wrap; }
.am details summary { cursor: pointer; color: #0b5cad; margin: 0.4em 0; }
@media (max-width: 760px) {  /* a narrow window: tighter cells rather than a table that scrolls */
  .am.teaching table.results th, .am.teaching table.results td { padding: 3px 4px; }
  .am .kill-matrix th, .am .kill-matrix td { padding: 2px 3px; }
  /* seven columns do not fit: each reading becomes a card (detector, verdict, reading; then its labelled values) */
  .am.teaching .readings table, .am.teaching .readings tbody { display: block; }
  .am.teaching .readings thead { display: none; }
  .am.teaching .readings tr { display: grid; grid-template-columns: auto auto 1fr; column-gap: 6px;
                              border-top: 1px solid #d8dee4; padding: 4px 0; }
  .am.teaching .readings td, .am.teaching .readings td:nth-child(n) { border: none; padding: 1px 4px; width: auto; }
  .am.teaching .readings td:nth-child(4) { grid-column: 1; }
  .am.teaching .readings td:nth-child(5) { grid-column: 2 / -1; }
  .am.teaching .readings td:nth-child(n+6) { grid-column: 1 / -1; }
  .am.teaching .readings td:empty { display: none; }
""" + "".join(f'  .am.teaching .readings td:nth-child({i}):not(:empty)::before {{ content: "{name}: "; color: #555; }}\n'
              for i, name in enumerate(_READING_COLUMNS[3:], 4)) + """}  /* labels for all but the card's first line */
"""


def teaching_html(audits: dict[str, diagnostics.AuditReport], sharded_audits: dict | None = None) -> str:
    """The kill matrix and one section per audited variant, as one self-contained HTML fragment; then the model
    chapter and the sharded chapter (`sharded_audits`: {variant id: ShardedReport}, None to draw it unaudited)."""
    variants = [VARIANTS[vid] for vid in audits]
    size = ", ".join(f"{k}={v}" for k, v in KILL_MATRIX_SIZE.items())
    return f"""<div class="am teaching" id="teaching-report"><style>{_html.STYLE}{_TEACHING_STYLE}</style>
<h2>Teaching report: every mistake in the catalog, its evidence and its fix</h2>
<p>Each section below is one broken variant from <code>buggy_variants</code>: the reference attention with one step
changed. It shows the lesson, the diff of that step against <code>correct.MultiHeadAttention</code>, the attention
weights of both layers on one input, what the detectors of <code>diagnostics</code> measured, and the one-line fix.
Every layer is built with {size} and <code>torch.manual_seed(0)</code>, and audited as it promises
(causal layers with <code>causal=True</code>, a layer with a window, chunks, a prefix or documents of its own with
that <code>pattern=</code>). The table of test results follows the last section
(<a href="#results-table">jump to it</a>).</p>
<h3 id="kill-matrix">Kill matrix: which detector catches which mistake</h3>
{_kill_matrix_html(audits)}
{"".join(_section_html(v, audits[v.id]) for v in variants)}
{model_chapter_html(VARIANTS)}
{sharded_chapter_html(sharded_audits)}
</div>"""


# pytest-html's results open filtered to what needs reading (its own `?visible=` and `?collapsed=` parameters, which
# a link or its checkboxes still override); set before its script reads them, at the end of the page
FAILURES_FIRST = """<script>(function () {
  var url = new URL(window.location.href);
  if (url.searchParams.has("visible")) { return; }
  url.searchParams.set("visible", "failed,error,xpassed,rerun");
  if (!url.searchParams.has("collapsed")) { url.searchParams.set("collapsed", "all"); }
  try { window.history.replaceState(null, "", url.href); } catch (e) { /* a browser that refuses: every row */ }
})();</script>"""

# after pytest-html's own styles: what its stylesheet does not do in a narrow window
NARROW_STYLE = """<style>
body { min-width: 0; }  /* pytest-html's 800 px made a 420 px window scroll sideways for everything */
h1#title { overflow-wrap: anywhere; font-size: clamp(18px, 2.4vw + 8px, 24px); }
.summary__data, .controls, .filters { flex-wrap: wrap; gap: 4px 10px; }
#results-table { display: block; overflow-x: auto; max-width: 100%; }
#results-table td { overflow-wrap: anywhere; }
.am .kill-matrix th.vid { position: sticky; left: 0; background: #fff; z-index: 1; }
</style>"""

PAGE_HEAD = ('<meta name="viewport" content="width=device-width, initial-scale=1">' + FAILURES_FIRST + NARROW_STYLE)


def finish_page(page: str) -> str:
    """pytest-html's page with `PAGE_HEAD` at the end of its head (after its styles, before its script)."""
    if "</head>" not in page or 'name="viewport"' in page:
        return page  # not pytest-html's page, or already finished
    return page.replace("</head>", PAGE_HEAD + "</head>", 1)


PASSED_LOG = "Passed: output not kept"  # as short as pytest-html's own "No log output captured.": one per passed test


class TeachingReportPlugin:
    """pytest-html hooks: the variant and detector columns, the teaching report above the results, and the page's
    head finished once it is written.

    Registered by `register(config)` only when pytest-html writes a report: its hooks exist only then."""

    def __init__(self, path: Path | None = None):
        self.audits: dict[str, diagnostics.AuditReport] | None = None
        self.sharded_audits: dict | None = None  # {sharded variant id: its ShardedReport}, where the session made them
        self.path = path  # where pytest-html writes the page

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        """Keep the session's catalog audits (whoever provides the fixture) so the report reuses them."""
        value = yield
        if fixturedef.argname == "catalog_audits":
            self.audits = value
        if fixturedef.argname == "sharded_audits":  # tests/test_kill_matrix.py's: {id: (variant's, twin's)}
            self.sharded_audits = {vid: broken for vid, (broken, _) in value.items()}
        return value

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """Tests parametrised by `vid` (and `detector`) say which variant (and detector) they are about."""
        report = yield
        params = item.callspec.params if hasattr(item, "callspec") else {}
        report.variant, report.detector = str(params.get("vid", "")), str(params.get("detector", ""))
        return report

    def pytest_html_report_title(self, report):
        report.title = "attention-mistakes: the test suite and its teaching report"

    def pytest_html_results_table_header(self, cells):
        cells[2:2] = ['<th class="sortable" data-column-type="variant">Variant</th>',
                      '<th class="sortable" data-column-type="detector">Detector</th>']

    def pytest_html_results_table_row(self, report, cells):
        vid, detector = getattr(report, "variant", ""), getattr(report, "detector", "")
        variant = escape(vid)
        if vid in VARIANTS:
            variant = f'<a href="#variant-{variant}">{variant}</a>'
        cells[2:2] = [f'<td class="col-variant">{variant}</td>', f'<td class="col-detector">{escape(detector)}</td>']

    def pytest_html_results_table_html(self, report, data):
        # A passed test's captured output (pytester's inner runs print whole sessions): 364 KB of pytest-html's JSON
        # in the whole suite's 5.27 MB page, in rows that open filtered out; failures, errors and skips keep theirs.
        if report.passed:
            data[:] = [PASSED_LOG]

    def pytest_html_results_summary(self, prefix, summary, postfix, session):
        # After pytest-html's totals and filters (its "prefix" would push them ~19,000 px down the page), before
        # the results table. A run that never asked for the audits (e.g. `pytest tests/test_correct.py --html=...`)
        # computes them here.
        postfix.append(teaching_html(self.audits if self.audits is not None else audit_catalog(),
                                     self.sharded_audits))  # the kill matrix's sharded rows', where they ran

    @pytest.hookimpl(wrapper=True)
    def pytest_sessionfinish(self, session):
        """After pytest-html's own (trylast) has written the page: finish its head."""
        result = yield
        if self.path is not None and self.path.is_file():
            self.path.write_text(finish_page(self.path.read_text(encoding="utf-8")), encoding="utf-8")
        return result


def register(config: pytest.Config) -> None:
    """From `pytest_configure`: add the report's hooks when pytest-html is about to write a report."""
    path = config.getoption("htmlpath", None)
    if config.pluginmanager.hasplugin("html") and path:
        # the page's path as pytest-html resolves it (its BaseReport), from the directory pytest started in
        config.pluginmanager.register(TeachingReportPlugin(Path.cwd() / Path(os.path.expandvars(path)).expanduser()),
                                      "teaching-report")


__all__ = ["KILL_MATRIX_SIZE", "PAGE_HEAD", "PASSED_LOG", "TeachingReportPlugin", "audit_catalog", "finish_page", "fold_repeats",
           "register", "teaching_html"]
