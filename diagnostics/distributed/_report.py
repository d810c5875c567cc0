"""What `audit_sharded` returns: `ShardedReport`, rendered through the same functions as a layer's report
(`diagnostics._report`: result rows, finding blocks, JSON of a result, `Report`'s status and raising; and
`diagnostics._html`: the same finding blocks and results table as the layer's and the model's pages)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._report import Report, find_result, finding_lines, result_dict, result_rows
from .._result import DetectorResult


class ShardedAuditError(AssertionError):
    """Raised by `ShardedReport.raise_for_findings()` unless the sharded audit passed."""


@dataclass
class ShardedReport(Report):
    """A sharded layer's audit: every sharded detector's result over all the world sizes, the status and why, and
    the groups of ranks started ({world size: [(start-up s, whole group s)]})."""

    failure = ShardedAuditError
    layer: str
    status: str
    status_reason: str
    results: list[DetectorResult]
    causal: bool
    takes: str
    layout: str
    world_sizes: tuple
    seq_len: int
    dtype: str
    seconds: float = 0.0
    groups: dict = field(default_factory=dict)
    unsharded: object = None  # the unsharded layer's AuditReport when asked for (check_unsharded=True)
    documents: list | None = None  # the declared document of each token (packed sequences), or None
    data_parallel: int = 1  # the data-parallel replicas declared beside the context parallelism

    @property
    def findings(self) -> list[DetectorResult]:
        return [r for r in self.results if r.fired]

    def result(self, detector: str) -> DetectorResult:
        """The result of one sharded detector; a clear error if it was not part of this audit."""
        return find_result(self.results, detector, "check the spelling (diagnostics.distributed.SHARDED_DETECTORS)")

    def fired(self) -> dict[str, str]:
        """{detector id: verdict} for the detectors that warned or failed."""
        return {r.detector: r.verdict for r in self.findings}

    def to_html(self, path) -> None:
        """A self-contained page: status, findings with their causes' fixes, every reading, the groups started."""
        from .._html import write_sharded_report_html

        write_sharded_report_html(self, path)

    def __str__(self) -> str:
        groups = sum(len(g) for g in self.groups.values())
        lines = [f"sharded audit of {self.layer}: {self.status.upper()} ({'causal, ' if self.causal else ''}"
                 f"takes the {'whole sequence' if self.takes == 'full' else self.layout + ' shard'}, "
                 f"{', '.join(map(str, self.world_sizes))} ranks, seq_len={self.seq_len}, {self.dtype}, "
                 + (f"documents {self.documents}, " if self.documents else "")
                 + (f"{self.data_parallel} data-parallel replicas, " if self.data_parallel > 1 else "")
                 + f"{groups} groups of ranks, {self.seconds:.2f} s)"]
        if self.status_reason:
            lines.append(f"  {self.status_reason}")
        lines += [""] + result_rows(self.results)
        for r in self.results:
            if r.fired or r.verdict == "error":
                lines += [""] + finding_lines(r)
        if self.unsharded is not None:
            lines += ["", f"the unsharded layer's own audit: {self.unsharded.status.upper()}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "status": self.status, "status_reason": self.status_reason,
                "passed": self.passed, "causal": self.causal, "takes": self.takes, "layout": self.layout,
                "world_sizes": list(self.world_sizes), "seq_len": self.seq_len, "dtype": self.dtype,
                "seconds": round(self.seconds, 4),
                "groups": {str(w): [[round(a, 4), round(b, 4)] for a, b in g] for w, g in self.groups.items()},
                "documents": self.documents, "data_parallel": self.data_parallel,
                "results": [result_dict(r) for r in self.results],
                "unsharded": None if self.unsharded is None else self.unsharded.to_dict()}


__all__ = ["ShardedAuditError", "ShardedReport"]
