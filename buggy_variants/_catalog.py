"""The broken layers: each is `correct.MultiHeadAttention` with exactly one step overridden.

Read each class next to the method of the same name in `correct/_mha.py`: the difference is the bug.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from correct import MultiHeadAttention, mask_from_mod
from correct import _sdpa


class MissingScale(MultiHeadAttention):
    def scale(self, scores: Tensor) -> Tensor:
        return scores  # the 1/sqrt(d_k) is gone


class ScaledByDModel(MultiHeadAttention):
    def scale(self, scores: Tensor) -> Tensor:
        return scores / math.sqrt(self.d_model)  # the width of all heads, not of one


class NoSoftmax(MultiHeadAttention):
    def softmax(self, scores: Tensor) -> Tensor:
        return scores  # (B, H, Tq, Tk), raw logits used as weights


class MaskAfterSoftmax(MultiHeadAttention):
    def mask_then_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        return self.mask(self.softmax(scores), mask, fill=0.0)  # (B, H, Tq, Tk), kept weights no longer sum to 1


class MissingCausalMask(MultiHeadAttention):
    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        return _sdpa.apply_mask(scores, mask, fill=fill)  # (B, H, Tq, Tk); self.causal is never consulted


class SwappedSelfCross(MultiHeadAttention):
    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        D = self.d_model
        if query is key and key is value:  # self-attention: one fused matmul
            return self.qkv(query).split(D, dim=-1)  # (B, T, 3D) -> 3 x (B, T, D)
        w, b = self.qkv.weight, self.qkv.bias  # (3D, D), (3D,)
        b_q, b_k, b_v = (None, None, None) if b is None else b.split(D)
        w_q, w_k, w_v = w.split(D)  # 3 x (D, D)
        return F.linear(key, w_q, b_q), F.linear(query, w_k, b_k), F.linear(query, w_v, b_v)  # (B, Tk, D), (B, Tq, D), (B, Tq, D)


class NonContiguousView(MultiHeadAttention):
    def merge_heads(self, x: Tensor) -> Tensor:
        B, H, T, d_k = x.shape
        return x.transpose(1, 2).view(B, T, H * d_k)  # (B, H, T, d_k) -> (B, T, H, d_k) -> (B, T, D)


class SoftmaxWrongDim(MultiHeadAttention):
    def softmax(self, scores: Tensor) -> Tensor:
        return torch.softmax(scores, dim=-2)  # (B, H, Tq, Tk), each *column* sums to 1 over queries


class HeadsMergedWithoutTranspose(MultiHeadAttention):
    def merge_heads(self, x: Tensor) -> Tensor:
        B, H, T, d_k = x.shape
        return x.reshape(B, T, H * d_k)  # (B, H, T, d_k) -> (B, T, D), heads and positions interleaved


class MaskPolarityInverted(MultiHeadAttention):
    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        if self.causal:
            t_q, t_k = scores.shape[-2:]
            causal = _sdpa.causal_mask(t_q, t_k, align="bottom_right", device=scores.device)  # (Tq, Tk)
            scores = _sdpa.apply_mask(scores, causal, fill=fill)
        return scores if mask is None else scores.masked_fill(mask, fill)  # True read as "blocked"


class CausalMaskMisaligned(MultiHeadAttention):
    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        if self.causal:
            t_q, t_k = scores.shape[-2:]
            causal = _sdpa.causal_mask(t_q, t_k, align="top_left", device=scores.device)  # (Tq, Tk)
            scores = _sdpa.apply_mask(scores, causal, fill=fill)
        return _sdpa.apply_mask(scores, mask, fill=fill)  # (B, H, Tq, Tk)


class CausalDiagonalMasked(MultiHeadAttention):
    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        if self.causal:
            t_q, t_k = scores.shape[-2:]
            future = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(t_k - t_q)  # (Tq, Tk), diagonal included
            scores = scores.masked_fill(future, fill)
        return _sdpa.apply_mask(scores, mask, fill=fill)  # (B, H, Tq, Tk)


class DropoutInEval(MultiHeadAttention):
    def dropout(self, weights: Tensor) -> Tensor:
        return F.dropout(weights, p=self.dropout_p, training=True)  # random even after model.eval()


class FullyMaskedRowNaN(MultiHeadAttention):
    def softmax(self, scores: Tensor) -> Tensor:
        return torch.softmax(scores, dim=-1)  # (B, H, Tq, Tk); an all -inf row is 0/0 = NaN



# ---- properties the first chapter's detectors did not ask (issue 9) -------------------------------------


class HeadsMergedSequenceFirst(MultiHeadAttention):
    def merge_heads(self, x: Tensor) -> Tensor:
        B, H, T, d_k = x.shape
        return x.permute(2, 0, 1, 3).reshape(B, T, H * d_k)  # (B, H, T, d_k) -> (T, B, H, d_k) -> "(B, T, D)": batch and time interleaved


class KeysFromQueryStream(MultiHeadAttention):
    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        D = self.d_model
        if query is key and key is value:  # self-attention: one fused matmul
            return self.qkv(query).split(D, dim=-1)  # (B, T, 3D) -> 3 x (B, T, D)
        w, b = self.qkv.weight, self.qkv.bias  # (3D, D), (3D,)
        b_q, b_k, b_v = (None, None, None) if b is None else b.split(D)
        w_q, w_k, w_v = w.split(D)  # 3 x (D, D)
        return F.linear(query, w_q, b_q), F.linear(query, w_k, b_k), F.linear(value, w_v, b_v)  # keys from the query stream


class PaddingMaskReplacesCausal(MultiHeadAttention):
    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        if self.causal and mask is None:  # the causal mask is built only when the caller passes none
            t_q, t_k = scores.shape[-2:]
            causal = _sdpa.causal_mask(t_q, t_k, align="bottom_right", device=scores.device)  # (Tq, Tk)
            scores = _sdpa.apply_mask(scores, causal, fill=fill)
        return _sdpa.apply_mask(scores, mask, fill=fill)  # (B, H, Tq, Tk)


class DoubleSoftmax(MultiHeadAttention):
    def softmax(self, scores: Tensor) -> Tensor:
        return _sdpa.safe_softmax(_sdpa.safe_softmax(scores))  # (B, H, Tq, Tk), a softmax of probabilities


class DetachedSoftmax(MultiHeadAttention):
    def softmax(self, scores: Tensor) -> Tensor:
        return _sdpa.safe_softmax(scores).detach()  # (B, H, Tq, Tk), no gradient reaches q and k


class RotaryNotOffset(MultiHeadAttention):
    def positions(self, t_q: int, t_k: int, device=None) -> tuple[Tensor, Tensor]:
        return torch.arange(t_q, device=device), torch.arange(t_k, device=device)  # new queries rotated as 0..Tq-1


# ---- attention patterns beyond causal (issue 19) --------------------------------------------------------


class WindowOneTooLong(MultiHeadAttention):
    def within_window(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= self.sliding_window)  # W + 1 keys: the window counted W *back*


class WindowOneTooShort(MultiHeadAttention):
    def within_window(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.sliding_window - 1)  # W - 1 keys: the query's own counted twice


class WindowOnBothSides(MultiHeadAttention):
    def within_window(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() < self.sliding_window  # |q - kv| < W: W - 1 future keys as well


class ChunkBoundaryOneLate(MultiHeadAttention):
    def within_chunk(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        C = self.attention_chunk_size
        return (kv_idx <= q_idx) & ((q_idx - 1) // C == (kv_idx - 1) // C)  # 1-based: chunks start one late


class DocumentsNotMasked(MultiHeadAttention):
    def same_document(self, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx >= 0  # the document ids are never read: every packed document sees the others


class CausalPrefix(MultiHeadAttention):
    def prefix_lm(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ((kv_idx <= q_idx) | (kv_idx < self.prefix)) & (kv_idx <= q_idx)  # causal on top: no prefix


class WindowDroppedWithCache(MultiHeadAttention):
    def pattern_mask(self, t_q: int, t_k: int, *, batch: int = 1, device=None) -> Tensor | None:
        if (self.sliding_window, self.attention_chunk_size, self.prefix, self.documents) == (None,) * 4:
            return None  # no pattern of its own: the causal mask and the caller's mask only
        pattern = self.pattern if t_k <= t_q else (lambda b, h, q, kv: kv <= q)  # a cache: causal, no window
        return mask_from_mod(pattern, t_q, t_k, batch=batch, device=device)  # (B, 1, Tq, Tk), queries bottom-right
