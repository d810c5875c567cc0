"""A module that returns each head's output apart, (B, T, H, d) or (B, H, T, d), for its caller to merge and project
(`detectors/_heads_out.py`): an attention core, as diffusers' Lumina processor is (its block merges the heads and
applies the layer's own `to_out`). Another convention, not a defect: the report needs a declaration, the call that
merges the heads as the caller does and applies the one projection the layer never calls; under it the correct
layer passes and each twin (q·k unscaled, heads merged without their transpose, a mask ignored) fails. Before,
`output_shape` and `parameters_used` failed the correct layer, with a fix about swapped streams.
"""

from __future__ import annotations

import ast
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import correct
import diagnostics


class HeadsApart(nn.Module):
    """Self-attention that returns each head's output apart: (B, T, H, d) (`layout="bthd"`) or (B, H, T, d)
    ("bhtd"); `to_out`, where built, is its caller's to apply. `bug`: "unscaled" (q·k not divided by sqrt(d)),
    "no_transpose" ((B, H, T, d) viewed as (B, T, H, d) without the transpose), "mask_ignored"."""

    def __init__(self, dim=32, heads=4, *, layout="bthd", projections=1, bug=None):
        super().__init__()
        self.heads, self.layout, self.bug = heads, layout, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        if projections:
            self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        if projections > 1:
            self.extra_out = nn.Linear(dim, dim)

    def attend(self, x, keep=None):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        mask = None if keep is None or self.bug == "mask_ignored" else keep[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 if self.bug == "unscaled" else None)
        if self.layout == "bhtd":
            return out
        return out.reshape(B, T, self.heads, -1) if self.bug == "no_transpose" else out.transpose(1, 2)

    def forward(self, x):
        return self.attend(x)


class HeadsApartMasked(HeadsApart):
    """The same, with a padding mask over its keys: `key_padding_mask` (B, T), True = padding."""

    def forward(self, x, key_padding_mask=None):
        return self.attend(x, None if key_padding_mask is None else ~key_padding_mask)


def _made(cls=HeadsApart, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    layer = cls(**kw)
    if dtype != torch.float32:  # training's scale: GPT-2's initialisation, in the low precision
        correct.gpt2_init_(layer)
    return layer.to(dtype)


def _declared(report) -> dict:
    """The report's declaration as keyword arguments for audit(), as a user would paste it."""
    call = ast.parse(f"f({report.declaration})", mode="eval").body
    return {k.arg: eval(compile(ast.Expression(k.value), "<declaration>", "eval"), {})  # noqa: S307 -- the report's
            if isinstance(k.value, ast.Lambda) else ast.literal_eval(k.value) for k in call.keywords}


CALLS = {("bthd", 1): "call=lambda layer, x: layer.to_out[0](layer(x).flatten(2))",
         ("bhtd", 1): "call=lambda layer, x: layer.to_out[0](layer(x).transpose(1, 2).flatten(2))",
         ("bthd", 0): "call=lambda layer, x: layer(x).flatten(2)",
         ("bhtd", 0): "call=lambda layer, x: layer(x).transpose(1, 2).flatten(2)"}
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16-std0.02")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, projections", list(CALLS), ids=[f"{a}-{'projection' if p else 'none'}"
                                                                    for a, p in CALLS])
def test_a_layer_returning_its_heads_apart_needs_the_call_that_merges_them_and_passes_under_it(layout, projections,
                                                                                               dtype):
    layer = _made(layout=layout, projections=projections, dtype=dtype)
    report = diagnostics.audit(layer, progress=False, dtype=dtype)
    assert report.status == "inconclusive" and report.declaration == CALLS[layout, projections], str(report)
    assert report.result("output_shape").verdict == "skip" and "heads' output apart" in report.status_reason
    used = report.result("parameters_used")
    assert used.verdict == ("warn" if projections else "pass"), used.message
    assert not any(m._forward_pre_hooks for m in layer.modules()), "the audit left a hook on the layer"
    again = diagnostics.audit(_made(layout=layout, projections=projections, dtype=dtype), progress=False, dtype=dtype,
                              **_declared(report))
    assert again.status == "passed", str(again)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bug, caught_by", [("unscaled", "softmax_saturation"), ("no_transpose", None)])
