"""The pytest plugin's model targets: `pytest --attention-audit-model=pkg.module:factory`.

One test per model-level detector (`model_audit::prefix_causality[mymodule:make_model]`), one per attention layer
found (`layer[h.1.attn][mymodule:make_model]`, failing with that layer's findings, and failing when that layer's
audit is inconclusive), and `model_audit_status[...]`, which fails when the whole audit is inconclusive. A skip
says why; `--attention-causal` and `--attention-seq-len` apply (causality is otherwise inferred). Loaded by
`pytest_plugin.py` only when the option is given.
"""

from __future__ import annotations

import pytest


class ModelAuditTarget(pytest.File):
    def __init__(self, *, spec: str, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec
        self._report = None

    def collect(self):
        from ._errors import AuditUsageError
        from ._model import MODEL_DETECTORS
        from ._model_cli import load_model

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
            from ._model import audit_model

            self._report = audit_model(self.model, causal=True if self.config.option.attention_causal else None,
                                       seq_len=seq_len)
        return self._report


class ModelAuditFailed(Exception):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


class _Item(pytest.Item):
    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ModelAuditFailed):
            return excinfo.value.text
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.parent.path, 0, f"model audit of {self.parent.spec}: {self.name}"


class ModelDetectorItem(_Item):
    def __init__(self, *, detector: str, **kwargs):
        super().__init__(**kwargs)
        self.detector = detector

    def runtest(self) -> None:
        report = self.parent.report()
        r = report.result(self.detector)
        layer = report.result_layers.get(self.detector)
        if r.verdict in ("fail", "error"):
            raise ModelAuditFailed("\n".join(
                [f"{r.verdict.upper()} {r.detector}{f' at {layer}' if layer else ''}: {r.message}",
                 f"  model:    {report.model} ({'causal' if report.causal else 'not causal'}, {report.causal_source})"]
                + ([f"  evidence: {r.evidence}"] if r.evidence else []) + ([f"  fix:      {r.fix}"] if r.fix else [])))
        if r.verdict == "skip":
            pytest.skip(f"{self.detector}: {r.message}")


class LayerItem(_Item):
    def __init__(self, *, path: str, **kwargs):
        super().__init__(**kwargs)
        self.layer_path = path

    def runtest(self) -> None:
        rep = self.parent.report().layers[self.layer_path]
        if rep.status != "passed":
            raise ModelAuditFailed(f"{rep.status.upper()} {self.layer_path} (audited in place)\n{rep}")


class ModelStatusItem(_Item):
    def runtest(self) -> None:
        report = self.parent.report()
        if report.status == "inconclusive":
            raise ModelAuditFailed(f"INCONCLUSIVE {report.model}\n  {report.status_reason}")


__all__ = ["ModelAuditTarget"]
