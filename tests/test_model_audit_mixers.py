"""A leak through a mixer that is not attention (issue 33, cause 6): packed documents do leak through a state-space
scan, linear attention or a convolution over the sequence that does not restart at a document's start (MiniMax's
lightning attention, Inkling's short convolutions on its keys and values). That is a true property of the model,
reported as a warning naming the mixer where the leak starts, not a failure blamed on the attention layer after it;
an attention layer that lets documents see each other still fails, at that layer.

Twins on the same two-layer model (test_model_patterns' LM and Attention): a causal convolution of kernel 3 before
the attention (the mixer leaks), the same of kernel 1 (no mixing: passes), and kernel 1 with the attention's
block-diagonal mask left out (fails at the attention). The packed probe's position ids are a tensor of their own
per row (a model that flattens them with .view(-1) raised on an expanded view).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn


def _sibling(name: str):
    """A test module beside this one, loaded by its path (importable under --import-mode=importlib too)."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_patterns = _sibling("test_model_patterns")
D, H, T, LM, Attention = _patterns.D, _patterns.H, _patterns.T, _patterns.LM, _patterns.Attention
audit = _patterns.audit


class ShortConv(nn.Module):
    """A causal depthwise convolution over the sequence, (B, T, D) -> (B, T, D), as hybrid models put beside their
    attention: it reads the `kernel - 1` positions before each one, whichever document they belong to."""

    def __init__(self, kernel: int):
        super().__init__()
        self.conv = nn.Conv1d(D, D, kernel, groups=D, padding=kernel - 1)

    def forward(self, x, docs=None):
        T = x.shape[1]
        return self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)  # (B, D, T + k - 1) cut to the causal T


def packed(model) -> object:
    return audit(model, packed=True, detectors=["packed_documents"]).result("packed_documents")


def test_a_leak_that_starts_in_a_convolution_is_a_warning_naming_it_not_the_attention_after_it():
    torch.manual_seed(0)
    r = packed(LM([ShortConv(3), Attention()]))
    assert r.verdict == "warn" and r.layer == "attn.0", r  # was: fail at attn.1, the attention whose input leaked
    assert "the leak starts in attn.0 (ShortConv), which runs no softmax attention" in r.message, r.message
    assert "reset attn.0's state at each document's start" in r.fix, r.fix


def test_the_same_model_without_the_mixing_passes_and_its_attention_that_ignores_the_documents_fails():
    torch.manual_seed(0)
    assert packed(LM([ShortConv(1), Attention()])).verdict == "pass"
    torch.manual_seed(0)
    leaky = packed(LM([ShortConv(1), Attention()], packing=False))
    assert leaky.verdict == "fail" and leaky.layer == "attn.1", leaky  # the attention: softmax attention ran in it
    assert "doc[q] == doc[kv]" in leaky.fix


class FlatPositionsLM(LM):
    """LM flattening its position ids with .view(-1) (Kosmos-2.5's text model), which an expanded view cannot take."""

    def forward(self, input_ids, position_ids=None):
        if position_ids is not None:
            position_ids = position_ids.view(-1).view(position_ids.shape)
        return super().forward(input_ids, position_ids)


def test_packed_positions_are_a_tensor_of_their_own_per_row():
    torch.manual_seed(0)
    good = packed(FlatPositionsLM([Attention(), Attention()]))
    assert good.verdict == "pass", good  # was: fail, the model raised (view size is not compatible)
    torch.manual_seed(0)
    leaky = packed(FlatPositionsLM([Attention(), Attention()], packing=False))
    assert leaky.verdict == "fail" and leaky.layer == "attn.0", leaky


class NoSoftmax(Attention):
    """The attention with its softmax left out (a bug): causal q·k weights used as they are. Kin to Attention, as a
    catalog variant is to its reference."""

    def forward(self, x, docs=None):
        B, t, _ = x.shape  # batch, sequence length
        q, k, v = self.qkv(x).view(B, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, t, d)
        scores = (q @ k.transpose(-1, -2)).tril()  # (B, H, t, t), no softmax
        return self.out((scores @ v).transpose(1, 2).reshape(B, t, D))


class Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.norm, self.mixer = nn.LayerNorm(D), mixer

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class HybridLM(nn.Module):
    """Blocks whose token mixer sits in one place, `blocks.{i}.mixer`, whatever its kind (Nemotron-H's layout)."""

    causal = True

    def __init__(self, mixers):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe, self.head = nn.Embedding(64, D), nn.Embedding(T, D), nn.Linear(D, 64)
        self.blocks = nn.ModuleList(Block(m) for m in mixers)

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))  # (B, t, D)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_mixer_of_another_kind_in_the_attentions_place_is_not_audited_as_attention_but_a_broken_one_is():
    """A hybrid's other mixer (Nemotron-H's Mamba mixer, MoE and MLP all sit in its blocks' `mixer`) is not audited
    as attention for being where attention is in another block; an attention layer of the same kind that runs no
    softmax still is, and fails there."""
    hybrid = audit(HybridLM([ShortConv(3), Attention()]), packed=False)
    assert list(hybrid.layers) == ["blocks.1.mixer"], list(hybrid.layers)  # was: blocks.0.mixer too
    broken = audit(HybridLM([NoSoftmax(), Attention()]), packed=False)
    assert list(broken.layers) == ["blocks.0.mixer", "blocks.1.mixer"] and broken.status == "failed", broken
    assert {f.layer for f in broken.findings if f.verdict == "fail"} == {"blocks.0.mixer"}, broken.findings


def _tiny(name: str):
    """A tiny model of transformers' `name` as benchmarks/sweep.py builds it (nothing downloaded)."""
    import pytest

    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    import sys

    if "sweep_benchmark" not in sys.modules:  # as tests/test_sweep.py loads it: one module, its dataclasses resolvable
        where = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep.py"
        spec = importlib.util.spec_from_file_location("sweep_benchmark", where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    sweep = sys.modules["sweep_benchmark"]
    torch.manual_seed(0)
    built = sweep.build(name)
    return (built[0] if isinstance(built, tuple) else built).eval()


def test_a_library_attention_class_that_computes_no_weights_is_a_mixer_and_its_hybrid_neighbour_is_audited():
    """RWKV's time mixing (RwkvSelfAttention, a recurrence) and BailingHybrid's delta-rule layer (a linear attention
    beside its softmax layers) carry "Attention" in their class names; `output_variance` failed both correct models
    (their outputs are no convex combination of the values). Now each is named a mixer of another kind, watched by the
    model-level checks; the hybrid's softmax layer is audited in place as before."""
    import diagnostics

    rwkv = diagnostics.audit_model(_tiny("rwkv"))
    assert rwkv.status == "inconclusive" and "no softmax attention to audit" in rwkv.status_reason, str(rwkv)
    assert all(f.mixer for f in rwkv.found) and not rwkv.layers
    hybrid = diagnostics.audit_model(_tiny("bailing_hybrid"))
    mixers = {f.path for f in hybrid.found if f.mixer}
    assert mixers == {"model.layers.0.self_attn"} and set(hybrid.layers) == {"model.layers.1.self_attn"}, str(hybrid)
    assert hybrid.status != "failed", str(hybrid)


def test_a_softmax_lost_in_every_layer_of_a_class_that_routes_through_the_attention_functions_still_fails():
    """The twin: a Llama whose registered attention function drops the softmax in every layer has no layer of its
    kind with one either, but its class hands q, k and v to transformers' attention functions: audited, and failed."""
    import diagnostics

    model = _tiny("llama")  # skips first where transformers is not installed
    model_audit = _sibling("test_model_audit")
    model_audit.register_attention("test_no_softmax_everywhere", model_audit.bug_attention)
    model.config._attn_implementation = "test_no_softmax_everywhere"
    for module in model.modules():
        if type(module).__name__ == "LlamaAttention":
            module._test_bug = "no_softmax"
    report = diagnostics.audit_model(model, seq_len=8)
    assert not any(f.mixer for f in report.found), str(report)
    assert report.status == "failed", str(report)


def test_a_softmax_over_the_wrong_axis_keeps_a_layer_audited_as_attention():
    """SwiftFormer's additive attention runs its softmax over an axis of size 1 (a problem of transformers' own, KNOWN
    in benchmarks/sweep.py): a softmax of any shape is attention the layer meant, never a mixer of another kind, so
    the bug stays a finding (the first draft of the mixer rule counted only softmaxes over two or more keys, and the
    slow step's sweep sample read swiftformer inconclusive)."""
    import diagnostics

    report = diagnostics.audit_model(_tiny("swiftformer"))
    assert not any(f.mixer for f in report.found) and report.status == "failed", str(report)
