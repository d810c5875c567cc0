"""Real attention bugs in released code: each audited from the PyPI release that has it and the next that fixed it.

    python benchmarks/pypi_bugs.py [--only ID ...] [--cache DIR] [--verbose] [--offline]

Unlike benchmarks/real_bugs.py (bugs rewritten in our own style), nothing here is written by this project: each
case names a package, the release with the bug and the release with the fix, and how a user would build the
attention small and declare it. The benchmark

- downloads both releases with `pip download --no-deps PKG==VER` (and the wheels the package imports, `deps`: pure
  Python, except numpy's for xformers and timm) into a cache folder (`--cache`, default
  ~/.cache/attention-mistakes/pypi), and unpacks them there;
- finds the lines the fix changed mechanically: difflib over the two releases' copies of the file the fix touched
  (`file`), mapped to the buggy release's lines (a deleted line counts as the lines on either side of it);
- audits each release in its own subprocess (the unpacked folder first on sys.path, so two releases never meet in
  one process) with `diagnostics.audit(layer, **declarations)`, the same declarations for both, as a user would;
- reports per case: *caught* (the buggy release's audit status is "failed"), *fixed passed* (the fixed release's is
  "passed"), *localised* (a failing finding's site lies in the changed file within 2 lines of a changed line; "by a
  caller": a frame that called the site's op does, e.g. a line that called einops), and the time; then the totals
  per kind of bug and overall, the command, the date and the versions.

Each case's `fix_line` is the fix's file:line in the fixed release as read from its commit (`url`);
`check_case` confirms it is among the lines the two releases' files differ by (the table's own audit of itself).
`--offline` uses the cache only (a case whose releases are not cached is reported as such, not run).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import subprocess
import sys
import tarfile
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEAR = 2  # a site within this many lines of a changed line localises the bug
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attention-mistakes" / "pypi"
EINOPS = "einops==0.8.2"  # the einops every lucidrains release below imports (its API they use is unchanged)


@dataclass(frozen=True)
class Case:
    """One real bug: `package` at `buggy` has it, at `fixed` does not. `build` is Python source run in the audit's
    subprocess after the release is on sys.path: it defines `layer` and `declarations` (what a user would pass to
    `diagnostics.audit`), the same for both releases. `file`: the package file the fix changed (relative to the
    unpacked release); `fix_line`: the fix's line in the fixed release's copy; `url`: the fixing commit.
    `true_finding`: where the fixed release fails for another real defect, what it is and how it was confirmed
    without the audit (the row says so; the totals count it apart)."""

    id: str
    kind: str
    package: str
    buggy: str
    fixed: str
    file: str
    fix_line: int
    url: str
    what: str
    build: str
    deps: tuple[str, ...] = (EINOPS,)
    true_finding: str = ""  # a finding on the fixed release that is true, confirmed outside the audit (how)
    confirm: str = ""  # a plain script that asserts that true finding on the fixed release (no diagnostics)


ENTMAX = "entmax==1.3"  # early x-transformers import entmax15 at the top of the module

_ALIBI_BLOCK = """
from torch import nn
from x_transformers.x_transformers import Attention, AlibiPositionalBias

class Block(nn.Module):
    # x-transformers' causal attention with the ALiBi bias its AttentionLayers passes it (alibi_pos_bias=True)
    def __init__(self):
        super().__init__()
        self.attn = Attention(32, dim_head=8, heads=4, causal=True)
        self.alibi = AlibiPositionalBias(heads=4)

    def forward(self, x):
        return self.attn(x, rel_pos=self.alibi)[0]  # (out, intermediates)

layer = Block()
declarations = dict(causal=True)
"""

ROTARY_BLOCK = """
import torch
import torch.nn.functional as F
from torch import nn
from rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb

class Block(nn.Module):
    # a user's causal self-attention, q and k turned by rotary-embedding-torch; a (B, T) mask, True = keep
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.rot = {make}

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # (b, heads, t, 8) each
        {rotate}
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(out.transpose(1, 2).reshape(b, t, -1))

layer = Block()
declarations = dict(causal=True, mask="key_keep")
"""


ROTARY_CACHE_BLOCK = """
import torch
import torch.nn.functional as F
from torch import nn
from rotary_embedding_torch import RotaryEmbedding

class Block(nn.Module):
    # a user's causal self-attention with a KV cache, q and k turned at their positions by rotary-embedding-torch
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.rot = RotaryEmbedding(8)

    def forward(self, x, mask=None, cache=None):  # mask: (B, 1, Tq, Tk) bool, True = may attend; cache: (k, v)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        past = 0 if cache is None else cache[0].shape[-2]
        q = self.rot.rotate_queries_or_keys(q, offset=past)
        k = self.rot.rotate_queries_or_keys(k, offset=past)
        if cache is not None:
            k, v = torch.cat((cache[0], k), -2), torch.cat((cache[1], v), -2)
        if mask is None:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(b, t, -1)), (k, v)

layer = Block()
declarations = dict(causal=True)
"""
"""A user's causal block with a KV cache, q and k turned at their offset by rotary-embedding-torch (its
`rotate_queries_or_keys(t, offset=...)`): the `rotary_cache_key_offset` case, and benchmarks/pypi_releases.py's
`rotary_cache` population on every release that takes an offset."""


def padded_keys_move_outputs(dtype: str = "float32", gain: float = 1000.0, least: float = 1e-3) -> str:
    """A plain check of a padding mask, no diagnostics (exec'd with BUILD, the case's build): changing only the
    padded tokens (to `gain` x a fresh draw) moves the unpadded outputs of the layer in `dtype` by more than `least`
    of their RMS. A layer that honours the mask moves them by exactly 0."""
    return f"""
import torch
scope = {{}}
exec(BUILD, scope)
layer = scope["layer"].eval().to(torch.{dtype})
x = torch.randn(1, 8, 32)
mask = torch.ones(1, 8, dtype=torch.bool)
mask[:, 6:] = False  # the last two tokens are padding
y = x.clone()
y[:, 6:] = {gain} * torch.randn(1, 2, 32)  # only the padded tokens change
with torch.no_grad():
    a, b = (layer(t.to(torch.{dtype}), mask=mask)[:, :6].float() for t in (x, y))
moved = (a - b).abs().max().item() / a.pow(2).mean().sqrt().item()
assert moved > {least}, f"the unpadded outputs moved by {{moved:.2e}} of their RMS: the mask is honoured"
"""

_IDENTICAL_TOKENS_DIFFER = """
import torch
scope = {}
exec(BUILD, scope)
layer = scope["layer"].eval()
x = torch.randn(1, 1, 32).expand(1, 16, 32).contiguous()  # one token 16 times: every value row is the same
with torch.no_grad():
    out = layer(x)
