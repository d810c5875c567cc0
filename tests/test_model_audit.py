"""audit_model(): whole models audited clean, injected bugs caught and localised to their layer, the model untouched.

Default run (torch only, a few seconds): a nanoGPT-style GPT (`TinyGPT`, the reference attention in nanoGPT's
frame) with every catalog variant swapped into one layer; a decoder with the Hugging Face keyword protocol
(`ProtocolGPT`: padding, position ids, a cache, a sliding window) with the model-level bugs of public reports;
torch's nn.TransformerEncoder and nn.TransformerDecoder. Extras run (transformers, timm; skipped without them):
tiny Hugging Face models built from configs and timm's VisionTransformer, clean and with each catalog bug that
can live in an attention function injected into one layer: through transformers' AttentionInterface (T5 included),
or in timm by swapping one block's attention for a broken copy. `python tests/test_model_audit.py`
prints docs/auditing-a-model.md's architectures x bugs table; a test keeps that page equal to it.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from buggy_variants._registry import Setting, promised_pattern
from buggy_variants.teaching_model import ProtocolGPT, TinyGPT, inject
from diagnostics._guard import seed_rng

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest_plugins = ["pytester"]
DOC = Path(__file__).resolve().parent.parent / "docs" / "auditing-a-model.md"  # the page on auditing a model
T = 16


def audit(model, **kw):
    seed_rng(1)  # the audit's verdicts do not depend on the global RNG; the models' draws do
    return diagnostics.audit_model(model, **kw)


def located(report) -> set:
    """{(layer path or None, detector)} of every warning and failure."""
    return {(f.layer, f.detector) for f in report.findings}


def tiny_gpt(seed: int = 0, **kw) -> TinyGPT:
    seed_rng(seed)
    return TinyGPT(**kw)


def protocol_gpt(seed: int = 0, **kw) -> ProtocolGPT:
    seed_rng(seed)
    return ProtocolGPT(**kw)


# ---- nanoGPT-style GPT, and catalog variants swapped into one layer ---------------------------------------


@pytest.fixture(scope="module")
def clean_gpt_report():
    return audit(tiny_gpt())


def test_tiny_gpt_audits_clean_with_every_layer_found_and_measured(clean_gpt_report):
    report = clean_gpt_report
    assert report.passed and report.status == "passed", str(report)
    assert list(report.layers) == ["h.0.attn", "h.1.attn", "h.2.attn"]
    assert all(f.how == "observed softmax over (Tq, Tk) scores" for f in report.found)
    assert report.causal and "model.causal" in report.causal_source
    for rep in report.layers.values():  # each layer measured, not passed by skipping
        assert {r.detector for r in rep.results if r.verdict == "pass"} >= {
            "weight_row_sums", "softmax_saturation", "future_leakage", "causal_alignment", "gradients"}
    verdicts = {r.detector: r.verdict for r in report.results}
    assert verdicts["prefix_causality"] == verdicts["gradient_flow"] == verdicts["batch_invariance"] == "pass"
    assert verdicts["cache_parity"] == verdicts["padding_invariance"] == "skip"  # TinyGPT's forward takes neither
    reach = report.readings["prefix_reach"]
    assert set(reach["reach"]) == set(report.layers) and not any(reach["reach"].values())


MATRIX = dict(n_layer=2, block_size=8)  # the catalog matrix: the bug in the last block, 8 tokens (cheap)


def _observable_in_model(variant) -> bool:
    """Whether the bug can show inside TinyGPT: causal self-attention, no mask, T queries over T keys, eval mode."""
    t = MATRIX["block_size"]
    setting = Setting(32, 4, t, t, mask=None, self_attention=True, causal=True, batch=2, backward=True,
                      dropout=variant.layer_kwargs.get("dropout", 0.0),
                      pattern=promised_pattern(variant.reference(32, 4, causal=True)))
    return variant.detectable_when(setting)


_REFERENCE_TWINS: dict = {}


def _reference_twin(variant):
    """TinyGPT with block 1 the variant's correct twin (the reference configured like it), audited once per
    configuration."""
    key = tuple(sorted(variant.layer_kwargs.items()))
    if key not in _REFERENCE_TWINS:
        _REFERENCE_TWINS[key] = audit(inject(tiny_gpt(**MATRIX), 1, variant, reference=True))
    return _REFERENCE_TWINS[key]


@pytest.mark.parametrize("vid", sorted(VARIANTS))
def test_catalog_variant_in_one_layer_is_caught_there_or_changes_nothing(vid):
    variant = VARIANTS[vid]
    if variant.layer_kwargs.get("documents") is not None:
        pytest.skip("the documents are the layer's own constructor argument, which no model input states: the model "
                    "audit's packed_documents reads documents from position ids that restart, and TinyGPT takes none "
                    "(the layer audit under pattern=document(ids) catches it: tests/test_kill_matrix.py)")
    report = _variant_report(vid)
    if _observable_in_model(variant):
        assert report.status == "failed", str(report)
        layers = {layer for layer, _ in located(report)}
        assert "h.1.attn" in layers and layers <= {"h.1.attn", None}, str(report)  # localised to the layer
    else:  # a bug that needs masks, cross-attention or Tq != Tk computes the reference here: passing is right
        ids = torch.randint(64, (2, MATRIX["block_size"]))
        with torch.no_grad():
            same = torch.equal(inject(tiny_gpt(**MATRIX), 1, variant)(ids),
                               inject(tiny_gpt(**MATRIX), 1, variant, reference=True)(ids))
        assert same and report.passed, str(report)
    twin = _reference_twin(variant)  # the same model, weights and inputs, with the correct layer
    assert twin.passed, str(twin)


# ---- model-level bugs, in one layer or in the model ----------------------------------------------------------


MODEL_BUGS = {  # name: (ProtocolGPT options, detector(s) that must catch it, the layer it must be localised to)
    "cache drops the causal mask at prefill": (dict(layer_bugs={1: "prefill_unmasked"}), "cache_parity", "h.1.attn"),
    "rotary positions not offset by the cache": (dict(rotary=True, layer_bugs={1: "rotary_no_offset"}),
                                                 "cache_parity", "h.1.attn"),
    # the layer declares its window: the model-level check, and the layer's own audit in place under it
    "sliding window off by one": (dict(sliding_window=5, layer_bugs={1: "window_off_by_one"}),
                                  ("sliding_window", "attention_pattern"), "h.1.attn"),
    "position ids not offset under left padding": (dict(model_bug="positions_ignore_padding"), "padding_invariance",
                                                   "h.0.attn"),  # positions enter before the first layer
}


def _twin_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in ("layer_bugs", "model_bug")}


_TWINS: dict = {}


def _twin_report(**options):
    """The audit of the correct ProtocolGPT with these options, once per session (bugs share their twins)."""
    key = tuple(sorted(options.items()))
    if key not in _TWINS:
        _TWINS[key] = audit(protocol_gpt(**options))
    return _TWINS[key]


@pytest.mark.parametrize("name", sorted(MODEL_BUGS))
def test_model_level_bug_is_caught_and_localised_and_its_twin_passes(name):
    options, detectors, layer = MODEL_BUGS[name]
    detectors = (detectors,) if isinstance(detectors, str) else detectors
    report = audit(protocol_gpt(**options))
    assert report.status == "failed", str(report)
    assert located(report) == {(layer, d) for d in detectors}, str(report)
    twin = _twin_report(**_twin_options(options))
    assert twin.passed, str(twin)
    assert twin.result(detectors[0]).verdict == "pass"  # measured, not skipped


def test_cache_parity_reads_every_schedule_and_the_prefill_bug_shows_at_prefill():
    good = audit(protocol_gpt(rotary=True), detectors=["cache_parity"])
    bad = audit(protocol_gpt(layer_bugs={1: "prefill_unmasked"}), detectors=["cache_parity"])
    assert set(good.readings["cache_parity"]) == {"steps of 1", "steps of 3", "uneven"}
    assert all(r["error"] <= r["allowed"] for r in good.readings["cache_parity"].values())
    plan = bad.readings["cache_parity"]["steps of 1"]
    prefill = plan["plan"][0]
    assert min(plan["per_position"][:prefill - 1]) > 1e-2  # a prefill without its mask: earlier tokens see later ones


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cache_parity_catches_the_rotary_offset_bug_and_passes_its_twin(dtype):
    # bfloat16's own factor (FUDGE_BY_DTYPE): with 10 x its full pass's rounding, this bug passed there
    bad = audit(protocol_gpt(rotary=True, layer_bugs={1: "rotary_no_offset"}).to(dtype), detectors=["cache_parity"])
    good = audit(protocol_gpt(rotary=True).to(dtype), detectors=["cache_parity"])
    assert located(bad) == {("h.1.attn", "cache_parity")}, str(bad)
    assert good.passed and good.result("cache_parity").verdict == "pass", str(good)


def test_prefix_causality_names_the_first_layer_a_future_change_reaches():
    report = audit(inject(tiny_gpt(), 1, VARIANTS["missing_causal_mask"]), detectors=["prefix_causality"])
    assert report.result_layers["prefix_causality"] == "h.1.attn"
    reach = report.readings["prefix_reach"]["reach"]
    assert reach["h.0.attn"] == 0 and reach["h.1.attn"] > 0 and reach["h.2.attn"] > 0


# ---- torch's transformer stacks ------------------------------------------------------------------------------


def _encoder(layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def test_torch_transformer_encoder_audits_clean_non_causal_and_causal():
    report = audit(_encoder())
    assert report.passed, str(report)
    assert list(report.layers) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(f.how.startswith("torch nn.MultiheadAttention") for f in report.found)
    assert not report.causal and report.causal_source.startswith("assumed")
    assert report.result("padding_invariance").verdict == "pass"  # through src_key_padding_mask
    causal = audit(_encoder(), causal=True)  # the audit passes the causal mask, as a decoder-only user does
    assert causal.passed, str(causal)
    assert causal.result("prefix_causality").verdict == "pass"


def test_torch_transformer_encoder_without_its_causal_mask_leaks_at_the_first_layer():
    class Forgetful(nn.Module):  # a decoder-only model whose author forgot to pass the mask
        causal = True

        def __init__(self):
            super().__init__()
            self.stack = _encoder()

        def forward(self, x):
            return self.stack(x)

    report = audit(Forgetful(), example=torch.randn(2, T, 32))
    assert report.result("prefix_causality").verdict == "fail"
    assert report.result_layers["prefix_causality"] == "stack.layers.0.self_attn"
    assert ("stack.layers.0.self_attn", "future_leakage") in located(report)


def test_torch_transformer_decoder_audits_clean_with_its_cross_attention_found():
    torch.manual_seed(0)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 4, 64, batch_first=True), 2)
    report = audit(decoder, causal=True)
    assert report.passed, str(report)
    assert set(report.layers) == {"layers.0.self_attn", "layers.0.multihead_attn", "layers.1.self_attn",
                                  "layers.1.multihead_attn"}
    assert report.layers["layers.0.self_attn"].causal and not report.layers["layers.0.multihead_attn"].causal


# ---- cross-attention in place: the memory is the one the model passed (issue 17, class 11) ----------------------


class CrossAttention(nn.Module):
    """Cross-attention called the Hugging Face way, `attn(hidden_states, key_value_states)`: queries from the
    decoder stream, keys and values from the memory. `bug` names one step done wrong."""

    def __init__(self, bug: str | None = None, d_model: int = 32, num_heads: int = 4):
        super().__init__()
        self.bug, self.num_heads = bug, num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, hidden_states, key_value_states):
        B, t, D = hidden_states.shape  # batch, decoder positions, d_model
        H, d = self.num_heads, D // self.num_heads
        source = key_value_states
        if self.bug == "memory dropped":
            source = hidden_states  # BUG: keys and values from the decoder stream, the encoder output unused
        s = source.shape[1]  # memory positions
        q = self.q(hidden_states).view(B, t, H, d).transpose(1, 2)  # (B, H, t, d)
        k, v = (proj(source).view(B, s, H, d).transpose(1, 2) for proj in (self.k, self.v))  # (B, H, s, d)
        scale = 1.0 if self.bug == "no scale" else d ** -0.5  # BUG (no scale): q·k multiplied by 1
        y = F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, H, t, d)
        return self.o(y.transpose(1, 2).reshape(B, t, D))


class Captioner(nn.Module):
    """A one-block decoder over a fixed memory (an image encoder's output, learned here): causal self-attention,
    then cross-attention to the memory of 6 positions."""

    causal = True

    def __init__(self, bug: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(64, 32), nn.Embedding(T, 32)
        self.memory = nn.Parameter(torch.randn(1, 6, 32))
        self.ln_1, self.ln_2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.self_attn, self.cross_attn = KeywordAttention(), CrossAttention(bug)
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids):
        B, t = input_ids.shape
        x = self.wte(input_ids) + self.wpe(torch.arange(t))  # (B, t, D)
        x = x + self.self_attn(self.ln_1(x))
        x = x + self.cross_attn(self.ln_2(x), self.memory.expand(B, -1, -1))
        return self.head(x)


CROSS_MEASURED = ("query_locality", "keys_matter", "softmax_saturation", "batch_independence")


def test_cross_attention_is_audited_in_place_with_the_memory_the_model_passed():
    report = audit(Captioner())
    assert report.passed, str(report)
    cross = report.layers["cross_attn"]
    assert "memory key_value_states" in cross.layer and "a module given queries and a memory" in cross.layer, cross.layer
    # the memory is probed: the checks a one-stream wrapper had to skip are measured
    assert {r.detector for r in cross.results if r.verdict == "pass"} >= set(CROSS_MEASURED), str(cross)


@pytest.mark.parametrize("bug,caught", [("memory dropped", {"keys_matter", "query_locality"}),
                                        ("no scale", {"softmax_saturation"})])
def test_a_broken_cross_attention_fails_in_place_and_its_twin_passes(bug, caught):
    """Dropping the memory (keys and values from the decoder stream) was seen before only at model level (the
    decoder then sees its future, prefix_causality); in place the cross-attention's own audit now fails."""
    report = audit(Captioner(bug))
    at_cross = {d for layer, d in located(report) if layer == "cross_attn"}
    assert caught <= at_cross, str(report)
    assert {layer for layer, _ in located(report)} <= {"cross_attn", None}, str(report)  # the self-attention passes
    assert audit(Captioner()).passed


# ---- honest verdicts, an untouched model, misuse ---------------------------------------------------------------


def test_the_model_its_rng_and_its_gradients_are_left_exactly_as_they_were():
    model = protocol_gpt(rotary=True, sliding_window=6).train()
    model.h[0].attn.eval()  # mixed modes come back as they were
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    state = copy.deepcopy(model.state_dict())
    modes = [m.training for m in model.modules()]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    report = diagnostics.audit_model(model)
    assert report.passed, str(report)
    assert torch.equal(torch.rand(3), expected)  # the global RNG
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_models_copies_hold_what_a_deep_copy_holds_without_copying_what_they_need_not():
    from diagnostics.model._context import model_copy

    model = tiny_gpt()
    model.lm_head.weight = model.wte.weight  # tied, as GPT-2's lm_head and wte are
    model.register_buffer("gain", torch.ones(3))
    golden, expected = model_copy(model, dtype=torch.float64), copy.deepcopy(model).to(torch.float64)
    got, want = golden.state_dict(keep_vars=True), expected.state_dict(keep_vars=True)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert (got[k].dtype, type(got[k]), got[k].requires_grad) == (v.dtype, type(v), v.requires_grad), k
        assert torch.equal(got[k], v), k
    assert golden.lm_head.weight is golden.wte.weight  # still tied
    assert not {p.data_ptr() for p in golden.parameters()} & {p.data_ptr() for p in model.parameters()}
    twin = model_copy(model)  # backend_parity's: the model's own parameters, its own modules and buffers
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    assert twin.gain is not model.gain and torch.equal(twin.gain, model.gain)
    assert twin.h[0] is not model.h[0]


def test_a_model_without_attention_is_inconclusive_not_passed():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.mlp = nn.Embedding(64, 32), nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64))

        def forward(self, input_ids):
            return self.mlp(self.wte(input_ids))

    report = audit(Bag())
    assert report.status == "inconclusive" and not report.passed
    assert "no attention module was found" in report.status_reason


