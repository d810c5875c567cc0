"""Tiny GPTs for the model audit, and the teaching report's model chapter.

`TinyGPT`: nanoGPT's model file in miniature, its attention the reference `correct.MultiHeadAttention(causal=True)`,
so that any catalog variant can be swapped into one layer (`inject(model, layer, variant)`).

`ProtocolGPT`: a decoder with the keyword protocol `diagnostics.audit_model` uses for plain models (Hugging Face's:
`forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False)`, returning
logits, or `(logits, cache)` with `use_cache=True`), learned or rotary positions, an optional sliding window, and
the model-level bugs of public reports, each switchable into one layer (`layer_bugs`) or into the model
(`model_bug`):

- `prefill_unmasked` (layer): with a cache attached, a prefill of several tokens skips the causal mask
  (TinyLLM #17, Qwen #979);
- `rotary_no_offset` (layer): rotary positions 0..Tq-1 for the new tokens, not offset by the cache length
  (executorch PR #2010);
- `window_off_by_one` (layer): the sliding window lets w + 1 keys in, not w (NeMo PR #9672, mlx-lm PR #390);
- `positions_ignore_padding` (model): position ids 0..T-1 whatever the attention mask, so left padding shifts
  every real token's position (unsloth #3699, nnsight PR #673).

The model chapter of the teaching report (`model_chapter_html`) audits a TinyGPT with one catalog bug in one layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from correct import MultiHeadAttention

LAYER_BUGS = ("prefill_unmasked", "rotary_no_offset", "window_off_by_one")
MODEL_BUGS = ("positions_ignore_padding",)


# ---- TinyGPT: the reference attention in nanoGPT's frame --------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads, causal=True)
        self.mlp = MLP(d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))[0]  # (B, T, D); the reference returns (out, weights)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token and learned position embeddings, `n_layer` pre-norm blocks, a language-model head."""

    causal = True

    def __init__(self, vocab_size: int = 64, n_layer: int = 3, d_model: int = 32, num_heads: int = 4,
                 block_size: int = 32):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, d_model), nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList(Block(d_model, num_heads) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape  # batch, sequence length
        x = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))  # (B, T, D)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def inject(model: TinyGPT, layer: int, variant) -> TinyGPT:
    """Swap the attention of block `layer` for the catalog variant's layer, with the same weights."""
    old = model.h[layer].attn
    new = variant.build(old.d_model, old.num_heads, causal=True)
    new.load_state_dict(old.state_dict())
    model.h[layer].attn = new
    return model


# ---- ProtocolGPT: padding, positions, a cache and a sliding window -----------------------------------------


def rotate(x: Tensor, positions: Tensor) -> Tensor:
    """Rotary embedding of (B, H, T, d) at integer positions (B, T) (RoFormer; halves rotated)."""
    d = x.shape[-1]
    freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # (d/2,)
    angle = positions.to(torch.float32).unsqueeze(-1) * freq  # (B, T, d/2)
    cos, sin = angle.cos().unsqueeze(1).to(x.dtype), angle.sin().unsqueeze(1).to(x.dtype)  # (B, 1, T, d/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class ProtocolAttention(nn.Module):
    """Causal self-attention over a cache: keys are the cached ones then the new ones; query i (absolute position
    past + i) may attend key j when j <= past + i, the key is not padding, and, with a window w, past + i - j < w."""

    def __init__(self, d_model: int, num_heads: int, *, rotary: bool, sliding_window: int | None, bug: str | None):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.rotary, self.sliding_window, self.bug = rotary, sliding_window, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, positions: Tensor, keep: Tensor, cache: list | None = None) -> Tensor:
        """x (B, Tq, D); positions (B, Tq); keep (B, Tk) 1 = a real key (the cache's and the new ones); cache: a
        list [k, v] for this layer (empty before the prefill), extended in place, or None."""
        B, T, D = x.shape  # batch, new tokens, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, H, T, d)
        if self.rotary:
            at = torch.arange(T, device=x.device).expand(B, T) if self.bug == "rotary_no_offset" else positions
            q, k = rotate(q, at), rotate(k, at)
        past = 0
        if cache is not None:
            if cache:
                past = cache[0].shape[2]
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)  # (B, H, past + T, d)
            cache[:] = [k, v]
        Tk = k.shape[2]
        i = torch.arange(T, device=x.device).view(T, 1) + past  # absolute query positions
        j = torch.arange(Tk, device=x.device).view(1, Tk)
        allowed = j <= i  # (T, Tk)
        if self.bug == "prefill_unmasked" and cache is not None and past == 0 and T > 1:
            allowed = torch.ones_like(allowed)  # the bug: a prefill through the cache without its causal mask
        if self.sliding_window is not None:
            w = self.sliding_window + (1 if self.bug == "window_off_by_one" else 0)
            allowed = allowed & (i - j < w)
        allowed = allowed & keep.bool().view(B, 1, 1, Tk)  # (B, 1, T, Tk)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, Tk)
        # finfo.min, not -inf: a padding query with no real key gets uniform weights, not NaN
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = scores.softmax(-1) @ v  # (B, H, T, d)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


class ProtocolBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, **kw):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = ProtocolAttention(d_model, num_heads, **kw), MLP(d_model)

    def forward(self, x, positions, keep, cache=None):
        x = x + self.attn(self.ln_1(x), positions, keep, cache)
        return x + self.mlp(self.ln_2(x))


class ProtocolGPT(nn.Module):
    causal = True

    def __init__(self, vocab_size: int = 64, n_layer: int = 3, d_model: int = 32, num_heads: int = 4,
                 block_size: int = 32, *, rotary: bool = False, sliding_window: int | None = None,
                 layer_bugs: dict | None = None, model_bug: str | None = None):
        super().__init__()
        layer_bugs = layer_bugs or {}
        assert set(layer_bugs.values()) <= set(LAYER_BUGS) and model_bug in (None, *MODEL_BUGS)
        self.block_size, self.rotary, self.model_bug = block_size, rotary, model_bug
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = None if rotary else nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList(ProtocolBlock(d_model, num_heads, rotary=rotary, sliding_window=sliding_window,
                                             bug=layer_bugs.get(n)) for n in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: list | None = None, use_cache: bool = False):
        B, T = input_ids.shape  # batch, new tokens
        past = past_key_values[0][0].shape[2] if past_key_values and past_key_values[0] else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=input_ids.device)
        elif attention_mask.shape[1] == T and past:
            attention_mask = torch.cat([torch.ones(B, past, dtype=attention_mask.dtype, device=input_ids.device),
                                        attention_mask], 1)
        if position_ids is None or self.model_bug == "positions_ignore_padding":
            position_ids = (past + torch.arange(T, device=input_ids.device)).expand(B, T)
        x = self.wte(input_ids)  # (B, T, D)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        cache = (past_key_values or [[] for _ in self.h]) if use_cache else None
        for n, block in enumerate(self.h):
            x = block(x, position_ids, attention_mask, None if cache is None else cache[n])
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return (logits, cache) if use_cache else logits
