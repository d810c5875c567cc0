"""The declared-pattern matrix (issue 19): every named pattern, in correct form, passes the whole audit through each
way of building it, and the same cell with the pattern off by one fails `attention_pattern`, on the same weights and
inputs.

    patterns   causal, sliding_window(4), chunked(4), prefix_lm(5), document(ids), document(ids) & causal,
               sliding_window(4) & document(ids), sliding_window(4) | prefix block (positions 0..4 bidirectional)
    backends   the reference (correct.MultiHeadAttention) given the pattern's mask by the audit; an SDPA function
               given it; a FlexAttention program whose block mask is the pattern's own mask_mod; a Hugging Face
               attention layer called as its model calls it, its mask built by transformers' own mask builder
    dtypes     float32, bfloat16
    inits      torch's default, GPT-2's std 0.02 (correct.gpt2_init_)

A correct cell asserts the whole audit passed with the pattern declared: no finding, and `attention_pattern` measured
(a pass, not a skip). Its twin: the mask the reference and the SDPA function are handed is built from the off-by-one
pattern (a caller whose mask builder is off by one; the same wrapper handed the right pattern passes), the
FlexAttention program's mask_mod is the off-by-one one, and the Hugging Face layer's config (or the inputs its mask
builder reads) is off by one while the declared pattern stays; each fails `attention_pattern`.

Which Hugging Face layer implements which pattern (transformers 5.24; its mask builders in `masking_utils`, as the
model's forward calls them; the attention layer itself only applies the mask it is given):

    causal                        LlamaAttention + create_causal_mask          twin: create_bidirectional_mask (leakage)
    sliding_window(4)             MistralAttention (sdpa, eager), Gemma2Attention (eager) +
                                  create_sliding_window_causal_mask, config.sliding_window = 4   twin: 5 (leakage)
    chunked(4)                    Llama4TextAttention + create_chunked_causal_mask, config.attention_chunk_size = 4
                                                                               twin: 5 (leakage)
    prefix_lm(5)                  GemmaAttention + create_causal_mask with PaliGemma's block_sequence_ids
                                  (token_type_ids == 0 marks the prefix)       twin: a prefix of 4 (over-masking)
    document(ids) & causal        LlamaAttention + create_causal_mask given position ids that restart at each
                                  document (transformers' packed-sequence mask) twin: no position ids (leakage)
    sliding_window(4) & document  MistralAttention + create_sliding_window_causal_mask, packed the same way
                                                                               twin: no position ids (leakage)
    sliding_window(4) | prefix    MistralAttention + create_sliding_window_causal_mask with block_sequence_ids (the
                                  mechanism Gemma 3 uses for bidirectional image blocks)   twin: a block of 4
    document(ids)                 none: transformers' bidirectional mask builder has no packed-sequence mask

The full matrix is marked `slow` (run it with `pytest --slow`); the default run keeps one torch cell and one Hugging
Face cell per pattern (the dtype, init and torch backend rotating over the patterns). Hugging Face cells skip where
transformers is absent (the real extra: pip install -e ".[real]"); FlexAttention's first eager call takes seconds, so
its programs share one warm-up.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import MultiHeadAttention, gpt2_init_
from diagnostics.patterns import Pattern, causal, chunked, document, prefix_lm, sliding_window

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every Hugging Face layer is built from a config: nothing downloaded

T, D, H = 16, 32, 4  # the probe's length, d_model, heads
W, C, P = 4, 4, 5  # window, chunk, prefix
DOCS = [0] * 5 + [1] * 6 + [2] * 5  # document ids per position: three packed documents
DOCS_LATE = [0] * 6 + [1] * 6 + [2] * 4  # the same documents, each boundary one position late


def prefix_block(n: int) -> Pattern:
    """Positions 0..n-1 see each other both ways (a bidirectional block, as Gemma 3's image tokens)."""
    return Pattern(lambda b, h, q, kv: (q < n) & (kv < n), f"prefix_block({n})", f"(q_idx < {n}) & (kv_idx < {n})")


@dataclass(frozen=True)
class Case:
    """A named pattern, its off-by-one twin and the finding the twin must produce."""

    pattern: Pattern
    broken: Pattern
    finding: str  # "leakage" or "over-masking": what attention_pattern reports for the twin


CASES = {
    "causal": Case(causal(), Pattern(lambda b, h, q, kv: kv <= q + 1, "one future key"), "leakage"),
    "sliding_window": Case(sliding_window(W), sliding_window(W + 1), "leakage"),
    "chunked": Case(chunked(C), chunked(C + 1), "leakage"),
    "prefix_lm": Case(prefix_lm(P), prefix_lm(P - 1), "over-masking"),
    "document": Case(document(DOCS), document(DOCS_LATE), "leakage"),
    "document & causal": Case(document(DOCS) & causal(), causal(), "leakage"),
    "sliding_window & document": Case(sliding_window(W) & document(DOCS), sliding_window(W), "leakage"),
    "sliding_window | prefix": Case(sliding_window(W) | prefix_block(P), sliding_window(W) | prefix_block(P - 1),
                                    "over-masking"),
}
DTYPES = [torch.float32, torch.bfloat16]
INITS = ["default", "gpt2"]
BACKENDS = ["reference", "sdpa", "flex"]


def verdict(report, det="attention_pattern"):
    return report.result(det)


def assert_whole_audit_passes(report):
    """No finding, and attention_pattern measured (a pass, not a skip)."""
    __tracebackhide__ = True
    r = verdict(report)
    assert r.verdict == "pass", (r.verdict, r.message, r.evidence)
    assert report.status == "passed" and not report.findings, str(report)


def assert_twin_fails(report, finding: str | None):
    __tracebackhide__ = True
    r = verdict(report)
    assert r.verdict == "fail", (r.verdict, r.message, r.evidence)
    assert finding is None or f"({finding})" in r.message, (r.message, r.evidence)


def initialised(module: nn.Module, init: str, dtype) -> nn.Module:
    if init == "gpt2":
        gpt2_init_(module)
    return module.to(dtype)


# ---- torch backends ----------------------------------------------------------------------------------------


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Handed(nn.Module):
    """The reference, handed the mask of `pattern` whatever the audit passes: a caller whose mask builder builds
    `pattern` (the declared one: a control; the off-by-one one: the twin)."""

    def __init__(self, layer: MultiHeadAttention, pattern: Pattern):
        super().__init__()
        self.layer, self.handed = layer, pattern

    def forward(self, query, key=None, value=None, mask=None):
        key = query if key is None else key
        own = self.handed.allowed(query.shape[0], query.shape[1], key.shape[1]).unsqueeze(1)  # (B, 1, Tq, Tk)
        return self.layer(query, key, value, own.to(query.device))


def handed_sdpa(pattern: Pattern):
    def attend(q, k, v, mask=None):
        own = pattern.allowed(q.shape[0], q.shape[-2], k.shape[-2]).unsqueeze(1)  # (B, 1, Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=own.to(q.device))

    return attend


try:  # FlexAttention (torch >= 2.5)
    from torch.nn.attention import flex_attention
except ImportError:
    flex_attention = None


def flex_program(mask_mod):
    """A FlexAttention program whose block mask is `mask_mod` (no mask argument: the pattern is its own)."""
    def program(q, k, v):
        block = flex_attention.create_block_mask(mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return flex_attention.flex_attention(q, k, v, block_mask=block)

    return program


@pytest.fixture(scope="module")
def flex(monkeypatch_module):
    """FlexAttention, warmed once for the module (its first eager call is the slow one). Its calls outside the
    observer skip dynamo compilation (torch's own switch, which the observer sets for its calls anyway)."""
    if flex_attention is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch >= 2.5 has)")
    monkeypatch_module.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.randn(2, H, T, D // H)
        flex_program(causal().mask_mod)(q, q, q)
    return flex_attention


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def torch_audit(backend: str, pattern: Pattern, handed: Pattern | None, dtype, init: str, **kw):
    """Audit `backend` declared with `pattern`; `handed`: the pattern its mask is built from instead (None: the
    audit's mask, or for FlexAttention the declared pattern's own mask_mod)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention's eager path warns that it is unfused
        if backend == "reference":
            layer = initialised(MultiHeadAttention(D, H), init, dtype)
            if handed is not None:
                layer = Handed(layer, handed)
            return diagnostics.audit(layer, pattern=pattern, seq_len=T, **kw)
        sizes = dict(d_model=D, num_heads=H, dtype=dtype)
        if backend == "sdpa":
            fn = sdpa if handed is None else handed_sdpa(handed)
        else:
            fn = flex_program((pattern if handed is None else handed).mask_mod)
        return diagnostics.audit(fn, pattern=pattern, seq_len=T, **sizes, **kw)


def torch_cells():
    """(name, backend, dtype, init): the default run keeps one per pattern, backend, dtype and init rotating."""
    for i, name in enumerate(CASES):
        chosen = (BACKENDS[i % 3], DTYPES[i % 2], INITS[(i // 2) % 2])
        for backend in BACKENDS:
            for dtype in DTYPES:
                for init in INITS:
                    cell = (name, backend, dtype, init)
                    slow = () if (backend, dtype, init) == chosen else (pytest.mark.slow,)
                    yield pytest.param(*cell, marks=slow, id=f"{name}-{backend}-{str(dtype)[6:]}-{init}")


@pytest.mark.parametrize("name,backend,dtype,init", list(torch_cells()))
def test_torch_cell_passes_and_its_off_by_one_twin_fails(request, name, backend, dtype, init):
    case = CASES[name]
    if backend == "flex":
        request.getfixturevalue("flex")
    assert_whole_audit_passes(torch_audit(backend, case.pattern, None, dtype, init))
    twin = torch_audit(backend, case.pattern, case.broken, dtype, init, detectors=["attention_pattern"])
    # FlexAttention's mask_mod is compared with the declared one point by point: the finding is that comparison's
    assert_twin_fails(twin, None if backend == "flex" else case.finding)
    if backend != "flex":  # the wrapper that hands the twin its mask, handed the declared pattern: a pass
        control = torch_audit(backend, case.pattern, case.pattern, dtype, init, detectors=["attention_pattern"])
        assert verdict(control).verdict == "pass", (verdict(control).message, verdict(control).evidence)
