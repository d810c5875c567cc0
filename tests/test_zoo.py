"""The library zoo (issue 17): attention classes of five PyPI libraries, audited as a new user first audits them.

x-transformers, vit-pytorch, openai-whisper, open-clip-torch and diffusers, each class built from a small config
(d_model 32, 4 heads, random weights: nothing is downloaded). A user first runs `audit(layer)` with no argument
(with `causal=True` only where the layer's own model makes it causal from outside, e.g. Whisper's decoder passes
its causal mask), then, if the report names a declaration (`mask="key_keep"`, `causal=True`, `scale=10.0`, ...),
once more with it. Per correct layer, two checks: the report names exactly the declaration the layer needs (or
none), and with it the layer passes. Per library, injected bugs (an instance patched or a class subclassed,
never the library edited): each is caught, by a detector that does not fail its correct twin on the same audit.

Where a correct layer does not pass today, the check is `xfail(strict=True)` with the gap in one sentence (the
detector or convention, and its cause): when the fix lands it shows as XPASS, and the mark goes. A bug whose twin's
declaration the audit does not accept yet is an xfail too. Without the libraries (the `zoo` extra in
pyproject.toml, pinned: `pip install -e ".[test,real,zoo]"` after the real extra's torch pair) each library is one
visible skip that says how to install it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import math
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diagnostics import audit

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from configs: nothing may come from a hub

D, H = 32, 4  # d_model and heads of every layer here
d_k = D // H
INSTALL = 'pip install torch==2.14.1 torchvision==0.29.1, then pip install -e ".[test,real,zoo]"'
# the detectors that must measure and pass a correct layer (a verdict that is clean by skipping is not a pass)
MEASURED = ("runs", "output_shape", "finite_output", "weight_row_sums", "softmax_saturation", "output_variance",
            "eval_determinism", "batch_independence")
CAUSAL = ("future_leakage", "causal_alignment")
# the keywords of audit() a report may tell a user to declare, read from the findings' fixes; `call=` is named with
# an example (a lambda), which the user writes for their layer: the case gives that function
DECLARABLE = ("causal", "cross", "mask", "scale", "layout", "num_heads", "d_model", "seq_len", "positions",
              "need_weights")
_LITERAL = r"""'[^']*'|"[^"]*"|True|False|-?\d+(?:\.\d+)?(?:e-?\d+)?"""


# ---- what a user does --------------------------------------------------------------------------------------


def declarations_named(report) -> dict[str, Any]:
    """The declarations the report tells its user to make: `keyword=literal` for an audit() keyword in the fix (or
    the status reason) of a finding, e.g. 'audit with mask='additive'' or 'audit it as causal (causal=True)', and
    `call` (as CALL) where it suggests declaring the call. A keyword named twice: the first, as a user reads it."""
    texts = [r.fix or "" for r in report.findings] + [report.status_reason or ""]
    named = {}
    for text in texts:
        for keyword, value in re.findall(rf"\b({'|'.join(DECLARABLE)})=({_LITERAL})", text):
            named.setdefault(keyword, ast.literal_eval(value))
        if re.search(r"\bcall=", text):
            named.setdefault("call", CALL)
    return named


CALL = "call=<the user's function>"


def _as_named(declare: dict) -> dict:
    """A case's declaration as the report names it: a declared call is named as CALL."""
    return {k: CALL if k == "call" else v for k, v in declare.items()}


def assert_passes(report, *, causal: bool):
    """No detector fails or warns; the core detectors (the causal ones for a causal audit, mask_honoured for a
    layer that takes a mask) measured and passed, so that the verdict is not clean by skipping."""
    __tracebackhide__ = True
    assert report.passed and not report.fired(), str(report)
    measured = MEASURED + (CAUSAL if causal else ()) + (("mask_honoured",) if report.settings["takes_mask"] else ())
    not_passed = {d: report.result(d).verdict for d in measured if report.result(d).verdict != "pass"}
    assert not not_passed, f"expected these detectors to measure and pass: {not_passed}\n{report}"