def test_a_model_that_raises_is_a_finding_localised_to_the_module_never_a_crash():
    report = audit(inject(tiny_gpt(), 2, VARIANTS["non_contiguous_view"]))
    assert report.status == "failed"
    assert ("h.2.attn", "model_runs") in located(report)
    assert "raised inside h.2.attn" in report.result("model_runs").evidence


def test_misuse_is_an_error_that_says_what_was_expected():
    with pytest.raises(diagnostics.AuditUsageError, match="expected an nn.Module"):
        diagnostics.audit_model(lambda x: x)
    with pytest.raises(diagnostics.AuditUsageError, match=r"seq_len <= 32, the model's context"):
        diagnostics.audit_model(tiny_gpt(), seq_len=64)
    with pytest.raises(diagnostics.AuditUsageError, match="expected example="):
        diagnostics.audit_model(nn.Sequential(nn.Linear(4, 4)))
    # a model that starts with a convolution is asked for pixels, not token ids (timm's usage errors, issue 33)
    with pytest.raises(diagnostics.AuditUsageError, match=r"Fix: pass example=torch.randn\(2, 3, H, W\) at the size "
                                                          r"the model was built for: it starts with Conv2d\(3 -> 8\) "
                                                          r"at 0"):
        diagnostics.audit_model(nn.Sequential(nn.Conv2d(3, 8, 2), nn.Flatten()))
    with pytest.raises(diagnostics.AuditUsageError, match="detector ids from"):
        diagnostics.audit_model(tiny_gpt(), detectors=["cache_parity", "no_such_check"])


@pytest.mark.parametrize("make", [lambda: nn.MultiheadAttention(32, 4, batch_first=True), lambda: KeywordAttention()],
                         ids=["torch MultiheadAttention", "own attention module"])
