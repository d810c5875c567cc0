"""Models made of towers: a causal text tower beside a vision tower, each a model that declares its own input, which the
whole takes together (CLIP's kind; issue 33, transformers 5.25).

- Zero-config, the audit builds the input the whole declares (token ids) and the whole raises on it: CLIP, SigLIP,
  ALIGN, CLAP and a dozen more were inconclusive, "pass example=... or audit the models it is made of one by one".
  Each tower is now audited on the example it declares (token ids, pixels), with its own causality, and the report
  is theirs together, every layer named by its path in the whole model; the status is the worst of the towers'.
  Twins on models of our own (no transformers): the correct one passes, a text layer that drops its causal mask
  fails there, a vision layer that drops its scale fails there (float32 at torch's init, and bfloat16 at std 0.02);
  attention outside the towers (a fusion of the streams) is not audited, and the model is inconclusive saying so;
  given an example, the model is audited whole, as before.
- Given an example with both its inputs (`{'input_ids': ..., 'pixel_values': ...}`), CLIPModel's correct vision
  layers failed `future_leakage` and `gradients` in place: the model is causal (its text tower's mask), and every
  self-attention was audited as causal, though the vision layers read the same pixels whatever the tokens. A layer
  whose length stays when the sequence is one token shorter reads another stream, and is audited as not causal.
  Twin: a text layer that drops its causal mask is still caught, in place, with that example.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants._catalog import MissingCausalMask, MissingScale
from correct import MultiHeadAttention
from correct._init import gpt2_init_

D, HEADS, VOCAB, CONTEXT, SIDE, PATCH = 16, 2, 48, 12, 16, 4  # a 16 px image in 4 px patches: 16 tokens


class TextTower(nn.Module):
    """Token ids through two causal self-attention blocks, the last token's state out: a text tower of CLIP's kind.
    It declares its input (`main_input_name`, a vocabulary in its config) and that it is causal."""

    main_input_name = "input_ids"
    causal = True

    def __init__(self, second: type = MultiHeadAttention, cross: bool = False):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=CONTEXT)
        self.embed = nn.Embedding(VOCAB, D)
        self.positions = nn.Parameter(torch.randn(CONTEXT, D) * 0.02)
        self.layers = nn.ModuleList([MultiHeadAttention(D, HEADS, causal=True), second(D, HEADS, causal=True)])
        self.norm = nn.LayerNorm(D)
        # BLIP's text decoder's kind: a cross-attention to the image, run only when the whole passes the image's states
        self.cross = nn.MultiheadAttention(D, HEADS, batch_first=True) if cross else None

    def forward(self, input_ids, encoder_hidden_states=None):
        x = self.embed(input_ids) + self.positions[:input_ids.shape[1]]  # (B, T, D)
        for attn in self.layers:
            x = x + attn(self.norm(x))[0]  # each returns (out, weights)
        if self.cross is not None and encoder_hidden_states is not None:
            x = x + self.cross(x, encoder_hidden_states, encoder_hidden_states)[0]
        return x


class VisionTower(nn.Module):
    """4 x 4 px patches of a 16 px image through two self-attention blocks, not causal; it declares pixels of the
    size in its config."""

    main_input_name = "pixel_values"

    def __init__(self, second: type = MultiHeadAttention):
        super().__init__()
        self.config = SimpleNamespace(image_size=SIDE, num_channels=3)
        self.embed = nn.Conv2d(3, D, PATCH, stride=PATCH)
        self.layers = nn.ModuleList([MultiHeadAttention(D, HEADS), second(D, HEADS)])
        self.norm = nn.LayerNorm(D)

    def forward(self, pixel_values):
        x = self.embed(pixel_values).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h x w, D)
        for attn in self.layers:
            x = x + attn(self.norm(x))[0]
        return x


class ConvTower(nn.Module):
    """Pixels through convolutions alone, pooled to (B, 1, D): a vision tower with no attention (ALIGN's
    EfficientNet)."""

    main_input_name = "pixel_values"

    def __init__(self, _second: type = MultiHeadAttention):
        super().__init__()
        self.config = SimpleNamespace(image_size=SIDE, num_channels=3)
        self.embed = nn.Sequential(nn.Conv2d(3, D, PATCH, stride=PATCH), nn.GELU(), nn.Conv2d(D, D, 3, padding=1))

    def forward(self, pixel_values):
        return self.embed(pixel_values).mean((2, 3))[:, None]  # (B, D, h, w) -> (B, 1, D)


class TwoTowers(nn.Module):
    """Each text's similarity to each image (CLIP's logits): the forward needs token ids and pixels together.
    `fuse`: a cross-attention of the text over the image's patches, outside both towers."""

    def __init__(self, text: type = MultiHeadAttention, vision: type = MultiHeadAttention, fuse: bool = False,
                 tower: type = None, cross: bool = False):
        super().__init__()
        self.text_model, self.vision_model = TextTower(text, cross), (tower or VisionTower)(vision)
        self.fuse = nn.MultiheadAttention(D, HEADS, batch_first=True) if fuse else None

    def forward(self, input_ids, pixel_values):
        v = self.vision_model(pixel_values)  # (B, N, D)
        t = self.text_model(input_ids, encoder_hidden_states=v)  # (B, T, D)
        if self.fuse is not None:
            t = t + self.fuse(t, v, v)[0]
        return t[:, -1] @ v.mean(1).T  # (B, D) x (D, B) -> (B, B)


