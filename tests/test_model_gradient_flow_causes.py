"""gradient_flow on correct models whose attention parameters looked unused for reasons of the audit's own (issue 33,
the transformers sweep); each twin: the correct model passes, the same model with one real bug still fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

IDS = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))


class TinyInitAttention(nn.Module):
    """Self-attention with separate q, k, v projections; `bug`: the scores detached (q and k get no gradient)."""

    def __init__(self, d_model: int = 16, num_heads: int = 2, bug: bool = False):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, width
        H = self.num_heads
        q, k, v = (f(x).reshape(B, T, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))  # (B, H, T, d)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B, H, T, T)
        w = (scores.detach() if self.bug else scores).softmax(-1)  # BUG: the scores cut from the backward
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D))


class TinyInitModel(nn.Module):
    """An embedding, two attention blocks (no norm) and a head, every weight drawn at std `init`, every bias 0 (SAM's
    vision encoder defaults to initializer_range=1e-10): the outputs are ~init ** 2, the attention weights' gradients
    far smaller."""

    def __init__(self, bug: bool = False, init: float = 1e-10, cast: bool = False):
        super().__init__()
        seed_rng(0)
        self.cast = cast  # the blocks compute in float32 whatever the model's dtype (SLANet's table head)
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([TinyInitAttention(bug=bug and i == 1) for i in range(2)])
        self.head = nn.Linear(16, 32)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, init) if p.dim() > 1 else p.zero_()

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x.float() if self.cast else x  # a float64 copy of the model then raises: float32 x, float64 weights
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("cast", [False, True])
@pytest.mark.parametrize("bug", [False, True])
def test_gradients_of_tiny_outputs_do_not_underflow_and_a_cut_path_still_fails(bug, cast):
    """Was: every q, k, v and proj weight "got no gradient" on the correct model: (out ** 2) of outputs ~1e-20 is
    below float32's smallest number, and so are the gradients (SAM and SAM-HQ's vision models, issue 33). Now the
    loss is scaled (`squared`) and what still gets exactly 0 is asked again in the model's float64 copy, or, where
    that copy does not run (`cast`), of each module alone in float64, given its output's gradient."""
    report = diagnostics.audit_model(TinyInitModel(bug, cast=cast), example=IDS)
    flow = report.result("gradient_flow")
    if bug:  # the detached scores: blocks.1's q and k get no gradient, whatever the scale
        assert flow.verdict == "fail" and flow.layer == "blocks.1", flow
        assert "blocks.1.q.weight" in flow.evidence and "blocks.1.k.weight" in flow.evidence, flow
        assert "blocks.0." not in flow.evidence, flow
        return
    assert flow.verdict == "pass" and "4 of them only in a float64 copy" in flow.message, flow
    assert "blocks.0.q.weight" in flow.message and report.status == "passed", report


@pytest.mark.parametrize("bug", [False, True])
def test_an_output_of_denormals_gives_finite_gradients_and_a_cut_path_still_fails(bug):
    """Outputs of ~1e-40 (float32 denormals: MobileViT's tiny configuration returns 8e-40): `squared` divided them by
    their largest magnitude, and the gradient of that, 2 / 8e-40, is past float32's largest number, so every
    parameter's gradient came out NaN and gradient_flow failed the correct model ("non-finite gradients"). The scale
    is now no smaller than the square root of the dtype's smallest normal number; the detached twin still fails."""
    report = diagnostics.audit_model(TinyInitModel(bug, init=1e-20), example=IDS)
    flow = report.result("gradient_flow")
    assert "non-finite" not in flow.message, flow
    if bug:
        assert flow.verdict == "fail" and flow.layer == "blocks.1" and "blocks.1.q.weight" in flow.evidence, flow
    else:
        assert flow.verdict == "pass", flow


class Teacher(nn.Module):
    """A small encoder block: attention and a feed-forward, both residual."""

    def __init__(self):
        super().__init__()
        self.attn, self.mlp = TinyInitAttention(), nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x, bug: bool = False):
        if bug:  # BUG: the attention alone run without autograd, inside a block whose feed-forward is trained
            with torch.no_grad():
                a = self.attn(x)
        else:
            a = self.attn(x)
        x = x + a
        return x + self.mlp(x)


