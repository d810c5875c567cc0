"""The sharded chapter of the catalog, audited and drawn: `audit_sharded_variant` runs one entry of
`SHARDED_VARIANTS` (or its correct twin) through `diagnostics.distributed.audit_sharded` as the kill matrix does, and
`sharded_chapter_html` draws the chapter of the teaching report: its own kill matrix (variants x sharded detectors)
and one section per variant with its lesson, symptom, the diff of its one step against the correct form, the
detector that caught it with the cause it named, and the fix.

Each audit forks groups of ranks (about 1-3 s a variant at 2 and 4 ranks), so the teaching report never starts them
itself: it draws the chapter from the kill matrix's audits where the session made them (`sharded_audits`, the slow
rows of tests/test_kill_matrix.py, kept by `TeachingReportPlugin` as it keeps the catalog's), and otherwise the lessons
with the detectors the catalog expects. Its sections and matrix have classes of their own (`sharded-variant`,
`sharded-matrix`), apart from the catalog's.
"""

from __future__ import annotations

import difflib
import inspect
import textwrap

import torch

from diagnostics._html import escape, results_table

from ._sharded import SHARDED_VARIANTS, ShardedVariant

KILL_MATRIX_WORLD_SIZES = (2, 4)  # every variant is observable at 4 ranks; the merge and offset bugs at 2 already


def audit_sharded_variant(variant: ShardedVariant, *, twin: bool = False, world_sizes=KILL_MATRIX_WORLD_SIZES):
    """The variant's audit (its correct twin's with `twin=True`): one unsharded layer (`variant.layer()`), float32,
    audited as the entry says (`audit_kwargs`)."""
    from diagnostics.distributed import audit_sharded

    return audit_sharded(variant.layer(), variant.reference if twin else variant.build, world_sizes=world_sizes,
                         dtype=torch.float32, **variant.audit_kwargs)


def _step_diff(variant: ShardedVariant) -> str:
    """The unified diff of the variant's overridden method against the correct form's, whole methods shown."""
    correct = getattr(variant.reference_cls, variant.step, None)
    before = textwrap.dedent(inspect.getsource(correct)).splitlines() if correct is not None else []
    after = textwrap.dedent(inspect.getsource(getattr(variant.cls, variant.step))).splitlines()
    lines = difflib.unified_diff(before, after, f"correct.sharded: {variant.reference_cls.__name__}.{variant.step}",
                                 f"buggy_variants: {variant.cls.__name__}.{variant.step}",
                                 n=len(before) + len(after), lineterm="")
    kinds = {"+": "add", "-": "del", "@": "hunk", " ": "ctx"}
    spans = [f'<span class="{"file" if i < 2 else kinds[line[:1]]}">{escape(line)}</span>'
             for i, line in enumerate(lines)]
    return f'<pre class="diff">{"".join(spans)}</pre>'


def _caught(variant: ShardedVariant, report) -> str:
    if report is None:
        return (f"<p><b>Caught by:</b> <code>{escape(', '.join(variant.expected_detectors))}</code> (expected; the "
                f"chapter was drawn without its audits), naming <q>{escape(variant.cause)}</q></p>")
    fired = report.findings
    return (f'<p class="meta">{escape(report.layer)} split across {", ".join(map(str, report.world_sizes))} ranks, '
            f'audited {"as causal, " if report.causal else ""}takes the '
            f'{"whole sequence" if report.takes == "full" else report.layout + " shard"}, {escape(report.dtype)}: '
            f'{escape(report.status)}</p>'
            + (f'<div class="wide readings">{results_table(fired)}</div>' if fired else "<p>No detector fired.</p>"))


def _section(variant: ShardedVariant, report) -> str:
    return f"""<section class="sharded-variant" id="sharded-{escape(variant.id)}">
<h3>{escape(variant.title)} <code>{escape(variant.id)}</code></h3>
<p>{escape(variant.explanation)}</p>
<p><b>Symptom:</b> {escape(variant.symptom)}</p>
<p><b>Observable when:</b> {escape(variant.detectable_when)}</p>
<h4>The mistake: <code>{escape(variant.cls.__name__)}.{escape(variant.step)}</code> against the correct form</h4>
{_step_diff(variant)}
<h4>The detector that caught it</h4>
{_caught(variant, report)}
<h4>The fix</h4>
<pre class="fix">{escape(variant.fix)}</pre>
<p><a href="#sharded-kill-matrix">↑ back to the sharded kill matrix</a></p>
</section>"""


def _matrix(audits: dict) -> str:
    """Variants x sharded detectors, as the catalog's kill matrix: each cell the verdict, the expected catches
    outlined (dashed where missed)."""
    detectors = list(dict.fromkeys(r.detector for report in audits.values() for r in report.results))
    head = "".join(f'<th class="det"><span>{escape(d)}</span></th>' for d in detectors)
    rows = []
    for vid, report in audits.items():
        expected, verdicts = SHARDED_VARIANTS[vid].expected_detectors, {r.detector: r for r in report.results}
        cells = []
        for d in detectors:
            r = verdicts.get(d)
            outline = (" expected" if r and r.fired else " missed") if d in expected else ""
            cells.append(f'<td class="k-{r.verdict if r else "skip"}{outline}" '
                         f'title="{escape(r.message if r else "not run")}">{r.verdict if r else "skip"}</td>')
        rows.append(f'<tr><th class="vid"><a href="#sharded-{escape(vid)}">{escape(vid)}</a></th>{"".join(cells)}</tr>')
    return (f'<div class="wide"><table class="sharded-matrix"><thead><tr><th class="vid">variant</th>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def sharded_chapter_html(audits: dict | None = None) -> str:
    """The chapter: its kill matrix (when audited) and one section per variant. `audits`: {variant id: its
    ShardedReport} (`audit_sharded_variant` of each); None or {} draws the lessons with the detectors expected."""
    audits = audits or {}
    matrix = (_matrix(audits) if audits else '<p class="meta">Not audited in this run (the kill matrix\'s sharded '
              'rows, which audit it, are slow: <code>pytest --slow tests/test_kill_matrix.py --html=...</code> draws '
              'them): each section names the detector the catalog expects and the cause it must name.</p>')
    sizes = ", ".join(map(str, KILL_MATRIX_WORLD_SIZES))
    return f"""<section class="sharded-chapter" id="sharded-chapter">
<h2>Sharded attention: one layer split across processes</h2>
<p>Each section is a form of <code>correct/sharded.py</code> (ring attention, Ulysses, head parallel, a
sequence-parallel front, data parallel beside context parallel) with one step overridden, audited by
<code>diagnostics.distributed.audit_sharded</code>
against the unsharded <code>correct.MultiHeadAttention(32, 8)</code> it was cut from, at {sizes} ranks in float32.
None of them raises; each is caught by the detector named, with the cause it read from the evidence.</p>
<h3 id="sharded-kill-matrix">Sharded kill matrix</h3>
{matrix}
{"".join(_section(v, audits.get(vid)) for vid, v in SHARDED_VARIANTS.items())}
</section>"""


__all__ = ["KILL_MATRIX_WORLD_SIZES", "audit_sharded_variant", "sharded_chapter_html"]