spread = (out - out[:, :1]).abs().max().item() / out.pow(2).mean().sqrt().item()
assert spread > 1e-3, f"identical tokens gave outputs equal to {spread:.2e} of their RMS: a weighted mean"
"""  # a weighted mean of identical values is that value at every position, whatever the weights

_IMAGE_LAYER = """
from timm.layers.attention2d import {cls}
layer = {cls}({args})
{then}# forward(x, ...) on an image (B, C, H, W): a sequence of T tokens is the (B, C, T, 1) image
declarations = dict(call=lambda layer, x: layer(x.transpose(1, 2)[..., None])[..., 0].transpose(1, 2))
"""

_NORM_NEVER_APPLIED = """
import torch
scope = {"load": load}
exec(BUILD, scope)
layer = scope["layer"].eval()
x = torch.randn(2, 32, 4, 4)  # an image (B, C, H, W)
with torch.no_grad():
    before = layer(x)
    layer.norm.weight.mul_(3.0), layer.norm.bias.add_(1.0)
    after = layer(x)
assert torch.equal(before, after), "the GroupNorm's parameters move the output: it is applied"
"""

_NON_CONTIGUOUS_QUERY_RAISES = """
import torch
scope = {"load": load}
exec(BUILD, scope)
query = torch.randn(16, 2, 32).transpose(0, 1)  # (B, T, D) read from a (T, B, D) tensor: not contiguous
try:
    scope["layer"](query, torch.randn(2, 16, 32))
except RuntimeError as error:
    assert "view" in str(error), error
else:
    raise AssertionError("a non-contiguous query ran")
"""

_FEWER_KEYS_THAN_K_RAISES = """
import torch
scope = {}
exec(BUILD, scope)
try:
    scope["layer"](torch.randn(1, 2, 32))  # 2 tokens, k = 4
except RuntimeError as error:
    assert "out of range" in str(error), error
else:
    raise AssertionError("a 2-token call ran: top-k with fewer keys than k is handled")
"""

_NYSTROM_PADS_AND_AUTOGRAD = """
import torch
scope = {}
exec(BUILD, scope)
layer = scope["layer"].eval()
x = torch.randn(1, 10, 32)  # 10 tokens, no multiple of its 4 landmarks: it pads 2 zero tokens in front
with torch.no_grad():
    alone, kept = layer(x), layer(x, mask=torch.ones(1, 10, dtype=torch.bool))  # the pads masked in the second
moved = ((alone - kept).abs().max() / kept.pow(2).mean().sqrt()).item()
assert moved > 1e-3, f"without a mask its own padding moved the outputs by {moved:.2e} of their RMS: not attended"
try:
    layer(x)  # autograd on, as in training
except RuntimeError as error:
    assert "modified inplace" in str(error), error
else:
    raise AssertionError("it ran with autograd on")
"""

_PADDED_QUERIES_NAN = """
import torch
from x_transformers.x_transformers import Encoder
scope = {}
exec(BUILD, scope)
x = torch.randn(1, 8, 32)
mask = torch.ones(1, 8, dtype=torch.bool)
mask[:, 6:] = False  # the last two tokens are padding
with torch.no_grad():
    out = scope["layer"].eval()(x, mask=mask)
    deep = Encoder(dim=32, depth=2, heads=4).eval()(x, mask=mask)  # two layers of it, as its Encoder stacks them
out = out[0] if isinstance(out, tuple) else out
assert bool(out[:, 6:].isnan().all()) and bool(out[:, :6].isfinite().all()), "the padded rows are not NaN"
assert not bool(deep[:, :6].isfinite().all()), "a 2-layer Encoder's real tokens stayed finite"
"""

_LAT_CAUSAL = """
from linear_attention_transformer.linear_attention_transformer import SelfAttention
layer = SelfAttention(32, 4, causal=True)  # causal linear attention on every head (no local heads), blindspot 1
declarations = dict(causal=True, mask="key_keep")  # the declaration its report names (`input_mask`, (B, T), keep)
"""
# xformers 0.0.x: its components import pyre_extensions (pure Python) and numpy; its C++ ops are optional
_XFORMERS_DEPS = ("pyre-extensions==0.0.23", "typing-inspect==0.9.0", "mypy-extensions==1.0.0", "numpy==2.4.6")
_LAT_DEPS = (EINOPS, "local-attention==1.4.3", "linformer==0.2.1", "product-key-memory==0.1.10",
             "axial-positional-embedding==0.2.1")

CASES: list[Case] = [
    Case("xtr_alibi_cache_longer", "positions", "x-transformers", "0.17.2", "0.17.3",
         "x_transformers/x_transformers.py", 200,
         "https://github.com/lucidrains/x-transformers/commit/fbbc159",
         "ALiBi reuses its cached bias when it is *shorter* than the keys (`<= j` for `>= j`): a call longer than "
         "the first raises (the bias does not broadcast)", _ALIBI_BLOCK, (EINOPS, ENTMAX)),
    Case("xtr_alibi_unalibied_heads", "positions", "x-transformers", "0.27.0", "0.27.1",
         "x_transformers/x_transformers.py", 272,
         "https://github.com/lucidrains/x-transformers/commit/6523746",
         "ALiBi counts the heads it leaves without a bias from the wrong axis of its (heads, 1, j) bias "
         "(`bias.shape[1]`, which is 1, for `shape[0]`), so it pads heads - 1 heads of zeros onto it: the bias has "
         "2 x heads - 1 heads and every call with more than one head raises where it is added to the scores",
         _ALIBI_BLOCK, (EINOPS, ENTMAX)),
    Case("xtr_alibi_cache_shapes", "positions", "x-transformers", "0.28.2", "0.28.3",
         "x_transformers/x_transformers.py", 273,
         "https://github.com/lucidrains/x-transformers/commit/74f241d",
         "ALiBi's bias is built once, on the first call's shape, and sliced on keys only (`[..., :j]`): a later "
         "call with other lengths gets a bias of the wrong shape", _ALIBI_BLOCK, (EINOPS, ENTMAX)),
    Case("xtr_talking_heads_post_softmax", "heads", "x-transformers", "0.2.4", "0.2.5",
         "x_transformers/x_transformers.py", 264,
         "https://github.com/lucidrains/x-transformers/commit/6cb3299",
         "talking heads' post-softmax mix is applied to the scores, which are not used again, instead of to the "
         "weights: post_softmax_proj has no effect",
         """
from x_transformers.x_transformers import Attention
layer = Attention(32, dim_head=8, heads=4, talking_heads=True)
declarations = dict(mask="key_keep")  # forward(x, mask=None): a (B, T) bool mask, True = keep
""", (EINOPS, ENTMAX)),
    Case("xtr_mem_kv_grouped_heads", "heads", "x-transformers", "1.27.7", "1.27.8",
         "x_transformers/x_transformers.py", 791,
         "https://github.com/lucidrains/x-transformers/commit/029ec31",
         "memory key/values are made with `heads` heads where the keys have `kv_heads` (grouped-query attention): "
         "every call with num_mem_kv and kv_heads < heads raises in the concatenation",
         """
