"""Detectors for silent attention mistakes, and `audit()` that runs them on any attention layer.

    import diagnostics
    report = diagnostics.audit(my_layer, causal=True)
    print(report)                      # a table of detectors, verdicts and evidence
    report.raise_for_findings()        # or diagnostics.assert_attention_ok(my_layer, causal=True)

`DETECTORS` is the registry: each entry has an id, the property it checks, the mistakes it targets and the
fix. `diagnostics` knows no implementation: it never imports `buggy_variants`.

The public names are loaded on first use (PEP 562), so that `import diagnostics` alone, which pytest does for
the plugin this package installs, costs no import of torch. `diagnostics.__version__` is the installed
distribution's version (`attention-mistakes`), read from its metadata on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._load import quiet_numpy_warning

# A torch without NumPy beside it (the README's CPU set-up) warns "Failed to initialize NumPy" when it is imported;
# this package never uses NumPy. Silenced from here on, for this one message, whoever imports torch next (the
# user's module, the plugin's targets, the audit); a torch imported before this package has warned already.
quiet_numpy_warning()

# public name -> the private module that defines it
_WHERE = {
    "DETECTORS": ".detectors",
    "AttentionAuditError": "._report",
    "AuditReport": "._report",
    "AuditUsageError": "._errors",
    "Detector": "._registry",
    "DetectorResult": "._result",
    "Finding": "._result",
    "MaskConvention": "._masks",
    "MODEL_DETECTORS": ".model",
    "ModelReport": ".model",
    "ShardedReport": ".distributed",
    "Site": "._result",
    "adapters": None,  # a submodule
    "patterns": None,  # a submodule: declared attention patterns
    "assert_attention_ok": "._audit",
    "audit": "._audit",
    "audit_model": ".model",
    "audit_sharded": ".distributed",
}

__all__ = [
    "DETECTORS",
    "MODEL_DETECTORS",
    "AttentionAuditError",
    "AuditReport",
    "AuditUsageError",
    "Detector",
    "DetectorResult",
    "Finding",
    "MaskConvention",
    "ModelReport",
    "ShardedReport",
    "Site",
    "adapters",
    "assert_attention_ok",
    "audit",
    "audit_model",
    "audit_sharded",
    "patterns",
]


def _version() -> str:
    """The version pip installed; from a source tree that was never installed, pyproject.toml's beside it."""
    from importlib import metadata
    from pathlib import Path
    import re

    try:
        return metadata.version("attention-mistakes")
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return f"{found.group(1)}+source" if found else "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        globals()[name] = value = _version()  # read once
        return value
    if name not in _WHERE:
        raise AttributeError(f"module 'diagnostics' has no attribute {name!r}")
    module = _WHERE[name]
    value = (importlib.import_module(f".{name}", __name__) if module is None
             else getattr(importlib.import_module(module, __name__), name))
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from . import adapters, patterns
    from ._audit import assert_attention_ok, audit
    from ._errors import AuditUsageError
    from ._masks import MaskConvention
    from .model import MODEL_DETECTORS, ModelReport, audit_model
    from ._registry import Detector
    from ._report import AttentionAuditError, AuditReport
    from ._result import DetectorResult, Finding, Site
    from .detectors import DETECTORS
    from .distributed import ShardedReport, audit_sharded
