"""Whether a model is causal: what it declares, else what its attention layers do.

Declarations, strongest first: the caller's `causal=`; the config's own flags (`is_decoder`, and `causal` /
`is_causal` given as a bool: a `*WithLMHeadModel` whose config says `causal=False` is a masked LM; an attention
type named bidirectional, XLNet's `attn_type="bi"`); a true
`model.causal` / `model.is_causal`; the class's family (`*ForCausalLM`, `*LMHeadModel`); an encoder-decoder, whose
decoder is causal.

Next, the layers' own declaration (read once they are found): self-attention layers that all say
`is_causal = True` (Hugging Face's decoder layers: a vision-language model's text decoder) make the model causal.
An encoder-decoder whose decoder self-attention layers all say `is_causal = False` (a non-autoregressive decoder)
is not causal: the layers' own declaration overrules the family's. What a layer does never overrules a
declaration: a bug that drops the causal mask of a one-layer decoder must not make it "not causal".

Where nothing declares it (a plain nanoGPT `GPT`, whose layers carry no `is_causal`), each
self-attention layer audited in place is measured on its own (`masks_future`): the same random input twice, every
position after the middle changed the second time; a layer whose past outputs stay put while its later ones move
masks the future itself. When most measured layers do, the model is causal, and a layer that does not is the
finding: its own audit, as a causal layer, points at the line.
"""

from __future__ import annotations

import math
import re

import torch

from .._errors import expect
from .._guard import seed_rng
from .._registry import phrase
from .._subject import MASK_NAMES
from .._thresholds import UNCHANGED, tolerance
from ._taps import moved

CAUSAL_CLASS = re.compile(r"CausalLM|LMHeadModel")
ATTENTION_KIND = ("attn_type", "attention_type")
BIDIRECTIONAL = ("bi", "bidirectional")
# an additive mask blocks a key where the key's weight beside one of bias 0, exp(bias), is under float32's resolution:
# finfo.min (Hugging Face's now), -10000.0 (older code's), -1e9 (T5's); half the dtype's minimum read -10000.0 as
# allowed, so a causal model's own causal mask made its `is_causal = True` layers read as not causal
BLOCKED = math.log(torch.finfo(torch.float32).eps)  # -15.9
"""A config that names its attention bidirectional (XLNet's `attn_type="bi"`, a permutation LM whose attention,
without a permutation mask, sees both ways, although its class is an `*LMHeadModel`) is not causal."""


def declared_causal(model, causal, runner) -> tuple[bool | None, str]:
    """(True / False, how the model declares it), or (None, "") where nothing does; an encoder-decoder is
    (True, ...), unless its decoder layers say otherwise (`infer_causal`)."""
    if causal is not None:
        expect(isinstance(causal, bool), "causal=True, False or None", f"causal={causal!r}", "pass a bool")
        return causal, "as given"
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_decoder", False) is True:
        return True, "inferred: config.is_decoder"
    for attr in ("causal", "is_causal"):
        value = getattr(config, attr, None) if config is not None else None
        if isinstance(value, bool):
            return value, f"inferred: config.{attr} is {value}"
    for attr in ATTENTION_KIND:
        value = getattr(config, attr, None) if config is not None else None
        if isinstance(value, str) and value.lower() in BIDIRECTIONAL:
            return False, f"inferred: config.{attr} is {value!r} (bidirectional)"
    for attr in ("causal", "is_causal"):
        if getattr(model, attr, None) is True:
            return True, f"inferred: model.{attr} is True"
    name = type(model).__name__
    if CAUSAL_CLASS.search(name):
        return True, f"inferred: {name} is a causal LM"
    if runner.encoder_decoder and runner.takes("decoder_input_ids"):
        return True, "inferred: an encoder-decoder, whose decoder is causal (the decoder inputs are what changes)"
    # an encoder-decoder that takes no decoder inputs (FastSpeech 2: its decoder reads the encoder's output, stretched
    # by durations) generates nothing token by token: nothing declares it causal, its layers are measured
    return None, ""


