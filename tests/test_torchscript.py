"""TorchScript modules audited as they are (issue 34 "Code nobody here wrote"; standards: an audit never crashes).

A scripted layer (`torch.jit.script`, or one `torch.jit.load` gives back) holds its parameters in the compiled object:
its registries cannot take an entry or lose one, and it has no Python attributes of its own. The audit crashed on every
such layer at its end (the state guard iterated a TorchScript registry, which reads its keys as integers: TypeError),
and on every model holding one. A scripted layer's deepcopy (the float64 copy the gradient checks run on) keeps no
Python signature, only its compiled schema, and its parameters come out as clones still in the graph of the user's, so
the copy's own `.grad` stayed unset: `gradients` read every parameter's gradient as 0 and failed a correct layer
inside a wrapper. Now the guard leaves a TorchScript module's registries alone and puts its values back, the copy's
parameters are leaves of their own, and the signature is read from the schema where Python has none. Twins on the
same inputs: the scripted layer without its 1/sqrt(d_k), or with its mask ignored, fails.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Optional

import pytest
import torch
from torch import Tensor, nn

import diagnostics

D, HEADS = 32, 4


class ScriptableAttention(nn.Module):
    """Multi-head self-attention written to compile with torch.jit.script: a bool mask (B, Tq, Tk), True = may attend.
    `bug`: "unscaled" (no 1/sqrt(d_k)) or "mask ignored"."""

    def __init__(self, bug: str = ""):
        super().__init__()
        self.d_model, self.num_heads, self.bug = D, HEADS, bug
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        B, T, width = x.shape
        d_k = width // self.num_heads
        qkv = self.qkv(x).view(B, T, 3, self.num_heads, d_k).permute(2, 0, 3, 1, 4)  # (3, B, H, T, d_k)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
        if self.bug != "unscaled":
            scores = scores / math.sqrt(d_k)
        if mask is not None and self.bug != "mask ignored":
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = scores.softmax(-1) @ v  # (B, H, T, d_k)
        return self.out(out.transpose(1, 2).reshape(B, T, width))


class Holder(nn.Module):
    """A Python module that holds a compiled layer and calls it: how a scripted block usually sits in a model."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.d_model, self.num_heads = inner, D, HEADS

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self.inner(x, mask)


def scripted(bug: str = "") -> torch.jit.ScriptModule:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice, where this torch gives one
        return torch.jit.script(ScriptableAttention(bug))


def loaded(bug: str = "") -> torch.jit.ScriptModule:
    """The scripted layer saved and loaded back: no Python signature at all, only the compiled schema."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.save's and load's deprecation notices
        torch.jit.save(scripted(bug), buffer)
        buffer.seek(0)
        return torch.jit.load(buffer)


MASK = "allowed:B,Tq,Tk"  # the layer's own convention, which its report names (the audit's default is (B, 1, Tq, Tk))
FORMS = {"scripted": scripted, "loaded": loaded, "scripted, held by a module": lambda bug="": Holder(scripted(bug))}


@pytest.mark.parametrize("form", list(FORMS))
def test_a_torchscript_layer_is_audited_and_its_bugs_fail_on_the_same_inputs(form):
    right = diagnostics.audit(FORMS[form](), d_model=D, num_heads=HEADS, mask=MASK)
    assert right.status == "passed", str(right)
    for name in ("softmax_saturation", "mask_honoured", "gradients", "parameters_used"):
        assert right.result(name).verdict == "pass", right.result(name)
    unscaled = diagnostics.audit(FORMS[form]("unscaled"), d_model=D, num_heads=HEADS, mask=MASK)
    assert unscaled.result("softmax_saturation").verdict == "fail", unscaled.result("softmax_saturation")
    ignored = diagnostics.audit(FORMS[form]("mask ignored"), d_model=D, num_heads=HEADS, mask=MASK)
    assert ignored.result("mask_honoured").verdict == "fail", ignored.result("mask_honoured")


@pytest.mark.parametrize("held", [False, True], ids=["alone", "held"])
def test_the_audit_leaves_a_torchscript_layer_as_it_came(held):
    """Values, gradients (none, or the one set before), training flag and the RNG as they were: the copy's backward no
    longer reaches the user's parameters through the clones its deepcopy made."""
    layer = scripted()
    layer.train()
    first = next(layer.parameters())
    first.grad = torch.full_like(first, 7.0)  # a gradient the user had: kept as it was
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    rng = torch.random.get_rng_state()
    diagnostics.audit(Holder(layer) if held else layer, d_model=D, num_heads=HEADS, mask=MASK)
    assert layer.training
    assert torch.equal(torch.random.get_rng_state(), rng)
    for name, p in layer.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert (p.grad is None) == (p is not first), name
    assert torch.equal(first.grad, torch.full_like(first, 7.0))


