"""Layers written unlike ours, in the styles of the repositories people learn from: upper-case `forward(Q, K, V)`,
`forward(x, y=None)` that wants its stream twice for self-attention, an optional `context=None`, a forward under
`torch.utils.checkpoint(use_reentrant=True)`, a forward patched on the instance, FlexAttention on the CPU, a mask of
another shape, torch's `is_causal` flag applied only when no mask is given. Each correct layer audits clean as a
user first audits it (or with the one declaration its report names first); each broken twin, the same code with one
bug, audited the same way on the same seed, still fails on the detector its bug breaks.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from diagnostics import AuditUsageError, audit

D, H = 32, 4  # d_model, heads
CORE = ("runs", "output_shape", "finite_output", "softmax_saturation", "output_variance", "eval_determinism")


def assert_clean(report, *, measured=()):
    __tracebackhide__ = True
    assert report.passed, str(report)
    assert set(report.fired()) <= {"fully_masked_rows"}, str(report)  # NaN rows of a -inf mask: a warning by design
    not_passed = {d: report.result(d).verdict for d in measured if report.result(d).verdict != "pass"}
    assert not not_passed, f"expected these detectors to measure and pass: {not_passed}\n{report}"


def audited(make, **kw):
    torch.manual_seed(0)
    return audit(make(), **kw)


def split(t: Tensor, heads: int) -> Tensor:
    B, T, C = t.shape  # batch, sequence length, d_model
    return t.view(B, T, heads, C // heads).transpose(1, 2)  # (B, H, T, d)


def merge(t: Tensor) -> Tensor:
    B, h, T, d = t.shape  # batch, heads, sequence length, head width
    return t.transpose(1, 2).reshape(B, T, h * d)  # (B, T, D)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float | None = None) -> Tensor:
    scores = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


class SelfAttention(nn.Module):
    """One fused qkv projection; `attention(x, mask)` is the step each style below wraps differently."""

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.d_model, self.n_heads = d_model, n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def attention(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(attend(q, k, v, mask)))

    def forward(self, x, mask=None):
        return self.attention(x, mask)


# ---- cause 4: the audit's own machinery ---------------------------------------------------------------------


class DetachedSoftmax(SelfAttention):
    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        w = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1).detach()  # BUG: no gradient to q, k
        return self.proj(merge(w @ v))


class Checkpointed(SelfAttention):
    """Activation checkpointing the old way (reentrant), which takes .backward() only."""

    def forward(self, x):
        return checkpoint(self.attention, x, use_reentrant=True)


class CheckpointedDetached(Checkpointed, DetachedSoftmax):
    pass


def test_a_reentrant_checkpoint_is_differentiated_through_backward():
    assert_clean(audited(Checkpointed), measured=CORE + ("gradients", "parameters_used"))
    assert audited(CheckpointedDetached).result("gradients").verdict == "fail"


class Unused(SelfAttention):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, D)  # BUG: built, never called


def patched(cls):
    """A forward patched on the instance, a closure over the original bound method (profilers, adapters, LoRA-style
    wrappers do this): deepcopy hands functions out as they are."""
    def make():
        layer = cls()
        original = layer.forward

        def forward(x, mask=None):
            return original(x, mask)

        layer.forward = forward
        return layer
    return make


def test_a_forward_patched_on_the_instance_runs_on_the_float64_copy():
    assert_clean(audited(patched(SelfAttention)), measured=CORE + ("gradients", "parameters_used"))
    unused = audited(patched(Unused)).result("parameters_used")
    assert unused.verdict == "fail" and "gate.weight" in unused.evidence, unused


def test_the_patched_copy_leaves_the_users_layer_alone():
    torch.manual_seed(0)
    layer = patched(SelfAttention)()
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    audit(layer, detectors=["gradients", "parameters_used"])
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in layer.named_parameters())
    assert layer.forward.__closure__[0].cell_contents.__self__ is layer  # the patch still calls the user's layer


def _swap_halves(t: Tensor) -> Tensor:
    return torch.cat(t.chunk(2, -1)[::-1], -1)


class StaticHelper(SelfAttention):
    """A helper kept on the instance as a `staticmethod` object (rotary-embedding-torch 0.8's
    `self.apply_rotary_emb = staticmethod(apply_rotary_emb)`), which deepcopy cannot copy; `unused`: the twin's
    bug, a gate built and never called."""

    def __init__(self, unused=False):
        super().__init__()
        self.mix = staticmethod(_swap_halves)
        self.gate = nn.Linear(D, D) if unused else None

    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(attend(q, k, self.mix.__func__(v), mask)))  # the value features swapped: a linear map


def test_a_staticmethod_kept_on_the_instance_is_shared_with_the_float64_copy():
    """Before, "no float64 copy of the layer could be made (TypeError: cannot pickle 'staticmethod' object)": both
    gradient checks not measured. The twin's unused gate is caught on the same seed."""
    assert_clean(audited(StaticHelper), measured=CORE + ("gradients", "parameters_used"))
    unused = audited(lambda: StaticHelper(unused=True)).result("parameters_used")
    assert unused.verdict == "fail" and "gate.weight" in unused.evidence, unused


