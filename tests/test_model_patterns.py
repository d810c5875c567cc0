"""Attention patterns at model level (issue 19): each layer's declared window or chunk read from the layer or its
config and checked in place (`sliding_window`, and `attention_pattern` in the layer's own audit under it); packed
documents kept apart (`packed_documents`); and Hugging Face sliding-window layers audited under
`pattern=sliding_window(W)`, as a layer and in their model, with the window patched off by one (by patching the
config or the model's mask builder, never the library's files).

Default run (torch only): models of our own, each correct one beside its broken twin on the same weights.
Real extra (transformers): Mistral and Gemma 2 sliding layers, Llama packed documents."""

from __future__ import annotations

import copy
import importlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics.model.window import declared_pattern, declared_window
from diagnostics.patterns import chunked, sliding_window

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T, D, H = 16, 32, 4


def audit(model, **kw):
    torch.manual_seed(1)
    return diagnostics.audit_model(model, **kw)


def located(report) -> set:
    return {(f.layer, f.detector) for f in report.findings}


# ---- where a layer declares its pattern -----------------------------------------------------------------------


def _module(**attrs) -> nn.Module:
    m = nn.Module()
    for name, value in attrs.items():
        setattr(m, name, value)
    return m


def test_the_declared_pattern_is_read_from_layer_types_the_layer_or_its_config():
    hybrid = SimpleNamespace(layer_types=["sliding_attention", "full_attention", "chunked_attention"],
                             sliding_window=5, attention_chunk_size=4)
    read = [declared_pattern(_module(config=hybrid, layer_idx=i)) for i in range(3)]
    assert [d and d.pattern.name for d in read] == ["sliding_window(5)", None, "chunked(4)"]
    assert read[0].source == "config.layer_types[0] = 'sliding_attention', config.sliding_window = 5"
    # layer_types wins over an attribute (Gemma 2 keeps both, and they agree); without it the attribute, then config
    assert declared_pattern(_module(config=hybrid, layer_idx=1, sliding_window=5)) is None
    assert declared_pattern(_module(sliding_window=3)).pattern.name == "sliding_window(3)"
    assert declared_pattern(_module(config=SimpleNamespace(attention_chunk_size=8))).pattern.name == "chunked(8)"
    off = SimpleNamespace(sliding_window=4, use_sliding_window=False)  # Qwen2's switch
    assert declared_pattern(_module(config=off)) is None and declared_window(_module(config=off)) is None
    own = declared_pattern(_module(attention_pattern=chunked(4)))
    assert own.label == "chunk 4" and own.source == "Module.attention_pattern"
    assert declared_window(_module(attention_pattern=chunked(4))) is None  # a chunk is not a window
    assert declared_pattern(_module(attention_pattern=sliding_window(2) | chunked(4))).band == 4
    bare = declared_pattern(_module(attention_pattern=lambda b, h, q, kv: (kv <= q) & (q - kv < 3)))  # a mask_mod
    assert bare.band == 3 and bare.kind == "" and bare.label == "<lambda>"
    assert declared_pattern(_module(attention_pattern=lambda b, h, q, kv: kv >= 0)) is None  # not causal: unchecked
    assert declared_pattern(_module(attention_pattern=lambda x: x.mean())) is None  # no mask_mod: nothing declared


