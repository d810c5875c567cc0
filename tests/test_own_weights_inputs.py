"""`own_weights` and what a call passes beside the hidden states (issue 33, the transformers sweep).

Two causes of false FAILs on correct transformers layers, each fixed as a class:
- absolute positions passed as one (B, T, D) tensor and added to the query's and key's inputs, never the value's
  (DETR's recipe; Table Transformer's and DAB-DETR's `object_queries`): the recompute now adds them where the recipe
  says, and a layer that adds them to its values too still fails;
- a tensor the recompute does not read (RoFormer's `sinusoidal_pos`, rotary positions applied by a method of its
  own): a difference no one step of the reference explains is then not judged (not applicable, naming the tensor);
  one that a step explains still fails.
Each correct layer failed `own_weights` before (transformers 5.25: Table Transformer 0.026, DAB-DETR 2.4e-5 to 2.6e-4,
RoFormer 0.046 of the output's RMS, allowed about 2e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics

D, HEADS = 32, 4


def positions(x: torch.Tensor) -> torch.Tensor:
    """Sinusoidal absolute positions (B, T, D) for the tokens of x, a fixed function of the position."""
    B, T, _ = x.shape
    t = torch.arange(T, dtype=torch.float64).unsqueeze(-1)  # (T, 1)
    f = torch.exp(-math.log(1e4) * torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    table = torch.cat([torch.sin(t * f), torch.cos(t * f)], dim=-1)  # (T, D)
    return table.to(x.dtype).expand(B, T, D)


class DetrStyle(nn.Module):
    """Self-attention with absolute positions added to the inputs of q and k, not of v (DETR's encoder layer), written
    as Hugging Face writes it. `bug`: "values" adds the positions to the values' input too; "merge" merges the heads
    without moving them next to their width."""

    def __init__(self, bug: str | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.bug = HEADS, D // HEADS, bug
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        B, T, _ = hidden_states.shape  # batch, sequence length, d_model
        qk_in = hidden_states + position_embeddings if position_embeddings is not None else hidden_states
        v_in = qk_in if self.bug == "values" else hidden_states
        q, k, v = (p(x).view(B, T, HEADS, -1).transpose(1, 2)  # (B, H, T, d)
                   for p, x in ((self.q_proj, qk_in), (self.k_proj, qk_in), (self.v_proj, v_in)))
        w = torch.softmax(q @ k.transpose(-2, -1) * self.scaling, dim=-1)  # (B, H, T, T)
        out = w @ v  # (B, H, T, d)
        out = out.reshape(B, T, D) if self.bug == "merge" else out.transpose(1, 2).reshape(B, T, D)
        return self.o_proj(out)


def with_positions(name: str):
    return lambda layer, x, memory, mask: layer(x, **{name: positions(x)})


def own_weights(layer, **kw):
    return diagnostics.audit(layer, detectors=["own_weights"], d_model=D, num_heads=HEADS, **kw).result("own_weights")


def built(make):
    torch.manual_seed(0)  # a layer and its twin share their weights
    return make().eval()


def test_positions_added_to_q_and_k_pass_and_a_step_done_wrong_still_fails():
    right = own_weights(built(DetrStyle), call=with_positions("position_embeddings"))
    assert right.verdict == "pass", right.message + " | " + str(right.evidence)
    assert "position_embeddings added to the query's input and the key's, not the value's" in right.evidence
    wrong = own_weights(built(lambda: DetrStyle("merge")), call=with_positions("position_embeddings"))
    assert wrong.verdict == "fail", wrong.evidence
    assert "heads merged without moving them next to their width" in wrong.evidence


# ---- transformers' own classes (the `real` extra) ------------------------------------------------------------------
def _table_transformer_attention():
    modeling = pytest.importorskip("transformers.models.table_transformer.modeling_table_transformer",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    torch.manual_seed(0)
    return modeling, modeling.TableTransformerAttention(D, HEADS).eval()


def _positions_in_the_values_too(original):
    """TableTransformerAttention.forward given x + pos as its hidden states: the values' input carries the positions
    (and q and k carry them twice): the bug of a layer that adds them before splitting the streams."""
    def forward(self, hidden_states, attention_mask=None, object_queries=None, **kwargs):
        return original(self, hidden_states + object_queries, attention_mask, object_queries, **kwargs)
    return forward


def test_table_transformer_positions_pass_and_its_twin_with_positions_in_the_values_fails(monkeypatch):
    modeling, layer = _table_transformer_attention()
    right = own_weights(layer, call=with_positions("object_queries"))
    assert right.verdict == "pass", right.message + " | " + str(right.evidence)  # failed before: 0.026 of the RMS
    assert "object_queries added to the query's input and the key's" in right.evidence
    cls = modeling.TableTransformerAttention
    monkeypatch.setattr(cls, "forward", _positions_in_the_values_too(cls.forward))
    wrong = own_weights(layer, call=with_positions("object_queries"))
    assert wrong.verdict == "fail", wrong.message + " | " + str(wrong.evidence)  # a class of transformers' own


def _roformer_attention():
    modeling = pytest.importorskip("transformers.models.roformer.modeling_roformer",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import RoFormerConfig

    config = RoFormerConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=64, num_hidden_layers=1,
                            vocab_size=64, embedding_size=D)
    torch.manual_seed(0)
    layer = modeling.RoFormerSelfAttention(config).eval()
    table = modeling.RoFormerSinusoidalPositionalEmbedding(64, D // HEADS)

    def call(layer, x, memory, mask):
        sinusoidal = table((x.shape[0], x.shape[1]))[None, None, :, :]  # (1, 1, T, d), as RoFormerEncoder passes it
        return layer(x, sinusoidal_pos=sinusoidal)
    return layer, call


def test_a_tensor_the_recompute_does_not_read_is_not_judged_where_no_step_explains_the_difference():
    layer, call = _roformer_attention()
    result = own_weights(layer, call=call)
    assert result.verdict == "skip", result.message + " | " + str(result.evidence)  # failed before: 0.046 of the RMS
    assert "the call passed sinusoidal_pos, which the recompute does not read" in result.message


def test_a_tensor_the_recompute_does_not_read_does_not_excuse_a_difference_one_step_explains(monkeypatch):
    """Llama's attention with its key/value heads repeated in the wrong order, passed a tensor it does not use (its
    **kwargs take it): the wrong order is one step of the reference and still fails."""
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = modeling.LlamaAttention(config, layer_idx=0).eval()
    rotary = modeling.LlamaRotaryEmbedding(config)

    class Passing(nn.Module):  # the Llama layer called as its model calls it, plus a tensor it takes in **kwargs
        def __init__(self):
            super().__init__()
            self.inner = layer

        def forward(self, x):
            cos_sin = rotary(x, torch.arange(x.shape[1]).unsqueeze(0))
            return self.inner(x, position_embeddings=cos_sin, attention_mask=None, unused_positions=positions(x))[0]

    right = own_weights(Passing(), causal=True)
    assert right.verdict == "pass", right.message + " | " + str(right.evidence)
    monkeypatch.setattr(modeling, "repeat_kv", lambda x, n: x if n == 1 else x.repeat(1, n, 1, 1))
    wrong = own_weights(Passing(), causal=True)
    assert wrong.verdict == "fail" and "repeat, not repeat_interleave" in wrong.evidence, wrong.evidence



def _lightglue():
    """LightGlue as the sweep builds it (benchmarks/sweep.py `build`: the tiny config, the seed)."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[real]')")
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep.py"
    if "sweep_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sweep_benchmark", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sweep_benchmark"].build("lightglue")


