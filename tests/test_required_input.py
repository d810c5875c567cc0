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
    return _from_text(report.declaration)


def _from_text(declaration: str) -> dict:
    """A declaration's text ("cross=True, call=lambda ...") as keyword arguments, as a user would paste it."""
    call = ast.parse(f"f({declaration})", mode="eval").body
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


class ImagePromptAttention(nn.Module):
    """A cross-attention in the style of diffusers' IP-Adapter processors: its memory is `(text tokens, [image
    tokens, ...])`, or one tensor whose last `image_tokens` are split off as image tokens (the older form). The
    queries attend the text tokens, under the mask (bool (B, 1, Tq, T_text), True = may attend), and each image
    prompt's tokens apart, through projections of their own, unmasked; the attentions are summed. The bugs:
    `scaled=False`, q·k of the text attention not scaled; `image_scaled=False`, the image prompts' q·k not scaled;
    `masked=False`, the text attention's mask ignored."""

    def __init__(self, dim=32, heads=4, image_tokens=4, scaled=True, image_scaled=True, masked=True):
        super().__init__()
        self.heads, self.image_tokens, self.scaled, self.image_scaled = heads, image_tokens, scaled, image_scaled
        self.masked = masked
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.to_k_ip, self.to_v_ip = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def split_memory(self, encoder_hidden_states):
        if isinstance(encoder_hidden_states, tuple):
            return encoder_hidden_states
        end = encoder_hidden_states.shape[1] - self.image_tokens  # raises on None
        return encoder_hidden_states[:, :end], [encoder_hidden_states[:, end:]]

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        text, images = self.split_memory(encoder_hidden_states)
        B, T, D = hidden_states.shape  # batch, queries, width
        split = lambda t: t.view(B, -1, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731  (B, H, n, d)
        q = split(self.to_q(hidden_states))
        out = F.scaled_dot_product_attention(q, split(self.to_k(text)), split(self.to_v(text)),
                                             attn_mask=attention_mask if self.masked else None,
                                             scale=None if self.scaled else 1.0)  # (B, H, T, d)
        for image in images:
            out = out + F.scaled_dot_product_attention(q, split(self.to_k_ip(image)), split(self.to_v_ip(image)),
                                                       scale=None if self.image_scaled else 1.0)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


class SplitOnlyMemory(ImagePromptAttention):
    """The older form alone: one tensor, its last `image_tokens` split off; a tuple is refused."""

    def split_memory(self, encoder_hidden_states):
        if isinstance(encoder_hidden_states, tuple):
            raise TypeError("encoder_hidden_states must be a tensor")
        return super().split_memory(encoder_hidden_states)


IMAGE_PROMPT_CALL = ("cross=True, call=lambda layer, x, memory, mask: layer(x, encoder_hidden_states=(memory, "
                     "[memory[:, :0]]), attention_mask=mask)")
IMAGE_BRANCH_CALL = ("cross=True, call=lambda layer, x, memory: layer(x, encoder_hidden_states=(memory[:, :0], "
                     "[memory]))")


def test_a_memory_taken_inside_a_tuple_names_the_call_that_gives_it_so():
    """Given a memory tensor it runs; given a mask over that memory's tokens it raises in every convention (the mask
    covers the text tokens left after the split); given the memory alone in a tuple it raises Python's unpacking
    error, which says it takes two parts. The call named gives the memory first and an image prompt of no tokens,
    and says that the image prompts are then not measured, naming the call that measures them."""
    report = diagnostics.audit(_layer(ImagePromptAttention), progress=False)
    assert report.status == "inconclusive" and report.declaration == IMAGE_PROMPT_CALL, report.status_reason
    runs = report.result("runs")
    assert "(ValueError: not enough values to unpack (expected 2, got 1)): it takes `encoder_hidden_states` as a " \
           "tuple of 2; given the memory first and [memory[:, :0]] beside it, it runs, reads the memory and honours " \
           "`attention_mask` over its tokens as allowed" in runs.message, runs.message
    assert "so what the layer does with it is not measured; to audit what it does with it, audit again with " \
           f"{IMAGE_BRANCH_CALL} " in runs.fix, runs.fix


def test_a_memory_whose_mask_fits_no_convention_and_no_tuple_names_no_declaration():
    """The twin of the rule above: a layer that splits its one memory tensor and refuses a tuple names no declaration
    under which it would raise: the audit is inconclusive and says why."""
    report = diagnostics.audit(_layer(SplitOnlyMemory), progress=False)
    assert report.status == "inconclusive" and not report.declaration, report
    said = report.result("runs").message
    assert said.startswith("not measured: the layer raised on every probe, each given without "
                           "`encoder_hidden_states`"), said
    assert "given `attention_mask` over `encoder_hidden_states`'s 5 tokens too" in said, said
    assert said.endswith("no declaration of the audit's gives it a mask that fits"), said
    assert "call=lambda layer, x, memory, mask: layer(x, encoder_hidden_states=<memory in the layer's form>" in \
        report.result("runs").fix


@pytest.mark.parametrize("bug, failing", [("scaled", "softmax_saturation"), ("masked", "mask_honoured")])
def test_the_named_tuple_call_passes_the_layer_and_fails_its_text_attentions_bugs(bug, failing):
    """The call the report names, pasted as a user would: the correct layer passes, its image projections a warning
    (given no token); each twin with a bug in the text attention fails on the same call."""
    report = diagnostics.audit(_layer(ImagePromptAttention), progress=False, **_from_text(IMAGE_PROMPT_CALL))
    assert report.status == "passed", report
    used = report.result("parameters_used")
    assert used.verdict == "warn" and used.message.startswith("to_k_ip.weight, to_v_ip.weight not measured"), used
    twin = diagnostics.audit(_layer(ImagePromptAttention, **{bug: False}), progress=False,
                             **_from_text(IMAGE_PROMPT_CALL))
    assert twin.status == "failed" and twin.result(failing).verdict == "fail", twin


def test_a_bug_in_the_image_prompts_passes_the_first_call_with_its_warning_and_fails_the_second():
    """What the first call leaves unmeasured, said and measurable: the image prompts' attention unscaled passes the
    named call, `to_k_ip`/`to_v_ip` not measured (a warning), and fails under the second call the fix names, which
    the correct layer passes."""
    bug = dict(image_scaled=False)
    first = diagnostics.audit(_layer(ImagePromptAttention, **bug), progress=False, **_from_text(IMAGE_PROMPT_CALL))
    assert first.status == "passed" and first.result("parameters_used").verdict == "warn", first
    assert diagnostics.audit(_layer(ImagePromptAttention), progress=False,
                             **_from_text(IMAGE_BRANCH_CALL)).status == "passed"
    second = diagnostics.audit(_layer(ImagePromptAttention, **bug), progress=False, **_from_text(IMAGE_BRANCH_CALL))
    assert second.status == "failed" and second.result("softmax_saturation").verdict == "fail", second


class MaskedMemory(nn.Module):
    """A cross-attention whose memory defaults to None yet is required, and whose mask covers that memory."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, queries, width
        split = lambda t: t.view(B, -1, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731  (B, H, n, d)
        q, k, v = (split(f(x)) for f, x in ((self.to_q, hidden_states), (self.to_k, encoder_hidden_states),
                                             (self.to_v, encoder_hidden_states)))  # raises on None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # (B, H, T, d)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


def test_a_cross_attention_whose_mask_covers_its_memory_is_still_declared_cross():
    """The twin of the rule above: a memory that its mask covers (in a convention of the audit's) names `cross=True`,
    and the layer passes with it."""
    report = diagnostics.audit(_layer(MaskedMemory), progress=False)
    assert report.declaration == "cross=True", report
    assert diagnostics.audit(_layer(MaskedMemory), progress=False, cross=True).status == "passed"


class TupleOnlyMemory(ImagePromptAttention):
    """The tuple form alone, `text, images = encoder_hidden_states`, as diffusers' IP-Adapter processors will be once
    their deprecated tensor form is gone: given one tensor it raises (it was `failed: runs`)."""

    def split_memory(self, encoder_hidden_states):
        text, images = encoder_hidden_states
        return text, images


class SkipsEmptyPrompt(ImagePromptAttention):
    """An image prompt of no token skipped (`if image.shape[1]:`), so under the named call `to_k_ip`/`to_v_ip` are
    never called; `keys_from_text=True`, the bug: the image prompts' keys made by the text's `to_k`, `to_k_ip` unused."""

    def __init__(self, keys_from_text=False, **kw):
        super().__init__(**kw)
        self.keys_from_text = keys_from_text

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        text, images = self.split_memory(encoder_hidden_states)
        B, T, D = hidden_states.shape  # batch, queries, width
        split = lambda t: t.view(B, -1, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731  (B, H, n, d)
        q = split(self.to_q(hidden_states))
        out = F.scaled_dot_product_attention(q, split(self.to_k(text)), split(self.to_v(text)), attn_mask=attention_mask)
        for image in images:
            if image.shape[1]:
                keys = (self.to_k if self.keys_from_text else self.to_k_ip)(image)
                out = out + F.scaled_dot_product_attention(q, split(keys), split(self.to_v_ip(image)))
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


class PaddedImagePrompt(ImagePromptAttention):
    """Its mask stated by its name, `key_padding_mask`, (B, T_text), True = padding; `inverted=True`, the bug: True
    read as may attend."""

    def __init__(self, inverted=False, **kw):
        super().__init__(**kw)
        self.inverted = inverted

    def forward(self, hidden_states, encoder_hidden_states=None, key_padding_mask=None):
        keep = None if key_padding_mask is None else (key_padding_mask if self.inverted else ~key_padding_mask)
        return super().forward(hidden_states, encoder_hidden_states, None if keep is None else keep[:, None, None, :])


def test_a_memory_taken_only_as_a_tuple_names_the_same_call_and_its_twin_fails_under_it():
    report = diagnostics.audit(_layer(TupleOnlyMemory), progress=False)
    assert report.status == "inconclusive" and report.declaration == IMAGE_PROMPT_CALL, report.status_reason
    assert "given it as one tensor it raises (" in report.result("runs").message
    assert diagnostics.audit(_layer(TupleOnlyMemory), progress=False, **_declared(report)).status == "passed"
    twin = diagnostics.audit(_layer(TupleOnlyMemory, scaled=False), progress=False, **_declared(report))
    assert twin.status == "failed" and twin.result("softmax_saturation").verdict == "fail", twin


def test_projections_a_layer_calls_only_on_a_prompts_tokens_are_not_measured_and_one_never_called_still_fails():
    """A layer that skips an image prompt of no token never calls its image projections under the named call: given
    tokens there, it calls them, so they are not measured (a warning), not unused; the twin whose `to_k_ip` is never
    called, tokens or not, still fails `parameters_used`."""
    report = diagnostics.audit(_layer(SkipsEmptyPrompt), progress=False)
    assert report.declaration == IMAGE_PROMPT_CALL, report.status_reason
    again = diagnostics.audit(_layer(SkipsEmptyPrompt), progress=False, **_declared(report))
    used = again.result("parameters_used")
    assert again.status == "passed" and used.verdict == "warn", again
    assert used.message.startswith("to_k_ip.weight, to_v_ip.weight not measured"), used.message
    twin = diagnostics.audit(_layer(SkipsEmptyPrompt, keys_from_text=True), progress=False, **_declared(report))
    used = twin.result("parameters_used")
    assert twin.status == "failed" and used.verdict == "fail" and "to_k_ip.weight" in used.message, twin


@pytest.mark.parametrize("inverted", [False, True], ids=["correct", "inverted"])
def test_a_tuple_memorys_stated_convention_is_in_the_declaration_its_call_needs(inverted):
    """Under a call the audit gives its default convention unless one is declared: the convention the layer's
    parameter name states, and that it honours, is named with the call (it took a second round); its inverted twin
    honours none, is given the same declaration, and fails under it."""
    report = diagnostics.audit(_layer(PaddedImagePrompt), progress=False)
    named = IMAGE_PROMPT_CALL.replace("cross=True, ", "cross=True, mask='key_padding', ").replace(
        "attention_mask=mask", "key_padding_mask=mask")
    assert report.declaration == named, report.status_reason
    again = diagnostics.audit(_layer(PaddedImagePrompt, inverted=inverted), progress=False, **_declared(report))
    assert again.status == ("failed" if inverted else "passed"), again
    assert not inverted or again.result("mask_honoured").verdict == "fail", again


@pytest.mark.parametrize("name, mask", [("Attention+IPAdapterAttnProcessor2_0", ""),
                                        ("Attention+IPAdapterAttnProcessor", "mask='additive:B,Tq,Tk', ")])
def test_diffusers_ip_adapter_processors_name_their_tuple_call_and_pass_with_it(name, mask):
    """diffusers' own: zero-config inconclusive, naming the call in their form (`(text, [image tokens])`, an image
    prompt of none), the older processor with its mask convention in the same declaration; under it they pass, and
    under the second call the fix names (the image prompts given the memory) they pass too."""
    pytest.importorskip("diffusers", reason="diffusers is not installed (the zoo extra)")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sweep_diffusers as sd

    report = diagnostics.audit(sd.diffusers_build(name), progress=False)
    named = IMAGE_PROMPT_CALL.replace("cross=True, ", f"cross=True, {mask}")
    assert report.status == "inconclusive" and report.declaration == named, report.status_reason
    again = diagnostics.audit(sd.diffusers_build(name), progress=False, **_from_text(named))
    assert again.status == "passed", again.status_reason
    assert IMAGE_BRANCH_CALL in report.result("runs").fix
    image = diagnostics.audit(sd.diffusers_build(name), progress=False, **_from_text(IMAGE_BRANCH_CALL))
    assert image.status == "passed", image.status_reason


class KeyPaddedMemory(MaskedMemory):
    """A memory that its mask covers in another convention: (B, Tm), True = keep, as many text encoders pad."""

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B = hidden_states.shape[0]
        keep = None if attention_mask is None else attention_mask.bool().view(B, 1, 1, -1)  # raises on (B, 1, Tq, Tk)
        return super().forward(hidden_states, encoder_hidden_states, keep)


def test_a_memory_whose_mask_fits_in_another_convention_is_declared_cross_with_that_convention_at_once():
    """The rule tries every convention of the audit's before it names no declaration: a (B, Tm) mask, which the
    audit's own (B, 1, Tq, Tk) does not fit, names `cross=True` with the convention it honours, in one declaration
    (two rounds before), and passes with it."""
    report = diagnostics.audit(_layer(KeyPaddedMemory), progress=False)
    assert report.declaration == "cross=True, mask='key_keep'", report
    assert "honours `attention_mask` over its tokens as key_keep" in report.result("runs").message
    assert diagnostics.audit(_layer(KeyPaddedMemory), progress=False, **_declared(report)).status == "passed"


class ThreePartMemory(ImagePromptAttention):
    """A memory of three parts, `(text, [image tokens], [audio tokens])`, the last two attended as the image prompts."""

    def split_memory(self, encoder_hidden_states):
        text, images, sounds = encoder_hidden_states
        return text, [*images, *sounds]


def test_a_memory_of_three_parts_names_each_other_part_given_nothing():
    report = diagnostics.audit(_layer(ThreePartMemory), progress=False)
    assert report.declaration == IMAGE_PROMPT_CALL.replace("[memory[:, :0]])", "[memory[:, :0]], [memory[:, :0]])"), \
        report.status_reason
    fix = report.result("runs").fix
    assert "the tuple's other parts ([memory[:, :0]]) nothing, so what the layer does with them is not measured" in fix
    assert "audit again" not in fix, fix  # a second call is named for two parts only
    assert diagnostics.audit(_layer(ThreePartMemory), progress=False, **_declared(report)).status == "passed"


class ConditionTuple(ImagePromptAttention):
    """The tuple memory under a name the audit does not know, `cond`, which the layer requires (left at None, it
    raises): the same call, under that name."""

    def forward(self, hidden_states, cond=None, attention_mask=None):
        return super().forward(hidden_states, tuple(cond), attention_mask)


def test_a_tuple_memory_of_a_name_the_audit_does_not_know_gets_its_call_under_that_name():
    report = diagnostics.audit(_layer(ConditionTuple), progress=False)
    assert report.declaration == IMAGE_PROMPT_CALL.replace("encoder_hidden_states=", "cond="), report.status_reason
    assert diagnostics.audit(_layer(ConditionTuple), progress=False, **_declared(report)).status == "passed"
    twin = diagnostics.audit(_layer(ConditionTuple, scaled=False), progress=False, **_declared(report))
    assert twin.status == "failed", twin


class PromptIds(nn.Module):
    """Image prompts given as token ids, (B, n), embedded only where there are any; the text attention as
    ImagePromptAttention's. `discarded=True`: embeds the ids whatever their number, and also the text tokens' ids,
    throwing that away: called on tokens in the very forward, its parameters are unused, a FAIL."""

    def __init__(self, dim=32, heads=4, discarded=False):
        super().__init__()
        self.attention = ImagePromptAttention(dim, heads)
        self.embed = nn.Embedding(10, dim)
        self.discarded = discarded

    def forward(self, hidden_states, encoder_hidden_states=None, prompt_ids=None, attention_mask=None):
        text = encoder_hidden_states  # raises below on None
        images = [self.embed(prompt_ids)] if prompt_ids.shape[1] or self.discarded else []
        if self.discarded:  # the embedding called on the empty ids and on the text's, its output thrown away
            self.embed(torch.zeros(text.shape[:2], dtype=torch.long))
        return self.attention(hidden_states, (text, images), attention_mask)


@pytest.mark.parametrize("discarded", [False, True], ids=["skips no ids", "embeds and discards"])
def test_an_embedding_called_only_on_ids_the_call_leaves_empty_is_not_measured_one_discarded_still_fails(discarded):
    """2-D ids of no token count as a stream given nothing: given some, the embedding is called, so its weights are
    not measured (a warning); one whose output is thrown away on a call it does get still fails."""
    call = lambda layer, x, memory, mask: layer(x, encoder_hidden_states=memory,  # noqa: E731
                                                prompt_ids=torch.zeros(x.shape[0], 0, dtype=torch.long),
                                                attention_mask=mask)
    torch.manual_seed(0)
    used = diagnostics.audit(PromptIds(discarded=discarded).eval(), progress=False, cross=True, call=call,
                             detectors=["parameters_used"]).result("parameters_used")
    assert used.verdict == ("fail" if discarded else "warn"), used
    assert "embed.weight" in used.message, used


class OneRowForATuple(ImagePromptAttention):
    """Given its memory alone in a tuple, returns one row, no error: no unpacking said, so no tuple form is read (the
    reading must not assume an error was said)."""

    def split_memory(self, encoder_hidden_states):
        if isinstance(encoder_hidden_states, tuple) and len(encoder_hidden_states) == 1:
            return encoder_hidden_states[0][:, :0], []
        return super().split_memory(encoder_hidden_states)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        out = super().forward(hidden_states, encoder_hidden_states, attention_mask)
        return out[:, :1] if isinstance(encoder_hidden_states, tuple) and len(encoder_hidden_states) == 1 else out


def test_a_tuple_of_one_that_runs_to_other_rows_reads_no_tuple_form_and_nothing_crashes():
    report = diagnostics.audit(_layer(OneRowForATuple), progress=False)
    runs = report.result("runs")
    assert runs.verdict == "skip" and not report.declaration, runs
    assert runs.message.endswith("no declaration of the audit's gives it a mask that fits"), runs.message


class TensorPrompt(ImagePromptAttention):
    """The image prompt a tensor, `(text, image tokens)`, read by its shape: given a list there it raises, so the
    filler it runs with, no tokens, is named."""

    def split_memory(self, encoder_hidden_states):
        text, image = encoder_hidden_states
        return text, ([image] if image.shape[1] else [])


class NeedsText(ImagePromptAttention):
    """Refuses a memory of no text tokens: the call that would audit the image prompts (the text given none) does not
    run, so the fix names none."""

    def split_memory(self, encoder_hidden_states):
        text, images = super().split_memory(encoder_hidden_states)
        if not text.shape[1]:
            raise ValueError("the text must have at least one token")
        return text, images


class HeadsMaskedPrompt(ImagePromptAttention):
    """Its mask one (Tq, T_text) per head and sequence, (B x H, Tq, T_text), as SDPA takes it: named with the call."""

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, _ = hidden_states.shape
        mask = None if attention_mask is None else attention_mask.view(B, self.heads, T, -1)  # raises on (B, 1, T, Tm)
        return super().forward(hidden_states, encoder_hidden_states, mask)


@pytest.mark.parametrize("cls, declaration, again", [
    (TensorPrompt, IMAGE_PROMPT_CALL.replace("[memory[:, :0]])", "memory[:, :0])"), True),
    (NeedsText, IMAGE_PROMPT_CALL, False),
    (HeadsMaskedPrompt, IMAGE_PROMPT_CALL.replace("cross=True, ", "cross=True, mask='allowed:B*H,Tq,Tk', "), True),
], ids=["a tensor prompt", "text required", "a mask per head"])
def test_the_tuple_form_named_is_the_one_the_layer_ran_with(cls, declaration, again):
    report = diagnostics.audit(_layer(cls), progress=False)
    assert report.declaration == declaration, report.status_reason
    assert ("audit again with" in report.result("runs").fix) is again, report.result("runs").fix
    assert diagnostics.audit(_layer(cls), progress=False, **_declared(report)).status == "passed"


def test_at_std_0_02_in_bfloat16_the_tuple_call_is_named_and_the_twins_part():
    """GPT-2's initialisation (std 0.02 weights, zero biases), in bfloat16: the same tuple call is named, the correct
    layer passes under it and the unscaled one fails."""
    import correct

    def made(**kw):
        layer = _layer(ImagePromptAttention, **kw)
        correct.gpt2_init_(layer)
        return layer.to(torch.bfloat16)

    report = diagnostics.audit(made(), progress=False, dtype=torch.bfloat16)
    assert report.declaration == IMAGE_PROMPT_CALL, report.status_reason
    assert diagnostics.audit(made(), progress=False, dtype=torch.bfloat16, **_declared(report)).status == "passed"
    twin = diagnostics.audit(made(scaled=False), progress=False, dtype=torch.bfloat16, **_declared(report))
    assert twin.status == "failed" and twin.result("softmax_saturation").verdict == "fail", twin
