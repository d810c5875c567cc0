"""pytest plugin: audit your own attention layer as part of your test run.

    pytest --attention-audit=mymodule:layer [--attention-causal] [--attention-seq-len=N]
           [--attention-require=DET]... [--attention-strict] [--attention-mask-convention=CONVENTION]
           [--attention-layout=bhtd|bthd|btd|tbd] [--attention-pattern=PATTERN] [--attention-call=MODULE:FUNCTION]
           [--attention-cross] [--attention-positions=relative|absolute] [--attention-queries=Q]
    pytest --attention-audit-model=mymodule:make_model   (a whole model: see diagnostics/model/_plugin.py)

adds one test per detector (`attention-audit::future_leakage[mymodule:layer]`, ...) to the run: a failing
detector fails its test and shows the evidence and the fix; a warning passes with an
`AttentionAuditWarning`; a detector that cannot measure this layer skips with its reason (fails, if
`--attention-require` names it or `--attention-strict` is given); a detector that crashed fails with the
internal error. One more test per target, `audit_status[mymodule:layer]`, fails when the audit is
inconclusive: nothing failed, but it could not measure the attention itself. `obj` is a layer, a class
built with no arguments, or a zero-argument factory; a target that cannot be loaded is a collection error.
Each target may carry its own declarations after it, spelled as `attention-audit` spells them, which win over the
session's `--attention-*` options for that target: `--attention-audit="mymodule:decoder --causal"
--attention-audit="mymodule:encoder --mask key_padding"`.
For your own tests, the fixture `attention_audit(layer, **audit_options)` returns the `AuditReport` and
fails the test with the report unless the audit passed (failed or inconclusive). Declarations per test, class,
module or parametrized case (one target each) go on the marker `@pytest.mark.attention_audit(causal=True,
mask="additive", ...)`, in `audit()`'s keywords: the closest marker wins over farther ones, and the fixture's own
keywords over every marker.

Installed with the package (entry point `pytest11`); elsewhere enable it with `-p diagnostics.pytest_plugin`.
Loading it costs next to nothing: torch and the audit are imported only when `--attention-audit` is given or
a test requests the `attention_audit` fixture (`python benchmarks/plugin_overhead.py` measures it).
"""

from __future__ import annotations

import inspect
import shlex
import warnings
from collections.abc import Mapping
from pathlib import Path

from typing import TYPE_CHECKING

import pytest

from ._errors import AuditUsageError
from ._load import importable_from, load_call, load_layer, load_pattern, quiet_numpy_warning

if TYPE_CHECKING:  # imported where used: the plugin loads in every pytest run, the audit needs torch
    from ._report import AuditReport
    from ._result import DetectorResult


# audit() parameters as this plugin's options spell them, for messages that name an option
OPTIONS = {"causal": "--attention-causal", "seq_len": "--attention-seq-len", "require": "--attention-require",
           "strict": "--attention-strict", "mask": "--attention-mask-convention", "layout": "--attention-layout",
           "pattern": "--attention-pattern", "call": "--attention-call", "cross": "--attention-cross",
           "positions": "--attention-positions", "queries": "--attention-queries",
           "pattern_example": '--attention-pattern "sliding_window(4)"'}


MARKER = "attention_audit"  # @pytest.mark.attention_audit(**audit options): a test's declarations for the fixture


class AttentionAuditWarning(UserWarning):
    """A detector warned: the layer passes, but does something worth knowing (e.g. NaN on a fully masked row)."""


class DetectorFailed(Exception):
    """Raised by an audit item whose detector failed (or crashed: verdict "error"); `repr_failure` shows the
    evidence and the fix."""

    def __init__(self, result: DetectorResult, report: AuditReport):
        super().__init__(result.message)
        self.result, self.report = result, report


