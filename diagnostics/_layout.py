"""Weights laid out by a layer's own partition of the tokens, read back as (B, H, Tq, Tk) by tagging the tokens.

A layer that cuts its tokens into windows of an image (ScalableViT's, Swin's inside the layer) or buckets softmaxes
scores of shape (..., n, m) whose rows and columns are no token's index the audit can see: its weights were read
nowhere. The probe then tags the tokens instead of guessing the partition: in call c the tokens whose number
(b x T + t + 1) has bit c set are moved, and each row of the queries that made the scores, and each row of the values
the weights sum, changes in exactly the calls of its token's bits, which spell its number. One more call, moving a
pattern of tokens no bit gives, must change exactly the rows the numbers predict: otherwise the layout is not one of
tokens (a projection that mixes neighbours before the partition, a routing that the moves themselves change, as
Sinkhorn's sort net does) and nothing is read. Heads are the blocks of rows a token appears in, in order; a key that
no tag moves is one of the layer's own making (zero padding of a look-around), and a layout that gives one weight is
not read either (where such weight belongs is not a token's place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._observe import Matmul, Record, SoftmaxCall, branch_sums

MAX_TOKENS = 1 << 14
"""The most tokens (batch x length) tagged: one call per bit of their numbers, 15 at this bound."""

MOVED = 1e-3
"""A row moved by a tag: by more than this share of the rows' largest entry (a tag moves its token's rows by about
their own size; rows of untagged tokens are computed from the same numbers and move by exactly 0)."""


@dataclass(frozen=True)
class Partition:
    """What the tagged calls read: the softmax (its output, (L, n, m) once flattened), its queries' rows (the left
    operand of the product that made its scores) and its values' rows (the right operand of the weighted sum)."""

    softmax: SoftmaxCall
    queries: Tensor  # (L, n, d)
    values: Tensor  # (L, m, d_v)


def partition(record: Record | None, t_q: int, t_k: int) -> Partition | None:
    """The one softmax over its last axis whose very weights a later product sums with values, where its last two
    axes are not (t_q, t_k) (those are read as they are), with the product that made its scores. None where there is
    none, or more than one weighted sum (branches), or the values are multiplied from the left."""
    if record is None:
        return None
    sums = branch_sums(record)
    if len(sums) != 1:
        return None
    sm, weighted, held = sums[0]
    n, m = sm.output.shape[-2:]
    if held != 0 or sm.laid_out or (n, m) == (t_q, t_k) or sm.output.dim() < 3:
        return None
    blocks = sm.output.numel() // (n * m)
    at = next(i for i, x in enumerate(record.order) if x is sm)
    scores = next((x for x in reversed(record.order[:at]) if isinstance(x, Matmul)
                   and x.out.numel() == sm.output.numel() and tuple(x.out.shape[-2:]) == (n, m)), None)
    if scores is None:
        return None
    q, v = scores.a, weighted.b
    if q.dim() < 2 or v.dim() < 2 or q.shape[-2] != n or v.shape[-2] != m or q.numel() % (blocks * n) or \
            v.numel() % (blocks * m):
        return None
    return Partition(sm, q.reshape(blocks, n, -1), v.reshape(blocks, m, -1))


def CHECKED(n: Tensor) -> Tensor:  # noqa: N802 -- a rule, named as one
    """The tokens the checking call moves, by their numbers: a pattern no single bit gives."""
    return (n * 7 + 3) % 5 < 2


def numbers(batch: int, length: int) -> Tensor:
    """(batch, length): each token's number, b x length + t + 1 (0 is no token)."""
    return torch.arange(1, batch * length + 1).reshape(batch, length)


def bits(batch: int, length: int) -> int:
    return (batch * length).bit_length()


def moved_rows(base: Tensor, tagged: Tensor) -> Tensor:
    """(L, rows) bool: the rows of `tagged` that differ from `base`'s."""
    scale = float(base.detach().abs().amax()) or 1.0
    return (tagged.detach().float() - base.detach().float()).abs().amax(-1) > MOVED * scale