class StaticOverSelf(SelfAttention):
    """A staticmethod kept on the instance that closes over the layer's own parameter (`staticmethod(lambda y: y *
    self.gain)`) or holds it in a partial: on the float64 copy it must read the copy's parameter, or `gain` gets no
    gradient there and `parameters_used` calls it unused (a false FAIL a first fix made, sharing the wrapper)."""

    def __init__(self, how="closure"):
        super().__init__()
        self.gain = nn.Parameter(torch.full((D,), 1.5))
        self.post = staticmethod(lambda y: y * self.gain) if how == "closure" else \
            staticmethod(functools.partial(torch.mul, other=self.gain))

    def forward(self, x, mask=None):
        return self.post(self.attention(x, mask))


@pytest.mark.parametrize("how", ["closure", "partial"])
def test_a_staticmethod_over_the_layers_own_parameter_reads_the_copys(how):
    assert_clean(audited(lambda: StaticOverSelf(how)), measured=CORE + ("gradients", "parameters_used"))


@pytest.mark.parametrize("make", [StaticHelper, lambda: StaticOverSelf("closure")], ids=["plain", "over its own"])
def test_the_staticmethod_copies_measure_and_catch_in_bfloat16_at_std_0_02(make, std_002):
    """The same in bfloat16 at GPT-2's initialisation: both gradient checks measure the correct layer and pass it, and
    the unused gate of the plain one's twin is caught."""
    def built(layer):
        return audit(std_002(layer).to(torch.bfloat16), dtype=torch.bfloat16, progress=False)

    torch.manual_seed(0)
    found = built(make())
    assert {d: found.result(d).verdict for d in ("gradients", "parameters_used")} == \
        {"gradients": "pass", "parameters_used": "pass"}, str(found)
    torch.manual_seed(0)
    unused = built(StaticHelper(unused=True)).result("parameters_used")
    assert unused.verdict == "fail" and "gate.weight" in unused.evidence, unused


flex = pytest.importorskip("torch.nn.attention.flex_attention")


class Flex(SelfAttention):
    """FlexAttention, uncompiled, on the CPU: it raises on a call that records autograd ("does not support
    backward on CPU") when its parameters require grad."""

    scale = None

    def forward(self, x):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(flex.flex_attention(q, k, v, scale=self.scale)))


class FlexUnscaled(Flex):
    scale = 1.0  # BUG: no 1/sqrt(d_k)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_on_the_cpu_is_observed_without_autograd():
    assert_clean(audited(Flex), measured=CORE)
    assert "softmax_saturation" in audited(FlexUnscaled).fired()


