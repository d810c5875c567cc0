"""A module that returns each head's output apart, (B, T, H, d) or (B, H, T, d), for its caller to merge and project
(`detectors/_heads_out.py`): an attention core, as diffusers' Lumina processor is (its block merges the heads and
applies the layer's own `to_out`). Another convention, not a defect: the report needs a declaration, the call that
merges the heads as the caller does and applies the one projection the layer never calls; under it the correct
layer passes and each twin (q·k unscaled, heads merged without their transpose, a mask ignored) fails. Before,
`output_shape` and `parameters_used` failed the correct layer, with a fix about swapped streams.
"""

from __future__ import annotations

import ast

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


def test_two_projections_never_called_name_no_call():
    """Which of them the caller applies cannot be told: `output_shape` names no call and says why."""
    report = diagnostics.audit(_made(projections=2), progress=False)
    shape = report.result("output_shape")
    assert shape.verdict == "skip" and not shape.declaration, shape.message
    assert "`to_out.0`, `extra_out`" in shape.message and "cannot be told" in shape.message, shape.message


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


def test_under_a_call_of_the_users_the_merge_cannot_be_written_and_the_report_says_so():
    report = diagnostics.audit(_made(), progress=False, call=lambda layer, x: layer(x))
    shape = report.result("output_shape")
    assert shape.verdict == "skip" and not shape.declaration, shape.message
    assert "cannot be written as a declared call" in shape.message and "merges its heads itself, out.reshape(B, T, " \
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


def test_a_call_is_not_written_where_the_audit_builds_arguments_the_call_cannot_spell():
    """Position embeddings the audit builds for a Hugging Face layer (`extra`) have no spelling in a declared call."""
    import types

    from diagnostics._subject import Signature
    from diagnostics.detectors._heads_out import HeadsOut, merged_call

    subject = types.SimpleNamespace(call=None, extra=lambda query, start: {}, form="self_module", mask_names=(),
                                    sig=Signature(query="hidden_states", first="hidden_states"))
    probe = types.SimpleNamespace(subject=subject, options=None)
    heads = HeadsOut("bthd", 4, left=("o_proj",))
    assert merged_call(probe, heads) is None
    subject.extra = None
    assert merged_call(probe, heads) == "call=lambda layer, x: layer.o_proj(layer(x).flatten(2))"


def test_heads_seen_names_nothing_where_the_second_call_raises_or_changes_form():
    """The second call records which projections the layer leaves unreached: where it raises (None) nothing is read
    from it, and where its output has another form the first is not trusted."""
    from diagnostics.detectors._heads_out import heads_seen

    layer, out = _made(), torch.zeros(2, 16, 4, 8)
    assert heads_seen(layer, out, (2, 16, 32), lambda: None) is None
    assert heads_seen(layer, out, (2, 16, 32), lambda: out.transpose(1, 2)) is None
    assert heads_seen(layer, out, (2, 16, 32), lambda: out).left == ("to_q", "to_k", "to_v", "to_out.0")


def flash_layout(q, k, v, mask=None):
    """A function that takes (B, H, T, d) as the audit gives it and returns (B, T, H, d), undeclared."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def test_a_function_of_another_output_layout_still_fails_output_shape():
    """Functions are called in a layout of their own (`layout=`), never read as a module's per-head output."""
    report = diagnostics.audit(flash_layout, d_model=32, num_heads=4, progress=False)
    assert report.result("output_shape").verdict == "fail", str(report)