class Traceable(nn.Module):
    """A causal self-attention as torch.jit.trace records it: its causal mask sliced from a buffer, and a buffer that
    counts its calls. `bug`: "no causal mask"."""

    def __init__(self, bug: str = ""):
        super().__init__()
        self.d_model, self.num_heads, self.bug = D, HEADS, bug
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("lower", torch.ones(64, 64, dtype=torch.bool).tril())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        B, T, width = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // HEADS)
        if self.bug != "no causal mask":
            scores = scores.masked_fill(~self.lower[:T, :T], float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, width))


def test_a_traced_layer_is_audited_on_its_first_calls_and_its_leaking_twin_fails():
    """TorchScript's profiling executor runs a traced graph's first calls through a profiling graph that raised under
    the audit's observers (aten::equal given an int): the correct layer failed `runs` on the very shape it was traced
    at. The audit runs compiled layers with the simple executor (`_guard.script_executor`); its buffers are put back."""
    reports = {}
    for bug in ("", "no causal mask"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(Traceable(bug), (torch.randn(2, 16, D),))
        calls = int(traced.calls)
        reports[bug] = diagnostics.audit(traced, d_model=D, num_heads=HEADS, causal=True)
        assert int(traced.calls) == calls  # the call counter as it came
    assert reports[""].status == "passed", str(reports[""])
    assert reports["no causal mask"].result("future_leakage").verdict == "fail", str(reports["no causal mask"])


class Model(nn.Module):
    """Tokens, an attention layer (Python, or compiled) with a residual, a feed-forward block (compiled, or Python),
    a head."""

    def __init__(self, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.embed, self.attn, self.ff, self.head = nn.Embedding(50, D), attention, feed_forward, nn.Linear(D, 50)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        x = x + self.attn(x)
        return self.head(x + self.ff(x))


def feed_forward() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))


def test_a_model_audit_finds_and_judges_its_python_attention_beside_a_compiled_block():
    """A compiled feed-forward block took no hooks, and the first refusal ended the model audit's observation (its
    attention then found by class only: none, inconclusive) and left the hooks already made on the user's model. Now
    compiled modules are left out of the observation and named in a note; the Python attention is found and judged:
    the correct one passes, its twin without 1/sqrt(d_k) fails, on the same example."""
    example = torch.randint(0, 50, (2, 8))
    reports = {}
    for bug in ("", "unscaled"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = Model(ScriptableAttention(bug), torch.jit.script(feed_forward()))
        reports[bug] = diagnostics.audit_model(model, example=example)
        assert [f.path for f in reports[bug].found] == ["attn"] and list(reports[bug].layers) == ["attn"], str(reports[bug])
        assert "ff: compiled (TorchScript)" in str(reports[bug]), str(reports[bug])
        assert not [m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks]
    assert reports[""].status == "passed", str(reports[""])
    assert reports["unscaled"].status == "failed", str(reports["unscaled"])
    assert reports["unscaled"].layers["attn"].result("softmax_saturation").verdict == "fail", str(reports["unscaled"])


def test_a_compiled_attention_inside_a_model_is_named_for_a_layer_audit():
    """Its ops count for the model around it (no hooks), which is no reason to call the whole model one attention
    layer: inconclusive, the note naming the layer audit to run; the model-level checks still run."""
    for bug in ("", "unscaled"):  # the bug unjudged too: inconclusive, never passed
        torch.manual_seed(0)
        report = diagnostics.audit_model(Model(scripted(bug), feed_forward()), example=torch.randint(0, 50, (2, 8)))
        assert report.status == "inconclusive", str(report)
        assert report.result("model_runs").verdict == "pass", str(report)
        assert "diagnostics.audit(model.attn)" in str(report), str(report)
