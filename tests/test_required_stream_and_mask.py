"""A layer that requires its second stream and a mask over that stream's tokens together (`runs`'
`_required_input`, `_stream_and_mask`): the report needs a declaration, the call that gives a mask keeping every
token wherever the audit gives none, in the per-key convention the layer honours (a memory attended apart), or the
stream with no tokens and a mask over none (joint attention); with it the correct layer passes and its unscaled
twin fails. Where the layer honours the mask only in the meaning opposite to the audit's and its words do not say
so, no declaration is named (an inverted mask is honoured the same way), and under the correct layer's declaration
that twin fails. The same layer reading the mask over its queries raises with both given, and still fails.

Written in the style of diffusers' Lumina processor (its text mask `attention_mask.bool().view(B, 1, 1, -1)`, read
with no check for None) and Mochi's (the text mask's valid tokens gathered per sequence and attended together with
the image's), on a module that leaves the attention to its processor as diffusers' Attention does; diffusers' own
with the zoo extra.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics


class TextMaskedProcessor:
    """Image tokens attend text tokens (`encoder_hidden_states`), the text's padding given as `attention_mask`
    (B, Tm), 1 = keep; both required. `over_queries`: the bug, the mask read over the image tokens; `inverted`: the
    bug, the mask's meaning inverted; `scaled=False`: the bug, q·k unscaled."""

    def __init__(self, over_queries=False, inverted=False, scaled=True):
        self.over_queries, self.inverted, self.scaled = over_queries, inverted, scaled

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, image tokens, width
        Tm = encoder_hidden_states.shape[1]  # raises on None, as Lumina's to_k(encoder_hidden_states) does
        # raises on None too; Lumina's view: any mask of B x Tm entries
        keep = attention_mask.bool().view(B, 1, T, 1) if self.over_queries else attention_mask.bool().view(B, 1, 1, -1)
        keep = ~keep if self.inverted else keep
        q = attn.to_q(hidden_states).view(B, T, attn.heads, D // attn.heads).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(encoder_hidden_states).view(B, Tm, attn.heads, D // attn.heads).transpose(1, 2)
                for f in (attn.to_k, attn.to_v))  # (B, H, Tm, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=None if self.scaled else 1.0)
        return attn.to_out(out.transpose(1, 2).reshape(B, T, D))  # (B, H, T, d) -> (B, T, D)


class JointTextProcessor(TextMaskedProcessor):
    """Mochi's way: each sequence's kept text tokens (`attention_mask` (B, Tm), 1 = keep, required) concatenated to
    its image tokens and attended together; the image tokens' outputs returned."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, D = hidden_states.shape
        outs = []
        for b in range(B):
            kept = torch.nonzero(attention_mask[b].flatten()).flatten()  # raises on None, as Mochi's does
            x = torch.cat([hidden_states[b:b + 1], encoder_hidden_states[b:b + 1, kept]], dim=1)  # (1, T + kept, D)
            q, k, v = (f(x).view(1, x.shape[1], attn.heads, D // attn.heads).transpose(1, 2)
                       for f in (attn.to_q, attn.to_k, attn.to_v))
            out = F.scaled_dot_product_attention(q, k, v, scale=None if self.scaled else 1.0)
            outs.append(out.transpose(1, 2).reshape(1, x.shape[1], D)[:, :T])
        return attn.to_out(torch.cat(outs))


class TextMaskedAttention(nn.Module):
    """diffusers' layout: the module holds the projections, its processor computes the attention."""

    def __init__(self, dim=32, heads=4, processor=None):
        super().__init__()
        self.heads, self.processor = heads, processor or TextMaskedProcessor()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


def _layer(processor=None):
    torch.manual_seed(0)
    return TextMaskedAttention(processor=processor)


def _declared(report) -> dict:
    """The report's declaration as keyword arguments for audit(), as a user would paste it."""
    call = ast.parse(f"f({report.declaration})", mode="eval").body
    return {k.arg: eval(compile(ast.Expression(k.value), "<declaration>", "eval"), {})  # noqa: S307 -- the report's
            if isinstance(k.value, ast.Lambda) else ast.literal_eval(k.value) for k in call.keywords}


MEMORY = ("cross=True, mask='key_keep', call=lambda layer, x, memory, mask: layer(x, encoder_hidden_states=memory, "
          "attention_mask=memory.new_ones(memory.shape[:2], dtype=bool) if mask is None else mask)")
