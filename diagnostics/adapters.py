"""Adapters: call layers from torch, timm and Hugging Face transformers the way `audit()` expects.

The audit passes masks in one convention, torch SDPA's: bool `(B, 1, Tq, Tk)`, True = may attend. A
library layer may name its mask argument differently, take it in another convention, or need arguments
its parent model would build (rotary position embeddings). An adapter translates, and nothing else: it
never changes what the layer computes, and no detector is loosened for a library.

    | layer                                   | mask argument       | convention                               |
    |-----------------------------------------|---------------------|------------------------------------------|
    | F.scaled_dot_product_attention, timm    | attn_mask           | "allowed": bool, True = may attend       |
    | nn.MultiheadAttention, nn.Transformer*  | attn_mask, src_mask | "mha_blocked": (B*H, Tq, Tk), True = blocked |
    | Hugging Face, attn_implementation eager | attention_mask      | "additive": 0 keep, finfo.min block      |
    | Hugging Face, attn_implementation sdpa  | attention_mask      | "allowed" (what the parent model passes) |

    from diagnostics import adapters, audit

    audit(adapters.huggingface(llama_attention, rotary=rotary_embedding), causal=True)  # as LlamaModel calls it
    audit(adapters.huggingface(llama_attention, rotary=rotary_embedding, pass_mask=False), causal=True)  # alone
    audit(adapters.self_attention(encoder_layer, mask_arg="src_mask", convention="mha_blocked", d_model=64,
                                  num_heads=4))
    audit(adapters.mha_key_padding(nn.MultiheadAttention(64, 4)))  # padding through key_padding_mask
    audit(adapters.image(scalable_self_attention))  # a layer over (B, C, H, W) pixels, its tokens laid out as an image

A layer that relies on its parent model to build the causal mask (every Hugging Face decoder attention in
eager mode) is not causal on its own: audited alone, `pass_mask=False`, it is reported as leaking, which
is true of the layer; audited with `pass_mask=True` it gets the causal mask its model would pass.
"""

from __future__ import annotations

import math
from collections import Counter

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ._errors import ProbeNotTaken, expect
from ._masks import SHORTCUTS, MaskConvention, convert_mask, mask_convention

CONVENTIONS = tuple(SHORTCUTS)
"""The shortcut spellings of mask conventions; any `MaskConvention` or MEANING:SHAPE (`additive:B,Tq,Tk`) works too
(`diagnostics._masks`, where `convert_mask` lives: the one conversion the audit and these adapters share)."""


def function(fn: Callable, *, mask_arg: str = "attn_mask", convention: str = "allowed", **fixed) -> Callable:
    """`f(q, k, v, mask=None)` calling `fn(q, k, v, **{mask_arg: mask in convention}, **fixed)`.

    For attention functions whose mask argument is named or encoded differently from the audit's
    (`mask`, `attn_mask` or `attention_mask`, bool True = may attend), e.g. an additive float mask:
    `adapters.function(my_attention, mask_arg="bias", convention="additive")`.
    `fixed`: further keyword arguments passed on every call, e.g. `scale=0.5`.
    """
    expect(callable(fn), "a function f(q, k, v, ...)", type(fn).__name__, "pass the function itself")
    mask_convention(convention, spelled="convention=")  # validates the convention

    def adapted(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None):
        kwargs = dict(fixed)
        if mask is not None:
            kwargs[mask_arg] = convert_mask(mask, convention, dtype=q.dtype, num_heads=q.shape[1])
        return fn(q, k, v, **kwargs)

    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    adapted.__qualname__ = adapted.__name__ = f"{name} [{mask_arg}: {convention}]"
    return adapted


