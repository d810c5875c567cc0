"""The one error type `diagnostics` raises for misuse of its API (never for a broken layer: that is a finding)."""

from __future__ import annotations


class AuditUsageError(TypeError):
    """The audit cannot be set up: the message says what was expected, what was seen, and the fix."""


def expect(condition: bool, expected: str, seen: str, fix: str) -> None:
    if not condition:
        raise AuditUsageError(f"expected {expected}; got {seen}. Fix: {fix}")