def test_a_bare_attention_layer_is_misuse_that_says_to_audit_it_as_a_layer(make):
    torch.manual_seed(0)
    layer = make()
    # was: an inconclusive model audit that said "no attention module was found" (issue 18, item 10)
    with pytest.raises(diagnostics.AuditUsageError, match=r"expected a whole model with attention layers in it; "
                                                          r"got \w+, which is one attention layer itself .*"
                                                          r"Fix: audit it as one layer: diagnostics.audit\(layer\)"):
        diagnostics.audit_model(layer, example=torch.randn(2, 8, 32))
    if isinstance(layer, KeywordAttention):  # the same layer inside a model: found and audited in place
        report = diagnostics.audit_model(nn.Sequential(layer), example=torch.randn(2, 8, 32))
        assert [f.path for f in report.found] == list(report.layers) == ["0"], str(report)


def test_report_prints_serialises_and_writes_html(tmp_path, clean_gpt_report):
    bad = audit(inject(tiny_gpt(), 1, VARIANTS["missing_scale"]))
    text = str(bad)
    assert text.startswith("model audit of TinyGPT: FAILED") and "FAIL softmax_saturation at h.1.attn" in text
    finding = next(f for f in bad.findings if f.detector == "softmax_saturation")
    assert finding.layer == "h.1.attn" and finding.fix and finding.evidence
    data = bad.to_dict()
    assert data["status"] == "failed" and set(data["layers"]) == {"h.0.attn", "h.1.attn", "h.2.attn"}
    assert {"detector": "softmax_saturation", "layer": "h.1.attn"}.items() <= next(
        f for f in data["findings"] if f["detector"] == "softmax_saturation").items()
    path = tmp_path / "model.html"
    bad.to_html(path)
    page = path.read_text()
    assert "h.1.attn" in page and "softmax_saturation" in page and "<script" not in page
    assert "PASSED" in str(clean_gpt_report).splitlines()[0]


# ---- Hugging Face and timm (extras run) ------------------------------------------------------------------------


def _import_torchvision() -> None:
    """tests/test_real_layers.py's `_import_torchvision` (PyPI's CUDA torchvision cannot load its extension
    beside the CPU torch), loaded from its path once: tests import nothing from each other by name, so that the
    suite also runs under --import-mode=importlib."""
    if "real_layers_tests" not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location("real_layers_tests", Path(__file__).with_name("test_real_layers.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    sys.modules["real_layers_tests"]._import_torchvision()


def _need(name: str):
    _import_torchvision()
    return pytest.importorskip(name, reason=f"{name} is not installed: pip install -e \".[real]\"")


COMMON = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)


def hf_model(tf, name: str, impl: str):
    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                bos_token_id=0, eos_token_id=0, attn_implementation=impl))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, num_key_value_heads=2, attn_implementation=impl,
                                                  **COMMON))
    if name == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(hidden_size=32, num_key_value_heads=2, sliding_window=5,
                                                      attn_implementation=impl, **COMMON))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(hidden_size=32, num_key_value_heads=2, attn_implementation=impl,
                                                  **COMMON))
    if name == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(hidden_size=32, num_key_value_heads=2, head_dim=8,
                                                  attn_implementation=impl, **COMMON))
    if name == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(hidden_size=32, num_key_value_heads=2, pad_token_id=0,
                                                attn_implementation=impl, **COMMON))
    if name == "bert":
        return tf.BertModel(tf.BertConfig(hidden_size=32, attn_implementation=impl, **COMMON))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                         num_heads=4, attn_implementation=impl))
    if name == "bart":
        return tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            attn_implementation=impl))
    if name == "marian":  # its decoder has a token embedding of its own (not in HF: the README's rows)
        return tf.MarianMTModel(tf.MarianConfig(
            vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            pad_token_id=0, decoder_start_token_id=0, attn_implementation=impl))
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, image_size=16, patch_size=4, attn_implementation=impl))
    raise KeyError(name)


HF = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3", "bert", "t5", "bart", "vit")
CAUSAL_HF = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3", "t5", "bart")
_MEMO: dict = {}


def hf_report(tf, name: str, impl: str):
    """The audit of a tiny Hugging Face model, once per session (the tests and the README table share it)."""
    if (name, impl) not in _MEMO:
        _MEMO[name, impl] = audit(hf_model(tf, name, impl))
    return _MEMO[name, impl]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", HF)
def test_hugging_face_model_audits_clean(name, impl):
    tf = _need("transformers")
    report = hf_report(tf, name, impl)
    assert report.layers and all(f.how.startswith("Hugging Face attention class") for f in report.found)
    assert report.causal == (name in CAUSAL_HF)
    # eager Llama and Gemma compute their softmax in float32 on purpose: the gradient check's float64 copy keeps
    # those casts at float64, so its finite differences measure the gradient, not float32 rounding
    assert report.passed, str(report)
    measured = {r.detector for r in report.results if r.verdict == "pass"}
    assert {"batch_invariance", "backend_parity", "gradient_flow"} <= measured
    if name in CAUSAL_HF:
        assert {"prefix_causality", "cache_parity", "padding_invariance"} <= measured
    if name == "mistral":
        assert report.result("sliding_window").verdict == "pass"


def test_encoder_decoder_cross_attention_is_measured_in_place_with_the_encoder_output_as_memory():
    tf = _need("transformers")
    for name, path in (("bart", "model.decoder.layers.0.encoder_attn"), ("t5", "decoder.block.1.layer.1.EncDecAttention"),
                       ("marian", "model.decoder.layers.0.encoder_attn")):
        report = hf_report(tf, name, "sdpa")
        # Marian: gradient_flow took the encoder's embedding for the decoder's (its decoder has its own), and
        # failed the model: every decoder output sees every encoder position
        assert report.passed, str(report)
        cross = report.layers[path]
        assert "a module given queries and a memory" in cross.layer, cross.layer
        assert {r.detector for r in cross.results if r.verdict == "pass"} >= set(CROSS_MEASURED), str(cross)


def test_bart_cross_attention_with_its_memory_dropped_fails_in_place():
    """BART's encoder_attn patched on the instance to take its keys and values from the decoder stream (the encoder
    output it is passed ignored): its in-place audit fails with the cause at the layer; before the memory was
    probed it passed there, and only the model's prefix_causality saw the decoder's future leak in."""
    tf = _need("transformers")
    model = hf_model(tf, "bart", "sdpa")
    attn = model.model.decoder.layers[0].encoder_attn
    original = attn.forward

    def forward(hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
        return original(hidden_states, None, None, None, **kwargs)  # BUG: the memory dropped

    attn.forward = forward
    report = audit(model, seq_len=BUG_SEQ_LEN)
    path = "model.decoder.layers.0.encoder_attn"
    assert {"keys_matter", "query_locality"} <= {d for layer, d in located(report) if layer == path}, str(report)
    assert report.layers[path].result("query_locality").where, str(report.layers[path])
    assert hf_bug_report(tf, "bart", "reference")[0].passed


def register_attention(name: str, fn):
    """`fn` registered as transformers' attention implementation `name`, with sdpa's masks (benchmarks/sweep.py
    injects its bugs through it too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)  # the model builds sdpa's masks for it


# Catalog variants written as attention functions. Each kind breaks the one step its catalog class overrides
# (buggy_variants/_catalog.py), in an explicit attention computed step by step like correct.MultiHeadAttention;
# "reference" is that explicit attention with nothing broken (the twin that proves the explicit path is right).
INJECTED = ("missing_scale", "scaled_by_d_model", "no_softmax", "mask_after_softmax", "missing_causal_mask",
            "softmax_wrong_dim", "heads_merged_without_transpose", "mask_polarity_inverted",
            "causal_mask_misaligned", "causal_diagonal_masked", "dropout_in_eval", "fully_masked_row_nan",
            "heads_merged_sequence_first", "padding_mask_replaces_causal", "double_softmax", "detached_softmax")
NOT_INJECTED = {  # catalog variants with nothing to break inside an attention function, and why
    "swapped_self_cross": "the function receives q, k and v already projected: which stream they came from is "
                          "decided before it",
    "keys_from_query_stream": "the function receives q, k and v already projected",
    "non_contiguous_view": "the model merges the heads itself, after the function, with reshape()",
    "rotary_not_offset": "rotary positions are applied before the function (ProtocolGPT's rotary bug covers it)",
}


def _safe_softmax(scores):
    """softmax over keys; a row with every key blocked gets zero weights, as torch's SDPA gives it."""
    return torch.softmax(scores, dim=-1).masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)


