"""Probes several detectors read (the standard probe, the stacked calls of detectors/_stacked.py, decode_consistency's
calls, the float64 copy) leave each detector's result as it is alone: `audit(layer, detectors=[one])` reads the same
numbers as the full audit, whichever reader makes the shared call first. A stacked call names its readers and the
copies each reads (decode_consistency's full pass holds future_leakage's cuts without a mask, also for a layer given
one stream, which gets no partial call)."""

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


class OneStream(torch.nn.Module):
    """nanoGPT's form, forward(x[, mask]): one input stream, so no query apart from its keys (no partial call of
    decode_consistency can be made). `masked`: it takes a mask, which the audit makes causal."""

    def __init__(self, inner: MultiHeadAttention, *, masked: bool = True):
        super().__init__()
        self.inner, self.masked = inner, masked
        if not masked:
            self.forward = lambda x: self.inner(x)[0]

    def forward(self, x, mask=None):
        return self.inner(x, mask=mask)[0]


CASES = {
    "module, causal": (lambda: _layer(True), dict(causal=True, seq_len=12)),
    "module": (lambda: _layer(False), dict(seq_len=12)),
    "module, causal, 3 tokens": (lambda: _layer(True), dict(causal=True, seq_len=3)),
    "function, causal": (lambda: attention, dict(causal=True, seq_len=10)),
    "one-stream module, causal": (lambda: OneStream(_layer(True)), dict(causal=True, seq_len=12)),
    "one-stream module without a mask, causal": (lambda: OneStream(_layer(True), masked=False),
                                                 dict(causal=True, seq_len=12)),
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


def test_decode_consistencys_full_pass_holds_future_leakages_cuts_without_a_mask():
    """One call: the full pass in copy 0 (decode_consistency reads it, and its partial calls after it take its keys),
    future_leakage's cuts at T // 2 and T - 2 in copy 1; future_leakage makes no unmasked call of its own."""
    report = diagnostics.audit(_layer(True), causal=True, seq_len=12)
    [stack] = [p for p in report.result("decode_consistency").probes if p.parts]
    assert [reader for reader, _, _ in stack.parts] == ["future_leakage", "decode_consistency"]
    assert stack.parts[0][1:] == (1, 2) and stack.parts[1][1] == stack.parts[1][2]  # the baseline copy only
    assert stack.label == "the full pass, 12 tokens; tokens after t in [6, 10] changed, no mask"
    assert stack.batch == 2 * 2 and (stack.t_q, stack.t_k) == (12, 12)
    leakage = report.result("future_leakage")
    assert any(p is stack for p in leakage.probes) and any(p is stack for p in report.result("output_shape").probes)
    assert all(p.parts or p.label.startswith("the standard probe (") for p in leakage.probes)  # no call of its own
    partial = [p for p in report.result("decode_consistency").probes if not p.parts and p.t_q < p.t_k]
    assert [p.t_q for p in partial] == [1, 3, 8] and all(p.batch == 2 for p in partial)


def test_a_one_stream_layer_gets_future_leakages_cuts_in_the_full_pass_and_no_partial_call():
    """decode_consistency does not apply to a layer given one stream (its query cannot differ from its keys): the
    stacked call is still made, for future_leakage, which catches a leak there and passes the causal twin."""
    for masked in (True, False):
        clean = diagnostics.audit(OneStream(_layer(True), masked=masked), causal=True, seq_len=12)
        assert clean.passed, clean
        assert clean.result("decode_consistency").message.startswith("not applicable: "), clean
        [stack] = [p for p in clean.result("future_leakage").probes if p.label.startswith("the full pass")]
        assert [reader for reader, _, _ in stack.parts] == ["future_leakage", "decode_consistency"]
        assert stack.batch == 2 * (2 if masked else 3)  # without a mask argument, the cut at 0 too (no padding)
        assert not any(p.t_q != p.t_k for r in clean.results for p in r.probes)  # no partial call was made
    leaky = diagnostics.audit(OneStream(_layer(False), masked=False), causal=True, seq_len=12,
                              detectors=["future_leakage"]).result("future_leakage")
    assert leaky.verdict == "fail" and "with no mask" in leaky.message, leaky
