"""The one error type `diagnostics` raises for misuse of its API (never for a broken layer: that is a finding),
and `BlindProbe`, the signal of a probe that did not bite (a bug of diagnostics)."""

from __future__ import annotations


class BlindProbe(Exception):
    """A probe whose own control failed: the perturbation did not change what it claims. A bug in
    diagnostics, never a finding about the layer."""


class AuditUsageError(TypeError):
    """The audit cannot be set up: the message says what was expected, what was seen, and the fix."""


def expect(condition: bool, expected: str, seen: str, fix: str) -> None:
    if not condition:
        raise AuditUsageError(f"expected {expected}; got {seen}. Fix: {fix}")
