"""The model audit on a library's whole population: every model type it builds, audited zero-config.

    python benchmarks/sweep.py LIBRARY [--sample N] [--seed S] [--only TYPE ...] [--limit N]
                               [--timeout SECONDS] [--results FILE] [--fresh] [--no-bugs] [--jobs N]
                               [--device cuda] [--dtype bfloat16]

Enumerates the model types of transformers' own registries (every type with a class in one of its auto model
mappings), builds each from a tiny config (its defaults with every width, depth and head count shrunk: `tiny_config`;
nothing is downloaded, HF_HUB_OFFLINE=1) and runs `diagnostics.audit_model(model)` with nothing declared. The class
audited is the type's first of: causal LM, image-text-to-text, seq2seq LM, masked LM, base model. Where the class
routes its attention through transformers' `AttentionInterface` and its correct audit passed, one layer (the
second one audited, else the first) is given each of `BUGS` through the explicit attention of
tests/test_model_audit.py (`bug_attention`): the bug is caught at the right layer when the audit fails and every
finding with a layer names that one. A mask bug (`MASK_BUGS`) is not applicable where the model masks nothing
(not causal, no padding mask taken): it changes nothing there, and is not counted.

`timm`: every architecture of timm's `list_models()` whose module defines or imports an attention class (an
nn.Module named *Attention: read from the source, nothing built to filter), each built with pretrained=False at
the first of `TIMM_TINY` it takes (64 px, 32 wide, 2 deep, 4 heads, else its default size), audited the same way,
whatever its attention classes are named; one in which the audit finds no attention and whose built modules hold no
attention class is a row "no attention", not counted (transformers' rule). Bugs are injected into
one layer (as for transformers) through torch's SDPA called inside that layer's forward (`inject_timm`).

`diffusers`: its attention layers, the layer audit (`diagnostics.audit`): every processor of attention_processor on
its Attention and every *Attention class of diffusers.models; bugs through torch's SDPA (benchmarks/sweep_diffusers.py).

`x_transformers`, `vit_pytorch`, `open_clip`, `whisper` (the zoo extra's packages), or any other installed package by
its import name (`pip install local-attention`, then `python benchmarks/sweep.py local_attention`): every *Attention
class the package defines, built small from its constructor's names, the layer audit, as for diffusers
(benchmarks/sweep_packages.py).

Each model runs in a forked child with a time limit (`--timeout`, 240 s), `--jobs` of them at once (default: the
number of cores), each on one torch thread; the parent alone writes the results. A model that hangs or takes the
machine's memory is a row, not the end of the sweep. Rows are appended to a results file (JSON lines, one per
model type; default under the temporary directory, named by the library's version) as they finish, so a sweep
stopped half way resumes where it stopped (`--fresh` starts over). `--sample N` takes N types drawn with
`--seed` (a fixed sample: the same N types every run); `--only` names types; `--limit` takes the first N.
`--device` and `--dtype` (transformers and timm) move each model, built on the CPU in float32 with the same seed,
to a device and a dtype before it is audited, injected bugs too: the population at the dtype people train at, on a
GPU's kernels. The results file is named by them, so such a run never resumes from the CPU float32 rows.

Prints a row per model (type, class, built, verdict, findings, bugs caught at the right layer, seconds) and the
rates: built; of the built, passed / failed / inconclusive / usage error / crashed or out of time; bugs caught
at the right layer over the models whose correct audit passed. A failure of a type in `KNOWN` (a problem of the
library's own, confirmed outside the audit) is counted apart as an expected failure, with its reason.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

BUGS = ("missing_scale", "mask_ignored", "softmax_wrong_dim", "mask_after_softmax")
# a bug that keeps every property a black-box check reads (the same function as a correct layer with its query heads
# permuted): caught only against the layer's own weights (own_weights), so counted apart, where those were read
GROUPED = "grouped_heads_wrong_order"
MASK_BUGS = ("mask_ignored", "mask_after_softmax")  # nothing to break where the model masks nothing
CLASS_ROLES = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
               "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
               "MODEL_MAPPING_NAMES")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
ROUTED = ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_k", "moe_top_k")
# widths, depths and head counts: a default larger than this is shrunk to it (32 wide, 4 heads of 8, 2 layers)
TINY = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim"), 32),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), 4),
    "num_key_value_heads": 2, "head_dim": 8, "d_kv": 8,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "moe_intermediate_size", "shared_expert_intermediate_size"), 64),
    **dict.fromkeys(EXPERTS, 4),
    # experts chosen per token follow the experts left (a router's top-k over 4 experts raises past 4); grouped
    # routing (DeepSeek's n_group groups, topk_group of them kept) as one group
    **dict.fromkeys(ROUTED, 2),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "image_size": 64,
    # a sparse-attention indexer (DeepSeek-V3.2's, GLM-DSA's, HY-V4's) keeps its top index_topk keys: with 2,048 of
    # them it chooses every key of any length the audit reaches (gradient_flow stops at 1,024), so it is never used;
    # 32 keys make it choose from 64 tokens on, where gradient_flow finds it (a top-k choice: a warning, not a fail)
    "index_topk": 32, "index_n_heads": 4, "index_head_dim": 16,
    # a linear-attention (gated delta rule) mixer's own heads, beside the attention's: left at GLM-5-Next's 64 heads of
    # 128 (8,192 wide on a 32-wide model), its text model's audit held 14.5 GB and was killed, its full model ran past
    # 240 s; value heads stay a multiple of key heads (Qwen3-Next's 16 and 32), as key/value heads of query heads
    "linear_num_heads": 4, "linear_head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    # a looped model's sections (Dory: 8 input layers, a recurrent middle looped over, 8 output layers) fit in the
    # 2 layers kept: left at 8 each, its middle was -14 layers and its cache read the wrong layers
    "n_input_layers": 1, "n_output_layers": 1,
    # a convolutional audio codec's first width, doubled at each of its downsamplings (VibeVoice's acoustic and
    # semantic tokenizers: 32 doubled six times, 2,048 channels with a 4x expansion: 1.03 billion parameters and 4.8 GB
    # to build "tiny", over 17 GB by its audit, killed; EnCodec's, Mimi's, WavTokenizer's likewise)
    "num_filters": 8,
}
# per-head widths and ranks by how their names end, so that those of one layer stay consistent: multi-head latent
# attention (DeepSeek's qk_rope_head_dim, qk_nope_head_dim, v_head_dim, kv_lora_rank) and a partial rotary
# (CodeGen's rotary_dim) shrunk with the head (a 64-wide rotary table on an 8-wide head raises); and a global stage's
# width read by another stage's config (BLT's local decoder projects the global transformer's output from
# hidden_size_global: left at 2,048 beside the global config's 32, every forward raised in that projection)
TINY_ENDINGS = {"rope_head_dim": 8, "nope_head_dim": 8, "v_head_dim": 8, "_lora_rank": 16, "rotary_dim": 4,
                "_size_global": 32}
LAYER_COUNT = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
TF = "transformers 5.25.0, transformers/models/"
KNOWN = {  # model type -> why it fails: a problem of the library's own, confirmed outside the audit (issue 33)
    "swiftformer": f"a softmax over a size-1 axis: every weight is 1 ({TF}swiftformer/modeling_swiftformer.py:183, "
                   "`scaled_query_weight.softmax(dim=-1)` of `query @ self.w_g`, w_g of shape (dim, 1), line 169)",
    "mamba": f"a cached step of more than one token restarts the scan: the recurrent state is read only when "
             f"seq_len == 1 ({TF}mamba/modeling_mamba.py:378)",
    "falcon_mamba": f"as Mamba: the recurrent state is read only when seq_len == 1 "
                    f"({TF}falcon_mamba/modeling_falcon_mamba.py:369)",
    "cpmant": f"CpmAntForCausalLM attends both ways: its base model marks every token as context, `context = "
              f"torch.full((batch, seq_length), 1, ...)` ({TF}cpmant/modeling_cpmant.py:626), and context tokens see "
              f"every other token (line 565), so past logits move when later tokens change",
    "fsmt": f"with use_cache=True the decoder gets no causal mask: `decoder_padding_mask, causal_mask = None, None` "
            f"({TF}fsmt/modeling_fsmt.py:866), so a prefill of several decoder tokens sees the later ones (generate's "
            f"one-token prefill hides it)",
    "jamba": f"as Mamba: a cached step of more than one token restarts the scan, the recurrent state read only when "
             f"seq_len == 1 ({TF}jamba/modeling_jamba.py:515; its own comment at line 555: the scan 'does not take the "
             f"past state, it is WRONG if the cache is not empty'); steps of 1 match",
    "mra": f"on a machine without its CUDA kernel the attention returns zeros: mra2_attention's `return "
           f"torch.zeros_like(query).requires_grad_()` ({TF}mra/modeling_mra.py:364); the output does not depend on "
           f"the query, key and value weights",
    "recurrent_gemma": f"left padding moves the real tokens' outputs: the recurrent block takes attention_mask and "
                       f"never applies it ({TF}recurrent_gemma/modeling_recurrent_gemma.py:419), so its convolution "
                       f"and RG-LRU scan run over the pad tokens",
    "switch_transformers": f"a forward with use_cache=True and no encoder_outputs raises: "
                           f"SwitchTransformersForConditionalGeneration passes its **kwargs, use_cache among them, to "
                           f"its encoder ({TF}switch_transformers/modeling_switch_transformers.py:1003), whose stack "
                           f"raises 'use_cache can only be set to True if ... used as a decoder' (line 734); T5 "
                           f"does not",
    "xlstm": f"cached decoding raises ('matC_old has wrong shape') where hidden_size x qk_dim_factor (or "
             f"v_dim_factor) is not a multiple of 64; with use_cache=False it runs: the cache sizes its state by "
             f"config.qk_head_dim and v_head_dim, rounded up to 64 "
             f"({TF}xlstm/modeling_xlstm.py:1357, configuration_xlstm.py:161), the layer by int(hidden_size x "
             f"qk_dim_factor) unrounded (modeling_xlstm.py:1043)",
    "moshi": f"a full forward ignores the sliding window its cache applies ({TF}moshi/modeling_moshi.py); not "
             f"reproduced at the sweep's 16 tokens, inside the window",
    "levit": f"in eval mode the attention biases are cached by the first forward ({TF}levit/modeling_levit.py:193): "
             f"after a forward under no_grad every later forward's attention_biases get no gradient (confirmed by a "
             f"plain script: grad None after one no_grad forward, non-zero without it)",
    "prophetnet": f"ProphetNetForCausalLM: past logits move when later tokens change; its logits are the first "
                  f"predicting stream's ({TF}prophetnet/modeling_prophetnet.py:1774)",
    "yoso": f"padding is not masked: YosoModel passes its 0/1 attention_mask to the encoder as it came ({TF}yoso/"
            f"modeling_yoso.py:683), and the layer, written for an additive mask (0 / -10000), turns it into key "
            f"weights by `1.0 + attention_mask / 10000.0` then `.int()` (line 356): 1 for pads and real tokens alike; "
            f"and its attention's backward is written by hand, not the forward's derivative: YosoCumulation.backward "
            f"(line 119) takes expectation x hash_code_len / 2 for the derivative of (1 - acos(q.k) / pi) ** "
            f"hash_code_len (the query's and key's gradients 16% off autograd's of the same formula; the value's "
            f"exact)",
    "nystromformer": f"padding moves the real tokens' outputs: the depth-wise convolution over the values, "
                     f"`context_layer += self.conv(value_layer)` ({TF}nystromformer/modeling_nystromformer.py:212, "
                     f"kernel conv_kernel_size=65), runs over the pad tokens' values, unmasked",
    "convbert": f"padding moves the real tokens' outputs: the span-based dynamic convolution beside the attention "
                f"runs over the pad tokens, unmasked: the keys' separable convolution "
                f"`self.key_conv_attn_layer(hidden_states.transpose(1, 2))` ({TF}convbert/modeling_convbert.py:191) "
                f"and the unfold of conv_kernel_size=9 neighbours (line 208); the mask reaches only the attention "
                f"scores (line 228). A plain script: 4 right pads, masked, move the real tokens' logits by 0.02 of "
                f"their RMS (tests/test_sweep.py)",
    "funnel": f"padding moves the real tokens' outputs: each pooling averages pairs of tokens without the mask, "
              f"`self.pool_tensor(output, mode=self.config.pooling_type)` ({TF}funnel/modeling_funnel.py:309; "
              f"avg_pool2d, line 277), so a real token is pooled with a pad where the boundary falls between them, "
              f"and the decoder upsamples that back onto the real positions",
    "deepseek_v4": f"left padding moves the real tokens' outputs: the compressors pool windows of compress_rate "
                   f"slots counted from the tensor's first slot, pads included, `kv[:, :usable]` "
                   f"({TF}deepseek_v4/modeling_deepseek_v4.py:419, 647), while the queries' causal threshold over "
                   f"the compressed entries reads position_ids, `(position_ids + 1) // self.compress_rate` "
                   f"(lines 448, 588); right padding leaves them",
    "paligemma": f"a sequence's logits depend on whether another sequence of its batch is padded: the configuration "
                 f"sets text_config.use_bidirectional_attention=True ({TF}paligemma/configuration_paligemma.py:92), "
                 f"so the Gemma attention's is_causal is False (gemma/modeling_gemma.py:228); where nothing is padded "
                 f"`create_causal_mask` (modeling_paligemma.py:246) returns None and SDPA attends both ways, where a "
                 f"row is padded it builds a causal mask",
    "colpali": f"as PaliGemma, its language model ({TF}colpali/modeling_colpali.py:99, a PaliGemma model): a "
               f"sequence attends both ways where nothing in its batch is padded (use_bidirectional_attention=True, "
               f"paligemma/configuration_paligemma.py:92), causally where a row is padded",
    "qwen3_omni_moe_thinker": f"a forward given input_ids and an attention_mask (all ones) raises AttributeError: it "
                              f"computes its 3-D rotary positions by get_rope_index ({TF}qwen3_omni_moe/"
                              f"modeling_qwen3_omni_moe.py:1908), which reads config.vision_start_token_id (line 291), "
                              f"a field Qwen3OmniMoeThinkerConfig does not have (configuration_qwen3_omni_moe.py:191; "
                              f"confirmed by a plain script: runs without the mask, raises with it; "
                              f"qwen2_5_omni_thinker's config lacks it too)",
    "qwen2_5_omni_thinker": f"as Qwen3-Omni's thinker: a forward given an attention_mask raises AttributeError in "
                            f"get_rope_index ({TF}qwen2_5_omni/modeling_qwen2_5_omni.py:288, called at line 1819), "
                            f"which reads config.vision_start_token_id, a field of Qwen2_5OmniTalkerConfig "
                            f"(configuration_qwen2_5_omni.py:343) that Qwen2_5OmniThinkerConfig (line 211) lacks "
                            f"(confirmed by a plain script: runs without the mask, raises with it; a checkpoint whose "
                            f"JSON sets the field runs; it ran on no input at all until the tiny config's rotary "
                            f"sections fitted, 2026-12-04)",
    "nemotron_asr_streaming_encoder": f"its eager attention gives NaN everywhere: eager's mask is additive (0.0 where "
                                      f"a key is allowed), which the layer reads as a boolean, `matrix_bd.masked_fill_("
                                      f"attention_mask.logical_not(), -inf)` ({TF}nemotron_asr_streaming/"
                                      f"modeling_nemotron_asr_streaming.py:615): every allowed key is set to -inf "
                                      f"(and line 983 takes rows of 0.0 for fully masked ones); sdpa's boolean mask is "
                                      f"read right (confirmed by a plain script: eager output all NaN, sdpa finite; "
                                      f"ParakeetEncoder, its base, agrees to 7e-7)",
    "sam3_lite_text_text_model": f"padding moves the real tokens' outputs: the learned position table is interpolated "
                                 f"to the whole input's length (Sam3LiteTextTextPositionEmbedding, {TF}sam3_lite_text/"
                                 f"modeling_sam3_lite_text.py:83), so a token's position embedding depends on how "
                                 f"many pads follow it (confirmed by a plain script: positions 0..11 interpolated to "
                                 f"12 and to 16 differ by 0.58; real tokens move by 4.3 with 4 right pads, with or "
                                 f"without its RepMixer convolution blocks)",
    "swin": f"an image whose stage resolution falls below the window (any image under 224 px with window 7: 192 px, "
            f"the sweep's 64 px) raises in the attention: SwinLayer builds its attention's relative position bias for "
            f"config.window_size ({TF}swin/modeling_swin.py:519, 416) and then clamps the window to the resolution "
            f"(set_shift_and_window_size, line 576): a 4 x 4 window's 16 keys against a 49-entry bias (confirmed by "
            f"a plain script: SwinModel(SwinConfig(image_size=192)) raises on 192 px images, runs at 224)",
    "donut-swin": f"as Swin: the window clamped to a smaller stage resolution after the relative position bias was "
                  f"built for config.window_size ({TF}donut/modeling_donut_swin.py:505, 511); built for 64 px it "
                  f"raises on 64 px images (confirmed by tests/test_sweep.py's plain script; SwinV2 and "
                  f"MaskFormer-Swin run)",
    "blt": f"a forward with use_cache=True (its config's default) raises AttributeError: BltModel builds its cache as "
           f"`DynamicCache(config=self.config)` ({TF}blt/modeling_blt.py:1190), which reads num_hidden_layers from "
           f"config.get_text_config(decoder=True), the BltConfig itself, whose depths are its sub-configs' only "
           f"(cache_utils.py:2121; generate raises the same); and left padding moves the real tokens' outputs: the "
           f"entropy patcher is run on input_ids without the attention_mask (modeling_blt.py:1215), so it attends the "
           f"pad bytes and the real bytes' entropies, which cut the patches, move (confirmed by tests/test_sweep.py's "
           f"plain scripts: 'BltConfig' object has no attribute 'num_hidden_layers'; 4 masked left pads move the real "
           f"tokens' logits by 4.5 of their RMS)",
    "aimv2": f"its text tower attends both ways unpadded and causally when padded: Aimv2Attention says is_causal = "
             f"False ({TF}aimv2/modeling_aimv2.py:283) and Aimv2TextModel builds a causal mask only from an "
             f"attention_mask (line 575), which sdpa drops where nothing is padded, so right padding moves the real "
             f"tokens' outputs (confirmed by tests/test_sweep.py's plain script: by 1.2 of their RMS; CLIP's text "
             f"tower, the same script, 9e-7)",
    "pi05": f"as Aimv2, its language model (a GemmaModel with use_bidirectional_attention=True, "
            f"{TF}pi05/configuration_pi05.py:126) attends both ways unpadded and causally when padded: GemmaAttention "
            f"says is_causal = not use_bidirectional_attention ({TF}gemma/modeling_gemma.py:228) and GemmaModel builds "
            f"create_causal_mask whatever the flag (line 403), which sdpa drops where nothing is padded (confirmed by "
            f"tests/test_sweep.py's plain script: right padding moves the real tokens by 0.52 of their RMS; a plain "
            f"GemmaModel, the same script, 2.4e-7; PI0.5 itself passes its own 4-D masks, so the model as PI0.5 calls "
            f"it is not affected: the row is its language model audited alone, as its tower)",
    "cvt": f"q·k is multiplied by 1/sqrt(embed_dim), the whole width's, in every stage, `self.scale = embed_dim**-0.5` "
           f"({TF}cvt/modeling_cvt.py:152, applied at line 205): the original CvT code's line (`self.scale = dim_out ** "
           f"-0.5`), which its trained weights expect; 1/sqrt(head_dim) only in the one-head first stage (confirmed by "
           f"tests/test_sweep.py's plain script: cvt-13's stages of 3 and 6 heads of 64 multiply by 0.0722 and 0.0510, "
           f"1/sqrt(192) and 1/sqrt(384), not 0.125); a user declares that scale (diagnostics.audit(layer, scale=...)) "
           f"to audit the rest",
    "clvp": f"its rotary width is max(projection_dim // (2 x heads), 32) ({TF}clvp/modeling_clvp.py:255), never read "
            f"from the head width, so any config whose heads are narrower than that (the sweep's 8-wide heads) raises "
            f"inside the attention, `apply_rotary_pos_emb` on mismatched halves (confirmed by tests/test_sweep.py's "
            f"plain script: ClvpEncoder 32 wide with 4 heads raises on any token ids, with 1 head of 32 it runs); its "
            f"default sizes (heads of 64, rotary 32) are unaffected",
    "edgetam_vision_model": f"its default config does not run: the backbone's timm architecture is given under a "
                            f"misspelt key, `\"archirecture\": \"repvit_m1\"` ({TF}edgetam/configuration_edgetam.py:56), "
                            f"so TimmWrapperConfig keeps its default resnet50, whose 1024-channel stage meets a neck "
                            f"built for backbone_channel_list [384, 192, 96, 48], and every forward raises (confirmed by "
                            f"tests/test_sweep.py's plain script: EdgeTamVisionConfig() raises on any image, with "
                            f"architecture='repvit_m1' it runs); inconclusive, the audit's example never ran",
    "edgetam": "as EdgeTAM's vision model, its vision encoder: the default backbone is resnet50, not repvit_m1 "
               "(a misspelt config key), and every forward raises",
    "uvdoc": f"its default config does not run: the backbone's out_features default to the last stage alone "
             f"({TF}uvdoc/configuration_uvdoc.py:50, utils/backbone_utils.py:66), so 128 channels reach a bridge "
             f"connector built for all six stages, 128 x 6 = 768 ({TF}uvdoc/modeling_uvdoc.py:339, raising at 354), on "
             f"any image (confirmed by tests/test_sweep.py's plain script; with out_features stage1..stage6 it runs); "
             f"inconclusive, the audit's example never ran",
    "pp_ocrv6_small_det": f"its default config does not run: __post_init__ builds a bare pp_lcnet_v4 backbone "
                          f"({TF}pp_ocrv6_small_det/configuration_pp_ocrv6_small_det.py:76-81) before the pp_lcnet_v3 "
                          f"its sub_configs_defaults name (54-65) is read, so one 384-channel stage meets a neck built "
                          f"for four of layer_list_out_channels (12, 18, 42, 360) (line 72, PP-OCRv5-mobile's, whose "
                          f"projections this model lacks: modeling_pp_ocrv6_small_det.py:234-241), on any image "
                          f"(confirmed by tests/test_sweep.py's plain script; with the v3 backbone's four stages and "
                          f"channels [48, 96, 192, 384] it runs); inconclusive, the audit's example never ran",
}
# Not KNOWN: timm's eval-mode attention-bias cache (LeViT, EfficientFormer, EfficientViT-MSRA, TinyViT). After a
# forward under no_grad the cached biases get no gradient (a pitfall for fine-tuning in eval mode after inference,
# confirmed by tests/test_sweep.py's plain script), but gradient_flow enters eval mode again before its forward, and
# timm's train() override drops the cache there: those models no longer fail (transformers' LeViT keeps its cache
# through eval(), and stays KNOWN).
KNOWN.update(__import__("sweep_diffusers").KNOWN)  # diffusers' own, keyed by the row names of its sweep
KNOWN.update(__import__("sweep_packages").KNOWN)  # the zoo packages' own, likewise


@dataclass
class Row:
    model_type: str
    cls: str = ""
    built: bool = False
    verdict: str = ""  # passed, failed, inconclusive, usage error, crashed, timeout, not built
    why: str = ""
    findings: list = field(default_factory=list)  # "detector@layer"
    causal: str = ""
    bugs: dict = field(default_factory=dict)  # bug -> "caught" (+ "; a warning also at"), "missed", "elsewhere"
    injected: str = ""  # the layer the bugs went into
    own_weights: dict = field(default_factory=dict)  # layer -> own_weights' verdict (and why, where not "pass")
    declared: str = ""  # a layer audit's named declaration and the status it gave with it (diffusers)
    seconds: float = 0.0  # wall clock, the fork to the row
    cpu_seconds: float = 0.0  # the child's own CPU time (user + system): what a model costs, whatever else runs

    def judged(self, verdict: str, why: str, limit: int = 300) -> None:
        """The verdict and its reason, the reason's first line cut to `limit` characters in the middle: its end says
        where to look (an inconclusive's "(see the notes)", a usage error's "Fix: ..."), its start what happened."""
        why = why.splitlines()[0] if why else ""
        if len(why) > limit:
            why = why[:limit - 125] + " ... " + why[-120:]
        self.verdict, self.why = verdict, why


# ---- transformers -------------------------------------------------------------------------------------------


def transformers_types() -> list[str]:
    """Every model type with a class in one of transformers' auto model mappings."""
    from transformers.models.auto import modeling_auto

    types = set()
    for name in dir(modeling_auto):
        if name.startswith("MODEL") and name.endswith("_MAPPING_NAMES"):
            types |= set(getattr(modeling_auto, name))
    return sorted(types)


