"""The declared-pattern matrix (issue 19): every named pattern, in correct form, passes the whole audit through each
way of building it, and the same cell with the pattern off by one fails `attention_pattern`, on the same weights and
inputs.

    patterns   causal, sliding_window(4), chunked(4), prefix_lm(5), document(ids), document(ids) & causal,
               sliding_window(4) & document(ids), sliding_window(4) | prefix_block(5) (positions 0..4 bidirectional)
    backends   the reference (correct.MultiHeadAttention) given the pattern's mask by the audit; an SDPA function
               given it; a FlexAttention program whose block mask is the pattern's own mask_mod (its queries offset
               to the last Tq positions, as a decoder needs); a Hugging Face attention layer called as its model calls
               it, its mask built by transformers' own mask builder
    dtypes     float32, bfloat16
    inits      torch's default, GPT-2's std 0.02 (correct.gpt2_init_)

A correct cell asserts the whole audit passed with the pattern declared: no finding, and `attention_pattern` measured
(a pass, not a skip). A pattern that blocks the future is a decoder's: audited with causal=True as well, so decoding is
measured too (decode_consistency and attention_pattern over the last Tq queries; future_leakage for the Hugging Face
layers, which take one stream). Its twin: the mask the reference and the SDPA function are handed is built from the
off-by-one pattern (a caller whose mask builder is off by one; the same wrapper handed the right pattern passes), the
FlexAttention program's mask_mod is the off-by-one one, and the Hugging Face layer's config (or the inputs its mask
builder reads) is off by one while the declared pattern stays; each fails `attention_pattern`.

Which Hugging Face layer implements which pattern (transformers 5.24; its mask builders in `masking_utils`, as the
model's forward calls them; the attention layer itself only applies the mask it is given):

    causal                        LlamaAttention (eager) + create_causal_mask   twin: the encoder's builder,
                                  create_bidirectional_mask (leakage). Under sdpa that builder returns no mask and
                                  the layer's own is_causal keeps it causal: no bug to catch there
    sliding_window(4)             MistralAttention (sdpa, eager), Gemma2Attention (eager) +
                                  create_sliding_window_causal_mask, config.sliding_window = 4   twin: 5 (leakage)
    chunked(4)                    Llama4TextAttention + create_chunked_causal_mask, config.attention_chunk_size = 4
                                                                                twin: 5 (leakage)
    prefix_lm(5)                  GemmaAttention + create_causal_mask with PaliGemma's block_sequence_ids
                                  (where(token_type_ids == 0, 0, -1))           twin: a prefix of 4 (over-masking)
    document(ids) & causal        LlamaAttention + create_causal_mask given position ids that restart at each
                                  document (transformers' packed-sequence mask) twin: no position ids (leakage)
    sliding_window(4) & document  MistralAttention + create_sliding_window_causal_mask, packed the same way
                                                                                twin: no position ids (leakage)
    sliding_window(4) | prefix    MistralAttention + create_sliding_window_causal_mask with block_sequence_ids (the
    _block(5)                     mechanism Gemma 3 uses for bidirectional image blocks)   twin: a block of 4
    document(ids)                 none: transformers' bidirectional mask builder has no packed-sequence mask

The sliding and chunked layers also decode through transformers' own cache (cache_decoding passes). The full matrix
(96 torch cells, 36 Hugging Face cells) is marked `slow` (`pytest --slow`, or `-m slow`); the default run keeps one
torch cell and one Hugging Face cell per pattern (the dtype, init and torch backend rotating over the patterns).
Hugging Face cells skip where transformers is absent (the real extra: pip install -e ".[real]"); FlexAttention's first
eager call takes seconds, so its programs share one warm-up.
"""

from __future__ import annotations

import copy
import importlib
import os
import warnings
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import MultiHeadAttention, gpt2_init_
from diagnostics.patterns import Pattern, causal, chunked, document, prefix_lm, sliding_window

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every Hugging Face layer is built from a config: nothing downloaded

T, D, H = 16, 32, 4  # the probe's length, d_model, heads
W, C, P = 4, 4, 5  # window, chunk, prefix
DOCS = [0] * 5 + [1] * 6 + [2] * 5  # document ids per position: three packed documents
DOCS_LATE = [0] * 6 + [1] * 6 + [2] * 4  # the same documents, each boundary one position late


def prefix_block(n: int) -> Pattern:
    """Positions 0..n-1 see each other both ways (a bidirectional block, as Gemma 3's image tokens)."""
    return Pattern(lambda b, h, q, kv: (q < n) & (kv < n), f"prefix_block({n})", f"(q_idx < {n}) & (kv_idx < {n})")


