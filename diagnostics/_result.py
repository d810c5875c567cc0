"""What a detector returns, and the registry entry that describes a detector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

VERDICTS = ("pass", "warn", "fail", "skip")


@dataclass(frozen=True)
class DetectorResult:
    """One detector's honest verdict on one layer.

    `value` is the measured quantity, `threshold` the most a correct layer may show, `margin` how far
    correct layers measured stay from it at this dtype, `evidence` the assert_close-style details
    (count, fraction, worst case and where, what was allowed), `fix` what to change when it fires.
    """

    detector: str
    verdict: str
    message: str
    value: float | None = None
    threshold: float | None = None
    margin: str = ""
    evidence: str = ""
    fix: str = ""
    extras: dict = field(default_factory=dict, compare=False, repr=False)  # e.g. weights for reports

    @property
    def severity(self) -> str:
        return self.verdict

    @property
    def fired(self) -> bool:
        return self.verdict in ("warn", "fail")


Finding = DetectorResult  # a result whose verdict is warn or fail


@dataclass(frozen=True)
class Detector:
    """A registry entry: the property it checks, the mistakes it targets, and the check itself."""

    id: str
    description: str
    targets: tuple[str, ...]
    fix: str
    check: Callable = field(repr=False)
    needs: str = "any attention layer"