def masks_future(layer, T: int, D: int, dtype, seed: int) -> bool | None:
    """Whether a self-attention layer (a `forward(x)` wrapper taking (1, T, D)) masks the future itself: changing
    every input after the middle leaves the outputs up to it unchanged and moves a later one. None where the later
    outputs did not move either (nothing measured) or the layer raised."""
    gen = torch.Generator().manual_seed(seed + 29)
    x = torch.randn(1, T, D, generator=gen)
    other = x.clone()
    c = T // 2
    other[:, c + 1:] = torch.randn(1, T - c - 1, D, generator=gen)
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))
    outs = []
    try:
        with torch.no_grad():
            for inp in (x, other):
                seed_rng(seed, device)  # the same dropout draws for both
                out = layer(inp.to(device, dtype))
                if not isinstance(out, torch.Tensor) or out.dim() < 3 or out.shape[1] != T:  # (1, T, features)
                    return None
                outs.append(out.float())
    except Exception:  # a layer that cannot take the probe tells nothing about its masking
        return None
    change = moved(outs[1], outs[0])[0]  # (T,)
    tol = tolerance(UNCHANGED, dtype)
    if not bool((change[c + 1:] > tol).any()):
        return None
    return not bool((change[:c + 1] > tol).any())


def _future_allowed(wrapper) -> bool:
    """Whether the model passes the layer a 4-D mask, (B, 1, Tq or 1, T), that lets some query attend a later key: the
    model's own mask then decides, and it is not causal, whatever the layer's `is_causal` says (Hugging Face's eager
    and sdpa paths apply `is_causal` only where no mask is given). LightGlue's matcher says is_causal = True (copied
    from Llama) and passes every layer its keypoints' (B, 1, 1, T) padding mask: audited as causal, its correct
    layers failed future_leakage. A 2-D padding mask says nothing (flash attention applies both)."""
    T = wrapper.block_size
    for name, value in getattr(wrapper, "call_arguments", {}).items():  # a wrapper that holds no call: none passed
        # T = 1 needs no guard: no key lies after the one query, and the empty triu(1) below reads False
        if name not in MASK_NAMES or not isinstance(value, torch.Tensor) or value.dim() != 4 or \
                value.shape[-1] != T or value.shape[-2] not in (1, T):
            continue
        m = value.detach()
        # boolean: True marks a key allowed (Hugging Face's); additive: blocked keys very negative (`BLOCKED`); else 0
        # blocks
        allowed = m if m.dtype == torch.bool else m > BLOCKED if m.is_floating_point() else m != 0
        allowed = allowed.expand(*allowed.shape[:-2], T, T)
        if bool(allowed.triu(1).any()):
            return True
    return False


def infer_causal(model, causal, runner, wrappers: dict, *, T: int, dtype, seed: int,
                 options: dict | None = None) -> tuple[bool, str]:
    """Whether the model is causal, and how that was decided (as given, declared by what, measured on how many
    layers, or assumed not). `wrappers`: {path: in-place layer}, the self-attention ones measured."""
    said, source = declared_causal(model, causal, runner)
    if said is not None and runner.encoder_decoder and source.startswith("inferred: an encoder-decoder"):
        decoder = [w.inner for p, w in wrappers.items() if w.is_self_attention() and ".decoder." in f".{p}."]
        if decoder and all(getattr(m, "is_causal", None) is False for m in decoder):
            return False, (f"inferred: an encoder-decoder whose {len(decoder)} decoder self-attention layers say "
                           f"is_causal = False (a non-autoregressive decoder)")
    if said is not None:
        return said, source
    own = [w for w in wrappers.values() if w.is_self_attention()]
    if own and all(getattr(w.inner, "is_causal", None) is True and not _future_allowed(w) for w in own):
        return True, f"inferred: its {len(own)} self-attention layers say is_causal = True"
    readings = {p: masks_future(w, T, w.d_model, dtype, seed) for p, w in wrappers.items()
                if w.is_self_attention() and w.block_size == T}
    measured = {p: m for p, m in readings.items() if m is not None}
    masking = [p for p, m in measured.items() if m]
    where = "attention layers"
    if measured and 2 * len(masking) > len(measured):
        text = f"measured: {len(masking)} of {len(measured)} {where} mask the future themselves"
        if len(masking) < len(measured):
            text += f" ({', '.join(p for p in measured if p not in masking)} does not: audited as causal)"
        return True, text
    return False, phrase("assumed: nothing says the model is causal; pass {causal} if it is", options)


__all__ = ["CAUSAL_CLASS", "declared_causal", "infer_causal", "masks_future"]