def _towers(text: type = MultiHeadAttention, vision: type = MultiHeadAttention, *, dtype: str = "float32",
            fuse: bool = False, tower: type = None, cross: bool = False) -> TwoTowers:
    """The same weights for every twin (seed 0); bfloat16 at GPT-2's std-0.02 init, biases 0."""
    torch.manual_seed(0)
    model = TwoTowers(text, vision, fuse, tower, cross)
    if dtype == "bfloat16":
        model = gpt2_init_(model, n_layers=2).to(torch.bfloat16)
    return model.eval()


TEXT_LAYERS = ["text_model.layers.0", "text_model.layers.1"]
VISION_LAYERS = ["vision_model.layers.0", "vision_model.layers.1"]


def test_zero_config_a_model_of_two_towers_is_audited_tower_by_tower_and_the_correct_one_passes():
    report = diagnostics.audit_model(_towers())  # before: inconclusive, "the model raised on the example"
    assert report.status == "passed", report
    assert list(report.layers) == TEXT_LAYERS + VISION_LAYERS, list(report.layers)
    assert report.notes[0].startswith("audited tower by tower: TwoTowers raised on the example built from what it "
                                      "declares"), report.notes
    assert "(text_model: input_ids, vision_model: pixel_values)" in report.notes[0], report.notes[0]
    assert "pass example={'input_ids': ..., 'pixel_values': ...} to audit the model whole" in report.notes[0]
    for p in TEXT_LAYERS:  # the text tower's own causality: its layers audited as causal, the vision tower's not
        assert report.layers[p].result("future_leakage").verdict == "pass", (p, report.layers[p])
    for p in VISION_LAYERS:
        assert report.layers[p].result("future_leakage").verdict == "skip", (p, report.layers[p])
    prefix = {r.layer: r.verdict for r in report.results if r.detector == "prefix_causality"}
    assert prefix == {"text_model": "pass", "vision_model": "skip"}, prefix
    assert report.causal and report.causal_source.startswith("per tower: text_model causal"), report.causal_source


@pytest.mark.parametrize("text", [MultiHeadAttention, MissingCausalMask], ids=["correct", "missing_causal_mask"])
def test_a_text_layer_without_its_causal_mask_fails_at_that_layer_of_the_whole(text):
    report = diagnostics.audit_model(_towers(text=text))
    if text is MultiHeadAttention:
        assert report.status == "passed", report
        return
    assert report.status == "failed", report
    assert {p for p, r in report.layers.items() if r.status == "failed"} == {"text_model.layers.1"}, report
    assert report.layers["text_model.layers.1"].result("future_leakage").verdict == "fail"
    assert "text_model.layers.1 (" in report.status_reason, report.status_reason
    assert {f.layer for f in report.findings if f.verdict == "fail"} <= {"text_model.layers.1", "text_model"}, \
        [(f.layer, f.detector) for f in report.findings]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vision", [MultiHeadAttention, MissingScale], ids=["correct", "missing_scale"])
def test_a_vision_layer_without_its_scale_fails_at_that_layer_of_the_whole(vision, dtype):
    report = diagnostics.audit_model(_towers(vision=vision, dtype=dtype))
    assert report.dtype == dtype, report
    if vision is MultiHeadAttention:
        assert report.status == "passed", report
        return
    assert report.status == "failed", report
    assert {p for p, r in report.layers.items() if r.status == "failed"} == {"vision_model.layers.1"}, report
    assert {f.layer for f in report.findings if f.verdict == "fail"} == {"vision_model.layers.1"}, \
        [(f.layer, f.detector) for f in report.findings]


