"""Real attention layers from torch, timm and Hugging Face transformers audit clean: no false findings.

Every layer is tiny and randomly initialised, built from a config; nothing is downloaded. Library
conventions (masks that block where ours allow, additive masks, rotary embeddings, the causal mask a
parent model builds) are handled by `diagnostics.adapters`, never by a detector. Where the audit does
report something on a real layer, the test checks it against the layer itself: each such finding is a
fact about that layer (see docs/auditing-a-layer.md). timm and transformers tests skip where the
packages are absent (`pip install -e ".[real]"`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics import adapters, audit

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from configs: nothing may come from a hub

D, H, T = 32, 4, 16  # d_model, heads, the audit's default probe length
ROW = T // 2  # the query the fully_masked_rows detector blocks entirely (batch row 0)
DOC = Path(__file__).resolve().parent.parent / "docs" / "auditing-a-layer.md"  # the page that shows these layers
CORE = ("runs", "output_shape", "finite_output", "softmax_saturation", "output_variance", "eval_determinism")
CAUSAL = ("future_leakage", "causal_alignment")

_torchvision_ops = None  # keeps the operator declarations below alive


def _import_torchvision() -> None:
    """Import torchvision, which timm needs and transformers imports whenever it is installed.

    Set up as the README says (torch 2.14.1 with torchvision 0.29.1) torchvision loads, and this does nothing;
    tests/test_setup.py checks that transformers and timm import there without it. Kept for an environment
    set up the old way: PyPI's torchvision 0.28.0 is a CUDA build whose extension (_C.so) cannot load beside
    the CPU build of torch 2.13.0, and `import torchvision` then fails in torchvision/_meta_registrations.py
    with "operator torchvision::nms does not exist", registering fake kernels for operators the extension
    would have defined. Only there, declare those operators' schemas and import again: the import succeeds,
    and torchvision's compiled operators (nms, roi_align, ...) stay unusable; no attention layer calls them."""
    global _torchvision_ops
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        return  # not installed: transformers does without it; timm is then skipped
    except RuntimeError as error:
        if "torchvision::nms does not exist" not in str(error):
            raise
        _torchvision_ops = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _torchvision_ops.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]  # the failed import's partial modules
        import torchvision  # noqa: F401


@pytest.fixture(scope="module")
def timm():
    _import_torchvision()
    return pytest.importorskip("timm", reason="timm is not installed: pip install -e \".[real]\"")


@pytest.fixture(scope="module")
def transformers():
    _import_torchvision()
    return pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")


def assert_clean(report, *, measured, warns=()):
    """No detector fails; only the detectors in `warns` may warn (the caller checks that they are right);
    every detector in `measured` ran and passed, so that the verdict is not clean by skipping."""
    __tracebackhide__ = True
    assert report.passed, str(report)
    assert set(report.fired()) <= set(warns), str(report)
    not_passed = {d: report.result(d).verdict for d in measured if report.result(d).verdict != "pass"}
    assert not not_passed, f"expected these detectors to measure and pass: {not_passed}\n{report}"