def _attend(kind: str, query, key, value, allowed, scaling: float, *, bias=None, causal: bool = False,
            dropout: float = 0.0, sinks=None, softcap: float | None = None):
    """Attention step by step with the step `kind` names broken; `allowed` (.., Tq, Tk) True = may attend (or None),
    `causal` whether the layer is a causal one; `sinks` (H,), a learned logit per head that each softmax row takes
    as one more key whose weight is then dropped (GPT-OSS's, MiMo-V2's `s_aux`, as their eager functions do);
    `softcap`, the scaled scores capped at +-softcap by softcap x tanh(scores / softcap) before the mask (Gemma 2's).
    Returns (B, Tq, H, d), as Hugging Face's functions do. Axes between the batch and the last three are kept as they
    come ((B, H, blocks, T, d): NesT's attention within each block, as the layer hands it to SDPA, the blocks read as
    the heads), so that the weights keep the shape the layer's own call has."""
    B, (H, Tq, d) = query.shape[0], query.shape[-3:]  # batch, query heads, queries, head width
    Tk, n_rep = key.shape[-2], H // key.shape[-3]
    if kind == "grouped_heads_wrong_order":  # query head h reads key/value head h % G, not h // n_rep: the bug
        key, value = key.repeat(1, n_rep, 1, 1), value.repeat(1, n_rep, 1, 1)
    else:
        key = key.repeat_interleave(n_rep, dim=-3)  # (B, H, Tk, d): grouped key/value heads shared by n_rep queries
        value = value.repeat_interleave(n_rep, dim=-3)
    scores = query @ key.transpose(-2, -1)  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    scale = {"missing_scale": 1.0, "scaled_by_d_model": scaling / H ** 0.5}.get(kind, scaling)  # d_model = H d
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias  # T5's relative position bias
    q_pos = torch.arange(Tq, device=query.device)[:, None] + (Tk - Tq)  # bottom-right: the last query is the last key
    k_pos = torch.arange(Tk, device=query.device)[None, :]
    if causal and kind == "causal_mask_misaligned":  # (Tq, Tk) aligned top-left: new queries lose their newest keys
        allowed = (allowed if allowed is not None else True) & (torch.arange(Tq, device=query.device)[:, None] >= k_pos)
    if causal and kind == "causal_diagonal_masked":  # each query blocked from its own key too
        allowed = (allowed if allowed is not None else True) & (k_pos < q_pos)
    if kind == "missing_causal_mask" and allowed is not None:  # the padding mask kept, causality (and window) gone
        allowed = allowed.any(dim=-2, keepdim=True)  # (.., 1, Tk): the keys some query may attend
    def with_sinks(s):  # (B, H, Tq, Tk + 1): the sink's logit as the last key's
        return s if sinks is None else torch.cat([s, sinks.reshape(1, -1, 1, 1).to(s).expand(B, H, Tq, 1)], dim=-1)

    if kind == "mask_after_softmax":
        weights = _safe_softmax(with_sinks(scores))[..., :Tk]  # normalised over every key, blocked ones included
        weights = weights if allowed is None else weights.masked_fill(~allowed, 0.0)  # kept rows sum to < 1
    else:
        scores = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
        weights = {"no_softmax": lambda s: s, "softmax_wrong_dim": lambda s: torch.softmax(s, dim=-2),
                   "fully_masked_row_nan": lambda s: torch.softmax(s, dim=-1),
                   "double_softmax": lambda s: _safe_softmax(_safe_softmax(s))}.get(kind, _safe_softmax)(
            with_sinks(scores))[..., :Tk]
    if kind == "detached_softmax":
        weights = weights.detach()  # no gradient reaches q and k
    if kind == "dropout_in_eval":
        weights = nn.functional.dropout(weights, p=0.1, training=True)  # configured 0.1, left on after eval()
    elif dropout:
        weights = nn.functional.dropout(weights, p=dropout, training=True)
    out = weights @ value  # (B,H,Tq,Tk) x (B,H,Tk,d) -> (B,H,Tq,d)
    if kind == "heads_merged_without_transpose":
        return out.reshape(B, Tq, H, d)  # heads and positions interleaved
    if kind == "heads_merged_sequence_first":
        return out.permute(2, 0, 1, 3).reshape(B, Tq, H, d)  # (Tq, B, H, d) read as (B, Tq, H, d)
    return out.transpose(-3, -2).contiguous()  # (B, Tq, H, d)


def bug_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  position_bias=None, **kw):
    """An attention function for transformers' AttentionInterface: sdpa's, except in the module marked
    `_test_bug = kind` (a mark that copies of the module keep, as they keep a bug in code), which runs `_attend`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kind = getattr(module, "_test_bug", None)
    sinks = kw.pop("s_aux", None)  # learned sinks: sdpa's function takes none, so the explicit attention runs
    # a sparse attention's chosen keys, (B, Tq, top-k) indices that a kernel of its own reads (DeepSeek-V3.2's DSA,
    # HY-V4's): the model masks the others itself only for "eager" and "sdpa", so any other function must
    indices = kw.pop("indices", None)
    softcap = kw.pop("softcap", None)  # Gemma 2's capped logits: sdpa's function raises on them
    if kind is None and (sinks is not None or indices is not None or softcap is not None):
        kind = "reference"
    if kind is not None:
        module._test_scaling = scaling  # the scale the layer hands its function: 1 where it scaled q itself
        module._test_groups = query.shape[1] // key.shape[1]  # query heads per key/value head
    if kind is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kw)
    Tq, Tk = query.shape[2], key.shape[2]
    layer_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # sdpa's rule: with no mask the model relies on is_causal (a causal square over the first Tq keys)
    square = Tq > 1 and attention_mask is None and layer_causal
    if square and Tk > Tq:
        key, value, Tk = key[:, :, :Tq], value[:, :, :Tq], Tq
        position_bias = None if position_bias is None else position_bias[..., :Tq]
    allowed, kw_bias = None, position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            allowed = attention_mask
        else:  # an additive float mask: its blocked entries are the dtype's minimum
            allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
            position_bias = attention_mask.masked_fill(~allowed, 0) + (0 if position_bias is None else position_bias)
    elif square:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril()
    if indices is not None:
        chosen = torch.zeros(query.shape[0], Tq, Tk, dtype=torch.bool, device=query.device)
        chosen = chosen.scatter(-1, indices.long(), True).unsqueeze(1)  # (B, 1, Tq, Tk)
        allowed = chosen if allowed is None else allowed & chosen
    if kind == "mask_polarity_inverted" and attention_mask is not None:  # the model's mask read as True = blocked
        allowed = ~allowed
        if layer_causal:  # the layer's own causal mask stays right
            allowed = allowed & torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril(Tk - Tq)
    if kind == "padding_mask_replaces_causal" and attention_mask is not None:  # keep the padded keys only
        allowed = allowed.any(dim=-2, keepdim=True)  # (B, 1, 1, Tk): the keys some query may attend
    if kind == "mask_ignored":  # the model's mask (causal, padding, window) never applied; a position bias kept
        allowed, position_bias = None, kw_bias
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _attend(kind, query, key, value, allowed, scale, bias=position_bias, causal=layer_causal,
                   dropout=dropout, sinks=sinks, softcap=softcap), None


def test_the_explicit_attention_takes_sinks_and_chosen_keys_as_the_models_own_eager_functions_do():
    """The sweep's explicit attention (every layer of a model given "sweep_bugs" runs it) must be the model's own
    attention where nothing is broken: with learned sinks (`s_aux`: GPT-OSS, MiMo-V2) it equals GPT-OSS's eager
    function, and a sparse attention's chosen keys (`indices`: DSA, which masks the others itself only for "eager"
    and "sdpa") are the only keys it attends. Without either it was sdpa's, and the correct MiMo-V2 and HY-V4 failed
    parameters_used (the sinks, the indexer unused), so none of their bugs was judged."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 6, 8
    q, k, v = (torch.randn(B, H, T, d, generator=gen) for _ in range(3))
    module = nn.Module()
    module.sinks, module.num_key_value_groups = nn.Parameter(torch.randn(H, generator=gen)), 1
    module.eval()
    causal = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), torch.finfo(q.dtype).min)
    mask = causal.expand(B, 1, T, T)
    ours, _ = bug_attention(module, q, k, v, mask, scaling=d ** -0.5, s_aux=module.sinks)
    theirs, _ = eager_attention_forward(module, q, k, v, mask, scaling=d ** -0.5)
    torch.testing.assert_close(ours, theirs)
    no_sinks, _ = bug_attention(module, q, k, v, mask, scaling=d ** -0.5)
    assert not torch.allclose(no_sinks, theirs, atol=1e-3)  # the sinks take weight: leaving them out is seen
    chosen = torch.stack([torch.randperm(T, generator=gen)[:3] for _ in range(B * T)]).view(B, T, 3)
    keep = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, chosen, True)[:, None] & (causal == 0)
    ours, _ = bug_attention(module, q, k, v, mask, scaling=d ** -0.5, indices=chosen)
    masked = torch.zeros(B, 1, T, T).masked_fill(~keep, float("-inf"))
    expected = torch.softmax((q @ k.transpose(-2, -1)) * d ** -0.5 + masked, dim=-1).nan_to_num() @ v
    torch.testing.assert_close(ours, expected.transpose(1, 2))