def test_attention_outside_the_towers_is_not_audited_and_the_model_is_inconclusive_saying_what_to_pass():
    report = diagnostics.audit_model(_towers(fuse=True))
    assert report.status == "inconclusive", report
    assert report.status_reason == ("inconclusive: fuse outside the towers reads their inputs together and was not "
                                    "audited: pass example={'input_ids': ..., 'pixel_values': ...}"), \
        report.status_reason
    assert list(report.layers) == TEXT_LAYERS + VISION_LAYERS, list(report.layers)


def test_a_towers_cross_attention_to_another_tower_is_not_audited_and_the_model_is_inconclusive_saying_so():
    report = diagnostics.audit_model(_towers(cross=True))
    assert report.status == "inconclusive", report
    assert report.status_reason == ("inconclusive: text_model.cross is not called by its tower on its own input "
                                    "(attention to another tower's output) and was not audited: pass "
                                    "example={'input_ids': ..., 'pixel_values': ...}"), report.status_reason


def test_a_failing_tower_fails_the_model_even_beside_attention_outside_the_towers():
    report = diagnostics.audit_model(_towers(vision=MissingScale, fuse=True))
    assert report.status == "failed", report
    assert {p for p, r in report.layers.items() if r.status == "failed"} == {"vision_model.layers.1"}, report


@pytest.mark.parametrize("text", [MultiHeadAttention, MissingCausalMask], ids=["correct", "missing_causal_mask"])
def test_a_tower_with_no_attention_is_named_and_the_other_decides(text):
    report = diagnostics.audit_model(_towers(text=text, tower=ConvTower))
    assert list(report.layers) == TEXT_LAYERS, list(report.layers)
    assert any(n.startswith("vision_model has no attention module") for n in report.notes), report.notes
    assert report.status == ("passed" if text is MultiHeadAttention else "failed"), report


def test_given_an_example_with_both_inputs_the_model_is_audited_whole_as_before():
    model = _towers()
    gen = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(VOCAB, (2, CONTEXT), generator=gen),
               "pixel_values": torch.randn(2, 3, SIDE, SIDE, generator=gen)}
    report = diagnostics.audit_model(model, example)
    assert not any("tower by tower" in n for n in report.notes), report.notes
    assert not report.causal_source.startswith("per tower"), report.causal_source
    assert report.result("model_runs").verdict == "pass" and report.result("model_runs").layer is None, report


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")


def _clip(attn_implementation: str = "sdpa"):
    """A tiny CLIP (std-0.02 initialisation, its default): 2 layers a tower, width 32, 4 heads, 32 px images."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(text_config=dict(vocab_size=99, max_position_embeddings=32, **tower),
                        vision_config=dict(image_size=32, patch_size=8, **tower), projection_dim=16)
    config._attn_implementation = attn_implementation
    return CLIPModel(config).eval()


def _both_inputs(model) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, 90, (2, 12), generator=gen),
            "pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}


def _drops_text_mask(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    """SDPA's attention function, except in the module marked `_test_drops_mask`: its causal mask is dropped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "_test_drops_mask", False):
        attention_mask, is_causal = None, False
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kw)


@pytest.mark.parametrize("causal", [None, True], ids=["inferred", "declared"])
def test_with_both_inputs_the_vision_tower_is_not_audited_as_causal(transformers, causal):
    model = _clip()
    report = diagnostics.audit_model(model, example=_both_inputs(model), causal=causal)
    assert report.causal, report  # the text tower's causal mask, inferred or declared
    vision = [p for p in report.layers if p.startswith("vision_model.")]
    text = [p for p in report.layers if p.startswith("text_model.")]
    assert len(vision) == 2 and len(text) == 2, list(report.layers)
    assert report.status != "failed", report
    for p in vision:  # before: future_leakage and gradients failed at both
        assert report.layers[p].status == "passed", (p, report.layers[p])
        assert report.layers[p].result("future_leakage").verdict == "skip"
    for p in text:
        assert report.layers[p].result("future_leakage").verdict == "pass", (p, report.layers[p])


def _register_drops_text_mask() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("test_drops_text_mask", _drops_text_mask)
    AttentionMaskInterface.register("test_drops_text_mask", sdpa_mask)


def test_with_both_inputs_a_text_layer_that_drops_its_causal_mask_is_caught_in_place(transformers):
    _register_drops_text_mask()
    model = _clip("test_drops_text_mask")
    model.text_model.encoder.layers[1].self_attn._test_drops_mask = True
    # declared: inferred from the model's behaviour, a model whose text tower leaks is not causal (its twin above)
    report = diagnostics.audit_model(model, example=_both_inputs(model), causal=True)
    assert report.status == "failed", report
    broken = report.layers["text_model.encoder.layers.1.self_attn"]
    assert broken.result("future_leakage").verdict == "fail", broken
    assert {p for p, r in report.layers.items() if r.status == "failed"} == {
        "text_model.encoder.layers.1.self_attn"}, report