def model_class(model_type: str):
    """The class a user would reach for first (`CLASS_ROLES`), else any class of the type."""
    import transformers
    from transformers.models.auto import modeling_auto

    for role in CLASS_ROLES:
        names = getattr(modeling_auto, role, {}).get(model_type)
        for name in (names,) if isinstance(names, str) else names or ():
            cls = getattr(transformers, name, None)
            if cls is not None:
                return cls
    for name in dir(modeling_auto):  # a type only in a task mapping (a detector, a vocoder)
        if name.startswith("MODEL") and name.endswith("_MAPPING_NAMES"):
            names = getattr(modeling_auto, name).get(model_type)
            for n in (names,) if isinstance(names, str) else names or ():
                if getattr(transformers, n, None) is not None:
                    return getattr(transformers, n)
    raise LookupError(f"no class for {model_type}")


def kept_layers(layer_types, depth: int, tiny: int) -> list[int]:
    """The layers a tiny config keeps of `depth`: the first `tiny`, except that a hybrid's kinds are all kept where
    they fit (Qwen3.5's and MiniCPM-V 4.6's first three layers are linear attention, the fourth full: the first two
    alone held no attention to audit); every per-layer list is cut at the same layers."""
    keep = list(range(min(tiny, depth)))
    if isinstance(layer_types, list) and len(layer_types) == depth:
        firsts = list(dict.fromkeys(layer_types))  # each kind once, in order
        chosen = [layer_types.index(kind) for kind in firsts][:tiny]
        keep = sorted(chosen + [i for i in keep if i not in chosen][:tiny - len(chosen)])
    return keep