def nan_on_a_fully_masked_row(call, *, cross: bool) -> bool:
    """Call the layer as the fully_masked_rows detector does (eval, no grad, batch 2, every key blocked
    for query ROW of batch row 0): True when that row's output is NaN. Other rows must stay finite.
    `call(query, memory, allowed)` with inputs (B, T, D) and allowed (B, T, T), True = may attend."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, T, D, generator=gen)
    memory = torch.randn(2, T, D, generator=gen) if cross else query
    allowed = torch.ones(2, T, T, dtype=torch.bool)
    allowed[0, ROW] = False
    with torch.no_grad():
        out = call(query, memory, allowed)
    finite = torch.isfinite(out).all(-1)  # (B, T)
    assert finite[1].all() and finite[0, torch.arange(T) != ROW].all()
    return not bool(finite[0, ROW])


def agrees_on_fully_masked_rows(report, layer_call, *, cross: bool) -> bool:
    """The detector warns exactly when the layer gives NaN for a query with no key to attend."""
    return (report.result("fully_masked_rows").verdict == "warn") == nan_on_a_fully_masked_row(layer_call, cross=cross)


# ---- the adapters themselves ------------------------------------------------------------------------------


def test_convert_mask_speaks_each_librarys_convention():
    allowed = torch.tensor([[True, False], [True, True]]).view(1, 1, 2, 2)  # (B, 1, Tq, Tk), True = may attend
    assert adapters.convert_mask(allowed, "allowed") is allowed
    assert torch.equal(adapters.convert_mask(allowed, "blocked"), ~allowed)
    additive = adapters.convert_mask(allowed, "additive", dtype=torch.float16)
    assert additive.dtype == torch.float16
    assert additive.tolist() == [[[[0.0, torch.finfo(torch.float16).min], [0.0, 0.0]]]]
    per_head = adapters.convert_mask(allowed, "mha_blocked", num_heads=3)  # (B*H, Tq, Tk), True = blocked
    assert per_head.shape == (3, 2, 2) and torch.equal(per_head[2], ~allowed[0, 0])
    with pytest.raises(diagnostics.AuditUsageError, match=r"expected a mask convention from .*; got 'inverted'"):
        adapters.convert_mask(allowed, "inverted")


def test_function_adapter_names_and_encodes_the_mask_argument():
    seen = {}

    def additive_attention(q, k, v, bias=None, scale=None):  # a float mask, added to the scores
        seen.update(bias=bias, scale=scale, q=q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    adapted = adapters.function(additive_attention, mask_arg="bias", convention="additive", scale=0.25)
    report = audit(adapted, causal=True, scale=0.25)
    assert report.layer.startswith("test_function_adapter_names_and_encodes_the_mask_argument.<locals>."
                                   "additive_attention [bias: additive] (a function of q, k, v")
    assert_clean(report, measured=CORE + CAUSAL + ("mask_honoured", "fully_masked_rows"))
    # the mask in the inputs' dtype (the gradient check's last call runs a float64 copy)
    assert seen["bias"].dtype == seen["q"].dtype and seen["scale"] == 0.25


# ---- torch ------------------------------------------------------------------------------------------------


def _mha(batch_first: bool) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(D, H, batch_first=batch_first).eval()  # the audit runs layers in eval mode


def _mha_call(mha, need_weights):
    def call(query, memory, allowed):
        blocked = (~allowed).repeat_interleave(mha.num_heads, dim=0)  # (B*H, Tq, Tk), True = blocked
        if not mha.batch_first:
            query, memory = query.transpose(0, 1), memory.transpose(0, 1)  # (T, B, D)
        out = mha(query, memory, memory, attn_mask=blocked, need_weights=need_weights)[0]
        return out if mha.batch_first else out.transpose(0, 1)
    return call


# batch_first and need_weights in all four combinations; causal and bidirectional twice each, with each of them
MHA_SETTINGS = pytest.mark.parametrize("batch_first, need_weights, causal", [
    (True, True, False), (True, False, True), (False, True, True), (False, False, False),
], ids=["batch_first-weights", "batch_first-no_weights-causal", "seq_first-weights-causal", "seq_first-no_weights"])


@MHA_SETTINGS
def test_multihead_attention(batch_first, need_weights, causal):
    mha = _mha(batch_first)
    report = audit(mha, causal=causal, need_weights=need_weights)
    measured = CORE + ("mask_honoured",) + (CAUSAL if causal else ("query_locality",))
    measured += ("weight_row_sums",) if need_weights else ()
    assert_clean(report, measured=measured, warns=("fully_masked_rows",))
    # nn.MultiheadAttention gives NaN where every key of a query is blocked (torch's SDPA gives zeros)
    assert agrees_on_fully_masked_rows(report, _mha_call(mha, need_weights), cross=not causal)


@MHA_SETTINGS
def test_multihead_attention_through_key_padding_mask(batch_first, need_weights, causal):
    layer = adapters.mha_key_padding(_mha(batch_first), need_weights=need_weights)
    report = audit(layer, causal=causal)
    measured = CORE + ("mask_honoured",) + (CAUSAL if causal else ("query_locality",))
    assert_clean(report, measured=measured + (("weight_row_sums",) if need_weights else ()),
                 warns=("fully_masked_rows",))
    call = lambda query, memory, allowed: layer(query, memory, memory, allowed.unsqueeze(1))[0]  # noqa: E731
    assert agrees_on_fully_masked_rows(report, call, cross=not causal)


def test_key_padding_adapter_passes_padding_as_key_padding_mask_and_the_rest_as_attn_mask():
    layer = adapters.mha_key_padding(_mha(True))
    seen = {}
    layer.mha.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    allowed[1, :, :, 3:] = False  # batch row 1: keys 3 and 4 are padding
    x = torch.randn(2, 5, D)
    layer(x, x, x, allowed)
    assert torch.equal(seen["key_padding_mask"], torch.tensor([[False] * 5, [False] * 3 + [True] * 2]))
    assert seen["attn_mask"] is None  # nothing left that key padding cannot say
    causal = allowed & torch.ones(5, 5, dtype=torch.bool).tril()
    layer(x, x, x, causal)
    assert torch.equal(seen["key_padding_mask"][1], torch.tensor([False] * 3 + [True] * 2))
    assert seen["attn_mask"].shape == (2 * H, 5, 5)  # the causal part, True = blocked, per head
    assert torch.equal(seen["attn_mask"][0], ~torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("sdpa", [F.scaled_dot_product_attention, adapters.function(F.scaled_dot_product_attention)],
                         ids=["builtin", "adapted"])
def test_scaled_dot_product_attention_as_a_function(sdpa):
    # attn_mask takes our convention as is; the builtin's mask argument is read from its docstring
    assert_clean(audit(sdpa), measured=CORE + ("query_locality", "mask_honoured", "fully_masked_rows"))
    report = audit(sdpa, causal=True)  # causal through the mask the audit passes
    assert_clean(report, measured=CORE + CAUSAL + ("mask_honoured", "fully_masked_rows"))
    assert report.settings["pass_causal_mask"]


def test_scaled_dot_product_attention_is_causal_aligns_top_left():
    report = audit(functools.partial(F.scaled_dot_product_attention, is_causal=True), causal=True)
    # decoding the last queries over all keys differs from the full pass: the same top-left alignment
    assert report.fired() == {"causal_alignment": "fail", "decode_consistency": "fail"}
    assert report.result("future_leakage").verdict == "pass"
    # true of torch: with 2 queries over 4 keys the last query (position 3) does not see key 3
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    v2 = v.clone()
    v2[..., 3, :] += 1
    out, out2 = (F.scaled_dot_product_attention(q, k, w, is_causal=True) for w in (v, v2))
    assert torch.equal(out[..., -1, :], out2[..., -1, :])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_transformer_encoder_layer_self_attention(causal):
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(D, H, dim_feedforward=64, batch_first=True).eval()
    report = audit(encoder.self_attn, causal=causal)  # an nn.MultiheadAttention
    assert_clean(report, measured=CORE + ("weight_row_sums", "mask_honoured") + (CAUSAL if causal else ()),
                 warns=("fully_masked_rows",))
    assert agrees_on_fully_masked_rows(report, _mha_call(encoder.self_attn, True), cross=not causal)


def test_whole_transformer_encoder_layer_through_src_mask():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(D, H, dim_feedforward=64, batch_first=True).eval()
    layer = adapters.self_attention(encoder, mask_arg="src_mask", convention="mha_blocked", d_model=D, num_heads=H)
    report = audit(layer, causal=True)
    assert_clean(report, measured=CORE + ("mask_honoured", "future_leakage"), warns=("fully_masked_rows",))
    assert agrees_on_fully_masked_rows(report, lambda x, _, allowed: layer(x, allowed.unsqueeze(1)), cross=False)


# ---- timm -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "non_fused"])
def test_timm_vision_transformer_attention(timm, fused, causal):
    from timm.models.vision_transformer import Attention

    torch.manual_seed(0)
    attn = Attention(D, num_heads=H, qkv_bias=True).eval()
    attn.fused_attn = fused  # True: F.scaled_dot_product_attention; False: q * scale, matmul, softmax
    report = audit(attn, causal=causal)  # zero-config: the width from num_heads * head_dim; attn_mask is SDPA's
    measured = CORE + ("mask_honoured",) + (() if fused else ("weight_row_sums",)) + (CAUSAL[:1] if causal else ())
    assert_clean(report, measured=measured, warns=("fully_masked_rows",))
    # the non-fused path turns the bool mask into -inf before a plain softmax: NaN on a fully masked row
    assert agrees_on_fully_masked_rows(report, lambda x, _, allowed: attn(x, attn_mask=allowed.unsqueeze(1)),
                                       cross=False)
    assert (report.result("fully_masked_rows").verdict == "warn") is (not fused)


# ---- Hugging Face transformers ----------------------------------------------------------------------------


def _bert(transformers, implementation):
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = transformers.BertConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=1, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=T, attn_implementation=implementation)
    torch.manual_seed(0)
    return BertSelfAttention(config).eval(), config


def _gpt2(transformers, implementation):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = transformers.GPT2Config(n_embd=D, n_head=H, n_layer=1, n_positions=T, vocab_size=64, bos_token_id=0,
                                     eos_token_id=0, attn_implementation=implementation)
    torch.manual_seed(0)
    return GPT2Attention(config, layer_idx=0).eval(), config


def _llama(transformers, implementation):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, num_hidden_layers=1,
                                      intermediate_size=64, vocab_size=64, max_position_embeddings=T,
                                      attn_implementation=implementation)
    torch.manual_seed(0)
    return LlamaAttention(config, layer_idx=0).eval(), LlamaRotaryEmbedding(config), config


IMPLEMENTATIONS = ["eager", "sdpa"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bert_self_attention(transformers, implementation):
    layer, _ = _bert(transformers, implementation)
    report = audit(adapters.huggingface(layer))  # an encoder: bidirectional
    weights = ("weight_row_sums",) if implementation == "eager" else ()  # eager returns them
    assert_clean(report, measured=CORE + weights + ("mask_honoured", "fully_masked_rows"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gpt2_attention_with_the_mask_gpt2model_builds(transformers, implementation):
    layer, _ = _gpt2(transformers, implementation)
    report = audit(adapters.huggingface(layer), causal=True)
    # One true finding: GPT2's Conv1D projections do x.view(-1, D), which raises on a non-contiguous input
    # (GPT2Model always passes contiguous hidden states, so it is harmless there).
    assert report.fired() == {"runs": "fail"}
    # the non-contiguous probe of a full audit: output_variance's identical tokens, laid out transposed
    assert re.fullmatch(r"identical tokens, non-contiguous inputs \(output_variance\): RuntimeError: view size is not "
                        r"compatible .*", report.result("runs").evidence)
    x = torch.randn(2, T, D).transpose(-1, -2).contiguous().transpose(-1, -2)  # (B, T, D), not contiguous
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        layer(x)
    layer(x.contiguous())
    weights = ("weight_row_sums",) if implementation == "eager" else ()
    for detector in ("output_shape", "finite_output", "softmax_saturation", "output_variance", "mask_honoured",
                     "fully_masked_rows", "future_leakage", "eval_determinism") + weights:
        assert report.result(detector).verdict == "pass", str(report)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_llama_attention_with_rotary_embeddings_and_the_mask_llamamodel_builds(transformers, implementation):
    layer, rotary, _ = _llama(transformers, implementation)
    report = audit(adapters.huggingface(layer, rotary=rotary), causal=True)
    weights = ("weight_row_sums", "causal_alignment") if implementation == "eager" else ()
    assert_clean(report, measured=CORE + weights + ("mask_honoured", "fully_masked_rows", "future_leakage"))
    assert report.fired() == {}


@pytest.mark.parametrize("implementation, leaks", [("eager", True), ("sdpa", False)])
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_decoder_attention_alone_is_causal_only_where_the_library_makes_it(transformers, model, implementation,
                                                                            leaks):
    """Alone, with no mask: eager attention never builds the causal mask (its model does), so the audit
    reports the leak, which is true; sdpa attention applies `is_causal` when no mask is given."""
    if model == "gpt2":
        layer, _ = _gpt2(transformers, implementation)
        alone, call = adapters.huggingface(layer, pass_mask=False), layer
    else:
        layer, rotary, _ = _llama(transformers, implementation)
        alone = adapters.huggingface(layer, rotary=rotary, pass_mask=False)
        call = alone
    report = audit(alone, causal=True)
    assert report.result("future_leakage").verdict == ("fail" if leaks else "pass")
    # runs: GPT2's view, above; gradients: the same leak, seen in the backward pass
    assert set(report.fired()) - {"runs"} == ({"future_leakage", "gradients"} if leaks else set())
    # the same, seen directly: does changing the last token move the first output?
    x = torch.randn(1, T, D)
    x2 = x.clone()
    x2[:, -1] += 1
    with torch.no_grad():
        first, first2 = (call(inputs)[0][:, 0] for inputs in (x, x2))
    assert (not torch.equal(first, first2)) is leaks


def _parent_mask(model, attention_type, input_ids, padding) -> torch.Tensor | None:
    """The attention_mask a Hugging Face model passes to its first attention layer."""
    seen = {}
    layer = next(m for m in model.modules() if isinstance(m, attention_type))
    handle = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=padding)
    handle.remove()
    return seen.get("attention_mask")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model", ["bert", "gpt2", "llama"])
def test_adapter_passes_the_mask_the_parent_model_builds(transformers, model, implementation):
    """With padding (batch row 1 padded after 3 of 5 tokens), the model's own mask equals the adapter's
    translation of the audit's mask (causal for the decoders, and the padding)."""
    B, L = 2, 5
    padding = torch.ones(B, L, dtype=torch.long)
    padding[1, 3:] = 0
    if model == "bert":
        layer, config = _bert(transformers, implementation)
        parent = transformers.BertModel(config).eval()
    elif model == "gpt2":
        layer, config = _gpt2(transformers, implementation)
        parent = transformers.GPT2Model(config).eval()
    else:
        layer, _, config = _llama(transformers, implementation)
        parent = transformers.LlamaModel(config).eval()
    built = _parent_mask(parent, type(layer), torch.randint(0, 64, (B, L)), padding)
    allowed = padding.bool().view(B, 1, 1, L).expand(B, 1, L, L)  # (B, 1, Tq, Tk), True = may attend
    if model != "bert":
        allowed = allowed & torch.ones(L, L, dtype=torch.bool).tril()
    wrapper = adapters.huggingface(layer)
    assert torch.equal(adapters.convert_mask(allowed, wrapper.convention, dtype=torch.float32), built)