def test_the_explicit_attention_caps_logits_as_gemma2s_eager_function_does():
    """Gemma 2 hands its attention function `softcap` (its attn_logit_softcapping), which sdpa's function refuses:
    the layers not given a bug raised, the reference failed `runs`, and no bug of gemma2 was judged. The explicit
    attention now caps the scaled scores as Gemma 2's eager function does; without the cap it is seen to differ."""
    pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 6, 8
    q, k, v = (4 * torch.randn(B, H, T, d, generator=gen) for _ in range(3))  # scores well past the cap of 2
    module = nn.Module()
    module.num_key_value_groups = 1
    module.eval()
    mask = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), torch.finfo(q.dtype).min)
    mask = mask.expand(B, 1, T, T)
    ours, _ = bug_attention(module, q, k, v, mask, scaling=d ** -0.5, softcap=2.0)
    theirs, _ = eager_attention_forward(module, q, k, v, mask, scaling=d ** -0.5, softcap=2.0)
    torch.testing.assert_close(ours, theirs)
    uncapped, _ = eager_attention_forward(module, q, k, v, mask, scaling=d ** -0.5)
    assert not torch.allclose(uncapped, theirs, atol=1e-3)
    assert module._test_scaling == d ** -0.5  # the scale it was handed, read by the sweep's missing_scale rule


HF_TARGET = {"bart": "model.decoder.layers.0.self_attn", "t5": "decoder.block.1.layer.0.SelfAttention"}
BUG_SEQ_LEN = 8  # the injected matrix runs at 8 tokens: cheap, and long enough for every bug's probe


def hf_bug_report(tf, name: str, bug: str):
    """The audit, at BUG_SEQ_LEN tokens, of the model with `bug` ("reference": nothing broken) computed by
    `_attend` in one layer through AttentionInterface, and that layer's path."""
    if (name, bug) not in _MEMO:
        clean = hf_report(tf, name, "sdpa")
        path = HF_TARGET.get(name, list(clean.layers)[1])
        register_attention("test_bugs", bug_attention)
        model = hf_model(tf, name, "test_bugs")
        dict(model.named_modules())[path]._test_bug = bug
        _MEMO[name, bug] = (audit(model, seq_len=BUG_SEQ_LEN), path)
    return _MEMO[name, bug]


# In a whole model a layer detector that passes masks of its own or needs a cache skips in place, and some bugs
# show only with the model's padding or cache: the model-level check of the same property counts (catalog -> model).
# A mask the model builds over packed documents (transformers' packed-sequence mask) is blocked keys too.
IN_MODEL = {"mask_honoured": ("padding_invariance", "packed_documents"), "decode_consistency": ("cache_parity",),
            "causal_alignment": ("cache_parity",),
            "future_leakage": ("prefix_causality", "padding_invariance", "packed_documents"),
            "fully_masked_rows": ("finite_output",)}


def _expected_in_model(kind: str) -> set:
    """The detectors the catalog expects to catch `kind` (or credits), and their model-level stand-ins."""
    variant = VARIANTS[kind]
    names = set(variant.expected_detectors) | set(variant.also_detected_by)
    return names | {alt for name in names for alt in IN_MODEL.get(name, ())}


def separates_documents(twin) -> bool:
    """Whether the correct model's audit measured its packed documents kept apart by a mask of the model's own
    (transformers' packed-sequence mask: BERT has one from transformers 5.25, none in 5.24)."""
    return twin is not None and twin.result("packed_documents").verdict == "pass"


def not_applicable(arch: str, kind: str, twin=None) -> str | None:
    """Why `kind` cannot show in `arch` (then the injected model must pass), or None. `twin`: the correct model's
    report, where what it measured decides (an encoder's block-diagonal mask over packed documents, which the bugs
    that keep only the padded keys of a mask drop)."""
    encoder = arch in ("bert", "vit", "timm")
    if encoder and kind in ("causal_mask_misaligned", "causal_diagonal_masked"):
        return "no causal mask"
    if encoder and kind in ("missing_causal_mask", "padding_mask_replaces_causal") and not separates_documents(twin):
        return "no causal mask"  # nor any other mask with rows of its own: only padded keys, which the bug keeps
    if arch in ("vit", "timm") and kind in ("mask_after_softmax", "mask_polarity_inverted"):
        return "no mask"
    if arch == "t5" and kind == "missing_scale":
        return "T5 does not scale"
    if kind == "fully_masked_row_nan":  # only a left-padded query before its first real token has no key at all
        return "no real token's row is fully masked"
    return None


def _check_injected(report, path: str, arch: str, kind: str, twin) -> None:
    __tracebackhide__ = True
    assert twin.passed, str(twin)  # the same model through the same explicit attention, nothing broken
    reason = not_applicable(arch, kind, twin)
    if reason:  # the bug changes nothing the audit can observe here: passing is right
        assert report.passed, f"{kind} in {arch} ({reason}) failed:\n{report}"
        return
    assert report.status == "failed", str(report)
    layers = {layer for layer, _ in located(report)}
    assert path in layers and layers <= {path, None}, str(report)  # localised to the layer it was injected into
    at_layer = {d for layer, d in located(report) if layer == path}
    assert at_layer & _expected_in_model(kind), f"{kind}: {sorted(at_layer)} at {path}, none of " \
                                                f"{sorted(_expected_in_model(kind))}\n{report}"


@pytest.mark.parametrize("kind", INJECTED)
@pytest.mark.parametrize("name", HF)
def test_catalog_bug_injected_through_attention_interface_is_caught_in_its_layer(name, kind):
    tf = _need("transformers")
    report, path = hf_bug_report(tf, name, kind)
    _check_injected(report, path, name, kind, hf_bug_report(tf, name, "reference")[0])


def test_grouped_heads_in_the_wrong_order_are_caught_only_against_the_layers_own_weights():
    """Key/value heads repeated in the wrong order (`repeat`, query head h reading group h % G, not h // (H / G)) keep
    every property a black-box check reads: the same function as a correct layer with its query heads permuted. In
    Llama (2 key/value heads for 4 query heads) through AttentionInterface, the model audit fails only own_weights, at
    the layer it went into, naming the step; its twin, the same explicit attention with nothing broken, passes."""
    tf = _need("transformers")
    report, path = hf_bug_report(tf, "llama", "grouped_heads_wrong_order")
    assert hf_bug_report(tf, "llama", "reference")[0].passed
    assert report.status == "failed", str(report)
    assert located(report) == {(path, "own_weights")}, str(report)
    found = report.layers[path].result("own_weights")
    assert "repeat, not repeat_interleave" in found.evidence, found.evidence


def test_grouped_heads_in_the_wrong_order_are_caught_in_bfloat16_at_std_002():
    """The same bug at the scale people train at: Llama's projections drawn at std 0.02 and the model cast to
    bfloat16. The explicit attention with nothing broken passes; the bug fails own_weights alone, at its layer."""
    tf = _need("transformers")
    register_attention("test_bugs", bug_attention)
    found = {}
    for bug in ("reference", "grouped_heads_wrong_order"):
        model = hf_model(tf, "llama", "test_bugs")
        for p in model.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
        model = model.to(torch.bfloat16)
        path = list(hf_report(tf, "llama", "sdpa").layers)[1]
        dict(model.named_modules())[path]._test_bug = bug
        found[bug] = audit(model, seq_len=BUG_SEQ_LEN)
    broken = found["grouped_heads_wrong_order"]
    assert found["reference"].passed, str(found["reference"])
    assert located(broken) == {(path, "own_weights")}, str(broken)


def test_the_injected_attention_with_nothing_broken_computes_what_sdpa_computes():
    tf = _need("transformers")
    register_attention("test_bugs", bug_attention)
    ids = torch.randint(64, (2, BUG_SEQ_LEN), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, BUG_SEQ_LEN, dtype=torch.long)
    mask[0, :3] = 0  # left padding: the model's own boolean mask reaches the function
    for name in ("llama", "t5"):
        sdpa, explicit = hf_model(tf, name, "sdpa").eval(), hf_model(tf, name, "test_bugs").eval()
        for module in explicit.modules():
            if type(module).__name__.endswith("Attention") and hasattr(module, "is_causal"):
                module._test_bug = "reference"
        extra = {"decoder_input_ids": ids} if name == "t5" else {}
        with torch.no_grad():
            want = sdpa(input_ids=ids, attention_mask=mask, **extra).logits
            got = explicit(input_ids=ids, attention_mask=mask, **extra).logits
        real = mask.bool() if name != "t5" else torch.ones_like(mask, dtype=torch.bool)
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


def _vit(timm):
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2,
                                                            num_heads=4, num_classes=0)


def _broken_timm_class(timm):
    """timm's Attention with its forward's attention computed by `_attend` (the kind in `self._test_bug`)."""
    class BrokenAttention(timm.layers.Attention):
        def forward(self, x, attn_mask=None, is_causal=False):
            assert attn_mask is None and self.gate is None, "written for ViT's unmasked, ungated attention"
            B, N, C = x.shape  # batch, patches, width
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, d)
            q, k, v = qkv.unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
            allowed = torch.ones(N, N, dtype=torch.bool).tril() if is_causal else None
            x = _attend(self._test_bug, q, k, v, allowed, self.scale, causal=is_causal).reshape(B, N, self.attn_dim)
            return self.proj_drop(self.proj(self.norm(x)))  # (B, N, C)
    return BrokenAttention


