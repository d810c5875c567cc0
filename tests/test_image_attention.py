"""An attention over an image's pixels (issue 34's vit-pytorch ScalableSelfAttention and Twins' GlobalAttention, a
UNet's attention block): the layer takes (B, C, H, W) and projects with convolutions, so it has no width attribute and
no nn.Linear, and the audit answered a usage error asking for d_model, which cannot help (the layer takes no token
sequence). The error now says what the layer is and names `adapters.image(layer)`, which lays each probe's tokens out
as an image; a key convolution of stride k needs images of two kernels a side, and the error names that seq_len. A
probe whose image is smaller than a kernel is not taken, with the reason, never a `runs` failure. Twins on the same
inputs: through the adapter the correct layer passes and the one without 1/sqrt(d_k) fails."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from correct import gpt2_init_
from diagnostics import AuditUsageError, adapters, audit

C, H = 32, 4  # channels, heads


class PixelAttention(nn.Module):
    """Self-attention between the pixels of (B, C, H, W) images: 1 x 1 convolutions for q and the output, keys and
    values from a `reduction` x `reduction` convolution of that stride (spatial reduction); `scaled=False` is the
    bug, no 1/sqrt(d_k)."""

    def __init__(self, reduction: int = 1, scaled: bool = True):
        super().__init__()
        self.to_q = nn.Conv2d(C, C, 1, bias=False)
        self.to_kv = nn.Conv2d(C, 2 * C, reduction, stride=reduction, bias=False)
        self.to_out = nn.Conv2d(C, C, 1)
        self.scaled = scaled

    def forward(self, images):
        B, _, height, width = images.shape  # batch, channels, rows, columns
        q, (k, v) = self.to_q(images), self.to_kv(images).chunk(2, dim=1)
        q, k, v = (t.reshape(B, H, C // H, -1).transpose(-2, -1) for t in (q, k, v))  # (B, H, pixels, d)
        scores = q @ k.transpose(-2, -1)  # (B, H, pixels, keys)
        if self.scaled:
            scores = scores / math.sqrt(C // H)
        out = torch.softmax(scores, dim=-1) @ v  # (B, H, pixels, d)
        return self.to_out(out.transpose(-2, -1).reshape(B, C, height, width))


def layer(**kw):
    torch.manual_seed(0)
    return gpt2_init_(PixelAttention(**kw))


def test_a_layer_over_pixels_is_a_usage_error_that_names_the_image_adapter():
    named = r"nn\.Conv2d over 32 channels.*Fix: audit adapters\.image\(layer\):"
    with pytest.raises(AuditUsageError, match=named) as error:
        audit(layer(), progress=False)
    assert error.value.adapter == "image"  # the fix named for a program too (the sweep follows it)
    with pytest.raises(AuditUsageError, match=r"adapters\.image\(layer\), seq_len=196 or more \(images of two"):
        audit(layer(reduction=7), progress=False)


@pytest.mark.parametrize("reduction, seq_len", [(1, None), (2, None), (7, 196)])
def test_through_the_image_adapter_the_correct_layer_passes_and_a_missing_scale_fails(reduction, seq_len):
    kw = {"seq_len": seq_len} if seq_len else {}
    right = audit(adapters.image(layer(reduction=reduction)), progress=False, **kw)
    wrong = audit(adapters.image(layer(reduction=reduction, scaled=False)), progress=False, **kw)
    assert right.status == "passed", right.status_reason
    assert wrong.status == "failed" and wrong.result("softmax_saturation").verdict == "fail", wrong.status_reason


def test_a_probe_whose_image_is_smaller_than_a_kernel_is_not_taken_and_says_the_length_to_audit_at():
    report = audit(adapters.image(layer(reduction=7)), progress=False)  # 16 tokens: a 4 x 4 image
    assert report.status == "inconclusive", report.status_reason
    assert "4 x 4 image, smaller than 7 x 7, the least the layer's convolutions take: audit with seq_len=196" in \
        report.status_reason, report.status_reason
    assert report.result("runs").verdict != "fail", report.result("runs")


class RaisesOnOddWidths(PixelAttention):
    """A shape bug, not a size: raises on any image whose width is odd, however large."""

    def forward(self, images):
        if images.shape[-1] % 2:
            raise RuntimeError("shape '[2, 4, 8, -1]' is invalid for input of size 1000")
        return super().forward(images)


def test_a_layer_that_raises_on_images_large_enough_for_its_kernels_still_fails_runs():
    torch.manual_seed(0)
    report = audit(adapters.image(gpt2_init_(RaisesOnOddWidths())), progress=False)  # 1 x 1 kernels: any image
    assert report.result("runs").verdict == "fail", report.result("runs")
    assert {"image", "image_seq_len", "Image"} <= set(adapters.__all__)


def test_the_images_channels_and_side_follow_what_the_layers_modules_take():
    """ScalableViT's windowed attention registers a depthwise convolution of its values (over the inner width) before
    its projections, and asserts that its windows divide the map: the channels are those most of its convolutions
    take (the first one's were read, and every probe raised), the side a multiple of its window (6 x 6 pixels for a
    3 x 3 kernel raised on a window of 4)."""
    from diagnostics import adapters

    class Windowed(nn.Module):
        def __init__(self, dim=32, inner=128, window_size=4):
            super().__init__()
            self.window_size = window_size
            self.values_conv = nn.Conv2d(inner, inner, 3, padding=1, groups=inner)
            self.to_q, self.to_k, self.to_v = (nn.Conv2d(dim, inner, 1) for _ in range(3))

    assert adapters.image_channels(Windowed()) == 32
    assert adapters.image_seq_len(Windowed()) == 12 * 12  # two kernels a side, 6, rounded up to a multiple of 4
    assert adapters.image_seq_len(Windowed(window_size=3)) == 6 * 6  # 3 divides 6 already