def test_readme_example_audits_llama_attention_alone_and_in_its_model(transformers, capsys):
    section = DOC.read_text().split("## Layers from torch, timm and Hugging Face transformers\n", 1)[1].split("\n## ", 1)[0]
    example = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "LlamaAttention" in b)
    exec(compile(example, str(DOC), "exec"), {"__name__": "readme_real_layers_example"})


# ---- the zoo: every attention class transformers builds from a tiny config, audited with no adapter ----------


@dataclasses.dataclass(frozen=True)
class Zoo:
    """One Hugging Face attention class, built from a tiny config (hidden 32, 4 heads) and audited zero-config:
    `audit(layer)`, with `causal=True` for decoders and `scale=` where the layer declares another scale.
    `fired`: the findings that are true of the layer, each checked against it in `test_zoo`."""

    family: str
    cls: str
    config: str
    kwargs: dict
    causal: bool = False
    scale: float | None = None
    fired: tuple = ()
    role: str = "encoder"  # encoder, decoder or cross-attention
    build_kw: dict = dataclasses.field(default_factory=dict)

    @property
    def call(self) -> str:
        return "audit(layer" + (", causal=True" if self.causal else "") + \
            (f", scale={self.scale}" if self.scale is not None else "") + ")"


_SIZES = dict(hidden_size=D, num_attention_heads=H, num_hidden_layers=1, intermediate_size=64, vocab_size=64,
              max_position_embeddings=64)