class SelfAttention(nn.Module):
    """A self-attention module `m(x, <mask_arg>=..., **extra)` seen by the audit as `m(x, mask=None)`.

    `mask_arg=None` calls the layer alone, `m(x)`, with no mask ever: what the layer does on its own.
    `extra(x)` returns further keyword arguments for each call (rotary position embeddings, say).
    The wrapped layer is a submodule, so the audit's eval mode and restoration of state reach it.
    """

    def __init__(self, layer: nn.Module, *, mask_arg: str | None = "attn_mask", convention: str = "allowed",
                 d_model: int, num_heads: int = 1, extra: Callable[[Tensor], dict] | None = None,
                 name: str | None = None, **fixed):
        super().__init__()
        expect(isinstance(layer, nn.Module), "an nn.Module", type(layer).__name__,
               "wrap functions with adapters.function(...)")
        mask_convention(convention, spelled="convention=")  # validates the convention
        self.layer, self.mask_arg, self.convention = layer, mask_arg, convention
        self.d_model, self.num_heads = d_model, num_heads
        self.extra, self.fixed = extra, fixed
        self.audit_name = name or f"{type(layer).__qualname__} [{mask_arg or 'no mask'}: {convention}]"

    def forward(self, x: Tensor, mask: Tensor | None = None):
        kwargs = dict(self.fixed)
        if self.extra is not None:
            kwargs.update(self.extra(x))
        if mask is not None and self.mask_arg is not None:
            kwargs[self.mask_arg] = convert_mask(mask, self.convention, dtype=x.dtype, num_heads=self.num_heads)
        return self.layer(x, **kwargs)


class _Alone(SelfAttention):
    """`SelfAttention` with `mask_arg=None`: its forward takes no mask, so the audit passes none."""

    def forward(self, x: Tensor):
        return super().forward(x)


def self_attention(layer: nn.Module, *, mask_arg: str | None = "attn_mask", convention: str = "allowed",
                   d_model: int, num_heads: int = 1, extra: Callable[[Tensor], dict] | None = None,
                   name: str | None = None, **fixed) -> SelfAttention:
    """Wrap a self-attention module whose mask argument is named `mask_arg` and encoded in `convention`.

        adapters.self_attention(nn.TransformerEncoderLayer(32, 4, batch_first=True), mask_arg="src_mask",
                                convention="mha_blocked", d_model=32, num_heads=4)

    `mask_arg=None`: the layer alone, never given a mask (`m(x)`); `fixed`: keyword arguments for every call.
    """
    cls = SelfAttention if mask_arg is not None else _Alone
    return cls(layer, mask_arg=mask_arg, convention=convention, d_model=d_model, num_heads=num_heads,
               extra=extra, name=name, **fixed)