@dataclass(frozen=True)
class Case:
    """A named pattern, its off-by-one twin and the finding the twin must produce."""

    pattern: Pattern
    broken: Pattern
    finding: str  # "leakage" or "over-masking": what attention_pattern reports for the twin


CASES = {
    "causal": Case(causal(), Pattern(lambda b, h, q, kv: kv <= q + 1, "one future key"), "leakage"),
    "sliding_window": Case(sliding_window(W), sliding_window(W + 1), "leakage"),
    "chunked": Case(chunked(C), chunked(C + 1), "leakage"),
    "prefix_lm": Case(prefix_lm(P), prefix_lm(P - 1), "over-masking"),
    "document": Case(document(DOCS), document(DOCS_LATE), "leakage"),
    "document & causal": Case(document(DOCS) & causal(), causal(), "leakage"),
    "sliding_window & document": Case(sliding_window(W) & document(DOCS), sliding_window(W), "leakage"),
    "sliding_window | prefix": Case(sliding_window(W) | prefix_block(P), sliding_window(W) | prefix_block(P - 1),
                                    "over-masking"),
}
DTYPES = [torch.float32, torch.bfloat16]
INITS = ["default", "gpt2"]
BACKENDS = ["reference", "sdpa", "flex"]


def verdict(report, det="attention_pattern"):
    return report.result(det)


def assert_whole_audit_passes(report):
    """No finding, and attention_pattern measured (a pass, not a skip)."""
    __tracebackhide__ = True
    r = verdict(report)
    assert r.verdict == "pass", (r.verdict, r.message, r.evidence)
    assert report.status == "passed" and not report.findings, str(report)


def assert_twin_fails(report, finding: str | None):
    __tracebackhide__ = True
    r = verdict(report)
    assert r.verdict == "fail", (r.verdict, r.message, r.evidence)
    assert finding is None or f"({finding})" in r.message, (r.message, r.evidence)


def initialised(module: nn.Module, init: str, dtype) -> nn.Module:
    if init == "gpt2":
        gpt2_init_(module)
    return module.to(dtype)


# ---- torch backends ----------------------------------------------------------------------------------------


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Handed(nn.Module):
    """The reference, handed the mask of `pattern` whatever the audit passes: a caller whose mask builder builds
    `pattern` (the declared one: a control; the off-by-one one: the twin)."""

    def __init__(self, layer: MultiHeadAttention, pattern: Pattern):
        super().__init__()
        self.layer, self.handed = layer, pattern

    def forward(self, query, key=None, value=None, mask=None):
        key = query if key is None else key
        own = self.handed.allowed(query.shape[0], query.shape[1], key.shape[1]).unsqueeze(1)  # (B, 1, Tq, Tk)
        return self.layer(query, key, value, own.to(query.device))


def handed_sdpa(pattern: Pattern):
    def attend(q, k, v, mask=None):
        own = pattern.allowed(q.shape[0], q.shape[-2], k.shape[-2]).unsqueeze(1)  # (B, 1, Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=own.to(q.device))

    return attend


try:  # FlexAttention (torch >= 2.5)
    from torch.nn.attention import flex_attention
except ImportError:
    flex_attention = None


def flex_program(mask_mod):
    """A FlexAttention program whose block mask is `mask_mod` (no mask argument: the pattern is its own). FlexAttention
    numbers the queries from 0; a decoder's Tq new queries are the last of the Tk positions, so they are offset."""
    def program(q, k, v):
        t_q, t_k = q.shape[-2], k.shape[-2]
        offset = t_k - t_q  # the cache length: queries at absolute positions offset..t_k-1 (bottom-right)

        def bottom_right(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + offset, kv_idx)

        block = flex_attention.create_block_mask(bottom_right, None, None, t_q, t_k, device=q.device)
        return flex_attention.flex_attention(q, k, v, block_mask=block)

    return program


