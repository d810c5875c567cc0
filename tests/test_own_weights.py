"""`own_weights`: the layer's output against the attention recomputed from its own projections.

The bug it exists for keeps every property a black-box detector measures: grouped key/value heads repeated in the
wrong order (`repeat` where `repeat_interleave` belongs) is a correct layer with its query heads permuted. Each catch
has its twin, the correct layer on the same inputs (same seed, same weights); layers whose projections cannot be
identified are not applicable, never failed.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import correct
import diagnostics

DTYPES = [torch.float32, torch.bfloat16, torch.float64]


class GroupedQueryAttention(nn.Module):
    """Grouped-query attention written as Hugging Face writes it (q_proj ... o_proj, num_key_value_heads, scaling);
    `wrong_order`: the key/value heads tiled (`repeat`) instead of each shared by consecutive query heads."""

    def __init__(self, d_model=32, num_heads=4, num_key_value_heads=2, *, wrong_order=False, scale=None):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.head_dim = d_model // num_heads
        self.scaling = self.head_dim ** -0.5
        self.applied_scale = self.scaling if scale is None else scale
        self.q_proj = nn.Linear(d_model, num_heads * self.head_dim)
        self.k_proj = nn.Linear(d_model, num_key_value_heads * self.head_dim)
        self.v_proj = nn.Linear(d_model, num_key_value_heads * self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, d_model)
        self.wrong_order = wrong_order

    def forward(self, hidden_states, attention_mask=None):
        B, T, _ = hidden_states.shape  # batch, sequence length, d_model
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, G, T, d)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, G, T, d)
        n_rep = self.num_heads // self.num_key_value_heads
        if self.wrong_order:
            k, v = k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1)  # head h reads kv head h % G: the bug
        else:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # (B, H, T, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.applied_scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


def own_weights(layer, **kw):
    return diagnostics.audit(layer, detectors=["own_weights"], **kw).result("own_weights")


def built(make, dtype, seed=0):
    torch.manual_seed(seed)  # the broken layer and its twin share their weights
    return make().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_heads_in_the_wrong_order_fail_and_the_right_order_passes(dtype):
    right = own_weights(built(GroupedQueryAttention, dtype))
    wrong = own_weights(built(lambda: GroupedQueryAttention(wrong_order=True), dtype))
    assert right.verdict == "pass", right.evidence
    assert wrong.verdict == "fail", wrong.evidence
    assert "repeated in the wrong order (repeat, not repeat_interleave)" in wrong.evidence
    assert "k.repeat_interleave(H // G, dim=1)" in wrong.fix  # the fix of the step found, not the general one
    assert wrong.value > 10 * wrong.threshold  # far outside, at every dtype
    assert right.value <= right.threshold


def test_the_wrong_order_keeps_what_the_black_box_detectors_measure():
    """Why the check exists: the full audit of the wrong-order layer fails on own_weights alone."""
    report = diagnostics.audit(built(lambda: GroupedQueryAttention(wrong_order=True), torch.float32))
    assert set(report.fired()) == {"own_weights"}, str(report)


def test_a_scale_other_than_the_layers_own_is_named_and_its_twin_passes():
    wrong = own_weights(built(lambda: GroupedQueryAttention(scale=1.0), torch.float32))
    right = own_weights(built(lambda: GroupedQueryAttention(scale=8 ** -0.5), torch.float32))
    assert wrong.verdict == "fail" and "the layer applies 1, its weights' 0.3536 expected" in wrong.evidence
    assert right.verdict == "pass", right.evidence


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_multihead_attention_passes(batch_first):
    torch.manual_seed(0)
    result = own_weights(nn.MultiheadAttention(32, 4, batch_first=batch_first).eval())
    assert result.verdict == "pass", result.evidence
    assert "in_proj_weight and out_proj of nn.MultiheadAttention" in result.evidence


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_passes_and_a_catalog_step_is_named(causal):
    from buggy_variants import VARIANTS

    layer = built(lambda: correct.MultiHeadAttention(32, 4, causal=causal), torch.float32)
    result = own_weights(layer, causal=causal)
    assert result.verdict == "pass", result.evidence
    assert "this project's reference" in result.evidence
    twin = built(lambda: VARIANTS["heads_merged_without_transpose"].build(d_model=32, num_heads=4, causal=causal),
                 torch.float32)
    caught = own_weights(twin, causal=causal)
    assert caught.verdict == "fail" and "heads merged without moving them next to their width" in caught.evidence


class MaskIgnored(GroupedQueryAttention):
    """Takes `attention_mask` and never hands it to SDPA."""

    def forward(self, hidden_states, attention_mask=None):
        return super().forward(hidden_states, None)


@pytest.mark.parametrize("dtype, gpt2", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["float32", "bfloat16", "bfloat16-std0.02"])
def test_a_mask_the_call_passed_and_the_layer_ignored_is_named_as_the_step(dtype, gpt2):
    """The reference recomputed without the call's mask reproduces the output: that step is named, with its fix; the
    twin that applies the mask passes on the same inputs, and its report names no step."""
    def built_at(cls):
        return correct.gpt2_init_(built(cls, torch.float32)).to(dtype) if gpt2 else built(cls, dtype)

    wrong = own_weights(built_at(MaskIgnored), causal=True)  # the audit's calls then pass a causal mask
    assert wrong.verdict == "fail", wrong.evidence
    assert "one step changed: the mask the call passed not applied" in wrong.evidence, wrong.evidence
    assert wrong.fix.startswith("apply the mask the call passes to the scores before the softmax"), wrong.fix
    right = own_weights(built_at(GroupedQueryAttention), causal=True)
    assert right.verdict == "pass" and "one step changed" not in right.evidence, right.evidence


class Sink(GroupedQueryAttention):
    """A parameter the recompute does not know (a learned sink logit per head)."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))


