"""Probes several detectors read (the standard probe, the stacked calls of detectors/_stacked.py, decode_consistency's
calls, the float64 copy) leave each detector's result as it is alone: `audit(layer, detectors=[one])` reads the same
numbers as the full audit, whichever reader makes the shared call first."""

from __future__ import annotations

import math

import pytest
import torch

import diagnostics
from correct import MultiHeadAttention


def attention(q, k, v, mask=None):
    """Scaled dot-product attention on (B, H, T, d), returning (out, weights)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B,H,Tq,Tk) x (B,H,Tk,d) -> (B,H,Tq,d)


def _layer(causal: bool):
    torch.manual_seed(0)
    return MultiHeadAttention(16, 2, causal=causal).eval()


CASES = {
    "module, causal": (lambda: _layer(True), dict(causal=True, seq_len=12)),
    "module": (lambda: _layer(False), dict(seq_len=12)),
    "module, causal, 3 tokens": (lambda: _layer(True), dict(causal=True, seq_len=3)),
    "function, causal": (lambda: attention, dict(causal=True, seq_len=10)),
    "torch.nn.MultiheadAttention": (lambda: torch.nn.MultiheadAttention(16, 2, batch_first=True).eval(),
                                    dict(seq_len=8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_detector_alone_reads_what_it_reads_in_the_full_audit(case):
    make, options = CASES[case]
    layer = make()
    full = diagnostics.audit(layer, **options)
    assert full.passed, full
    for result in full.results:
        if result.detector == "runs":  # its evidence counts every call of the audit, by design
            continue
        alone = diagnostics.audit(layer, detectors=[result.detector], **options).result(result.detector)
        assert (alone.verdict, alone.message, alone.evidence, alone.value) == (
            result.verdict, result.message, result.evidence, result.value), f"{case}: {result.detector}"


def test_a_stacked_call_names_each_reader_and_its_copies():
    report = diagnostics.audit(_layer(True), causal=True, seq_len=12)
    [stack] = [p for p in report.result("mask_honoured").probes if p.parts]
    assert [reader for reader, _, _ in stack.parts] == ["weight_row_sums", "mask_honoured", "future_leakage"]
    assert stack.parts[0][1:] == (1, 1)  # weight_row_sums reads the baseline copy only
    assert stack.batch == 2 * (1 + sum(stop - first for _, first, stop in stack.parts))
    assert any(p is stack for p in report.result("future_leakage").probes)


class Tied(torch.nn.Module):
    """Two projections that share one weight (tied), and a buffer: what a copy must keep as it is."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.a.bias.requires_grad_(False)
        self.register_buffer("table", torch.arange(4.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_float64_copy_is_the_layer_in_float64_never_its_storage(dtype):
    """The copy the gradient checks change in place (finite differences move its parameters): its own storage at
    every dtype, a float64 layer's too (where converting would hand back the same tensor), ties kept, values,
    requires_grad and buffers as the layer has them."""
    from diagnostics.detectors._common import float64_copy

    layer = Tied().to(dtype)
    twin = float64_copy(layer)
    assert twin.b.weight is twin.a.weight  # tied weights stay one tensor
    for (name, p), (_, q) in zip(layer.named_parameters(), twin.named_parameters()):
        assert q.dtype == torch.float64 and q.data_ptr() != p.data_ptr() and q.requires_grad == p.requires_grad, name
        assert torch.equal(q, p.double()), name
    assert twin.table.dtype == torch.float64 and twin.table.data_ptr() != layer.table.data_ptr()
