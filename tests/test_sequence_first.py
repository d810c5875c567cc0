"""Sequence-first layers: tokens (T, B, D), a mask (Tq, Tk, B) (issue 34 "Code nobody here wrote", cause 8).

labml-nn's annotated implementations (MultiHeadAttention and the dozen layers built on it: RoPE, relative, ALiBi,
Primer's) take their tokens sequence first, `[seq_len, batch_size, d_model]`, as their docstrings say, and their mask
as `[seq_len, seq_len, batch_size]`; so do torch's layers without batch_first and fairseq's ("Time x Batch x
Channel"). Given the audit's (B, T, D) tokens such a layer attends across the batch and treats the tokens as its
batch: the correct layer FAILED (runs, batch_independence). A layer that takes another convention needs a
declaration, not a verdict. Now `layout="tbd"` audits a module on (T, B, D) tokens (its output read back), the mask
shape "Tq,Tk,B" gives it its mask, and a layer that states its layout (its docstring's (seq_len, batch, d_model), its
`batch_first` False) is audited in it unasked, as a stated mask convention is. What the layer does never chooses it:
a batch-first layer that attends across the batch by mistake does what a sequence-first one does given batch-first
tokens, so where nothing is stated the failure stands and its fix names both readings. Twins on the same inputs: the
layer without its 1/sqrt(d_k), or ignoring its mask, fails in its own layout.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._masks import stated_layout_in_text
from diagnostics._subject import make_subject

D, HEADS = 32, 4


class SequenceFirst(nn.Module):
    """Multi-head attention on sequence-first tokens.

    Args:
        query, key, value: (seq_len, batch, d_model) tokens.
        mask: (seq_len, seq_len, batch) bool, True where the query may attend the key.
    """

    def __init__(self, bug: str = ""):
        super().__init__()
        self.bug, self.heads = bug, HEADS
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, *, query, key, value, mask=None):
        T, B, _ = query.shape  # sequence first
        S = key.shape[0]
        q = self.q(query).view(T, B, self.heads, -1)  # (T, B, H, d_k)
        k, v = self.k(key).view(S, B, self.heads, -1), self.v(value).view(S, B, self.heads, -1)
        scores = torch.einsum("ibhd,jbhd->ijbh", q, k)  # (Tq, Tk, B, H): queries first, as labml-nn lays them
        if self.bug != "unscaled":
            scores = scores / math.sqrt(q.shape[-1])
        if mask is not None and self.bug != "mask ignored":
            scores = scores.masked_fill(~mask[..., None], float("-inf"))
        weights = scores.softmax(dim=1)  # over the keys
        return self.out(torch.einsum("ijbh,jbhd->ibhd", weights, v).reshape(T, B, D))


class Unstated(SequenceFirst):
    """The same layer, its docstrings saying nothing about its layout."""

    def forward(self, *, query, key, value, mask=None):
        return super().forward(query=query, key=key, value=value, mask=mask)


class Flagged(Unstated):
    """The same layer, its layout said by torch's flag."""

    batch_first = False


def _audit(layer, dtype=torch.float32, **declared):
    torch.manual_seed(0)
    return diagnostics.audit(layer.to(dtype), **declared)


def _std_002(layer):
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    return layer


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_layer_that_states_it_is_sequence_first_is_audited_so_and_its_bugs_fail(dtype, init):
    """Its docstring states the tokens' layout and the mask's shape and meaning: zero-config, audited in them (the
    report's first line says so), it passes; its twins fail on the same inputs in the same layout."""
    build = (lambda bug="": _std_002(SequenceFirst(bug))) if init == "std 0.02" else SequenceFirst
    torch.manual_seed(0)
    right = _audit(build(), dtype)
    assert right.status == "passed", str(right)
    assert "layout=tbd" in right.layer and "(seq_len, batch, d_model)" in right.layer, right.layer
    torch.manual_seed(0)
    unscaled = _audit(build("unscaled"), dtype)
    assert unscaled.result("softmax_saturation").verdict == "fail", str(unscaled)
    torch.manual_seed(0)
    ignored = _audit(build("mask ignored"), dtype)
    assert ignored.result("mask_honoured").verdict == "fail", str(ignored)


def test_a_sequence_first_layer_that_says_nothing_fails_and_its_fix_names_both_readings():
    """Nothing states the layout: the behaviour cannot choose it (a batch-first layer attending across the batch by
    mistake reads the same), so batch_independence fails, its fix naming the bug and layout="tbd"; declared, with its
    mask's convention, the layer passes and its twin fails."""
    plain = _audit(Unstated())
    assert plain.status == "failed" and plain.result("batch_independence").verdict == "fail", str(plain)
    assert "sequence-first (T, B, D)" in plain.result("batch_independence").fix
    assert "layout=" not in plain.result("batch_independence").fix  # no declaration under which the bug passes
    declared = dict(layout="tbd", mask="allowed:Tq,Tk,B")
    assert _audit(Unstated(), **declared).status == "passed"
    assert _audit(Unstated("unscaled"), **declared).result("softmax_saturation").verdict == "fail"


