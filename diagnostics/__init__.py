"""Detectors for silent attention mistakes, and `audit()` that runs them on any attention layer."""

__all__: list[str] = []
