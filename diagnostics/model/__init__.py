"""The model audit, a wing of its own: `audit_model(model)` audits every attention layer of a model in place and
runs the properties only a model has (`MODEL_DETECTORS`: prefix causality, cache parity, padding and batch
invariance, backend parity, gradient flow, sliding windows and chunks, packed documents), registered with the
same `@detector` as the layer detectors, on a `ModelContext`.

    _find.py       finding the attention modules        _inplace.py  capturing their calls, the in-place wrapper
    _runner.py     calling the model (keyword protocol) _tolerance.py parity tolerances (float64 golden rule)
    _context.py    what the detectors are judged on     _taps.py     layer outputs, and where a change starts
    _causal.py     whether the model is causal: declared, else measured on its layers
    runs.py causality.py cache.py padding.py backends.py gradients.py window.py packing.py
                   the model-level detectors
    _audit.py      audit_model()                        _report.py   ModelReport
    _towers.py     a model made of towers (CLIP's text and vision), audited tower by tower
    _plugin.py     the pytest plugin's model targets (imported by diagnostics.pytest_plugin, not here)

`MODULES` lists the model detector modules: importing this package imports them in that order, which is the
order the detectors run and are reported in (`model_runs` first: the others run only on a model that runs). A
new model detector is a new module here and its name in `MODULES`.
"""

from importlib import import_module

from .._registry import MODEL_DETECTORS

MODULES = ("runs", "causality", "cache", "padding", "backends", "gradients", "window", "packing")

for _name in MODULES:
    import_module(f"{__name__}.{_name}")

from ._audit import audit_model  # noqa: E402  (after its detectors are registered)
from ._report import ModelAuditError, ModelReport  # noqa: E402
from ._tolerance import FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR  # noqa: E402

__all__ = ["FUDGE", "FUDGE_BY_DTYPE", "GOLDEN_FLOOR", "MODEL_DETECTORS", "MODULES", "ModelAuditError", "ModelReport",
           "audit_model"]