def cpu_kernel(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """An attention kernel with no backward on this device, refusing as FlexAttention does on the CPU (which the
    audit's observer only reaches where flex_attention was imported before the audit began: imported inside the
    layer's first forward, it raised exactly so)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("this kernel does not support backward on CPU. Please set the input requires_grad "
                                  "to False or use another device.")
    return attend(q, k, v, None, scale=scale)


class NoBackwardKernel(SelfAttention):
    scale = None

    def forward(self, x):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(cpu_kernel(q, k, v, self.scale)))


class NoBackwardKernelUnscaled(NoBackwardKernel):
    scale = 1.0  # BUG: no 1/sqrt(d_k)


def test_a_kernel_without_a_backward_here_runs_the_probes_that_need_no_gradient():
    report = audited(NoBackwardKernel)
    assert_clean(report, measured=CORE)
    assert report.result("gradients").verdict == "skip" and "NotImplementedError" in report.result("gradients").message
    assert "softmax_saturation" in audited(NoBackwardKernelUnscaled).fired()


# ---- cause 5: calling conventions ---------------------------------------------------------------------------


class UpperCase(nn.Module):
    """The Annotated Transformer / d2l style: forward(Q, K, V, mask=None), projections W_Q, W_K, W_V, W_O."""

    scale = None

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.d_model, self.n_heads = d_model, n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, Q, K, V, Mask=None):
        q, k, v = (split(W(t), self.n_heads) for W, t in ((self.W_Q, Q), (self.W_K, K), (self.W_V, V)))
        return self.W_O(merge(attend(q, k, v, Mask, scale=self.scale)))


class UpperCaseUnscaled(UpperCase):
    scale = 1.0  # BUG: no 1/sqrt(d_k)


def test_upper_case_parameters_are_read_as_query_key_value_and_mask():
    report = audited(UpperCase)
    assert report.settings["form"] == "qkv_module" and report.settings["takes_mask"], report.settings
    assert_clean(report, measured=CORE + ("mask_honoured", "keys_matter", "query_locality"))
    assert "softmax_saturation" in audited(UpperCaseUnscaled).fired()


class SecondStream(nn.Module):
    """forward(x, y): "for self attention, x=y"; queries from x, keys and values from y."""

    scale = None

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.d_model, self.n_heads = d_model, n_heads
        self.q, self.kv, self.o = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, y, mask=None):
        q = split(self.q(x), self.n_heads)
        k, v = (split(t, self.n_heads) for t in self.kv(y).chunk(2, -1))
        return self.o(merge(attend(q, k, v, mask, scale=self.scale)))


class SecondStreamUnscaled(SecondStream):
    scale = 1.0  # BUG


def test_a_required_second_stream_is_offered_the_self_attention_call_first():
    first = audited(SecondStream)
    fix = first.result("runs").fix
    self_call, cross_call = "call=lambda layer, x, mask: layer(x, y=x, mask=mask)", "layer(x, y=memory, mask=mask)"
    assert first.status == "inconclusive" and first.declaration == self_call
    assert self_call in fix and cross_call in fix and fix.index(self_call) < fix.index(cross_call)
    declared = lambda layer, x, mask: layer(x, y=x, mask=mask)  # noqa: E731 -- the call the message names first
    assert_clean(audited(SecondStream, call=declared, causal=True), measured=CORE + ("mask_honoured", "future_leakage"))
    assert "softmax_saturation" in audited(SecondStreamUnscaled, call=declared, causal=True).fired()


class OptionalContext(SecondStream):
    """forward(x, context=None): self-attention without a context, cross-attention with one (Stable Diffusion's
    CrossAttention style)."""

    def forward(self, x, context=None, mask=None):
        return super().forward(x, x if context is None else context, mask)


class ContextIgnored(OptionalContext):
    def forward(self, x, context=None, mask=None):
        return SecondStream.forward(self, x, x, mask)  # BUG: the context never reaches the keys


def test_cross_true_feeds_an_optional_context():
    report = audited(OptionalContext, cross=True)
    assert report.settings["form"] == "cross_module", report.settings
    assert_clean(report, measured=CORE + ("mask_honoured", "keys_matter", "query_locality"))
    assert {"keys_matter"} <= set(audited(ContextIgnored, cross=True).fired())
    assert audited(OptionalContext).settings["form"] == "self_module"  # undeclared: self-attention, as before


class FlagWhenUnmasked(SelfAttention):
    """torch's contract, "attn_mask or is_causal": `is_causal=True` applied only when no mask is given, a mask given
    instead carrying the causality itself."""

    is_causal = True

    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(merge(y))


class FlagIgnored(FlagWhenUnmasked):
    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))  # BUG: is_causal unread


class CausalReplacedByPadding(FlagWhenUnmasked):
    """The same code under a `causal` flag, which says the layer builds its causal mask whatever it is given: a
    padding mask then replaces it (the catalog's padding_mask_replaces_causal)."""

    is_causal, causal = False, True

    def attention(self, x, mask=None):
        self.is_causal = self.causal
        try:
            return super().attention(x, mask)
        finally:
            self.is_causal = False


def test_an_is_causal_flag_applied_only_without_a_mask_gets_causal_masks():
    assert_clean(audited(FlagWhenUnmasked, causal=True), measured=CORE + ("mask_honoured", "future_leakage"))
    assert "future_leakage" in audited(FlagIgnored, causal=True).fired()  # the flag itself is still tested
    assert "future_leakage" in audited(CausalReplacedByPadding, causal=True).fired()


# ---- cause 8: a convention mismatch is not a defect ------------------------------------------------------------


class KeepPerKey(SelfAttention):
    """A (B, T) padding mask, True = keep, in a parameter named plainly `mask` and documented nowhere: the audit's
    (B, 1, Tq, Tk) mask makes it raise."""

    scale = None

    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        keep = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, Tk)
        return self.proj(merge(attend(q, k, v, keep, scale=self.scale)))


class KeepPerKeyUnscaled(KeepPerKey):
    scale = 1.0  # BUG: no 1/sqrt(d_k)


def test_a_mask_of_another_shape_needs_a_declaration_and_is_never_failed(tmp_path):
    report = audited(KeepPerKey)
    runs = report.result("runs")
    assert report.status == "inconclusive" and report.declaration == "mask='key_keep'", str(report)
    assert runs.verdict == "skip" and runs.message.startswith("needs a declaration, mask='key_keep'"), runs
    assert "INCONCLUSIVE (needs a declaration: mask='key_keep')" in str(report).splitlines()[0]
    assert report.to_dict()["needs_declaration"] == "mask='key_keep'"
    report.to_html(tmp_path / "report.html")
    assert "Needs a declaration: audit with <code>mask=&#x27;key_keep&#x27;</code>" in (tmp_path / "report.html").read_text()
    assert_clean(audited(KeepPerKey, mask="key_keep"), measured=CORE + ("mask_honoured",))  # the one it names
    # the same undeclared mask on a layer with a bug: the bug fails the audit, the mask does not
    buggy = audited(KeepPerKeyUnscaled)
    assert buggy.status == "failed" and "softmax_saturation" in buggy.fired() and "runs" not in buggy.fired()
    assert "needs a declaration: audit with mask='key_keep'" in buggy.status_reason  # still named, after the failure


def test_a_layer_that_raises_on_every_mask_still_fails_runs():
    class Broken(KeepPerKey):
        def attention(self, x, mask=None):
            if mask is not None:
                raise RuntimeError("masks are not supported yet")  # no convention makes it run
            return super().attention(x)

    report = audited(Broken)
    assert report.status == "failed" and report.result("runs").verdict == "fail" and not report.declaration
    assert report.status == audited(Broken, mask="key_keep").status  # declaring a convention does not hide it


def test_an_exception_is_quoted_to_the_end_of_a_sentence():
    from diagnostics._frames import exception_text

    shapes = ("The size of tensor a (16) must match the size of tensor b (2) at non-singleton dimension 3. "
              "Check the shapes of the mask passed to the layer against the scores, which are (B, H, Tq, Tk) here")
    assert exception_text(RuntimeError(shapes)) == ("RuntimeError: The size of tensor a (16) must match the size of "
                                                    "tensor b (2) at non-singleton dimension 3.")
    assert exception_text(RuntimeError("word " * 60)).endswith("word word ...")


# ---- cause 7: a convention hint is never one under which the observed behaviour is the bug -----------------------


class AddsBoolMask(SelfAttention):
    """Annotated bool, turned into 0./1. floats and added to the scores: True shifts the allowed logits by 1 and
    blocks nothing (the bug); declared additive, it would pass."""

    def attention(self, x, mask: torch.BoolTensor | None = None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores + mask.float()  # BUG: 0./1. added, nothing blocked
        return self.proj(merge(scores.softmax(-1) @ v))

    def forward(self, x, mask: torch.BoolTensor | None = None):
        return self.attention(x, mask)


class BlocksBoolMask(AddsBoolMask):
    def forward(self, x, mask: torch.BoolTensor | None = None):
        return SelfAttention.attention(self, x, mask)  # masked_fill(~mask, -inf): the fix


def test_a_bool_annotated_mask_that_is_added_is_never_told_to_declare_additive():
    finding = audited(AddsBoolMask).result("mask_honoured")
    assert finding.verdict == "fail" and "audit with mask='additive'" not in finding.fix, finding.fix
    assert "is annotated" in finding.fix and "masked_fill(~mask" in finding.fix, finding.fix
    assert_clean(audited(BlocksBoolMask), measured=CORE + ("mask_honoured",))


class MaskAsKeyBias(SelfAttention):
    """Reads its mask as one row per key and adds it: broken for the audit's mask in every convention (bool added,
    additive rows read as keys), and at T = 1 the (B, 1, 1, 1) mask broadcasts, so only T > 1 raises."""

    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores + mask.reshape(mask.shape[0], 1, 1, -1).float() * 0  # BUG: the mask blocks nothing
        return self.proj(merge(scores.softmax(-1) @ v))


def test_a_mask_that_raises_only_past_one_token_is_not_called_a_maximum_length():
    """The layer raises on the audit's (B, 1, Tq, Tk) mask and runs given one row per key: a convention mismatch,
    named as the declaration (it honours none, so that is no verdict: tests/test_unhonoured_conventions.py), never a
    maximum length (the standard probe ran at this length). Declared, the mask it ignores fails mask_honoured."""
    report = audited(MaskAsKeyBias)
    runs = report.result("runs")
    assert runs.verdict == "skip" and report.declaration == "mask='key_keep'", str(report)
    assert "maximum length" not in runs.message + runs.fix, runs
    assert audited(MaskAsKeyBias, mask="key_keep").result("mask_honoured").verdict == "fail"
    assert "maximum length" in audited(LengthLimited).result("runs").remedy[0]  # its twin: a real limit


class LengthLimited(SelfAttention):
    """A buffer of fixed size (4 positions) the scores are added to: a real maximum length, below the probe's 16."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rel", torch.zeros(4, 4))

    def attention(self, x, mask=None):
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        T = x.shape[1]  # sequence length
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.rel[:T, :T]  # (B, H, T, T) + (<=4, <=4)
        return self.proj(merge(scores.softmax(-1) @ v))


# ---- cause 6: a docstring about the layer's insides, read as its input convention ------------------------------


class DocumentsItsBias(KeepPerKey):
    def attention(self, x, mask=None):
        """Self-attention.

        Args:
            x: (B, T, D) tokens.
            mask: the additive mask (0 / -inf) expanded to (B, H, T, T) and added to the scores.
        """
        q, k, v = (split(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(attend(q, k, v, mask, scale=self.scale)))  # takes bool (B, 1, Tq, Tk): masked_fill

    forward = attention


class DocumentsItsBiasUnscaled(DocumentsItsBias):
    scale = 1.0  # BUG


def test_a_docstring_about_the_internal_bias_is_a_declaration_away_never_a_failure():
    report = audited(DocumentsItsBias)
    assert "mask: additive (its docstring says" in report.layer  # what it read, and said so
    assert report.status == "inconclusive" and report.declaration == "mask='allowed'", str(report)
    assert_clean(audited(DocumentsItsBias, mask="allowed"), measured=CORE + ("mask_honoured",))
    buggy = audited(DocumentsItsBiasUnscaled)
    assert buggy.status == "failed" and set(buggy.fired()) == {"softmax_saturation"}, str(buggy)


# ---- cause 1: a transform after the weighted sum of the values is not broken attention --------------------------


class LuongAttention(nn.Module):
    """pytorch-seq2seq's `Attention` (Luong et al. 2015, "global attention", dot score): forward(output, context),
    the weights softmaxed as a (B * Tq, Tk) view, mix = attn @ context, output = tanh(W [mix; output])."""

    dim = 1  # the keys of each (batch, query) row

    def __init__(self, dim=D):
        super().__init__()
        self.linear_out = nn.Linear(dim * 2, dim)

    def forward(self, output, context):
        batch_size, hidden_size, input_size = output.size(0), output.size(2), context.size(1)
        attn = torch.bmm(output, context.transpose(1, 2)) / math.sqrt(hidden_size)  # (B, Tq, Tk)
        attn = F.softmax(attn.view(-1, input_size), dim=self.dim).view(batch_size, -1, input_size)
        mix = torch.bmm(attn, context)  # (B, Tq, D)
        combined = torch.cat((mix, output), dim=2)  # (B, Tq, 2D)
        return torch.tanh(self.linear_out(combined.view(-1, 2 * hidden_size))).view(batch_size, -1, hidden_size)


class LuongOverTheQueries(LuongAttention):
    dim = 0  # BUG: each key's weights over every (batch, query) row


class GatedCrossAttention(nn.Module):
    """Cross-attention whose output is gated by its own query, elementwise after SDPA (the "G1" gate of Qiu et al.
    2025, Qwen3-Next's gated attention): y = sdpa(q, k, v) * sigmoid(W_g x)."""

    dropout_p = 0.0

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.n_heads = n_heads
        self.to_q, self.to_kv = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model)
        self.gate, self.to_out = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x, context, mask=None):
        q = split(self.to_q(x), self.n_heads)
        k, v = (split(t, self.n_heads) for t in self.to_kv(context).chunk(2, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p)  # (B, H, Tq, d)
        return self.to_out(merge(y) * torch.sigmoid(self.gate(x)))


class GatedDropoutInEval(GatedCrossAttention):
    dropout_p = 0.1  # BUG: SDPA's dropout is not switched off by .eval(); pass dropout_p only when training


class GatedValuesFromQuery(GatedCrossAttention):
    def forward(self, x, context, mask=None):
        q = split(self.to_q(x), self.n_heads)
        k, _ = (split(t, self.n_heads) for t in self.to_kv(context).chunk(2, -1))
        _, v = (split(t, self.n_heads) for t in self.to_kv(x).chunk(2, -1))  # BUG: values from the query stream
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, Tq, d)
        return self.to_out(merge(y) * torch.sigmoid(self.gate(x)))


class LePEAttention(nn.Module):
    """CSWin Transformer's locally-enhanced positional encoding: a depthwise convolution of the values over the
    positions, added beside the attention (no mask: a vision layer)."""

    def __init__(self, d_model=D, n_heads=H):
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.get_v = nn.Conv1d(d_model, d_model, kernel_size=3, padding=1, groups=d_model)

    def merge(self, y):
        return merge(y)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)  # 3 x (B, T, D)
        lepe = self.get_v(v.transpose(1, 2)).transpose(1, 2)  # (B, T, D): each value's neighbours
        y = self.merge(attend(split(q, self.n_heads), split(k, self.n_heads), split(v, self.n_heads), None))
        return self.proj(y + lepe)


