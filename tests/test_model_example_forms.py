"""The other forms of the example audit_model builds where a Hugging Face model raises on its first (issue 33: 67
transformers model types "raised on the example the audit built from what it declares"): a video of the frames its
config declares (VideoMAE, ViViT), larger images where no size is declared (a detector whose queries outnumber its
tokens at 64 px), the decoder's ids beside the pixels of a vision encoder-decoder, and use_cache left out where a
forward's **kwargs refuse it (Mimi's encoder). Each fixed case is judged, its attention measured; its twin, the same
model on the same inputs with a bug in one attention layer, still fails there."""

from __future__ import annotations

import pytest
import torch

import diagnostics

tf = pytest.importorskip("transformers")

LAYER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def wrong_axis(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention (B, H, T, d) with the softmax over the queries instead of the keys: the bug."""
    scores = query @ key.transpose(-2, -1) * scaling  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
    if attention_mask is not None:
        scores = scores + attention_mask[..., :key.shape[-2]]
    weights = scores.softmax(dim=-2)  # BUG: over the queries
    return (weights @ value).transpose(1, 2).contiguous(), weights  # (B, T, H, d)


tf.AttentionInterface.register("example_forms_wrong_axis", wrong_axis)


def videomae(attn_implementation: str = "sdpa"):
    torch.manual_seed(0)
    config = tf.VideoMAEConfig(**LAYER, image_size=32, patch_size=8, num_frames=4, tubelet_size=2,
                               attn_implementation=attn_implementation)
    return tf.VideoMAEModel(config).eval()


def test_a_video_model_gets_the_frames_its_config_declares_and_passes():
    report = diagnostics.audit_model(videomae())
    assert report.status == "passed", report
    assert report.layers, report  # its attention measured, layer by layer
    assert any("pixel_values (2, 4, 3, 32, 32)" in n for n in report.notes), report.notes


def test_a_video_model_with_a_softmax_over_the_wrong_axis_fails_at_that_layer_on_the_same_frames():
    model = videomae()
    layer = dict(model.named_modules())["encoder.layer.1.attention.attention"]
    layer.config = type(model.config)(**{**model.config.to_dict(), "attn_implementation": "example_forms_wrong_axis"})
    report = diagnostics.audit_model(model)
    assert any("pixel_values (2, 4, 3, 32, 32)" in n for n in report.notes), report.notes
    assert report.status == "failed", report
    assert {f.layer for f in report.findings if f.verdict == "fail"} <= {"encoder.layer.1.attention.attention",
                                                                         None}, report


def vision_encoder_decoder(attn_implementation: str = "sdpa"):
    torch.manual_seed(0)
    encoder = tf.ViTConfig(**LAYER, image_size=32, patch_size=8)
    decoder = tf.BertConfig(**LAYER, vocab_size=64, is_decoder=True, add_cross_attention=True)
    config = tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    model = tf.VisionEncoderDecoderModel(config).eval()
    model.decoder.set_attn_implementation(attn_implementation)  # the decoder's layers only
    return model


def test_a_vision_encoder_decoder_gets_decoder_ids_beside_its_pixels_and_passes():
    report = diagnostics.audit_model(vision_encoder_decoder())
    assert report.status == "passed", report
    assert report.causal, report  # the decoder, read as causal: its causality measured
    assert any("decoder_input_ids (2, 16) with pixel_values (2, 3, 32, 32)" in n for n in report.notes), report.notes


def test_a_vision_encoder_decoder_whose_decoder_softmax_is_over_the_wrong_axis_fails_on_the_same_inputs():
    report = diagnostics.audit_model(vision_encoder_decoder("example_forms_wrong_axis"))
    assert any("decoder_input_ids (2, 16) with pixel_values (2, 3, 32, 32)" in n for n in report.notes), report.notes
    assert report.status == "failed", report
    assert all(f.layer is None or f.layer.startswith("decoder.") for f in report.findings if f.verdict == "fail"), \
        report


def test_use_cache_is_left_out_where_the_forwards_kwargs_refuse_it():
    """Mimi's encoder hands use_cache= and its **kwargs to its transformer: the audit's use_cache=False through them
    raised "got multiple values for keyword argument 'use_cache'" on every call."""
    from diagnostics.model._runner import Runner

    torch.manual_seed(0)
    config = tf.MimiConfig(hidden_size=32, num_filters=8, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=8, intermediate_size=64, codebook_dim=32)
    model = tf.MimiEncoderModel(config).eval() if hasattr(tf, "MimiEncoderModel") else None
    if model is None:
        pytest.skip("this transformers has no MimiEncoderModel")
    runner = Runner(model, None, seq_len=None, seed=0)
    out, _ = runner(runner.inputs)
    assert torch.isfinite(out).all() and not runner.kwargs_take_cache  # refused once, then left out
    again, _ = runner(runner.inputs)
    torch.testing.assert_close(again, out)


@pytest.mark.slow  # builds and audits the sweep's Deformable DETR five times (the correct model, the reference, two bugs)
def test_a_detector_that_declares_no_size_and_raises_at_64_px_is_audited_on_larger_images(sweep_benchmark):
    """Deformable DETR declares no image size; at the audit's 64 px its last feature level is 1 x 1 and its GroupNorm
    raised ("Expected more than 1 value per channel"): inconclusive, raised on the example. At 128 px, said in the
    notes, it passes through the sweep, and the bugs injected into its second audited layer are caught there."""
    sweep = sweep_benchmark
    report = diagnostics.audit_model(sweep.build("deformable_detr"))
    assert any("pixel_values (2, 3, 128, 128)" in n and "a size nothing declares" in n for n in report.notes), \
        report.notes
    row = sweep.run_transformers("deformable_detr", bugs=True)
    assert row.verdict == "passed", row
    assert {row.bugs[b] for b in ("missing_scale", "softmax_wrong_dim")} == {"caught"}, row.bugs
