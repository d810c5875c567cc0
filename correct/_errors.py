"""The one error type `correct` raises for misuse."""

from __future__ import annotations


class AttentionUsageError(ValueError):
    """A call that cannot be right: the message says what was expected, what was seen, and the fix."""


def expect(condition: bool, expected: str, seen: str, fix: str) -> None:
    """Raise `AttentionUsageError` worded as expected / seen / fix unless `condition` holds."""
    if not condition:
        raise AttentionUsageError(f"expected {expected}; got {seen}. Fix: {fix}")