def timm_bug_report(timm, kind: str):
    """The audit, at the model's own size, of a ViT whose block 1 attention is swapped for a broken copy."""
    if ("timm", kind) not in _MEMO:
        model = _vit(timm)
        model.blocks[1].attn.__class__ = _broken_timm_class(timm)
        model.blocks[1].attn._test_bug = kind
        _MEMO["timm", kind] = (audit(model), "blocks.1.attn")
    return _MEMO["timm", kind]


def test_timm_vision_transformer_audits_clean():
    timm = _need("timm")
    report = audit(_vit(timm))
    assert report.passed, str(report)
    assert list(report.layers) == ["blocks.0.attn", "blocks.1.attn"]
    assert all(f.how.startswith("timm attention class") for f in report.found)


@pytest.mark.parametrize("kind", INJECTED)
def test_catalog_bug_in_one_swapped_timm_attention_is_caught_in_its_block(kind):
    timm = _need("timm")
    report, path = timm_bug_report(timm, kind)
    _check_injected(report, path, "timm", kind, timm_bug_report(timm, "reference")[0])


# ---- the README's architectures x bugs table --------------------------------------------------------------------


SHORT = {  # the table's abbreviations of the detectors (its legend lists them)
    "softmax_saturation": "sat", "weight_row_sums": "rows", "output_variance": "var", "finite_output": "nan",
    "future_leakage": "leak", "causal_alignment": "align", "eval_determinism": "eval", "gradients": "grad",
    "batch_independence": "batch", "prefix_causality": "PREFIX", "cache_parity": "CACHE",
    "padding_invariance": "PAD", "batch_invariance": "BATCH", "gradient_flow": "GRADFLOW",
    "sliding_window": "WINDOW", "backend_parity": "BACKEND", "model_runs": "RUNS", "attention_pattern": "pattern",
    "packed_documents": "PACKED"}
_REASONS: list = []  # the n/a reasons, numbered in the order the table meets them


def _cell(report, target: str, reason: str | None = None) -> str:
    if reason:
        if reason not in _REASONS:
            _REASONS.append(reason)
        return f"n/a ({_REASONS.index(reason) + 1})" if report.passed else "**fails: " + reason + "**"
    if report.passed:
        return "**missed**"
    fired = located(report)
    elsewhere = sorted({layer for layer, _ in fired if layer not in (target, None)})
    where = f"at `{', '.join(elsewhere)}`: " if elsewhere else ""
    names = {SHORT.get(d, d) + ("" if layer else "*") for layer, d in fired}  # *: a finding naming no layer
    return where + " ".join(sorted(names, key=lambda s: (s.isupper(), s)))


_VARIANT_REPORTS: dict = {}


def _variant_report(vid: str):
    """TinyGPT (MATRIX) with catalog variant `vid` in block 1, audited once per session."""
    if vid not in _VARIANT_REPORTS:
        _VARIANT_REPORTS[vid] = audit(inject(tiny_gpt(**MATRIX), 1, VARIANTS[vid]))
    return _VARIANT_REPORTS[vid]


def architecture_table() -> str:
    """Rows: architectures (with the layer the bug goes into); columns: the catalog bugs injected there."""
    _REASONS.clear()
    rows = ["| architecture (bug in) | twin | " + " | ".join(f"`{k}`" for k in INJECTED) + " |",
            "|---" * (len(INJECTED) + 2) + "|"]

    def row(label, twin, cells):
        rows.append(f"| {label} | {'pass' if twin.passed else '**FAIL**'} | " + " | ".join(cells) + " |")

    def gpt_cell(kind):
        report = _variant_report(kind)
        if not _observable_in_model(VARIANTS[kind]):
            return _cell(report, "h.1.attn", "TinyGPT passes no mask and has no cache")
        return _cell(report, "h.1.attn")

    row("nanoGPT-style `TinyGPT`, catalog class (`h.1.attn`)", _reference_twin(VARIANTS["missing_scale"]),
        [gpt_cell(k) for k in INJECTED])
    try:
        tf = _need("transformers")
    except pytest.skip.Exception:
        return "\n".join(rows)
    for name in HF:
        twin, path = hf_bug_report(tf, name, "reference")
        row(f"HF `{twin.model}` (`{path}`)", twin,
            [_cell(hf_bug_report(tf, name, k)[0], path, not_applicable(name, k, twin)) for k in INJECTED])
    try:
        timm = _need("timm")
    except pytest.skip.Exception:
        return "\n".join(rows)
    twin, path = timm_bug_report(timm, "reference")
    row(f"timm `VisionTransformer` (`{path}`, swapped)", twin,
        [_cell(timm_bug_report(timm, k)[0], path, not_applicable("timm", k)) for k in INJECTED])
    return "\n".join(rows) + "\n\n" + _legend()


def _legend() -> str:
    used = sorted(SHORT.items(), key=lambda kv: (kv[1].isupper(), kv[1]))
    layer = ", ".join(f"{s} = `{d}`" for d, s in used if not s.isupper())
    model = ", ".join(f"{s} = `{d}`" for d, s in used if s.isupper())
    reasons = "; ".join(f"({i}) {r}" for i, r in enumerate(_REASONS, 1))
    return ("Cells: the detectors that caught the bug, at the layer in the row's first column (a finding at any "
            "other layer would be named; * marks a model-level finding that names no layer). Layer detectors, in "
            f"place: {layer}. Model-level: {model}. Not applicable, and the injected model passes: {reasons}.")


def model_bug_table() -> str:
    """The model-level bugs: ProtocolGPT with each, and its correct twin."""
    rows = ["| `ProtocolGPT` bug | correct twin | with the bug |", "|---|---|---|"]
    for bug, (options, _, layer) in sorted(MODEL_BUGS.items()):
        twin = _twin_report(**_twin_options(options))
        rows.append(f"| {bug} (`{layer}`) | {'passes' if twin.passed else '**fails**'} | "
                    f"{_cell(audit(protocol_gpt(**options)), layer)} |")
    return "\n".join(rows)


def test_readme_has_the_architectures_x_bugs_table():
    _need("transformers")
    _need("timm")
    text = DOC.read_text()
    assert architecture_table() in text, "run `python tests/test_model_audit.py` and paste its tables"
    assert model_bug_table() in text, "run `python tests/test_model_audit.py` and paste its tables"


if __name__ == "__main__":
    print(architecture_table() + "\n\n" + model_bug_table())


# ---- command line and pytest plugin --------------------------------------------------------------------------

MODELS_SOURCE = '''
import torch
from buggy_variants import VARIANTS
from buggy_variants.teaching_model import TinyGPT, inject


def good():
    torch.manual_seed(0)
    return TinyGPT(n_layer=2)


def bad():
    torch.manual_seed(0)
    return inject(TinyGPT(n_layer=2), 1, VARIANTS["missing_scale"])
'''


