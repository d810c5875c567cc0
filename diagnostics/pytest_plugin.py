"""pytest plugin: audit your own attention layer as part of your test run.

    pytest --attention-audit=mymodule:layer [--attention-causal] [--attention-seq-len=N]

adds one test per detector (`attention-audit::future_leakage[mymodule:layer]`, ...) to the run: a failing
detector fails its test and shows the evidence and the fix; a warning passes with an
`AttentionAuditWarning`; a detector that cannot measure this layer skips with its reason. `obj` is a layer,
a class built with no arguments, or a zero-argument factory; a target that cannot be loaded is a
collection error. For your own tests, the fixture `attention_audit(layer, **audit_options)` returns the
`AuditReport` and fails the test with the report when a detector fails.

Installed with the package (entry point `pytest11`); elsewhere enable it with `-p diagnostics.pytest_plugin`.
Loading it costs next to nothing: torch and the audit are imported only when `--attention-audit` is given or
a test requests the `attention_audit` fixture (`python benchmarks/plugin_overhead.py` measures it).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported where used: the plugin loads in every pytest run, the audit needs torch
    from ._audit import AuditReport
    from ._result import DetectorResult


# audit() parameters as this plugin's options spell them, for messages that name an option
OPTIONS = {"causal": "--attention-causal", "seq_len": "--attention-seq-len", "require": "--attention-require",
           "strict": "--attention-strict"}


class AttentionAuditWarning(UserWarning):
    """A detector warned: the layer passes, but does something worth knowing (e.g. NaN on a fully masked row)."""


class DetectorFailed(Exception):
    """Raised by an audit item whose detector failed; `repr_failure` shows the evidence and the fix."""

    def __init__(self, result: DetectorResult, report: AuditReport):
        super().__init__(result.message)
        self.result, self.report = result, report


def _import_torch_quietly() -> None:
    """Import torch (once) without the "Failed to initialize NumPy" warning a torch without NumPy beside it
    gives at import (see `_cli.quiet_numpy_warning`); later imports of it, by the user's module, are silent."""
    from ._cli import quiet_numpy_warning

    with warnings.catch_warnings():
        quiet_numpy_warning()
        import torch  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attention-audit", "audit attention layers for silent mistakes (diagnostics)")
    group.addoption("--attention-audit", action="append", default=[], metavar="MODULE:OBJECT",
                    help="add one test per detector auditing this layer: pkg.module:obj, a layer, a class built "
                         "with no arguments or a zero-argument factory (repeat for several layers)")
    group.addoption("--attention-causal", action="store_true", default=False,
                    help="the audited layers promise causality: also check future leakage and causal alignment")
    group.addoption("--attention-seq-len", type=int, default=None, metavar="N",
                    help="probe length for --attention-audit (default 16; use your context length)")


def _warning(report: AuditReport, result: DetectorResult) -> AttentionAuditWarning:
    return AttentionAuditWarning(f"{report.layer}: {result.detector}: {result.message}; evidence: "
                                 f"{result.evidence}; fix: {result.fix}")


@pytest.fixture
def attention_audit():
    """`attention_audit(layer, causal=..., seq_len=..., ...)`: run `diagnostics.audit` with these options,
    fail the test showing the report if a detector fails, warn (AttentionAuditWarning) for each warning,
    and return the `AuditReport`."""

    _import_torch_quietly()
    from ._audit import audit

    def check(layer, **options) -> AuditReport:
        __tracebackhide__ = True
        report = audit(layer, **options)
        for result in report.results:
            if result.verdict == "warn":
                warnings.warn(_warning(report, result), stacklevel=2)  # at the line of the test that audits
        if not report.passed:
            pytest.fail(str(report), pytrace=False)
        return report

    return check


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so that they select among the audit's tests too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    specs = config.getoption("attention_audit")
    if not specs:
        return
    here = str(config.invocation_params.dir)
    if here not in sys.path:
        sys.path.insert(0, here)  # `mymodule:layer` from the directory pytest runs in
    for spec in specs:
        target = AuditTarget.from_parent(session, path=config.rootpath / "attention-audit", spec=spec)
        items.extend(session.genitems(target))


def _source(layer) -> tuple[Path, int] | None:
    """(file, 0-based line) where the layer's function or class is defined, if Python can tell."""
    for obj in (layer, type(layer)):
        try:
            return Path(inspect.getsourcefile(obj)), inspect.getsourcelines(obj)[1] - 1
        except (TypeError, OSError):
            continue
    return None


class AuditTarget(pytest.File):
    """One `--attention-audit` target: loads the layer at collection, audits it once, on first use."""

    def __init__(self, *, spec: str, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec
        self.layer = None
        self.source: tuple[Path, int] = (self.path, 0)  # where the layer is defined, once loaded
        self._report: AuditReport | None = None

    def collect(self):
        _import_torch_quietly()
        from ._cli import load_layer
        from ._detectors import DETECTORS
        from ._errors import AuditUsageError
        from ._subject import check_seq_len, make_subject

        seq_len = self.config.option.attention_seq_len
        if seq_len is not None and seq_len < 1:
            raise self.CollectError(f"--attention-seq-len: expected a length >= 1; got {seq_len}. Fix: pass your "
                                    f"context length, e.g. --attention-seq-len=128")
        try:
            self.layer = load_layer(self.spec)
            # cannot be called as an attention layer, or not at this length: say so now, not per detector
            check_seq_len(make_subject(self.layer, options=OPTIONS), seq_len, options=OPTIONS)
        except AuditUsageError as error:
            raise self.CollectError(f"--attention-audit={self.spec}: {error}") from error
        self.source = _source(self.layer) or self.source
        for detector in DETECTORS:
            yield AuditItem.from_parent(self, name=f"{detector}[{self.spec}]", detector=detector)

    def report(self) -> AuditReport:
        if self._report is None:
            from ._audit import audit

            options = self.config.option
            self._report = audit(self.layer, causal=options.attention_causal, seq_len=options.attention_seq_len)
        return self._report


class AuditItem(pytest.Item):
    """One detector's verdict on the target's layer."""

    def __init__(self, *, detector: str, **kwargs):
        super().__init__(**kwargs)
        self.detector = detector

    def runtest(self) -> None:
        report = self.parent.report()
        result = report.result(self.detector)
        if result.verdict == "fail":
            raise DetectorFailed(result, report)
        if result.verdict == "warn":
            self.warn(_warning(report, result))
        elif result.verdict == "skip":
            pytest.skip(f"{self.detector}: {result.message}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, DetectorFailed):
            from ._detectors import DETECTORS

            r, report = excinfo.value.result, excinfo.value.report
            return "\n".join([
                f"FAIL {r.detector}: {r.message}",
                f"  layer:    {report.layer} ({'causal, ' if report.causal else ''}seq_len={report.seq_len}, "
                f"{report.dtype} on {report.device})",
                f"  checks:   {DETECTORS[r.detector].description}",
                f"  evidence: {r.evidence}",
                f"  fix:      {r.fix}",
            ])
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        path, line = self.parent.source  # failures and warnings point at the layer's code
        return path, line, f"attention audit of {self.parent.spec}: {self.detector}"


__all__ = ["AttentionAuditWarning", "AuditItem", "AuditTarget", "attention_audit"]