def _import_torch_quietly() -> None:
    """Import torch (once) without the "Failed to initialize NumPy" warning a torch without NumPy beside it
    gives at import (see `_load.quiet_numpy_warning`); later imports of it, by the user's module, are silent."""
    with warnings.catch_warnings():
        quiet_numpy_warning()
        import torch  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attention-audit", "audit attention layers for silent mistakes (diagnostics)")
    group.addoption("--attention-audit", action="append", default=[], metavar="MODULE:OBJECT",
                    help="add one test per detector auditing this layer: pkg.module:obj, a layer, a class built "
                         "with no arguments or a zero-argument factory (repeat for several layers); its own "
                         "declarations may follow it as attention-audit spells them, over the --attention-* "
                         "options: --attention-audit=\"mymodule:layer --causal --mask additive\"")
    group.addoption("--attention-audit-model", action="append", default=[], metavar="MODULE:OBJECT",
                    help="add tests auditing a whole model: one per model-level check and one per attention layer "
                         "found (pkg.module:obj, a model, a class or a zero-argument factory; repeatable)")
    group.addoption("--attention-causal", action="store_true", default=False,
                    help="the audited layers promise causality: also check future leakage and causal alignment")
    group.addoption("--attention-seq-len", type=int, default=None, metavar="N",
                    help="probe length for --attention-audit (default 16; use your context length)")
    group.addoption("--attention-require", action="append", default=[], metavar="DET",
                    help="a detector that must measure the audited layers: its skip fails (repeat for several)")
    group.addoption("--attention-strict", action="store_true", default=False,
                    help="every detector that applies to the audited layers must measure them: a 'not measured' "
                         "skip fails")
    group.addoption("--attention-mask-convention", default=None, metavar="CONVENTION",
                    help="how the audited layers take their mask: allowed (bool (B, 1, Tq, Tk), True = may attend; the "
                         "default), blocked, additive, key_padding, key_keep, mha_blocked, or MEANING:SHAPE such as "
                         "additive:B,Tq,Tk")
    group.addoption("--attention-pattern", default=None, metavar="PATTERN",
                    help="the attention pattern the audited layers promise, e.g. \"sliding_window(4)\" (causal, "
                         "sliding_window, chunked, prefix_lm, document, combined with & and |)")
    group.addoption("--attention-call", default=None, metavar="MODULE:FUNCTION",
                    help="how to call the audited layers: a function call(layer, x, mask), call(layer, query, memory, "
                         "mask) or call(layer, query, key, value, mask)")
    group.addoption("--attention-cross", action="store_true", default=False,
                    help="the audited layers are cross-attention: a raise at Tq != Tk fails")
    group.addoption("--attention-positions", default=None, metavar="POSITIONS", choices=("relative", "absolute"),
                    help="absolute: the audited layers add absolute position embeddings themselves (relative_positions "
                         "does not apply); relative: their positions are meant to be relative")
    group.addoption("--attention-queries", default=None, type=int, metavar="Q",
                    help="the audited layers attend with Q queries of their own (an attention-pooling head's learned "
                         "query), not one per token: their output is (B, Q, D), or (B, D) where Q = 1")
    group.addoption("--attention-layout", default=None, metavar="LAYOUT", choices=("bhtd", "bthd", "btd", "tbd"),
                    help="an audited function's tensors: bhtd (B, H, T, d; the default) or bthd (flash-attn's); a "
                         "module's tokens: btd (B, T, D; the default) or tbd (T, B, D, sequence first)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}(**options): declarations for the attention_audit fixture in this "
                                       "test, class or module, in audit()'s keywords (causal=True, mask='additive', "
                                       "seq_len=128, ...); the closest marker wins, the fixture call's keywords win "
                                       "over all")


def marker_options(node: pytest.Item, accepted: Mapping) -> dict:
    """The audit options that `@pytest.mark.attention_audit(...)` markers declare for `node`: farthest first (module,
    class, function, a parametrized case's marks), so that the closest wins. Anything but `audit()`'s keywords
    (`accepted`) fails the test with what was expected."""
    __tracebackhide__ = True
    options: dict = {}
    for mark in reversed(list(node.iter_markers(MARKER))):  # iter_markers gives the closest first
        unknown = [name for name in mark.kwargs if name not in accepted or name in ("layer", "progress")]
        if mark.args or unknown:
            got = ", ".join([repr(a) for a in mark.args] + [f"{name}=" for name in unknown])
            pytest.fail(f"expected @pytest.mark.{MARKER}(...) to name audit()'s keywords only ("
                        f"{', '.join(n for n in accepted if n not in ('layer', 'progress') and not n.startswith('_'))}"
                        f"); got {got}. Fix: e.g. @pytest.mark.{MARKER}(causal=True, mask='additive')", pytrace=False)
        options.update(mark.kwargs)
    return options