JOINT = ("call=lambda layer, x: layer(x, encoder_hidden_states=x[:, :0], attention_mask=x.new_ones(x.shape[0], 0))")


@pytest.mark.parametrize("processor, declaration", [(TextMaskedProcessor, MEMORY), (JointTextProcessor, JOINT)],
                         ids=["memory", "joint"])
def test_a_layer_requiring_its_stream_and_a_mask_over_it_names_the_call_and_passes_with_it(processor, declaration):
    report = diagnostics.audit(_layer(processor()), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and report.declaration == declaration, report.status_reason
    assert runs.verdict == "skip" and "raises given `encoder_hidden_states` alone" in runs.message, runs.message
    again = diagnostics.audit(_layer(processor()), progress=False, **_declared(report))
    assert again.status == "passed", again.status_reason


@pytest.mark.parametrize("processor", [TextMaskedProcessor, JointTextProcessor], ids=["memory", "joint"])
def test_its_unscaled_twin_names_the_same_call_and_fails_under_it(processor):
    report = diagnostics.audit(_layer(processor(scaled=False)), progress=False)
    assert report.declaration == diagnostics.audit(_layer(processor()), progress=False).declaration
    again = diagnostics.audit(_layer(processor(scaled=False)), progress=False, **_declared(report))
    assert again.status == "failed" and again.result("softmax_saturation").verdict == "fail", again.status_reason


def test_a_mask_honoured_only_inverted_names_no_convention_and_fails_under_the_correct_twins_declaration():
    """Inverted, the text mask is honoured as key_padding (True = blocked): what a correct layer of that convention
    does too, but nothing the layer says suggests it, so no declaration is named; under the one its correct twin
    names, the bug is caught."""
    report = diagnostics.audit(_layer(TextMaskedProcessor(inverted=True)), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    assert "it honours it only as key_padding" in runs.message and "names no convention" in runs.message, runs.message
    correct = diagnostics.audit(_layer(), progress=False)
    again = diagnostics.audit(_layer(TextMaskedProcessor(inverted=True)), progress=False, **_declared(correct))
    assert again.status == "failed", again.status_reason


class MemoryFirst(TextMaskedAttention):
    """The same layer, its memory first: `forward(encoder_hidden_states=None, hidden_states=None, ...)`."""

    def forward(self, encoder_hidden_states=None, hidden_states=None, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


def test_the_call_gives_x_by_name_where_the_query_is_not_forwards_first():
    torch.manual_seed(0)
    report = diagnostics.audit(MemoryFirst(), progress=False)
    named = MEMORY.replace("layer(x, encoder", "layer(hidden_states=x, encoder")
    assert report.declaration == named, report.declaration
    torch.manual_seed(0)
    assert diagnostics.audit(MemoryFirst(), progress=False, **_declared(report)).status == "passed"


class AdditiveOnly(TextMaskedProcessor):
    """Takes its text mask as an additive float (B, Tm), 0 keep and a large negative number block, added to the
    scores; refuses a bool mask with a TypeError."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if attention_mask is None or attention_mask.dtype == torch.bool:
            raise TypeError("attention_mask: a float tensor (B, Tm), 0 keep, a large negative number block")
        B, T, D = hidden_states.shape  # batch, image tokens, width
        Tm = encoder_hidden_states.shape[1]
        q = attn.to_q(hidden_states).view(B, T, attn.heads, D // attn.heads).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(encoder_hidden_states).view(B, Tm, attn.heads, D // attn.heads).transpose(1, 2)
                for f in (attn.to_k, attn.to_v))  # (B, H, Tm, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.view(B, 1, 1, Tm).to(q.dtype))
        return attn.to_out(out.transpose(1, 2).reshape(B, T, D))


def test_conventions_the_layer_raises_on_are_passed_over_for_the_additive_one_it_honours():
    """Pin (`_key_convention`: a convention under which a call raises is skipped, not read): the bool ones raise; the
    additive one is honoured, a bias of -1 moving the outputs less than blocking, and is named with a mask of zeros
    where the audit gives none. With it the layer passes."""
    report = diagnostics.audit(_layer(AdditiveOnly()), progress=False)
    assert report.declaration == MEMORY.replace("key_keep", "additive:B,Tk").replace(
        "memory.new_ones(memory.shape[:2], dtype=bool)", "memory.new_zeros(memory.shape[:2])"), report.declaration
    assert diagnostics.audit(_layer(AdditiveOnly()), progress=False, **_declared(report)).status == "passed"


class CondMasked(TextMaskedAttention):
    """The same attention, its memory a parameter of a name the audit does not know and its mask required over it:
    `forward(x, cond, mask=None)`, mask (B, Tm), True = keep; cond: a text encoder's output, say."""

    def forward(self, x, cond, mask=None):
        return self.processor(self, x, cond, mask)


COND = ("cross=True, mask='key_keep', call=lambda layer, x, memory, mask: layer(x, cond=memory, "
        "mask=memory.new_ones(memory.shape[:2], dtype=bool) if mask is None else mask)")


@pytest.mark.parametrize("scaled", [True, False], ids=["correct", "unscaled"])
def test_a_memory_of_a_name_the_audit_does_not_know_gets_the_same_call(scaled):
    """A stream of an unknown name, attended apart from the queries (each output row moved only with its own query),
    is a memory: the per-key convention it honours is named as for a known one, by its own name. Under that call
    the correct layer passes and its unscaled twin fails; before, both were inconclusive with no call named."""
    torch.manual_seed(0)
    report = diagnostics.audit(CondMasked(processor=TextMaskedProcessor(scaled=scaled)), progress=False)
    assert report.status == "inconclusive" and report.declaration == COND, report.status_reason
    assert "attends `cond` as a memory" in report.result("runs").message, report.result("runs").message
    torch.manual_seed(0)
    again = diagnostics.audit(CondMasked(processor=TextMaskedProcessor(scaled=scaled)), progress=False,
                              **_declared(report))
    assert again.status == ("passed" if scaled else "failed"), str(again)


def test_the_same_layer_reading_that_mask_over_its_queries_still_fails_runs():
    report = diagnostics.audit(_layer(TextMaskedProcessor(over_queries=True)), progress=False)
    assert report.status == "failed" and report.result("runs").verdict == "fail", report.status_reason


class HeadsApartProcessor(TextMaskedProcessor):
    """Lumina's way: the same attention, each head's output returned apart, (B, T, H, d), for the block that calls
    the layer to merge and project with the layer's own `to_out` (which the processor never calls);
    `HeadsFirstProcessor`: the same, (B, H, T, d)."""

    heads_first = False

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, D = hidden_states.shape
        Tm = encoder_hidden_states.shape[1]
        keep = attention_mask.bool().view(B, 1, 1, -1)
        q = attn.to_q(hidden_states).view(B, T, attn.heads, D // attn.heads).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(encoder_hidden_states).view(B, Tm, attn.heads, D // attn.heads).transpose(1, 2)
                for f in (attn.to_k, attn.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=None if self.scaled else 1.0)
        return out if self.heads_first else out.transpose(1, 2)  # (B, H, T, d) or (B, T, H, d)


class HeadsFirstProcessor(HeadsApartProcessor):
    heads_first = True


MERGED = MEMORY.replace("layer(x, encoder", "layer.to_out(layer(x, encoder") + ".flatten(2))"


@pytest.mark.parametrize("processor", [HeadsApartProcessor, HeadsFirstProcessor], ids=["BTHD", "BHTD"])
@pytest.mark.parametrize("scaled", [True, False], ids=["correct", "unscaled"])
def test_a_layer_returning_each_heads_output_gets_the_call_that_merges_and_projects_them(scaled, processor):
    """The memory's call, its output merged and projected with the `to_out` the processor leaves to its caller, as
    Lumina's block does (before: no call named, inconclusive; a call that merged alone would leave `to_out` unused).
    Under it the correct layer passes and its unscaled twin fails. Heads first, (B, H, T, d), the rows the memory's
    trial calls compare are read behind the head axis (before: `runs` failed the correct layer, every trial call
    read as giving no row per query)."""
    report = diagnostics.audit(_layer(processor(scaled=scaled)), progress=False)
    merged = MERGED.replace(".flatten(2)", ".transpose(1, 2).flatten(2)") if processor.heads_first else MERGED
    assert report.status == "inconclusive" and report.declaration == merged, report.status_reason
    assert "each of its 4 heads' output apart" in report.result("runs").message, report.result("runs").message
    again = diagnostics.audit(_layer(processor(scaled=scaled)), progress=False, **_declared(report))
    assert again.status == ("passed" if scaled else "failed"), str(again)


@pytest.mark.parametrize("name", ["Attention+MochiAttnProcessor2_0", "attention_processor:MochiAttention",
                                  "Attention+LuminaAttnProcessor2_0"])
def test_diffusers_layers_requiring_their_text_stream_and_its_mask(name):
    """Mochi's two pass with the call their report names, and so does Lumina's processor, which returns each head's
    output (B, T, H, d), merged and projected with its own `to_out` by the block that calls it: the call does that."""
    pytest.importorskip("diffusers", reason="diffusers is not installed (the zoo extra)")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sweep_diffusers as sd

    report = diagnostics.audit(sd.diffusers_build(name), progress=False)
    assert report.status == "inconclusive", report.status_reason
    assert report.declaration == (MERGED.replace("layer.to_out(", "layer.to_out[0](") if "Lumina" in name
                                  else JOINT), report.status_reason
    assert diagnostics.audit(sd.diffusers_build(name), progress=False, **_declared(report)).status == "passed"


def test_on_the_command_line_the_declaration_is_spelled_with_its_flags():
    """`--cross` alone (a flag, never `--cross True`), the convention after `--mask`, the call as a function to name."""
    from diagnostics._cli import OPTIONS

    report = diagnostics.audit(_layer(), progress=False, _options=OPTIONS)
    assert report.declaration == (
        "--cross, --mask key_keep, --call mymodule:call with def call(layer, x, memory, mask): return layer(x, "
        "encoder_hidden_states=memory, attention_mask=memory.new_ones(memory.shape[:2], dtype=bool) if mask is None "
        "else mask)"), report.declaration


@pytest.mark.parametrize("processor, declaration", [(TextMaskedProcessor, MEMORY), (JointTextProcessor, JOINT)],
                         ids=["memory", "joint"])
def test_at_std_0_02_in_bfloat16_the_same_call_is_named_and_the_twins_part(processor, declaration):
    """GPT-2's initialisation (std 0.02 weights, zero biases), in bfloat16: the same call, under which the correct
    layer passes and the unscaled one fails; the inverted memory mask still names no convention."""
    import correct

    def made(**kw):
        layer = _layer(processor(**kw))
        correct.gpt2_init_(layer)
        return layer.to(torch.bfloat16)

    report = diagnostics.audit(made(), progress=False, dtype=torch.bfloat16)
    assert report.declaration == declaration, report.status_reason
    declared = _declared(report)
    assert diagnostics.audit(made(), progress=False, dtype=torch.bfloat16, **declared).status == "passed"
    buggy = diagnostics.audit(made(scaled=False), progress=False, dtype=torch.bfloat16, **declared)
    assert buggy.status == "failed" and buggy.result("softmax_saturation").verdict == "fail", buggy.status_reason
    if processor is TextMaskedProcessor:
        inverted = diagnostics.audit(made(inverted=True), progress=False, dtype=torch.bfloat16)
        assert inverted.status == "inconclusive" and not inverted.declaration, inverted.status_reason


class BroadcastMaskProcessor(TextMaskedProcessor):
    """Takes its text mask (B, Tm) or any mask that broadcasts over the scores, (B, 1, Tq, Tm) too: the per-key
    convention is the one named, since the call fills a (B, Tm) mask of ones wherever the audit gives none."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, T, D = hidden_states.shape
        keep = attention_mask.bool()  # raises on None
        keep = keep[:, None, None, :] if keep.dim() == 2 else keep
        q = attn.to_q(hidden_states).view(B, T, attn.heads, D // attn.heads).transpose(1, 2)
        k, v = (f(encoder_hidden_states).view(B, -1, attn.heads, D // attn.heads).transpose(1, 2)
                for f in (attn.to_k, attn.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return attn.to_out(out.transpose(1, 2).reshape(B, T, D))


def test_a_mask_that_also_broadcasts_per_query_is_still_named_per_key():
    report = diagnostics.audit(_layer(BroadcastMaskProcessor()), progress=False)
    assert report.declaration == MEMORY, report.status_reason
    assert diagnostics.audit(_layer(BroadcastMaskProcessor()), progress=False, **_declared(report)).status == "passed"


class HalfWidthProcessor(TextMaskedProcessor):
    """Requires its text and mask as TextMaskedProcessor does, and returns half the width, (B, T, D / 2): no per-head
    form, no call named, and the reading says so (it must not stop at the shape)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        out = super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask)
        return out[..., : out.shape[-1] // 2]


def test_a_layer_requiring_both_that_returns_another_width_names_no_call_and_says_its_shape():
    report = diagnostics.audit(_layer(HalfWidthProcessor()), progress=False)
    runs = report.result("runs")
    assert runs.verdict == "skip" and not report.declaration, runs
    assert "; it returns (2, 16, 16), not the queries' form (2, 16, 32)" in runs.message, runs.message
