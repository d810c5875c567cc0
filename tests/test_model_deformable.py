"""Deformable attention (Deformable DETR's, RT-DETR v2's, D-FINE's, DEIMv2's decoder `encoder_attn`) is no token
attention the layer audit can measure: its weights are a softmax over each head's sampling points, made from the query
alone by a projection, and it reads its memory at points (grid_sample), bilinearly, not through keys. Found by its
library class name and audited in place, it could not be given one probe, and the three transformers models were
inconclusive for it. It is now a mixer of another kind (`ModuleWatch.deformable`): not audited in place as softmax
attention, saying why, its parameters still judged by the model-level checks, and the other layers decide (issue 33,
cause 5). Recognised by what it computes: a softmax over each head's part of a projection's outputs whose weights
multiply values read at points.

Twins: the correct model passes; with its self-attention's scale missing it still fails there; with its sampling
offsets ignored it fails gradient_flow; and a library class of the same form is still audited as attention where it
samples nothing (values pooled: a layer whose keys are lost), where a grid_sample runs beside weights that do not weigh
what it read (a position table resized), and where one softmax runs over every head's points at once (a split lost).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import MultiHeadAttention
from diagnostics._guard import seed_rng

D, HEADS, POINTS, QUERIES = 16, 2, 4, 6
LIBRARY = "transformers.models.toy_detr.modeling_toy_detr"  # what makes a class a library's attention class


class ToyDeformableAttention(nn.Module):
    """Each query's head samples the (h, w) memory at POINTS offsets of its own and weighs them by a softmax over the
    points. `form`: "pooled" (the values pooled over the memory instead, no grid_sample, the same weights), "beside"
    (pooled, and a position table resized by a grid_sample added to the output), "joint" (one softmax over every
    head's points at once), "offsets ignored" (the offsets computed and the points left where they start: a real
    bug)."""

    def __init__(self, grid: tuple[int, int], form: str = ""):
        super().__init__()
        self.grid, self.form = grid, form
        self.offsets = nn.Linear(D, HEADS * POINTS * 2)
        self.attention_weights = nn.Linear(D, HEADS * POINTS)
        self.value, self.out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, hidden_states, encoder_hidden_states):
        B, Q, _ = hidden_states.shape  # batch, queries
        (h, w), d = self.grid, D // HEADS
        logits = self.attention_weights(hidden_states)  # (B, Q, H P)
        weights = (logits.softmax(-1).view(B, Q, HEADS, POINTS) if self.form == "joint"
                   else logits.view(B, Q, HEADS, POINTS).softmax(-1))  # over each head's points
        v = self.value(encoder_hidden_states)  # (B, h w, D)
        if self.form in ("pooled", "beside"):
            sampled = v.view(B, h * w, HEADS, d).mean(1).reshape(B * HEADS, d, 1, 1).expand(-1, -1, Q, POINTS)
        else:
            v = v.view(B, h, w, HEADS, d).permute(0, 3, 4, 1, 2).reshape(B * HEADS, d, h, w)
            offsets = self.offsets(hidden_states)
            if self.form == "offsets ignored":  # computed, and the fixed points read instead
                offsets = torch.zeros_like(offsets)
            at = torch.tanh(offsets).view(B, Q, HEADS, POINTS, 2).transpose(1, 2)
            sampled = F.grid_sample(v, at.reshape(B * HEADS, Q, POINTS, 2), align_corners=False)  # (B H, d, Q, P)
        mixed = (sampled * weights.transpose(1, 2).reshape(B * HEADS, 1, Q, POINTS)).sum(-1)  # (B H, d, Q)
        out = self.out(mixed.view(B, HEADS, d, Q).permute(0, 3, 1, 2).reshape(B, Q, D))
        if self.form == "beside":  # a (2 x 2) table of the layer's, resized bilinearly, read at its centre
            table = self.value.weight[:, :4].reshape(1, D, 2, 2)
            out = out + F.grid_sample(table, torch.zeros(1, Q, 1, 2), align_corners=False)[0, :, :, 0].T
        return out


ToyDeformableAttention.__module__ = LIBRARY


class ToyDetector(nn.Module):
    """(B, 3, 8, 8) pixels -> a 4 x 4 memory of patches; QUERIES learned queries -> self-attention -> deformable
    attention over the memory -> box logits. `scaled=False`: the self-attention's 1/sqrt(d_k) dropped (a real bug)."""

    def __init__(self, form: str = "", scaled: bool = True):
        super().__init__()
        seed_rng(0)
        self.patch = nn.Conv2d(3, D, 2, 2)
        self.queries = nn.Parameter(torch.randn(1, QUERIES, D) * 0.5)
        self.self_attn = MultiHeadAttention(D, HEADS)
        if not scaled:
            self.self_attn.scale = lambda scores: scores
        self.encoder_attn = ToyDeformableAttention((4, 4), form)
        self.head = nn.Linear(D, 4)

    def forward(self, pixel_values):
        memory = self.patch(pixel_values).flatten(2).transpose(1, 2)  # (B, 16, D)
        q = self.queries.expand(memory.shape[0], -1, -1)
        q = q + self.self_attn(q)[0]
        return self.head(q + self.encoder_attn(q, memory))


PIXELS = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _deformable(report) -> str:
    """How the report found encoder_attn, where it is a mixer (not audited in place); "" otherwise."""
    found = next((f for f in report.found if f.path == "encoder_attn"), None)
    return found.how if found is not None and found.mixer else ""


@pytest.mark.parametrize("scaled", [True, False])
def test_deformable_attention_is_a_mixer_saying_why_and_the_other_layers_decide(scaled):
    report = diagnostics.audit_model(ToyDetector(scaled=scaled), example=PIXELS)
    assert set(report.layers) == {"self_attn"}, (list(report.layers), report)
    how = _deformable(report)
    assert "grid_sample" in how and "sampling points" in how, report.found
    if scaled:
        assert report.status == "passed", report
    else:
        failed = {(f.layer, f.detector) for f in report.findings if f.verdict == "fail"}
        assert report.status == "failed" and ("self_attn", "softmax_saturation") in failed, report


def test_its_sampling_offsets_ignored_fail_gradient_flow():
    """The model-level checks judge a mixer's parameters: offsets that move nothing get no gradient."""
    report = diagnostics.audit_model(ToyDetector("offsets ignored"), example=PIXELS)
    assert _deformable(report), report.found
    flow = report.result("gradient_flow")
    assert report.status == "failed" and flow.verdict == "fail" and "encoder_attn.offsets" in flow.evidence, flow


@pytest.mark.parametrize("form", ["pooled", "beside", "joint"])
def test_a_library_class_of_that_form_that_weighs_no_sampled_points_per_head_is_still_audited(form):
    """Weights over a projection's outputs that weigh no values read at points, or one softmax over every head's
    points: the form of a layer whose keys are lost, never excused."""
    report = diagnostics.audit_model(ToyDetector(form), example=PIXELS)
    assert "encoder_attn" in report.layers and not _deformable(report), (list(report.layers), report.found)
    assert report.status != "passed", report