class FrozenTeacherModel(nn.Module):
    """A frozen feature extractor (X-Codec's semantic model: run under torch.no_grad(), its output detached) beside a
    trained attention; `bug`: instead, only the extractor's attention is run without autograd."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.bug = bug
        self.emb, self.teacher, self.attn = nn.Embedding(32, 16), Teacher(), TinyInitAttention()
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if self.bug:
            features = self.teacher(x, bug=True)
        else:
            with torch.no_grad():
                features = self.teacher(x)
        x = x + features
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("bug", [False, True])
def test_a_frozen_sub_model_is_not_judged_and_an_attention_run_without_autograd_still_fails(bug):
    """Was: every attention parameter of X-Codec's semantic model (a HuBERT run under torch.no_grad() as a feature
    extractor) "got no gradient" (issue 33). A submodule none of whose parameters, its feed-forward too, gets a
    gradient is frozen as a whole: not judged, and said so."""
    report = diagnostics.audit_model(FrozenTeacherModel(bug), example=IDS)
    flow = report.result("gradient_flow")
    if bug:  # the teacher's feed-forward is trained: its attention alone is cut
        assert flow.verdict == "fail" and flow.layer == "teacher.attn", flow
        assert "teacher.attn.q.weight" in flow.evidence, flow
        return
    assert flow.verdict == "pass" and "teacher, a frozen sub-model" in flow.message, flow
    assert "all 8 attention parameters" in flow.message, flow


class EntityAttention(nn.Module):
    """Self-attention over words and, where given, entities appended to them, the entities' queries through a
    projection of their own (LUKE's entity-aware attention: e2w_query, e2e_query); `bug`: the entities are queried
    through the words' projection again, their own never used."""

    def __init__(self, d_model: int = 16, num_heads: int = 2, bug: bool = False):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.entity_query, self.proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, words, entities=None):
        x = words if entities is None else torch.cat([words, entities], 1)  # (B, T + E, D)
        q = self.query(x)
        if entities is not None:  # BUG (bug=True): the words' projection for the entities too
            q = torch.cat([q[:, :words.shape[1]], (self.query if self.bug else self.entity_query)(entities)], 1)
        B, T, D = x.shape
        H = self.num_heads
        q, k, v = (t.reshape(B, T, H, D // H).transpose(1, 2) for t in (q, self.key(x), self.value(x)))
        w = (q @ k.transpose(-1, -2) / (D // H) ** 0.5).softmax(-1)  # (B, H, T + E, T + E)
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D))  # words, then entities


class EntityLM(nn.Module):
    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.entity_emb = nn.Embedding(32, 16), nn.Embedding(8, 16)
        self.attn, self.head = EntityAttention(bug=bug), nn.Linear(16, 32)

    def forward(self, input_ids, entity_ids=None, entity_attention_mask=None):
        x = self.emb(input_ids)
        entities = None if entity_ids is None else self.entity_emb(entity_ids)
        both = x if entities is None else torch.cat([x, entities], 1)
        return self.head(both + self.attn(x, entities))  # (B, T, 32), or (B, T + E, 32) with entities


@pytest.mark.parametrize("bug", [False, True])
def test_parameters_used_only_with_a_second_stream_of_ids_are_not_exercised_and_unused_ones_still_fail(bug):
    """Was: LUKE's entity-aware query projections (used only with `entity_ids`) and Evolla's protein adapters (only
    with `protein_input_ids` and `protein_attention_mask`) failed gradient_flow and, in place, parameters_used (issue
    33). An optional `*_ids` input is tried as all ones with the optional inputs of its prefix: "not exercised"."""
    report = diagnostics.audit_model(EntityLM(bug), example=IDS)
    flow = report.result("gradient_flow")
    if bug:  # the entities' own projection is unused with entities too
        assert flow.verdict == "fail" and "attn.entity_query.weight" in flow.evidence, flow
        assert report.status == "failed", report
        return
    assert flow.verdict == "warn" and "with entity_ids and entity_attention_mask" in flow.message, flow
    assert "entity_ids" in flow.fix, flow.fix
    assert report.status == "passed", report


class GatedCrossAttention(TinyInitAttention):
    """Self-attention, then, where a second stream is given, cross-attention to it added through tanh(gate) with the
    gate at 0 (Evolla's protein adapters, as Flamingo's gated cross-attention); `bug`: the cross-attention's keys
    projected by its query projection, its key projection never used."""

    def __init__(self, d_model: int = 16, bug: bool = False):
        super().__init__(d_model)
        self.bug = bug
        self.cross_query, self.cross_key, self.cross_value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x, memory=None):
        x = x + super().forward(x)
        if memory is None:
            return x
        k = (self.cross_query if self.bug else self.cross_key)(memory)  # BUG (bug=True): the query projection
        w = (self.cross_query(x) @ k.transpose(-1, -2) / x.shape[-1] ** 0.5).softmax(-1)  # (B, T, M)
        return x + torch.tanh(self.gate) * (w @ self.cross_value(memory))


class GatedLM(nn.Module):
    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.protein_emb = nn.Embedding(32, 16), nn.Embedding(8, 16)
        self.adapter, self.head = GatedCrossAttention(bug=bug), nn.Linear(16, 32)

    def forward(self, input_ids, protein_input_ids=None, protein_attention_mask=None):
        memory = None if protein_input_ids is None else self.protein_emb(protein_input_ids)
        return self.head(self.adapter(self.emb(input_ids), memory))


@pytest.mark.parametrize("bug", [False, True])
def test_parameters_used_only_with_a_second_stream_behind_a_gate_at_0_are_not_exercised_and_unused_ones_fail(bug):
    """Evolla: its protein adapters run only with `protein_input_ids` and `protein_attention_mask`, and there behind
    tanh(gate), the gate at 0: no gradient even with them, yet used; "not exercised", saying both."""
    report = diagnostics.audit_model(GatedLM(bug), example=IDS)
    flow = report.result("gradient_flow")
    if bug:  # the key projection is never called, with the protein ids too
        assert flow.verdict == "fail" and "adapter.cross_key.weight" in flow.evidence, flow
        assert "adapter.cross_query.weight" not in flow.evidence, flow
        return
    assert flow.verdict == "warn" and "with protein_input_ids and protein_attention_mask" in flow.message, flow
    assert "behind a factor 0" in flow.evidence, flow
