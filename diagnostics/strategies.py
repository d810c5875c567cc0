"""Hypothesis strategies for attention property tests: configurations, then q/k/v and masks built from them.

    from hypothesis import given
    from diagnostics.strategies import attention_cases

    @given(case=attention_cases())
    def test_my_attention(case):
        q, k, v = case.qkv(dtype=torch.float64)        # (B, H, Tq, d), (B, H, Tk, d), (B, H, Tk, d_v)
        mask = case.mask()                              # bool (B, 1, Tq, Tk), True = may attend, or None
        ...

Hypothesis draws the small things (sizes, a mask kind, a seed); the tensors are made from the seed, so
examples shrink well and a failure replays exactly. `attention_configs()` draws layer configurations to
build and audit your own layer across sizes:

    @given(cfg=attention_configs(causal=True))
    def test_my_layer_passes_the_audit(cfg):
        torch.manual_seed(cfg.seed)
        diagnostics.assert_attention_ok(MyAttention(cfg.d_model, cfg.num_heads), causal=True,
                                        seq_len=cfg.seq_len, seed=cfg.seed)

Requires the `hypothesis` package (extra `test`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor

MASK_KINDS = ("none", "causal_top_left", "causal_bottom_right", "padding", "random", "fully_masked_row")
"""Kinds of mask a case can carry. `padding` blocks trailing keys per batch row; `random` blocks keys at
random but keeps every row non-empty; `fully_masked_row` is random with one query row blocked entirely."""


@dataclass(frozen=True)
class AttentionCase:
    """Sizes, a mask kind and a seed; `qkv()`, `mask()` and `inputs()` make the tensors reproducibly."""

    batch: int
    heads: int
    head_dim: int
    value_dim: int
    t_q: int
    t_k: int
    mask_kind: str
    seed: int

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    def _generator(self, salt: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + salt)

    def qkv(self, *, dtype=torch.float32, device="cpu") -> tuple[Tensor, Tensor, Tensor]:
        """q `(B, H, Tq, d)`, k `(B, H, Tk, d)`, v `(B, H, Tk, d_v)`, standard normal, drawn on the CPU in
        float64 so that every device and dtype sees the same numbers."""
        g = self._generator(1)
        B, H = self.batch, self.heads
        shapes = ((B, H, self.t_q, self.head_dim), (B, H, self.t_k, self.head_dim), (B, H, self.t_k, self.value_dim))
        return tuple(torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for s in shapes)

    def inputs(self, *, dtype=torch.float32, device="cpu") -> tuple[Tensor, Tensor]:
        """Module inputs: query `(B, Tq, D)` and memory `(B, Tk, D)` with D = heads * head_dim."""
        g = self._generator(2)
        make = lambda t: torch.randn(self.batch, t, self.d_model, generator=g, dtype=torch.float64)  # noqa: E731
        return make(self.t_q).to(device=device, dtype=dtype), make(self.t_k).to(device=device, dtype=dtype)

    def mask(self, *, device="cpu") -> Tensor | None:
        """Bool `(B, 1, Tq, Tk)`, True = may attend (torch SDPA's convention), or None for kind `none`."""
        B, t_q, t_k, kind = self.batch, self.t_q, self.t_k, self.mask_kind
        if kind == "none":
            return None
        i = torch.arange(t_q).unsqueeze(-1)  # (Tq, 1)
        j = torch.arange(t_k)  # (Tk,)
        g = self._generator(3)
        if kind == "causal_top_left":
            m = (j <= i).expand(B, 1, t_q, t_k)
        elif kind == "causal_bottom_right":
            m = (j <= i + t_k - t_q).expand(B, 1, t_q, t_k)
        elif kind == "padding":
            lengths = torch.randint(1, t_k + 1, (B,), generator=g)  # at least one key stays
            m = (j < lengths.view(B, 1, 1, 1)).expand(B, 1, t_q, t_k)
        else:
            m = torch.rand(B, 1, t_q, t_k, generator=g) < 0.7
            m[..., torch.randint(0, t_k, (1,), generator=g)] = True  # no row is empty by chance
            if kind == "fully_masked_row":
                m[:, :, torch.randint(0, t_q, (1,), generator=g)] = False
        return m.contiguous().to(device)


@dataclass(frozen=True)
class AttentionConfig:
    """A layer configuration to build and audit: `MyAttention(cfg.d_model, cfg.num_heads)`, then
    `diagnostics.audit(layer, causal=cfg.causal, seq_len=cfg.seq_len, seed=cfg.seed)`."""

    d_model: int
    num_heads: int
    seq_len: int
    causal: bool
    seed: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@st.composite
def attention_configs(draw, *, max_heads: int = 4, max_head_dim: int = 16, max_seq_len: int = 32,
                      causal: bool | None = None) -> AttentionConfig:
    """Draw an `AttentionConfig`: heads, a head width (1 and odd sizes included), so d_model = heads * width;
    a probe length >= 2; causal or not (fixed when `causal` is given); a seed."""
    heads = draw(st.integers(1, max_heads))
    return AttentionConfig(
        d_model=heads * draw(st.integers(1, max_head_dim)),
        num_heads=heads,
        seq_len=draw(st.integers(2, max_seq_len)),
        causal=draw(st.booleans()) if causal is None else causal,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def attention_cases(draw, *, max_batch: int = 3, max_heads: int = 3, max_len: int = 16, max_head_dim: int = 16,
                    mask_kinds: tuple[str, ...] = MASK_KINDS, same_length: bool = False) -> AttentionCase:
    """Draw an `AttentionCase`: batch, heads, head_dim (1 and odd sizes included), Tq != Tk allowed,
    one of `mask_kinds`, and a seed. `same_length=True` forces Tq == Tk (self-attention)."""
    t_q = draw(st.integers(1, max_len))
    return AttentionCase(
        batch=draw(st.integers(1, max_batch)),
        heads=draw(st.integers(1, max_heads)),
        head_dim=draw(st.integers(1, max_head_dim)),
        value_dim=draw(st.integers(1, max_head_dim)),
        t_q=t_q,
        t_k=t_q if same_length else draw(st.integers(1, max_len)),
        mask_kind=draw(st.sampled_from(mask_kinds)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


__all__ = ["MASK_KINDS", "AttentionCase", "AttentionConfig", "attention_cases", "attention_configs"]
