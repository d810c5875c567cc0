"""What a model's layers declare, read by the model audit (issue 33, causes 1 and 9).

- A layer's softmax scale is read from a number it holds as `scaling` (Hugging Face's), `scale` or `softmax_scale`:
  DIFF Transformer's is (d_k / 2) ** -0.5, not 1/sqrt(d_k), by design; the same layer declaring that scale but applying
  none still fails softmax_saturation. (A number that is the scale bug itself, the whole width's as CvT's, is no
  declaration: tests/test_model_attribute_scale.py.)
- A speech model's example is built from its config (real extra): Whisper's input_features (B, mel bins, twice its
  encoder positions), audited instead of a usage error that asks for one.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class HalfHeadScale(nn.Module):
    """Two-head self-attention scaled by (d_k / 2) ** -0.5, held as `self.scale` (DIFF Transformer's, whose heads are
    two half-width maps each); `applied`: False multiplies q·k by nothing although it declares the scale (a bug)."""

    def __init__(self, d_model: int = 16, applied: bool = True):
        super().__init__()
        self.scale, self.applied = (d_model // 2 / 2) ** -0.5, applied
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, T, D/2)
        scores = q @ k.transpose(-1, -2) * (self.scale if self.applied else 1.0)  # (B, 2, T, T)
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class ScaledLM(nn.Module):
    def __init__(self, applied: bool):
        super().__init__()
        seed_rng(0)
        self.wte, self.attn, self.head = nn.Embedding(32, 16), HalfHeadScale(applied=applied), nn.Linear(16, 32)
        with torch.no_grad():
            self.wte.weight.mul_(3.0)  # scores large enough that the scale shows in the softmax

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("applied", [True, False])
def test_a_scale_the_layer_declares_as_scale_is_what_its_softmax_is_judged_against(applied):
    ids = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(0))
    report = diagnostics.audit_model(ScaledLM(applied), example=ids, detectors=["softmax_saturation"])
    saturation = report.layers["attn"].result("softmax_saturation")
    assert any("from HalfHeadScale.scale" in n for n in report.notes), report.notes
    if applied:
        assert saturation.verdict == "pass", saturation  # was: fail, "1.41x too sharp" against 1/sqrt(d_k)
    else:
        assert saturation.verdict == "fail", saturation


class SplitScale(nn.Module):
    """Two heads of 8; `self.scaling = d_k ** exponent` applied to q and to k each, the scores given no other scale
    (OpenAI's privacy filter: head_dim ** -0.25 on both, so q·k gets 1/sqrt(d_k)). exponent -0.5 on both is the
    standard scale applied twice, 1/d_k (a bug)."""

    def __init__(self, exponent: float, d_model: int = 16):
        super().__init__()
        self.scaling = (d_model // 2) ** exponent
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)  # 3 x (B, 2, T, D/2)
        scores = (q * self.scaling) @ (k * self.scaling).transpose(-1, -2)  # (B, 2, T, T)
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("exponent, verdict", [(-0.25, "pass"), (-0.5, "fail")])
def test_a_declared_scale_applied_to_q_and_to_k_each_is_judged_by_its_square(exponent, verdict):
    model = ScaledLM(True)
    model.attn = SplitScale(exponent)
    ids = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(0))
    report = diagnostics.audit_model(model, example=ids, detectors=["softmax_saturation"])
    saturation = report.layers["attn"].result("softmax_saturation")
    assert saturation.verdict == verdict, saturation  # -0.25 was: fail, "1.68x too flat" against the declared scale
    assert ("the square of the declared scale" in saturation.message) is (verdict == "pass"), saturation.message


def test_a_speech_model_is_audited_on_input_features_read_from_its_config():
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is not installed: pip install -e \".[real]\"")
    config = transformers.WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                        num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                                        vocab_size=64)
    torch.manual_seed(0)
    encoder = transformers.WhisperForAudioClassification(config).eval()  # its main input: input_features
    report = diagnostics.audit_model(encoder, detectors=["runs", "output_shape"])
    assert any("input_features (2, 8, 16) read from the config" in n for n in report.notes), report.notes
    assert report.status == "passed", report  # was: a usage error asking for example={'input_features': ...}


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)

    def get_input_embeddings(self):
        return self.embed_tokens


class Seq2Seq(nn.Module):
    """An encoder-decoder whose own table is the encoder's; `get_decoder()` its decoder."""

    def __init__(self):
        super().__init__()
        self.shared, self.decoder = nn.Embedding(8, 4), Decoder()

    def get_input_embeddings(self):
        return self.shared

    def get_decoder(self):
        return self.decoder


class Wrapped(nn.Module):
    """A vision-language model around a Seq2Seq whose `get_decoder()` is the whole Seq2Seq (Florence-2's BART)."""

    def __init__(self):
        super().__init__()
        self.language_model = Seq2Seq()

    def get_input_embeddings(self):
        return self.language_model.shared

    def get_decoder(self):
        return self.language_model


def test_the_decoder_token_table_is_found_through_every_get_decoder():
    from diagnostics.model.gradients import input_embedding

    wrapped, plain = Wrapped(), Seq2Seq()
    # was: the Seq2Seq's own table, the encoder's, so the decoder's causality was read on the bidirectional encoder
    assert input_embedding(wrapped, decoder=True) is wrapped.language_model.decoder.embed_tokens
    assert input_embedding(plain, decoder=True) is plain.decoder.embed_tokens  # one level, as before
    assert input_embedding(wrapped) is wrapped.language_model.shared  # without decoder=True: the model's own


class NestedReturn(HalfHeadScale):
    """I-BERT's return: ((context, attention probabilities), the output's quantisation scale)."""

    def forward(self, x):
        return (super().forward(x), None), torch.tensor(0.1)


class NestedLM(ScaledLM):
    def __init__(self, applied: bool):
        super().__init__(applied)
        seed_rng(0)
        self.attn = NestedReturn(applied=applied)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        return self.head(x + self.attn(x)[0][0])


@pytest.mark.parametrize("applied", [True, False])
def test_a_layer_returning_its_output_inside_a_nested_tuple_is_audited_on_it(applied):
    ids = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(0))
    report = diagnostics.audit_model(NestedLM(applied), example=ids,
                                     detectors=["runs", "output_shape", "softmax_saturation"])
    layer = report.layers["attn"]
    # was: the scale read as the output (output_shape failed; I-BERT's runs failed on every probe)
    assert layer.result("runs").verdict == "pass" and layer.result("output_shape").verdict == "pass", layer
    assert layer.result("softmax_saturation").verdict == ("pass" if applied else "fail"), layer