@pytest.fixture(scope="module")
def flex(monkeypatch_module):
    """FlexAttention, warmed once for the module (its first eager call is the slow one). Its calls outside the
    observer skip dynamo compilation (torch's own switch, which the observer sets for its calls anyway)."""
    if flex_attention is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch >= 2.5 has)")
    monkeypatch_module.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.randn(2, H, T, D // H)
        flex_program(causal().mask_mod)(q, q, q)
    return flex_attention


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def blocks_the_future(pattern: Pattern) -> bool:
    """A decoder's pattern: audited with causal=True too, so that decoding (the last Tq queries over all Tk keys) is
    measured as well (future_leakage, causal_alignment, decode_consistency, attention_pattern while decoding)."""
    return not bool(pattern.allowed(1, T, T).triu(1).any())


def torch_audit(backend: str, pattern: Pattern, handed: Pattern | None, dtype, init: str, **kw):
    """Audit `backend` declared with `pattern` (and causal=True where it blocks the future); `handed`: the pattern its
    mask is built from instead (None: the audit's mask, or for FlexAttention the declared pattern's own mask_mod)."""
    kw.setdefault("causal", blocks_the_future(pattern))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention's eager path warns that it is unfused
        if backend == "reference":
            layer = initialised(MultiHeadAttention(D, H), init, dtype)
            if handed is not None:
                layer = Handed(layer, handed)
            return diagnostics.audit(layer, pattern=pattern, seq_len=T, **kw)
        sizes = dict(d_model=D, num_heads=H, dtype=dtype)
        if backend == "sdpa":
            fn = sdpa if handed is None else handed_sdpa(handed)
        else:
            fn = flex_program((pattern if handed is None else handed).mask_mod)
        return diagnostics.audit(fn, pattern=pattern, seq_len=T, **sizes, **kw)


def torch_cells():
    """(name, backend, dtype, init): the default run keeps one per pattern, backend, dtype and init rotating."""
    for i, name in enumerate(CASES):
        chosen = (BACKENDS[i % 3], DTYPES[i % 2], INITS[(i // 2) % 2])
        for backend in BACKENDS:
            for dtype in DTYPES:
                for init in INITS:
                    cell = (name, backend, dtype, init)
                    slow = () if (backend, dtype, init) == chosen else (pytest.mark.slow,)
                    yield pytest.param(*cell, marks=slow, id=f"{name}-{backend}-{str(dtype)[6:]}-{init}")


@pytest.mark.parametrize("name,backend,dtype,init", list(torch_cells()))
def test_torch_cell_passes_and_its_off_by_one_twin_fails(request, name, backend, dtype, init):
    case = CASES[name]
    if backend == "flex":
        request.getfixturevalue("flex")
    report = torch_audit(backend, case.pattern, None, dtype, init)
    assert_whole_audit_passes(report)
    if blocks_the_future(case.pattern):  # a decoder: measured decoding too, not skipped
        assert "while decoding" in verdict(report).message, verdict(report).message
        assert verdict(report, "decode_consistency").verdict == "pass", str(verdict(report, "decode_consistency"))
    twin = torch_audit(backend, case.pattern, case.broken, dtype, init, detectors=["attention_pattern"])
    # FlexAttention's mask_mod is compared with the declared one point by point: the finding is that comparison's
    assert_twin_fails(twin, None if backend == "flex" else case.finding)
    if backend != "flex":  # the wrapper that hands the twin its mask, handed the declared pattern: a pass
        control = torch_audit(backend, case.pattern, case.pattern, dtype, init, detectors=["attention_pattern"])
        assert verdict(control).verdict == "pass", (verdict(control).message, verdict(control).evidence)


def test_a_flex_program_that_numbers_its_queries_from_zero_fails_as_a_decoder_only(flex):
    """FlexAttention's q_idx counts the Tq queries from 0: without the offset, the last queries of a decoder over all
    keys are masked as the first positions (top-left). As a full pass it is the pattern; as a decoder it fails."""
    def top_left(q, k, v):
        block = flex.create_block_mask(sliding_window(W).mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return flex.flex_attention(q, k, v, block_mask=block)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decoder = diagnostics.audit(top_left, d_model=D, num_heads=H, seq_len=T, pattern=sliding_window(W), causal=True)
        full = diagnostics.audit(top_left, d_model=D, num_heads=H, seq_len=T, pattern=sliding_window(W))
    assert verdict(decoder, "decode_consistency").verdict == "fail", str(decoder)
    assert verdict(decoder).verdict == "fail" and "decoding with a cache of" in verdict(decoder).message, verdict(decoder)
    assert_whole_audit_passes(full)


# ---- Hugging Face layers (the real extra) ------------------------------------------------------------------------




def document_positions(ids: list[int], t: int) -> torch.Tensor:
    """(t,) position ids restarting at each document, as a packed batch gives them (positions past the ids belong
    to the last document, as diagnostics.patterns.document has it)."""
    ids = torch.tensor(ids + [ids[-1]] * max(0, t - len(ids)))[:t]  # (t,)
    start = torch.cat([torch.ones(1, dtype=torch.bool), ids[1:] != ids[:-1]])  # a document begins here
    first = torch.where(start, torch.arange(t), 0).cummax(0).values  # (t,): where each position's document began
    return torch.arange(t) - first


class AsItsModelCalls(nn.Module):
    """A Hugging Face attention layer called as its decoder model calls it: rotary positions, and the mask from
    transformers' own builder (`masking_utils.<builder>`, which reads the config), given what the model gives it:
    position ids (restarting at each of `documents` when packed) and `block_sequence_ids` (PaliGemma's
    `where(token_type_ids == 0, 0, -1)` for a prefix of `prefix` tokens). No cache: the pattern's own audit."""

    def __init__(self, attention: nn.Module, rotary: nn.Module, config, builder: str, *, documents=None,
                 prefix: int | None = None, pass_positions: bool = True):
        super().__init__()
        self.attn, self.rotary, self.config = attention, rotary, config
        self._mask = getattr(importlib.import_module("transformers.masking_utils"), builder)
        self.documents, self.prefix, self.pass_positions = documents, prefix, pass_positions

    def mask(self, hidden_states, past_key_values, positions):
        kw = {}
        if self.prefix is not None:
            B, t = positions.shape
            token_type_ids = (torch.arange(t, device=positions.device) >= self.prefix).long().expand(B, t)
            kw["block_sequence_ids"] = torch.where(token_type_ids == 0, 0, -1)  # as PaliGemmaModel builds them
        if self._mask.__name__ == "create_bidirectional_mask":
            return self._mask(self.config, hidden_states, None, past_key_values, **kw)
        return self._mask(self.config, hidden_states, None, past_key_values,
                          position_ids=positions if self.pass_positions else None, **kw)

    def attend(self, hidden_states, past_key_values=None):
        B, t, _ = hidden_states.shape  # batch, new tokens
        past = 0 if past_key_values is None else past_key_values.get_seq_length(0)
        if self.documents is not None:
            positions = document_positions(self.documents, t).to(hidden_states.device).expand(B, t)  # (B, t)
        else:
            positions = (past + torch.arange(t, device=hidden_states.device)).expand(B, t)  # (B, t)
        mask = self.mask(hidden_states, past_key_values, positions)
        out, _ = self.attn(hidden_states, self.rotary(hidden_states, positions), mask, past_key_values)
        return out

    def forward(self, hidden_states):
        return self.attend(hidden_states)


class Cached(AsItsModelCalls):
    """The same, with transformers' own cache built from the config (a sliding layer keeps the last W - 1 keys, a
    chunked one its chunk): the audit also decodes through it (cache_decoding)."""

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = importlib.import_module("transformers").DynamicCache(config=self.config)
        out = self.attend(hidden_states, past_key_values)
        return (out, past_key_values) if use_cache else out


@dataclass(frozen=True)
class HF:
    """A Hugging Face layer that implements a pattern: its family, attention implementation, config, mask builder,
    and the twin's change (`broken`: config fields, or the wrapper's own options), described in `bug`."""

    family: str
    impl: str
    builder: str
    bug: str
    config: dict = field(default_factory=dict)
    wrapper: dict = field(default_factory=dict)
    broken_config: dict = field(default_factory=dict)
    broken_wrapper: dict = field(default_factory=dict)
    cached: bool = True

    @property
    def id(self) -> str:
        return f"{self.family}-{self.impl}"


FAMILIES = {  # family: (module, config, attention, rotary, extra config)
    "llama": ("llama", "LlamaConfig", "LlamaAttention", "LlamaRotaryEmbedding", {}),
    "mistral": ("mistral", "MistralConfig", "MistralAttention", "MistralRotaryEmbedding", {}),
    "gemma": ("gemma", "GemmaConfig", "GemmaAttention", "GemmaRotaryEmbedding", dict(head_dim=D // H)),
    "gemma2": ("gemma2", "Gemma2Config", "Gemma2Attention", "Gemma2RotaryEmbedding",
               dict(head_dim=D // H, query_pre_attn_scalar=D // H, attn_logit_softcapping=None,
                    final_logit_softcapping=None)),
    "llama4": ("llama4", "Llama4TextConfig", "Llama4TextAttention", "Llama4TextRotaryEmbedding",
               dict(head_dim=D // H, intermediate_size_mlp=64, no_rope_layers=[1], use_qk_norm=False,
                    attn_temperature_tuning=False)),
}
SIZES = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=2, intermediate_size=64, vocab_size=64,
             max_position_embeddings=64, num_hidden_layers=1)
SLIDING = "create_sliding_window_causal_mask"
HF_LAYERS = {  # pattern: the layers that implement it, the first in the default run
    # eager: under sdpa the bidirectional builder returns no mask and the layer's own is_causal makes it causal anyway
    "causal": [HF("llama", "eager", "create_causal_mask", "the encoder's mask builder, create_bidirectional_mask",
                  broken_wrapper=dict(builder="create_bidirectional_mask"))],
    "sliding_window": [HF(f, impl, SLIDING, f"config.sliding_window = {W + 1}", config=dict(sliding_window=W),
                          broken_config=dict(sliding_window=W + 1))
                       for f, impl in (("mistral", "sdpa"), ("mistral", "eager"), ("gemma2", "eager"))],
    "chunked": [HF("llama4", "sdpa", "create_chunked_causal_mask", f"config.attention_chunk_size = {C + 1}",
                   config=dict(attention_chunk_size=C), broken_config=dict(attention_chunk_size=C + 1))],
    "prefix_lm": [HF("gemma", "sdpa", "create_causal_mask", f"token_type_ids marking a prefix of {P - 1}",
                     wrapper=dict(prefix=P), broken_wrapper=dict(prefix=P - 1), cached=False)],
    "document & causal": [HF("llama", "sdpa", "create_causal_mask", "the position ids not passed to the mask builder",
                             wrapper=dict(documents=DOCS), broken_wrapper=dict(pass_positions=False), cached=False)],
    "sliding_window & document": [HF("mistral", "sdpa", SLIDING, "the position ids not passed to the mask builder",
                                     config=dict(sliding_window=W), wrapper=dict(documents=DOCS),
                                     broken_wrapper=dict(pass_positions=False), cached=False)],
    "sliding_window | prefix": [HF("mistral", "sdpa", SLIDING, f"token_type_ids marking a block of {P - 1}",
                                   config=dict(sliding_window=W), wrapper=dict(prefix=P),
                                   broken_wrapper=dict(prefix=P - 1), cached=False)],
}
NO_HF_LAYER = {"document": "transformers' bidirectional mask builder has no packed-sequence mask"}
assert set(HF_LAYERS) | set(NO_HF_LAYER) == set(CASES)


def hf_layer(tf, spec: HF, *, broken: bool, dtype, init: str) -> AsItsModelCalls:
    """The layer of `spec` (its twin when `broken`), on the same weights either way."""
    module, config_name, attention, rotary, extra = FAMILIES[spec.family]
    module = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(tf, config_name)(**SIZES, **extra, **spec.config, attn_implementation=spec.impl)
    torch.manual_seed(0)
    layer = getattr(module, attention)(config, layer_idx=0)
    if broken:
        config = copy.deepcopy(config)  # the library untouched: a copy of the config, the same weights
        for name, value in spec.broken_config.items():
            setattr(config, name, value)
        layer.config = config
    wrapper = {**dict(builder=spec.builder), **spec.wrapper, **(spec.broken_wrapper if broken else {})}
    cls = Cached if spec.cached else AsItsModelCalls
    wrapped = cls(layer, getattr(module, rotary)(config), config, **wrapper)
    return initialised(wrapped, init, dtype).eval()


def hf_cells():
    """(name, spec, dtype, init): the default run keeps each pattern's first layer at one dtype and init, rotating."""
    for i, name in enumerate(HF_LAYERS):
        for j, spec in enumerate(HF_LAYERS[name]):
            for dtype in DTYPES:
                for init in INITS:
                    default = j == 0 and (dtype, init) == (DTYPES[(i + 1) % 2], INITS[(i // 2) % 2])
                    yield pytest.param(name, spec, dtype, init, marks=() if default else (pytest.mark.slow,),
                                       id=f"{name}-{spec.id}-{str(dtype)[6:]}-{init}")


@pytest.mark.parametrize("name,spec,dtype,init", list(hf_cells()))
def test_hugging_face_cell_passes_and_its_off_by_one_twin_fails(name, spec, dtype, init, hf_transformers):
    tf = hf_transformers
    case = CASES[name]
    layer = hf_layer(tf, spec, broken=False, dtype=dtype, init=init)
    report = diagnostics.audit(layer, pattern=case.pattern, causal=blocks_the_future(case.pattern), seq_len=T)
    assert_whole_audit_passes(report)
    if blocks_the_future(case.pattern):  # a decoder: its future measured too (one stream: no decoding without a cache)
        assert verdict(report, "future_leakage").verdict == "pass", str(verdict(report, "future_leakage"))
    if spec.cached:  # transformers' own cache, decoded through under the pattern
        assert verdict(report, "cache_decoding").verdict == "pass", str(verdict(report, "cache_decoding"))
    twin = hf_layer(tf, spec, broken=True, dtype=dtype, init=init)
    assert_twin_fails(diagnostics.audit(twin, pattern=case.pattern, causal=blocks_the_future(case.pattern), seq_len=T,
                                        detectors=["attention_pattern"]), case.finding)