class NoProjections(nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("make, reason", [
    (Sink, "holds sinks, which the recompute from q_proj, k_proj, v_proj and o_proj does not use"),
    (NoProjections, "no attention projections identified"),
    (lambda: correct.MultiHeadAttention(32, 4, rotary=True), "rotary=True: a position or pattern step"),
    (lambda: nn.MultiheadAttention(32, 4, batch_first=True, add_bias_kv=True), "appends keys of its own"),
], ids=["unknown parameter", "no projections", "own rotary", "mha bias_kv"])
def test_what_cannot_be_recomputed_is_not_applicable_with_the_reason(make, reason):
    result = own_weights(built(make, torch.float32), d_model=32, num_heads=4)
    assert result.verdict == "skip" and result.message.startswith("not applicable: "), result.message
    assert reason in result.message


# ---- real libraries (the `real` extra) -------------------------------------------------------------------
def _llama_attention(implementation):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return modeling, modeling.LlamaAttention(config, layer_idx=0).eval()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_transformers_layer_passes_and_fails_with_its_key_value_heads_in_the_wrong_order(implementation,
                                                                                           monkeypatch):
    modeling, layer = _llama_attention(implementation)
    right = own_weights(layer, causal=True)
    assert right.verdict == "pass", right.evidence
    assert "rotary tables from the call's position_embeddings" in right.evidence
    if implementation == "eager":  # sdpa repeats the heads inside torch (enable_gqa) or with the same repeat_kv
        monkeypatch.setattr(modeling, "repeat_kv", lambda x, n: x if n == 1 else x.repeat(1, n, 1, 1))
        wrong = own_weights(layer, causal=True)
        assert wrong.verdict == "fail" and "repeat, not repeat_interleave" in wrong.evidence, wrong.evidence


@pytest.mark.slow  # two model audits of a 2-layer Llama, ~20 s each on a quiet machine (conftest.py's list)
def test_the_model_audit_finds_the_wrong_order_at_every_layer_and_passes_the_twin(monkeypatch):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=2, vocab_size=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = modeling.LlamaForCausalLM(config).eval()
    right = diagnostics.audit_model(model, seq_len=8)
    assert right.status == "passed", str(right)
    assert all(r.result("own_weights").verdict == "pass" for r in right.layers.values())
    monkeypatch.setattr(modeling, "repeat_kv", lambda x, n: x if n == 1 else x.repeat(1, n, 1, 1))
    wrong = diagnostics.audit_model(model, seq_len=8)
    assert wrong.status == "failed"
    at_layers = {(f.layer, f.detector) for f in wrong.findings if f.layer is not None}
    assert at_layers == {(path, "own_weights") for path in wrong.layers}, str(wrong)  # the model's own backend_parity
    # also sees it here: sdpa's repeat is not the patched one


def test_a_transformers_layer_without_an_output_projection_passes():
    """BERT's self-attention returns the merged heads; its parent projects them."""
    modeling = pytest.importorskip("transformers.models.bert.modeling_bert",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import BertConfig

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1)
    result = own_weights(modeling.BertSelfAttention(config).eval())
    assert result.verdict == "pass", result.evidence
    assert "query, key, value (no output projection)" in result.evidence


def _stacked_split(self, hidden_states, attention_mask, layer_past=None, position_embeddings=None, **kwargs):
    """GPT-NeoX's attention with its fused query_key_value split as if its rows were stacked [Q; K; V] (the layout of
    Phi-3's qkv_proj) where they are interleaved per head [q_0 k_0 v_0 q_1 ...]: the bug of a checkpoint converted
    with the other layout. Otherwise GPTNeoXAttention.forward (transformers 5.25) as written."""
    modeling = sys.modules[type(self).__module__]
    shape = hidden_states.shape[:-1]  # (B, T)
    q, k, v = self.query_key_value(hidden_states).chunk(3, dim=-1)  # the bug: each (B, T, D) from the wrong rows
    q, k, v = (x.view(*shape, -1, self.head_size).transpose(1, 2) for x in (q, k, v))  # (B, H, T, d)
    cos, sin = position_embeddings
    q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    out, weights = modeling.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0)
    return self.dense(out.reshape(*shape, -1).contiguous()), weights


