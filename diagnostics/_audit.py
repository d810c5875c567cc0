"""audit(): run every detector on a layer and leave the layer, the RNG and the inputs as they were."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ._detectors import DETECTORS, _weights_from
from ._errors import expect
from ._probe import Probe
from ._result import DetectorResult
from ._subject import make_subject
from ._thresholds import dtype_name


class AttentionAuditError(AssertionError):
    """Raised by `raise_for_findings()` / `assert_attention_ok()`: the layer failed a detector."""


@dataclass
class AuditReport:
    layer: str
    results: list[DetectorResult]
    causal: bool
    seq_len: int
    dtype: str
    device: str
    forward_passes: int
    seconds: float
    settings: dict = field(default_factory=dict)
    weights: torch.Tensor | None = field(default=None, repr=False)  # (B, [H,] Tq, Tk) of the standard probe
    weights_source: str = ""  # "returned weights" or "observed softmax output (dim=...)"

    @property
    def passed(self) -> bool:
        """False exactly when some detector fails (warnings do not fail an audit)."""
        return not any(r.verdict == "fail" for r in self.results)

    @property
    def findings(self) -> list[DetectorResult]:
        return [r for r in self.results if r.fired]

    def result(self, detector: str) -> DetectorResult:
        return next(r for r in self.results if r.detector == detector)

    def fired(self) -> dict[str, str]:
        """{detector id: verdict} for the detectors that warned or failed."""
        return {r.detector: r.verdict for r in self.findings}

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        head = (f"attention audit of {self.layer}: {verdict} "
                f"({'causal, ' if self.causal else ''}seq_len={self.seq_len}, {self.dtype} on {self.device}, "
                f"{self.forward_passes} forward passes, {self.seconds:.2f} s)")
        width = max(len(r.detector) for r in self.results)
        lines = [head, ""] + [f"  {r.detector:<{width}}  {r.verdict.upper():<4}  {r.message}" for r in self.results]
        for r in self.findings:
            lines += ["", f"{r.verdict.upper()} {r.detector}: {r.message}", f"  evidence: {r.evidence}",
                      f"  fix:      {r.fix}"]
        return "\n".join(lines)

    def raise_for_findings(self) -> None:
        """Raise `AttentionAuditError` with the report if any detector failed."""
        __tracebackhide__ = True
        if not self.passed:
            raise AttentionAuditError(str(self))

    def to_html(self, path) -> None:
        """Write a self-contained HTML page: findings, evidence, fixes, and heatmaps of the weights."""
        from ._html import write_report_html

        write_report_html(self, path)

    def to_dict(self) -> dict:
        return {
            "layer": self.layer, "passed": self.passed, "causal": self.causal, "seq_len": self.seq_len,
            "dtype": self.dtype, "device": self.device, "forward_passes": self.forward_passes,
            "seconds": round(self.seconds, 4),
            "results": [{"detector": r.detector, "verdict": r.verdict, "message": r.message, "value": r.value,
                         "threshold": r.threshold, "margin": r.margin, "evidence": r.evidence, "fix": r.fix}
                        for r in self.results],
        }


@contextlib.contextmanager
def _untouched(layer, device):
    """Eval mode during the audit; afterwards training flags, every parameter and buffer (persistent or
    not, even if the layer replaced it), every .grad and the global RNG state are as they were."""
    modules = list(layer.modules()) if isinstance(layer, nn.Module) else []
    modes = [m.training for m in modules]
    # (module, registry, name, the original tensor object, a copy of its values)
    slots = [(m, registry, name, t, t.detach().clone())
             for m in modules for registry in (m._parameters, m._buffers)
             for name, t in registry.items() if t is not None]
    grads = [(t, None if t.grad is None else t.grad.clone()) for _, registry, _, t, _ in slots
             if registry is not None and isinstance(t, nn.Parameter)]
    cuda = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        try:
            if modules:
                layer.eval()
            yield
        finally:
            for m, mode in zip(modules, modes):
                m.train(mode)
            with torch.no_grad():
                for m, registry, name, original, values in slots:
                    registry[name] = original  # a buffer the layer reassigned (a growing cache) goes back
                    if not torch.equal(original.detach(), values):
                        original.detach().copy_(values)
            for t, grad in grads:
                t.grad = grad


def audit(layer, *, causal: bool = False, d_model: int | None = None, num_heads: int | None = None,
          scale: float | None = None, seq_len: int | None = None, device=None, dtype=None, seed: int = 0,
          need_weights: bool = True, detectors: list[str] | None = None, progress=None) -> AuditReport:
    """Run the detectors on `layer` and return an `AuditReport`.

    `layer`: a function f(q, k, v, mask=None) on (B, H, T, d) tensors; a module m(query, key, value,
    mask=None) or m(x[, mask]) on (B, T, D); or torch.nn.MultiheadAttention. Outputs may be `out` or
    `(out, weights)`. Masks passed to functions and modules are bool (B, 1, Tq, Tk), True = may attend.
    `causal=True`: the layer promises causality; a layer that takes a mask (and has no truthy `causal` /
    `is_causal` attribute saying it builds its own) is given causal masks. `scale`: the softmax scale the
    layer declares, if not 1/sqrt(d_k). `seq_len`: probe length (default 16; audit at your context
    length). `progress`: optional callable(detector_id, index, total) for long audits.
    """
    expect(seq_len is None or (isinstance(seq_len, int) and seq_len >= 1), "seq_len >= 1", f"seq_len={seq_len!r}",
           "pass the context length you train with, e.g. seq_len=128")
    expect(scale is None or (isinstance(scale, (int, float)) and scale > 0), "a positive scale or None",
           f"scale={scale!r}", "pass the factor your layer multiplies q·k by, e.g. scale=1.0")
    chosen = list(DETECTORS) if detectors is None else detectors
    unknown = [d for d in chosen if d not in DETECTORS]
    expect(not unknown, f"detector ids from {sorted(DETECTORS)}", f"{unknown}", "check the spelling")
    subject = make_subject(layer, d_model=d_model, num_heads=num_heads, device=device, dtype=dtype,
                           need_weights=need_weights)
    probe = Probe(subject, causal=causal, scale=scale, seq_len=seq_len or 16, seed=seed)
    started = time.perf_counter()
    results: list[DetectorResult] = []
    with _untouched(layer, subject.device):
        for n, det_id in enumerate(chosen):
            if progress is not None:
                progress(det_id, n, len(chosen))
            try:
                results.append(DETECTORS[det_id].check(probe))
            except Exception as error:  # a detector that cannot cope must not crash the audit
                results.append(DetectorResult(det_id, "skip", f"not measured: the detector could not handle this "
                                              f"layer ({type(error).__name__}: {error})"))
        base = probe.base()
    weights, source = _weights_from(base, probe.t, probe.t) if base.ok else (None, "")
    return AuditReport(layer=subject.describe(), results=results, causal=causal, seq_len=probe.t,
                       dtype=dtype_name(subject.dtype), device=str(subject.device), forward_passes=probe.passes,
                       seconds=time.perf_counter() - started,
                       settings={"form": subject.form, "d_model": subject.d_model, "num_heads": subject.num_heads,
                                 "takes_mask": subject.takes_mask, "pass_causal_mask": probe.pass_causal_mask},
                       weights=None if weights is None else weights.cpu(), weights_source=source)


def assert_attention_ok(layer, **kwargs) -> AuditReport:
    """For users' own tests: audit the layer and raise `AttentionAuditError` (with the report) on failure."""
    __tracebackhide__ = True
    report = audit(layer, **kwargs)
    report.raise_for_findings()
    return report