from x_transformers.x_transformers import Attention
layer = Attention(32, dim_head=8, heads=4, kv_heads=2, num_mem_kv=2)
declarations = dict(mask="key_keep")  # forward(x, ..., mask=None): a (B, T) bool mask, True = keep
"""),
    Case("xtr_sparse_topk_inverted", "masking", "x-transformers", "1.37.9", "1.37.10",
         "x_transformers/attend.py", 419,
         "https://github.com/lucidrains/x-transformers/commit/d1f5d6b",
         "sparse top-k attention builds its keep-mask as `sim < top_values[..., -1:]`, the keys *below* the k-th "
         "score, and ands it into the mask: each query attends everything but its top k, future keys included",
         """
from x_transformers.x_transformers import Attention
layer = Attention(32, dim_head=8, heads=4, causal=True, sparse_topk=4)  # each query keeps its 4 highest scores
declarations = dict(causal=True, mask="key_keep")  # forward(x, ..., mask=None): a (B, T) bool mask, True = keep
""",
         true_finding="the fix drops the old `sparse_topk < j` guard, so any call with fewer keys than k raises in "
                      "topk (selected index k out of range): a 2-token call raises",
         confirm=_FEWER_KEYS_THAN_K_RAISES),
    Case("xtr_qk_norm_dim_scale_unused", "scaling", "x-transformers", "2.25.4", "2.25.5",
         "x_transformers/x_transformers.py", 2259,
         "https://github.com/lucidrains/x-transformers/issues/352",
         "with qk_norm_dim_scale=True, the per-dimension scales of the l2-normalised q and k are made but never "
         "applied: q and k are multiplied by the scalar qk_norm_scale instead",
         """
from x_transformers.x_transformers import Attention
layer = Attention(32, dim_head=8, heads=4, qk_norm=True, qk_norm_dim_scale=True)
declarations = dict(mask="key_keep")  # forward(x, ..., mask=None): a (B, T) bool mask, True = keep
""", (EINOPS, "einx==0.4.3", "frozendict==2.5.1", "loguru==0.7.3", "packaging==24.2",
      "torch-einops-utils==0.2.0", "numpy==2.4.6")),
    Case("vit_mask_broadcast_heads", "masking", "vit-pytorch", "0.6.7", "0.6.8",
         "vit_pytorch/vit_pytorch.py", 60,
         "https://github.com/lucidrains/vit-pytorch/commit/3f2cbc6",
         "the (B, N, N) pair mask is broadcast against (B, H, N, N) scores without a head axis, so it lines its "
         "batch up with the heads: it raises unless B == H or B == 1 (and masks the wrong sequences when B == H)",
         """
from vit_pytorch.vit_pytorch import Attention
layer = Attention(32, heads=4, dim_head=8)
# forward(x, mask=None): the mask is over the patches, (B, T - 1) bool, True = keep; the layer prepends True for the
# class token itself, so the audit's (B, T) keep mask is passed without its first column
declarations = dict(mask="key_keep",
                    call=lambda layer, x, mask=None: layer(x, mask=None if mask is None else mask[:, 1:]))
"""),
    Case("local_exact_window_and", "masking", "local-attention", "1.2.1", "1.2.2",
         "local_attention/local_attention.py", 150,
         "https://github.com/lucidrains/local-attention/commit/270adde",
         "exact_windowsize's limit is and-ed into the causal mask (`mask & too_far` for `|`), so the causal mask "
         "blocks almost nothing: future keys and keys beyond the window are attended",
         """
from local_attention import LocalAttention
from diagnostics.patterns import sliding_window
# window 4, one window back, exact: its code keeps q - 4 <= kv <= q (4 keys back and the query's own; the
# README's 'at maximum the window size' counts the keys back), so 5 keys: sliding_window(5)
layer = LocalAttention(window_size=4, causal=True, look_backward=1, exact_windowsize=True, autopad=True)
# d_model: the usage error's fix; mask: the declaration its report names (`input_mask`, (B, T), True = keep)
declarations = dict(causal=True, pattern=sliding_window(5), d_model=16, mask="key_keep")
"""),
    Case("local_rel_pos_unset", "crash", "local-attention", "1.0.1", "1.0.2",
         "local_attention/local_attention.py", 80,
         "https://github.com/lucidrains/local-attention/commit/e73206e",
         "`self.rel_pos` is set only when a relative position config is given, and read on every call: "
         "every call without one raises AttributeError",
         """
from local_attention import LocalAttention
layer = LocalAttention(window_size=4, causal=True, look_backward=1)
# d_model: the usage error's fix; mask: the declaration its report names (`input_mask`, (B, T), True = keep)
declarations = dict(causal=True, d_model=16, mask="key_keep")
"""),
    Case("performer_key_max_over_batch", "batch", "performer-pytorch", "1.1.0", "1.1.1",
         "performer_pytorch/performer_pytorch.py", 109,
         "https://github.com/lucidrains/performer-pytorch/commit/08525a4",
         "the key features' stabiliser subtracts torch.max over the whole tensor (every sequence of the batch), "
         "so one sequence's output depends on the others (through the kernel's eps)",
         """
import torch
def qr(a, some=True):  # the 2021 code calls torch.qr(block, some=True), which torch 2.x removed: the same decomposition
    return torch.linalg.qr(a, "reduced" if some else "complete")
torch.qr = qr
from performer_pytorch import SelfAttention
layer = SelfAttention(32, causal=False, heads=4, dim_head=8)
# forward(*args, context=None, **kwargs): the usage error's fix, a call; the mask is a (B, T) bool, True = keep
declarations = dict(mask="key_keep", call=lambda layer, x, mask=None: layer(x, mask=mask))
""", (EINOPS, "local-attention==1.4.3", "axial-positional-embedding==0.2.1"),
         true_finding="its padding mask zeroes the padded values only, so padded keys still weigh in the "
                      "denominator: changing only the padded tokens moves the unpadded outputs (0.085, 72% of "
                      "their RMS, on a (1, 8) input)",
         confirm=padded_keys_move_outputs()),
    Case("lat_causal_key_max_leak", "masking", "linear-attention-transformer", "0.16.0", "0.16.1",
         "linear_attention_transformer/linear_attention_transformer.py", 167,
         "https://github.com/lucidrains/linear-attention-transformer/commit/a0db8ba",
         "causal linear attention subtracts each key feature's max over the whole sequence before exp, so every "
         "past output depends on the future keys",
         _LAT_CAUSAL, _LAT_DEPS,
         true_finding="its causal linear attention divides by the keys' running sum, not by q . (running sum of "
                      "keys), so the output is no weighted mean of the values; the library fixed it in 0.17.2 "
                      "(`D_inv = 1. / einsum(...)`, commit dc2a661, the lat_causal_d_inv case)",
         confirm=_IDENTICAL_TOKENS_DIFFER),
    Case("lat_causal_d_inv", "normalisation", "linear-attention-transformer", "0.17.1", "0.17.2",
         "linear_attention_transformer/linear_attention_transformer.py", 191,
         "https://github.com/lucidrains/linear-attention-transformer/commit/dc2a661",
         "causal linear attention multiplies by its normaliser D = q . (running sum of keys) instead of dividing "
         "by it: the output is no weighted mean of the values", _LAT_CAUSAL, _LAT_DEPS),
    Case("mea_scale_twice", "scaling", "memory-efficient-attention-pytorch", "0.0.4", "0.0.5",
         "memory_efficient_attention_pytorch/memory_efficient_attention.py", 185,
         "https://github.com/lucidrains/memory-efficient-attention-pytorch/commit/2b93d55",
         "the module scales q by dim_head ** -0.5 and the attention function scales it again: logits 1/d_k, "
         "too flat by sqrt(d_k)",
         """