def test_a_cross_attention_is_recomputed_with_its_memorys_mask_and_its_twin_with_the_queries_mask_fails(monkeypatch):
    """The recompute read `attention_mask` only: LightGlue's correct cross-attention, which applies
    `encoder_attention_mask` (its attention_mask is the queries' own), failed own_weights in the sweep (lg33). The
    twin applies nothing of the memory's mask: still a failure, at the cross-attention."""
    model = _lightglue()
    right = diagnostics.audit_model(model)
    cross = "transformer_layers.0.cross_attention"
    result = right.layers[cross].result("own_weights")
    assert result.verdict == "pass", result.message + " | " + str(result.evidence)
    assert "encoder_attention_mask as passed" in result.evidence
    from transformers.models.lightglue import modeling_lightglue as modeling

    original = modeling.LightGlueAttention.forward

    def memory_mask_dropped(self, hidden_states, position_embeddings=None, attention_mask=None,
                            encoder_hidden_states=None, encoder_attention_mask=None, **kwargs):
        return original(self, hidden_states, position_embeddings, attention_mask, encoder_hidden_states, None,
                        **kwargs)

    monkeypatch.setattr(modeling.LightGlueAttention, "forward", memory_mask_dropped)
    wrong = diagnostics.audit_model(_lightglue())
    assert any(f.layer == cross and f.detector == "own_weights" for f in wrong.findings), str(wrong)