def _warning(report: AuditReport, result: DetectorResult) -> AttentionAuditWarning:
    where = f"; where: {result.where[0].describe(short=True)}" if result.where else ""
    return AttentionAuditWarning(f"{report.layer}: {result.detector}: {result.message}; evidence: "
                                 f"{result.evidence}{where}; fix: {result.fix}")


@pytest.fixture
def attention_audit(request: pytest.FixtureRequest):
    """`attention_audit(layer, causal=..., seq_len=..., require=..., strict=..., ...)`: run `diagnostics.audit`
    with these options over those the test's `@pytest.mark.attention_audit(...)` markers declare, warn
    (AttentionAuditWarning) for each warning, and return the `AuditReport`. The test fails, showing the report,
    unless the audit passed: when a detector failed, and also when the audit is inconclusive (it could not measure
    the attention itself, or a detector crashed)."""

    _import_torch_quietly()
    from ._audit import audit

    declared = marker_options(request.node, inspect.signature(audit).parameters)

    def check(layer, **options) -> AuditReport:
        __tracebackhide__ = True
        report = audit(layer, **{**declared, **options})
        for result in report.results:
            if result.verdict == "warn":
                warnings.warn(_warning(report, result), stacklevel=2)  # at the line of the test that audits
        if not report.passed:
            pytest.fail(str(report), pytrace=False)
        return report

    return check


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so that they select among the audit's tests too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    specs, models = config.getoption("attention_audit"), config.getoption("attention_audit_model")
    if not specs and not models:
        return
    importable_from(config.invocation_params.dir)  # `mymodule:layer` from the directory pytest runs in
    for spec in specs:
        target = AuditTarget.from_parent(session, path=config.rootpath / "attention-audit", spec=spec)
        items.extend(session.genitems(target))
    if models:
        _import_torch_quietly()
        from .model._plugin import ModelAuditTarget  # here: it imports torch and the audit

        for spec in models:
            target = ModelAuditTarget.from_parent(session, path=config.rootpath / "attention-audit-model", spec=spec)
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
        self.layer = self.pattern = self.call = None
        self.options: dict = {}  # audit()'s keywords for this target (`declared`), set at collection
        self.spelled: dict = OPTIONS
        self.source: tuple[Path, int] = (self.path, 0)  # where the layer is defined, once loaded
        self._report: AuditReport | None = None

    def collect(self):
        _import_torch_quietly()
        from . import DETECTORS  # here, not at the top: they import torch
        from ._subject import check_seq_len, make_subject

        try:
            target, self.options = self.declared()
        except AuditUsageError as error:
            raise self.CollectError(f"--attention-audit={self.spec}: {error}") from error
        options, spelled = self.options, self.spelled
        seq_len = options["seq_len"]
        if seq_len is not None and seq_len < 1:
            raise self.CollectError(f"{spelled['seq_len']}: expected a length >= 1; got {seq_len}. Fix: pass your "
                                    f"context length, e.g. {spelled['seq_len']}=128")
        unknown = [d for d in options["require"] if d not in DETECTORS]
        if unknown:
            raise self.CollectError(f"{spelled['require']}: expected detector ids from {', '.join(DETECTORS)}; got "
                                    f"{', '.join(unknown)}. Fix: check the spelling")
        try:
            self.layer = load_layer(target)
            self.pattern = (load_pattern(options["pattern"], spelled=spelled["pattern"])
                            if options["pattern"] is not None else None)
            self.call = load_call(options["call"], spelled=spelled["call"]) if options["call"] is not None else None
            # cannot be called as an attention layer, or not at this length: say so now, not per detector
            check_seq_len(make_subject(self.layer, d_model=options["d_model"], num_heads=options["num_heads"],
                                       mask=options["mask"], call=self.call, layout=options["layout"],
                                       queries=options["queries"], options=spelled), seq_len, options=spelled)
        except AuditUsageError as error:
            raise self.CollectError(f"--attention-audit={self.spec}: {error}") from error
        self.source = _source(self.layer) or self.source
        for detector in DETECTORS:
            yield AuditItem.from_parent(self, name=f"{detector}[{self.spec}]", detector=detector)
        yield AuditStatusItem.from_parent(self, name=f"audit_status[{self.spec}]")

    def declared(self) -> tuple[str, dict]:
        """(the target, its audit options): the session's `--attention-*` options, and over them the target's own
        declarations, written after it in `--attention-audit` as the command spells them
        (`--attention-audit="mymodule:layer --causal --mask additive"`), so that each target of a run says what it
        is. `self.spelled`: the options as the messages name them, the target's own spelling where it gave one."""
        from ._cli import OPTIONS as COMMAND, target_declarations

        target, *own = shlex.split(self.spec)
        option = self.config.option
        options = dict(causal=option.attention_causal, seq_len=option.attention_seq_len,
                       require=list(option.attention_require), strict=option.attention_strict,
                       mask=option.attention_mask_convention, layout=option.attention_layout,
                       pattern=option.attention_pattern, call=option.attention_call, cross=option.attention_cross,
                       positions=option.attention_positions, queries=option.attention_queries, d_model=None,
                       num_heads=None, scale=None)
        declared = target_declarations(own, target=target)
        self.spelled = {**OPTIONS, **{name: COMMAND[name] for name in declared}, "d_model": COMMAND["d_model"],
                        "num_heads": COMMAND["num_heads"], "scale": COMMAND["scale"]}
        if "pattern" in declared:
            self.spelled["pattern_example"] = COMMAND["pattern_example"]
        return target, {**options, **declared}

    def report(self) -> AuditReport:
        if self._report is None:
            from ._audit import audit

            options = {name: value for name, value in self.options.items() if name not in ("pattern", "call")}
            self._report = audit(self.layer, **options, pattern=self.pattern, call=self.call, _options=self.spelled)
        return self._report