@dataclass(frozen=True)
class TokenLayout:
    """Each weight row's query token and each column's key token (b x T + t; -1: a key of the layer's own), the head
    of each block of rows, and the number of heads."""

    queries: Tensor  # (L, n) long
    keys: Tensor  # (L, m) long
    heads: Tensor  # (L,) long
    n_heads: int


def decode(base: Partition, tagged: list[Partition], check: Partition, checked_q: Tensor, checked_k: Tensor,
           tokens_q: int, tokens_k: int) -> TokenLayout | None:
    """The layout the tagged calls spell (call c moved the tokens with bit c of their number set), if the check call
    (`checked_q`, `checked_k`: which tokens' numbers it moved, bool over the numbers 0..tokens) moved exactly the rows
    it predicts, every query token has a row in as many blocks as every other (its heads), each block's rows have one
    head and one sequence, and its keys that sequence's; else None."""
    shape_q, shape_v = base.queries.shape[:2], base.values.shape[:2]
    if any(p.queries.shape[:2] != shape_q or p.values.shape[:2] != shape_v for p in (*tagged, check)):
        return None
    code_q = sum(moved_rows(base.queries, p.queries).long() << c for c, p in enumerate(tagged))
    code_k = sum(moved_rows(base.values, p.values).long() << c for c, p in enumerate(tagged))
    if int(code_q.min()) < 1 or int(code_q.max()) > tokens_q or int(code_k.max()) > tokens_k:
        return None
    if not torch.equal(moved_rows(base.queries, check.queries), checked_q[code_q]) or \
            not torch.equal(moved_rows(base.values, check.values), checked_k[code_k]):
        return None
    q_tok, k_tok = code_q - 1, code_k - 1  # b x T + t; -1 where no tag moved the key: the layer's own
    counts = torch.bincount(q_tok.flatten(), minlength=tokens_q)
    n_heads = int(counts[0])
    if n_heads < 1 or bool((counts != n_heads).any()):
        return None
    blocks = q_tok.shape[0]
    # a token's k-th block (in order) is its head k: the same k for every row of a block
    order = torch.arange(blocks).unsqueeze(1).expand_as(q_tok).flatten()
    by_token = q_tok.flatten() * blocks + order  # sorted, each token's blocks in order
    ranks = torch.empty_like(by_token)
    ranks[torch.argsort(by_token)] = torch.arange(by_token.numel()) % n_heads
    ranks = ranks.reshape(q_tok.shape)
    if bool((ranks != ranks[:, :1]).any()):
        return None
    return TokenLayout(q_tok, k_tok, ranks[:, 0].clone(), n_heads)


def laid_out(weights: Tensor, layout: TokenLayout, batch: int, t_q: int, t_k: int, tol: float) -> Tensor | None:
    """(B, H, Tq, Tk) weights from the layer's (L, n, m): each weight at its query token's row and key token's
    column. None where a block's keys are of another sequence than its queries, or a row gives a key of the layer's
    own more than `tol` of weight."""
    w = weights.detach().reshape(layout.queries.shape[0], *weights.shape[-2:])
    q_seq, k_seq = layout.queries // t_q, layout.keys // t_k
    own = layout.keys < 0
    if bool(((k_seq != q_seq[:, :1]) & ~own).any()) or bool((q_seq != q_seq[:, :1]).any()):
        return None
    if bool(own.any()) and float(w.masked_select(own.unsqueeze(1).expand_as(w)).abs().max()) > tol:
        return None
    whole = w.new_zeros(batch * layout.n_heads * t_q * t_k)
    b, t = layout.queries // t_q, layout.queries % t_q  # (L, n)
    s = layout.keys % t_k  # (L, m)
    h = layout.heads.unsqueeze(1)  # (L, 1)
    row = ((b * layout.n_heads + h) * t_q + t) * t_k  # (L, n)
    index = row.unsqueeze(-1) + s.unsqueeze(1)  # (L, n, m)
    keep = ~own.unsqueeze(1).expand_as(w)
    whole.index_put_((index[keep],), w[keep], accumulate=True)
    return whole.reshape(batch, layout.n_heads, t_q, t_k)