# ---- our own models: a chunked decoder, packed documents --------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention over (B, T, D), its pattern from `allowed(q, kv)` (positions (T, 1) and (1, T)) and,
    where a sequence packs several documents, the document ids (B, T) it is given."""

    def __init__(self, allowed=None, pattern=None):
        super().__init__()
        self.qkv, self.out, self.allowed = nn.Linear(D, 3 * D), nn.Linear(D, D), allowed
        if pattern is not None:
            self.attention_pattern = pattern  # what the layer promises (diagnostics.patterns)

    def forward(self, x, docs=None):
        B, t, _ = x.shape  # batch, sequence length
        q, k, v = self.qkv(x).view(B, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, t, d)
        i, j = torch.arange(t).view(t, 1), torch.arange(t).view(1, t)
        allowed = (j <= i) if self.allowed is None else self.allowed(i, j)  # (t, t)
        if docs is not None and bool(docs.any()):  # packed: more than one document
            allowed = allowed & (docs.unsqueeze(-1) == docs.unsqueeze(-2))  # (B, t, t): block-diagonal
            allowed = allowed.unsqueeze(1)  # (B, 1, t, t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, t, d)
        return self.out(y.transpose(1, 2).reshape(B, t, D))


class LM(nn.Module):
    """A two-layer decoder-only LM: forward(input_ids, position_ids=None); learned positions. `packing`: whether its
    attention keeps documents apart, found where the position ids restart (as transformers finds them); `layers`:
    the attention of each layer."""

    causal = True

    def __init__(self, layers, packing: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(64, D), nn.Embedding(T, D)
        self.attn = nn.ModuleList(layers)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in layers)
        self.head, self.packing = nn.Linear(D, 64), packing

    def forward(self, input_ids, position_ids=None):
        B, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t).expand(B, t)
        docs = None
        if self.packing:  # a new document wherever the position does not follow the previous one
            step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
            docs = (step != 1).cumsum(-1)  # (B, t)
        x = self.wte(input_ids) + self.wpe(position_ids)  # positions restart with each document
        for attn, norm in zip(self.attn, self.norms):
            x = x + attn(norm(x), docs)
        return self.head(x)


C = 4


def chunk(i, j):
    return (j <= i) & (i // C == j // C)


def chunk_one_late(i, j):
    return (j <= i) & ((i - 1) // C == (j - 1) // C)  # BUG: each chunk boundary one position late


def test_a_chunk_boundary_one_late_fails_in_its_layer_and_the_correct_chunk_passes():
    chosen = ["sliding_window", "attention_pattern", "future_leakage"]  # the full-attention layer measured too
    good = audit(LM([Attention(), Attention(chunk, chunked(C))]), detectors=chosen)
    bad = audit(LM([Attention(), Attention(chunk_one_late, chunked(C))]), detectors=chosen)
    assert good.passed and good.result("sliding_window").verdict == "pass", str(good)
    assert "attn.1: chunk 4 exact (Attention.attention_pattern" in good.result("sliding_window").evidence
    assert good.layers["attn.1"].result("attention_pattern").verdict == "pass"  # measured in place, key by key
    assert located(bad) == {("attn.1", "sliding_window"), ("attn.1", "attention_pattern")}, str(bad)
    finding = bad.result("sliding_window")
    # column s = 0: key 0 is its own chunk now, so outputs 1..3 that chunked(4) lets see it do not move
    assert "did not move the output at t=3" in finding.evidence and "narrower than declared" in finding.evidence
    assert any(s.function == "chunk_one_late" for s in bad.layers["attn.1"].result("attention_pattern").where)


@pytest.fixture(scope="module")
def packed_reports():
    good, leaky = LM([Attention(), Attention()]), LM([Attention(), Attention()], packing=False)
    return {"good": audit(good, packed=True, detectors=["packed_documents"]),
            "leaky": audit(leaky, packed=True, detectors=["packed_documents"]),
            "undeclared": audit(good, detectors=["packed_documents"])}


def test_packed_documents_that_see_each_other_fail_at_the_first_layer_and_the_block_diagonal_twin_passes(
        packed_reports):
    good, leaky = packed_reports["good"].result("packed_documents"), packed_reports["leaky"].result("packed_documents")
    assert good.verdict == "pass" and "(0..4, 5..9, 10..15)" in good.message, good
    assert leaky.verdict == "fail" and leaky.layer == "attn.0", leaky  # the first layer a change crosses at
    assert "changing document 0 (t=0..4) moved" in leaky.evidence and "first t=5" in leaky.evidence, leaky.evidence
    assert "doc[q] == doc[kv]" in leaky.fix


def test_without_a_declaration_a_model_of_its_own_is_not_checked_and_says_why(packed_reports):
    r = packed_reports["undeclared"].result("packed_documents")
    assert r.verdict == "skip" and "pass packed=True to audit_model" in r.message, r
    with pytest.raises(diagnostics.AuditUsageError, match="packed=True, False or None"):
        diagnostics.audit_model(LM([Attention()]), packed="yes")
    off = audit(LM([Attention()], packing=False), packed=False, detectors=["packed_documents"])
    assert off.result("packed_documents").message.endswith("packed=False: not checked")


# ---- Hugging Face (real extra) ----------------------------------------------------------------------------------




W = 4
SIZES = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, intermediate_size=64, vocab_size=64,
             max_position_embeddings=64)
FAMILIES = {  # family: (config, attention, rotary, implementations, extra config)
    "mistral": ("MistralConfig", "MistralAttention", "MistralRotaryEmbedding", ("eager", "sdpa"), {}),
    "gemma2": ("Gemma2Config", "Gemma2Attention", "Gemma2RotaryEmbedding", ("eager",),
               dict(head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=None, final_logit_softcapping=None)),
}
CASES = [(f, i) for f, spec in FAMILIES.items() for i in spec[3]]


def hf_config(tf, family: str, impl: str, window: int, layers: int = 1):
    name, _, _, _, extra = FAMILIES[family]
    return getattr(tf, name)(**SIZES, **extra, num_hidden_layers=layers, sliding_window=window,
                             attn_implementation=impl)


class AsItsModelCalls(nn.Module):
    """A Hugging Face sliding-window attention layer called as its decoder model calls it: rotary positions from
    the cache length, the mask from the config by transformers' own `create_sliding_window_causal_mask`, and
    transformers' own cache built from the config (a sliding layer keeps the last sliding_window - 1 keys).
    Hugging Face layers do not build their window: the model's mask builder does, from `config.sliding_window`."""

    def __init__(self, tf, attention: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.attn, self.rotary, self.config = attention, rotary, config
        self._mask = importlib.import_module("transformers.masking_utils").create_sliding_window_causal_mask
        self._cache = tf.DynamicCache

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        B, t, _ = hidden_states.shape  # batch, new tokens
        if use_cache and past_key_values is None:
            past_key_values = self._cache(config=self.config)
        past = 0 if past_key_values is None else past_key_values.get_seq_length(0)
        positions = (past + torch.arange(t, device=hidden_states.device)).expand(B, t)  # (B, t)
        mask = self._mask(self.config, hidden_states, None, past_key_values, position_ids=positions)
        out, _ = self.attn(hidden_states, self.rotary(hidden_states, positions), mask, past_key_values)
        return (out, past_key_values) if use_cache else out


def hf_sliding_layer(tf, family: str, impl: str, *, window: int = W, dtype=torch.float32) -> AsItsModelCalls:
    _, attention, rotary, _, _ = FAMILIES[family]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = hf_config(tf, family, impl, window)
    torch.manual_seed(0)
    layer = getattr(module, attention)(config, layer_idx=0)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    return AsItsModelCalls(tf, layer, getattr(module, rotary)(config), config).to(dtype).eval()


def patched_window(layer: AsItsModelCalls, window: int) -> AsItsModelCalls:
    """The same layer and weights, its config's window changed (a copy of the config: the library untouched)."""
    broken = copy.deepcopy(layer)
    broken.config = copy.deepcopy(layer.config)
    broken.config.sliding_window = window
    broken.attn.config = broken.config
    return broken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family,impl", CASES)
def test_a_hugging_face_sliding_layer_passes_under_its_window_and_fails_it_off_by_one(family, impl, dtype, hf_transformers):
    tf = hf_transformers
    layer = hf_sliding_layer(tf, family, impl, dtype=dtype)
    report = diagnostics.audit(layer, pattern=sliding_window(W), seq_len=T)
    assert report.status == "passed", str(report)
    assert report.result("attention_pattern").verdict == "pass"
    decoded = report.result("cache_decoding")  # transformers' sliding cache, through its roll-over at W and 2W
    assert decoded.verdict == "pass" and f"rolls over, t={W} and {2 * W}" in decoded.evidence, decoded
    for window, finding in ((W + 1, "(leakage)"), (W - 1, "(over-masking)")):
        broken = diagnostics.audit(patched_window(layer, window), pattern=sliding_window(W), seq_len=T,
                                   detectors=["attention_pattern"]).result("attention_pattern")
        assert broken.verdict == "fail" and finding in broken.message, (window, broken.message, broken.evidence)


class ShortCache(AsItsModelCalls):
    """The same layer with transformers' sliding cache built for a window one shorter than the mask's: once the
    cache is full it has dropped a key the window still holds."""

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            short = copy.deepcopy(self.config)
            short.sliding_window = self.config.sliding_window - 1  # BUG: the cache keeps W - 2 keys, not W - 1
            past_key_values = self._cache(config=short)
        return super().forward(hidden_states, past_key_values, use_cache)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_hugging_face_sliding_cache_one_key_short_fails_cache_decoding_where_it_fills(impl, hf_transformers):
    tf = hf_transformers
    layer = hf_sliding_layer(tf, "mistral", impl)
    broken = copy.deepcopy(layer)
    broken.__class__ = ShortCache
    r = diagnostics.audit(broken, pattern=sliding_window(W), seq_len=T, detectors=["cache_decoding"])
    r = r.result("cache_decoding")
    # the prefill's cache keeps W - 2 = 2 keys: the token at t = W - 1 already misses one of its W
    assert r.verdict == "fail" and r.message.endswith(f"(from the 1 new token at t={W - 1})"), (r.message, r.evidence)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_hugging_face_sliding_layer_through_the_adapter_honours_the_windows_mask(impl, dtype, hf_transformers):
    """Through `adapters.huggingface` the audit gives the layer the pattern's mask, as its model would: the layer
    honours it (the window itself is the model's mask builder's, checked above and in the model)."""
    tf = hf_transformers
    layer = hf_sliding_layer(tf, "mistral", impl, dtype=dtype)
    adapted = diagnostics.adapters.huggingface(layer.attn, rotary=layer.rotary)
    r = diagnostics.audit(adapted, pattern=sliding_window(W), seq_len=T, detectors=["attention_pattern"])
    assert r.result("attention_pattern").verdict == "pass", str(r)


def hf_model(tf, family: str, *, window: int = 5):
    torch.manual_seed(0)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**SIZES, num_hidden_layers=2, attn_implementation="sdpa"))
    impl = "sdpa" if family == "mistral" else "eager"
    return getattr(tf, {"mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM"}[family])(
        hf_config(tf, family, impl, window, layers=2))


