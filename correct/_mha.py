"""Multi-head attention as a sequence of small, named, overridable steps.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_O,
    head_h = Attention(Q W_Q^h, K W_K^h, V W_V^h)                (Vaswani et al. 2017, section 3.2.2)

`forward` reads top to bottom as the formula. Each step is a method, so a broken variant in
`buggy_variants` overrides exactly one of them and its diff against this file *is* the bug.

Attention patterns beyond causal are FlexAttention-style mask_mods over absolute positions, one small step
each, and-ed by `pattern` (the mask_mod of the whole layer) and turned into a mask by `pattern_mask`:

    sliding window of W keys   kv <= q and q - kv < W     (Mistral, Gemma 2: the query's own key included)
    chunks of C positions      kv <= q and q // C == kv // C       (Llama 4's chunked attention)
    prefix of P positions      kv <= q or kv < P          (prefix-LM: T5, PaliGemma; the prefix sees itself)
    packed documents           ids[q] == ids[kv]          (block-diagonal; with causal=True, causal inside)

Legend:  B = batch, Tq / Tk = query / key length, D = d_model, H = heads, d_k = D // H.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _positional, _sdpa
from ._errors import expect
from ._patterns import mask_from_mod


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection; `forward` returns `(out, weights)`.

    `causal=True` makes it a decoder self-attention layer: query i may attend keys j <= i + (Tk - Tq)
    (bottom-right alignment, right for cached decoding). `mask` follows torch's SDPA: True = may attend.
    `rotary=True` rotates q and k by their positions (RoPE, Su et al. 2021), the queries being the last Tq of
    the Tk positions, as in cached decoding: then scores depend on positions only through j - i.
    `sliding_window`, `attention_chunk_size` (Hugging Face's names: Mistral's, Llama 4's), `prefix` and `documents`
    (ids per position, (T,) or (B, T); positions past the end belong to the last document) give the layer its own
    pattern (see the module docstring), on top of the causal mask
    and the caller's mask: each key must be allowed by all of them.
    """

    def __init__(self, d_model: int, num_heads: int, *, bias: bool = True, dropout: float = 0.0,
                 causal: bool = False, rotary: bool = False, sliding_window: int | None = None,
                 attention_chunk_size: int | None = None, prefix: int | None = None, documents: Tensor | None = None):
        super().__init__()
        expect(num_heads >= 1 and d_model >= 1, "d_model >= 1 and num_heads >= 1",
               f"d_model={d_model}, num_heads={num_heads}", "pass positive sizes")
        divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
        expect(d_model % num_heads == 0, "d_model divisible by num_heads",
               f"d_model={d_model}, num_heads={num_heads}", f"choose num_heads in {{{', '.join(map(str, divisors))}}}")
        expect(0.0 <= dropout < 1.0, "0 <= dropout < 1", f"dropout={dropout}", "pass a probability below 1")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        for name, n in (("sliding_window", sliding_window), ("attention_chunk_size", attention_chunk_size),
                        ("prefix", prefix)):
            expect(n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1),
                   f"{name}: an int >= 1 or None", f"{name}={n!r}", f"pass the number of positions, e.g. {name}=4")
        if documents is not None:
            documents = torch.as_tensor(documents)
            expect(documents.dim() in (1, 2) and documents.numel() >= 1 and not documents.is_floating_point(),
                   "documents: integer ids per position, (T,) or (B, T)",
                   f"shape {tuple(documents.shape)}, dtype {documents.dtype}",
                   "pass e.g. torch.tensor([0, 0, 1, 1, 1])")
            documents = documents.view(-1, documents.shape[-1]).clone()  # (B_docs, L); a plain attribute: not a weight
        self.dropout_p, self.causal, self.rotary = dropout, causal, rotary
        self.sliding_window, self.attention_chunk_size = sliding_window, attention_chunk_size
        self.prefix, self.documents = prefix, documents
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)  # W_Q, W_K, W_V stacked: one matmul for self-attention
        self.out = nn.Linear(d_model, d_model, bias=bias)  # W_O

    # ---- the steps, in the order forward calls them -------------------------------------------------
    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        D = self.d_model
        if query is key and key is value:  # self-attention: one fused matmul
            return self.qkv(query).split(D, dim=-1)  # (B, T, 3D) -> 3 x (B, T, D)
        w, b = self.qkv.weight, self.qkv.bias  # (3D, D), (3D,)
        b_q, b_k, b_v = (None, None, None) if b is None else b.split(D)
        w_q, w_k, w_v = w.split(D)  # 3 x (D, D)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)  # (B, Tq, D), (B, Tk, D), (B, Tk, D)

    def split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, T, D) -> (B, H, T, d_k)

    def positions(self, t_q: int, t_k: int, device=None) -> tuple[Tensor, Tensor]:
        # the keys are positions 0..Tk-1 and the queries the last Tq of them (a KV cache holds Tk - Tq)
        return torch.arange(t_k - t_q, t_k, device=device), torch.arange(t_k, device=device)  # (Tq,), (Tk,)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        return _positional.rotary(x, positions)  # (B, H, T, d_k): pairs (i, i + d_k/2) turned by position

    # The layer's own pattern: mask_mods over absolute positions, index tensors that broadcast (FlexAttention's
    # signature, evaluated on the whole grid at once); the queries are the last Tq of the Tk positions.
    def within_window(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.sliding_window)  # W keys, the query's own included

    def within_chunk(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        C = self.attention_chunk_size
        return (kv_idx <= q_idx) & (q_idx // C == kv_idx // C)  # causal inside the query's chunk of C positions

    def prefix_lm(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)  # causal, and the prefix sees all of itself

    def same_document(self, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        ids, last = self.documents.to(q_idx.device), self.documents.shape[-1] - 1  # (B_docs, L)
        row = b % ids.shape[0]  # sequence b of a batch reads row b % B_docs
        return ids[row, q_idx.clamp(max=last)] == ids[row, kv_idx.clamp(max=last)]  # a query sees its own document only

    def pattern(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        parts = []  # each configured pattern as a bool tensor that broadcasts to (B, H, Tq, Tk)
        if self.sliding_window is not None:
            parts.append(self.within_window(q_idx, kv_idx))
        if self.attention_chunk_size is not None:
            parts.append(self.within_chunk(q_idx, kv_idx))
        if self.prefix is not None:
            parts.append(self.prefix_lm(q_idx, kv_idx))
        if self.documents is not None:
            parts.append(self.same_document(b, q_idx, kv_idx))
        allowed = parts[0] if parts else torch.ones((), dtype=torch.bool, device=q_idx.device)
        for part in parts[1:]:
            allowed = allowed & part  # a key must be allowed by every configured pattern
        return allowed

    def pattern_mask(self, t_q: int, t_k: int, *, batch: int = 1, device=None) -> Tensor | None:
        if (self.sliding_window, self.attention_chunk_size, self.prefix, self.documents) == (None,) * 4:
            return None  # no pattern of its own: the causal mask and the caller's mask only
        return mask_from_mod(self.pattern, t_q, t_k, batch=batch, device=device)  # (B, 1, Tq, Tk), queries bottom-right

    def score(self, q: Tensor, k: Tensor) -> Tensor:
        return _sdpa.scores(q, k)  # (B, H, Tq, d_k) x (B, H, d_k, Tk) -> (B, H, Tq, Tk)

    def scale(self, scores: Tensor) -> Tensor:
        return scores / math.sqrt(self.head_dim)  # per-head width: keeps logits' variance ~1 as d_k grows

    def mask(self, scores: Tensor, mask: Tensor | None, *, fill: float = -math.inf) -> Tensor:
        if self.causal:
            t_q, t_k = scores.shape[-2:]
            causal = _sdpa.causal_mask(t_q, t_k, align="bottom_right", device=scores.device)  # (Tq, Tk)
            scores = _sdpa.apply_mask(scores, causal, fill=fill)
        return _sdpa.apply_mask(scores, mask, fill=fill)  # (B, H, Tq, Tk)

    def softmax(self, scores: Tensor) -> Tensor:
        return _sdpa.safe_softmax(scores)  # (B, H, Tq, Tk), rows sum to 1 over keys (0 if fully masked)

    def mask_then_softmax(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        # Order matters: masked logits must be -inf *before* normalising, so the kept weights sum to 1.
        return self.softmax(self.mask(scores, mask))  # (B, H, Tq, Tk)

    def dropout(self, weights: Tensor) -> Tensor:
        return F.dropout(weights, p=self.dropout_p, training=self.training)  # identity in eval mode

    def weight_values(self, weights: Tensor, v: Tensor) -> Tensor:
        return _sdpa.weight_values(weights, v)  # (B, H, Tq, Tk) x (B, H, Tk, d_k) -> (B, H, Tq, d_k)

    def merge_heads(self, x: Tensor) -> Tensor:
        B, H, T, d_k = x.shape
        return x.transpose(1, 2).contiguous().view(B, T, H * d_k)  # (B, H, T, d_k) -> (B, T, H, d_k) -> (B, T, D)

    def output_projection(self, x: Tensor) -> Tensor:
        return self.out(x)  # (B, Tq, D)

    # ---- the formula ---------------------------------------------------------------------------------
    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """query `(B, Tq, D)`, key and value `(B, Tk, D)` (default: query). Returns out `(B, Tq, D)` and
        the attention weights `(B, H, Tq, Tk)` after dropout, i.e. the weights that were used."""
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value, mask)

        q, k, v = self.project(query, key, value)  # (B, Tq, D), (B, Tk, D), (B, Tk, D)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, H, T, d_k)
        if self.rotary:
            pos_q, pos_k = self.positions(q.shape[-2], k.shape[-2], device=q.device)  # (Tq,), (Tk,)
            q, k = self.rotate(q, pos_q), self.rotate(k, pos_k)  # (B, H, T, d_k)
        scores = self.scale(self.score(q, k))  # (B, H, Tq, Tk)
        own = self.pattern_mask(q.shape[-2], k.shape[-2], batch=q.shape[0], device=q.device)  # (B, 1, Tq, Tk) or None
        scores = _sdpa.apply_mask(scores, own)  # -inf where its pattern blocks; the causal and caller's masks block more
        weights = self.dropout(self.mask_then_softmax(scores, mask))  # (B, H, Tq, Tk)
        out = self.merge_heads(self.weight_values(weights, v))  # (B, H, Tq, d_k) -> (B, Tq, D)
        return self.output_projection(out), weights.to(query.dtype)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> None:
        D = self.d_model
        for name, x in (("query", query), ("key", key), ("value", value)):
            expect(isinstance(x, Tensor) and x.dim() == 3, f"{name} of shape (B, T, d_model={D})",
                   f"{name}.shape={tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}",
                   "add the batch dimension with x.unsqueeze(0)" if isinstance(x, Tensor) and x.dim() == 2
                   else "pass a 3-D tensor (batch, sequence, features)")
            expect(x.size(-1) == D, f"{name} with last dimension d_model={D}", f"{name}.shape={tuple(x.shape)}",
                   f"project the input to width {D} or build the layer with d_model={x.size(-1)}")
        expect(query.size(0) == key.size(0) == value.size(0), "query, key and value with one batch size",
               f"{query.size(0)}, {key.size(0)}, {value.size(0)}", "stack the same batch for all three")
        expect(key.size(1) == value.size(1), "key and value of one length Tk",
               f"key Tk={key.size(1)}, value Tk={value.size(1)}", "pass one value per key")
        B, t_q, t_k = query.size(0), query.size(1), key.size(1)
        _sdpa.check_mask(mask, torch.Size((B, self.num_heads, t_q, t_k)))
