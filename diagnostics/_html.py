"""HTML for attention reports: escaping, a hand-built SVG heatmap of attention weights, the table of detector results,
`write_report_html` behind `AuditReport.to_html` and `model_report_html` behind `ModelReport.to_html`.

Every page is one self-contained file that opens offline: styles in one <style> block, heatmaps as inline SVG whose
cells are one PNG inside it (a `data:` URL written here with zlib and struct), no scripts, nothing fetched. The test
suite's teaching report (buggy_variants/teaching_report.py) builds on the same pieces, so a user's audit page and
the catalog's report look and read alike.
"""

from __future__ import annotations

import base64
import html
import math
import re
import struct
import zlib
from pathlib import Path

import torch

from ._errors import AuditUsageError
from ._result import DependencyMap

# Scoped under `.am` so that the rules do not leak into a host page (pytest-html's report has its own CSS).
STYLE = """
.am { color: #1a1a1a; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
      max-width: 1180px; }
.am h1 { font-size: 24px; margin: 0.4em 0; }
.am h2 { font-size: 19px; margin: 1.4em 0 0.4em; color: #1a1a1a; }
.am h3 { font-size: 17px; margin: 0 0 0.4em; color: #1a1a1a; }
.am h4 { font-size: 14px; margin: 1.1em 0 0.3em; color: #333; }
.am p { color: #1a1a1a; margin: 0.35em 0; }
.am a { color: #0b5cad; }
.am code, .am pre { font: 12.5px/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
.am pre { background: #f6f8fa; border: 1px solid #d8dee4; border-radius: 4px; padding: 8px 10px;
          overflow-x: auto; margin: 0.3em 0; color: #1a1a1a; }
.am .meta, .am .margin { color: #555; }
.am .margin { font-size: 12px; }
.am table.results { border-collapse: collapse; width: 100%; margin: 0.3em 0; }
.am table.results th, .am table.results td { border: 1px solid #d8dee4; padding: 4px 6px; text-align: left;
                                             vertical-align: top; color: #1a1a1a; }
.am table.results th { background: #f0f3f6; }
.am table.results td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.am .verdict { display: inline-block; min-width: 3.2em; text-align: center; border-radius: 3px;
               padding: 0 4px; font-weight: 600; font-size: 12px; }
.am .v-fail { background: #d73a49; color: #fff; }
.am .v-warn { background: #f0b400; color: #1a1a1a; }
.am .v-pass { background: #dcefdc; color: #1e5e1e; }
.am .v-skip { background: #eceff1; color: #555; }
.am .finding { border-left: 4px solid #d73a49; background: #fdf3f4; padding: 6px 10px; margin: 0.5em 0; }
.am .finding.warn { border-left-color: #f0b400; background: #fffaf0; }
.am figure { display: inline-block; margin: 0 24px 8px 0; vertical-align: top; }
.am figcaption { font-size: 13px; color: #333; margin-bottom: 2px; }
.am ol.where { margin: 0.2em 0 0.4em; padding-left: 1.6em; }
.am ol.where pre { margin: 0.1em 0; }
.am .hit { background: #fff1a8; outline: 2px solid #d73a49; }
.am svg.heatmap text, .am svg.pattern text { font-family: system-ui, Helvetica, Arial, sans-serif; fill: #333; }
"""

# Colour ramps (ColorBrewer "Blues" / "Reds", light to dark): positive weights blue, negative ones red. An
# exact 0 (a masked key) is pure white, one step lighter than the ramp starts, so masks stay visible.
_BLUES = ((0xf7, 0xfb, 0xff), (0xde, 0xeb, 0xf7), (0xc6, 0xdb, 0xef), (0x9e, 0xca, 0xe1), (0x6b, 0xae, 0xd6),
          (0x42, 0x92, 0xc6), (0x21, 0x71, 0xb5), (0x08, 0x51, 0x9c), (0x08, 0x30, 0x6b))
_REDS = ((0xff, 0xf5, 0xf0), (0xfe, 0xe0, 0xd2), (0xfc, 0xbb, 0xa1), (0xfc, 0x92, 0x72), (0xfb, 0x6a, 0x4a),
         (0xef, 0x3b, 0x2c), (0xcb, 0x18, 0x1d), (0xa5, 0x0f, 0x15), (0x67, 0x00, 0x0d))