def _shrunk(config) -> dict:
    """The keyword overrides that make `config` tiny, sub-configs (as dicts) included."""
    from transformers import PreTrainedConfig

    tiny = {**{k: small for k in vars(config) for end, small in TINY_ENDINGS.items() if k.endswith(end)}, **TINY}
    kw = {k: v for k, v in tiny.items() if isinstance(getattr(config, k, None), int)
          and not isinstance(getattr(config, k), bool) and getattr(config, k) > v
          and not isinstance(getattr(type(config), k, None), property)}  # derived (Falcon's head_dim): follows
    for k in ROUTED:  # left unset by the default config (DeepSeek-V2's): its router's top-k raises on None
        if k in vars(config) and getattr(config, k) is None and any(getattr(config, e, None) for e in EXPERTS):
            kw[k] = TINY[k]
    rope = getattr(config, "rope_parameters", None)  # multimodal rotary: (time, height, width) over half the rope
    if "qk_rope_head_dim" in kw and isinstance(rope, dict) and len(rope.get("mrope_section") or ()) == 3:
        half = kw["qk_rope_head_dim"] // 2
        kw["rope_parameters"] = {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}  # HY-V4-VL
    elif isinstance(rope, dict) and _splits_rope(config):
        kw["rope_parameters"] = {**rope, "mrope_section": _sections(config, kw)}
    rope, head = getattr(config, "qk_rope_head_dim", None), getattr(config, "head_dim", None)
    if "qk_rope_head_dim" in kw and "head_dim" in kw and isinstance(rope, int) and isinstance(head, int) and rope:
        # the rotary table is built over head_dim x partial_rotary_factor (Mistral 4's 128 x 0.5 = its 64-wide rope
        # part): the two keep their ratio (8 and 8 built a 4-wide table for an 8-wide rope part, and it raised)
        kw["head_dim"] = kw["qk_rope_head_dim"] * head // rope
    kw.update(_stage_heads(config, kw))
    kw.update(_stage_widths(config, kw))
    heads, groups = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if "num_key_value_heads" in kw and heads == groups and "num_attention_heads" in kw:
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # a key/value head per query head stays so (MLA needs it)
    for k in LAYER_COUNT:
        # a depth that is another name for a stage count (attribute_map: ConvNeXt's num_hidden_layers is num_stages),
        # given per stage by tuples of that length (hidden_sizes, depths), is left as it is: cut to 2 beside 4
        # hidden_sizes, ConvNeXt's last LayerNorm (768 wide) raised on its second stage (192) on every forward
        old = getattr(config, k, None)
        alias = getattr(config, "attribute_map", {}).get(k)
        if k in kw and alias is not None and alias not in LAYER_COUNT and isinstance(old, int) and any(
                isinstance(v, tuple) and len(v) == old for v in vars(config).values()):
            del kw[k]
    for k in LAYER_COUNT:  # lists with one entry per layer follow the depth
        old = getattr(config, k, None)
        if k in kw and isinstance(old, int):
            keep = kept_layers(getattr(config, "layer_types", None), old, kw[k])
            for name, value in vars(config).items():
                if isinstance(value, list) and len(value) == old:
                    kw[name] = [value[i] for i in keep]
                    if "key_value_heads" in name and "num_attention_heads" in kw:  # Sapiens2's 16 per layer for 4
                        kw[name] = [min(h, kw["num_attention_heads"]) if isinstance(h, int) else h for h in kw[name]]
    subs = {}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PreTrainedConfig):
            subs[name] = sub
            kw[name] = {**sub.to_dict(), **_shrunk(sub)}
    return _channels(config, subs, _coupled(subs, kw))