class Image(nn.Module):
    """An attention over an image's pixels, `m(images)` on (B, C, H, W) with its projections convolutions (vit-pytorch's
    ScalableSelfAttention and Twins' GlobalAttention, a UNet's attention block), seen by the audit as a layer over
    tokens, `m(x)` on (B, T, C): each probe's T tokens laid out row by row as an H x W image, H the largest divisor of
    T up to sqrt(T) (or `height`, which must divide every length audited), and the output read back as tokens in the
    same order. Nothing else changes. A probe whose image is smaller than a convolution can take is not taken, with
    that reason, before the layer is called; a layer whose keys are strided convolutions needs images of at least two
    kernels a side to leave more than one key, so audit it at `image_seq_len(layer)` (196 for a 7 x 7 kernel)."""

    def __init__(self, layer: nn.Module, *, channels: int | None = None, height: int | None = None):
        super().__init__()
        expect(isinstance(layer, nn.Module), "an nn.Module", type(layer).__name__, "pass the attention module itself")
        channels = channels if channels is not None else image_channels(layer)
        expect(channels is not None, "an attention whose first convolution states its channels, or channels=C",
               f"{type(layer).__name__} with no nn.Conv2d", "pass channels=... (the C of its (B, C, H, W) input)")
        expect(height is None or (isinstance(height, int) and height >= 1), "height an int >= 1, or None",
               f"height={height!r}", "pass the images' height in pixels, or leave it out")
        self.layer, self.d_model, self.height = layer, channels, height
        self.side = image_side(layer)  # the smallest image side every convolution of the layer takes
        self.audit_name = f"{type(layer).__qualname__} [tokens as an image]"

    def forward(self, x: Tensor):
        B, T, C = x.shape  # batch, tokens, channels
        expect(self.height is None or T % self.height == 0, f"a length that height={self.height} divides",
               f"{T} tokens", "leave height out (each length is laid out as its own squarest image)")
        h = self.height or max(d for d in range(1, int(T ** 0.5) + 1) if T % d == 0)
        if min(h, T // h) < self.side:  # smaller than a convolution of the layer takes: not the layer's defect
            raise ProbeNotTaken(f"{T} tokens make a {h} x {T // h} image, smaller than {self.side} x {self.side}, "
                                f"the least the layer's convolutions take: audit with "
                                f"seq_len={image_seq_len(self.layer) or self.side * self.side} or more")
        out = self.layer(x.transpose(1, 2).reshape(B, C, h, T // h))  # (B, C, H, W), row by row
        return out.flatten(2).transpose(1, 2)  # (B, T, C') in the same order


def image(layer: nn.Module, *, channels: int | None = None, height: int | None = None) -> Image:
    """Audit an attention over an image's pixels, (B, C, H, W), as one over tokens (see `Image`)."""
    return Image(layer, channels=channels, height=height)


def image_channels(layer: nn.Module) -> int | None:
    """The channels of the images a layer takes, as its nn.Conv2d modules state them: the in_channels most of them
    take (q's, k's and v's projections; a depthwise convolution of the values over the inner width, registered first in
    ScalableViT's windowed attention, is one), the first of those where as many take another; None where it has none."""
    counts = Counter(m.in_channels for m in layer.modules() if isinstance(m, nn.Conv2d))
    return max(counts, key=counts.__getitem__) if counts else None  # ties: the first seen (Counter keeps order)


def image_side(layer: nn.Module) -> int:
    """The smallest image side each nn.Conv2d of the layer takes: its dilated kernel less its padding on both sides."""
    sides = [m.dilation[i] * (m.kernel_size[i] - 1) + 1 - 2 * (m.padding[i] if isinstance(m.padding, tuple) else 0)
             for m in layer.modules() if isinstance(m, nn.Conv2d) for i in (0, 1)]
    return max([1, *sides])


def image_seq_len(layer: nn.Module) -> int | None:
    """The length to audit an attention over pixels at, where the default's 4 x 4 image is too small: images of two
    of its largest kernels a side, so that a key convolution of that stride (Twins' GlobalAttention) leaves 2 x 2
    keys, the side rounded up to a multiple of each window the layer's modules hold (`window_size`: ScalableViT's
    windowed attention asserts that its windows divide the map); None where a kernel of 2 or less leaves the default
    enough (16 tokens)."""
    kernel = max((max(m.kernel_size) for m in layer.modules() if isinstance(m, nn.Conv2d)), default=1)
    side = 2 * kernel
    for window in {w for m in layer.modules() for w in [getattr(m, "window_size", None)]
                   if isinstance(w, int) and not isinstance(w, bool) and w > 1}:
        side = math.lcm(side, window) if side % window else side
    return side * side if side * side > 16 else None


class KeyPaddingMHA(nn.Module):
    """nn.MultiheadAttention given the audit's mask through `key_padding_mask` where it can be.

    Keys that no query of a batch row may attend go to `key_padding_mask` (B, Tk), True = padding; what
    key padding cannot express (a causal pattern, a single blocked query) goes to `attn_mask`
    (B*H, Tq, Tk), True = blocked. Both are torch's conventions, the opposite of SDPA's.
    """

    def __init__(self, mha: nn.MultiheadAttention, *, need_weights: bool = True):
        super().__init__()
        expect(isinstance(mha, nn.MultiheadAttention), "a torch.nn.MultiheadAttention", type(mha).__name__,
               "use adapters.self_attention(...) for other modules")
        self.mha, self.need_weights = mha, need_weights
        self.embed_dim, self.num_heads = mha.embed_dim, mha.num_heads
        self.audit_name = "MultiheadAttention [key_padding_mask + attn_mask: blocked]"

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None):
        padding = attn_mask = None
        if mask is not None:
            blocked = ~mask[:, 0]  # (B, Tq, Tk), True = blocked
            padding = blocked.all(dim=1)  # (B, Tk): keys no query may attend
            rest = blocked & ~padding.unsqueeze(1)  # (B, Tq, Tk): what key padding does not cover
            if rest.any():
                attn_mask = rest.repeat_interleave(self.mha.num_heads, dim=0)  # (B*H, Tq, Tk)
        if not self.mha.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))  # (T, B, D)
        out, weights = self.mha(query, key, value, key_padding_mask=padding, attn_mask=attn_mask,
                                need_weights=self.need_weights, average_attn_weights=False)
        if not self.mha.batch_first:
            out = out.transpose(0, 1)  # (B, Tq, D)
        return out, weights