ZERO_COLOUR = "#ffffff"
NONFINITE_COLOUR = "#e7298a"  # magenta: in neither ramp, so a NaN row cannot pass for a large weight
MAX_CELLS = 64  # larger maps are cropped to their first 64 queries and keys: beyond that a cell is < 4 px


def escape(value) -> str:
    """`value` as text safe inside HTML elements and attribute values."""
    return html.escape(str(value), quote=True)


VIEWPORT = '<meta name="viewport" content="width=device-width, initial-scale=1">'  # a phone lays it out at its width


def prose(value) -> str:
    """`value` escaped, with its `backticked` spans (as the reports' messages quote code) set as <code>."""
    return re.sub(r"`([^`\n]+)`", r"<code>\1</code>", escape(value))


def number(x: float | None) -> str:
    """A measured value or threshold as a reader wants it: 4 significant digits, "—" when not measured."""
    if x is None:
        return "—"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def verdict_badge(verdict: str) -> str:
    return f'<span class="verdict v-{escape(verdict)}">{escape(verdict)}</span>'


def first_map(weights: torch.Tensor) -> torch.Tensor:
    """The (Tq, Tk) map of batch 0 (and head 0) from weights shaped (B, [H,] Tq, Tk)."""
    w = weights.detach().to("cpu", torch.float64)
    while w.dim() > 2:
        w = w[0]
    return w


def colour(value: float, vmax: float) -> str:
    """Hex colour of one weight on a scale that saturates at |value| = vmax (see the ramps above)."""
    if not math.isfinite(value):
        return NONFINITE_COLOUR
    if value == 0:
        return ZERO_COLOUR
    ramp = _BLUES if value > 0 else _REDS
    t = min(abs(value) / vmax, 1.0) * (len(ramp) - 1)
    i = min(int(t), len(ramp) - 2)
    f = t - i
    rgb = (round(a + (b - a) * f) for a, b in zip(ramp[i], ramp[i + 1]))
    return "#" + "".join(f"{c:02x}" for c in rgb)


def scale_max(*maps: torch.Tensor) -> float:
    """The largest finite |weight| of the maps: one colour scale for maps that are compared side by side."""
    finite = [m[torch.isfinite(m)].abs() for m in maps]
    return max([float(f.max()) for f in finite if f.numel()] + [1e-12])


def png_data_url(pixels: list[list[str]]) -> str:
    """A `data:image/png;base64,...` URL of an RGB image, one pixel per entry of `pixels` (rows of "#rrggbb"), written
    with the standard library: the PNG signature, IHDR (8-bit truecolour), one zlib-compressed IDAT of the rows, each
    behind filter byte 0, and IEND (https://www.w3.org/TR/png/)."""
    height, width = len(pixels), len(pixels[0])

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + bytes.fromhex("".join(c.removeprefix("#") for c in row)) for row in pixels)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


PIXELATED = 'preserveAspectRatio="none" image-rendering="optimizeSpeed" style="image-rendering: pixelated"'
"""An <image>'s pixels scaled up as sharp squares, not blurred into each other (Chromium reads the style, older
renderers the attribute)."""


