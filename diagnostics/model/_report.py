"""What `audit_model` returns: `ModelReport`, rendered through the same functions as a layer's report
(`diagnostics._report`: result rows, finding blocks, JSON of a result, annotations; `diagnostics._html`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .._html import write_model_report_html
from .._report import Report, find_result, finding_lines, result_dict, result_rows
from .._result import DetectorResult
from ._find import FoundModule


class ModelAuditError(AssertionError):
    """Raised by `ModelReport.raise_for_findings()` unless the model audit passed."""


@dataclass
class ModelReport(Report):
    """A model's audit: the attention modules found, each one's in-place `AuditReport` (`layers`), and the
    model-level results, each naming the layer it was localised to (`DetectorResult.layer`, None: the model)."""

    failure = ModelAuditError
    model: str
    status: str
    status_reason: str
    causal: bool
    causal_source: str
    seq_len: int
    dtype: str
    found: list[FoundModule]
    layers: dict  # {module path: AuditReport}
    results: list[DetectorResult]  # the model-level detectors
    readings: dict = field(default_factory=dict)  # per-detector numbers for reports (reach per layer, cache errors)
    model_forwards: int = 0
    layer_calls: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def result_layers(self) -> dict:
        """{model-level detector: the layer it localised to}."""
        return {r.detector: r.layer for r in self.results if r.layer}

    @property
    def findings(self) -> list[DetectorResult]:
        """Every warning and failure: the model-level ones, then each layer's, with `layer` its module path."""
        return [r for r in self.results if r.fired] + [replace(r, layer=path) for path, rep in self.layers.items()
                                                       for r in rep.findings]

    def result(self, detector: str) -> DetectorResult:
        """The result of one model-level detector; a clear error if it was not part of this audit."""
        return find_result(self.results, detector, "check the spelling; per-layer results are in report.layers")

    def fired(self) -> dict:
        """{(layer path or None, detector): verdict} for every warning and failure."""
        return {(f.layer, f.detector): f.verdict for f in self.findings}

    def __str__(self) -> str:
        lines = [f"model audit of {self.model}: {self.status.upper()} ({'causal' if self.causal else 'not causal'}"
                 f" ({self.causal_source}), seq_len={self.seq_len}, {self.dtype}, {len(self.layers)} attention "
                 f"layers, {self.model_forwards} model forwards + {self.layer_calls} layer calls, {self.seconds:.2f} s)"]
        if self.status_reason:
            lines.append(f"  {self.status_reason}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += ["", "attention modules found:"]
        lines += [f"  {f.path}  {f.cls}  ({f.how}{'' if f.called else '; not called by the forward: not audited'})"
                  for f in self.found] or ["  none"]
        if self.results:
            lines += ["", "model-level:"] + result_rows(self.results)
        if self.layers:
            width = max(len(p) for p in self.layers)
            lines += ["", "layers (audited in place):"]
            for path, rep in self.layers.items():
                fired = ", ".join(f"{r.detector} {r.verdict}" for r in rep.results if r.fired or r.verdict == "error")
                lines.append(f"  {path:<{width}}  {rep.status.upper():<12}  {fired}")
        for f in self.findings + [r for r in self.results if r.verdict == "error"]:
            lines += [""] + finding_lines(f)
        for path, rep in self.layers.items():
            if rep.status == "inconclusive":
                lines += ["", f"INCONCLUSIVE {path}: {rep.status_reason}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "status": self.status, "status_reason": self.status_reason, "passed": self.passed,
            "causal": self.causal, "causal_source": self.causal_source, "seq_len": self.seq_len, "dtype": self.dtype,
            "model_forwards": self.model_forwards, "layer_calls": self.layer_calls, "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            "found": [{"path": f.path, "class": f.cls, "how": f.how, "called": f.called} for f in self.found],
            "results": [{**result_dict(r), "layer": r.layer} for r in self.results],
            "layers": {p: rep.to_dict() for p, rep in self.layers.items()},
            "findings": [{**result_dict(f), "layer": f.layer} for f in self.findings],
        }

    def to_html(self, path) -> None:
        """A self-contained page: status, modules found, model-level results, the per-layer table, findings."""
        write_model_report_html(self, path)


__all__ = ["ModelAuditError", "ModelReport"]