def mha_key_padding(mha: nn.MultiheadAttention, *, need_weights: bool = True) -> KeyPaddingMHA:
    """Audit nn.MultiheadAttention through its `key_padding_mask` argument (see `KeyPaddingMHA`)."""
    return KeyPaddingMHA(mha, need_weights=need_weights)


def huggingface(module: nn.Module, *, rotary: nn.Module | None = None, pass_mask: bool = True) -> SelfAttention:
    """A Hugging Face transformers self-attention module (BertSelfAttention, GPT2Attention, LlamaAttention
    and their kin), called as its parent model calls it.

    - Masks go to `attention_mask` in the form the parent model builds: an additive float mask (0 keep,
      torch.finfo(dtype).min block) for `attn_implementation="eager"`, a bool mask (True = keep) for "sdpa".
      Other implementations are refused: their masks differ again.
    - `rotary`: the model's rotary embedding (e.g. `LlamaRotaryEmbedding(config)`), called as
      `rotary(x, position_ids)` with positions 0..T-1 to supply `position_embeddings=(cos, sin)`.
    - `pass_mask=False`: the layer alone, called with no mask at all. In eager mode no HF attention builds
      a causal mask itself (its model does), so a decoder layer audited alone as causal leaks the future.
    """
    config = getattr(module, "config", None)
    expect(config is not None and hasattr(config, "hidden_size"),
           "a Hugging Face attention module with a .config (hidden_size, num_attention_heads)",
           type(module).__name__, "pass the attention submodule itself, e.g. model.h[0].attn")
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    expect(implementation in ("eager", "sdpa"), 'attn_implementation "eager" or "sdpa"', repr(implementation),
           'build the config with attn_implementation="eager" (weights returned) or "sdpa"')
    convention = "additive" if implementation == "eager" else "allowed"
    extra = None
    if rotary is not None:
        def extra(x: Tensor) -> dict:
            B, T = x.shape[:2]  # batch, sequence length
            positions = torch.arange(T, device=x.device).expand(B, T)  # (B, T)
            return {"position_embeddings": rotary(x, positions)}  # (cos, sin), each (B, T, head_dim)

    wrapper = self_attention(module, mask_arg="attention_mask" if pass_mask else None, convention=convention,
                             d_model=config.hidden_size, num_heads=config.num_attention_heads, extra=extra,
                             name=f"{type(module).__qualname__} [{implementation}, "
                                  f"{'attention_mask: ' + convention if pass_mask else 'alone, no mask'}]")
    if rotary is not None:
        wrapper.rotary = rotary  # a submodule: moved, restored and put in eval mode with the layer
    return wrapper


__all__ = ["CONVENTIONS", "Image", "KeyPaddingMHA", "MaskConvention", "SelfAttention", "convert_mask", "function",
           "huggingface", "image", "image_channels", "image_seq_len", "image_side", "mask_convention",
           "mha_key_padding", "self_attention"]