def widen_window_builder(monkeypatch, module_name: str, builder: str) -> None:
    """The model's own mask builder patched (in the model's module, for this test only) to build the window one key
    wider than the config it reads says."""
    module = importlib.import_module(module_name)
    original = getattr(module, builder)

    def one_wider(config, *args, **kwargs):
        wider = copy.copy(config)
        wider.sliding_window = config.sliding_window + 1  # BUG: the mask one key wider than the config's window
        return original(wider, *args, **kwargs)

    monkeypatch.setattr(module, builder, one_wider)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_a_hugging_face_model_whose_mask_builder_is_one_window_wider_fails_at_its_sliding_layers(family, monkeypatch, hf_transformers):
    """The model's own mask builder patched (in the model's module, for this test only) to build the window one
    wider than the config it reads says: every sliding layer sees one key too many, and the audit, reading the
    declared window from the config, names them; the unpatched model passes."""
    tf = hf_transformers
    chosen = ["sliding_window", "attention_pattern", "future_leakage"]  # the full-attention layers measured too
    good = audit(hf_model(tf, family), detectors=chosen)
    assert good.passed and good.result("sliding_window").verdict == "pass", str(good)
    widen_window_builder(monkeypatch, f"transformers.models.{family}.modeling_{family}",
                         "create_sliding_window_causal_mask")
    bad = audit(hf_model(tf, family), detectors=chosen)
    sliding = [p for p, m in hf_model(tf, family).named_modules() if p.endswith("self_attn") and declared_window(m)]
    assert bad.status == "failed" and bad.result("sliding_window").layer == sliding[0], str(bad)
    assert "the pattern is wider than declared" in bad.result("sliding_window").evidence
    assert {layer for layer, _ in located(bad)} == set(sliding), str(bad)  # the full-attention layers pass


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_hugging_face_packed_documents_pass_and_a_mask_that_ignores_the_restarts_fails(family, monkeypatch, hf_transformers):
    tf = hf_transformers
    good = audit(hf_model(tf, family), detectors=["packed_documents"]).result("packed_documents")
    assert good.verdict == "pass" and "transformers applied its packed-sequence mask" in good.evidence, good
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        if hasattr(module, name):
            original = getattr(module, name)

            def ignores_restarts(*args, original=original, **kwargs):
                kwargs["position_ids"] = None  # BUG: the mask is built without the position ids that restart
                return original(*args, **kwargs)

            monkeypatch.setattr(module, name, ignores_restarts)
    undeclared = audit(hf_model(tf, family), detectors=["packed_documents"]).result("packed_documents")
    assert undeclared.verdict == "skip" and "did not apply its packed-sequence mask" in undeclared.message
    leaky = audit(hf_model(tf, family), packed=True, detectors=["packed_documents"]).result("packed_documents")
    assert leaky.verdict == "fail" and leaky.layer == "model.layers.0.self_attn", leaky