def test_its_twins_name_the_same_call_and_fail_under_it(bug, caught_by, dtype):
    """On the same inputs as the correct layer above: the declaration is the correct layer's, and it does not pass
    the bug (heads merged without their transpose keeps the (B, T, H, d) form, so the hint reads it the same)."""
    report = diagnostics.audit(_made(bug=bug, dtype=dtype), progress=False, dtype=dtype)
    assert report.declaration == CALLS["bthd", 1], str(report)
    again = diagnostics.audit(_made(bug=bug, dtype=dtype), progress=False, dtype=dtype, **_declared(report))
    assert again.status == "failed", str(again)
    assert caught_by is None or again.result(caught_by).verdict == "fail", str(again)


@pytest.mark.parametrize("bug", [None, "mask_ignored"], ids=["correct", "mask ignored"])
def test_the_call_keeps_the_mask_in_the_convention_the_layer_states(bug):
    report = diagnostics.audit(_made(HeadsApartMasked, bug=bug), progress=False)
    assert not [r.detector for r in report.results if r.verdict == "error"], str(report)
    assert report.declaration == ("mask='key_padding', call=lambda layer, x, mask: layer.to_out[0](layer(x, "
                                  "key_padding_mask=mask).flatten(2))"), str(report)
    again = diagnostics.audit(_made(HeadsApartMasked, bug=bug), progress=False, **_declared(report))
    assert again.status == ("passed" if bug is None else "failed"), str(again)
    assert bug is None or again.result("mask_honoured").verdict == "fail", str(again)


def test_a_change_in_a_per_head_output_is_placed_by_token_then_head():
    """Zero-config, a (B, T, H, d) output's changes are (B, T, H) with the features folded, and where the greatest
    one lies is said in that order (it was labelled (b, h, t)); a function's (B, H, T, d) keeps (b, h, t)."""
    import re

    report = diagnostics.audit(_made(HeadsApartMasked, bug="mask_ignored"), progress=False)
    evidence = report.result("mask_honoured").evidence
    assert re.search(r"greatest change \S+ at \(b=\d+, t=\d+, h=\d+\)", evidence), evidence
    from diagnostics._core import where_text
    assert where_text((0, 1, 2), 3) == "(b=0, h=1, t=2)"


def test_two_projections_never_read_name_no_call_and_fail_as_before():
    """Which of them the caller applies cannot be told: no call is named, and one of them is unused whichever it is,
    so `output_shape` fails as it did before, saying why."""
    report = diagnostics.audit(_made(projections=2), progress=False)
    shape = report.result("output_shape")
    assert shape.verdict == "fail" and not report.declaration, shape.message
    assert "`to_out.0`, `extra_out`" in shape.message and "cannot be told" in shape.message, shape.message
    assert "no declared call that merges them can be named" in shape.message, shape.message