class LePEHeadsMerged(LePEAttention):
    def merge(self, y):
        B, h, T, d = y.shape  # batch, heads, sequence length, head width
        return y.reshape(B, T, h * d)  # BUG: heads and positions interleaved (no transpose first)


def rotate(x: Tensor, sign: float = 1.0) -> Tensor:
    """Rotary embedding of (B, H, T, d) by each position (sign -1: rotated back), pairs (0, 1), (2, 3), ..."""
    T, d = x.shape[-2], x.shape[-1]  # sequence length, head width
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))  # (d/2,)
    angle = sign * torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv_freq  # (T, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, H, T, d/2) each
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)  # (B, H, T, d)


class RoPERAttention(SelfAttention):
    """RoPER (rotary on the values too, the output rotated back by its query's position): relative positions reach
    the values, and identical tokens come out differing by design."""

    dim = -1  # the keys

    def attention(self, x, mask=None):
        q, k, v = (rotate(split(t, self.n_heads)) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.proj(merge(rotate(scores.softmax(self.dim) @ v, -1.0)))


class RoPERWrongAxis(RoPERAttention):
    dim = -2  # BUG: normalised over the queries


POST_ATTENTION = {  # correct layer, its one-bug twin, how a user audits both
    "luong": (LuongAttention, LuongOverTheQueries, dict(cross=True, d_model=D)),
    "gated": (GatedCrossAttention, GatedDropoutInEval, dict(cross=True)),
    "lepe": (LePEAttention, LePEHeadsMerged, {}),
    "roper": (RoPERAttention, RoPERWrongAxis, {}),
}


@pytest.mark.parametrize("name", sorted(POST_ATTENTION))
def test_a_transform_after_the_weighted_sum_is_judged_on_the_weighted_sum(name):
    correct, buggy, kw = POST_ATTENTION[name]
    variance = audited(correct, **kw).result("output_variance")
    assert variance.verdict == "pass", f"{variance.message}\n{variance.evidence}"
    if buggy is not None:
        failed = audited(buggy, **kw).result("output_variance")
        assert failed.verdict == "fail", f"{failed.message}\n{failed.evidence}"


@pytest.mark.parametrize("name", sorted(POST_ATTENTION))
def test_a_correct_layer_with_a_transform_after_its_weighted_sum_audits_clean(name):
    """Every one of them measured (Luong's weights are softmaxed as a (B * Tq, Tk) view and read back as (B, Tq, Tk)
    by the product: seen as weights, not missed)."""
    correct, _, kw = POST_ATTENTION[name]
    report = audited(correct, **kw)
    assert_clean(report, measured=CORE + ("weight_row_sums",))
    assert "judged" in report.result("output_variance").message


def test_heads_merged_into_the_positions_are_named_with_the_transpose_and_a_convolution_is_not():
    """The transpose fix only where the evidence shows a merge that moved heads into the positions (the reshape of
    the (B, H, T, d) product); the correct layer's convolution is never called a merge of heads."""
    failed = audited(LePEHeadsMerged).result("output_variance")
    assert failed.where and "mixes positions with another axis" in failed.where[0].note, failed.where
    assert "transpose(1, 2)" in failed.where[0].fix and "reshape(B, T, h * d)" in failed.where[0].code
    passed = audited(LePEAttention).result("output_variance")
    assert "heads" not in passed.message and "transpose" not in passed.evidence, passed.evidence


def test_a_weighted_sum_of_values_from_another_stream_is_not_judged_inside():
    """The weighted sum passes for the output only where it weights the value input: the same gated layer with its
    values read from the query stream is a convex combination of the wrong vectors, and its output's fail stands."""
    failed = audited(GatedValuesFromQuery, cross=True).result("output_variance")
    assert failed.verdict == "fail" and "judged" not in failed.message, failed
    assert audited(GatedCrossAttention, cross=True).result("output_variance").verdict == "pass"


class LePEHeadsReshapedFirst(LePEAttention):
    def merge(self, y):
        B, h, T, d = y.shape  # batch, heads, sequence length, head width
        return y.reshape(B, T, h, d).flatten(2)  # BUG: (B, H, T, d) read as (B, T, H, d), as an attention function returns


def test_pin_a_reshape_that_keeps_the_rank_can_move_heads_into_the_positions():
    """`positions_mixed` reads any view or reshape that changes the shape, not only one that merges axes (Hugging
    Face's attention functions return (B, T, H, d): the bug is a 4-d reshape; test_model_audit's ViT cells)."""
    failed = audited(LePEHeadsReshapedFirst).result("output_variance")
    assert failed.verdict == "fail" and "mixes positions with another axis" in failed.where[0].note, failed
