"""Channel attention's weights measured (issue 34 "Code nobody here wrote", third-party layers).

Cross-covariance attention (XCA, El-Nouby et al. 2021; BS-RoFormer's mel-band `LinearAttention`, XCiT's, DaViT's
channel attention) attends between the channels of a head: softmax(q^T k) over (B, H, d, d), q and k summed over the
tokens. The layer audit was inconclusive on it ("the attention itself was not measured": no weights over the
tokens), the checks of token attention being not applicable; a layer that names its heads passed, its weights read as
over 8 keys "the layer makes of its own from the 16 tokens (pooled: a spatial reduction)", which they are not.
`weight_row_sums` now measures what such weights must be: each softmax normalises the axis its values are then summed over, read from the axes themselves. Only where every
softmax's q·k product sums over the tokens and its scores are square (channel attention's own form), and again so in
one more call at four times the length (a head as wide as the probe is long reads the same at one length: windows of 4
tokens over heads of 16 at T = 16, tests/test_tagged_layout.py and tests/test_layer_causes.py, stay token attention).
`keys_matter` asks what such a layer's rows must do: each reads its own token's value only (token 0's value moved
alone through the value projection moves no other row); heads merged without moving the tokens first scramble them,
and passed (it was inconclusive). Twins on the same inputs: the softmax over the other axis fails, the heads merged
wrongly fail; a token attention is judged as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics

D, HEADS = 32, 4


class CrossCovariance(nn.Module):
    """XCA on (B, T, D) tokens: per head, q and k (B, H, d, T) l2-normalised over the tokens, a learned temperature
    per head, softmax over the channels of k, then the values' channels mixed. `bug`: "other axis" (the softmax over
    the channels of q), "merged wrongly" (out (B, H, d, T) reshaped to (B, T, D) without its permute). `named`: False leaves the heads unnamed (BS-RoFormer's layer names none: one head assumed)."""

    def __init__(self, bug: str = "", named: bool = True):
        super().__init__()
        self.bug, self.d_model = bug, D
        if named:
            self.num_heads = HEADS
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.temperature = nn.Parameter(torch.ones(HEADS, 1, 1))
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, -1).permute(2, 0, 3, 4, 1)  # each (B, H, d, T)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * self.temperature  # (B, H, d, d): channels of q by channels of k
        weights = scores.softmax(dim=-2 if self.bug == "other axis" else -1)
        out = weights @ v  # (B, H, d, T)
        if self.bug == "merged wrongly":  # the heads merged without moving the tokens first: tokens scrambled
            return self.proj(out.reshape(B, T, D))
        return self.proj(out.permute(0, 3, 1, 2).reshape(B, T, D))


@pytest.mark.parametrize("named", [True, False], ids=["heads named", "heads unnamed"])
@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_channel_weights_are_measured_and_the_other_axis_fails(dtype, init, named, std_002):
    def audit_(bug=""):
        torch.manual_seed(0)
        layer = CrossCovariance(bug, named)
        return diagnostics.audit((std_002(layer) if init == "std 0.02" else layer).to(dtype))

    right = audit_()
    assert right.status == "passed", right
    rows = right.result("weight_row_sums")
    assert rows.verdict == "pass" and "channel attention" in rows.message, rows
    other = audit_("other axis").result("weight_row_sums")
    assert other.verdict == "fail" and "normalises axis -2" in other.evidence, other
    assert right.result("keys_matter").verdict == "pass", right.result("keys_matter")
    merged = audit_("merged wrongly").result("keys_matter")
    assert merged.verdict == "fail" and "reads other tokens' values" in merged.message, merged


def test_a_token_attention_is_judged_as_before():
    """The same projections attending between tokens (q k^T over the channels): weights over (T, T), read as ever."""
    class Tokens(CrossCovariance):
        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
            weights = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)
            return self.proj((weights @ v).transpose(1, 2).reshape(B, T, D))

    torch.manual_seed(0)
    rows = diagnostics.audit(Tokens()).result("weight_row_sums")
    assert rows.verdict == "pass" and "sum to 1" in rows.message and "channel" not in rows.message, rows


class AcrossTheBatch(nn.Module):
    """Scalar q, k and v per position, (B, T) each, multiplied as matrices: q @ k^T is (B, B), attention across the
    batch (timm 1.0.31's CSATv2 SpatialTransformerBlock writes its attention so, csatv2.py:413). Square scores of a
    product over the tokens, but no channels: never read as channel attention."""

    def __init__(self):
        super().__init__()
        self.d_model, self.num_heads = 1, 1
        self.qkv = nn.Linear(1, 3, bias=False)

    def forward(self, x):  # (B, T, 1)
        q, k, v = self.qkv(x).unbind(-1)  # (B, T) each
        return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).unsqueeze(-1)


def test_attention_across_the_batch_is_not_channel_attention():
    torch.manual_seed(0)
    report = diagnostics.audit(AcrossTheBatch())
    assert "channel" not in report.result("weight_row_sums").message, report.result("weight_row_sums")
    assert report.result("batch_independence").verdict == "fail", report.result("batch_independence")