def test_command_line_audits_a_model_with_the_layer_exit_codes(tmp_path, monkeypatch, capsys):
    from diagnostics._cli import main

    (tmp_path / "mymodels.py").write_text(MODELS_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--model", "mymodels:good"]) == 0
    assert capsys.readouterr().out.startswith("model audit of TinyGPT: PASSED")
    assert main(["--model", "mymodels:bad", "--json"]) == 1
    assert '"layer": "h.1.attn"' in capsys.readouterr().out
    assert main(["--model", "mymodels:good", "--mask", "additive"]) == 2  # a layer option: usage error
    assert "expected only --example, --causal, --seq-len, --seed, --detectors, --json and --html with --model" in capsys.readouterr().err
    assert main(["--model", "mymodels:missing"]) == 2
    assert main([]) == 2  # neither a layer nor a model


def test_pytest_plugin_adds_a_test_per_model_check_and_per_layer(pytester):
    pytester.makepyfile(mymodels=MODELS_SOURCE, test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "diagnostics.pytest_plugin", "--attention-audit-model=mymodels:bad",
                                          "-p", "no:cacheprovider")
    # the expected outcomes counted from the same audit, item by item as the plugin makes them: one per model
    # detector (fail/error fails, skip skips), one per audited layer (fails unless passed), one for the status
    # (fails when inconclusive), and the user's own test_nothing
    namespace = {}
    exec(MODELS_SOURCE, namespace)
    report = diagnostics.audit_model(namespace["bad"]())
    verdicts = [r.verdict for r in report.results]
    failed = (sum(v in ("fail", "error") for v in verdicts) + sum(rep.status != "passed" for rep in report.layers.values())
              + (report.status == "inconclusive"))
    skipped = sum(v == "skip" for v in verdicts)
    items = len(verdicts) + len(report.layers) + 1 + 1
    result.assert_outcomes(passed=items - failed - skipped, failed=failed, skipped=skipped)
    result.stdout.fnmatch_lines(["*FAILED*layer?h.1.attn??mymodels:bad?*"])


def test_teaching_report_has_the_model_chapter_with_its_reach_chart_and_cache_readings():
    from buggy_variants.teaching_model import CHAPTER_BUG, model_chapter_html

    page = model_chapter_html(VARIANTS)
    vid, layer = CHAPTER_BUG
    assert f"<code>{vid}</code>" in page and 'id="model-chapter"' in page
    assert page.count("<svg") == 2 and "<script" not in page and "http" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # inline, offline
    assert f"(<code>h.{layer}.attn</code>); the layers after it inherit it" in page  # where the leak starts
    assert "steps of 1" in page and "uneven" in page and f"localised to <code>h.{layer}.attn</code>" in page


def test_chosen_detectors_run_alone_and_an_unmeasured_causality_is_not_passed():
    stages = []
    only = audit(protocol_gpt(), detectors=["cache_parity", "padding_invariance"],
                 progress=lambda stage, i, n: stages.append((stage, i, n)))
    assert only.passed and not only.layers
    assert stages == [("discover", 0, 1), ("cache_parity", 0, 2), ("padding_invariance", 1, 2)]
    assert [r.detector for r in only.results] == ["model_runs", "cache_parity", "padding_invariance"]
    skipped = audit(TinyGPT(), detectors=["cache_parity"])  # TinyGPT takes no cache: nothing measured
    assert skipped.status == "inconclusive" and "every one skipped" in skipped.status_reason

    class Constant(TinyGPT):  # causal by construction and by claim, but every output is the same
        def forward(self, input_ids):
            return super().forward(torch.zeros_like(input_ids))

    report = audit(Constant(), detectors=["prefix_causality"])
    assert report.result("prefix_causality").verdict == "skip" and report.status == "inconclusive"


def test_an_attention_module_that_cannot_be_audited_in_place_makes_the_audit_inconclusive():
    class FlatAttention(nn.Module):  # takes (B*T, D) rows and the batch size: no (B, T, D) input to replace
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, rows, batch):
            q, k, v = self.qkv(rows).view(batch, -1, 3, 32).unbind(2)  # (B, T, D) each
            weights = (q @ k.transpose(-2, -1) / 32 ** 0.5).softmax(-1)  # (B, T, T)
            return (weights @ v).reshape(-1, 32)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.attn, self.head = nn.Embedding(64, 32), FlatAttention(), nn.Linear(32, 64)

        def forward(self, input_ids):
            B, T = input_ids.shape
            return self.head(self.attn(self.wte(input_ids).reshape(B * T, 32), B).view(B, T, 32))

    report = audit(Model())
    assert [f.path for f in report.found] == ["attn"] and not report.layers
    assert report.status == "inconclusive" and "attn could not be audited in place" in report.status_reason
    assert any("expected attn (FlatAttention) to take its hidden states as a (B, T, D) tensor" in n for n in report.notes)


def test_a_classifier_without_per_position_outputs_skips_the_sequence_checks_with_the_reason():
    class Classifier(TinyGPT):  # one output per sequence: nothing per position to compare
        def forward(self, input_ids):
            return super().forward(input_ids)[:, -1]  # (B, vocab)

    report = audit(Classifier())
    assert report.result("prefix_causality").verdict == "skip"
    assert "has no sequence dimension" in report.result("prefix_causality").message
    assert report.status == "inconclusive"  # a causal model whose causality was not measured
    assert all(rep.passed for rep in report.layers.values())  # its layers, in place, are measured all the same


def test_readme_example_runs_as_written(tmp_path, monkeypatch):
    _need("transformers")
    section = DOC.read_text().split("## Audit a whole model\n", 1)[1].split("\n## ", 1)[0]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)  # it writes model.html
    torch.manual_seed(0)
    exec(compile(example, str(DOC), "exec"), {"__name__": "readme_model_example"})
    assert (tmp_path / "model.html").exists()


def test_a_leak_outside_attention_is_localised_to_its_block_and_the_attention_layers_pass():
    class MeanOverTime(nn.Module):  # a "norm" with statistics over the whole sequence: the future leaks in
        def forward(self, x):
            return x - x.mean(dim=1, keepdim=True)

    model = tiny_gpt()
    model.h[1].mlp = nn.Sequential(MeanOverTime(), model.h[1].mlp)
    report = audit(model)
    assert report.result("prefix_causality").verdict == "fail"
    assert report.result_layers["prefix_causality"] == "h.1"
    assert "whose attention (h.1.attn) did not move: the leak is outside attention" in report.result("prefix_causality").message
    assert all(rep.passed for rep in report.layers.values())  # the attention layers themselves are causal
    assert report.readings["prefix_reach"]["reach"]["h.1.attn"] == 0 and report.readings["prefix_reach"]["blocks"]["h.1"] > 0


def test_an_example_dict_with_its_own_mask_is_audited_with_the_masks_each_check_builds():
    ids = torch.randint(64, (2, T), generator=torch.Generator().manual_seed(3))
    report = audit(protocol_gpt(), example={"input_ids": ids, "attention_mask": torch.ones(2, T, dtype=torch.long)})
    assert report.passed, str(report)
    assert report.result("padding_invariance").verdict == report.result("cache_parity").verdict == "pass"
    assert any("attention_mask not passed" in note for note in report.notes)


def test_gemma2_alternating_layers_have_their_sliding_window_checked_where_they_declare_one():
    tf = _need("transformers")
    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(hidden_size=32, num_key_value_heads=2, head_dim=8, sliding_window=5,
                                                 attn_logit_softcapping=None, final_logit_softcapping=None, **COMMON))
    windows = {p: m.sliding_window for p, m in model.named_modules() if p.endswith("self_attn")}
    assert windows == {"model.layers.0.self_attn": 5, "model.layers.1.self_attn": None}  # sliding, then full
    report = audit(model)
    assert report.passed, str(report)
    window = report.result("sliding_window")
    assert window.verdict == "pass" and "model.layers.0.self_attn: window 5 exact" in window.evidence
    assert "model.layers.1.self_attn" not in window.evidence


# ---- the model wing's registry and crash rule; patched forwards (issue 18, items 1 and 2) ----------------------


def test_model_detectors_register_in_the_one_registry_with_where_they_point():
    from diagnostics import model
    from diagnostics._registry import MODEL_DETECTORS

    assert model.MODEL_DETECTORS is MODEL_DETECTORS is diagnostics.MODEL_DETECTORS
    assert list(MODEL_DETECTORS) == ["model_runs", "prefix_causality", "cache_parity", "padding_invariance",
                                     "batch_invariance", "backend_parity", "gradient_flow", "sliding_window",
                                     "packed_documents"]
    for det in MODEL_DETECTORS.values():
        assert det.scope == "model" and det.fix and det.description
        assert det.locate is not None or det.unlocated, det.id
    assert model.__all__ == sorted(model.__all__)


class KeywordAttention(nn.Module):
    """Causal self-attention called the Hugging Face way, `attn(hidden_states, attention_mask=mask)`, with a
    (B, T) padding mask, 1 = real token."""

    def __init__(self, d_model: int = 32, num_heads: int = 4):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, hidden_states, attention_mask=None):
        B, T, D = hidden_states.shape  # batch, sequence length, d_model
        H, d = self.num_heads, D // self.num_heads
        q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in self.qkv(hidden_states).split(D, -1))  # (B, H, T, d)
        allowed = torch.ones(T, T, dtype=torch.bool, device=hidden_states.device).tril()  # (T, T)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
        scores = (q @ k.transpose(-2, -1) / d ** 0.5).masked_fill(~allowed, float("-inf"))  # (B, H, T, T)
        y = scores.softmax(-1) @ v  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(32), KeywordAttention()

    def forward(self, x, attention_mask=None):
        return x + self.attn(self.ln(x), attention_mask=attention_mask)


class KeywordGPT(nn.Module):
    causal = True

    def __init__(self, n_layer: int = 3):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, 32), nn.Embedding(32, 32)
        self.h = nn.ModuleList(KeywordBlock() for _ in range(n_layer))
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids, attention_mask=None):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.h:
            x = block(x, attention_mask=attention_mask)
        return self.head(x)


def keyword_gpt() -> KeywordGPT:
    torch.manual_seed(0)
    return KeywordGPT()


def test_a_forward_patched_without_wraps_is_audited_and_its_leak_blamed_on_it_not_the_next_layer():
    def patched(model, leak: bool):
        attn = model.h[1].attn
        inner = attn.forward

        def forward(*args, **kwargs):  # no functools.wraps: its signature is (*args, **kwargs)
            out = inner(*args, **kwargs)
            return out + out.mean(dim=1, keepdim=True) if leak else out  # the mean over time: the future leaks in
        attn.forward = forward
        return model

    report = audit(patched(keyword_gpt(), leak=True))
    assert list(report.layers) == ["h.0.attn", "h.1.attn", "h.2.attn"], str(report)  # layer 1 audited in place
    assert report.result_layers["prefix_causality"] == "h.1.attn", str(report)
    assert {layer for layer, _ in located(report)} <= {"h.1.attn", None}, str(report)
    assert ("h.1.attn", "future_leakage") in located(report)
    assert set(report.readings["prefix_reach"]["reach"]) == {"h.0.attn", "h.1.attn", "h.2.attn"}
    twin = audit(patched(keyword_gpt(), leak=False))  # the same patch, passing through
    assert twin.passed and list(twin.layers) == ["h.0.attn", "h.1.attn", "h.2.attn"], str(twin)