# ---- the cases ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
    """A correct attention class as a library ships it. `use`: what the user knows from the model the layer sits
    in (causal=True for a decoder's self-attention whose model passes the causal mask); `declare`: the one
    declaration its report must name ({}: it passes with no argument); `names_gap` / `passes_gap`: why the
    report does not name it today / why the layer does not pass with it today (None: it does)."""

    library: str  # the distribution's name on PyPI
    name: str
    build: Callable[[], nn.Module]
    use: dict = dataclasses.field(default_factory=dict)
    declare: dict = dataclasses.field(default_factory=dict)
    names_gap: str | None = None
    passes_gap: str | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def module(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().eval()  # the audit runs layers in eval mode

    def audit(self, layer=None, **declared):
        with self.context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations inside the libraries
            return audit(self.module() if layer is None else layer, **self.use, **declared)

    @property
    def causal(self) -> bool:
        return bool(self.use.get("causal") or self.declare.get("causal"))


@dataclasses.dataclass(frozen=True, eq=False)
class Bug:
    """A mistake injected into a correct layer (`twin`) by `inject(module) -> module`, audited as its twin is (the
    twin's `use` and its declaration): caught when one of `caught_by` fails on the bug and not on the twin."""

    twin: Layer
    name: str
    inject: Callable[[nn.Module], nn.Module]
    caught_by: tuple
    gap: str | None = None

    @property
    def declare(self) -> dict:
        return self.twin.declare

    @property
    def library(self) -> str:
        return self.twin.library


# -- helpers that inject a mistake without editing a library: modules put where the library calls its own

class Scale(nn.Module):
    """x * factor: after a query projection, factor sqrt(d_k) cancels the layer's 1/sqrt(d_k): q·k unscaled."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class MergeWithoutTranspose(nn.Module):
    """Turns heads merged correctly, (B, T, H*d), into what `x.reshape(B, T, H*d)` of (B, H, T, d) gives: head h's
    positions laid side by side. Put before the output projection: the projection sees the bug's merge."""

    def forward(self, x):  # (B, T, D)
        B, T, _ = x.shape
        return x.reshape(B, T, H, d_k).transpose(1, 2).reshape(B, T, D)  # (B, T, H, d) -> (B, H, T, d) -> "(B, T, D)"


class ReshapeHeadsWithoutTranspose(nn.Module):
    """x-transformers' `merge_heads` (einops 'b h n d -> b n (h d)') written as a plain reshape."""

    def forward(self, x):  # (B, H, T, d)
        B, _, T, _ = x.shape
        return x.reshape(B, T, H * d_k)


def setting(path: str = "", **attributes) -> Callable[[nn.Module], nn.Module]:
    """An injection: set attributes on the layer's sub-module at `path` ("" for the layer itself)."""

    def inject(module: nn.Module) -> nn.Module:
        target = module.get_submodule(path) if path else module
        for name, value in attributes.items():
            setattr(target, name, value)
        return module

    return inject


def _replace(module: nn.Module, path: str, make: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """module.<path> = make(the original), for a dotted path ("to_out.0": the first of a ModuleList)."""
    parent, _, name = path.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    setattr(owner, name, make(getattr(owner, name)))
    return module


def before(path: str, step: Callable[[], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """An injection: a step put before the layer's sub-module at `path` (Sequential(step, the original))."""
    return lambda module: _replace(module, path, lambda original: nn.Sequential(step(), original))


def after(path: str, step: Callable[[], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """An injection: a step put after the layer's sub-module at `path` (Sequential(the original, step))."""
    return lambda module: _replace(module, path, lambda original: nn.Sequential(original, step()))


def retype(subclass: Callable[[], type]) -> Callable[[nn.Module], nn.Module]:
    """An injection: the layer becomes an instance of a subclass that rewrites one method (same weights)."""

    def inject(module: nn.Module) -> nn.Module:
        module.__class__ = subclass()
        return module

    return inject


# ---- x-transformers --------------------------------------------------------------------------------------

XT = "x-transformers"


def xt_attention(**options):
    from x_transformers.x_transformers import Attention
    return Attention(D, heads=H, dim_head=d_k, **options)


XT_CAUSAL = Layer(XT, "Attention(causal=True)", lambda: xt_attention(causal=True),
                  declare={"causal": True, "mask": "key_keep"})
XT_ATTENTION = Layer(XT, "Attention", xt_attention, declare={"mask": "key_keep"})
XT_LAYERS = [
    XT_ATTENTION,
    XT_CAUSAL,
    Layer(XT, "Attention(causal=True, flash=True)", lambda: xt_attention(causal=True, flash=True),
          declare={"causal": True, "mask": "key_keep"}),
    Layer(XT, "Attention(num_mem_kv=4)", lambda: xt_attention(num_mem_kv=4), declare={"mask": "key_keep"}),
    Layer(XT, "Attention(qk_norm=True)", lambda: xt_attention(qk_norm=True),
          declare={"mask": "key_keep"}),  # its scale of 10 on normalised q, k: judged as such (issue 34, cause 2)
    Layer(XT, "Attention(dim_context=32) with context", lambda: xt_attention(dim_context=D),
          declare={"mask": "key_keep"}),
]


def xt_inverted_mask():
    from x_transformers.x_transformers import Attention

    class InvertedKeyMask(Attention):
        """A caller's mistake: the (B, Tk) key mask inverted on its way in (a key-padding mask passed as key-keep)."""

        def forward(self, x, mask=None):
            return super().forward(x, mask=None if mask is None else ~mask)

    return InvertedKeyMask


def _no_causal_mask(i, j, device=None):
    return torch.zeros(i, j, dtype=torch.bool, device=device)  # (Tq, Tk): nothing blocked


XT_BUGS = [
    Bug(XT_CAUSAL, "scale dropped (Attend.scale = 1)", setting("attend", scale=1.0), ("softmax_saturation",)),
    Bug(XT_CAUSAL, "softmax over the queries (dim=-2)",
        setting("attend", attn_fn=functools.partial(F.softmax, dim=-2, dtype=torch.float32)), ("weight_row_sums",)),
    Bug(XT_CAUSAL, "causal mask dropped", setting("attend", create_causal_mask=_no_causal_mask), ("future_leakage",)),
    Bug(XT_CAUSAL, "heads merged without transpose", setting(merge_heads=ReshapeHeadsWithoutTranspose()),
        ("output_variance", "future_leakage", "query_locality", "mask_honoured")),
    Bug(XT_ATTENTION, "key mask inverted on its way in", retype(xt_inverted_mask), ("mask_honoured",)),
]


# ---- vit-pytorch -------------------------------------------------------------------------------------------

VIT = "vit-pytorch"


def vit_attention(module: str, **options):
    return importlib.import_module(f"vit_pytorch.{module}").Attention(D, heads=H, dim_head=d_k, **options)


VIT_ATTENTION = Layer(VIT, "vit.Attention", lambda: vit_attention("vit"))
VIT_LAYERS = [
    VIT_ATTENTION,
    Layer(VIT, "simple_vit.Attention", lambda: vit_attention("simple_vit")),
    Layer(VIT, "cross_vit.Attention", lambda: vit_attention("cross_vit")),
    Layer(VIT, "simple_vit_with_qk_norm.Attention", lambda: vit_attention("simple_vit_with_qk_norm")),  # QK-norm
    Layer(VIT, "na_vit.Attention", lambda: vit_attention("na_vit"), declare={"mask": "key_keep"}),  # QK-norm
]
VIT_BUGS = [
    Bug(VIT_ATTENTION, "scale dropped (self.scale = 1)", setting(scale=1.0), ("softmax_saturation",)),
    Bug(VIT_ATTENTION, "softmax over the queries (nn.Softmax(dim=-2))", setting(attend=nn.Softmax(dim=-2)),
        ("weight_row_sums",)),
    Bug(VIT_ATTENTION, "heads merged without transpose", before("to_out", MergeWithoutTranspose),
        ("output_variance", "query_locality", "mask_honoured")),
]


# ---- openai-whisper ----------------------------------------------------------------------------------------

WHISPER = "openai-whisper"


def whisper_attention():
    from whisper.model import MultiHeadAttention
    return MultiHeadAttention(D, H)


def whisper_block(**options):
    from whisper.model import ResidualAttentionBlock
    return ResidualAttentionBlock(D, H, **options)


def whisper_eager():
    """Whisper's own switch to its non-SDPA path (used for word timestamps, which read the q·k it returns)."""
    from whisper.model import disable_sdpa
    return disable_sdpa()


def whisper_mask_not_passed_on():
    from whisper.model import MultiHeadAttention

    class MaskNotPassedOn(MultiHeadAttention):
        """forward() drops the mask on its way to qkv_attention: the SDPA path is then never causal."""

        def qkv_attention(self, q, k, v, mask=None):
            return super().qkv_attention(q, k, v, None)

    return MaskNotPassedOn


def whisper_unmasked(layer, x):
    """How Whisper's encoder calls its blocks: no mask (its SDPA path reads any mask as is_causal=True)."""
    return layer(x)


def whisper_cross(layer, query, memory):
    """How Whisper's decoder calls its cross-attention: the encoder's output as `xa`, no mask."""
    return layer(query, xa=memory)


WHISPER_DECODER = Layer(WHISPER, "MultiHeadAttention, decoder self-attention", whisper_attention,
                        use={"causal": True})
WHISPER_LAYERS = [
    WHISPER_DECODER,
    Layer(WHISPER, "MultiHeadAttention, encoder self-attention", whisper_attention, declare={"call": whisper_unmasked}),
    Layer(WHISPER, "MultiHeadAttention, cross-attention (memory xa)", whisper_attention,
          declare={"call": whisper_cross}),
    Layer(WHISPER, "MultiHeadAttention, eager path (disable_sdpa), decoder", whisper_attention, use={"causal": True},
          declare={"mask": "additive"}, context=whisper_eager),
    Layer(WHISPER, "ResidualAttentionBlock, decoder", whisper_block, use={"causal": True}),
    Layer(WHISPER, "ResidualAttentionBlock, encoder", whisper_block, declare={"call": whisper_unmasked}),
]
WHISPER_BUGS = [
    Bug(WHISPER_DECODER, "causal mask not passed on (mask=None to qkv_attention)", retype(whisper_mask_not_passed_on),
        ("future_leakage",)),
    Bug(WHISPER_DECODER, "scale dropped (q multiplied by sqrt(d_k) after its projection)",
        after("query", lambda: Scale(math.sqrt(d_k))), ("softmax_saturation",)),
    Bug(WHISPER_DECODER, "heads merged without transpose", before("out", MergeWithoutTranspose),
        ("output_variance", "future_leakage", "query_locality", "mask_honoured")),
]


# ---- open-clip-torch ---------------------------------------------------------------------------------------

OPEN_CLIP = "open-clip-torch"


def open_clip_attention(**options):
    from open_clip.transformer import Attention
    return Attention(D, H, **options)


def open_clip_block(custom: bool, **options):
    from open_clip.transformer import (
        CustomResidualAttentionBlock,
        ResidualAttentionBlock,
    )
    return (CustomResidualAttentionBlock if custom else ResidualAttentionBlock)(D, H, **options)


def open_clip_inverted_mask():
    from open_clip.transformer import Attention

    class InvertedMask(Attention):
        """A caller's mistake: the bool mask inverted on its way in (the other library's polarity)."""

        def forward(self, x, attn_mask=None):
            return super().forward(x, attn_mask=None if attn_mask is None else ~attn_mask)

    return InvertedMask


OPEN_CLIP_ATTENTION = Layer(OPEN_CLIP, "Attention", open_clip_attention, declare={"mask": "blocked"})
OPEN_CLIP_LAYERS = [
    OPEN_CLIP_ATTENTION,
    Layer(OPEN_CLIP, "Attention(qk_norm=True)", lambda: open_clip_attention(qk_norm=True), declare={"mask": "blocked"}),
    Layer(OPEN_CLIP, "Attention(scale_heads=True)", lambda: open_clip_attention(scale_heads=True),
          declare={"mask": "blocked"}),
    Layer(OPEN_CLIP, "CustomResidualAttentionBlock", lambda: open_clip_block(True), declare={"mask": "blocked"}),
    # its attention() casts any mask to the input's dtype before nn.MultiheadAttention: a bool one becomes 0./1.
    Layer(OPEN_CLIP, "ResidualAttentionBlock (nn.MultiheadAttention inside)", lambda: open_clip_block(False),
          declare={"mask": "additive:B*H,Tq,Tk"}),
]
OPEN_CLIP_BUGS = [
    Bug(OPEN_CLIP_ATTENTION, "scale dropped (q multiplied by sqrt(d_k) at ln_q)", setting(ln_q=Scale(math.sqrt(d_k))),
        ("softmax_saturation",)),
    Bug(OPEN_CLIP_ATTENTION, "heads merged without transpose", setting(ln_inner=MergeWithoutTranspose()),
        ("output_variance", "query_locality", "mask_honoured")),
    Bug(OPEN_CLIP_ATTENTION, "bool mask inverted on its way in", retype(open_clip_inverted_mask), ("mask_honoured",)),
]


# ---- diffusers ---------------------------------------------------------------------------------------------

DIFFUSERS = "diffusers"


def diffusers_attention(processor: str, **options):
    from diffusers.models import attention_processor as ap
    return ap.Attention(D, heads=H, dim_head=d_k, processor=getattr(ap, processor)(), **options)


def diffusers_subclass(method: str) -> Callable[[], type]:
    """Attention with one method rewritten with a mistake (the processor calls it unchanged)."""
    return lambda: _diffusers_subclasses()[method]


@functools.cache
def _diffusers_subclasses() -> dict[str, type]:
    from diffusers.models.attention_processor import Attention

    class SoftmaxOverQueries(Attention):
        def get_attention_scores(self, query, key, attention_mask=None):
            baddbmm_input = (torch.zeros(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype,
                                         device=query.device) if attention_mask is None else attention_mask)
            scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=1, alpha=self.scale)
            return scores.softmax(dim=-2)  # (B*H, Tq, Tk): each column sums to 1 over the queries

    class MergeWithoutPermute(Attention):
        def batch_to_head_dim(self, tensor):
            head_size = self.heads
            batch_size, seq_len, dim = tensor.shape
            return tensor.reshape(batch_size // head_size, seq_len, dim * head_size)  # no permute(0, 2, 1, 3)

    return {"get_attention_scores": SoftmaxOverQueries, "batch_to_head_dim": MergeWithoutPermute}


DIFFUSERS_SDPA = Layer(DIFFUSERS, "Attention + AttnProcessor2_0", lambda: diffusers_attention("AttnProcessor2_0"))
DIFFUSERS_PLAIN = Layer(DIFFUSERS, "Attention + AttnProcessor", lambda: diffusers_attention("AttnProcessor"),
                        declare={"mask": "additive:B,Tq,Tk"})
DIFFUSERS_LAYERS = [
    DIFFUSERS_SDPA,
    DIFFUSERS_PLAIN,
    Layer(DIFFUSERS, "Attention(cross_attention_dim=32) + AttnProcessor2_0",
          lambda: diffusers_attention("AttnProcessor2_0", cross_attention_dim=D)),
    Layer(DIFFUSERS, "Attention(cross_attention_dim=32) + AttnProcessor",
          lambda: diffusers_attention("AttnProcessor", cross_attention_dim=D), declare={"mask": "additive:B,Tq,Tk"}),
    Layer(DIFFUSERS, "Attention(qk_norm='layer_norm') + AttnProcessor2_0",
          lambda: diffusers_attention("AttnProcessor2_0", qk_norm="layer_norm")),
]
DIFFUSERS_BUGS = [
    Bug(DIFFUSERS_PLAIN, "scale dropped (attn.scale = 1)", setting(scale=1.0), ("softmax_saturation",)),
    Bug(DIFFUSERS_PLAIN, "softmax over the queries (get_attention_scores)",
        retype(diffusers_subclass("get_attention_scores")), ("weight_row_sums",)),
    Bug(DIFFUSERS_PLAIN, "heads merged without permute (batch_to_head_dim)",
        retype(diffusers_subclass("batch_to_head_dim")), ("output_variance", "query_locality", "mask_honoured")),
    Bug(DIFFUSERS_SDPA, "scale dropped (q multiplied by sqrt(d_k) at norm_q)", setting(norm_q=Scale(math.sqrt(d_k))),
        ("softmax_saturation",)),
    Bug(DIFFUSERS_SDPA, "heads merged without transpose", before("to_out.0", MergeWithoutTranspose),
        ("output_variance", "query_locality", "mask_honoured")),
]

LIBRARIES = {  # distribution: (its correct layers, its injected bugs)
    XT: (XT_LAYERS, XT_BUGS),
    VIT: (VIT_LAYERS, VIT_BUGS),
    WHISPER: (WHISPER_LAYERS, WHISPER_BUGS),
    OPEN_CLIP: (OPEN_CLIP_LAYERS, OPEN_CLIP_BUGS),
    DIFFUSERS: (DIFFUSERS_LAYERS, DIFFUSERS_BUGS),
}


# ---- the checks: one test function, so that a library not installed is one skip -----------------------------


@functools.cache
def _first_audit(case: Layer):
    return case.audit()


@functools.cache
def _audit(case: Layer, declared: tuple):
    return case.audit(**dict(declared))


def names_its_declaration(case: Layer):
    report = _first_audit(case)
    named, expected = declarations_named(report), _as_named(case.declare)
    assert named == expected, f"the report names {named or 'nothing'}, not {expected or 'nothing'}\n{report}"


def passes_with_it(case: Layer):
    report = _audit(case, tuple(case.declare.items())) if case.declare else _first_audit(case)
    assert_passes(report, causal=case.causal)


def caught(bug: Bug):
    declared = tuple(bug.declare.items())
    twin = _audit(bug.twin, declared)
    torch.manual_seed(0)
    report = bug.twin.audit(bug.inject(bug.twin.module()), **bug.declare)
    by = [d for d in bug.caught_by if report.result(d).verdict == "fail" and twin.result(d).verdict != "fail"]
    assert not report.passed and by, (f"expected one of {bug.caught_by} to fail on the bug and not on its twin; "
                                      f"the bug: {report.fired()}, the twin: {twin.fired()}\n{report}")


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _xfail(reason: str | None):
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _checks():
    for distribution, (layers, bugs) in LIBRARIES.items():
        if _installed(distribution) is None:
            yield pytest.param(None, None, id=distribution, marks=pytest.mark.skip(
                reason=f"{distribution} is not installed (the zoo extra): {INSTALL}"))
            continue
        for case in layers:
            yield pytest.param(names_its_declaration, case, id=f"{distribution}/{case.name}/names its declaration",
                               marks=_xfail(case.names_gap))
            yield pytest.param(passes_with_it, case, id=f"{distribution}/{case.name}/passes with it",
                               marks=_xfail(case.passes_gap))
        for bug in bugs:
            yield pytest.param(caught, bug, id=f"{distribution}/{bug.twin.name}/bug: {bug.name}", marks=_xfail(bug.gap))


@pytest.mark.parametrize(("check", "case"), list(_checks()))
def test_zoo(check, case):
    check(case)


def test_every_library_has_two_bugs_and_its_layers_are_distinct():
    for distribution, (layers, bugs) in LIBRARIES.items():
        assert len(bugs) >= 2, distribution
        assert len({case.name for case in layers}) == len(layers), distribution
        assert all(case.library == distribution for case in layers + [bug.twin for bug in bugs]), distribution
