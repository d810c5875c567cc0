"""Declared attention patterns: which keys each query may see, stated as FlexAttention states it.

A `Pattern` is a `mask_mod`, a function `(b, h, q_idx, kv_idx) -> bool` of index tensors made of tensor ops
(the signature of `torch.nn.attention.flex_attention.create_block_mask`'s `mask_mod`), so that one
statement serves both the audit (`audit(layer, pattern=sliding_window(4))`) and a FlexAttention program.
Positions are absolute: in `allowed(B, Tq, Tk)` the Tq queries are the last Tq of the Tk positions
(bottom-right, as the audit's causal mask and cached decoding align them).

    causal()                 kv <= q
    sliding_window(W)        q - W < kv <= q: W keys, the query's own included (Mistral's and Gemma's
                             convention; a window of W + 1 or W - 1 is the off-by-one bug)
    chunked(C)               q // C == kv // C and kv <= q: causal inside chunks of C positions (Llama 4)
    prefix_lm(P)             kv < P or kv <= q: a bidirectional prefix of P positions, causal after it
    document(ids)            ids[b, q] == ids[b, kv]: block-diagonal over packed documents (not causal:
                             write document(ids) & causal() for a packed decoder)
    a & b, a | b             both allow, either allows

Ground floor: torch only.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._errors import expect


class Pattern:
    """A named `mask_mod`. Call it like one; `allowed(B, Tq, Tk)` builds the bool (B, Tq, Tk) mask, True = may
    attend; `&` and `|` combine patterns (or a pattern and a bare `mask_mod`). `rule`: the mask_mod as one line of
    code over `q_idx` and `kv_idx` (absolute positions), for fixes to quote; None for a bare mask_mod."""

    def __init__(self, mask_mod: Callable, name: str, rule: str | None = None):
        expect(callable(mask_mod), "a mask_mod(b, h, q_idx, kv_idx) -> bool tensor", f"{mask_mod!r}",
               "pass e.g. lambda b, h, q, kv: kv <= q, or a named pattern such as sliding_window(4)")
        self.mask_mod, self.name, self.rule = mask_mod, name, rule

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mask_mod(b, h, q_idx, kv_idx)

    def __and__(self, other) -> "Pattern":
        other = as_pattern(other)
        a, o = self.mask_mod, other.mask_mod
        return Pattern(lambda b, h, q, kv: a(b, h, q, kv) & o(b, h, q, kv), f"({self.name} & {other.name})",
                       _joined(self, other, "&"))

    def __or__(self, other) -> "Pattern":
        other = as_pattern(other)
        a, o = self.mask_mod, other.mask_mod
        return Pattern(lambda b, h, q, kv: a(b, h, q, kv) | o(b, h, q, kv), f"({self.name} | {other.name})",
                       _joined(self, other, "|"))

    __rand__, __ror__ = __and__, __or__

    def __repr__(self) -> str:
        return self.name

    def allowed(self, batch: int, t_q: int, t_k: int, *, heads: int = 1) -> Tensor:
        """Bool (B, Tq, Tk), True = may attend, query i at absolute position i + Tk - Tq (bottom-right); with
        `heads` > 1, (B, H, Tq, Tk). Index tensors broadcast, so the mask_mod runs once on the whole grid."""
        b = torch.arange(batch).view(batch, 1, 1, 1)  # (B, 1, 1, 1)
        h = torch.arange(heads).view(1, heads, 1, 1)  # (1, H, 1, 1)
        q = (torch.arange(t_q) + (t_k - t_q)).view(1, 1, t_q, 1)  # (1, 1, Tq, 1): the last Tq positions
        kv = torch.arange(t_k).view(1, 1, 1, t_k)  # (1, 1, 1, Tk)
        out = self.mask_mod(b, h, q, kv)
        expect(isinstance(out, Tensor) and out.dtype == torch.bool, "a mask_mod that returns a bool tensor",
               f"{type(out).__name__}" + (f" of dtype {out.dtype}" if isinstance(out, Tensor) else ""),
               "return a comparison such as kv <= q (combine with & and |, not `and` / `or`)")
        out = out.expand(batch, heads, t_q, t_k)  # (B, H, Tq, Tk)
        return (out[:, 0] if heads == 1 else out).clone()


def _joined(a: Pattern, b: Pattern, op: str) -> str | None:
    return None if a.rule is None or b.rule is None else f"({a.rule}) {op} ({b.rule})"


def as_pattern(x) -> Pattern:
    """A `Pattern` as it is, a bare mask_mod named after its function."""
    if isinstance(x, Pattern):
        return x
    expect(callable(x), "a Pattern or a mask_mod(b, h, q_idx, kv_idx) -> bool tensor", f"{x!r}",
           "pass e.g. diagnostics.patterns.sliding_window(4) or lambda b, h, q, kv: kv <= q")
    return Pattern(x, getattr(x, "__name__", "mask_mod"))


def _positive(name: str, n) -> int:
    expect(isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"an int {name} >= 1", f"{name}={n!r}",
           f"pass the number of positions, e.g. {name}=4")
    return n


def causal() -> Pattern:
    return Pattern(lambda b, h, q, kv: kv <= q, "causal()", "kv_idx <= q_idx")


def sliding_window(W: int) -> Pattern:
    """W keys including the query's own: q - W < kv <= q. (A layer that counts W keys *back*, q - W <= kv,
    sees W + 1; one that stops at q - W + 1 < kv sees W - 1.)"""
    W = _positive("W", W)
    return Pattern(lambda b, h, q, kv: (kv <= q) & (q - kv < W), f"sliding_window({W})",
                   f"(kv_idx <= q_idx) & (q_idx - kv_idx < {W})")


def chunked(C: int) -> Pattern:
    """Causal inside chunks of C positions: keys of the query's own chunk, up to the query."""
    C = _positive("C", C)
    return Pattern(lambda b, h, q, kv: (kv <= q) & (q // C == kv // C), f"chunked({C})",
                   f"(kv_idx <= q_idx) & (q_idx // {C} == kv_idx // {C})")


def prefix_lm(P) -> Pattern:
    """Every query sees the first P positions (the prefix, bidirectional) and, after it, causally. `P`: an int,
    or one per sequence, a (B,) tensor (sequence b of a probe uses P[b % len(P)])."""
    if isinstance(P, Tensor):
        expect(P.dim() == 1 and P.numel() >= 1 and not P.is_floating_point(), "a (B,) integer tensor of prefix lengths",
               f"shape {tuple(P.shape)}, dtype {P.dtype}", "pass torch.tensor([3, 5]) for two sequences")
        lengths = P.clone()

        def prefix(b, h, q, kv):
            return (kv <= q) | (kv < lengths.to(b.device)[b % lengths.numel()])

        return Pattern(prefix, f"prefix_lm({lengths.tolist()})", "(kv_idx <= q_idx) | (kv_idx < prefix_length[b])")
    P = _positive("P", P)
    return Pattern(lambda b, h, q, kv: (kv <= q) | (kv < P), f"prefix_lm({P})", f"(kv_idx <= q_idx) | (kv_idx < {P})")


def document(ids) -> Pattern:
    """Block-diagonal over packed documents: q and kv in the same document. `ids`: document ids per position,
    (T,) for every sequence or (B, T) per sequence (sequence b of a probe uses row b % B); positions past the
    end belong to the last document."""
    ids = torch.as_tensor(ids)
    expect(ids.dim() in (1, 2) and ids.shape[-1] >= 1 and not ids.is_floating_point(),
           "document ids as a (T,) or (B, T) integer tensor", f"shape {tuple(ids.shape)}, dtype {ids.dtype}",
           "pass e.g. torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])")
    table = (ids if ids.dim() == 2 else ids.unsqueeze(0)).clone()  # (Bd, T)
    n, L = table.shape

    def same_document(b, h, q, kv):
        t = table.to(b.device)
        rows = b % n
        return t[rows, q.clamp(max=L - 1)] == t[rows, kv.clamp(max=L - 1)]

    shown = table[0].tolist() if n == 1 else table.tolist()
    return Pattern(same_document, f"document({shown})", "document_id[b, q_idx] == document_id[b, kv_idx]")


__all__ = ["Pattern", "as_pattern", "causal", "chunked", "document", "prefix_lm", "sliding_window"]
