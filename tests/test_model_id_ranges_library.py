"""Ids in range on two transformers models as the sweep builds them (issue 33): on an H200's bfloat16 sweep, Dia and
LUKE crashed the process with a device-side assert, where the CPU raised IndexError and the audit caught it. Dia's
encoder ids (a vocabulary of 256) were drawn from its decoder's (1,028 audio codes); LUKE (512 positions) was run
at 1,024 tokens by gradient_flow's longer lengths. On the CPU: no embedding call of either audit gets an id outside
its table (the hand-written twins: tests/test_model_id_ranges.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

import diagnostics

pytest.importorskip("transformers")

SWEEP = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep.py"


def _sweep():
    if "sweep_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sweep_benchmark", SWEEP)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sweep_benchmark"] = module
        spec.loader.exec_module(module)
    return sys.modules["sweep_benchmark"]


@pytest.mark.slow  # builds and audits two transformers models
@pytest.mark.parametrize("model_type", ["dia", "luke"])
def test_no_id_the_audit_passes_is_out_of_its_table(monkeypatch, model_type):
    seen, embedding = [], F.embedding

    def checked(input, weight, *args, **kwargs):
        if input.numel() and (int(input.max()) >= weight.shape[0] or int(input.min()) < 0):
            seen.append((tuple(input.shape), int(input.max()), weight.shape[0]))
        return embedding(input, weight, *args, **kwargs)

    monkeypatch.setattr(F, "embedding", checked)
    report = diagnostics.audit_model(_sweep().build(model_type))
    assert not seen, (seen[:3], str(report))
    assert "IndexError" not in report.status_reason, report.status_reason