_GQA = dict(_SIZES, num_key_value_heads=2)
_GPT2 = dict(n_embd=D, n_head=H, n_layer=1, n_positions=64, vocab_size=64, bos_token_id=0, eos_token_id=0)
_NOT_CONTIGUOUS = ("runs",)  # GPT-2's Conv1D does x.view(-1, D): see test_gpt2_attention_with_the_mask_...
ZOO = [
    Zoo("bert", "BertSelfAttention", "BertConfig", _SIZES),
    Zoo("bert", "BertCrossAttention", "BertConfig", _SIZES, role="cross-attention"),
    Zoo("roberta", "RobertaSelfAttention", "RobertaConfig", _SIZES),
    Zoo("distilbert", "DistilBertSelfAttention", "DistilBertConfig",
        dict(dim=D, n_heads=H, n_layers=1, hidden_dim=64, vocab_size=64)),
    Zoo("albert", "AlbertAttention", "AlbertConfig", dict(_SIZES, embedding_size=16)),
    Zoo("electra", "ElectraSelfAttention", "ElectraConfig", dict(_SIZES, embedding_size=16)),
    Zoo("gpt2", "GPT2Attention", "GPT2Config", _GPT2, causal=True, fired=_NOT_CONTIGUOUS, role="decoder",
        build_kw=dict(layer_idx=0)),
    Zoo("gpt2", "GPT2Attention", "GPT2Config", _GPT2, fired=_NOT_CONTIGUOUS, role="cross-attention",
        build_kw=dict(layer_idx=0, is_cross_attention=True)),
    Zoo("gpt_neo", "GPTNeoSelfAttention", "GPTNeoConfig",
        dict(hidden_size=D, num_heads=H, num_layers=1, attention_types=[[["global"], 1]], max_position_embeddings=64,
             vocab_size=64), causal=True, scale=1.0, role="decoder", build_kw=dict(attention_type="global")),
    Zoo("gptj", "GPTJAttention", "GPTJConfig", dict(_GPT2, rotary_dim=4), causal=True, role="decoder",
        build_kw=dict(layer_idx=0)),
    Zoo("opt", "OPTAttention", "OPTConfig", dict(_SIZES, ffn_dim=64, word_embed_proj_dim=D), causal=True,
        role="decoder", build_kw=dict(layer_idx=0)),
    Zoo("falcon", "FalconAttention", "FalconConfig", _SIZES, causal=True, role="decoder", build_kw=dict(layer_idx=0)),
    *[Zoo(family, cls, config, kw, causal=True, role="decoder", build_kw=dict(layer_idx=0))
      for family, cls, config, kw in [
          ("llama", "LlamaAttention", "LlamaConfig", _GQA), ("mistral", "MistralAttention", "MistralConfig", _GQA),
          ("mixtral", "MixtralAttention", "MixtralConfig", _GQA), ("qwen2", "Qwen2Attention", "Qwen2Config", _GQA),
          ("qwen3", "Qwen3Attention", "Qwen3Config", dict(_GQA, head_dim=8)), ("phi", "PhiAttention", "PhiConfig", _SIZES),
          ("phi3", "Phi3Attention", "Phi3Config", _GQA), ("gemma", "GemmaAttention", "GemmaConfig", dict(_GQA, head_dim=8)),
          ("gemma2", "Gemma2Attention", "Gemma2Config",
           dict(_GQA, head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=None)),
          ("starcoder2", "Starcoder2Attention", "Starcoder2Config", _GQA)]],
    Zoo("t5", "T5Attention", "T5Config", dict(d_model=D, num_heads=H, d_kv=8, d_ff=64, num_layers=1, vocab_size=64),
        scale=1.0, build_kw=dict(has_relative_attention_bias=True, layer_idx=0)),
    Zoo("t5", "T5Attention", "T5Config", dict(d_model=D, num_heads=H, d_kv=8, d_ff=64, num_layers=1, vocab_size=64,
                                              is_decoder=True),
        causal=True, scale=1.0, role="decoder", build_kw=dict(has_relative_attention_bias=True, layer_idx=0)),
    Zoo("bart", "BartAttention", "BartConfig", dict(d_model=D), build_kw=dict(embed_dim=D, num_heads=H, layer_idx=0)),
    Zoo("bart", "BartAttention", "BartConfig", dict(d_model=D), causal=True, role="decoder",
        build_kw=dict(embed_dim=D, num_heads=H, is_decoder=True, is_causal=True, layer_idx=0)),
    Zoo("whisper", "WhisperAttention", "WhisperConfig", dict(d_model=D), build_kw=dict(embed_dim=D, num_heads=H,
                                                                                       layer_idx=0)),
    Zoo("vit", "ViTAttention", "ViTConfig", _SIZES),
    Zoo("deit", "DeiTAttention", "DeiTConfig", _SIZES),
    Zoo("clip", "CLIPAttention", "CLIPTextConfig", dict(_SIZES, bos_token_id=0, eos_token_id=0)),
    Zoo("siglip", "SiglipAttention", "SiglipTextConfig", _SIZES),
]
# (class, implementation) -> detectors known to fail falsely on it (a fault of the observer, not of the layer),
# none today. Such a row is still audited, and test_zoo asserts that exactly these fire on it, so that a fix
# shows as a failure that removes the entry. (Falcon in eager mode, which divides its scores in place after the
# matmul, `attention_scores /= math.sqrt(head_dim)`, was one: its eager row is audited and asserted clean.)
FALSE_FINDINGS: dict[tuple[str, str], tuple[str, ...]] = {}


