"""A mask named by the stream whose keys it covers (`input_mask`, `context_mask`, `kv_mask`, `context_padding_mask`)
is the layer's mask: the audit gives its mask there, so a layer that ignores or inverts it fails, where before such a
parameter was left at None and its twins passed. A `*padding_mask` name says True = padding, one per key, as torch's
`key_padding_mask` does: the correct layer passes with no declaration and its inverted twin fails. In a
cross-attention the memory's mask (`context_mask`) is chosen over the queries' (`mask`); a query's own mask
(`q_mask`) is never the keys'.

Written in the styles of x-transformers (`forward(x, context=None, mask=None, context_mask=None)`), local-attention
and Sinkhorn (`input_mask`, True = keep) and a plain memory layer whose padding mask is named for its stream; the
packages' own layers are swept by benchmarks/sweep.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics._subject import _choose_mask, _is_mask_name

MASK_DETECTORS = ("runs", "mask_honoured", "blocked_keys_absent", "fully_masked_rows")


class _Heads(nn.Module):
    """Projections and the head split shared by the layers below; `bug`: None, "ignored" (the mask never applied)
    or "inverted" (its meaning flipped)."""

    def __init__(self, dim=32, heads=4, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def attend(self, x, memory, keep):
        """x (B, T, D) attends memory (B, Tm, D); keep (B, Tm) True = may attend, or None."""
        B, T, D = x.shape
        q = self.to_q(x).view(B, T, self.heads, -1).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(memory).view(B, memory.shape[1], self.heads, -1).transpose(1, 2) for f in (self.to_k, self.to_v))
        if keep is not None and self.bug == "inverted":
            keep = ~keep
        if keep is not None and self.bug == "ignored":
            keep = None
        mask = None if keep is None else keep.reshape(B, 1, 1, memory.shape[1])  # (B, 1, 1, Tm): raises on others
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


class ContextPadding(_Heads):
    """A memory layer: `context_padding_mask` (B, Tm), True = padding."""

    def forward(self, x, context, context_padding_mask=None):
        keep = None if context_padding_mask is None else ~context_padding_mask.bool()
        return self.attend(x, context, keep)


class InputMask(_Heads):
    """Self-attention with local-attention's and Sinkhorn's name: `input_mask` (B, T), True = keep."""

    def forward(self, x, input_mask=None):
        return self.attend(x, x, None if input_mask is None else input_mask.bool())


class ContextMask(_Heads):
    """x-transformers' Attention: `mask` covers the queries (and the keys of self-attention), `context_mask` the
    memory's keys; both (B, T), True = keep."""

    def forward(self, x, context=None, mask=None, context_mask=None):
        if context is None:
            return self.attend(x, x, None if mask is None else mask.bool())
        out = self.attend(x, context, None if context_mask is None else context_mask.bool())
        return out if mask is None else out * mask[..., None]  # a query masked out gives zeros, as x-transformers'


def _audit(cls, bug=None, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    layer = cls(bug=bug).to(dtype).eval()
    with torch.no_grad():  # std 0.02, as models are initialised
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return diagnostics.audit(layer, progress=False, dtype=dtype, **kw)


def _failed(report) -> set[str]:
    return {r.detector for r in report.results if r.verdict == "fail"}


def test_stream_mask_names_are_masks():
    for name in ("input_mask", "context_mask", "kv_mask", "key_mask", "padding_mask", "context_padding_mask",
                 "input_attn_mask", "encoder_mask", "Input_Mask"):
        assert _is_mask_name(name), name
    for name in ("q_mask", "query_mask", "head_mask", "cls_mask", "block_mask", "masks", "image_mask"):
        assert not _is_mask_name(name), name


def test_memory_mask_chosen_in_a_cross_attention():
    names = ("mask", "context_mask")
    assert _choose_mask(names, None) == "mask"
    assert _choose_mask(names, None, cross=True) == "context_mask"
    assert _choose_mask(("q_mask", "kv_mask"), None) == "kv_mask"
    assert _choose_mask(("input_mask", "input_attn_mask"), None) == "input_mask"  # the first, as the layer lists them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_name_passes_with_no_declaration_and_its_twins_fail(dtype):
    correct = _audit(ContextPadding, dtype=dtype, cross=True)
    assert correct.passed, correct
    assert correct.result("mask_honoured").verdict == "pass"
    assert "its name, `context_padding_mask`, says a padding mask" in str(correct)
    for bug in ("ignored", "inverted"):
        twin = _audit(ContextPadding, bug, dtype=dtype, cross=True)
        assert "mask_honoured" in _failed(twin), (bug, twin)


def test_input_mask_read_as_its_docstring_says_and_its_twins_fail():
    correct = _audit(InputMask)  # the class's docstring says "True = keep": key_keep, stated by the layer
    assert correct.passed, correct
    assert "input_mask: key_keep (its docstring says 'True = keep')" in str(correct)
    for bug in ("ignored", "inverted"):
        twin = _audit(InputMask, bug)
        assert "mask_honoured" in _failed(twin), (bug, twin)


def test_context_mask_is_given_under_cross():
    correct = _audit(ContextMask, cross=True, mask="key_keep")
    assert correct.passed, correct
    ignored = _audit(ContextMask, "ignored", cross=True, mask="key_keep")
    assert "mask_honoured" in _failed(ignored), ignored