@pytest.mark.parametrize("bug", [False, True], ids=["correct", "text_layer_drops_its_causal_mask"])
def test_zero_config_clip_is_audited_tower_by_tower_and_a_text_layer_without_its_mask_fails_there(transformers, bug):
    _register_drops_text_mask()
    model = _clip("test_drops_text_mask")  # sdpa's attention, but where a layer is marked
    model.text_model.encoder.layers[1].self_attn._test_drops_mask = bug
    report = diagnostics.audit_model(model)  # before: inconclusive, "audit the models it is made of one by one"
    assert any(n.startswith("audited tower by tower: CLIPModel") for n in report.notes), report.notes
    assert len(report.layers) == 4, list(report.layers)
    if not bug:
        assert report.status == "passed", report
        assert report.causal_source.startswith("per tower: text_model causal (measured"), report.causal_source
        return
    # CLIP's text tower declares no causality: measured on its layers, one of two masks the future, so it is not read
    # as causal; the layer drops the model's whole mask, its padding with it, and padding_invariance finds it there
    assert report.status == "failed", report
    assert {f.layer for f in report.findings if f.verdict == "fail"} == {"text_model.encoder.layers.1.self_attn"}, \
        [(f.layer, f.detector, f.verdict) for f in report.findings]


def _assign_unnormalised(self, query, key):
    """GroupViT's assignment with the softmax over the groups weighed with the values as it came, not renormalised over
    the keys: the form of the bug `softmax_wrong_dim` (each key's column sums to 1, not each group's row)."""
    q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(key)  # (B, G, D), (B, N, D), (B, N, D)
    attn = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-2)  # (B, G, N): over the groups
    return self.proj(attn @ v), attn


@pytest.mark.parametrize("renormalised", [True, False], ids=["groupvit", "not_renormalised"])
def test_groupvits_assignment_of_patches_to_groups_is_not_audited_as_attention_its_bugs_form_is(transformers,
                                                                                                renormalised):
    """GroupViT's GroupViTAssignAttention: a softmax over the groups (the queries), renormalised over the patches before
    the values' product, assigns each patch to a group by design; audited as attention it failed weight_row_sums,
    output_variance, query_locality and gradients (groupvit's vision tower, the whole sweep's one failure of the
    towers). Twin: the same softmax weighed with the values as it came, the bug's form, is still audited and fails."""
    from transformers import GroupViTVisionConfig, GroupViTVisionModel

    torch.manual_seed(0)
    config = GroupViTVisionConfig(hidden_size=32, intermediate_size=64, depths=[1, 1], num_group_tokens=[8, 0],
                                  num_output_groups=[4, 4], num_attention_heads=4, image_size=32, patch_size=8)
    model = GroupViTVisionModel(config).eval()
    assign = model.vision_model.encoder.stages[0].downsample.assign
    if not renormalised:
        assign.forward = _assign_unnormalised.__get__(assign)
    report = diagnostics.audit_model(model)
    path = "vision_model.encoder.stages.0.downsample.assign"
    if renormalised:
        assert report.status == "passed", report
        assert path not in report.layers and any(n.startswith(f"{path} not audited as attention: its softmax runs "
                                                              f"over the queries") for n in report.notes), report
        return
    assert report.status == "failed", report
    assert report.layers[path].result("weight_row_sums").verdict == "fail", report.layers[path]


# Review of the towers path (t33c): three ways it turned an inconclusive or failed model into a pass.

class HandFusion(nn.Module):
    """The text's cross-attention over the image's patches, written by hand (no class to find it by); `scaled`: by
    1/sqrt(D), else the scores are multiplied by 100 (a temperature bug)."""

    def __init__(self, scaled: bool):
        super().__init__()
        self.scaled = scaled
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, memory):
        s = self.q(x) @ self.k(memory).transpose(-1, -2)  # (B, T, D) x (B, D, N) -> (B, T, N)
        s = s / D ** 0.5 if self.scaled else s * 100.0
        return s.softmax(-1) @ self.v(memory)  # (B, T, N) x (B, N, D) -> (B, T, D)


class HandFused(TwoTowers):
    def __init__(self, scaled: bool):
        super().__init__()
        self.fusion = HandFusion(scaled)

    def forward(self, input_ids, pixel_values):
        v, t = self.vision_model(pixel_values), self.text_model(input_ids)
        t = t + self.fusion(t, v)
        return t[:, -1] @ v.mean(1).T  # (B, D) x (D, B) -> (B, B)