def heatmap_svg(weights: torch.Tensor, *, vmax: float | None = None, label: str = "attention weights") -> str:
    """An inline SVG heatmap of a (Tq, Tk) map: rows are queries, columns keys, a colour bar underneath.

    The cells are one PNG of a pixel per cell, scaled up (a <rect> per cell with its value as a tooltip made the
    teaching report's 62 heatmaps 1.1 MB); the grid between cells is one path drawn over it, and the image's
    tooltip names the largest weight and where it is. `vmax` fixes the colour scale (pass the same to maps that are
    compared); by default it is the map's largest finite |weight|.
    """
    m = weights.detach().to("cpu", torch.float64)
    t_q, t_k = m.shape
    cropped = max(t_q, t_k) > MAX_CELLS
    m = m[:MAX_CELLS, :MAX_CELLS]
    rows, cols = m.shape
    vmax = scale_max(m) if vmax is None else vmax
    cell = max(4, min(18, 288 // max(rows, cols)))
    gap = 1 if cell >= 8 else 0  # a white grid between cells large enough to keep one
    left, top = 48, 36  # room for the "query" / "key" labels and the tick labels
    width, height = cols * cell, rows * cell
    step = 1
    while step * cell < 20:  # tick labels at least 20 px apart, room for two digits
        step *= 2

    parts = [f'<text x="{left + width / 2}" y="12" text-anchor="middle" font-size="12" font-weight="600">key</text>',
             f'<text x="12" y="{top + height / 2}" text-anchor="middle" font-size="12" font-weight="600" '
             f'transform="rotate(-90 12 {top + height / 2})">query</text>']
    for j in range(0, cols, step):
        parts.append(f'<text x="{left + j * cell + cell / 2}" y="{top - 6}" text-anchor="middle" '
                     f'font-size="10">{j}</text>')
    for i in range(0, rows, step):
        parts.append(f'<text x="{left - 5}" y="{top + i * cell + cell / 2 + 3.5}" text-anchor="end" '
                     f'font-size="10">{i}</text>')
    finite = torch.where(torch.isfinite(m), m.abs(), torch.full_like(m, -1.0))
    top_i, top_j = divmod(int(finite.argmax()), cols)
    summary = (f"{rows} queries x {cols} keys; the largest |weight| {m[top_i, top_j].item():.4g} at query {top_i}, "
               f"key {top_j}")
    parts.append(f'<image x="{left}" y="{top}" width="{width}" height="{height}" {PIXELATED} '
                 f'href="{png_data_url([[colour(v, vmax) for v in row] for row in m.tolist()])}">'
                 f'<title>{escape(summary)}</title></image>')
    if gap:  # the grid: a line of the grid colour between neighbouring cells, one path for all of them
        lines = [f"M{left + j * cell - 0.5} {top - 1}v{height + 1}" for j in range(cols + 1)]
        lines += [f"M{left - 1} {top + i * cell - 0.5}h{width + 1}" for i in range(rows + 1)]
        parts.append(f'<path d="{"".join(lines)}" stroke="#d0d7de" stroke-width="1" fill="none"/>')

    # The colour bar: 0 to vmax in blue, and -vmax to 0 in red when the map has negative weights.
    negative = bool((m[torch.isfinite(m)] < 0).any())
    bar_y, bar_w = top + height + 14, max(width, 200)
    lo = -vmax if negative else 0.0
    steps = 40
    bar = [[colour(lo + (vmax - lo) * (s + 0.5) / steps, vmax) for s in range(steps)]]
    parts.append(f'<image x="{left}" y="{bar_y}" width="{bar_w}" height="10" {PIXELATED} href="{png_data_url(bar)}"/>')
    parts.append(f'<text x="{left}" y="{bar_y + 22}" font-size="10">{lo:.3g}</text>')
    if negative:
        parts.append(f'<text x="{left + bar_w / 2}" y="{bar_y + 22}" font-size="10" text-anchor="middle">0</text>')
    parts.append(f'<text x="{left + bar_w}" y="{bar_y + 22}" font-size="10" text-anchor="end">{vmax:.3g}</text>')

    # Swatches for the two colours that are off the bar, and a note when the map was cropped.
    legend_y = bar_y + 30
    notes = [(ZERO_COLOUR, "exactly 0")] if bool((m == 0).any()) else []
    if not bool(torch.isfinite(m).all()):
        notes.append((NONFINITE_COLOUR, "NaN or inf"))
    x = left
    for fill, text in notes:
        parts.append(f'<rect x="{x}" y="{legend_y}" width="10" height="10" fill="{fill}" stroke="#888"/>'
                     f'<text x="{x + 14}" y="{legend_y + 9}" font-size="10">{text}</text>')
        x += 24 + 6 * len(text)
    total_h = legend_y + (16 if notes else 0)
    total_w = left + bar_w + 12
    if cropped:
        note = f"showing the first {rows} of {t_q} queries and {cols} of {t_k} keys"
        parts.append(f'<text x="{left}" y="{total_h + 10}" font-size="10">{note}</text>')
        total_h += 16
        total_w = max(total_w, left + 6 * len(note))
    return (f'<svg class="heatmap" width="{total_w}" height="{total_h}" '
            f'viewBox="0 0 {total_w} {total_h}" role="img" aria-label="{escape(label)}" '
            f'shape-rendering="crispEdges">' + "".join(parts) + "</svg>")


# A finding's picture (a DependencyMap): the declared pattern beside the measured one. Allowed and seen in the
# heatmaps' blue, blocked white; the cells that differ in the verdicts' colours, red for a leak (seen although
# blocked) and amber for over-masking (allowed but unseen), outlined in both grids; grey where nothing could be
# measured.
CELL_COLOURS = {"seen": "#4292c6", "blocked": "#ffffff", "leak": "#d73a49", "over": "#f0b400", "unmeasured": "#d0d7de"}
CELL_LABELS = {"seen": "allowed, seen", "blocked": "blocked, unseen", "leak": "blocked but seen (leak)",
               "over": "allowed but unseen (over-masked)", "unmeasured": "not measurable"}


def dependency_svg(m) -> str:
    """An inline SVG of a DependencyMap: the declared grid and the measured grid side by side (rows are queries,
    columns keys), the cells where they differ coloured and outlined in both, a legend with the count of each kind
    underneath."""
    kinds = m.kinds()
    n_q, n_k = len(kinds), len(kinds[0]) if kinds else 0
    cell = max(6, min(16, 256 // max(n_q, n_k, 1)))  # a little smaller than the heatmaps': two grids side by side
    left, top, gap = 34, 44, 28  # room for the query labels, the titles and key labels, and between the grids
    width, height = n_k * cell, n_q * cell
    step = 1
    while step * cell < 16:
        step *= 2
    parts = []
    for g, title in enumerate(("declared", "measured")):
        x0 = left + g * (width + gap)
        parts.append(f'<text x="{x0 + width / 2}" y="12" text-anchor="middle" font-size="12" font-weight="600">'
                     f'{title}</text>')
        for j in range(0, n_k, step):
            parts.append(f'<text x="{x0 + j * cell + cell / 2}" y="{top - 6}" text-anchor="middle" font-size="9">'
                         f'{m.k0 + j}</text>')
        # the cells as one PNG of a pixel per cell (a <rect> per cell with a tooltip made 7 pictures 563 KB), the grid
        # over it as one path, and the cells where the grids differ outlined as another
        pixels = [[CELL_COLOURS["seen" if a else "blocked"] if g == 0 else CELL_COLOURS[kind]
                   for a, kind in zip(allowed, row)] for allowed, row in zip(m.declared.tolist(), kinds)]
        if pixels and pixels[0]:
            parts.append(f'<image x="{x0}" y="{top}" width="{width}" height="{height}" {PIXELATED} '
                         f'href="{png_data_url(pixels)}"><title>{escape(title)}: {escape(m.pattern)}, queries '
                         f'{m.q0}..{m.q0 + n_q - 1}, keys {m.k0}..{m.k0 + n_k - 1}</title></image>')
        grid = [f"M{x0 + j * cell - 0.5} {top - 1}v{height + 1}" for j in range(n_k + 1)]
        grid += [f"M{x0 - 1} {top + i * cell - 0.5}h{width + 1}" for i in range(n_q + 1)]
        parts.append(f'<path d="{"".join(grid)}" stroke="#d0d7de" stroke-width="1" fill="none"/>')
        differs = [f"M{x0 + j * cell} {top + i * cell}h{cell - 1}v{cell - 1}h{1 - cell}z"
                   for i, row in enumerate(kinds) for j, kind in enumerate(row) if kind in ("leak", "over")]
        if differs:
            parts.append(f'<path d="{"".join(differs)}" stroke="#1a1a1a" stroke-width="1.5" fill="none"/>')
    for i in range(0, n_q, step):
        parts.append(f'<text x="{left - 5}" y="{top + i * cell + cell / 2 + 3}" text-anchor="end" font-size="9">'
                     f'{m.q0 + i}</text>')
    parts.append(f'<text x="{left + width / 2}" y="26" text-anchor="middle" font-size="10">key</text>'
                 f'<text x="10" y="{top + height / 2}" text-anchor="middle" font-size="10" '
                 f'transform="rotate(-90 10 {top + height / 2})">query</text>')
    counts = m.counts()
    shown = [k for k in CELL_COLOURS if counts[k] or k in ("seen", "blocked")]
    y = top + height + 14
    for n, kind in enumerate(shown):
        ly = y + 15 * n
        parts.append(f'<rect x="{left}" y="{ly}" width="10" height="10" fill="{CELL_COLOURS[kind]}" stroke="#888"/>'
                     f'<text x="{left + 15}" y="{ly + 9}" font-size="10">{escape(CELL_LABELS[kind])}: {counts[kind]}'
                     f'</text>')
    total_w = max(left + 2 * width + gap + 8, left + 230)
    total_h = y + 15 * len(shown)
    label = f"{m.pattern} declared beside the measured dependency pattern"
    return (f'<svg class="pattern" width="{total_w}" height="{total_h}" viewBox="0 0 {total_w} {total_h}" '
            f'role="img" aria-label="{escape(label)}" shape-rendering="crispEdges">' + "".join(parts) + "</svg>")


def dependency_html(m) -> str:
    """A DependencyMap as a figure: the SVG and a caption that says what was measured."""
    n_q, n_k = m.declared.shape
    return (f'<figure class="pattern"><figcaption>{escape(m.pattern)}: declared, and measured in sequence '
            f'{m.sequence} ({escape(m.how)}), queries {m.q0}..{m.q0 + n_q - 1} down, keys {m.k0}..{m.k0 + n_k - 1} '
            f'across</figcaption>{dependency_svg(m)}</figure>')


def results_table(results, *, layers: bool = False) -> str:
    """The detector readings: verdict, message, measured value against its threshold, evidence and fix;
    `layers`: with a column for the layer each result names (a model audit's)."""
    rows = []
    for r in results:
        fix = f"<code>{escape(r.remedy[0])}</code>" if r.fired and r.remedy[0] else ""  # the cause's fix, if found
        # The margin says how far correct layers stay from the threshold: small print under the evidence.
        margin = f'<div class="margin">{escape(r.margin)}</div>' if r.margin else ""
        if r.fired and r.where:  # the first site; the finding's block (finding_html) lists them all
            margin += (f'<div class="margin">where: <code>{escape(r.where[0].path)}:{r.where[0].line}</code> '
                       f'<code>{escape(r.where[0].code)}</code></div>')
        layer = f'<td><code>{escape(r.layer or "")}</code></td>' if layers else ""
        rows.append(f'<tr><td><code>{escape(r.detector)}</code></td><td>{verdict_badge(r.verdict)}</td>{layer}'
                    f'<td>{prose(r.message)}</td><td class="num">{number(r.value)}</td>'
                    f'<td class="num">{number(r.threshold)}</td><td>{prose(r.evidence)}{margin}</td>'
                    f'<td>{fix}</td></tr>')
    return ('<table class="results"><thead><tr><th>detector</th><th>verdict</th>' + ("<th>layer</th>" if layers else "")
            + '<th>reading</th><th>value</th><th>threshold</th><th>evidence</th><th>fix</th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def where_html(sites) -> str:
    """The sites of a finding, most likely first: `file:line in function`, the line's code, and why."""
    if not sites:
        return ""
    items = []
    for site in sites:
        why = "; ".join(x for x in (site.op, site.note) if x)
        called = (f' <span class="margin">(called from {escape(site.callers[0][0].rsplit("/", 1)[-1])}:'
                  f'{site.callers[0][1]} in {escape(site.callers[0][2])})</span>' if site.callers else "")
        items.append(f'<li><code class="site">{escape(site.path)}:{site.line}</code> in <code>{escape(site.function)}'
                     f'</code>{called}<pre>{escape(site.code)}</pre><span class="margin">{escape(why)}</span></li>')
    return f'<p><b>Where:</b></p><ol class="where">{"".join(items)}</ol>'


def finding_html(r) -> str:
    """One warn/fail result as a block: what fired, the evidence, where in the code, and what to write instead."""
    at = f' at <code>{escape(r.layer)}</code>' if r.layer else ""
    picture = r.extras.get("dependency_map")
    return (f'<div class="finding {escape(r.verdict)}"><p>{verdict_badge(r.verdict)} <code>{escape(r.detector)}'
            f'</code>{at}: {prose(r.message)}</p><p><b>Evidence:</b> {prose(r.evidence) or "—"}</p>'
            f'{where_html(r.where)}<p><b>Fix:</b> <code>{escape(r.remedy[0] if r.fired else r.fix) or "—"}</code></p>'
            f'{dependency_html(picture) if isinstance(picture, DependencyMap) else ""}</div>')


def write_page(path, page: str) -> None:
    """Write an HTML page; a path that cannot be written is a usage error that says why and what to do."""
    target = Path(path)
    try:
        target.write_text(page, encoding="utf-8")
    except OSError as error:
        folder = target.parent
        why = ("its folder does not exist" if not folder.exists() else
               f"{type(error).__name__}: {error.strerror or error}")
        fix = (f"create {str(folder)!r} first, or pass a path in a folder you can write to" if not folder.exists()
               else "pass a path in a folder you can write to")
        raise AuditUsageError(f"expected a path the HTML report can be written to; got {str(path)!r} ({why}). "
                              f"Fix: {fix}") from None


def declaration_html(report) -> str:
    """The declaration an inconclusive audit needs, first, with why (its status reason); nothing otherwise."""
    if not report.declaration or report.status != "inconclusive":
        return ""
    return (f'<div class="finding skip"><p>{verdict_badge("skip")} Needs a declaration: audit with '
            f'<code>{escape(report.declaration)}</code></p><p>{escape(report.status_reason)}</p></div>\n')


NO_FINDINGS = "<p>No findings: every detector passed or was skipped.</p>"  # every report page's empty findings


def write_report_html(report, path) -> None:
    """Write `report` (an AuditReport) to `path` as one self-contained HTML page."""
    verdict = escape(report.headline)  # PASSED, FAILED, INCONCLUSIVE (needs a declaration: mask='key_padding')
    # form, d_model and num_heads are in the title (report.layer); what the audit did with the mask, in words
    takes_mask = report.settings.get("takes_mask")
    mask = "" if takes_mask is None else "; the layer takes a mask" if takes_mask else "; the layer takes no mask"
    if report.settings.get("pass_causal_mask"):
        mask += ", and the audit passed it a causal mask"
    findings = report.findings
    if report.weights is None:
        weights = ("<p>No weights to show: the layer returned none and no softmax output could be observed on "
                   "the standard probe.</p>")
    else:
        heads = "batch 0, head 0" if report.weights.dim() == 4 else "batch 0"
        weights = (f'<figure><figcaption>{heads} of the standard probe ({escape(report.weights_source)}), '
                   f'shape {tuple(report.weights.shape)}</figcaption>{heatmap_svg(first_map(report.weights))}'
                   f'</figure>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{VIEWPORT}<title>attention audit of {escape(report.layer)}: {verdict}</title>
<style>{STYLE}
body {{ margin: 24px; }}</style></head>
<body class="am">
<h1>Attention audit of {prose(report.layer)}: {verdict}</h1>
<p class="meta">{"causal, " if report.causal else ""}seq_len={report.seq_len}, {escape(report.dtype)} on
{escape(report.device)}, {report.forward_passes} forward passes of work, {report.seconds:.2f} s{escape(mask)}</p>
{declaration_html(report)}<h2>Findings</h2>
{"".join(finding_html(r) for r in findings) or NO_FINDINGS}
<h2>Attention weights</h2>
{weights}
<h2>All detector results</h2>
{results_table(report.results)}
</body></html>
"""
    write_page(path, page)


STATUS_LOOK = {"passed": "pass", "failed": "fail", "inconclusive": "warn"}  # a status in its verdict's colours


def status_badge(status: str) -> str:
    return f'<span class="verdict v-{STATUS_LOOK.get(status, "skip")}">{escape(status)}</span>'


def model_report_html(report, *, standalone: bool = True) -> str:
    """A model audit (a `ModelReport`) as HTML: status, the attention modules found, the model-level results
    with the layer each names, the layers audited in place, and every finding with its sites. `standalone`:
    a whole page; else the body, for a host page that has `STYLE`."""
    found = "".join(f"<tr><td><code>{escape(f.path)}</code></td><td>{escape(f.cls)}</td><td>{escape(f.how)}"
                    f"{'' if f.called else '; not called by the forward: not audited'}</td></tr>" for f in report.found)
    layers = "".join(
        f"<tr><td><code>{escape(p)}</code></td><td>{status_badge(rep.status)}</td><td>"
        f"{escape(', '.join(f'{r.detector} {r.verdict}' for r in rep.results if r.fired or r.verdict == 'error'))}"
        f"</td></tr>" for p, rep in report.layers.items())
    findings = "".join(finding_html(r) for r in report.findings)
    notes = "".join(f"<li>{prose(n)}</li>" for n in report.notes)
    body = (f'<h1>Model audit of {escape(report.model)}: {escape(report.status.upper())}</h1>'
            f'<p>{prose(report.status_reason)}</p>'
            f'<p class="meta">{"causal" if report.causal else "not causal"} ({escape(report.causal_source)}), '
            f'seq_len {report.seq_len}, {escape(report.dtype)}, {report.model_forwards} model forwards + '
            f'{report.layer_calls} layer calls, {report.seconds:.2f} s</p>'
            + (f"<ul class='meta'>{notes}</ul>" if notes else "") +
            f'<h2>Findings</h2>{findings or NO_FINDINGS}'
            f'<h2>Attention modules found</h2><table class="results"><thead><tr><th>module</th><th>class</th>'
            f'<th>how</th></tr></thead><tbody>{found or "<tr><td colspan=3>none</td></tr>"}</tbody></table>'
            f'<h2>Model-level detectors</h2>{results_table(report.results, layers=True)}'
            f'<h2>Layers, audited in place</h2><table class="results"><thead><tr><th>layer</th><th>status</th>'
            f'<th>findings</th></tr></thead><tbody>{layers}</tbody></table>')
    if not standalone:
        return body
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{VIEWPORT}<title>model audit of '
            f'{escape(report.model)}: {escape(report.status.upper())}</title><style>{STYLE}\nbody {{ margin: 24px; }}'
            f'</style></head>\n<body class="am">{body}</body></html>\n')


def sharded_report_html(report, *, standalone: bool = True) -> str:
    """A sharded audit (a `ShardedReport`) as HTML, in the same parts as a model audit's: status and why, the
    settings, every finding with its cause's fix, every sharded detector's reading, the groups of ranks started and the
    unsharded layer's own audit where it ran. `standalone`: a whole page; else the body, for a host page with
    `STYLE`."""
    how = "the whole sequence" if report.takes == "full" else f"its {report.layout} shard"
    extra = "".join([f", packed documents {report.documents}" if report.documents else "",
                     f", {report.data_parallel} data-parallel replicas" if report.data_parallel > 1 else ""])
    groups = "".join(f"<tr><td>{w}</td><td>{len(g)}</td><td class='num'>{sum(a for a, _ in g):.2f}</td>"
                     f"<td class='num'>{sum(b for _, b in g):.2f}</td></tr>" for w, g in report.groups.items())
    unsharded = ("" if report.unsharded is None else
                 f"<h2>The unsharded layer's own audit</h2><p>{status_badge(report.unsharded.status)} "
                 f"{prose(report.unsharded.status_reason)}</p>{results_table(report.unsharded.results)}")
    body = (f'<h1>Sharded audit of {escape(report.layer)}: {escape(report.status.upper())}</h1>'
            f'<p>{status_badge(report.status)} {prose(report.status_reason)}</p>'
            f'<p class="meta">{"causal" if report.causal else "not causal"}, takes {escape(how)}, '
            f'{escape(", ".join(map(str, report.world_sizes)))} ranks, seq_len {report.seq_len}, '
            f'{escape(report.dtype)}{escape(extra)}, {report.seconds:.2f} s</p>'
            f'<h2>Findings</h2>{"".join(finding_html(r) for r in report.findings) or NO_FINDINGS}'
            f'<h2>All sharded detector results</h2>{results_table(report.results)}'
            f'<h2>Groups of ranks started</h2><table class="results"><thead><tr><th>world size</th><th>groups</th>'
            f'<th>start-up s</th><th>whole s</th></tr></thead><tbody>{groups}</tbody></table>{unsharded}')
    if not standalone:
        return body
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{VIEWPORT}<title>sharded audit of '
            f'{escape(report.layer)}: {escape(report.status.upper())}</title><style>{STYLE}\nbody {{ margin: 24px; }}'
            f'</style></head>\n<body class="am">{body}</body></html>\n')


def write_sharded_report_html(report, path) -> None:
    """Write `report` (a ShardedReport) to `path` as one self-contained HTML page."""
    write_page(path, sharded_report_html(report))


def write_model_report_html(report, path) -> None:
    """Write `report` (a ModelReport) to `path` as one self-contained HTML page."""
    write_page(path, model_report_html(report))