from memory_efficient_attention_pytorch import Attention
layer = Attention(dim=32, dim_head=8, heads=4)
declarations = dict(mask="key_keep")  # forward(x, context=None, mask=None): a (B, T) bool mask, True = keep
""",
         true_finding="it subtracts a detached max over every key, the padded ones too, before masking, so the padded "
                      "tokens move the unpadded outputs through the rounding of that shift (by 1.3e-5 of their RMS "
                      "in float32, 0.39 in bfloat16 when only the padded tokens change, x1000; 0.0.14, which takes "
                      "the max after masking, moves them by 0)",
         confirm=padded_keys_move_outputs("bfloat16", least=0.1)),
    Case("nvit_qk_scale_before_norm", "scaling", "vit-pytorch", "1.8.4", "1.8.5",
         "vit_pytorch/normalized_vit.py", 98,
         "https://github.com/lucidrains/vit-pytorch/commit/e300cdd",
         "nViT multiplies q and k by their learned scales (dim_head ** 0.25 each) *before* the l2 norm, which "
         "undoes them: the logits stay within [-1, 1] (SDPA's scale is 1), too flat by sqrt(dim_head)",
         """
normalized_vit = load("vit_pytorch/normalized_vit.py")  # vit_pytorch/__init__ imports torchvision
layer = normalized_vit.Attention(32, dim_head=8, heads=4)
declarations = dict()
"""),
    Case("perceiver_scale_divided", "scaling", "perceiver-io-pytorch", "0.1.2", "0.1.4",
         "perceiver_io/attention.py", 74,
         "https://github.com/esceptico/perceiver-io/issues/9",
         "the scores are divided by `self.scale`, which is already head_dim ** -0.5, for multiplied: logits "
         "head_dim times too sharp",
         """
from perceiver_io.attention import MultiHeadAttention
layer = MultiHeadAttention(kv_dim=32, q_dim=32, num_heads=4)
# forward(inputs_kv, inputs_q, attention_mask=None): the usage error's fix, inputs_q the same stream again; its
# mask is a 0/1 tensor that it both subtracts from 1 and fills with, which no dtype allows in torch 2, so none
declarations = dict(call=lambda layer, x: layer(x, inputs_q=x))
"""),
    Case("torchnlp_softmax_dim0", "normalisation", "pytorch-nlp", "0.1.0", "0.2.0",
         "torchnlp/nn/attention.py", 42,
         "https://github.com/PetrochukM/PyTorch-NLP/issues/2",
         "the softmax over the (batch x queries, keys) scores is taken over dim=0, across the batch and the "
         "queries, for dim=-1: each query's weights do not sum to 1 over its keys",
         """
attention = load("torchnlp/nn/attention.py")  # torchnlp/__init__ imports its datasets and text encoders
layer = attention.Attention(32)  # 'general': score(c, q) = c . W q; output tanh(W_out [mix; query])
declarations = dict(scale=1.0)  # Luong's scores are unscaled by design (its docstring: score = H_j^T W_a q)
""", (),
         true_finding="it reshapes its query with `.view`, so a non-contiguous query raises (a (T, B, D) RNN output "
                      "transposed to batch-first, as seq2seq decoders give it); every release since does the same",
         confirm=_NON_CONTIGUOUS_QUERY_RAISES),
    Case("fastnlp_softmax_over_queries", "normalisation", "fastNLP", "0.5.0", "0.5.5",
         "fastNLP/modules/encoder/attention.py", 29,
         "https://github.com/FudanNLP/fastNLP/issues/254",
         "DotAttention's softmax over (B, H, Tq, Tk) scores is nn.Softmax(dim=2), over the queries, for dim=-1",
         """