def test_a_declared_call_lays_the_tokens_out_itself_and_the_stated_layout_is_not_applied_on_top():
    """A call that transposes the tokens itself (as labml-nn's RoPER case in benchmarks/pypi_bugs.py declares it): the
    layer's stated layout is the call's business, not applied twice (which failed that case's both releases)."""
    call = lambda layer, x, mask=None: layer(  # noqa: E731
        query=x.transpose(0, 1), key=x.transpose(0, 1), value=x.transpose(0, 1),
        mask=None if mask is None else mask.permute(1, 2, 0)).transpose(0, 1)
    report = _audit(SequenceFirst(), call=call, mask="allowed:B,Tq,Tk")
    assert report.status == "passed" and "layout=tbd" not in report.layer, str(report)
    assert _audit(SequenceFirst("unscaled"), call=call, mask="allowed:B,Tq,Tk").status == "failed"


def test_batch_first_false_states_the_layout_and_the_mask_convention_is_then_named():
    """torch's flag states it; the mask's convention, stated nowhere, is found by the probes and named."""
    report = _audit(Flagged())
    assert "its `batch_first` is False" in report.layer, report.layer
    assert report.status == "inconclusive" and "mask='allowed:Tq,Tk,B'" in report.status_reason, str(report)
    assert _audit(Flagged(), mask="allowed:Tq,Tk,B").status == "passed"
    assert _audit(Flagged("mask ignored"), mask="allowed:Tq,Tk,B").result("mask_honoured").verdict == "fail"


@pytest.mark.parametrize("text, name, expected", [
    ("`query`, `key` and `value` are the tensors.\n They have shape `[seq_len, batch_size, d_model]`.\n\n"
     "`mask` has shape `[seq_len, seq_len, batch_size]`", "query", "tbd"),  # labml-nn's
    ("query: (L, N, E) where L is the target sequence length, N is the batch size", "query", "tbd"),  # torch's
    ("Input shape: Time x Batch x Channel", "query", "tbd"),  # fairseq's
    (":param x: is the tensor of shape `[batch_size, seq_len, d_model]`", "x", "btd"),
    ("x: (B, T, D) tokens", "x", "btd"),
    ("x (b, n, d)", "x", "btd"),  # einops' n is the tokens: batch first
    ("Args:\n  x: (batch, seq_len, d_model)\n  cache: (seq_len, batch, d_model)", "x", "btd"),  # the cache's own entry
    ("mask: (seq_len, batch, 1)", "x", None),  # a mask's shape says nothing of the tokens'
    ("Args:\n  x: the tokens\nReturns:\n  weights of shape (tgt_len, bsz, src_len)", "x", None),  # a returned tensor's
    ("A position table of shape (seq_len, batch, d_model).", "x", None),  # no entry of the input's own
    ("x: the tokens. The table `pos` is kept as (seq_len, batch, d_model).", "x", None),  # another tensor's sentence
    ("query: (L, N, E) when batch_first=False or (N, L, E) when batch_first=True", "query", None),  # both: the flag
    ("x: the tokens", "x", None),
])
def test_the_docstring_reader_takes_the_inputs_own_entry_time_first_or_batch_first(text, name, expected):
    stated = stated_layout_in_text(text, name)
    assert (stated[0] if stated else None) == expected, stated


class SaysBatchFirst(nn.Module):
    """A batch-first layer whose class docstring describes its cache as (seq_len, batch, d_model)."""

    def __init__(self, mixes_the_batch: bool = False):
        super().__init__()
        self.d_model, self.num_heads, self.mixes = D, HEADS, mixes_the_batch
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, x, mask=None):
        """x: (batch, seq_len, d_model) tokens."""
        if self.mixes:  # a real bug: attends across the batch
            return self.attn(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))[0].transpose(0, 1)
        return self.attn(x, x, x, attn_mask=None if mask is None else ~mask.repeat_interleave(HEADS, 0)[:, 0])[0]


class TorchWords(SaysBatchFirst):
    """query: (L, N, E) when batch_first=False or (N, L, E) when batch_first=True."""

    batch_first = True

    def forward(self, x, mask=None):
        return super().forward(x, mask)


def test_a_shape_written_for_another_tensor_or_both_ways_leaves_a_batch_first_layer_so():
    """Forward's own entry says batch first: the class docstring's cache shape is not read (the layer passes, and its
    twin that attends across the batch fails); torch's wording of both layouts is decided by `batch_first` = True."""
    for layer in (SaysBatchFirst(), TorchWords()):
        report = _audit(layer)
        assert "layout=tbd" not in report.layer and report.status == "passed", str(report)
    mixed = _audit(SaysBatchFirst(mixes_the_batch=True))
    assert mixed.result("batch_independence").verdict == "fail", str(mixed)


def test_a_layout_of_the_other_form_is_refused_with_what_to_pass():
    with pytest.raises(diagnostics.AuditUsageError, match='for a module, layout one of btd, tbd'):
        make_subject(SequenceFirst(), layout="bthd")
    with pytest.raises(diagnostics.AuditUsageError, match="for a function, layout one of bhtd, bthd"):
        make_subject(lambda q, k, v, mask=None: v, layout="tbd")