class WrongWidth(HeadsApart):
    """A shape bug that is no per-head form: half the heads' output returned, (B, T, D / 2)."""

    def forward(self, x):
        return self.attend(x).flatten(2)[..., : x.shape[-1] // 2]


def test_an_output_of_another_shape_still_fails():
    report = diagnostics.audit(_made(WrongWidth), progress=False)
    assert report.result("output_shape").verdict == "fail" and not report.declaration, str(report)


def test_on_the_command_line_the_call_is_a_function_to_name():
    from diagnostics._cli import OPTIONS

    report = diagnostics.audit(_made(), progress=False, _options=OPTIONS)
    assert report.declaration == ("--call mymodule:call with def call(layer, x): return "
                                  "layer.to_out[0](layer(x).flatten(2))"), report.declaration


# ---- pins: what the reading refuses, and how the call is spelled --------------------------------------------------

@pytest.mark.parametrize("shape, seen", [
    ((2, 16, 4, 8), ("bthd", 4)), ((2, 4, 16, 8), ("bhtd", 4)), ((2, 16, 1, 32), ("bthd", 1)),
    ((2, 16, 16, 2), None),  # a head axis as long as the sequence: which axis is which cannot be told
    ((2, 16, 4, 4), None), ((2, 4, 16, 4), None),  # H x d not the width
    ((2, 16, 32), None), ((1, 16, 4, 8), None),  # not four axes; another batch
], ids=str)
def test_heads_layout_reads_only_a_batch_of_each_heads_rows_of_the_whole_width(shape, seen):
    from diagnostics.detectors._heads_out import heads_layout

    assert heads_layout(torch.zeros(shape), 2, 16, 32) == seen


class NoAttention(HeadsApart):
    """A tensor of the per-head shape with no attention in it: a projection viewed as (B, T, H, d)."""

    def forward(self, x):
        return self.to_v(x).view(*x.shape[:2], self.heads, -1)


def test_a_per_head_shape_with_no_attention_observed_still_fails():
    report = diagnostics.audit(_made(NoAttention), progress=False)
    assert report.result("output_shape").verdict == "fail" and not report.declaration, str(report)


def test_a_call_of_the_users_that_returns_the_heads_apart_fails():
    """The user declared how the layer is called, and that call returns each head's output apart: the declaration is
    what needs the merge. Failed, as before, saying so (a skip would have let the audit pass)."""
    report = diagnostics.audit(_made(), progress=False, call=lambda layer, x: layer(x))
    shape = report.result("output_shape")
    assert report.status == "failed" and shape.verdict == "fail" and not report.declaration, str(report)
    assert "the declared call returns them so" in shape.message and "merges its heads itself, out.reshape(B, T, " \
        "H * d)" in shape.fix, shape


def test_the_fix_merges_heads_first_outputs_with_their_transpose():
    shape = diagnostics.audit(_made(layout="bhtd"), progress=False).result("output_shape")
    assert "out.transpose(1, 2).reshape(B, T, H * d), and applies `to_out.0`" in shape.fix, shape.fix


class MaskedCore(HeadsApart):
    """A plain `mask` (the audit's default convention, bool (B, 1, Tq, Tk), True = may attend)."""

    def forward(self, hidden_states, mask=None):
        B, T, D = hidden_states.shape
        q, k, v = (f(hidden_states).view(B, T, self.heads, -1).transpose(1, 2)
                   for f in (self.to_q, self.to_k, self.to_v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


class MemoryCore(HeadsApart):
    """Cross-attention core, its memory first: `forward(encoder_hidden_states, hidden_states)`."""

    def forward(self, encoder_hidden_states, hidden_states):
        B, T, D = hidden_states.shape
        q = self.to_q(hidden_states).view(B, T, self.heads, -1).transpose(1, 2)
        k, v = (f(encoder_hidden_states).view(B, -1, self.heads, D // self.heads).transpose(1, 2)
                for f in (self.to_k, self.to_v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


@pytest.mark.parametrize("cls, options, declaration", [
    (MaskedCore, {}, "call=lambda layer, x, mask: layer.to_out[0](layer(x, mask=mask).flatten(2))"),
    (MemoryCore, {"cross": True}, "cross=True, call=lambda layer, x, memory: layer.to_out[0](layer(hidden_states=x, "
                                  "encoder_hidden_states=memory).flatten(2))"),
], ids=["default mask", "memory first"])
def test_the_call_passes_x_positionally_only_to_forwards_first_and_names_a_convention_only_where_read(cls, options,
                                                                                                     declaration):
    report = diagnostics.audit(_made(cls), progress=False, **options)
    assert report.declaration == declaration, str(report)
    # the detectors that compare rows read each head's rows (B, T, H) where nothing is merged yet: none crashed
    assert not [r.detector for r in report.results if r.verdict in ("error", "fail")], str(report)
    assert diagnostics.audit(_made(cls), progress=False, **_declared(report)).status == "passed"


class AdditiveCore(HeadsApart):
    """Hugging Face's style: `attention_mask` added to the scores (float, 0 keep, large negative block), which nothing
    the layer says states, so the audit's default reading (bool, True = may attend) is its first: one it does not
    honour, where it honours the additive one. `bug` as HeadsApart's, "mask_ignored" never adding it."""

    def forward(self, hidden_states, attention_mask=None):
        B, T, D = hidden_states.shape
        q, k, v = (f(hidden_states).view(B, T, self.heads, -1).transpose(1, 2)
                   for f in (self.to_q, self.to_k, self.to_v))
        scores = q @ k.transpose(-1, -2) / (1.0 if self.bug == "unscaled" else math.sqrt(D // self.heads))
        if attention_mask is not None and self.bug != "mask_ignored":
            scores = scores + attention_mask
        out = scores.softmax(-1) @ v  # (B, H, T, d)
        return out if self.layout == "bhtd" else out.transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("bug, caught_by", [(None, None), ("unscaled", "softmax_saturation"),
                                            ("mask_ignored", "mask_honoured")], ids=["correct", "unscaled", "ignored"])
def test_a_mask_convention_read_only_once_the_heads_are_merged_is_named_with_the_call_at_once(layout, bug, caught_by,
                                                                                              dtype):
    """The convention `mask_honoured` would name for the merged twin is named in the same declaration as the call (two
    rounds before: the mask detectors read no rows of a heads-first output), only where the layer honours it and not
    the default; the mask ignored honours none, so no convention is named under which it would pass, and every twin
    fails under the declaration its report names."""
    report = diagnostics.audit(_made(AdditiveCore, layout=layout, bug=bug, dtype=dtype), progress=False, dtype=dtype)
    call = CALLS[layout, 1].replace("lambda layer, x:", "lambda layer, x, mask:").replace(
        "layer(x)", "layer(x, attention_mask=mask)")
    assert report.declaration == (call if bug == "mask_ignored" else f"mask='additive', {call}"), str(report)
    again = diagnostics.audit(_made(AdditiveCore, layout=layout, bug=bug, dtype=dtype), progress=False, dtype=dtype,
                              **_declared(report))
    assert again.status == ("passed" if bug is None else "failed"), str(again)
    assert caught_by is None or again.result(caught_by).verdict == "fail", str(again)


def test_as_many_heads_as_tokens_heads_first_the_convention_is_still_named_with_the_call():
    """16 heads at 16 tokens, (B, H, T, d): the rows the convention is read on are told from the heads by the layout
    read at T + 3 (by shape alone the heads were taken for tokens, and the correct layer failed `mask_honoured`)."""
    report = diagnostics.audit(_made(AdditiveCore, layout="bhtd", dim=64, heads=16), progress=False)
    assert report.declaration == ("mask='additive', call=lambda layer, x, mask: layer.to_out[0](layer(x, "
                                  "attention_mask=mask).transpose(1, 2).flatten(2))"), str(report)
    again = diagnostics.audit(_made(AdditiveCore, layout="bhtd", dim=64, heads=16), progress=False,
                              **_declared(report))
    assert again.status == "passed", str(again)


class PaddingCore(HeadsApart):
    """A padding mask under `attention_mask`, which nothing the layer says states (its words would be read)."""

    def forward(self, hidden_states, attention_mask=None):
        B, T, D = hidden_states.shape
        q, k, v = (f(hidden_states).view(B, T, self.heads, -1).transpose(1, 2)
                   for f in (self.to_q, self.to_k, self.to_v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads)
        if attention_mask is not None:  # (B, T), True = padding: -inf on the scores
            blocked = torch.zeros(attention_mask.shape, dtype=scores.dtype).masked_fill(attention_mask, float("-inf"))
            scores = scores + blocked[:, None, None, :]
        out = scores.softmax(-1) @ v  # (B, H, T, d)
        return out if self.layout == "bhtd" else out.transpose(1, 2)


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_a_per_head_layer_given_its_mask_in_another_convention_needs_a_declaration_never_fails(layout):
    """Zero-config, the probes that gave its mask in the audit's default convention read it wrong (every key of a row
    blocked, masked keys with gradient): with the convention named with the call, those findings need the same
    declaration, as its merged twin's do, and under it the layer passes."""
    report = diagnostics.audit(_made(PaddingCore, layout=layout), progress=False)
    assert report.status == "inconclusive", str(report)
    assert report.declaration.startswith("mask='key_padding', call="), str(report)
    assert not [r.detector for r in report.results if r.verdict in ("fail", "error")], str(report)
    assert diagnostics.audit(_made(PaddingCore, layout=layout), progress=False,
                             **_declared(report)).status == "passed"


def test_a_call_is_not_written_where_the_audit_builds_arguments_the_call_cannot_spell():
    """Position embeddings the audit builds for a Hugging Face layer (`extra`) have no spelling in a declared call."""
    import types

    from diagnostics._subject import Signature
    from diagnostics.detectors._heads_out import HeadsOut, merged_call

    subject = types.SimpleNamespace(call=None, extra=lambda query, start: {}, form="self_module", mask_names=(),
                                    sig=Signature(query="hidden_states", first="hidden_states"))
    probe = types.SimpleNamespace(subject=subject, options=None)
    heads = HeadsOut("bthd", 4, left=(("o_proj", "layer.o_proj"),))
    assert merged_call(probe, heads) is None
    subject.extra = None
    assert merged_call(probe, heads) == "call=lambda layer, x: layer.o_proj(layer(x).flatten(2))"


def test_heads_seen_names_nothing_where_the_traced_calls_raise_or_show_another_form():
    """The traced call (at T + 3, else at T) records which parameters the layer reads: where both raise nothing is
    read, and where its output has another form the first is not trusted."""
    from diagnostics.detectors._heads_out import heads_seen

    layer, out = _made(), torch.zeros(2, 16, 4, 8)
    from diagnostics.detectors._heads_out import Read

    def at(t, form=lambda t: torch.zeros(2, t, 4, 8)):
        return Read(form(t), False, frozenset({"to_q.weight", "to_k.weight"}))

    assert heads_seen(layer, out, (2, 16, 32), lambda t: None) is None
    assert heads_seen(layer, out, (2, 16, 32), lambda t: at(t, lambda t: torch.zeros(2, 4, t, 8))) is None
    # to_v unread is no caller's projection: named for values, an unused parameter of the layer's own
    assert heads_seen(layer, out, (2, 16, 32), at).left == (("to_out.0", "layer.to_out[0]"),)


def flash_layout(q, k, v, mask=None):
    """A function that takes (B, H, T, d) as the audit gives it and returns (B, T, H, d), undeclared."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def test_a_function_of_another_output_layout_still_fails_output_shape():
    """Functions are called in a layout of their own (`layout=`), never read as a module's per-head output."""
    report = diagnostics.audit(flash_layout, d_model=32, num_heads=4, progress=False)
    assert report.result("output_shape").verdict == "fail", str(report)


# ---- the review's cases (2026-12-06): each read wrong by the first draft, now with its twin ------------------------

class ValuesFromKeys(HeadsApart):
    """The bug: values made by the key projection, `to_v` never read; no output projection of its own."""

    def __init__(self, bug=True, projections=0, **kw):
        super().__init__(projections=projections, **kw)
        self.values_bug = bug

    def forward(self, x):
        B, T, D = x.shape
        q, k = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k))
        v = (self.to_k if self.values_bug else self.to_v)(x).view(B, T, self.heads, -1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


@pytest.mark.parametrize("bug", [False, True], ids=["correct", "values from keys"])
def test_an_unread_input_projection_is_never_taken_for_the_callers_output_projection(bug):
    """`to_v` left unread is an unused parameter, not the projection the caller applies: the call merges only, and
    under it the bug fails `parameters_used` (the first draft named `layer.to_v(...)`, under which it passed)."""
    report = diagnostics.audit(_made(ValuesFromKeys, bug=bug), progress=False)
    assert report.declaration == CALLS["bthd", 0], str(report)
    again = diagnostics.audit(_made(ValuesFromKeys, bug=bug), progress=False, **_declared(report))
    assert again.status == ("failed" if bug else "passed"), str(again)
    assert not bug or again.result("parameters_used").verdict == "fail", str(again)


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_as_many_heads_as_tokens_are_told_apart_at_another_length(layout):
    """16 heads of width 2 at the default 16 tokens: the axes are told apart at 19 tokens."""
    report = diagnostics.audit(_made(layout=layout, heads=16), progress=False)
    assert report.declaration == CALLS[layout, 1], str(report)
    assert diagnostics.audit(_made(layout=layout, heads=16), progress=False, **_declared(report)).status == "passed"


class ReturnsWeights(HeadsApart):
    """The bug: the weights (B, H, T, T) returned for the output; at 16 tokens and 4 heads, H x T is the width."""

    def forward(self, x):
        B, T, D = x.shape
        q, k = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k))
        return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)


def test_returned_weights_whose_shape_mimics_heads_apart_still_fail():
    """At 16 tokens (B, 4, 16, 16) reads as four heads of width 16 = 64 / 4; at 19 its last axis follows the length,
    which no head's width does."""
    report = diagnostics.audit(_made(ReturnsWeights, dim=64), progress=False)
    assert report.result("output_shape").verdict == "fail" and not report.declaration, str(report)


class MHACore(nn.Module):
    """nn.MultiheadAttention (which reads its `out_proj` through F.linear, never calling it) returned split into heads
    for the caller to merge; `to_out` of its own, where built, is the caller's."""

    def __init__(self, dim=32, heads=4, own_out=False):
        super().__init__()
        self.heads = heads
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        if own_out:
            self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        return self.mha(x, x, x, need_weights=False)[0].view(B, T, self.heads, D // self.heads)


@pytest.mark.parametrize("own_out, declaration", [
    (False, "call=lambda layer, x: layer(x).flatten(2)"),
    (True, "call=lambda layer, x: layer.to_out(layer(x).flatten(2))"),
], ids=["mha alone", "mha and the caller's to_out"])
def test_projections_read_through_functional_calls_count_as_read(own_out, declaration):
    """Which projections the layer reads is traced from its ops, not from module calls: `mha.out_proj` is read by
    F.linear inside nn.MultiheadAttention (the first draft's hooks named it never called, and the call applied it
    twice)."""
    torch.manual_seed(0)
    report = diagnostics.audit(MHACore(own_out=own_out), progress=False)
    assert report.declaration == declaration, str(report)
    torch.manual_seed(0)
    assert diagnostics.audit(MHACore(own_out=own_out), progress=False, **_declared(report)).status == "passed"


class WithWeights(HeadsApart):
    """Returns (each head's output apart, the weights)."""

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return (weights @ v).transpose(1, 2), weights


def test_a_tuple_returned_is_indexed_in_the_call():
    report = diagnostics.audit(_made(WithWeights), progress=False)
    assert report.declaration == "call=lambda layer, x: layer.to_out[0](layer(x)[0].flatten(2))", str(report)
    assert diagnostics.audit(_made(WithWeights), progress=False, **_declared(report)).status == "passed"


@pytest.mark.parametrize("container, key, spelled", [
    (nn.ModuleList, "0", "layer.out[0]"), (nn.Sequential, "0", "layer.out[0]"),
    (nn.ModuleDict, "0", "layer.out['0']"), (nn.ModuleDict, "in", "layer.out['in']"),
    (None, "out", "layer.out"),
])
def test_a_projections_path_is_spelled_as_python_reaches_it(container, key, spelled):
    from diagnostics.detectors._heads_out import _spelled

    layer = nn.Module()
    if container is None:
        layer.out, path = nn.Linear(4, 4), "out"
    else:
        layer.out = (container({key: nn.Linear(4, 4)}) if container is nn.ModuleDict else
                     container([nn.Linear(4, 4)]) if container is nn.ModuleList else container(nn.Linear(4, 4)))
        path = f"out.{key}"
    assert _spelled(layer, path) == spelled
    assert eval(spelled, {"layer": layer}) is layer.get_submodule(path)  # noqa: S307 -- our own spelling
    layer.add_module("in", nn.Linear(4, 4))  # a keyword: reached through get_submodule
    assert _spelled(layer, "in") == "layer.get_submodule('in')"


def test_beside_the_callers_projection_an_unread_input_projection_still_fails_parameters_used():
    """`to_out` is the caller's (a warning, left to the call), `to_v` unread is the layer's own unused parameter: a
    failure already zero-config, and under the call the report names."""
    report = diagnostics.audit(_made(ValuesFromKeys, projections=1), progress=False)
    used = report.result("parameters_used")
    assert used.verdict == "fail" and "to_v.weight" in used.message and "to_out" not in used.message, used.message
    assert report.declaration == CALLS["bthd", 1], str(report)
    again = diagnostics.audit(_made(ValuesFromKeys, projections=1), progress=False, **_declared(report))
    assert again.result("parameters_used").verdict == "fail", str(again)


class PerHeadProjection(nn.Module):
    """Each head's output projected to the whole width by a (H, d, D) weight, in the style of mmdit's
    AdaptiveAttention; `concatenated=True`, its bug: the heads then concatenated (H x D wide), not summed."""

    def __init__(self, dim=32, heads=4, concatenated=False):
        super().__init__()
        self.heads, self.concatenated = heads, concatenated
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Parameter(torch.randn(heads, dim // heads, dim) * (dim ** -0.5))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        out = torch.einsum("bhnd,hde->bhne", F.scaled_dot_product_attention(q, k, v), self.to_out)  # (B, H, T, D)
        return out.transpose(1, 2).reshape(B, T, -1) if self.concatenated else out.sum(1)


@pytest.mark.parametrize("concatenated", [False, True], ids=["summed", "concatenated"])
def test_heads_projected_to_the_width_and_concatenated_fail_with_a_fix_that_says_so(concatenated):
    """The twin that sums the heads' projections passes; the one that concatenates them fails `output_shape` with a
    fix that names what it did (it named queries and a memory, the detector's general fix)."""
    torch.manual_seed(0)
    report = diagnostics.audit(PerHeadProjection(concatenated=concatenated), progress=False)
    shape = report.result("output_shape")
    assert shape.verdict == ("fail" if concatenated else "pass"), str(report)
    assert not concatenated or shape.fix.startswith("sum the heads' outputs after each head's projection"), shape.fix


@pytest.mark.parametrize("cls", [WrongWidth, NoAttention], ids=["half the width", "no attention"])
def test_an_output_of_another_width_than_heads_times_the_width_is_not_called_heads_side_by_side(cls):
    """The twin of the concatenated heads above: an output that is not H x the width, or of other rows, keeps the
    detector's own message."""
    shape = diagnostics.audit(_made(cls), progress=False).result("output_shape")
    assert shape.verdict == "fail" and "x the width" not in shape.message, shape


class RowsDropped(HeadsApart):
    """H x the width on a shape whose rows are not the tokens' (the last token dropped): not the heads side by side."""

    def forward(self, x):
        out = self.attend(x).flatten(2)
        return torch.cat([out] * self.heads, -1)[:, :-1]


def test_an_output_h_times_as_wide_with_rows_missing_keeps_the_general_message():
    shape = diagnostics.audit(_made(RowsDropped), progress=False).result("output_shape")
    assert shape.verdict == "fail" and "x the width" not in shape.message, shape