import sys, types
# fastNLP/__init__ imports the whole toolkit (nltk, its trainers); the attention needs modules/utils.py only
for name in ("fastNLP", "fastNLP.modules"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["fastNLP.modules.utils"] = load("fastNLP/modules/utils.py")
attention = load("fastNLP/modules/encoder/attention.py")
layer = attention.MultiHeadAttention(input_size=32, key_size=8, value_size=8, num_head=4, dropout=0.0)
declarations = dict()
""", ()),
    Case("labml_ddpm_softmax_over_queries", "normalisation", "labml-nn", "0.4.129", "0.4.131",
         "labml_nn/diffusion/ddpm/unet.py", 188,
         "https://github.com/labmlai/annotated_deep_learning_paper_implementations/issues/146",
         "the DDPM U-Net's attention block takes the softmax of its (b, i, j, h) scores over i, the queries "
         "(`softmax(dim=1)`), for j, the keys",
         """
unet = load("labml_nn/diffusion/ddpm/unet.py")  # labml_nn/__init__ is the whole zoo
layer = unet.AttentionBlock(32)  # one head of 32, as its U-Net builds it (with more heads its .view raises in torch 2)
# forward(x, t=None) on an image (B, C, H, W): a sequence of T tokens is the (B, C, T, 1) image
declarations = dict(call=lambda layer, x: layer(x.transpose(1, 2)[..., None])[..., 0].transpose(1, 2))
""", ("labml-helpers==0.4.89",),
         true_finding="its __init__ makes a GroupNorm (`self.norm`) that forward never applies: the output does not "
                      "move with norm.weight or norm.bias (every release since, 0.5.1 too, the same)",
         confirm=_NORM_NEVER_APPLIED),
    Case("timm_mqa_v2_unscaled", "scaling", "timm", "1.0.12", "1.0.13",
         "timm/layers/attention2d.py", 71,
         "https://github.com/huggingface/pytorch-image-models/pull/2388",
         "MultiQueryAttentionV2 never multiplies q.k by its `self.scale`, and writes its (B, N, C) output into the "
         "(B, C, H, W) image with a reshape, no transpose, so positions and channels are mixed",
         _IMAGE_LAYER.format(cls="MultiQueryAttentionV2", args="32, num_heads=4, key_dim=8, value_dim=8", then=""),
         ("numpy==2.4.6",)),
    Case("timm_attention2d_scale_num_heads", "scaling", "timm", "1.0.12", "1.0.13",
         "timm/layers/attention2d.py", 341,
         "https://github.com/huggingface/pytorch-image-models/pull/2388",
         "Attention2d's unfused path scales q by num_heads ** -0.5 for dim_head ** -0.5 (its fused path, SDPA, "
         "scales right): too sharp by sqrt(dim_head / num_heads)",
         _IMAGE_LAYER.format(cls="Attention2d", args="32, num_heads=4",
                             then="layer.fused_attn = False  # the path written out (the fused one is SDPA's)\n"),
         ("numpy==2.4.6",)),
    Case("timm_eva_mask_after_softmax", "masking", "timm", "1.0.7", "1.0.8",
         "timm/models/eva.py", 150,
         "https://github.com/huggingface/pytorch-image-models/pull/2236",
         "EvaAttention's path without SDPA fills the blocked keys with -inf after the softmax, not before it: every "
         "row with a blocked key is NaN",
         """
from timm.models.eva import EvaAttention
layer = EvaAttention(32, num_heads=4, num_prefix_tokens=0)
layer.fused_attn = False  # the path written out (the fused path hands the (B, N) mask to SDPA as it is)
# forward(x, rope=None, attn_mask=None): a (B, T) bool mask, True = keep
declarations = dict(mask="key_keep", call=lambda layer, x, mask=None: layer(x, attn_mask=mask))
""", ("numpy==2.4.6",)),
    Case("braindecode_scale_whole_width", "scaling", "braindecode", "1.4.0", "1.5.0",
         "braindecode/modules/attention.py", 904,
         "https://github.com/braindecode/braindecode/issues/873",
         "MultiHeadAttention (EEGConformer's, CTNet's) divides q.k by sqrt(emb_size), the whole width's, for "
         "sqrt(d_k): too flat by sqrt(num_heads)",
         """
import sys, types
# braindecode/__init__ imports mne and its model zoo; attention.py needs only braindecode.functional's helpers
sys.modules["braindecode"] = types.ModuleType("braindecode")
sys.modules["braindecode.functional"] = load("braindecode/functional/functions.py")
attention = load("braindecode/modules/attention.py")
layer = attention.MultiHeadAttention(32, 4, 0.0)  # (emb_size, num_heads, dropout); forward(x, mask=None)
# mask: bool, True = keep, broadcast against (B, H, Tq, Tk) in both releases (1.4.0: masked_fill(~mask); 1.5.0: SDPA)
declarations = dict(mask="key_keep",
                    call=lambda layer, x, mask=None: layer(x, mask=None if mask is None else mask[:, None, None, :]))
""", ()),
    Case("labml_rope_values_rotated_twice", "positions", "labml-nn", "0.4.136", "0.4.137",
         "labml_nn/transformers/rope/value_pe/__init__.py", 234,
         "https://github.com/labmlai/annotated_deep_learning_paper_implementations/issues/251",
         "RoPER (rotary value embeddings): the values are rotated when projected and again inside the weighted sum, "
         "then rotated back once, so what the output keeps of a value's position is absolute, not relative",
         """
import sys, types
# labml_nn/__init__ is the whole zoo, and labml (its logger and tracker) is a separate package: stand-ins
labml = types.ModuleType("labml")
labml.tracker = types.SimpleNamespace(debug=lambda *a, **k: None)
labml.logger = types.ModuleType("labml.logger")
labml.logger.inspect = print
sys.modules.update({"labml": labml, "labml.logger": labml.logger, "labml_nn": types.ModuleType("labml_nn"),
                    "labml_nn.transformers": types.ModuleType("labml_nn.transformers")})
sys.modules["labml_nn.transformers.mha"] = load("labml_nn/transformers/mha.py")
sys.modules["labml_nn.transformers.rope"] = load("labml_nn/transformers/rope/__init__.py")
value_pe = load("labml_nn/transformers/rope/value_pe/__init__.py")
layer = value_pe.RotaryValuePEMultiHeadAttention(heads=4, d_model=32, rope_percentage=0.5, rope_value_percentage=0.5)
# forward(*, query, key, value, mask=None), sequence-first (T, B, D); its mask (Tq, Tk, B), 1 = may attend
declarations = dict(mask="allowed:B,Tq,Tk", call=lambda layer, x, mask=None: layer(
    query=x.transpose(0, 1), key=x.transpose(0, 1), value=x.transpose(0, 1),
    mask=None if mask is None else mask.permute(1, 2, 0)).transpose(0, 1))
""", ()),
    Case("ttc_label_attention_mask_inverted", "masking", "torchtextclassifiers", "1.0.4", "2.0.0",
         "torchTextClassifiers/model/components/text_embedder.py", 282,
         "https://github.com/InseeFrLab/torchTextClassifiers/pull/92",
         "the label attention hands SDPA `attention_mask == 0` as its bool mask, where True means attend: each "
         "learned label query attends the padding only",
         """
import sys, types
for name in ("torchTextClassifiers", "torchTextClassifiers.model", "torchTextClassifiers.model.components"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["torchTextClassifiers.model.components.attention"] = load(
    "torchTextClassifiers/model/components/attention.py")
te = load("torchTextClassifiers/model/components/text_embedder.py")
if hasattr(te, "LabelAttentionClassifier"):  # 1.0.x
    layer = te.LabelAttentionClassifier(te.TextEmbedderConfig(vocab_size=10, embedding_dim=32, padding_idx=0,
        label_attention_config=te.LabelAttentionConfig(n_head=4, num_classes=3)))
else:  # 2.0.0 renamed it
    layer = te.LabelAttention(te.LabelAttentionConfig(n_head=4, num_classes=3, embedding_dim=32))
# forward(token_embeddings, attention_mask=None) -> dict; mask (B, T), 1 = a real token; 3 learned label queries
declarations = dict(mask="key_keep", queries=3, call=lambda layer, x, mask=None: layer(
    x, attention_mask=None if mask is None else mask.long())["sentence_embedding"])
""", ()),
    # found for stop 65 by a helper reading the packages' histories (commit messages, then the two releases' diff)
    Case("nystrom_left_pad_rows", "positions", "nystrom-attention", "0.0.9", "0.0.10",
         "nystrom_attention/nystrom_attention.py", 144,
         "https://github.com/lucidrains/nystrom-attention/commit/d7eb229",
         "a sequence whose length is no multiple of the landmarks is padded on the left, and the output is cut to "
         "its first n rows (`out[:, :n]` for `out[:, -n:]`): the padding's rows and the tokens' shifted",
         """
from nystrom_attention import NystromAttention
layer = NystromAttention(dim=32, dim_head=8, heads=4, num_landmarks=4, pinv_iterations=6, residual=False)
declarations = dict(mask="key_keep")  # forward(x, mask=None): a (B, T) bool mask, True = keep
""",
         true_finding="without a mask it attends the zero tokens it pads the sequence with (10 tokens: its outputs move "
                      "by 0.55 of their RMS against the same call with every token kept), and it scales q in place "
                      "(`q *= self.scale`, a view of the projection's output), which raises whenever autograd is on, "
                      "so it cannot be trained in torch 2 (the audit's runs, gradients); every detector's finding on "
                      "it was not confirmed one by one (Nystrom's approximation at 4 landmarks is no exact attention)",
         confirm=_NYSTROM_PADS_AND_AUTOGRAD),
    Case("palm_alibi_cached_twice", "positions", "PaLM-pytorch", "0.2.0", "0.2.1",
         "palm_pytorch/palm_lite.py", 57,
         "https://github.com/lucidrains/PaLM-pytorch/commit/d78cd03",
         "ALiBi's cached path returns the scores plus the bias, which its caller adds to the scores again: from the "
         "second call on the logits are 2 x q.k + bias, twice too sharp",
         """
palm_lite = load("palm_pytorch/palm_lite.py")  # palm_pytorch/__init__ imports the full PaLM (triton's kernels)
layer = palm_lite.ParallelTransformerBlock(dim=32, dim_head=8, heads=4, ff_mult=2)  # attention and FF in parallel
declarations = dict(causal=True)  # its own causal mask, no mask argument
"""),
    Case("sinkhorn_local_unscaled", "scaling", "sinkhorn-transformer", "0.5.8", "0.5.9",
         "sinkhorn_transformer/sinkhorn_transformer.py", 269,
         "https://github.com/lucidrains/sinkhorn-transformer/commit/cd3ec38",
         "LocalAttention's bucketed scores `einsum(bq, bk)` are never scaled by 1/sqrt(d_head): too sharp by "
         "sqrt(d_head)",
         """
import fractions, math
fractions.gcd = math.gcd  # the 2020 code imports fractions.gcd, which Python 3.9 removed
from sinkhorn_transformer.sinkhorn_transformer import LocalAttention
local = LocalAttention(bucket_size=4, causal=True)  # forward(q, k, v, q_mask=None, kv_mask=None) on (B, H, T, d)

def layer(q, k, v):  # a module on per-head tensors is audited as the function that calls it
    return local(q, k, v)

declarations = dict(causal=True)
"""),
    Case("xtr_input_mask_inverted", "masking", "x-transformers", "0.0.28", "0.0.29",
         "x_transformers/x_transformers.py", 230,
         "https://github.com/lucidrains/x-transformers/commit/ff7e307",
         "the (B, T) keep mask is filled with -inf as it is (`masked_fill_(input_mask, ...)` for `~input_mask`): "
         "each query attends the padding only, and a row with no padding is NaN",
         """
from x_transformers.x_transformers import Attention
layer = Attention(32, dim_head=8, heads=4)
declarations = dict(mask="key_keep")  # forward(x, context=None, mask=None): a (B, T) bool mask, True = keep
""", (EINOPS, ENTMAX),
         true_finding="the fix masks queries too (`q_mask * k_mask`), so a padded query has no key and its row is NaN; "
                      "the next layer's attention reads those NaN values (0 x NaN), and a 2-layer Encoder of it "
                      "gives NaN at the real tokens (weight_row_sums)",
         confirm=_PADDED_QUERIES_NAN),
    Case("xtr_rel_pos_bucket_direction", "positions", "x-transformers", "0.6.6", "0.6.7",
         "x_transformers/x_transformers.py", 118,
         "https://github.com/lucidrains/x-transformers/commit/6d0c641",
         "T5's relative position buckets test `if causal:` for `if not causal:`, so a bidirectional layer gets the "
         "one-sided buckets: every key after its query falls in the bucket of the query itself",
         """
from torch import nn
from x_transformers.x_transformers import Attention, RelativePositionBias

class Block(nn.Module):
    # x-transformers' attention with the T5 bias its Encoder passes it (rel_pos_bias=True), 8 heads as the bias has
    def __init__(self):
        super().__init__()
        self.attn = Attention(32, dim_head=4, heads=8)
        self.rel_pos = RelativePositionBias(causal=False)

    def forward(self, x):
        return self.attn(x, rel_pos=self.rel_pos)[0]  # (out, intermediates)

layer = Block()
declarations = dict()
""", (EINOPS, ENTMAX)),
    Case("rotary_rotate_half_pairs", "positions", "rotary-embedding-torch", "0.0.11", "0.0.12",
         "rotary_embedding_torch/rotary_embedding_torch.py", 37,
         "https://github.com/lucidrains/rotary-embedding-torch/commit/204cb02",
         "`rotate_half` takes the interleaved pairs (2m, 2m+1) apart and joins them again as halves, "
         "`torch.cat((-x2, x1))`, while the cos/sin table is interleaved: q and k are not rotated, and q·k depends "
         "on absolute positions",
         ROTARY_BLOCK.format(make="RotaryEmbedding(8)", rotate="""freqs = self.rot(torch.arange(t), cache_key=t)
        q, k = apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k)""")),
    Case("rotary_xpos_scale_halves", "positions", "rotary-embedding-torch", "0.7.0", "0.8.0",
         "rotary_embedding_torch/rotary_embedding_torch.py", 240,
         "https://github.com/lucidrains/rotary-embedding-torch/commit/4ae4ca0",
         "xPos's decay is laid out in halves, `torch.cat((scale, scale))`, while the cos/sin table is interleaved: "
         "the two features of a pair are scaled apart, and q·k depends on absolute positions",
         ROTARY_BLOCK.format(make="RotaryEmbedding(8, use_xpos=True)",
                              rotate="q, k = self.rot.rotate_queries_and_keys(q, k)")),
    Case("rotary_cache_key_offset", "positions", "rotary-embedding-torch", "0.2.6", "0.2.7",
         "rotary_embedding_torch/rotary_embedding_torch.py", 118,
         "https://github.com/lucidrains/rotary-embedding-torch/issues/11",
         "`rotate_queries_or_keys(t, offset=...)` caches the frequencies under the length alone (`freqs:{seq_len}`): a "
         "second call of the same length at another offset (a decoding step through a KV cache) gets the first "
         "offset's positions",
         ROTARY_CACHE_BLOCK),
    Case("xformers_causal_without_mask", "masking", "xformers", "0.0.3", "0.0.4",
         "xformers/components/attention/scaled_dot_product.py", 108,
         "https://github.com/facebookresearch/xformers/issues/103",
         "ScaledDotProduct(causal=True) merges its causal mask into a mask that is passed but never uses it alone: "
         "called without att_mask, it attends the future",
         """
from xformers.components.attention.scaled_dot_product import ScaledDotProduct
layer = ScaledDotProduct(causal=True, seq_len=64)  # forward(q, k, v, att_mask=None) on (B x heads, T, d)
declarations = dict(causal=True, d_model=16)  # d_model: the usage error's fix
""", _XFORMERS_DEPS),
]


# ---- downloading and unpacking ---------------------------------------------------------------------------------


def _dist_name(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    if not name or not version:
        raise ValueError(f"expected NAME==VERSION, got {requirement!r}")
    return name, version


def release_dir(requirement: str, cache: Path, offline: bool = False) -> Path:
    """The unpacked release of `requirement` (NAME==VERSION) under `cache`: downloaded with `pip download
    --no-deps` and unpacked on first use. Its folder is the one to put on sys.path (a wheel's root; an sdist's
    top folder)."""
    name, version = _dist_name(requirement)
    folder = cache / f"{name}-{version}"
    unpacked = folder / "unpacked"
    if (folder / "UNPACKED").exists():
        return _import_root(unpacked)
    archives = [p for p in folder.glob("*") if p.suffix in (".whl", ".gz", ".zip")] if folder.exists() else []
    if not archives:
        if offline:
            raise FileNotFoundError(f"{requirement} is not in the cache {cache} (run once without --offline)")
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                               "--disable-pip-version-check", "-q", requirement, "-d", str(folder)],
                              capture_output=True, text=True)
        archives = [p for p in folder.glob("*") if p.suffix in (".whl", ".gz", ".zip")]
        if done.returncode or not archives:
            raise RuntimeError(f"pip download {requirement} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    archive = archives[0]
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            z.extractall(unpacked)
    else:
        with tarfile.open(archive) as t:
            t.extractall(unpacked, filter="data")
    (folder / "UNPACKED").write_text(archive.name)
    return _import_root(unpacked)


def _import_root(unpacked: Path) -> Path:
    """A wheel's files sit at its root; an sdist's in one top folder (NAME-VERSION/)."""
    inner = [p for p in unpacked.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", ".egg-info"))]
    if len(inner) == 1 and (inner[0] / "setup.py").exists() or len(inner) == 1 and (inner[0] / "PKG-INFO").exists():
        return inner[0]
    return unpacked


# ---- what the fix changed -----------------------------------------------------------------------------------


def changed_lines(buggy: list[str], fixed: list[str]) -> tuple[list[int], list[int]]:
    """(1-based lines of `buggy`, 1-based lines of `fixed`) that differ, by difflib. A deletion counts, on the
    side that lacks the lines, as the lines on either side of where they were."""
    on_buggy, on_fixed = set(), set()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, buggy, fixed, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if i2 > i1:
            on_buggy.update(range(i1 + 1, i2 + 1))
        else:
            on_buggy.update(n for n in (i1, i1 + 1) if 1 <= n <= len(buggy))
        if j2 > j1:
            on_fixed.update(range(j1 + 1, j2 + 1))
        else:
            on_fixed.update(n for n in (j1, j1 + 1) if 1 <= n <= len(fixed))
    return sorted(on_buggy), sorted(on_fixed)


def check_case(case: Case, buggy_root: Path, fixed_root: Path) -> list[int]:
    """The buggy release's changed lines of `case.file`; raises when the two releases' files are equal or the
    case's `fix_line` is not a line the fixed release changed (the table would cite a fix that is not there)."""
    buggy = (buggy_root / case.file).read_text().splitlines()
    fixed = (fixed_root / case.file).read_text().splitlines()
    on_buggy, on_fixed = changed_lines(buggy, fixed)
    if not on_buggy:
        raise ValueError(f"{case.id}: {case.file} is the same in {case.buggy} and {case.fixed}")
    if case.fix_line not in on_fixed:
        raise ValueError(f"{case.id}: expected the fix at {case.file}:{case.fix_line} of {case.fixed}; "
                         f"the lines that differ there are {on_fixed[:20]}")
    return on_buggy


# ---- one audit, in a subprocess --------------------------------------------------------------------------------

CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
paths, build, project, confirm = json.loads(sys.argv[1])
sys.path[:0] = paths + [project]
import torch
torch.set_num_threads(1)
import diagnostics
start = time.perf_counter()
out = {}
try:
    def load(relative):
        # a module file of the release by its path, without its package's __init__ (which may import what the
        # attention does not need, such as torchvision)
        import importlib.util
        spec = importlib.util.spec_from_file_location(relative.replace("/", ".")[:-3], paths[0] + "/" + relative)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    scope = {"load": load}
    exec(build, scope)
    torch.manual_seed(0)
    report = diagnostics.audit(scope["layer"], progress=False, **scope["declarations"])
except diagnostics.AuditUsageError as error:
    out = {"status": "usage error", "error": str(error)}
except Exception as error:  # the release does not build or import here: not the audit's verdict
    out = {"status": "did not build", "error": f"{type(error).__name__}: {error}"[:300]}
else:
    failing = [r for r in report.findings if r.verdict == "fail"]
    out = {"status": report.status, "fired": report.fired(), "failed": [r.detector for r in failing],
           "sites": [[r.detector, s.file, s.line, [list(c[:2]) for c in s.callers]] for r in failing for s in r.where]}
out["seconds"] = time.perf_counter() - start
if confirm:  # the true finding checked without the audit: a plain script that asserts the defect
    try:
        torch.manual_seed(0)
        exec(confirm, {"BUILD": build, "load": load})
        out["confirmed"] = "yes"
    except Exception as error:
        out["confirmed"] = f"no ({type(error).__name__}: {error})"[:200]
print("PYPI-BUGS-RESULT " + json.dumps(out))
"""


def audit_release(case: Case, root: Path, deps: list[Path], timeout: float = 600, confirm: str = "") -> dict:
    """diagnostics.audit of the case's layer built from the release unpacked at `root`, in a fresh process; then
    `confirm` (a script asserting a true finding) run there too, its outcome in "confirmed"."""
    args = json.dumps([[str(root), *map(str, deps)], case.build, str(ROOT), confirm])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=str(root))
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "seconds": timeout}
    for line in done.stdout.splitlines():
        if line.startswith("PYPI-BUGS-RESULT "):
            return json.loads(line.split(" ", 1)[1])
    return {"status": "crashed", "error": (done.stderr or done.stdout).strip()[-300:], "seconds": 0.0}


# ---- a case, the table, the totals ----------------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    lines: list[int] = field(default_factory=list)
    buggy: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    localised: bool = False
    via_caller: bool = False
    sites: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""  # the case could not be run (download, unpacking, the table's own check)


def localise(case: Case, root: Path, lines: list[int], sites: list) -> tuple[bool, bool, list[str]]:
    """(a site lies within NEAR lines of a changed line of case.file, a site's caller does, the sites shown)."""
    target = str((root / case.file).resolve())

    def near(path: str, line: int) -> bool:
        return str(Path(path).resolve()) == target and any(abs(line - n) <= NEAR for n in lines)

    localised = via_caller = False
    shown = []
    for detector, path, line, callers in sites:
        shown.append(f"{detector}@{Path(path).name}:{line}")
        localised = localised or near(path, line)
        via_caller = via_caller or any(near(p, n) for p, n in callers)
    return localised, localised or via_caller, shown


def run_case(case: Case, cache: Path, offline: bool = False) -> Outcome:
    start = time.perf_counter()
    outcome = Outcome(case)
    try:
        buggy_root = release_dir(f"{case.package}=={case.buggy}", cache, offline)
        fixed_root = release_dir(f"{case.package}=={case.fixed}", cache, offline)
        deps = [release_dir(d, cache, offline) for d in case.deps]
        outcome.lines = check_case(case, buggy_root, fixed_root)
    except (OSError, RuntimeError, ValueError) as error:
        outcome.error = str(error)
        outcome.seconds = time.perf_counter() - start
        return outcome
    outcome.buggy = audit_release(case, buggy_root, deps)
    outcome.fixed = audit_release(case, fixed_root, deps, confirm=case.confirm)
    outcome.localised, outcome.via_caller, outcome.sites = localise(case, buggy_root, outcome.lines,
                                                                    outcome.buggy.get("sites", []))
    outcome.seconds = time.perf_counter() - start
    return outcome


def _status(result: dict) -> str:
    failed = [d for d, v in result.get("fired", {}).items() if v == "fail"]
    status = result.get("status", "-")
    return f"{status}: {', '.join(failed)}" if failed else status


def table(outcomes: list[Outcome], verbose: bool = False) -> str:
    rows = ["| case | kind | release pair | buggy caught (failed detectors) | fixed passed | localised | fix | s |",
            "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        c = o.case
        pair = f"{c.package} {c.buggy} -> {c.fixed}"
        if _not_run(o):
            rows.append(f"| `{c.id}` | {c.kind} | {pair} | not run: {_not_run(o)[:200]} | - | - | {c.url} | - |")
            continue
        caught = "yes" if o.buggy.get("status") == "failed" else "no"
        caught += f" ({_status(o.buggy)})"
        fixed = "yes" if o.fixed.get("status") == "passed" else f"no ({_status(o.fixed)})"
        if c.true_finding and o.fixed.get("status") == "failed" and o.fixed.get("confirmed", "yes") == "yes":
            fixed += ", a true finding confirmed outside the audit"
        where = (("yes" if o.localised else "by a caller" if o.via_caller else "no")
                 if o.buggy.get("status") == "failed" else "-")
        rows.append(f"| `{c.id}` | {c.kind} | {pair} | {caught} | {fixed} | {where} | "
                    f"[{c.file}:{c.fix_line}]({c.url}) | {o.seconds:.1f} |")
        if verbose:
            errors = "; ".join(r["error"] for r in (o.buggy, o.fixed) if r.get("error"))
            what = c.what + (f" (fixed release's true finding: {c.true_finding}; its script: "
                             f"{o.fixed.get('confirmed', 'none')})" if c.true_finding else "")
            rows.append(f"|   | {what} | changed lines {o.lines[:8]} | fired {o.buggy.get('fired', {})} | "
                        f"fired {o.fixed.get('fired', {})} | {'; '.join(o.sites[:6]) or '-'} | {errors or '-'} | |")
    return "\n".join(rows)


NOT_AUDITED = ("did not build", "crashed", "timed out")  # the release, not the audit: the case is not run here


def _not_run(o: Outcome) -> str:
    """Why the case was not run ("" if it was): the table's own check, or a release that does not build here (an
    API its torch no longer has)."""
    if o.error:
        return o.error
    broken = [f"{which} release {r['status']}: {r.get('error', '')}" for which, r in (("buggy", o.buggy),
              ("fixed", o.fixed)) if r.get("status") in NOT_AUDITED]
    return "; ".join(broken)


def counts(outcomes: list[Outcome]) -> dict:
    ran = [o for o in outcomes if not _not_run(o)]
    caught = [o for o in ran if o.buggy.get("status") == "failed"]
    return {"cases": len(outcomes), "ran": len(ran), "caught": len(caught),
            "fixed_passed": sum(o.fixed.get("status") == "passed" for o in ran),
            "true_findings": sum(o.fixed.get("status") == "failed" and bool(o.case.true_finding)
                                 and o.fixed.get("confirmed", "yes") == "yes" for o in ran),
            "localised": sum(o.localised for o in caught), "via_caller": sum(o.via_caller for o in caught)}


def _line(n: dict) -> str:
    true = f" (+{n['true_findings']} failed for a confirmed true finding)" if n["true_findings"] else ""
    text = (f"caught {n['caught']}/{n['ran']}, fixed passed {n['fixed_passed']}/{n['ran']}{true}, localised "
            f"{n['localised']}/{n['caught']} ({n['via_caller']}/{n['caught']} counting the lines that called a site's op)")
    return text + (f"; {n['cases'] - n['ran']} not run" if n["cases"] > n["ran"] else "")


def totals(outcomes: list[Outcome]) -> str:
    kinds = sorted({o.case.kind for o in outcomes})
    rows = [f"- {kind}: {_line(counts([o for o in outcomes if o.case.kind == kind]))}" for kind in kinds]
    return "\n".join(rows + [f"- all: {_line(counts(outcomes))}"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="the cases with these ids")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"where releases are downloaded (default {CACHE})")
    parser.add_argument("--offline", action="store_true", help="use the cache only; download nothing")
    parser.add_argument("--verbose", action="store_true", help="a second line per case: what, findings, sites")
    args = parser.parse_args(argv)
    cases = CASES
    if args.only:
        unknown = sorted(set(args.only) - {c.id for c in CASES})
        if unknown:
            parser.error(f"unknown ids {unknown}; known: {', '.join(c.id for c in CASES)}")
        cases = [c for c in CASES if c.id in args.only]
    start = time.perf_counter()
    outcomes = [run_case(case, args.cache, args.offline) for case in cases]
    took = time.perf_counter() - start
    print(table(outcomes, args.verbose))
    print()
    print(totals(outcomes))
    warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")
    import torch  # noqa: PLC0415 (only for the versions line; the audits ran in subprocesses)

    command = " ".join(["python benchmarks/pypi_bugs.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"\n`{command}`: {len(outcomes)} cases, {2 * sum(not o.error for o in outcomes)} audits in {took:.1f} s on "
          f"{datetime.date.today().isoformat()} (torch {torch.__version__}, Python {sys.version.split()[0]}, "
          f"1 thread per audit, one subprocess per release)")


if __name__ == "__main__":
    main()
