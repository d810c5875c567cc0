"""Pins for the survivors of the full mutation run (`benchmarks/mutations.py --all --only _projections.py`, issue 37)
in the recognisers of `diagnostics._projections`, beside tests/test_pins_own_weights.py: what the Hugging Face
recogniser reads of a GPT-NeoX-style `query_key_value` (rows per key/value group), on modules built here (no
transformers needed). Each case has its twin.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from torch import nn

from diagnostics._projections import NotApplicable, Projections, recognise


class NeoX(nn.Module):
    """GPT-NeoX's attention as the recogniser reads it: one `query_key_value` of (H + 2 G) x d rows, grouped per
    key/value head, and `dense`; `heads`: num_attention_heads (0: none stated); `kept`: q_proj, k_proj and v_proj
    beside it (then those are the projections read, and the fused rows a weight they do not use: refused)."""

    def __init__(self, heads: int = 4, kv_heads: int | None = None, d: int = 8, kept: bool = False):
        super().__init__()
        G = kv_heads or heads
        self.query_key_value, self.dense = nn.Linear(32, (heads + 2 * G) * d), nn.Linear(32, 32)
        if heads:
            self.num_attention_heads = heads
        if kv_heads:
            self.num_key_value_heads = kv_heads
        self.head_size = d
        if kept:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, hidden_states, attention_mask=None):
        raise NotImplementedError  # read, never called


@pytest.mark.parametrize("make, expected", [
    (lambda: NeoX(), (4, 4, 8, "query_key_value")),
    (lambda: NeoX(heads=4, kv_heads=2), (4, 2, 8, "query_key_value")),
    (lambda: NeoX(kept=True), "which the recompute from q_proj, k_proj, v_proj and dense does not use"),
    (lambda: NeoX(heads=0), "a fused query_key_value, but no number of heads to split it by"),
    (lambda: NeoX(heads=4, kv_heads=3), "query_key_value gives"),
], ids=["grouped", "grouped, 2 kv heads", "q, k, v kept beside it", "no heads", "kv heads do not divide"])
def test_a_grouped_query_key_value_is_read_with_its_heads_and_only_where_no_q_k_v_projections_are(make, expected):
    """The grouped rows are split by the heads stated (`if not H` refuses only where none is: `if H` would refuse
    every one), the width checked (`!=`: `==` would refuse the right width), and only where the module has no
    complete set of q, k and v projections (`names is None and fused is None`: `or` would read query_key_value
    beside q_proj, k_proj and v_proj, and refuse those as unused)."""
    found = recognise(make())
    if isinstance(expected, str):
        assert isinstance(found, str) and expected in found, found
        return
    H, G, d, read = expected
    assert isinstance(found, Projections) and (found.heads, found.kv_heads, found.head_dim) == (H, G, d), found
    assert read in found.read[0], found.read


class DETR(nn.Module):
    """Hugging Face-style attention of width 32, 4 heads, called with absolute positions (DETR's object_queries)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(32, 32) for _ in range(4))
        self.num_heads = 4

    def forward(self, hidden_states, attention_mask=None, object_queries=None):
        raise NotImplementedError  # read, never called


@pytest.mark.parametrize("pos, expected", [
    (torch.randn(1, 4, 32), "object_queries added to the query's input and the key's"),
    (torch.randn(1, 4, 1), "object_queries of shape (1, 4, 1): not positions of the hidden states' width 32"),
    (torch.arange(32).expand(1, 4, 32), "object_queries of shape (1, 4, 32): not positions of the hidden states'"),
], ids=["positions", "another width", "integers"])
def test_absolute_positions_are_added_only_as_floats_of_the_hidden_states_width(pos, expected):
    """Float positions of the width are added to the query's and the key's inputs; another width (even one that
    broadcasts) or integers are refused (`not pos.is_floating_point() and pos.shape[-1] != ...` would add both)."""
    p = recognise(DETR())
    call = {"hidden_states": torch.randn(1, 4, 32), "object_queries": pos}
    if expected.startswith("object_queries added"):
        assert any(expected in r for r in p.inputs(call).read), p.inputs(call).read
        return
    with pytest.raises(NotApplicable, match=re.escape(expected)):
        p.inputs(call)


@pytest.mark.parametrize("extra, unread", [
    ({"output_attentions": False, "use_cache": True}, ()),
    ({"output_attentions": False, "sinusoidal_pos": torch.randn(1, 4, 8)}, ("sinusoidal_pos",)),
], ids=["flags", "a float tensor"])
def test_only_float_tensors_the_recompute_does_not_read_are_named_unread(extra, unread):
    """A call's flags are no values the module may apply in its own way; a float tensor it passes and the recompute
    does not read (RoFormer's sinusoidal_pos) is (`... and a.is_floating_point() or n not in used` would name the
    flags too)."""
    p = recognise(DETR())
    assert p.inputs({"hidden_states": torch.randn(1, 4, 32), **extra}).unread == unread


def _rotate_another_way(q, k, cos, sin, position_ids):  # another signature than Llama's (q, k, cos, sin)
    raise AssertionError("never called with Llama's four arguments")


class OtherRotary(nn.Module):
    """DETR's projections, in a modeling file whose apply_rotary_pos_emb takes other arguments than Llama's."""

    __module__ = "m37_other_modeling"

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(32, 32) for _ in range(4))
        self.num_heads = 4

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        raise NotImplementedError  # read, never called


@pytest.mark.parametrize("width, partial", [(8, False), (4, True)], ids=["whole head", "half a head"])
def test_a_rotary_that_does_not_run_as_llamas_names_a_partial_width_only_where_the_tables_are_narrower(
        width, partial, monkeypatch):
    """Not applicable either way; the reason adds "a partial rotary of width 4 of 8" only where the tables are
    narrower than a head (`cos.shape[-1] < d`: `<=` would add it at the whole width, `>` never)."""
    modeling = types.ModuleType("m37_other_modeling")
    modeling.apply_rotary_pos_emb = _rotate_another_way
    monkeypatch.setitem(sys.modules, "m37_other_modeling", modeling)
    p = recognise(OtherRotary())
    q = torch.randn(1, 4, 4, 8)  # (B, H, T, d)
    tables = (torch.ones(1, 4, width), torch.zeros(1, 4, width))
    c = p.inputs({"hidden_states": torch.randn(1, 4, 32), "position_embeddings": tables})
    with pytest.raises(NotApplicable, match="does not take \\(q, k, cos, sin\\)") as raised:
        c.rotary(q, q)
    assert ("a partial rotary of width" in str(raised.value)) is partial, raised.value
    assert not partial or "a partial rotary of width 4 of 8" in str(raised.value), raised.value