class ForgotTranspose(TwoTowers):
    """Glue that raises on every input: (B, D) x (B, D), the transpose forgotten."""

    def forward(self, input_ids, pixel_values):
        v, t = self.vision_model(pixel_values), self.text_model(input_ids)
        return t[:, -1] @ v.mean(1)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "scores_x100"])
def test_attention_written_by_hand_outside_the_towers_is_seen_when_the_whole_runs_and_the_model_is_inconclusive(
        scaled):
    torch.manual_seed(0)
    report = diagnostics.audit_model(HandFused(scaled).eval())  # before: passed, the fusion never run
    assert report.status == "inconclusive", report
    assert report.status_reason == ("inconclusive: fusion outside the towers reads their inputs together and was not "
                                    "audited: pass example={'input_ids': ..., 'pixel_values': ...}"), \
        report.status_reason
    assert report.result("model_runs").verdict == "pass", report.result("model_runs")


@pytest.mark.parametrize("glue", [TwoTowers, ForgotTranspose], ids=["correct", "forgotten_transpose"])
def test_glue_that_raises_on_the_towers_examples_together_makes_the_model_inconclusive(glue):
    torch.manual_seed(0)
    report = diagnostics.audit_model(glue().eval())
    ran = report.result("model_runs")  # the whole's own, kept beside its towers'
    assert ran.layer is None and [r.layer for r in report.results if r.detector == "model_runs"] == [
        None, "text_model", "vision_model"], report.results
    if glue is TwoTowers:
        assert report.status == "passed", report
        assert ran.verdict == "pass" and "towers' examples together" in ran.message, ran
        return
    # before: passed, the towers' model_runs passes shown, the whole's "not measured" dropped
    assert report.status == "inconclusive", report
    assert report.status_reason.startswith(
        "inconclusive: ForgotTranspose raised on its towers' examples together (input_ids (2, 12), pixel_values (2, "
        "3, 16, 16)): RuntimeError: mat1 and mat2 shapes cannot be multiplied"), report.status_reason
    assert ran.verdict == "skip", ran


@pytest.mark.parametrize("text", [MultiHeadAttention, MissingCausalMask], ids=["correct", "missing_causal_mask"])
def test_causal_declared_for_the_whole_is_no_towers_and_the_model_is_not_audited_tower_by_tower(text):
    model = _towers(text=text)
    model.text_model.causal = None  # a text tower that does not say it is causal (CLIP's): the user says it
    report = diagnostics.audit_model(model, causal=True)  # before: both passed, the text tower audited as not causal
    assert report.status == "inconclusive", report
    assert "pass example=" in report.status_reason, report.status_reason
    assert any(n.startswith("not audited tower by tower (text_model, vision_model): causal=True was given for the "
                            "model whole") for n in report.notes), report.notes
    # given both inputs, as it asks, the declaration is the whole's: every correct layer passes (the model's prefix
    # causality is not measurable on its (B, B) similarities), the missing mask fails there
    gen = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(VOCAB, (2, CONTEXT), generator=gen),
               "pixel_values": torch.randn(2, 3, SIDE, SIDE, generator=gen)}
    report = diagnostics.audit_model(model, example, causal=True)
    failed = {p for p, r in report.layers.items() if r.status == "failed"}
    assert len(report.layers) == 4 and failed == (set() if text is MultiHeadAttention else {"text_model.layers.1"}), \
        report
    assert report.status == ("inconclusive" if text is MultiHeadAttention else "failed"), report


class HalfWidthFusion(TwoTowers):
    """A fusion's attention given half the patches' width: it raises inside that attention module on every input."""

    def __init__(self, half: bool):
        super().__init__(fuse=True)
        self.half = half

    def forward(self, input_ids, pixel_values):
        v, t = self.vision_model(pixel_values), self.text_model(input_ids)
        memory = v[..., :D // 2] if self.half else v
        t = t + self.fuse(t, memory, memory)[0]
        return t[:, -1] @ v.mean(1).T


@pytest.mark.parametrize("half", [False, True], ids=["correct", "half_width_memory"])
def test_a_whole_that_raises_inside_an_attention_module_on_its_towers_examples_fails_there(half):
    torch.manual_seed(0)
    report = diagnostics.audit_model(HalfWidthFusion(half).eval())
    if not half:  # the fusion is not audited: inconclusive, saying so
        assert report.status == "inconclusive" and report.status_reason.startswith("inconclusive: fuse outside the "
                                                                                   "towers"), report
        return
    assert report.status == "failed", report
    ran = report.result("model_runs")
    assert ran.verdict == "fail" and ran.layer == "fuse", ran
    assert report.status_reason == "failed: model_runs at fuse", report.status_reason
