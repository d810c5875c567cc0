"""A layer behind a zero-initialised gate or output projection (DiT's adaLN-Zero, Flamingo's tanh gate at 0,
ControlNet's zero convolutions) outputs zeros at initialisation, by design: every output-level check (masks, locality,
batch independence, keys) said "not measured", the observed weights passed, and the audit read PASSED, a pass
nothing earned. The audit now measures a copy with those all-zero trainable parameters drawn, and says so; the user's
layer is left as it was. The twins, on the same zeroed projection: a broken mask behind it fails (it passed before),
and a frozen zero projection (requires_grad=False: it stays zero, the layer is nothing) is not drawn.
"""

from __future__ import annotations

import torch

import diagnostics
from buggy_variants._catalog import MaskPolarityInverted
from correct import MultiHeadAttention


def _zeroed(cls, *, trainable=True):
    torch.manual_seed(0)
    layer = cls(32, 4)
    with torch.no_grad():
        layer.out.weight.zero_()
        layer.out.bias.zero_()
    layer.out.requires_grad_(trainable)
    return layer


def test_a_zero_output_projection_is_drawn_in_a_copy_and_the_attention_behind_it_measured():
    layer = _zeroed(MultiHeadAttention)
    report = diagnostics.audit(layer)
    assert report.status == "passed" and report.settings["drawn"] == ("out.weight", "out.bias"), str(report)
    assert report.result("mask_honoured").verdict == "pass" and report.result("batch_independence").verdict == "pass"
    assert "drawn from N(0, 1/fan_in) in a copy" in report.layer
    assert not layer.out.weight.any() and not layer.out.bias.any()  # the user's layer as it was


def test_a_broken_mask_behind_a_zero_output_projection_fails():
    report = diagnostics.audit(_zeroed(MaskPolarityInverted))
    assert report.status == "failed" and report.result("mask_honoured").verdict == "fail", str(report)


def test_a_frozen_zero_projection_is_not_drawn():
    report = diagnostics.audit(_zeroed(MultiHeadAttention, trainable=False))
    assert "drawn" not in report.settings
    assert report.result("mask_honoured").verdict == "skip" and "zero" in report.result("mask_honoured").message


class Uncopyable(MultiHeadAttention):
    def __deepcopy__(self, memo):
        raise TypeError("holds a handle that cannot be copied")


def test_a_zero_gated_layer_that_cannot_be_copied_is_inconclusive_saying_how_to_audit_it():
    report = diagnostics.audit(_zeroed(Uncopyable))
    assert report.status == "inconclusive" and "could not be copied to draw them" in report.status_reason, str(report)
    assert "torch.nn.init.normal_" in report.status_reason
