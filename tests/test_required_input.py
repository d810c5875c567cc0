"""A layer that raises for want of an input the audit left at None is a calling convention, not a bug (`runs`'
`_required_input`): the audit "needs a declaration" naming the input and how to pass it, and with that declaration
it measures the layer. Twins: a layer that raises whatever it is given still fails `runs`, and a bug in a joint
attention is caught under the declaration the report names.

Written in the style of diffusers' joint attention (CogVideoX's processor: text and image tokens concatenated along
the sequence, attended together, the outputs split back) and of a cross-attention whose memory defaults to None but
is required, no diffusers needed.
"""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


class JointAttention(nn.Module):
    """Text tokens (`encoder_hidden_states`) and image tokens attended together; returns (image, text) outputs."""

    def __init__(self, dim=32, heads=4, scaled=True):
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        text = encoder_hidden_states.size(1)  # raises on None, as CogVideoX's processor does
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        B, T, D = x.shape  # batch, joint length, width
        q, k, v = (f(x).view(B, T, self.heads, D // self.heads).transpose(1, 2) for f in (self.to_q, self.to_k,
                                                                                          self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             scale=None if self.scaled else 1.0)  # (B, H, T, d)
        out = self.to_out(out.transpose(1, 2).reshape(B, T, D))
        return out[:, text:], out[:, :text]


class MemoryRequired(nn.Module):
    """A cross-attention whose memory defaults to None yet is required."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, hidden_states, context=None):
        if context is None:
            raise ValueError("MemoryRequired requires context (the text tokens)")
        return self.mha(hidden_states, context, context, need_weights=False)[0]


class RaisesAnyway(MemoryRequired):
    """Raises whatever it is given: a finding, whatever the calling convention."""

    def forward(self, hidden_states, context=None):
        return self.mha(hidden_states, context, context, need_weights=False)[0].view(-1, 7, 3)


def _declared(report) -> dict:
    """The report's declaration as keyword arguments for audit(), as a user would paste it."""
    call = ast.parse(f"f({report.declaration})", mode="eval").body
    return {k.arg: eval(compile(ast.Expression(k.value), "<declaration>", "eval"), {"torch": torch})
            if isinstance(k.value, ast.Lambda) else ast.literal_eval(k.value) for k in call.keywords}


def _layer(cls, **kw):
    torch.manual_seed(0)
    return cls(**kw).eval()


@pytest.mark.parametrize("cls, declaration", [
    (JointAttention, "call=lambda layer, x, mask: layer(x, encoder_hidden_states=x[:, :0], attention_mask=mask)"),
    (MemoryRequired, "cross=True")])
def test_a_layer_that_requires_an_input_left_at_none_needs_a_declaration_and_passes_with_it(cls, declaration):
    report = diagnostics.audit(_layer(cls), progress=False)
    assert report.status == "inconclusive", report
    runs = report.result("runs")
    assert runs.verdict == "skip" and report.declaration == declaration, runs
    name = "encoder_hidden_states" if cls is JointAttention else "context"
    assert f"without `{name}`, which it requires" in runs.message, runs.message
    assert report.headline == f"INCONCLUSIVE (needs a declaration: {declaration})"
    again = diagnostics.audit(_layer(cls), progress=False, **_declared(report))
    assert again.status == "passed", again


def test_a_layer_that_raises_with_the_input_given_too_still_fails_runs():
    report = diagnostics.audit(_layer(RaisesAnyway), progress=False)
    assert report.status == "failed" and report.result("runs").verdict == "fail", report
    assert not report.declaration


def test_a_joint_attention_without_its_scale_fails_under_the_declaration_its_correct_twin_passes_with():
    declared = _declared(diagnostics.audit(_layer(JointAttention), progress=False))
    buggy = diagnostics.audit(_layer(JointAttention, scaled=False), progress=False)
    assert buggy.declaration == diagnostics.audit(_layer(JointAttention), progress=False).declaration
    report = diagnostics.audit(_layer(JointAttention, scaled=False), progress=False, **declared)
    assert report.status == "failed" and report.result("softmax_saturation").verdict == "fail", report


class TextProjectedJoint(nn.Module):
    """Joint attention in PRX's and JoyImage's style: the image tokens get q, k and v, the text tokens k and v of
    their own projection (`txt_kv`), and the mask, when given, is over the text tokens only, (B, L_txt), True = keep.
    `unused`: a projection the code never reads (the bug the twin keeps)."""

    def __init__(self, dim=32, heads=4, unused=False):
        super().__init__()
        self.heads = heads
        self.img_qkv, self.txt_kv, self.to_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.extra = nn.Linear(dim, dim) if unused else None

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, L, D = hidden_states.shape  # batch, image tokens, width
        text = encoder_hidden_states.size(1)  # raises on None
        split = lambda t: t.view(B, -1, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731  (B, H, n, d)
        q, k, v = (split(t) for t in self.img_qkv(hidden_states).chunk(3, dim=-1))
        tk, tv = (split(t) for t in self.txt_kv(encoder_hidden_states).chunk(2, dim=-1))
        k, v = torch.cat([tk, k], dim=2), torch.cat([tv, v], dim=2)  # text keys first, then the image's
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[-1] != text:
                raise ValueError(f"Unsupported attention_mask shape: {tuple(attention_mask.shape)}")
            mask = torch.cat([attention_mask.bool(), attention_mask.new_ones(B, L).bool()], dim=1)[:, None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, d)
        return self.to_out(out.transpose(1, 2).reshape(B, L, D))


def test_a_joint_attention_with_a_text_only_mask_is_declared_without_the_mask_and_its_text_weights_not_measured():
    """PRX's: its mask is over the text tokens only, so under an empty text stream the audit's mask raises; the call
    the report names passes none, and with it the layer passes, its text projection a warning (given no token) and no
    failure. The twin, the same layer with a projection it never reads, still fails `parameters_used` for that one."""
    report = diagnostics.audit(_layer(TextProjectedJoint), progress=False)
    assert report.declaration == "call=lambda layer, x: layer(x, encoder_hidden_states=x[:, :0])", report.declaration
    said = report.result("runs").message
    assert "its `attention_mask` is over `encoder_hidden_states`'s tokens (given a mask over them it runs" in said, said
    assert "it raises ValueError: Unsupported attention_mask shape" in said and said.endswith("so none is passed"), said
    again = diagnostics.audit(_layer(TextProjectedJoint), progress=False, **_declared(report))
    assert again.status == "passed", again.status_reason
    used = again.result("parameters_used")
    assert used.verdict == "warn" and used.message.startswith("txt_kv.weight, txt_kv.bias not measured"), used
    twin = diagnostics.audit(_layer(TextProjectedJoint, unused=True), progress=False, **_declared(report))
    assert twin.status == "failed", twin.status_reason
    assert twin.result("parameters_used").message == "the output does not depend on extra.weight, extra.bias", twin


class EmptySliceBug(nn.Module):
    """A self-attention whose memory tokens are sliced at a wrong index, `x[:, T:]`, so its memory projection is handed
    no token and the memory never reaches the keys: the bug, which an empty slice of the layer's own making is."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.mha, self.memory = nn.MultiheadAttention(dim, heads, batch_first=True), nn.Linear(dim, dim)

    def forward(self, x):
        memory = self.memory(x[:, x.shape[1]:])  # meant x[:, :4]: (B, 0, D)
        keys = torch.cat([memory, x], dim=1)
        return self.mha(x, keys, keys, need_weights=False)[0]


def test_parameters_handed_an_empty_slice_of_the_layers_own_making_still_fail():
    report = diagnostics.audit(_layer(EmptySliceBug), progress=False, detectors=["parameters_used"])
    used = report.result("parameters_used")
    assert used.verdict == "fail" and "memory.weight" in used.message, used


class MaskRaisesJoint(TextProjectedJoint):
    """The same joint attention raising on any mask, over the text tokens too: no mask it takes is the text's only."""

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if attention_mask is not None:
            raise RuntimeError("the mask broadcast fails")
        return super().forward(hidden_states, encoder_hidden_states)


def test_a_joint_attention_that_raises_on_any_mask_keeps_the_mask_in_its_declaration_and_fails_runs_under_it():
    report = diagnostics.audit(_layer(MaskRaisesJoint), progress=False)
    declared = "call=lambda layer, x, mask: layer(x, encoder_hidden_states=x[:, :0], attention_mask=mask)"
    assert report.declaration == declared, report.declaration
    again = diagnostics.audit(_layer(MaskRaisesJoint), progress=False, **_declared(report))
    assert again.status == "failed" and again.result("runs").verdict == "fail", again.status_reason


class TwoStreamMixer(nn.Module):
    """A submodule given both streams, (text, image): its weight multiplies the text tokens only."""

    def __init__(self, dim=32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, text, image):
        return torch.cat([text * self.weight, image], dim=1)


class MixedJoint(TextProjectedJoint):
    """The joint attention with a mixer handed the (empty) text and the image tokens, whose output it then drops: the
    mixer's weight is unused, and its module was handed tokens, so no empty stream excuses it."""

    def __init__(self):
        super().__init__()
        self.mixer = TwoStreamMixer()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        self.mixer(encoder_hidden_states, hidden_states)  # computed and dropped: the bug
        return super().forward(hidden_states, encoder_hidden_states, attention_mask)


def test_a_module_handed_tokens_beside_the_empty_stream_is_not_excused():
    declared = {"call": lambda layer, x: layer(x, encoder_hidden_states=x[:, :0])}
    used = diagnostics.audit(_layer(MixedJoint), progress=False, detectors=["parameters_used"],
                             **declared).result("parameters_used")
    assert used.verdict == "fail" and used.message == "the output does not depend on mixer.weight", used
