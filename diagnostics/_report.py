"""What an audit returns: the report of a layer (`AuditReport`) and how it reads as text, JSON, editor
annotations and HTML. The model audit's report (`ModelReport`) renders through the same functions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._errors import AuditUsageError
from ._result import DetectorResult


class AttentionAuditError(AssertionError):
    """Raised by `raise_for_findings()` / `assert_attention_ok()`: the layer failed a detector."""


CORE = ("weight_row_sums", "softmax_saturation")
"""The attention itself: the weights are a distribution, at the right temperature. An audit that measured
neither (no softmax or fused attention seen, no weights returned) is inconclusive, never passed."""

STATUSES = ("passed", "failed", "inconclusive")


@dataclass
class AuditReport:
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
    def passed(self) -> bool:
        """True only when no detector failed and the core properties were measured (status "passed");
        warnings do not fail an audit, an inconclusive one is not passed."""
        return self.status == "passed"

    @property
    def findings(self) -> list[DetectorResult]:
        return [r for r in self.results if r.fired]

    def result(self, detector: str) -> DetectorResult:
        """The result of one detector; a clear error if it was not part of this audit."""
        for r in self.results:
            if r.detector == detector:
                return r
        raise AuditUsageError(f"expected the id of a detector this audit ran ({', '.join(r.detector for r in self.results) or 'none'}); "
                              f"got {detector!r}. Fix: run it (detectors=[..., {detector!r}]) or check the spelling")

    def fired(self) -> dict[str, str]:
        """{detector id: verdict} for the detectors that warned or failed."""
        return {r.detector: r.verdict for r in self.findings}

    def __str__(self) -> str:
        head = (f"attention audit of {self.layer}: {self.status.upper()} "
                f"({'causal, ' if self.causal else ''}seq_len={self.seq_len}, {self.dtype} on {self.device}, "
                f"{self.forward_passes} forward passes, {self.seconds:.2f} s)")
        lines = [head]
        if self.status_reason:
            lines.append(f"  {self.status_reason}")
        if self.results:
            width = max(len(r.detector) for r in self.results)
            lines += [""] + [f"  {r.detector:<{width}}  {r.verdict.upper():<5}  {r.message}" for r in self.results]
        for r in self.results:
            if r.fired or r.verdict == "error":
                lines += ["", f"{r.verdict.upper()} {r.detector}: {r.message}"]
                if r.evidence:
                    lines.append(f"  evidence: {r.evidence}")
                lines += [f"  {'where:' if n == 0 else '':<9} {site.describe()}" for n, site in enumerate(r.where)]
                if r.fix and r.verdict != "error":
                    lines.append(f"  fix:      {r.fix}")
        return "\n".join(lines)

    def annotations(self) -> list[str]:
        """One `file:line: error|warning|note: detector: message` line per site of each finding, the format
        editors and CI annotate: the first site of a finding carries its message, the others their reason."""
        lines = []
        for r in self.findings:
            for n, site in enumerate(r.where):
                kind = ("error" if r.verdict == "fail" else "warning") if n == 0 else "note"
                text = r.message if n == 0 else "; ".join(x for x in (site.op, site.note) if x)
                lines.append(f"{site.path}:{site.line}: {kind}: {r.detector}: {text}")
        return lines

    def raise_for_findings(self) -> None:
        """Raise `AttentionAuditError` with the report unless the audit passed (failed or inconclusive)."""
        __tracebackhide__ = True
        if not self.passed:
            raise AttentionAuditError(str(self))

    def to_html(self, path) -> None:
        """Write a self-contained HTML page: findings, evidence, fixes, and heatmaps of the weights."""
        from ._html import write_report_html

        write_report_html(self, path)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer, "status": self.status, "status_reason": self.status_reason, "passed": self.passed,
            "causal": self.causal, "seq_len": self.seq_len, "dtype": self.dtype, "device": self.device,
            "forward_passes": self.forward_passes, "seconds": round(self.seconds, 4),
            "results": [{"detector": r.detector, "verdict": r.verdict, "message": r.message, "value": r.value,
                         "threshold": r.threshold, "margin": r.margin, "evidence": r.evidence, "fix": r.fix,
                         "where": [site.to_dict() for site in r.where]}
                        for r in self.results],
        }
