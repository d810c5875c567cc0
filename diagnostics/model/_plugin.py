"""The pytest plugin's model targets: `pytest --attention-audit-model=pkg.module:factory`.

One test per model-level detector (`model_audit::prefix_causality[mymodule:make_model]`), one per attention layer
found (`layer[h.1.attn][mymodule:make_model]`, failing with that layer's findings, and failing when that layer's
audit is inconclusive), and `model_audit_status[...]`, which fails when the whole audit is inconclusive. A skip
says why; `--attention-causal` and `--attention-seq-len` apply (causality is otherwise inferred). Imported by
`diagnostics.pytest_plugin` only when the option is given (it imports torch).
"""

from __future__ import annotations

import pytest

from .._errors import AuditUsageError
from .._load import load_model
from .._report import finding_lines
from . import MODEL_DETECTORS, audit_model

# audit_model() parameters as the plugin's options spell them, for messages that name an option
OPTIONS = {"causal": "--attention-causal", "seq_len": "--attention-seq-len"}


class ModelAuditTarget(pytest.File):
    def __init__(self, *, spec: str, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec
        self._report = None

    def collect(self):
        seq_len = self.config.option.attention_seq_len
        try:
            self.model = load_model(self.spec)
            report = self.report(seq_len)
        except AuditUsageError as error:
            raise self.CollectError(f"--attention-audit-model={self.spec}: {error}") from error
        ran = {r.detector for r in report.results}
        for detector in MODEL_DETECTORS:
            if detector in ran:
                yield ModelDetectorItem.from_parent(self, name=f"{detector}[{self.spec}]", detector=detector)
        for path in report.layers:
            yield LayerItem.from_parent(self, name=f"layer[{path}][{self.spec}]", path=path)
        yield ModelStatusItem.from_parent(self, name=f"model_audit_status[{self.spec}]")

    def report(self, seq_len=None):
        if self._report is None:
            self._report = audit_model(self.model, causal=True if self.config.option.attention_causal else None,
                                       seq_len=seq_len, _options=OPTIONS)
        return self._report


class ModelAuditFailed(Exception):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


class ModelItem(pytest.Item):
    """An item of a model target: its failure shows the finding's block, not a traceback."""

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ModelAuditFailed):
            return excinfo.value.text
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.parent.path, 0, f"model audit of {self.parent.spec}: {self.name}"


class ModelDetectorItem(ModelItem):
    def __init__(self, *, detector: str, **kwargs):
        super().__init__(**kwargs)
        self.detector = detector

    def runtest(self) -> None:
        report = self.parent.report()
        r = report.result(self.detector)
        if r.verdict in ("fail", "error"):
            about = (("model", f"{report.model} ({'causal' if report.causal else 'not causal'}, "
                               f"{report.causal_source})"),)
            raise ModelAuditFailed("\n".join(finding_lines(r, about=about)))
        if r.verdict == "skip":
            pytest.skip(f"{self.detector}: {r.message}")


class LayerItem(ModelItem):
    def __init__(self, *, path: str, **kwargs):
        super().__init__(**kwargs)
        self.layer_path = path

    def runtest(self) -> None:
        rep = self.parent.report().layers[self.layer_path]
        if rep.status != "passed":
            raise ModelAuditFailed(f"{rep.status.upper()} {self.layer_path} (audited in place)\n{rep}")


class ModelStatusItem(ModelItem):
    def runtest(self) -> None:
        report = self.parent.report()
        if report.status == "inconclusive":
            raise ModelAuditFailed(f"INCONCLUSIVE {report.model}\n  {report.status_reason}")


__all__ = ["ModelAuditTarget"]
