"""The audit's probes packed into fewer calls (issue 21) keep what each one measures.

- future_leakage cuts a layer that takes a mask at 0 under the padding mask only; its unmasked copies measure the
  other cuts in one copy of the batch. A leak into row 0 alone is still caught (there), and a layer that takes no mask
  is still cut at 0 without one.
- causal_alignment's cached-decoding probe pushes key T-1 by +-100 only: a layer whose newest query does not see
  the newest key is caught, the reference passes, on the same sizes.
- logit_gain is read once per audit from the standard probe and kept (Probe.memo): a replay after the record is
  released gets the audit's gain.
- the audit runs with denormal floats flushed to zero (slow on x86, read by no threshold) and restores the setting.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import diagnostics
from correct import MultiHeadAttention, _sdpa
from diagnostics._guard import flushing_denormals
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._common import logit_gain

T = 16


class RowZeroSeesNext(MultiHeadAttention):
    """Causal except that query 0 also sees key 1 (a mask wrong in its first row only)."""

    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        t_q, t_k = scores.shape[-2:]
        allowed = _sdpa.causal_mask(t_q, t_k, align="bottom_right", device=scores.device).clone()  # (Tq, Tk)
        allowed[0, 1] = True
        return _sdpa.apply_mask(_sdpa.apply_mask(scores, allowed, fill=fill), mask, fill=fill)  # (B, H, Tq, Tk)


class NoMaskArgument(torch.nn.Module):
    """A causal layer that takes no mask: (x) -> out, so future_leakage has no padding scenario."""

    def __init__(self, inner: MultiHeadAttention):
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)[0]


def _leakage(layer, **kw) -> diagnostics.DetectorResult:
    return diagnostics.audit(layer, causal=True, seq_len=T, detectors=["future_leakage"], **kw).results[0]


def test_a_leak_into_row_zero_alone_is_caught_under_the_padding_mask():
    torch.manual_seed(0)
    result = _leakage(RowZeroSeesNext(32, 4, causal=True))
    assert result.verdict == "fail", result
    assert "with a padding mask" in result.message and "with no mask" not in result.message, result.message


def test_the_reference_passes_the_same_probes():
    torch.manual_seed(0)
    result = _leakage(MultiHeadAttention(32, 4, causal=True))
    assert result.verdict == "pass", result


def _unmasked_batch(result) -> int:
    """The batch of future_leakage's call without an extra mask (baseline and perturbed copies stacked)."""
    [shape] = [s for s in result.probes if "no mask" in s.label]
    return shape.batch


def test_a_layer_that_takes_a_mask_gets_one_unmasked_copy_and_one_without_a_mask_argument_two():
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, causal=True)
    takes = _leakage(layer)
    no_arg = _leakage(NoMaskArgument(layer))
    assert takes.verdict == no_arg.verdict == "pass", (takes, no_arg)
    B = Probe.BATCH
    assert _unmasked_batch(takes) == B * 2  # baseline + cuts T//2 and T-2 in one copy; cut 0 under the padding mask
    assert _unmasked_batch(no_arg) == B * 3  # no padding scenario: cut 0 stays among the unmasked cuts
    assert any("padding" in s.label for s in takes.probes)
    assert not any("padding" in s.label for s in no_arg.probes)


def test_without_a_mask_argument_a_leak_into_row_zero_is_still_caught_unmasked():
    """The twin of the packing: where there is no padding scenario, the unmasked copies keep the cut at 0."""
    torch.manual_seed(0)
    caught = _leakage(NoMaskArgument(RowZeroSeesNext(32, 4, causal=True)))
    clean = _leakage(NoMaskArgument(MultiHeadAttention(32, 4, causal=True)))
    assert caught.verdict == "fail" and "t>=1" in caught.evidence, caught
    assert clean.verdict == "pass", clean


class DiagonalBlocked(MultiHeadAttention):
    """Causal with the diagonal blocked as well: the newest query cannot see the newest key."""

    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        t_q, t_k = scores.shape[-2:]
        allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).tril(t_k - t_q - 1)  # (Tq, Tk)
        allowed[0, 0] = True  # the first query keeps one key, so that no row is empty
        return _sdpa.apply_mask(_sdpa.apply_mask(scores, allowed, fill=fill), mask, fill=fill)  # (B, H, Tq, Tk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_alignment_with_two_gains_catches_a_blocked_diagonal_and_passes_the_reference(dtype):
    torch.manual_seed(0)
    broken = diagnostics.audit(DiagonalBlocked(32, 4, causal=True).to(dtype), causal=True, seq_len=T,
                               detectors=["causal_alignment"]).results[0]
    torch.manual_seed(0)
    clean = diagnostics.audit(MultiHeadAttention(32, 4, causal=True).to(dtype), causal=True, seq_len=T,
                              detectors=["causal_alignment"]).results[0]
    assert broken.verdict == "fail", broken
    assert clean.verdict == "pass" and clean.value > 100 * clean.threshold, clean
    [shape] = [s for s in clean.probes if "newest queries" in s.label]
    assert shape.batch == Probe.BATCH * 3  # baseline, x100, x-100


def test_logit_gain_is_read_once_and_kept_past_the_release_of_the_standard_probe():
    torch.manual_seed(0)
    subject = make_subject(MultiHeadAttention(32, 4, causal=True))
    probe = Probe(subject, causal=True, scale=None, seq_len=T, seed=0)
    first = logit_gain(probe)
    assert probe.memo["logit_gain"] == first
    probe.release()  # the standard probe's record (its softmax inputs) is dropped
    assert logit_gain(probe) == first
    # the negative control: read afresh without the record, the gain comes from the weights' log instead of the
    # softmax input, and differs in its last float32 digits: the memo is what gives a replay the audit's own gain
    probe.memo.clear()
    assert probe.base().record is None
    again = logit_gain(probe)
    assert again == pytest.approx(first, rel=1e-5) and again != first, (again, first)


class SeesFlushing(MultiHeadAttention):
    """The reference, noting on each call whether its thread flushes denormal floats to zero."""

    seen: list

    def forward(self, query, key=None, value=None, mask=None):
        self.seen.append(flushing_denormals())
        return super().forward(query, key, value, mask)


@pytest.mark.parametrize("before", [False, True])
def test_the_audit_flushes_denormals_while_it_runs_and_restores_the_threads_setting(before):
    if not torch.set_flush_denormal(before):
        pytest.skip("this CPU cannot flush denormals")
    try:
        layer = SeesFlushing(16, 2, causal=True)
        layer.seen = []
        assert flushing_denormals() == before
        layer(torch.randn(1, 3, 16))  # the negative control: outside an audit the layer sees the thread's setting
        assert layer.seen == [before]
        report = diagnostics.audit(layer, causal=True, seq_len=8)
        assert report.passed, report
        assert len(layer.seen) > 10 and all(layer.seen[1:]), layer.seen
        assert flushing_denormals() == before  # the user's setting, as it was
    finally:
        torch.set_flush_denormal(False)
