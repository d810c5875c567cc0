"""The model audit on transformers' own building blocks (issue 33; real extra): what the library does that a parity
check must take as it is.

- Mixture-of-experts layers: transformers 5 computes them with `grouped_mm`, which takes no float64, so the float64
  copy every parity check compares with raised and the checks fell back to a bare 1e-5 floor against the float32
  pass. The copy now computes its experts one by one ("eager", the same sum): a tiny Mixtral's cache parity is judged
  against it, also where the experts are a submodel's (a vision-language model's Mixtral); its twin, a tiny Jamba (experts beside a Mamba scan), still fails where its cache is wrong (a cached
  step of 3 tokens restarts the scan, `KNOWN` in benchmarks/sweep.py) and passes steps of 1.
- A model whose inputs nothing declares (Decision Transformer's states) is a usage error naming the dict to pass.
"""

from __future__ import annotations

import os

import pytest
import torch

import diagnostics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             num_local_experts=4, num_experts_per_tok=2)


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")


def _cache(model):
    torch.manual_seed(0)
    report = diagnostics.audit_model(model.eval(), causal=True, detectors=["cache_parity"])
    return report.result("cache_parity")


def test_a_mixture_of_experts_is_compared_with_its_float64_copy():
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(num_hidden_layers=2, **SMALL))
    result = _cache(model)
    assert result.verdict == "pass", (result.message, result.evidence)
    assert "against the float64 copy" in result.evidence and "no float64 copy" not in result.evidence, result.evidence
    assert model.config._experts_implementation != "eager"  # the user's model keeps its own


def test_a_language_model_of_experts_inside_a_composite_model_is_compared_with_its_float64_copy():
    """A vision-language model whose language model is a mixture of experts: its top config names no experts
    implementation ("eager", the default), its text config names `grouped_mm`. Read from the top config alone, the
    copy kept grouped_mm and raised, so cache_parity fell back to the bare 1e-5 floor (Nemotron 3.5 Transcribe, whose
    47-layer Nemotron-H differs by 1.45e-5 in float32 and FAILED for it). Every submodel's config is read now."""
    tf = _transformers()
    torch.manual_seed(0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, image_size=32, patch_size=8)
    config = tf.LlavaConfig(text_config=tf.MixtralConfig(num_hidden_layers=2, **SMALL).to_dict(),
                            vision_config=vision, image_token_index=SMALL["vocab_size"] - 1)
    model = tf.LlavaForConditionalGeneration(config)
    assert model.model.language_model.config._experts_implementation != "eager"  # the case: experts one level down
    result = _cache(model)
    assert result.verdict == "pass", (result.message, result.evidence)
    assert "against the float64 copy" in result.evidence and "no float64 copy" not in result.evidence, result.evidence
    assert model.model.language_model.config._experts_implementation != "eager"  # the user's model keeps its own


def test_a_hybrid_whose_cached_steps_of_several_tokens_restart_its_scan_still_fails():
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.JambaForCausalLM(tf.JambaConfig(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                               expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=4,
                                               **SMALL))
    result = _cache(model)
    assert result.verdict == "fail", (result.message, result.evidence)
    assert "steps of 3" in result.message and "steps of 1" not in result.message, result.message
    assert all("against the float64 copy" in s for s in result.evidence.split("; ")), result.evidence


def test_a_model_whose_inputs_nothing_declares_is_a_usage_error_naming_the_dict_to_pass():
    """Decision Transformer takes states, actions, returns and timesteps, none of which its config sizes: a usage
    error that says what to pass, written as the user writes it (was: example={{'states': ...}}, doubled braces)."""
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.DecisionTransformerModel(tf.DecisionTransformerConfig(hidden_size=32, n_layer=2, n_head=4)).eval()
    with pytest.raises(diagnostics.AuditUsageError) as raised:
        diagnostics.audit_model(model)
    message = str(raised.value)
    assert "pass example={'states': ...}, a dict of the model's inputs" in message and "{{" not in message, message


def test_a_t5_module_that_keeps_no_config_is_judged_at_its_models_scale():
    """LongT5's local attention keeps no `config`, so its family (T5: q·k multiplied by 1, the scale folded into the
    initialisation) was not found and `softmax_saturation` failed the correct model, "too sharp" by sqrt(d_kv). The
    family is now its model's. The twin: the same module inside a model of another family is judged by 1/sqrt(d_k)."""
    tf = _transformers()
    from diagnostics.model._inplace import declared_scale

    torch.manual_seed(0)
    config = tf.LongT5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                             vocab_size=128, local_radius=4, encoder_attention_type="local")
    model = tf.LongT5ForConditionalGeneration(config).eval()
    local = model.encoder.block[0].layer[0].LocalSelfAttention
    assert not hasattr(local, "config")
    assert declared_scale(local, model)[0] == 1.0
    assert declared_scale(local, tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1,
                                                            num_attention_heads=4, intermediate_size=64)))[0] is None
    report = diagnostics.audit_model(model, detectors=["softmax_saturation"])
    local_report = report.layers["encoder.block.0.layer.0.LocalSelfAttention"]
    assert local_report.result("softmax_saturation").verdict == "pass", str(report)


@pytest.mark.parametrize("attn_type, causal", [("bi", False), ("uni", True)])
def test_an_attention_type_the_config_names_bidirectional_makes_an_lm_head_class_not_causal(attn_type, causal):
    """XLNet's `*LMHeadModel` is a permutation LM: without a permutation mask its attention sees both ways, and its
    config says so (`attn_type="bi"`). Read as causal by its class name, the correct model failed prefix_causality
    and future_leakage. Its twin, `attn_type="uni"`, is left to the class name: causal."""
    tf = _transformers()
    torch.manual_seed(0)
    model = tf.XLNetLMHeadModel(tf.XLNetConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4, d_inner=64,
                                               attn_type=attn_type))
    report = diagnostics.audit_model(model.eval(), detectors=["prefix_causality"])
    assert report.causal is causal, report.causal_source
    assert report.causal_source == ("inferred: config.attn_type is 'bi' (bidirectional)" if not causal else
                                    "inferred: XLNetLMHeadModel is a causal LM")