def modernbert(tf):
    """ModernBERT's local layers: a window of config.sliding_window on both sides of the query (layers 1 and 2)."""
    torch.manual_seed(0)
    return tf.ModernBertModel(tf.ModernBertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        local_attention=4, global_attn_every_n_layers=3, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, attn_implementation="sdpa"))


def test_an_encoders_two_sided_window_passes_and_one_a_key_wider_fails_at_its_layers(monkeypatch, hf_transformers):
    """A layer that is not causal declares its window on both sides (|i - j| <= 2 here): read as one-sided, every
    correct local layer of ModernBERT failed `sliding_window`. The mask builder patched one key wider fails there."""
    tf = hf_transformers
    good = audit(modernbert(tf))
    assert good.passed, str(good)
    result = good.result("sliding_window")
    assert result.verdict == "pass" and "two_sided_window(2) exact" in result.evidence, result
    assert "s=0: t=0..2 moved" in result.evidence and "s=2: t=0..4 moved" in result.evidence, result.evidence
    widen_window_builder(monkeypatch, "transformers.models.modernbert.modeling_modernbert",
                         "create_bidirectional_sliding_window_mask")
    bad = audit(modernbert(tf))
    assert bad.status == "failed" and bad.result("sliding_window").layer == "layers.1.attn", str(bad)
    assert {layer for layer, _ in located(bad)} == {"layers.1.attn", "layers.2.attn"}, str(bad)
