"""What an audit returns: the report of a layer (`AuditReport`) and how a report reads as text, JSON, editor
annotations, HTML and an exit status. The model audit's report (`diagnostics.model.ModelReport`) renders its
results through the same functions: `result_rows`, `finding_lines`, `result_dict`, `annotation_lines`,
and `Report`, the behaviour both share. (A status as an exit status is `_cli.EXIT_STATUS`, which the command
reads before torch is imported.)"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import torch

from ._errors import AuditUsageError
from ._html import write_report_html
from ._result import DependencyMap, DetectorResult


class AttentionAuditError(AssertionError):
    """Raised by `raise_for_findings()` / `assert_attention_ok()`: the layer failed a detector."""


CORE = ("weight_row_sums", "softmax_saturation")
"""The attention itself: the weights are a distribution, at the right temperature. An audit that measured
neither (no softmax or fused attention seen, no weights returned) is inconclusive, never passed."""

STATUSES = ("passed", "failed", "inconclusive")
NEEDS_DECLARATION = "needs a declaration"
"""An inconclusive audit of a layer that ran under another convention than the audit's, which the audit cannot
choose for it (a mask of another shape or meaning): its status stays "inconclusive" (the exit status and the
plugin's `audit_status` item read it so), its reason and headline say this and name the declaration first."""


# "(RuntimeError: view size is not compatible (at least one dimension ...)...)": an exception quoted in a message,
# one level of parentheses inside it
QUOTED_EXCEPTION = re.compile(r"\((\w+(?:Error|Exception)): (?:[^()]|\([^()]*\))*\)")


def result_rows(results, *, indent: str = "  ") -> list[str]:
    """One line per result: `detector  VERDICT  message`, aligned, and `[at layer]` where it names one. An
    exception quoted again (the layer raised it on several detectors' probes) is named, not repeated."""
    width = max((len(r.detector) for r in results), default=0)
    seen: dict[str, str] = {}  # quoted exception -> the detector whose line quoted it first

    def fold(match, detector: str) -> str:
        quoted = match.group(0)
        if seen.setdefault(quoted, detector) == detector:
            return quoted
        return f"({match.group(1)}, the one quoted at {seen[quoted]})"

    return [f"{indent}{r.detector:<{width}}  {r.verdict.upper():<5}  "
            + QUOTED_EXCEPTION.sub(lambda m, d=r.detector: fold(m, d), r.message)
            + (f"  [at {r.layer}]" if r.layer else "")
            for r in results]


def labelled(label: str, text: str) -> str:
    """`  label:    text`, the labels of a finding's block aligned."""
    return f"  {label + ':' if label else '':<9} {text}"


CELL_CHARS = {"seen": "#", "blocked": ".", "leak": "L", "over": "O", "unmeasured": "?"}
CELL_WORDS = {"seen": "allowed, seen", "blocked": "blocked, unseen", "leak": "blocked but seen (leak)",
              "over": "allowed but unseen (over-masked)", "unmeasured": "not measurable"}


def dependency_lines(m: DependencyMap) -> list[str]:
    """A finding's picture as text: the declared pattern ('#' allowed, '.' blocked) beside the measured one, one
    character per (query, key) cell (CELL_CHARS), rows labelled with their query, a ruler of the keys' last digits,
    and a legend of the kinds present."""
    kinds = m.kinds()
    n_q, n_k = len(kinds), len(kinds[0]) if kinds else 0
    ruler = "".join(str((m.k0 + j) % 10) for j in range(n_k))
    lines = [labelled("pattern", f"{m.pattern} declared, beside what was measured in sequence {m.sequence} "
                                 f"({m.how}): queries {m.q0}..{m.q0 + n_q - 1} down, keys {m.k0}..{m.k0 + n_k - 1} "
                                 f"across"),
             labelled("", f"    {'declared':<{n_k}}  measured"), labelled("", f"    {ruler}  {ruler}")]
    for i, (allowed, row) in enumerate(zip(m.declared.tolist(), kinds)):
        lines.append(labelled("", f"{m.q0 + i:>3} {''.join('#' if a else '.' for a in allowed)}  "
                                  f"{''.join(CELL_CHARS[k] for k in row)}"))
    counts = m.counts()
    legend = [f"{CELL_CHARS[k]} {CELL_WORDS[k]}" + (f" ({counts[k]})" if k in ("leak", "over") else "")
              for k in CELL_CHARS if counts[k] or k in ("seen", "blocked")]
    lines.append(labelled("", "   ".join(legend)))
    return lines


def finding_lines(r: DetectorResult, *, about: tuple = ()) -> list[str]:
    """A finding's block: `VERDICT detector[ at layer]: message`, then `about` ((label, text) pairs), the
    evidence, its sites (`where:`), and the fix (none for a crash of diagnostics, which the user cannot fix)."""
    at = f" at {r.layer}" if r.layer else ""
    lines = [f"{r.verdict.upper()} {r.detector}{at}: {r.message}"] + [labelled(k, v) for k, v in about]
    if r.evidence:
        lines.append(labelled("evidence", r.evidence))
    lines += [labelled("where" if n == 0 else "", site.describe()) for n, site in enumerate(r.where)]
    fix, general = r.remedy if r.fired else ("", True)
    if fix:
        lines.append(labelled("fix", fix + (" (the detector's general fix: the audit did not pin down the cause)"
                                            if general else "")))
    picture = r.extras.get("dependency_map")
    if isinstance(picture, DependencyMap):
        lines += dependency_lines(picture)
    return lines


def result_dict(r: DetectorResult) -> dict:
    """A result as JSON-ready data (the sites read, so that they travel)."""
    return {"detector": r.detector, "verdict": r.verdict, "message": r.message, "value": r.value,
            "threshold": r.threshold, "margin": r.margin, "evidence": r.evidence,
            "fix": r.remedy[0] if r.fired else "", "fix_is_general": r.remedy[1] if r.fired else None,
            "where": [site.to_dict() for site in r.where]}


def annotation_lines(findings) -> list[str]:
    """One `file:line: error|warning|note: detector: message` line per site of each finding, the format
    editors and CI annotate: the first site of a finding carries its message, the others their reason."""
    lines = []
    for r in findings:
        at = f" (at {r.layer})" if r.layer else ""
        for n, site in enumerate(r.where):
            kind = ("error" if r.verdict == "fail" else "warning") if n == 0 else "note"
            text = r.message + at if n == 0 else "; ".join(x for x in (site.op, site.note) if x)
            lines.append(f"{site.path}:{site.line}: {kind}: {r.detector}: {text}")
    return lines


JUNIT_ELEMENT = {"fail": "failure", "error": "error", "skip": "skipped"}
"""A verdict as JUnit XML writes it inside its <testcase>; a pass and a warning are a plain (passed) testcase."""


def junit_suite(name: str, report) -> ET.Element:
    """A report (a layer's or a model's) as a JUnit <testsuite name=name>: one <testcase> per detector (a model's
    layers' as classname `name.layer`), a failure, error or skipped element carrying the finding's message, its
    block (evidence, where, fix) as text; a warning's message goes to the testcase's <system-out>."""
    rows = [(name, r) for r in report.results]
    rows += [(f"{name}.{path}", r) for path, layer in getattr(report, "layers", {}).items() for r in layer.results]
    suite = ET.Element("testsuite", name=name, tests=str(len(rows)),
                       failures=str(sum(r.verdict == "fail" for _, r in rows)),
                       errors=str(sum(r.verdict == "error" for _, r in rows)),
                       skipped=str(sum(r.verdict == "skip" for _, r in rows)),
                       time=f"{getattr(report, 'seconds', 0.0):.3f}")
    for classname, r in rows:
        case = ET.SubElement(suite, "testcase", classname=classname, name=r.detector, time="0")
        kind = JUNIT_ELEMENT.get(r.verdict)
        if kind is not None:
            element = ET.SubElement(case, kind, message=r.message, type=r.verdict)
            element.text = "\n".join(finding_lines(r))
        elif r.verdict == "warn":
            ET.SubElement(case, "system-out").text = "\n".join(finding_lines(r))
    return suite


def find_result(results, detector: str, fix: str) -> DetectorResult:
    """The result of `detector` among `results`; a clear error (with `fix`) if it is not there."""
    for r in results:
        if r.detector == detector:
            return r
    raise AuditUsageError(f"expected the id of a detector this audit ran ({', '.join(r.detector for r in results) or 'none'}); "
                          f"got {detector!r}. Fix: {fix}")


class Report:
    """What a layer's and a model's report share: the status, the findings, and raising unless it passed."""

    failure: type = AssertionError  # what raise_for_findings raises
    status: str

    @property
    def passed(self) -> bool:
        """True only when no detector failed and the core properties were measured (status "passed");
        warnings do not fail an audit, an inconclusive one is not passed."""
        return self.status == "passed"

    def annotations(self) -> list[str]:
        """`file:line: error|warning|note: detector: message` lines for the findings' sites (`annotation_lines`)."""
        return annotation_lines(self.findings)

    def raise_for_findings(self) -> None:
        """Raise `failure` with the report unless the audit passed (failed or inconclusive)."""
        __tracebackhide__ = True
        if not self.passed:
            raise self.failure(str(self))


@dataclass
class AuditReport(Report):
    """A layer's audit: every detector's result, the status and why, and the standard probe's weights."""

    failure = AttentionAuditError
    layer: str
    results: list[DetectorResult]
    causal: bool
    seq_len: int
    dtype: str
    device: str
    forward_passes: int
    seconds: float
    settings: dict = field(default_factory=dict)
    weights: torch.Tensor | None = field(default=None, repr=False)  # (B, [H,] Tq, Tk) of the standard probe
    weights_source: str = ""  # "returned weights" or "observed softmax output (dim=...)"
    status: str = "passed"  # "passed" | "failed" | "inconclusive"
    status_reason: str = ""

    @property
    def findings(self) -> list[DetectorResult]:
        return [r for r in self.results if r.fired]

    @property
    def declaration(self) -> str:
        """The declaration the audit needs to measure all it could ("mask='key_padding'"), or "": that of the first
        result that names one (a failed audit names it too, in its status reason)."""
        return next((r.declaration for r in self.results if r.declaration), "")

    @property
    def headline(self) -> str:
        """The status as the reports' first line shows it: `FAILED`, or `INCONCLUSIVE (needs a declaration:
        mask='key_padding')` where that is why it is inconclusive."""
        declaration = self.declaration if self.status == "inconclusive" else ""
        return self.status.upper() + (f" ({NEEDS_DECLARATION}: {declaration})" if declaration else "")

    def result(self, detector: str) -> DetectorResult:
        """The result of one detector; a clear error if it was not part of this audit."""
        return find_result(self.results, detector, f"run it (detectors=[..., {detector!r}]) or check the spelling")

    def fired(self) -> dict[str, str]:
        """{detector id: verdict} for the detectors that warned or failed."""
        return {r.detector: r.verdict for r in self.findings}

    def __str__(self) -> str:
        head = (f"attention audit of {self.layer}: {self.headline} "
                f"({'causal, ' if self.causal else ''}seq_len={self.seq_len}, {self.dtype} on {self.device}, "
                f"{self.forward_passes} forward passes of work, {self.seconds:.2f} s)")
        lines = [head]
        if self.status_reason:
            lines.append(f"  {self.status_reason}")
        if self.results:
            lines += [""] + result_rows(self.results)
        for r in self.results:
            if r.fired or r.verdict == "error":
                lines += [""] + finding_lines(r)
        return "\n".join(lines)

    def to_html(self, path) -> None:
        """Write a self-contained HTML page: findings, evidence, fixes, and heatmaps of the weights."""
        write_report_html(self, path)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer, "status": self.status, "status_reason": self.status_reason, "passed": self.passed,
            "needs_declaration": self.declaration,
            "causal": self.causal, "seq_len": self.seq_len, "dtype": self.dtype, "device": self.device,
            "forward_passes": self.forward_passes, "seconds": round(self.seconds, 4),
            "results": [result_dict(r) for r in self.results],
        }


__all__ = ["CELL_CHARS", "CELL_WORDS", "CORE", "JUNIT_ELEMENT", "NEEDS_DECLARATION", "STATUSES", "AttentionAuditError", "AuditReport", "Report", "annotation_lines",
           "dependency_lines", "find_result", "finding_lines", "junit_suite", "labelled", "result_dict", "result_rows"]