def _zoo_id(z: Zoo) -> str:
    return f"{z.cls}-{z.role}"


def build_zoo_layer(transformers, z: Zoo, implementation: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{z.family}.modeling_{z.family}")
    config = getattr(transformers, z.config)(**z.kwargs, attn_implementation=implementation)
    cls = getattr(module, z.cls)
    kwargs = dict(z.build_kw)
    if "embed_dim" in kwargs:
        kwargs["config"] = config  # BART and Whisper take their sizes as arguments, the config by keyword
        layer = cls(**kwargs)
    else:
        layer = cls(config, **kwargs)
    torch.manual_seed(0)
    for p in layer.parameters():  # a fixed draw, whatever the construction order
        p.data.normal_(0, 0.2)
    return layer.eval()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("z", ZOO, ids=_zoo_id)
def test_zoo(transformers, z, implementation):
    layer = build_zoo_layer(transformers, z, implementation)
    false = FALSE_FINDINGS.get((z.cls, implementation), ())  # audited all the same: exactly these fire
    report = audit(layer, causal=z.causal, scale=z.scale)
    fired = report.fired()
    assert fired == {d: "fail" for d in (*z.fired, *false)}, str(report)
    assert report.status == ("failed" if report.fired() else "passed"), str(report)
    for detector in ("softmax_saturation", "output_variance", "mask_honoured", "eval_determinism") + \
            (("future_leakage",) if z.causal else ()) + (("query_locality",) if z.role == "cross-attention" else ()):
        if detector not in false:
            assert report.result(detector).verdict == "pass", str(report)
    if "runs" in z.fired:  # true of the layer: a non-contiguous (B, T, D) input raises in its Conv1D's view
        assert "non-contiguous inputs (output_variance): RuntimeError: view size is not compatible" in \
            report.result("runs").evidence
        x = torch.randn(2, T, D).transpose(-1, -2).contiguous().transpose(-1, -2)
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            layer(x, encoder_hidden_states=x) if z.role == "cross-attention" else layer(x)
    if z.scale is not None:  # true of the layer: its logits are q·k, unscaled; audited as 1/sqrt(d_k) it fails
        unscaled = audit(layer, causal=z.causal, detectors=["softmax_saturation"])
        assert unscaled.result("softmax_saturation").verdict == "fail"
        assert "q·k is multiplied by 1 before the softmax" in unscaled.result("softmax_saturation").evidence


CACHED = [z for z in ZOO if z.causal and z.cls != "GPTNeoSelfAttention"]  # GPT-Neo's layer takes no cache


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("z", CACHED, ids=_zoo_id)
def test_decoder_layers_decode_through_their_own_cache(transformers, z, implementation):
    """A causal Hugging Face layer with a `layer_idx` is prefilled and decoded through a DynamicCache it fills,
    its rotary positions offset by what the cache holds, and gives the full pass's rows."""
    layer = build_zoo_layer(transformers, z, implementation)
    result = audit(layer, causal=True, scale=z.scale, detectors=["cache_decoding"]).result("cache_decoding")
    assert result.verdict == "pass" and "DynamicCache it fills" in result.evidence, result


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_layer_that_drops_its_mask_once_the_cache_holds_keys_fails_cache_decoding(transformers, implementation):
    """The twin of the Llama row above: the same weights, the mask dropped whenever the cache is not empty (then
    sdpa's is_causal aligns top-left, and eager attends every new token's future)."""
    z = next(z for z in ZOO if z.cls == "LlamaAttention")
    layer = build_zoo_layer(transformers, z, implementation)

    broken = build_zoo_layer(transformers, z, implementation)  # the same weights, still a LlamaAttention
    original = broken.forward

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if cache is not None and cache.get_seq_length(broken.layer_idx) > 0:
            attention_mask = None  # BUG: the causal mask is dropped once the cache holds keys
        return original(hidden_states, position_embeddings, attention_mask, cache, **kwargs)

    broken.forward = forward  # patched on the instance, as a user's monkeypatch would be
    report = audit(broken, causal=True)
    assert report.result("cache_decoding").verdict == "fail", str(report)
    assert "3 new tokens" in report.result("cache_decoding").message, str(report)  # the first chunk of several
    assert not audit(layer, causal=True).fired(), "the correct twin"


def zoo_table() -> str:
    """docs/auditing-a-layer.md's table of Hugging Face layers, from ZOO: what `test_zoo` audits and expects."""
    rows = ["| model | layer | role | audit | result (eager and sdpa) |", "|---|---|---|---|---|"]
    for z in ZOO:
        result = "clean" if not z.fired else ", ".join(f"`{d}` fails (true: see below)" for d in z.fired)
        rows.append(f"| {z.family} | `{z.cls}` | {z.role} | `{z.call}` | {result} |")
    return "\n".join(rows)


def test_readme_zoo_table_is_the_tests_table():
    assert zoo_table() in DOC.read_text(), "regenerate with: python tests/test_real_layers.py"


if __name__ == "__main__":
    print(zoo_table())