class AuditItem(pytest.Item):
    """One detector's verdict on the target's layer."""

    def __init__(self, *, detector: str, **kwargs):
        super().__init__(**kwargs)
        self.detector = detector

    def runtest(self) -> None:
        report = self.parent.report()
        result = report.result(self.detector)
        if result.verdict in ("fail", "error"):
            raise DetectorFailed(result, report)
        if result.verdict == "warn":
            self.warn(_warning(report, result))
        elif result.verdict == "skip":
            pytest.skip(f"{self.detector}: {result.message}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, DetectorFailed):
            from . import DETECTORS  # here, not at the top: they import torch
            from ._report import finding_lines

            r, report = excinfo.value.result, excinfo.value.report
            about = (("layer", _settings(report)), ("checks", DETECTORS[r.detector].description))
            return "\n".join(finding_lines(r, about=about))
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        path, line = self.parent.source  # failures and warnings point at the layer's code
        return path, line, f"attention audit of {self.parent.spec}: {self.detector}"


class AuditStatusItem(pytest.Item):
    """The audit's overall outcome: fails when it is inconclusive (nothing failed, but the attention itself
    was not measured, or a detector crashed); a failed audit fails through its detectors' own items."""

    def runtest(self) -> None:
        report = self.parent.report()
        if report.status == "inconclusive":
            raise AuditInconclusive(report)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, AuditInconclusive):
            report = excinfo.value.report
            return "\n".join([f"INCONCLUSIVE {report.layer}", f"  {report.status_reason}",
                              f"  layer:    {_settings(report)}"])
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        path, line = self.parent.source
        return path, line, f"attention audit of {self.parent.spec}: status"


class AuditInconclusive(Exception):
    """Raised by `audit_status[...]` when the audit could not conclude; `repr_failure` shows why."""

    def __init__(self, report: AuditReport):
        super().__init__(report.status_reason)
        self.report = report


def _settings(report: AuditReport) -> str:
    return (f"{report.layer} ({'causal, ' if report.causal else ''}seq_len={report.seq_len}, {report.dtype} on "
            f"{report.device})")


__all__ = ["AttentionAuditWarning", "AuditItem", "AuditStatusItem", "AuditTarget", "MARKER", "attention_audit",
           "marker_options"]
