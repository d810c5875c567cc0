"""The one error type `diagnostics` raises for misuse of its API (never for a broken layer: that is a finding),
`BlindProbe`, the signal of a probe that did not bite (a bug of diagnostics), and `ProbeNotTaken`, a probe the
layer as held cannot be given (skipped with its reason)."""

from __future__ import annotations


class BlindProbe(Exception):
    """A probe whose own control failed: the perturbation did not change what it claims. A bug in
    diagnostics, never a finding about the layer."""


class ProbeNotTaken(Exception):
    """A probe the layer, as the audit holds it, cannot be given: a layer audited in place raised at a length its
    model never called it with, while its captured arguments (a rotary table, a window grid, a relative bias) are
    tied to the length it was called with and could not be cut (`diagnostics.model._inplace`). The probe is skipped
    with `reason`, never a finding: the layer's own error is the exception's `__cause__`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class AuditUsageError(TypeError):
    """The audit cannot be set up: the message says what was expected, what was seen, and the fix. `adapter`: where
    the fix is to audit the layer through one of `diagnostics.adapters` ("image"), its name, for a program to follow
    the fix without reading the message."""

    def __init__(self, message: str, *, adapter: str | None = None):
        super().__init__(message)
        self.adapter = adapter


def expect(condition: bool, expected: str, seen: str, fix: str, *, adapter: str | None = None) -> None:
    if not condition:
        raise AuditUsageError(f"expected {expected}; got {seen}. Fix: {fix}", adapter=adapter)
