"""A layer that its model gives one token attends one key with weight 1, whatever its code: no detector can tell a
right layer from a wrong one there. The model audit said "the attention itself was not measured ... use a softmax or
torch's scaled_dot_product_attention" (timm's EfficientViT-M, built at 64 px: its last stage sees one pixel), a fix
for a problem the layer does not have, and torch's nn.MultiheadAttention on one token PASSED, a pass not earned. It now says the layer sees one token and asks for a larger input; on that
input the correct model passes and the one without its scale fails. (Only a layer found by its class is audited
at one token: torch's, timm's, Hugging Face's; a layer of one's own is found by the softmax over (Tq, Tk) it runs,
which at one token is no attention, and the report says none was found.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants._catalog import MissingScale
from correct import MultiHeadAttention

D, HEADS, PATCH = 16, 2, 8


class PatchModel(nn.Module):
    """Patches of 8 x 8 pixels, self-attention over them, mean-pooled to 4 logits: a 8 px image is one token."""

    def __init__(self, attention: str):
        super().__init__()
        self.embed = nn.Conv2d(3, D, PATCH, stride=PATCH)
        self.attn = {"torch": lambda: nn.MultiheadAttention(D, HEADS, batch_first=True),
                     "reference": lambda: MultiHeadAttention(D, HEADS),
                     "missing scale": lambda: MissingScale(D, HEADS)}[attention]()  # the bug: q·k not divided by √d_k
        self.head = nn.Linear(D, 4)

    def forward(self, pixel_values):
        x = self.embed(pixel_values).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h x w, D)
        return self.head((x + self.attn(x, x, x)[0]).mean(1))  # each returns (out, weights)


def _audit(side: int, attention: str):
    torch.manual_seed(0)
    model = PatchModel(attention).eval()
    images = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    return diagnostics.audit_model(model, images)


def test_a_layer_given_one_token_is_inconclusive_and_the_report_asks_for_a_larger_input():
    report = _audit(PATCH, "torch")
    assert report.status == "inconclusive", str(report)
    assert report.status_reason == ("inconclusive: attn sees one token on this example (one key: weight 1 whatever "
                                    "the scale, the mask or the softmax's axis): give the model a larger input (a "
                                    "larger image, a longer sequence)")  # before: PASSED, on one token
    assert any(n.startswith("attn sees one token on this example") for n in report.notes), report.notes


@pytest.mark.parametrize("attention", ["torch", "reference", "missing scale"])
def test_on_a_larger_image_the_correct_models_pass_and_the_unscaled_one_fails(attention):
    report = _audit(4 * PATCH, attention)  # 16 tokens
    assert report.status == ("failed" if attention == "missing scale" else "passed"), str(report)
    assert report.status == "passed" or "attn" in {f.layer for f in report.findings}, str(report)


class TwoStages(nn.Module):
    """A stage of attention over 8 x 8 px patches, then a 4 x 4 pooling of them, attended again: at 32 px, 16 tokens
    and then one (a pyramid's last stage on a small image)."""

    def __init__(self, first: str):
        super().__init__()
        self.first = PatchModel(first)
        self.pool = nn.Conv2d(D, D, 4, stride=4)
        self.last = nn.MultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, pixel_values):
        x = self.first.embed(pixel_values)  # (B, D, 4, 4)
        tokens = x.flatten(2).transpose(1, 2)
        x = (tokens + self.first.attn(tokens, tokens, tokens)[0]).transpose(1, 2).reshape(x.shape)
        x = self.pool(x).flatten(2).transpose(1, 2)  # (B, 1, D)
        return self.first.head((x + self.last(x, x, x)[0]).mean(1))


@pytest.mark.parametrize("first", ["reference", "missing scale"])
def test_a_layer_given_one_token_leaves_the_verdict_to_the_layers_that_see_more(first):
    torch.manual_seed(0)
    model = TwoStages(first).eval()
    report = diagnostics.audit_model(model, torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    assert report.status == ("passed" if first == "reference" else "failed"), str(report)
    assert report.status == "passed" or {f.layer for f in report.findings} == {"first.attn"}, str(report)
    assert any(n.startswith("last sees one token on this example") for n in report.notes), report.notes


def _trained_scale(model: nn.Module) -> nn.Module:
    """The scale people train at, as Hugging Face's `_init_weights` sets it: matrices drawn at std 0.02, biases 0, the
    whole model in bfloat16."""
    for p in model.parameters():
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)
    return model.to(torch.bfloat16)


@pytest.mark.parametrize(("side", "attention", "status"), [(PATCH, "torch", "inconclusive"),
                                                           (4 * PATCH, "reference", "passed"),
                                                           (4 * PATCH, "missing scale", "failed")])
def test_the_one_token_rule_holds_in_bfloat16_at_std_0_02(side, attention, status):
    torch.manual_seed(0)
    model = _trained_scale(PatchModel(attention).eval())
    images = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    report = diagnostics.audit_model(model, images)
    assert report.status == status, str(report)  # the same inputs and seeds for all three
    if status == "inconclusive":
        assert report.status_reason.startswith("inconclusive: attn sees one token on this example"), str(report)
    if status == "failed":
        assert {f.layer for f in report.findings} == {"attn"}, str(report)
