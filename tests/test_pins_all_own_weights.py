"""Pins for the survivors of the full mutation run (`benchmarks/mutations.py --all --only detectors/own_weights.py`,
issue 37) in `own_weights`, beside tests/test_pins_own_weights.py. Each pin has its twin on the same inputs.

- A layer passed rotary tables that it does not apply (a hybrid model's layers without positions, NoPE: Exaone 4's
  global layers) is recomputed without them, and the evidence says so, and no longer that the tables were applied;
  the same layer applying them is read with them.
- A value scale the layer states (`v_scale`) of any number but 1 is tried as the step the layer left out.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics._projections import NotApplicable, recognise
from diagnostics.detectors.own_weights import _judge


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Llama's, read by the recogniser from the module's own Python module (this one), as from a modeling file."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Rotary(nn.Module):
    """Hugging Face-style attention of width 16, 2 heads of 8, passed its rotary tables as position_embeddings;
    `applies=False`: a layer of no positions of its own (NoPE) that takes the tables and leaves them."""

    def __init__(self, applies: bool, d_model=16, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.num_heads, self.head_dim, self.applies = num_heads, d_model // num_heads, applies
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, tokens, width
        q, k, v = (p(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, T, d) each
        if self.applies:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # (B, H, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


def tables(T: int, d: int = 8):
    angles = torch.arange(T)[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))[None]  # (T, d / 2)
    angles = torch.cat((angles, angles), dim=-1)[None]  # (1, T, d)
    return angles.cos(), angles.sin()


def test_rotary_tables_a_layer_leaves_are_read_as_left_and_not_as_applied():
    """Both pass; the layer that leaves its tables is read without them ("passed but not applied", and the reading
    of the tables as applied is dropped from the evidence: `r.startswith(...)` kept for `not r.startswith(...)` would
    keep only it); the layer that applies them is read with them."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    for applies in (True, False):
        layer = Rotary(applies)
        call = {"hidden_states": x, "position_embeddings": tables(6)}
        with torch.no_grad():
            verdict, evidence, err, allowed, _ = _judge(recognise(layer), (), call, layer(**call))
        assert verdict == "pass" and err <= allowed, evidence
        assert ("rotary tables from the call's position_embeddings" in evidence) is applies, evidence
        assert ("rotary tables passed but not applied by the module" in evidence) is not applies, evidence


# ---- a stated value scale of any number but 1 is tried as the step left out ----------------------------------------


class StatedValueScale(nn.Module):
    """Hugging Face-style attention of width 16, 2 heads of 8, stating `v_scale` (MiMo-V2-Flash's attribute);
    `applies=False`: stated and not applied, the bug."""

    def __init__(self, v_scale: float, applies: bool, d_model=16, num_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.num_heads, self.head_dim, self.v_scale, self.applies = num_heads, d_model // num_heads, v_scale, applies
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, tokens, width
        q, k, v = (p(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, T, d) each
        v = v * self.v_scale if self.applies else v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # (B, H, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("v_scale", [0.1, 10.0])
@pytest.mark.parametrize("applies", [True, False], ids=["applied", "not applied"])
def test_a_stated_value_scale_not_applied_is_named_whatever_the_number(v_scale, applies):
    """Only a stated scale of exactly 1 (none) is not tried as the step left out (`p.value_scale == 1.0`): at 0.1
    and 10 (the 1.0 x0.1 and x10) the layer that forgets it fails with that step named and its fix; the layer that
    applies it passes."""
    found = diagnostics.audit(StatedValueScale(v_scale, applies), detectors=["own_weights"]).result("own_weights")
    if applies:
        assert found.verdict == "pass" and f"values times {v_scale:.4g} (StatedValueScale.v_scale)" in found.evidence, \
            found.evidence
    else:
        assert found.verdict == "fail" and "the values' stated scale not applied" in found.evidence, found.evidence
        assert "v_scale" in found.fix, found.fix


# ---- several modules: the failing one's numbers are the result's ---------------------------------------------------


class TwoBlocks(nn.Module):
    """Two attention modules one after the other; `first_wrong`: the first states v_scale 0.5 and forgets it, the
    second is right (else both right)."""

    def __init__(self, first_wrong: bool):
        super().__init__()
        self.first = StatedValueScale(0.5, applies=not first_wrong)
        self.second = StatedValueScale(0.5, applies=True)

    def forward(self, hidden_states, attention_mask=None):
        return self.second(self.first(hidden_states, attention_mask), attention_mask)


@pytest.mark.parametrize("first_wrong", [True, False], ids=["first wrong", "both right"])
def test_a_failing_modules_error_and_allowance_are_the_results_even_where_a_right_one_follows(first_wrong):
    """The result's value and threshold are those of a module that failed (`verdict == "fail"` replaces them), so a
    failure reads value > threshold even where a module that passes comes after it (`!=` for `==`, or "pass" for
    "fail", would report the right one's numbers); where both pass they are the worse one's, under the threshold."""
    found = diagnostics.audit(TwoBlocks(first_wrong), detectors=["own_weights"]).result("own_weights")
    if first_wrong:
        assert found.verdict == "fail" and "StatedValueScale (first)" in found.message, found
        assert found.value > 10 * found.threshold, (found.value, found.threshold)
    else:
        assert found.verdict == "pass", found
        assert found.value <= found.threshold, (found.value, found.threshold)


# ---- a call's tensor the recompute does not read hides no step that explains the output --------------------------


class Unread(StatedValueScale):
    """StatedValueScale of v_scale 1 (none), passed `sinusoidal_pos` (RoFormer's), which it ignores; `scale`: the
    factor its scores are multiplied by (its own, 1/sqrt(8), by default; 1.0 forgets it; `twice`: the output also
    doubled, two changes no one step explains)."""

    def __init__(self, scale: float | None = None, twice: bool = False):
        super().__init__(1.0, applies=True)
        self.scale, self.twice = scale, twice

    def forward(self, hidden_states, sinusoidal_pos=None, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, tokens, width
        q, k, v = (p(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, T, d) each
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scale)  # (B, H, T, d)
        out = self.o_proj(y.transpose(1, 2).reshape(B, T, D))
        return 2 * out if self.twice else out


@pytest.mark.parametrize("scale, twice, expected", [(None, False, "pass"), (1.0, False, "fail"), (1.0, True, None)],
                         ids=["right", "scale forgotten", "two changes"])
def test_an_unread_tensor_leaves_a_step_that_explains_the_output_named(scale, twice, expected):
    """With a tensor the recompute does not read in the call: the right layer passes, the one that forgets its scale
    fails with that step named (`explained and c.unread`, or `not explained or c.unread`, would call it not
    applicable), and one that no single step explains is not applicable, naming the tensor (it may be how the module
    applies it)."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    layer = Unread(scale, twice)
    call = {"hidden_states": x, "sinusoidal_pos": torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        if expected is None:
            with pytest.raises(NotApplicable, match="the call passed sinusoidal_pos, which the recompute does not"):
                _judge(recognise(layer), (), call, layer(**call))
            return
        verdict, evidence, err, allowed, fix = _judge(recognise(layer), (), call, layer(**call))
    assert verdict == expected, evidence
    if expected == "fail":
        assert "the scale: the layer applies 1, its weights' 0.3536 expected" in evidence, evidence