@pytest.mark.parametrize("rotary_pct", [1.0, 0.25], ids=["full rotary", "partial rotary"])
def test_gpt_neox_fused_query_key_value_passes_and_split_in_the_wrong_layout_fails(rotary_pct, monkeypatch):
    """GPT-NeoX's query_key_value: rows (H, 3, d), q, k and v interleaved per head; its default rotary turns a
    quarter of each head (its apply_rotary_pos_emb keeps the rest). Twin: the same weights split as stacked rows."""
    modeling = pytest.importorskip("transformers.models.gpt_neox.modeling_gpt_neox",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=1,
                           vocab_size=64, rotary_pct=rotary_pct)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = modeling.GPTNeoXAttention(config, layer_idx=0).eval()
    right = own_weights(layer, causal=True)
    assert right.verdict == "pass", right.evidence
    assert "query_key_value and dense of GPTNeoXAttention" in right.evidence, right.evidence
    monkeypatch.setattr(modeling.GPTNeoXAttention, "forward", _stacked_split)
    wrong = own_weights(layer, causal=True)
    assert wrong.verdict == "fail", wrong


def test_a_timm_attention_passes():
    layers = pytest.importorskip("timm.layers", reason="timm is not installed (pip install -e '.[real]')")
    torch.manual_seed(0)
    layer = layers.Attention(32, num_heads=4, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm).eval()
    result = own_weights(layer)
    assert result.verdict == "pass", result.evidence
    assert "qkv and proj of Attention" in result.evidence


