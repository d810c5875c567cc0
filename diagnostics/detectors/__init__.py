"""The layer detectors, one module per property family (being moved here from diagnostics/_detectors.py)."""

from .._detectors import DETECTORS  # noqa: F401  (temporary: the registry, filled by the old module)