class BertStyleCross(nn.Module):
    """A cross-attention written as transformers writes BERT's (BertCrossAttention): the memory comes as
    `encoder_hidden_states`, its padding mask as `attention_mask` (the parent passes the encoder's mask under that
    name), no `encoder_attention_mask` argument. `reads_mask=False`: the mask is taken and not applied (the bug)."""

    def __init__(self, reads_mask: bool = True):
        super().__init__()
        self.num_heads, self.head_dim, self.reads_mask = HEADS, D // HEADS, reads_mask
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, Tq, _ = hidden_states.shape  # batch, query length, d_model
        Tk = encoder_hidden_states.shape[1]  # the memory's length
        q = self.q_proj(hidden_states).view(B, Tq, HEADS, -1).transpose(1, 2)  # (B, H, Tq, d)
        k, v = (p(encoder_hidden_states).view(B, Tk, HEADS, -1).transpose(1, 2)  # (B, H, Tk, d)
                for p in (self.k_proj, self.v_proj))
        scores = q @ k.transpose(-2, -1) * self.scaling  # (B, H, Tq, Tk)
        if attention_mask is not None and self.reads_mask:
            scores = scores.masked_fill(~attention_mask, float("-inf"))  # bool (B, 1, Tq, Tk), True = may attend
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, Tq, D))


def memory_padded(layer, x, memory, mask):
    """The memory's last 3 keys are padding in the second sequence, its mask passed as `attention_mask`."""
    allowed = torch.ones(memory.shape[0], 1, x.shape[1], memory.shape[1], dtype=torch.bool)
    allowed[1, ..., -3:] = False
    return layer(x, encoder_hidden_states=memory, attention_mask=allowed)


def test_a_cross_attention_given_its_memorys_mask_as_attention_mask_is_recomputed_with_it():
    """_projections.huggingface's choice of mask (L393 at 3057bfd, `and`->`or`: a memory passed as
    encoder_hidden_states made the recompute read `encoder_attention_mask` even where the call passed none, so BERT's
    cross-attention, whose memory mask arrives as `attention_mask`, was recomputed unmasked and failed). The memory's
    mask is read from `encoder_attention_mask` only where the call passes one (LightGlue, above); here the layer's
    `attention_mask` is the memory's. Its twin, which takes the mask and applies none, is not passed on the same
    inputs: its output differs from the recompute, and the recompute without the call's mask reproduces it, the step
    named with its fix (before that step was among the reference's, own_weights said it could not tell)."""
    right = own_weights(built(BertStyleCross), cross=True, call=memory_padded)
    assert right.verdict == "pass", right.message + " | " + str(right.evidence)
    assert "attention_mask as passed" in right.evidence, right.evidence
    wrong = own_weights(built(lambda: BertStyleCross(reads_mask=False)), cross=True, call=memory_padded)
    assert wrong.verdict == "fail", wrong.message
    assert "one step changed: the mask the call passed not applied" in wrong.evidence, wrong.evidence