def _channels(config, subs: dict, kw: dict) -> dict:
    """A config's list of its sub-config's per-stage widths (SAM 2's vision config reads its backbone's stages through
    backbone_channel_list, [768, 384, 192, 96], the Hiera's embed_dim_per_stage reversed) follows their scaling
    (`_stage_widths`): left as it was, its neck's first convolution expected 768 channels of a 256-wide stage."""
    scaled = {}
    for name, sub in subs.items():
        for k, value in vars(sub).items():
            new = kw[name].get(k)
            if isinstance(value, (list, tuple)) and isinstance(new, (list, tuple)) and len(new) == len(value) and \
                    all(isinstance(v, int) and not isinstance(v, bool) for v in value) and list(new) != list(value):
                scaled.update(zip(value, new))
    for k, value in vars(config).items():
        if k.endswith("channel_list") and isinstance(value, (list, tuple)) and value and all(v in scaled for v in value):
            kw[k] = type(value)(scaled[v] for v in value)
    return kw


def _coupled(subs: dict, kw: dict) -> dict:
    """A width one sub-config declares for another's (a name ending in hidden_size, left as it was, equal to another
    sub-config's default width, which was shrunk) follows that one: PP-FormulaNet's vision config projects its output
    to decoder_hidden_size, 512, its text config's d_model; left at 512 beside the text's 32, its decoder's
    cross-attention raised on every forward (a correct model failed model_runs inside it)."""
    shrunk = {getattr(sub, k): kw[name][k] for name, sub in subs.items() for k in WIDTHS
              if isinstance(getattr(sub, k, None), int) and k in kw[name] and kw[name][k] != getattr(sub, k)}
    for name, sub in subs.items():
        for k, value in vars(sub).items():
            if k.endswith(COUPLED_WIDTHS) and k not in WIDTHS and kw[name].get(k) == value and value in shrunk \
                    and not isinstance(value, bool):
                kw[name][k] = shrunk[value]
        feats, width = getattr(sub, "num_pos_feats", None), kw[name].get("output_channels")
        if isinstance(feats, int) and isinstance(width, int) and 2 * feats == sub.output_channels:
            kw[name]["num_pos_feats"] = width // 2  # SAM's sine features, two per channel of its neck's output
        size, patch = kw[name].get("image_size"), getattr(sub, "patch_size", None)
        grid = getattr(sub, "image_embedding_size", None)
        if isinstance(size, int) and isinstance(patch, int) and isinstance(grid, int) and \
                grid == sub.image_size // patch and size != sub.image_size:  # SAM's prompt grid: image / patch
            kw[name]["image_embedding_size"] = size // patch
    return kw


def _splits_rope(config) -> bool:
    """Whether the config's model splits its rotary table into (time, height, width) sections (`mrope_section`): the
    config's own, or a default written in its modeling code where the config states none (GLM-4V's [8, 12, 12],
    which sums to its full-size rotary half-width, 32, and raised on every tiny GLM-4V, GLM-Image and GLM-OCR)."""
    if isinstance(config.rope_parameters.get("mrope_section"), (list, tuple)):
        return True
    module = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        return "mrope_section" in inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return False