def margins(seeds: int = 5) -> None:
    """`python tests/test_own_weights.py --margins [SEEDS]`: per dtype, the largest error / allowed of correct layers
    (the grouped-query layer, nn.MultiheadAttention, the reference causal and not, at torch's default and GPT-2's
    std-0.02 initialisation; with the real extra, Llama eager and sdpa and timm's Attention) and the smallest of the
    wrong-order layer, over `seeds` seeds: FUDGE's margin is 1 / the first, the catch's the second."""
    makers = {"gqa": GroupedQueryAttention, "mha": lambda: nn.MultiheadAttention(32, 4, batch_first=True),
              "reference": lambda: correct.MultiHeadAttention(32, 4),
              "reference causal": lambda: correct.MultiHeadAttention(32, 4, causal=True)}
    try:
        import timm.layers
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention

        def llama(implementation):
            config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
            config._attn_implementation = implementation
            return LlamaAttention(config, layer_idx=0)

        makers.update({"llama eager": lambda: llama("eager"), "llama sdpa": lambda: llama("sdpa"),
                       "timm": lambda: timm.layers.Attention(32, 4, qkv_bias=True, qk_norm=True,
                                                             norm_layer=nn.LayerNorm)})
    except ImportError:
        print("(transformers or timm not installed: the real layers are left out)")
    for dtype in DTYPES:
        worst, worst_at, catch = 0.0, "", float("inf")
        for seed in range(seeds):
            for init in ("default", "gpt2"):
                for name, make in [*makers.items(), ("WRONG ORDER", lambda: GroupedQueryAttention(wrong_order=True))]:
                    layer = built(make, dtype, seed)
                    if init == "gpt2":
                        correct.gpt2_init_(layer, seed=seed)
                    causal = name.startswith("llama") or name == "reference causal"
                    r = diagnostics.audit(layer.eval(), detectors=["own_weights"], causal=causal, seed=seed
                                          ).result("own_weights")
                    ratio = r.value / r.threshold
                    if name == "WRONG ORDER":
                        catch = min(catch, ratio)
                    elif ratio > worst:
                        worst, worst_at = ratio, f"{name}, seed {seed}, {init} init ({r.value:.3g} / {r.threshold:.3g})"
        print(f"{str(dtype):16} correct layers reach {worst:.3g} of the allowed error (margin {1 / worst:.3g}x; "
              f"{worst_at}); the wrong order is {catch:.3g}x over it")


if __name__ == "__main__":
    import sys

    if "--margins" in sys.argv:
        margins(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 5)


@pytest.mark.parametrize("layer_idx, wrong_order", [(0, False), (1, False), (1, True)],
                         ids=["sliding, rotary", "global, no rotary", "global, kv heads in the wrong order"])
def test_a_layer_that_applies_no_rotary_of_its_own_choice_passes_and_its_wrong_grouped_heads_still_fail(
        layer_idx, wrong_order, monkeypatch):
    """Exaone 4's global layers skip the rotary tables they are passed (`if self.sliding_window is None or
    self.is_sliding`): recomputed with and without them, whichever reproduces the output, the layer's own choice of
    no positions passes (it failed before: 3.1 of the output's RMS). Its sliding layer is read with the rotary, and the
    global layer with its key/value heads repeated in the wrong order (repeat, not repeat_interleave) still fails."""
    modeling = pytest.importorskip("transformers.models.exaone4.modeling_exaone4",
                                   reason="transformers is not installed (pip install -e '.[real]')")
    from transformers import Exaone4Config

    config = Exaone4Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           intermediate_size=64, num_hidden_layers=2, vocab_size=64, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = modeling.Exaone4Attention(config, layer_idx=layer_idx).eval()
    if wrong_order:
        monkeypatch.setattr(modeling, "repeat_kv", lambda x, n: x.repeat(1, n, 1, 1))
    found = own_weights(layer, causal=True)
    if wrong_order:
        assert found.verdict == "fail", found.evidence
        return
    assert found.verdict == "pass", found.evidence
    read = "rotary tables passed but not applied" if layer_idx else "rotary tables from the call's position_embeddings"
    assert read in found.evidence, found.evidence


class ValueScaled(GroupedQueryAttention):
    """Values multiplied by a number the module states (MiMo-V2-Flash's `v_scale`, its config's
    attention_value_scale); `applies=False`: stated and not applied, the bug."""

    def __init__(self, *, applies=True):
        super().__init__()
        self.v_scale, self.applies = 0.707, applies

    def forward(self, hidden_states, attention_mask=None):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, G, T, d)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, G, T, d)
        if self.applies:
            v = v * self.v_scale
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_scaled_by_a_number_the_layer_states_pass_and_its_twin_that_forgets_it_fails(dtype):
    """MiMo-V2-Flash (transformers 5.25) multiplies its values by `v_scale` = 0.707: the recompute without it failed
    the correct model ("not the attention its own weights compute"). The stated number is now applied; a layer that
    states it and does not apply it differs by that factor and still fails."""
    right = own_weights(built(ValueScaled, dtype))
    forgot = own_weights(built(lambda: ValueScaled(applies=False), dtype))
    assert right.verdict == "pass" and "values times 0.707 (ValueScaled.v_scale)" in right.evidence, right.evidence
    assert forgot.verdict == "fail", forgot.evidence
    assert "the values' stated scale not applied" in forgot.evidence and "v_scale" in forgot.fix
    assert forgot.value > 10 * forgot.threshold