def test_a_forward_patched_with_wraps_is_called_by_keyword_as_the_model_calls_it():
    model = keyword_gpt()
    attn = model.h[1].attn
    inner = attn.forward

    @functools.wraps(inner)  # its signature reads (hidden_states, attention_mask=None); it takes the mask by keyword
    def forward(*args, attention_mask=None, **kwargs):
        return inner(*args, attention_mask=attention_mask, **kwargs)
    attn.forward = forward

    report = audit(model)
    assert report.passed, str(report)
    assert report.layers["h.1.attn"].result("runs").verdict == "pass"  # no "multiple values for attention_mask"
    assert report.result("padding_invariance").verdict == "pass"
    assert audit(keyword_gpt()).passed  # the unpatched twin


def test_the_crash_rule_the_models_exception_is_a_finding_ours_an_error(monkeypatch):
    class NoPadding(KeywordGPT):
        def forward(self, input_ids, attention_mask=None):
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("padding is not supported")  # the user's model raises on the padded probe
            return super().forward(input_ids, attention_mask)

    torch.manual_seed(0)
    report = audit(NoPadding(), detectors=["padding_invariance"])
    result = report.result("padding_invariance")
    assert result.verdict == "fail" and report.status == "failed", str(report)
    assert "the model raised on this detector's probe (ValueError: padding is not supported)" in result.message

    from diagnostics.model import padding
    from diagnostics.model._runner import device_dtype

    monkeypatch.setattr(padding, "pad_tokens", device_dtype)  # a bug in diagnostics: called with the wrong arguments
    report = audit(keyword_gpt(), detectors=["padding_invariance"])
    result = report.result("padding_invariance")
    assert result.verdict == "error" and "the detector crashed: TypeError" in result.message, str(report)
    assert report.status == "inconclusive" and "padding_invariance crashed" in report.status_reason


# ---- causality read from the layers where nothing declares it (issue 35's first contact) ---------------------


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: a registered triangle masks the scores; `diagonal=1` lets each query see the
    next key (the off-by-one mask, torch.tril(ones, 1) where torch.tril(ones) belongs)."""

    def __init__(self, diagonal: int = 0, n_embd: int = 32, n_head: int = 4, block_size: int = 32):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size), diagonal)[None, None])

    def forward(self, x):
        B, T, C = x.shape  # batch, sequence length, n_embd
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))  # (B, H, T, d)
        att = (q @ k.transpose(-2, -1)) / (k.shape[-1] ** 0.5)  # (B, H, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self, diagonal: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(32), NanoAttention(diagonal), nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT as its users write it: no `causal` attribute, no config, forward(idx, targets) -> (logits,
    loss). `leaky`: the block whose mask is off by one."""

    def __init__(self, n_layer: int = 4, leaky: int | None = None):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(64, 32), wpe=nn.Embedding(32, 32), ln_f=nn.LayerNorm(32),
            h=nn.ModuleList(NanoBlock(1 if i == leaky else 0) for i in range(n_layer))))
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def nano_gpt(leaky: int | None = None) -> GPT:
    torch.manual_seed(0)
    return GPT(leaky=leaky)


def test_a_plain_nanogpt_whose_layers_mask_the_future_is_audited_as_causal():
    report = audit(nano_gpt())
    assert report.passed and report.causal, str(report)
    assert report.causal_source == "measured: 4 of 4 attention layers mask the future themselves"
    assert report.result("prefix_causality").verdict == "pass"


def test_a_nanogpt_with_one_mask_off_by_one_fails_at_that_layer():
    report = audit(nano_gpt(leaky=2))
    path = "transformer.h.2.attn"
    assert report.status == "failed" and report.causal, str(report)
    assert "3 of 4" in report.causal_source and f"{path} does not" in report.causal_source
    assert report.result_layers["prefix_causality"] == path, str(report)
    assert (path, "future_leakage") in located(report)
    assert {layer for layer, _ in located(report)} <= {path, None}, str(report)


def test_an_encoder_whose_layers_do_not_mask_is_still_assumed_not_causal_and_a_declaration_wins():
    report = audit(_encoder())  # torch's TransformerEncoder: no layer masks the future
    assert not report.causal and report.causal_source.startswith("assumed"), report.causal_source
    said = audit(nano_gpt(leaky=2), causal=False)  # told: the layers' masks are not read
    assert not said.causal and said.causal_source == "as given"


# ---- the example a Hugging Face model declares ----------------------------------------------------------------


def _llava(tf):
    """A vision-language decoder: no top-level vocab_size (its text config has one), a vision tower whose position
    table is the first nn.Embedding, the image token inside the vocabulary."""
    torch.manual_seed(0)
    text = dict(model_type="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=64, max_position_embeddings=64, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=64, image_size=16, patch_size=8)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(text_config=text, vision_config=vision, image_token_id=63,
                                                           attn_implementation="sdpa"))


def test_a_vision_language_decoder_gets_ids_from_its_text_config_and_its_layers_declare_it_causal():
    """Before: ids drawn for the vision tower's position table, and the decoder assumed not causal."""
    tf = _need("transformers")
    report = audit(_llava(tf))
    assert report.passed and report.causal, str(report)
    assert report.causal_source == "inferred: its 2 self-attention layers say is_causal = True", report.causal_source
    assert report.result("prefix_causality").verdict == "pass" and report.result("cache_parity").verdict == "pass"


def test_the_example_draws_no_special_id_and_neither_do_the_probes_replacements():
    from diagnostics.model._runner import Runner, pad_tokens

    tf = _need("transformers")
    model = _llava(tf)
    runner = Runner(model, None, seq_len=16, seed=0)
    assert runner.main == "input_ids" and runner.vocab == 64 and {0, 63} <= runner.special, runner.special
    gen = torch.Generator().manual_seed(0)
    drawn = torch.cat([runner.inputs.flatten(), runner.other_tokens(runner.inputs, gen).flatten(),
                       pad_tokens(runner, (4, 16), gen).flatten()])
    assert not set(drawn.tolist()) & set(runner.special), sorted(set(drawn.tolist()) & set(runner.special))
    assert bool((runner.other_tokens(runner.inputs, gen) != runner.inputs).all())  # every position another token


def test_a_model_whose_main_input_is_neither_ids_nor_sized_pixels_asks_for_an_example():
    tf = _need("transformers")
    torch.manual_seed(0)
    model = tf.WhisperModel(tf.WhisperConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                             decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                             max_target_positions=16, pad_token_id=0, bos_token_id=1,
                                             eos_token_id=2, decoder_start_token_id=1))
    with pytest.raises(diagnostics.AuditUsageError) as caught:
        diagnostics.audit_model(model)
    assert "whose main input is 'input_features'" in str(caught.value) and "example=" in str(caught.value)


def test_padding_compares_explicit_positions_on_both_sides_for_positions_numbered_from_the_padding_index():
    """RoBERTa numbers its own positions from padding_idx + 1 when given none: the unpadded reference, run without
    position ids, sat elsewhere than the padded rows given cumsum(mask) - 1, and a correct model "moved"."""
    tf = _need("transformers")
    torch.manual_seed(0)
    model = tf.RobertaForCausalLM(tf.RobertaConfig(hidden_size=32, is_decoder=True, pad_token_id=1,
                                                   attn_implementation="sdpa", **COMMON))
    report = audit(model, detectors=["padding_invariance"])
    assert report.result("padding_invariance").verdict == "pass", str(report)


def test_a_config_that_says_causal_false_makes_an_lm_head_class_a_masked_lm():
    tf = _need("transformers")
    torch.manual_seed(0)
    model = tf.XLMWithLMHeadModel(tf.XLMConfig(vocab_size=64, emb_dim=32, n_layers=2, n_heads=4, causal=False,
                                               max_position_embeddings=64))
    report = audit(model, detectors=["prefix_causality"])
    assert not report.causal and report.causal_source == "inferred: config.causal is False", report.causal_source


class Picky(nn.Module):
    """Raises on every input: a front end that is not attention (a vision tower handed token ids)."""

    def forward(self, x):
        raise ValueError("expected pixel values (B, 3, H, W)")


def test_a_model_raising_outside_attention_on_the_audits_own_example_is_inconclusive_and_on_the_users_a_finding():
    class Fronted(KeywordGPT):
        def __init__(self):
            super().__init__()
            self.front = Picky()

        def forward(self, input_ids, attention_mask=None):
            self.front(input_ids)
            return super().forward(input_ids, attention_mask)

    torch.manual_seed(0)
    own = audit(Fronted())
    assert own.status == "inconclusive" and own.result("model_runs").verdict == "skip", str(own)
    assert "the example the audit built" in own.status_reason and "pass example=" in own.status_reason
    users = audit(Fronted(), example=torch.randint(64, (2, T)))  # the user's own example: the model raising is a finding
    assert users.status == "failed" and users.result("model_runs").verdict == "fail", str(users)