def _sections(config, kw: dict) -> list[int]:
    """Three sections that sum to the tiny rotary table's half-width, head_dim x partial_rotary_factor / 2."""
    width = kw.get("hidden_size", getattr(config, "hidden_size", 0))
    heads = kw.get("num_attention_heads", getattr(config, "num_attention_heads", 1)) or 1
    head = kw.get("head_dim", getattr(config, "head_dim", None)) or width // heads
    half = int(head * config.rope_parameters.get("partial_rotary_factor", 1.0)) // 2
    return [half - 2 * (half // 3), half // 3, half // 3]


WIDTHS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")
# a sub-config's width for a sibling's input (`_coupled`): PP-FormulaNet's decoder_hidden_size, SAM 2's
# fpn_hidden_size, SAM's output_channels (its vision neck's output, the mask decoder's hidden_size); a tower's
# output width that its model's joint call reads (SigLIP's text projection_size, ViT's pooler_output_size in a
# vision-text dual encoder: left at 768 beside 32-wide towers, the whole raised on its towers' examples together;
# measured: of 831 types' tiny configs, these two names change 4, siglip, siglip2, vision-encoder-decoder and
# vision-text-dual-encoder)
COUPLED_WIDTHS = ("hidden_size", "output_channels", "projection_size", "pooler_output_size")
HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads")


def _stage_heads(config, kw: dict) -> dict:
    """Head counts given per stage (Swin's num_heads (3, 6, 12, 24) over stages of embed_dim x 2^i) shrunk with the
    width, each head keeping its width where it can: h x new / old, else the largest divisor of the new width under
    it. Left as they were, 3 heads on Swin's 32 wide first stage made a head 10.67 wide: SwinModel raised in its first
    attention and the Swin family (SwinV2, Donut-Swin, MaskFormer-Swin, Swin2SR) refused to build."""
    widths = [k for k in WIDTHS if k in kw and isinstance(getattr(config, k, None), int)]
    if not widths:
        return {}
    width = min(widths, key=lambda k: getattr(config, k))  # the first stage's (Swin's hidden_size is its last's)
    old, new = getattr(config, width), kw[width]
    out = {}
    for name in HEADS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value and all(isinstance(h, int) and h > 0 for h in value):
            out[name] = type(value)(
                h * new // old if h * new % old == 0
                else max(d for d in range(1, new + 1) if new % d == 0 and d <= max(1, round(h * new / old)))
                for h in value)
    return out


def _stage_widths(config, kw: dict) -> dict:
    """Widths given per stage from the first stage's width on (SAM 2's Hiera: hidden_size 96, embed_dim_per_stage
    [96, 192, 384, 768]) scaled with that width, so the first stage stays as wide as the layer before it: left as
    they were beside a hidden_size of 32, the first block's LayerNorm (96) raised on the 32-wide patches. Lists of one
    width repeated (RT-DETR's decoder_in_channels, its encoder's, not shrunk) are not per-stage widths."""
    out = {}
    for width in WIDTHS:
        old, new = getattr(config, width, None), kw.get(width)
        if not (isinstance(old, int) and isinstance(new, int) and new < old):
            continue
        for name, value in vars(config).items():
            if isinstance(value, (list, tuple)) and value and all(
                    isinstance(v, int) and not isinstance(v, bool) and v % old == 0 for v in value) and \
                    len(set(value)) > 1 and value[0] == old:
                out[name] = type(value)(v * new // old for v in value)
    return out


def tiny_config(model_type: str, *, decoder: bool = False):
    """The type's default config shrunk; `decoder`: with is_decoder=True, as its causal-LM class asks of an
    encoder's config (BERT's BertLMHeadModel is bidirectional without it)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    decoder = decoder and hasattr(base, "is_decoder")  # transformers 5 keeps the flag on the configs that read it
    kw = {**_shrunk(base), **({"is_decoder": True} if decoder else {})}
    config = type(base)(**kw)
    deeper = _deeper(base, config, kw)
    return type(base)(**{**kw, **deeper}) if deeper else config


def _deeper(base, config, kw: dict) -> dict:
    """The depth at which a tiny config keeps a layer of each kind its default has, where the kinds follow from the
    depth (a `layer_types` derived, not a list `kept_layers` cuts): Jamba's attention is layer 4 of every 8 and
    RecurrentGemma's layer 2 of every 3, so its first two layers were all recurrent and nothing was attention (its
    cache then raised on a cache of linear layers only). {} where the tiny config already has every kind."""
    if "layer_types" in vars(base):  # a list of its own, cut by kept_layers
        return {}
    try:
        full, tiny = list(base.layer_types or ()), list(config.layer_types or ())
    except Exception:  # no layer kinds declared
        return {}
    missing = set(full) - set(tiny)
    if not missing:
        return {}
    depth = max(full.index(kind) for kind in missing) + 1
    return {k: depth for k in LAYER_COUNT if k in kw}


def build(model_type: str, impl: str | None = None, *, device: str = "cpu", dtype: str | None = None):
    import torch

    from transformers.models.auto import modeling_auto

    cls = model_class(model_type)
    causal_lm = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    config = tiny_config(model_type, decoder=cls.__name__ in ((causal_lm,) if isinstance(causal_lm, str) else
                                                               causal_lm or ()))
    wants, text = getattr(cls, "config_class", None), config.get_text_config()
    if isinstance(wants, type) and not isinstance(config, wants) and isinstance(text, wants):
        # a composite config for its text model's class, as AutoModelForCausalLM.from_config hands it over (Qwen3.5's
        # and Qwen4-Exp's causal LM classes take the text config: given the whole, they raised on its vocab_size)
        config = text
    torch.manual_seed(0)
    kw = {"attn_implementation": impl} if impl else {}
    try:
        model = cls._from_config(config, **kw)
    except KeyError:
        if not impl or not getattr(config, "sub_configs", None):
            raise
        # a part that keys classes of its own by the name (Unlimited-OCR's SAM: {"eager": ..., "sdpa": ...}) refuses
        # an attention function registered under another: the parts that take it get it, the others sdpa
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation=by_part(cls, config, impl))
    return placed(model.eval(), device=device, dtype=dtype)


def by_part(cls, config, impl: str) -> dict:
    """transformers' attn_implementation by part ("" the model's own config, else a sub-config's key): `impl` for
    each part whose model builds with it alone, "sdpa" for the others."""
    parts = ["", *config.sub_configs]
    takes = []
    for part in parts:
        try:
            cls._from_config(config, attn_implementation={p: impl if p == part else "sdpa" for p in parts})
        except KeyError:
            continue
        takes.append(part)
    return {p: impl if p in takes else "sdpa" for p in parts}


def placed(model, *, device: str = "cpu", dtype: str | None = None):
    """The model moved to `device` and, where `dtype` names one ("bfloat16", "float16", ...), cast to it: the sweep
    on a GPU or at a training dtype (`--device`, `--dtype`). Built on the CPU in float32 first, with the same seed,
    so that the same weights are audited wherever they run."""
    import torch

    if device == "cpu" and dtype is None:
        return model
    return model.to(device=torch.device(device), dtype=getattr(torch, dtype) if dtype else None)


def located(report) -> set:
    return {(f.layer, f.detector) for f in report.findings}


def audit_row(row: Row, model, *, bugs: bool, device: str = "cpu", dtype: str | None = None):
    """The model's zero-config audit into the row (and transformers' bugs injected where `bugs`); the report, or None
    where the audit answered a usage error."""
    import diagnostics
    from diagnostics import AuditUsageError

    try:
        report = diagnostics.audit_model(model)
    except AuditUsageError as exc:
        row.judged("usage error", str(exc))
        return None
    row.judged(report.status, report.status_reason)
    row.causal = f"{report.causal} ({report.causal_source})"[:200]
    row.findings = sorted(f"{d}@{layer}" if layer else d for layer, d in located(report))
    for path, layer_report in (report.layers or {}).items():
        own = layer_report.result("own_weights") if hasattr(layer_report, "result") else None
        if own is not None:
            row.own_weights[path] = own.verdict + ("" if own.verdict == "pass" else ": " + own.message[:160])
    if not bugs or report.status != "passed" or not report.layers:
        return report
    if not getattr(type(model), "_supports_attention_backend", False):
        return report
    inject_transformers(row, report, device=device, dtype=dtype)
    return report


def injected_at(report) -> str:
    """The layer a sweep breaks: the second the audit measured, else the first."""
    paths = list(report.layers)
    return paths[1] if len(paths) > 1 else paths[0]


def inject_transformers(row: Row, report, *, device: str = "cpu", dtype: str | None = None) -> None:
    import diagnostics
    from test_model_audit import bug_attention, register_attention

    register_attention("sweep_bugs", bug_attention)
    padding = report.result("padding_invariance")
    masked = report.causal or (padding is not None and padding.verdict != "skip")  # else a mask bug changes nothing
    path = row.injected = injected_at(report)
    for bug in ("reference", *BUGS, GROUPED):
        if bug in MASK_BUGS and not masked:
            row.bugs[bug] = "not applicable: no mask (not causal, no padding mask)"
            continue
        if bug == GROUPED and not groups > 1:
            row.bugs[bug] = "not applicable: a key/value head per query head, no groups to reorder"
            continue
        try:
            broken = build(row.model_type, "sweep_bugs", device=device, dtype=dtype)
        except Exception as exc:  # a model whose every part maps attn_implementation to classes of its own
            row.bugs[bug] = (f"not judged: the model does not build with an attention function registered under a "
                             f"name of its own ({type(exc).__name__}: {str(exc)[:80]})")
            return
        target = dict(broken.named_modules()).get(path)
        if target is None:
            row.bugs[bug] = "no such layer"
            continue
        runs = getattr(getattr(target, "config", None), "_attn_implementation", "sweep_bugs")
        if runs != "sweep_bugs":  # the layer's part builds only its own classes (`by_part`)
            row.bugs[bug] = (f"not judged: {path}'s part of the model builds with attention classes of its own "
                             f"({runs!r}), not with a function registered under another name")
            return
        if bug == "missing_scale" and getattr(target, "scaling", None) == 1.0:  # Granite's attention_multiplier
            row.bugs[bug] = "not applicable: the layer's own scale is 1 (its configuration's), nothing to drop"
            continue
        if bug == "missing_scale" and given == 1.0:  # Kosmos-2.5's text layers scale q and pass scaling=1.0
            row.bugs[bug] = "not applicable: the layer scales q itself and hands its attention function a scale of 1"
            continue
        target._test_bug = bug
        try:
            rep = diagnostics.audit_model(broken, seq_len=8)
        except Exception as exc:
            row.bugs[bug] = f"raised {type(exc).__name__}"
            continue
        if bug == "reference":  # the explicit attention with nothing broken must pass, or no bug is judged
            if rep.status != "passed":
                row.bugs[bug] = f"reference {rep.status}: {rep.status_reason[:120]}"
                return
            reference = rep
            given = getattr(target, "_test_scaling", None)  # the scale the layer handed its attention function
            groups = getattr(target, "_test_groups", 1)  # its query heads per key/value head
            continue
        row.bugs[bug] = where_caught(rep, report, reference, path)
        if row.bugs[bug].startswith("missed") and bug not in MASK_BUGS and \
                moves_nothing(row.model_type, bug, path, device=device, dtype=dtype):
            row.bugs[bug] = ("not applicable: the bug changes no output at these weights (the model's output on the "
                             "audit's own examples equals the reference's, bit for bit)")


def moves_nothing(model_type: str, bug: str, path: str, *, device: str = "cpu", dtype: str | None = None) -> bool:
    """Whether the model with `bug` in the layer `path` gives the reference's output on the audit's own examples at
    8 and 16 tokens, bit for bit (both built with the same seed): the bug changes nothing at these weights, so an audit that passes it
    misses nothing (no scale to drop where q·k is 0: Zaya's keys times a learned temperature its init sets to 0).
    Only for bugs of no mask, which the example, unpadded, may not exercise."""
    import torch
    from diagnostics.model._runner import Runner

    for length in (8, 16):  # the length the bug's audit runs at, and the audit's default
        outputs = []
        for kind in ("reference", bug):
            model = build(model_type, "sweep_bugs", device=device, dtype=dtype)
            dict(model.named_modules())[path]._test_bug = kind
            runner = Runner(model, None, seq_len=length, seed=0)
            outputs.append(runner(runner.inputs)[0])
        if outputs[0].shape != outputs[1].shape or not torch.equal(*outputs):
            return False
    return True


def where_caught(rep, report, reference, path: str) -> str:
    """The row's word for a model audit `rep` with a bug injected at the layer `path`, against the correct model's
    audit `report` and the reference's (the injected attention with nothing broken): "caught" where it failed and every
    new failing finding with a layer names `path`, "elsewhere: ..." where one names another, "missed (status)"."""
    # where the bug shows: findings neither the correct model's audit nor the reference's had (a warning it had
    # already, a leak through a mixer beside the attention, is no finding of the bug's); the reference is the
    # same attention function at the same length: CLIP's text layers, causal by their own mask, warn so at every
    # layer through it, not through SDPA's is_causal
    before = {(f.layer, f.detector, f.verdict) for f in (*report.findings, *reference.findings)}
    new = [f for f in rep.findings if (f.layer, f.detector, f.verdict) not in before]
    at = {f.layer for f in new if f.verdict == "fail"}  # where the failure points: the bug's verdict
    warned = sorted({f.layer for f in new if f.verdict != "fail" and f.layer not in (path, None)})
    if rep.status != "failed":
        return f"missed ({rep.status})"
    if path in at and at <= {path, None}:
        # a warning elsewhere is no verdict, but said: CLIP's text layer 0, causal by its own mask, warns so where
        # the bug at layer 1 leaves the model non-causal and layer 0 is no longer audited as causal
        return "caught" + (f"; a warning also at {', '.join(warned)[:100]}" if warned else "")
    return "elsewhere: " + ", ".join(sorted(str(a) for a in at))[:120]


def run_transformers(model_type: str, *, bugs: bool, device: str = "cpu", dtype: str | None = None) -> Row:
    row = Row(model_type)
    try:
        row.cls = model_class(model_type).__name__
        model = build(model_type, device=device, dtype=dtype)
    except Exception as exc:
        row.verdict, row.why = "not built", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return row
    row.built = True
    try:
        audit_row(row, model, bugs=bugs, device=device, dtype=dtype)
    except Exception as exc:
        row.verdict = "crashed"
        row.why = f"{type(exc).__name__}: {str(exc)[:200]} | " + traceback.format_exc().splitlines()[-3][:200]
    without_attention(row, model)
    return row


NONE_FOUND = "inconclusive: no attention module was found"


def without_attention(row: Row, model) -> None:
    """A model the audit found no attention in (no attention class, no softmax over (Tq, Tk) scores or fused call
    observed) and that holds no module of an attention class (`class_kind`: torch's, timm's, transformers'
    *Attention) is a row "no attention", not counted, as timm's rule by class counts it: ResNet, ConvNeXt, FNet's
    Fourier mixing, FocalNet's modulation, a codec's convolutions (28 transformers types at 5a3f78e, counted as
    inconclusive). A model that holds such a class stays inconclusive: the audit missed its attention."""
    from diagnostics.model._find import class_kind

    if row.verdict == "inconclusive" and row.why.startswith(NONE_FOUND) and \
            not any(class_kind(m) for m in model.modules()):
        row.verdict, row.why = "no attention", "no attention class among its modules and none observed"


# ---- timm -----------------------------------------------------------------------------------------------------

# a timm model built small: the first of these whose keywords the model takes (a keyword it does not take is
# dropped, `timm_build`) and that builds; the last, nothing overridden, is the model's default size
TIMM_TINY = ({"img_size": 64, "embed_dim": 32, "depth": 2, "num_heads": 4, "num_classes": 10},
             # four stages each of its own width, depth and heads (DaViT's embed_dims, depths, num_heads; Swin-CR's
             # one embed_dim doubled at each stage): without these, davit_giant and swinv2_cr_giant were built at
             # their full size (the first entry's depth and int num_heads do not fit them) and took the machine's
             # memory or the time limit
             {"img_size": 64, "embed_dims": (32, 64, 128, 256), "depths": (1, 1, 1, 1), "num_heads": (1, 2, 4, 8),
              "num_classes": 10},
             {"img_size": 64, "embed_dim": 32, "depths": (1, 1, 1, 1), "num_heads": (1, 2, 4, 8), "num_classes": 10},
             {"img_size": 64, "num_classes": 10}, {"num_classes": 10}, {})
# a per-stage entry of TIMM_TINY is taken only with its widths: one whose widths a model does not take would build it
# one block deep at its full width (Swin-CR's giant given DaViT's embed_dims: 4,096 wide, 312 million parameters)
TIMM_STAGE_WIDTHS = ("embed_dim", "embed_dims")


def timm_attention_modules() -> list[str]:
    """timm's model modules that define or import an attention class (an nn.Module named *Attention, what the
    audit recognises as timm attention): the rule for "has attention", read from the source, nothing built."""
    import importlib

    import timm
    import torch

    names = []
    for module in timm.list_modules():
        ns = vars(importlib.import_module(f"timm.models.{module}"))
        if any(n.endswith("Attention") and isinstance(c, type) and issubclass(c, torch.nn.Module)
               for n, c in ns.items()):
            names.append(module)
    return names


def timm_types() -> list[str]:
    """Every architecture of timm's `list_models()` whose module has an attention class; a model in which the audit
    finds no attention and whose built modules hold no attention class is a row "no attention", not counted."""
    import timm

    return sorted(m for module in timm_attention_modules() for m in timm.list_models(module=module))


def timm_image_size(model):
    from diagnostics.model._runner import timm_image_size as declared

    return declared(model)


def timm_build(name: str):
    """The model at the first of `TIMM_TINY` it builds with and runs a plain forward at the image size it declares
    (`timm_image_size`, what the audit's example is built from), keywords it does not take dropped one by one: a
    model that takes img_size=64 yet cannot run at it (CrossViT's second branch) is built at the next. A model of
    a fixed input size (`fixed_input_size` in its pretrained_cfg: LeViT, Hiera, MViTv2, VOLO, ...) given another
    img_size is given the same size as its configuration's `input_size` (`pretrained_cfg_overlay`, timm's own
    way to change a configuration; its builder sizes such a model by it), so that the configuration says the size
    the model was built at: without it, the configuration kept 224 and the model was built at 64. A model that
    takes no img_size and whose configuration states a `min_input_size` below its `input_size` is run at that
    minimum, by the same overlay (SAM 2's Hiera: 224 px, not 896)."""
    import re

    import timm
    import torch

    cfg = timm.get_pretrained_cfg(name)
    fixed = cfg is not None and cfg.fixed_input_size and len(cfg.input_size or ()) == 3
    # a model that takes no img_size is run at the size its configuration states, and SAM 2's Hiera states 896 or
    # 1,024 px, where its global blocks (3,136 tokens at 1,024) are past the audit's memory guard: where the
    # configuration also states a smaller size the model takes (`min_input_size`), that one
    smallest = cfg is not None and not fixed and len(cfg.min_input_size or ()) == 3 and len(cfg.input_size or ()) == 3 \
        and cfg.min_input_size[1:] < cfg.input_size[1:]
    errors = []
    for overrides in TIMM_TINY:
        kw = dict(overrides)
        while True:
            torch.manual_seed(0)
            size = kw.get("img_size")
            overlay = {"pretrained_cfg_overlay": {"input_size": (cfg.input_size[0], size, size)}} \
                if fixed and isinstance(size, int) else {}
            if smallest and "img_size" not in kw:
                overlay = {"pretrained_cfg_overlay": {"input_size": tuple(cfg.min_input_size)}}
            try:
                model = timm.create_model(name, pretrained=False, **kw, **overlay).eval()
                size, channels, _ = timm_image_size(model)
                if size is not None:
                    h, w = (size, size) if isinstance(size, int) else tuple(size)
                    with torch.no_grad():
                        model(torch.randn(1, channels, h, w))
                torch.manual_seed(0)  # the model as built, whatever the forward drew
                return timm.create_model(name, pretrained=False, **kw, **overlay).eval()
            except TypeError as exc:
                unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
                staged = "depths" in overrides and unexpected and unexpected.group(1) in TIMM_STAGE_WIDTHS
                if unexpected and unexpected.group(1) in kw and not staged:
                    del kw[unexpected.group(1)]
                    continue
                errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
            except Exception as exc:
                # 64 px is no multiple of a 14 px patch (InternViT-300M's "Input height (64) should be divisible by
                # patch size (14)"): the largest size under it that is, else the model fell to its full 448 px size
                patch = re.search(r"divisible by patch size \((\d+)\)", str(exc))
                if patch and isinstance(kw.get("img_size"), int) and kw["img_size"] % int(patch.group(1)):
                    kw["img_size"] = max(1, kw["img_size"] // int(patch.group(1))) * int(patch.group(1))
                    continue
                errors.append(f"{type(exc).__name__}: {str(exc)[:100]}")
            break
    raise RuntimeError("; ".join(errors[-1:]))


def run_timm(name: str, *, bugs: bool, device: str = "cpu", dtype: str | None = None) -> Row:
    row = Row(name)
    try:
        model = placed(timm_build(name), device=device, dtype=dtype)
    except Exception as exc:
        row.verdict, row.why = "not built", str(exc).splitlines()[0][:200] if str(exc) else ""
        return row
    row.cls = type(model).__name__
    # audited whatever its classes are named: attention inside a block (ViT-XP's ParallelScalingBlock) or in a class
    # not named *Attention (AttentionRope, the rope-mixed ViTs') is observed running; "no attention" is a model in
    # which the audit found none and that holds no attention class (`without_attention`, transformers' rule too)
    row.built = True
    try:
        report = audit_row(row, model, bugs=False)
        if bugs and report is not None and report.status == "passed" and report.layers:
            inject_timm(row, report, lambda: placed(timm_build(name), device=device, dtype=dtype))
    except Exception as exc:
        row.verdict = "crashed"
        row.why = f"{type(exc).__name__}: {str(exc)[:200]} | " + traceback.format_exc().splitlines()[-3][:200]
    without_attention(row, model)
    return row


class _Within:
    """torch's SDPA replaced, while in use, by the sweep's attention with `kind` broken (sweep_diffusers._Routed) for
    the calls made inside the forward of the module `target`, and torch's own for every other call: one layer of a
    model broken, whatever its class. The hooks that mark the target's forward are functions over one shared count, so
    that a copy of the layer the audit makes (its float64 copy) is broken too."""

    def __init__(self, target, kind: str):
        from sweep_diffusers import _Routed, swap_sdpa

        self.routed, self.target, self.inside, self.swap = _Routed(kind), target, [0], swap_sdpa

    def __call__(self, *args, **kwargs):
        return (self.routed if self.inside[0] else self.saved)(*args, **kwargs)

    def __enter__(self):
        inside = self.inside

        def enter(module, args):
            inside[0] += 1

        def leave(module, args, output):
            inside[0] -= 1

        self.hooks = [self.target.register_forward_pre_hook(enter),
                      self.target.register_forward_hook(leave, always_call=True)]
        self.saved = self.swap(self)
        return self

    def __exit__(self, *exc):
        self.swap(self.saved)
        for hook in self.hooks:
            hook.remove()


def inject_timm(row: Row, report, build) -> None:
    """`BUGS` in one layer of a timm model whose correct audit passed (`injected_at`), through torch's SDPA called
    inside that layer's forward (`_Within`; a timm attention class with `fused_attn` is set to call it): each audit of a
    fresh build (`build()`), judged as transformers' are (`where_caught`). A layer that calls no SDPA is not broken; a
    mask bug where no call inside it was given a mask that blocks a key or is_causal (BEiT's relative position bias,
    handed to SDPA as a float attn_mask, blocks nothing: dropping it drops positions, not a mask), and a missing scale
    where every call was handed a scale of 1, are not applicable."""
    import diagnostics

    path = injected_at(report)
    from sweep_diffusers import NO_MASK

    reference, masked, scales = None, True, [None]  # read from the reference's calls before any bug
    for bug in ("reference", *BUGS):
        if bug in MASK_BUGS and not masked:
            row.bugs[bug] = NO_MASK
            continue
        if bug == "missing_scale" and all(scale == 1.0 for scale in scales):
            row.bugs[bug] = "not applicable: the layer scales q itself and hands SDPA a scale of 1, nothing to drop"
            continue
        model = build()
        target = dict(model.named_modules()).get(path)
        if target is None:
            row.bugs[bug] = "no such layer"
            continue
        if hasattr(target, "fused_attn"):
            target.fused_attn = True  # timm's switch between SDPA and its own softmax
        with _Within(target, bug) as within:
            try:
                rep = diagnostics.audit_model(model)
            except Exception as exc:
                row.bugs[bug] = f"raised {type(exc).__name__}"
                continue
        if bug == "reference":
            if not within.routed.calls:
                row.why += f"; no bug injected: {path} calls no scaled_dot_product_attention"
                return
            if rep.status != "passed":
                row.bugs[bug] = f"reference {rep.status}: {rep.status_reason[:120]}"
                return
            reference, masked, scales = rep, within.routed.masked, within.routed.scales
            continue
        row.bugs[bug] = where_caught(rep, report, reference, path)


# ---- diffusers: every attention class and processor, the layer audit (benchmarks/sweep_diffusers.py) ------------


def diffusers_types() -> list[str]:
    from sweep_diffusers import diffusers_types as types

    return types()


def run_diffusers(name: str, *, bugs: bool) -> Row:
    from sweep_diffusers import run

    return run(Row(name), bugs=bugs, injected=BUGS, mask_bugs=MASK_BUGS)


LIBRARIES = {"transformers": (transformers_types, run_transformers), "timm": (timm_types, run_timm),
             "diffusers": (diffusers_types, run_diffusers)}
PLACED = ("transformers", "timm")  # the sweeps of whole models, which --device and --dtype move


# ---- packages of attention layers: every *Attention class they define (benchmarks/sweep_packages.py) ----------


def _package(package: str):
    """(enumerate, run one) for a package of sweep_packages.PACKAGES."""
    def types() -> list[str]:
        from sweep_packages import package_types

        return package_types(package)

    def run_one(name: str, *, bugs: bool) -> Row:
        from sweep_packages import run_package

        return run_package(package, Row(name), bugs=bugs, injected=BUGS, mask_bugs=MASK_BUGS)

    return types, run_one


LIBRARIES.update({package: _package(package) for package in __import__("sweep_packages").PACKAGES})


# What every child of a library's sweep imports, imported once by the parent before the children fork (`warm`): each
# child then starts with it loaded, shared copy-on-write, where it used to import it again. Measured for transformers
# (2026-12-04): its generation, masking and cache machinery, torch._dynamo and sympy under them, and the audit's own
# modules took 2.4 s of CPU in every child, where a small model's whole audit takes 0.3 to 0.7 s.
WARM = {"transformers": ("transformers.modeling_utils", "transformers.modeling_layers", "transformers.generation.utils",
                         "transformers.masking_utils", "transformers.cache_utils", "transformers.processing_utils"),
        "timm": ("timm", "timm.layers"), "diffusers": ("diffusers", "diffusers.models.attention_processor")}
AUDIT_MODULES = ("diagnostics", "diagnostics.model")


def warm(library: str, *, bugs: bool) -> None:
    """Imports, in the parent, the modules every child of `library`'s sweep imports (`WARM`; a package of
    sweep_packages by its own name), the audit's, and the explicit attention the injected bugs run through."""
    for name in (*WARM.get(library, (library,)), *AUDIT_MODULES, *(("test_model_audit",) if bugs else ())):
        importlib.import_module(name)


def library_version(library: str) -> str:
    """The installed version of `library` (a package of sweep_packages, or any other, by its distribution's metadata)."""
    from importlib.metadata import PackageNotFoundError

    from sweep_packages import package_version

    if library not in ("transformers", "timm", "diffusers"):
        try:
            return package_version(library)
        except PackageNotFoundError:  # a module of the standard library (the tests' stand-in): its own word
            pass
    return __import__(library).__version__


# ---- the sweep: a forked child per model, a results file to resume from ---------------------------------------


class Child:
    """fn(model_type) in a forked child with one torch thread, its Row back through a file; `poll` gives the Row
    once the child has finished, died or run past `timeout` (then it is killed), else None."""

    def __init__(self, fn, model_type: str, timeout: float, **kw):
        self.model_type, self.timeout = model_type, timeout
        self.started = time.perf_counter()
        fd, self.out = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        self.pid = os.fork()
        if self.pid == 0:  # the child: one model, then out without running the parent's exit handlers
            code = 0
            try:
                import torch

                torch.set_num_threads(1)  # children run side by side (--jobs): one core each, no oversubscription
                row = fn(model_type, **kw)
                Path(self.out).write_text(json.dumps(asdict(row)))
            except BaseException:
                code = 1
            os._exit(code)

    def poll(self) -> Row | None:
        done, status, usage = os.wait4(self.pid, os.WNOHANG)
        if not done:
            if time.perf_counter() - self.started < self.timeout:
                return None
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            Path(self.out).unlink(missing_ok=True)
            return Row(self.model_type, verdict="timeout", why=f"over {self.timeout:.0f} s", seconds=self.timeout)
        text = Path(self.out).read_text() if Path(self.out).exists() else ""
        Path(self.out).unlink(missing_ok=True)
        seconds = time.perf_counter() - self.started
        if not text:
            why = (f"the child died (signal {os.WTERMSIG(status)})" if os.WIFSIGNALED(status)
                   else "the child wrote no row")
            return Row(self.model_type, verdict="crashed", why=why, seconds=seconds)
        row = Row(**json.loads(text))
        row.seconds, row.cpu_seconds = seconds, usage.ru_utime + usage.ru_stime
        return row


def in_child(fn, model_type: str, timeout: float, **kw) -> Row:
    """fn(model_type) in a forked child (`Child`), waited for."""
    return next(run_children(fn, [model_type], timeout, jobs=1, **kw))


def run_children(fn, types: list, timeout: float, *, jobs: int, **kw):
    """Yields each type's Row as it finishes (not in order), at most `jobs` children running at once. The caller,
    in the parent, is the only one to write them down."""
    todo, running = list(types), []
    try:
        while todo or running:
            while todo and len(running) < jobs:
                running.append(Child(fn, todo.pop(0), timeout, **kw))
            for child in list(running):
                row = child.poll()
                if row is not None:
                    running.remove(child)
                    yield row
            time.sleep(0.05)
    finally:  # the parent stopped early (Ctrl-C, an error): no child left running
        for child in running:
            child.timeout = 0
            child.poll()


def rates(rows: list[Row]) -> list[str]:
    plain = [r for r in rows if r.verdict != "no attention"]  # built, but nothing for the audit: not counted
    n = len(plain)
    # a child killed (out of time, or by the kernel for its memory: GLM-5-Next's, 14.5 GB) was building or auditing:
    # counted with the built, as crashed or timeout, never as "not built"
    built = [r for r in plain if r.built or r.verdict in ("timeout", "crashed")]
    count = lambda v: sum(r.verdict == v for r in built)  # noqa: E731
    known = [r for r in built if r.verdict == "failed" and r.model_type in KNOWN]
    # a model the library's own problem keeps from running (a default config that raises): inconclusive, expected
    kept = [r for r in built if r.verdict == "inconclusive" and r.model_type in KNOWN]
    lines = [f"{len(built)} / {n} built ({100 * len(built) / max(n, 1):.0f}%)"
             + (f"; {len(rows) - n} more built with no attention module, not counted" if len(rows) > n else "")]
    if built:
        lines.append("of the built: " + ", ".join(
            f"{v} {count(v)} ({100 * count(v) / len(built):.0f}%)"
            for v in ("passed", "failed", "inconclusive", "usage error", "crashed", "timeout") if count(v))
            + (f"; {len(known)} of the failures expected (KNOWN)" if known else "")
            + (f"; {len(kept)} of the inconclusive the library's own problem (KNOWN: kept from running, or "
               f"failing under the declaration their report names)" if kept else ""))
    judged = [r for r in built if r.bugs and "reference" not in r.bugs]
    pairs = [(r, b, v) for r in judged for b, v in r.bugs.items() if not v.startswith("not applicable")
             and b != GROUPED]
    if judged:
        caught = sum(v.startswith("caught") for _, _, v in pairs)
        warned = sum(v.startswith("caught; a warning") for _, _, v in pairs)
        lines.append(f"injected bugs caught at the right layer: {caught} / {len(pairs)} in {len(judged)} models "
                     f"whose correct audit passed" + (f" ({warned} with a warning at another layer too)" if warned
                                                      else ""))
    grouped = [r for r in judged if not r.bugs.get(GROUPED, "not applicable").startswith("not applicable")]
    if grouped:  # where own_weights passed at the layer the bug went into, it can be seen; elsewhere not
        read_there = [r for r in grouped if r.own_weights.get(r.injected) == "pass"]
        caught = lambda rs: sum(r.bugs[GROUPED].startswith("caught") for r in rs)  # noqa: E731
        lines.append(f"grouped key/value heads repeated in the wrong order (no black-box check can see it): caught "
                     f"at the right layer in {caught(read_there)} / {len(read_there)} models where that layer's own "
                     f"weights were read (own_weights passed there), {caught(grouped) - caught(read_there)} / "
                     f"{len(grouped) - len(read_there)} elsewhere")
    read = [r for r in built if any(v == "pass" or v.startswith("fail") for v in r.own_weights.values())]
    if built:
        false = [r.model_type for r in read if any(v.startswith("fail") for v in r.own_weights.values())]
        layers = [v for r in built for v in r.own_weights.values()]
        lines.append(f"own_weights: {len(read)} / {len(built)} models with a layer whose projections were identified "
                     f"({sum(v == 'pass' for v in layers)} layers passed, {sum(v.startswith('fail') for v in layers)} "
                     f"failed, {sum(v.startswith('skip') for v in layers)} not applicable of {len(layers)} audited)"
                     + (f"; failed in: {', '.join(false)}" if false else ""))
    refused = [r for r in built if "reference" in r.bugs]
    if refused:
        lines.append(f"{len(refused)} models' explicit reference attention did not pass (no bug judged): "
                     + ", ".join(r.model_type for r in refused))
    seconds = [r.seconds for r in rows]
    if seconds:
        lines.append(f"time: {sum(seconds):.0f} s for {len(rows)} types, {sum(seconds) / len(rows):.1f} s a type "
                     f"(median {sorted(seconds)[len(rows) // 2]:.1f} s)")
    cpu = [r.cpu_seconds for r in rows if r.cpu_seconds]  # rows of an older sweep have none
    if cpu:
        lines.append(f"CPU: {sum(cpu):.0f} s in the children of {len(cpu)} types, {sum(cpu) / len(cpu):.1f} s a type "
                     f"(median {sorted(cpu)[len(cpu) // 2]:.1f} s)")
    return lines


def table(rows: list[Row]) -> str:
    out = [f"{'model type':28} {'class':44} {'verdict':13} {'s':>5}  findings | bugs"]
    for r in rows:
        bugs = ""
        if r.bugs:
            bugs = " | " + ", ".join(f"{b}: {v}" for b, v in r.bugs.items())
        detail = ", ".join(r.findings) if r.verdict == "failed" else r.why
        detail = f"[with {r.declared}] {detail}" if r.declared else detail
        mark = (" (KNOWN: " + KNOWN[r.model_type] + ")" if r.model_type in KNOWN and r.verdict in ("failed",
                                                                                                 "inconclusive")
                else "")
        out.append(f"{r.model_type:28} {r.cls[:44]:44} {r.verdict:13} {r.seconds:5.1f}  {detail[:160]}{mark}{bugs}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library", help=f"{', '.join(sorted(LIBRARIES))}, or any installed package's import name "
                                        f"(every *Attention class it defines)")
    parser.add_argument("--only", nargs="+", default=None, help="these model types")
    parser.add_argument("--sample", type=int, default=None, help="N model types drawn with --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="the first N model types")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per model (240)")
    parser.add_argument("--results", type=Path, default=None, help="the JSON-lines file to append to and resume from")
    parser.add_argument("--fresh", action="store_true", help="ignore the results file's rows")
    parser.add_argument("--no-bugs", action="store_true", help="audit the correct models only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="models audited at once, one core each (default: the number of cores)")
    parser.add_argument("--device", default="cpu",
                        help="where the models run, e.g. cuda (transformers and timm; default cpu)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "float64"),
                        help="cast the models to this dtype after building them (transformers and timm)")
    args = parser.parse_args(argv)
    if args.library not in LIBRARIES:
        if importlib.util.find_spec(args.library) is None:
            parser.error(f"library {args.library!r} is neither one of {', '.join(sorted(LIBRARIES))} nor an installed "
                         f"package; install it (pip install ...) and pass its import name, e.g. local_attention")
        LIBRARIES[args.library] = _package(args.library)  # every *Attention class it defines
    import torch

    placement = {}
    if args.device != "cpu" or args.dtype:
        if args.library not in PLACED:
            parser.error(f"--device and --dtype place the models of {', '.join(PLACED)}; {args.library}'s sweep "
                         f"audits layers it builds itself on the CPU in float32. Leave them out for {args.library}.")
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            parser.error(f"--device {args.device!r}: {exc}. Expected a torch device such as cpu or cuda.")
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # asked without initialising CUDA: children fork
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda, but torch.cuda.is_available() is False on this machine: run on a machine "
                         "with a GPU, or leave --device out for the CPU.")
        placement = {"device": args.device, "dtype": args.dtype}

    enumerate_types, run_one = LIBRARIES[args.library]
    types = enumerate_types()
    if args.only:
        unknown = sorted(set(args.only) - set(types))
        if unknown:
            parser.error(f"unknown model types {unknown}; e.g. {types[:5]}")
        types = [t for t in types if t in args.only]
    if args.sample:
        types = sorted(random.Random(args.seed).sample(types, min(args.sample, len(types))))
    if args.limit:
        types = types[:args.limit]
    version = library_version(args.library)
    placed_name = "".join(f"-{v}" for v in placement.values() if v)
    results = args.results or Path(tempfile.gettempdir()) / f"sweep-{args.library}-{version}{placed_name}.jsonl"
    done: dict = {}
    if results.exists() and not args.fresh:
        for line in results.read_text().splitlines():
            row = Row(**json.loads(line))
            done[row.model_type] = row
    elif args.fresh:
        results.unlink(missing_ok=True)
    where = f" on {args.device}" + (f" in {args.dtype}" if args.dtype else "") if placement else ""
    print(f"{args.library} {version}, torch {torch.__version__}{where}: {len(types)} model types; results {results} "
          f"({sum(t in done for t in types)} already there)", flush=True)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    todo = [t for t in types if t not in done]
    started = time.perf_counter()
    warm(args.library, bugs=not args.no_bugs)
    for r in run_children(run_one, todo, args.timeout, jobs=args.jobs, bugs=not args.no_bugs,
                          **placement):
        done[r.model_type] = r
        with results.open("a") as f:  # the parent alone writes: one whole line per finished model
            f.write(json.dumps(asdict(r)) + "\n")
        print(f"  {r.model_type}: {r.verdict} {r.seconds:.1f} s {r.why[:100]}", flush=True)
    rows = [done[t] for t in types]
    print(table(rows))
    print("\n".join(rates(rows)))
    print(f"wall clock: {time.perf_counter() - started:.0f} s for the {len(todo)} types run now, --jobs {args.jobs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
