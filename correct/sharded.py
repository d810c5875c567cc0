"""Attention split across processes, written to be read beside `correct/_mha.py`, whose layer (its weights and
its steps: project, split_heads, score, scale, mask, softmax, weight_values, merge_heads, output_projection) each
sharded form reuses. Every form computes exactly what the unsharded layer computes; only where the work happens
changes. A rotary layer (`rotary=True`) is turned by its tokens' global positions in every form. Packed documents
(`documents=`, one row of ids) are honoured in every form: a query attends its own document's keys only (causal
inside it where the layer is causal), the keys' document ids travelling round the ring with them; RoPE by global
positions turns a document's tokens as per-document positions would (its scores depend on j - i only). A layer with
another pattern of its own (a sliding window, chunks, a prefix) is refused: no form here writes its pattern.

    RingAttention         context parallel (Liu et al. 2023, "Ring Attention"): each rank holds a shard of the
                          sequence and its queries; the key/value shards travel round the ring, one step a hop, and
                          each rank merges its partial results with their log-sum-exp (Milakov & Gimelshein 2018,
                          the online softmax). Positions travel with the keys, so any layout works: contiguous,
                          zigzag (rank r holds chunks r and 2W-1-r of 2W: a causal ring's work is balanced), striped.
    UlyssesAttention      DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns "my tokens, all heads" into
                          "all tokens, my heads", attention runs per head as usual, a second all-to-all turns it back.
    HeadParallelAttention Megatron-LM's tensor parallelism (Shoeybi et al. 2019): rank r owns heads r*H/W.. of the
                          fused QKV projection (column parallel) and the matching columns of the output projection
                          (row parallel); one all-reduce sums the ranks' parts, and the bias is added once, after it.
                          An optional dropout on the (replicated) output draws from the stream all ranks share.
    DataContextParallel   data parallelism beside context parallelism: replicas of adjacent context-parallel
                          ranks, each group running a form above (rank // cp the replica, rank % cp the context rank).
    SequenceParallel      a full-sequence front for a shard layer: it cuts the sequence in a layout, runs the shard
                          layer, gathers the shards and puts the tokens back in order.
    OutputDropout         the unsharded layer with dropout on its output: what HeadParallelAttention with
                          output_dropout draws, mask for mask, under the same seed.

Every form says how its parameters map to the unsharded layer's (`unsharded_parameters`: the whole parameter and a
part of its gradient, the whole of both, or a slice), so an audit can put the ranks' parameter gradients together.

The collectives carry their backward (`ring_shift`, `all_to_all`, `reduce_from_ranks`, `copy_to_ranks`,
`scatter_sequence`, `gather_sequence`), so each layer's gradients are the unsharded layer's: a backward-only bug
(a key/value gradient sent back to the wrong rank) lives in one of them.

Legend:  B = batch, T = whole sequence, T_r = a rank's shard, D = d_model, H = heads, H_r = H / W heads a rank,
d_k = D // H, W = world size (ranks), r = this rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._errors import expect
from ._mha import MultiHeadAttention

LAYOUTS = ("contiguous", "zigzag", "striped")
PARTIAL, REPLICATED = "partial", "replicated"  # how a rank's parameter maps to the unsharded one (unsharded_parameters)


def shard_positions(layout: str, t: int, rank: int, world_size: int) -> Tensor:
    """The global positions rank `rank` holds of a `t`-token sequence, in the order it holds them: contiguous (one
    run each), zigzag (chunks r and 2W-1-r of 2W), striped (every W-th token from r). Uneven where W does not
    divide t (torch.tensor_split's rule: the first shards get one more)."""
    expect(layout in LAYOUTS, f"a layout in {LAYOUTS}", repr(layout), "pass layout='contiguous'")
    order = torch.arange(t)
    if layout == "contiguous":
        return order.tensor_split(world_size)[rank]
    if layout == "striped":
        return order[rank::world_size]
    chunks = order.tensor_split(2 * world_size)  # zigzag: the early chunk r pairs with the late chunk 2W-1-r
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


# ---- collectives with their backward ------------------------------------------------------------------------------
class _RingShift(torch.autograd.Function):
    """Send to rank r+1, receive from rank r-1; the gradient travels the other way (the adjoint of a shift)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, direction: int) -> Tensor:
        ctx.group, ctx.direction = group, direction
        return send_round(x, group, direction)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return send_round(grad, ctx.group, -ctx.direction), None, None  # back to the rank it came from


def send_round(x: Tensor, group, direction: int) -> Tensor:
    """Send x to rank r+direction and return what rank r-direction sent (no autograd: see `ring_shift`)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + direction) % world), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - direction) % world), group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def ring_shift(x: Tensor, group) -> Tensor:
    """x of rank r-1 (autograd: the gradient goes back to r-1)."""
    return _RingShift.apply(x, group, 1)


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j; chunk i of the result came from rank i. With equal chunks the adjoint is
    the same exchange, so the backward is one more all-to-all."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x.contiguous())
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = torch.empty_like(grad.contiguous())
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_to_all(x: Tensor, group) -> Tensor:
    """x (W, ...) -> (W, ...): chunk j sent to rank j, chunk i received from rank i."""
    return _AllToAll.apply(x, group)


class _ReduceFromRanks(torch.autograd.Function):
    """Megatron's `g`: forward all-reduce (sum), backward identity (every rank holds the same summed output)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _CopyToRanks(torch.autograd.Function):
    """Megatron's `f`: forward identity (every rank holds the input), backward all-reduce (each rank's part of the
    input's gradient summed, so every rank holds the whole gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def reduce_from_ranks(x: Tensor, group) -> Tensor:
    return _ReduceFromRanks.apply(x, group)


def copy_to_ranks(x: Tensor, group) -> Tensor:
    return _CopyToRanks.apply(x, group)


def _gather_along_1(x: Tensor, group) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)  # (B, W * T_r, ...), rank order


class _GatherSequence(torch.autograd.Function):
    """Forward all-gather of the shards along dim 1 (rank order); backward keeps this rank's slice (every rank's
    output is the same whole sequence, so its gradient is not summed over ranks)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.t_r = group, x.shape[1]
        return _gather_along_1(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        r = dist.get_rank(ctx.group)
        return grad[:, r * ctx.t_r:(r + 1) * ctx.t_r].contiguous(), None


class _ScatterSequence(torch.autograd.Function):
    """Forward: this rank's slice of the whole sequence; backward all-gathers the slices' gradients and puts each at
    its position, so every rank holds the input's whole gradient (the adjoint of `_GatherSequence`)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, group) -> Tensor:
        ctx.group, ctx.order = group, order
        mine = order.view(dist.get_world_size(group), -1)[dist.get_rank(group)]  # (T_r,)
        return x[:, mine].contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        gathered = _gather_along_1(grad, ctx.group)  # (B, T, ...) in the ranks' order
        return gathered[:, ctx.order.argsort()], None, None  # slot i held position order[i]


def scatter_sequence(x: Tensor, order: Tensor, group) -> Tensor:
    """x (B, T, ...) -> this rank's shard (B, T_r, ...); `order` (T,): every rank's positions, in the ranks' order."""
    return _ScatterSequence.apply(x, order, group)


def gather_sequence(x: Tensor, group) -> Tensor:
    return _GatherSequence.apply(x, group)


def check_equal_shards(t_r: int, group, device=None) -> None:
    """Every rank holds as many tokens: refuse otherwise, on every rank alike (the ring and the all-to-all exchange
    equal blocks; an uneven one would fail in the transport or, worse, read past a shard)."""
    lengths = torch.zeros(dist.get_world_size(group), dtype=torch.long, device=device)  # NCCL: on the rank's GPU
    lengths[dist.get_rank(group)] = t_r
    dist.all_reduce(lengths, group=group)
    seen = lengths.tolist()
    expect(len(set(seen)) == 1, "as many tokens on every rank (a length divisible by the world size)",
           f"shards of {seen} tokens", f"pad the sequence to a multiple of {len(seen)} (and mask the padding)")


# ---- the layers -------------------------------------------------------------------------------------------------
class _Sharded(nn.Module):
    """What every form shares: the unsharded layer (weights and steps) and the process group."""

    def __init__(self, layer: MultiHeadAttention, group=None):
        super().__init__()
        expect(isinstance(layer, MultiHeadAttention), "a correct.MultiHeadAttention to shard",
               type(layer).__name__, "build the layer with correct.MultiHeadAttention(d_model, num_heads)")
        expect(layer.dropout_p == 0.0, "a layer without attention dropout (not written for shards here)",
               f"dropout={layer.dropout_p}", "build it with dropout=0.0")
        own = {name: getattr(layer, name) for name in ("sliding_window", "attention_chunk_size", "prefix")
               if getattr(layer, name) is not None}
        expect(not own, "a layer without a pattern of its own but documents (the sharded forms write the causal mask "
                        "and packed documents only)",
               ", ".join(f"{name}={value!r}" for name, value in own.items()),
               "shard a layer built without sliding_window, attention_chunk_size and prefix")
        docs = layer.documents
        expect(docs is None or docs.shape[0] == 1, "documents: one row of ids per position, (T,), alike for every "
                                                   "sequence of the batch", f"documents of shape {tuple(docs.shape)}"
               if docs is not None else "", "pack every sequence alike, or shard each packing's batch on its own")
        self.layer, self.group = layer, group if group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)

    def unsharded_parameters(self) -> dict:
        """{the unsharded layer's parameter name: (this rank's parameter, how it maps)}, which an audit reads to put
        the ranks' gradients together: `PARTIAL` (every rank holds the whole parameter and a part of its gradient; the
        ranks' parts sum to the whole, as the data or context parallel all-reduce does), `REPLICATED` (every rank holds
        the whole parameter and its whole gradient), or `(dim, index)` (this rank holds those rows or columns)."""
        return {name: (p, PARTIAL) for name, p in self.layer.named_parameters()}  # every rank the whole layer

    def rotary_positions(self, positions: Tensor) -> Tensor:
        return positions  # the tokens' global positions: RoPE turns each token by where it sits in the sequence

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q and k (B, H, T_r, d_k) turned by their tokens' positions (T_r,) where the layer is rotary, as the unsharded
        layer turns them; unchanged otherwise."""
        if not self.layer.rotary:
            return q, k
        turn = self.rotary_positions(positions)  # (T_r,)
        return self.layer.rotate(q, turn), self.layer.rotate(k, turn)  # (B, H, T_r, d_k)

    def documents_of(self, positions: Tensor) -> Tensor | None:
        """(T_r,) the document id of each token at these global positions (positions past the packing's end belong to
        its last document, as in the unsharded layer); None for a layer without documents."""
        ids = self.layer.documents
        if ids is None:
            return None
        ids = ids[0].to(positions.device)  # (L,)
        return ids[positions.long().clamp(max=len(ids) - 1)]  # (T_r,)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, q_doc: Tensor | None = None,
               k_doc: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One block of attention by the layer's own steps, with the causal mask from global positions and, for packed
        documents, the keys of the query's own document only (`q_doc`, `k_doc`: (Tq,), (Tk,) document ids); returns
        the block's output and its log-sum-exp per query (-inf where the block hides every key from the query)."""
        layer = self.layer
        scores = layer.scale(layer.score(q, k))  # (B, H, Tq, d_k) x (B, H, d_k, Tk) -> (B, H, Tq, Tk)
        if layer.causal:
            allowed = k_pos[None, :] <= q_pos[:, None]  # (Tq, Tk): positions, not indices, decide
            scores = scores.masked_fill(~allowed, -math.inf)
        if q_doc is not None:
            scores = scores.masked_fill(q_doc[:, None] != k_doc[None, :], -math.inf)  # (Tq, Tk): its own document only
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, Tq, 1): no key of this block allowed
        # logsumexp of an all -inf row is -inf, but its gradient is NaN: take it of zeros there, then put -inf back
        lse = torch.where(empty, -math.inf, torch.logsumexp(scores.masked_fill(empty, 0.0), dim=-1, keepdim=True))
        out = layer.weight_values(layer.softmax(scores), v)  # (B, H, Tq, Tk) x (B, H, Tk, d_k) -> (B, H, Tq, d_k)
        return out, lse  # (B, H, Tq, d_k), (B, H, Tq, 1)


class RingAttention(_Sharded):
    """Context parallel self-attention: `forward(x, positions)` takes this rank's shard `(B, T_r, D)` and the global
    positions of its tokens `(T_r,)`, and returns the shard's output `(B, T_r, D)`."""

    def query_positions(self, positions: Tensor) -> Tensor:
        return positions  # the shard's global positions: the causal mask must know where the shard's queries sit

    def pass_on(self, x: Tensor) -> Tensor:
        return ring_shift(x, self.group)  # from rank r-1; its gradient goes back to r-1

    def received_documents(self, k_doc: Tensor | None) -> Tensor | None:
        # the keys' document ids travel with them, as their positions do (a block from rank r-1 is masked by its own
        # documents, not by this rank's)
        return None if k_doc is None else send_round(k_doc, self.group, 1)  # (T_r,) of rank r-1

    def merge(self, out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
        # the online softmax: rescale both partial results to the joint normaliser, in log space (no exp of a
        # large logit ever happens: each factor is exp of a difference <= 0)
        new = torch.logaddexp(lse, part_lse)  # (B, H, T_r, 1)
        return out * torch.exp(lse - new) + part * torch.exp(part_lse - new), new  # (B, H, T_r, d_k)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        layer = self.layer
        check_equal_shards(x.shape[1], self.group, x.device)
        q, k, v = layer.project(x, x, x)  # (B, T_r, D) each
        q, k, v = layer.split_heads(q), layer.split_heads(k), layer.split_heads(v)  # (B, H, T_r, d_k)
        q, k = self.rotate(q, k, positions)  # the keys travel turned by their own positions
        q_pos = self.query_positions(positions)  # (T_r,)
        k_pos = positions.to(torch.float64)  # travels with its keys round the ring
        q_doc = k_doc = self.documents_of(positions)  # (T_r,) or None: the documents of the shard's tokens
        out, lse = self.attend(q, k, v, q_pos, positions, q_doc, k_doc)  # own block first: a causal row sees its key
        for _ in range(self.world_size - 1):
            k, v, k_pos = self.pass_on(k), self.pass_on(v), self.pass_on(k_pos)  # the shard of rank r-1, r-2, ...
            k_doc = self.received_documents(k_doc)
            part, part_lse = self.attend(q, k, v, q_pos, k_pos.long(), q_doc, k_doc)
            out, lse = self.merge(out, lse, part, part_lse)
        return layer.output_projection(layer.merge_heads(out))  # (B, H, T_r, d_k) -> (B, T_r, D)


class UlyssesAttention(_Sharded):
    """Sequence parallel by heads (DeepSpeed-Ulysses): `forward(x, positions)` on this rank's shard, like
    RingAttention; needs H divisible by W."""

    def __init__(self, layer: MultiHeadAttention, group=None):
        super().__init__(layer, group)
        H, W = layer.num_heads, self.world_size
        expect(H % W == 0, f"num_heads divisible by the world size {W}", f"num_heads={H}",
               f"use a multiple of {W} heads, or another form (RingAttention needs no division of heads)")

    def heads_out(self, x: Tensor) -> Tensor:
        B, H, T_r, d_k = x.shape
        W = self.world_size
        x = x.view(B, W, H // W, T_r, d_k).transpose(0, 1)  # (W, B, H_r, T_r, d_k): head group j goes to rank j
        x = all_to_all(x, self.group)  # (W, B, H_r, T_r, d_k): the shard of rank i, my heads
        return x.permute(1, 2, 0, 3, 4).reshape(B, H // W, W * T_r, d_k)  # (B, H_r, T, d_k), ranks' order

    def heads_back(self, x: Tensor) -> Tensor:
        B, H_r, T, d_k = x.shape
        W = self.world_size
        x = x.view(B, H_r, W, T // W, d_k).permute(2, 0, 1, 3, 4)  # (W, B, H_r, T_r, d_k): shard i to rank i
        x = all_to_all(x, self.group)  # (W, B, H_r, T_r, d_k): head group i, from rank i, of my shard
        return x.transpose(0, 1).reshape(B, W * H_r, T // W, d_k)  # (B, H, T_r, d_k): head i*H_r + j in place

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        layer = self.layer
        check_equal_shards(x.shape[1], self.group, x.device)
        q, k, v = layer.project(x, x, x)  # (B, T_r, D) each
        q, k, v = layer.split_heads(q), layer.split_heads(k), layer.split_heads(v)  # (B, H, T_r, d_k)
        q, k = self.rotate(q, k, positions)  # turned on the shard, by its tokens' global positions
        q, k, v = self.heads_out(q), self.heads_out(k), self.heads_out(v)  # (B, H_r, T, d_k)
        everywhere = _gather_along_1(positions.view(1, -1), self.group)[0]  # (T,): the tokens' order after the exchange
        docs = self.documents_of(everywhere)  # (T,) or None
        out, _ = self.attend(q, k, v, everywhere, everywhere, docs, docs)  # (B, H_r, T, d_k)
        return layer.output_projection(layer.merge_heads(self.heads_back(out)))  # (B, T_r, D)


class HeadParallelAttention(_Sharded):
    """Tensor parallel by heads (Megatron-LM): `forward(x)` takes the whole sequence `(B, T, D)` on every rank and
    returns the whole output on every rank; rank r computes heads r*H_r .. (r+1)*H_r - 1."""

    def __init__(self, layer: MultiHeadAttention, group=None, *, output_dropout: float = 0.0):
        super().__init__(layer, group)
        H, W, D = layer.num_heads, self.world_size, layer.d_model
        expect(H % W == 0, f"num_heads divisible by the world size {W}", f"num_heads={H}",
               f"use a multiple of {W} heads")
        self.output_dropout = output_dropout  # on the whole output, which every rank holds alike
        w, b = self.shard_qkv(layer.qkv.weight, layer.qkv.bias)
        self.qkv_weight = nn.Parameter(w.detach().clone())  # (3 D/W, D): my heads' rows of W_Q, W_K, W_V
        self.qkv_bias = None if b is None else nn.Parameter(b.detach().clone())  # (3 D/W,)
        cols = slice(self.rank * D // W, (self.rank + 1) * D // W)
        self.out_weight = nn.Parameter(layer.out.weight[:, cols].detach().clone())  # (D, D/W): my heads' columns
        self.out_bias = layer.out.bias  # (D,) or None: added once, after the sum

    def qkv_rows(self) -> Tensor:
        # the fused weight stacks W_Q, W_K, W_V (3 x (D, D)): cut each of the three, not the stack
        D, W, r = self.layer.d_model, self.world_size, self.rank
        return torch.cat([torch.arange(part * D + r * D // W, part * D + (r + 1) * D // W) for part in range(3)])

    def shard_qkv(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        rows = self.qkv_rows()  # (3 D/W,): my heads' rows of W_Q, then of W_K, then of W_V
        return weight[rows], None if bias is None else bias[rows]  # (3 D/W, D), (3 D/W,)

    def unsharded_parameters(self) -> dict:
        D, W, r = self.layer.d_model, self.world_size, self.rank
        mine = {"qkv.weight": (self.qkv_weight, (0, self.qkv_rows())),  # my heads' rows
                "out.weight": (self.out_weight, (1, torch.arange(r * D // W, (r + 1) * D // W)))}  # my heads' columns
        if self.qkv_bias is not None:
            mine["qkv.bias"] = (self.qkv_bias, (0, self.qkv_rows()))
        if self.out_bias is not None:
            mine["out.bias"] = (self.out_bias, REPLICATED)  # after the sum: every rank the whole gradient
        # with output dropout, the unsharded layer is OutputDropout(layer, p), which holds the layer as `.layer`
        return {f"layer.{name}": how for name, how in mine.items()} if self.output_dropout else mine

    def output_projection(self, x: Tensor) -> Tensor:
        partial = x @ self.out_weight.T  # (B, T, D/W) x (D/W, D) -> (B, T, D): my heads' part of the sum
        out = reduce_from_ranks(partial, self.group)  # (B, T, D), the same on every rank
        return out if self.out_bias is None else out + self.out_bias  # once, after the sum

    def replicated_dropout(self, out: Tensor) -> Tensor:
        # the replicated region draws from the stream every rank shares (seeded alike): the same mask on every rank
        return torch.nn.functional.dropout(out, p=self.output_dropout, training=self.training)  # (B, T, D)

    def forward(self, x: Tensor) -> Tensor:
        layer = self.layer
        B, T, D = x.shape
        x = copy_to_ranks(x, self.group)  # every rank's part of x's gradient is summed in the backward
        qkv = torch.nn.functional.linear(x, self.qkv_weight, self.qkv_bias)  # (B, T, 3 D/W)
        H_r, d_k = layer.num_heads // self.world_size, layer.head_dim
        q, k, v = (t.view(B, T, H_r, d_k).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, H_r, T, d_k)
        positions = torch.arange(T, device=x.device)
        q, k = self.rotate(q, k, positions)  # (B, H_r, T, d_k)
        docs = self.documents_of(positions)  # (T,) or None
        out, _ = self.attend(q, k, v, positions, positions, docs, docs)  # (B, H_r, T, d_k)
        return self.replicated_dropout(self.output_projection(layer.merge_heads(out)))  # (B, T, D/W) -> (B, T, D)


class DataContextParallel(nn.Module):
    """Data parallelism beside context parallelism: the W ranks of `group` are `data_parallel` replicas of
    cp = W / data_parallel context-parallel ranks each, adjacent (Megatron-LM's and torchtitan's order, context inside
    data): rank r is replica r // cp and context rank r % cp. It builds one context-parallel group a replica and runs
    `form(layer, its group)` in it; `forward(x, positions)` as the form's, on the rank's shard of its replica's
    sequences."""

    def __init__(self, layer: MultiHeadAttention, data_parallel: int, group=None, *, form: type = None):
        super().__init__()
        group = group if group is not None else dist.group.WORLD
        W, rank = dist.get_world_size(group), dist.get_rank(group)
        expect(data_parallel >= 1 and W % data_parallel == 0, f"data_parallel dividing the world size {W}",
               f"data_parallel={data_parallel}", f"pass one of {[d for d in range(1, W + 1) if W % d == 0]}")
        self.data_parallel, cp = data_parallel, W // data_parallel
        groups = []  # every rank creates every group, in one order (new_group is a collective of the whole group)
        for replica in range(data_parallel):
            ranks = self.context_ranks(replica, data_parallel, cp)
            groups.append((ranks, dist.new_group([dist.get_global_rank(group, r) for r in ranks])))
        mine = next(g for ranks, g in groups if rank in ranks)
        self.inner = (form or RingAttention)(layer, mine)

    def context_ranks(self, replica: int, data_parallel: int, cp: int) -> list[int]:
        return list(range(replica * cp, (replica + 1) * cp))  # adjacent ranks: rank // cp is the replica

    def unsharded_parameters(self) -> dict:
        return self.inner.unsharded_parameters()  # the replicas' partial gradients sum too (data parallel's all-reduce)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.inner(x, positions)  # (B_replica, T_r, D)


class OutputDropout(nn.Module):
    """The unsharded layer with dropout on its output (`forward(x)` -> `(B, T, D)`): what
    `HeadParallelAttention(layer.layer, group, output_dropout=layer.p)` computes draw for draw, each rank seeded as the
    unsharded layer is, since it draws its mask of the whole output from the stream every rank shares."""

    def __init__(self, layer: MultiHeadAttention, p: float):
        super().__init__()
        self.layer, self.p = layer, p
        self.d_model, self.num_heads = layer.d_model, layer.num_heads  # read by audits, as the layer's own

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.layer(x)  # (B, T, D)
        return torch.nn.functional.dropout(out, p=self.p, training=self.training)  # (B, T, D)


class SequenceParallel(nn.Module):
    """A whole-sequence front for a shard layer (RingAttention, UlyssesAttention): `forward(x)` on `(B, T, D)` on
    every rank cuts the sequence in `layout`, runs `inner(shard, positions)` and returns the whole output, tokens
    back in order, on every rank."""

    def __init__(self, inner: nn.Module, layout: str = "contiguous"):
        super().__init__()
        expect(layout in LAYOUTS, f"a layout in {LAYOUTS}", repr(layout), "pass layout='zigzag'")
        self.inner, self.layout = inner, layout
        self.group, self.rank, self.world_size = inner.group, inner.rank, inner.world_size

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        T, W = x.shape[1], self.world_size
        pieces = 2 * W if self.layout == "zigzag" else W
        expect(T % pieces == 0, f"a length divisible by {pieces} ({self.layout} over {W} ranks)", f"T={T}",
               f"pad the sequence to a multiple of {pieces} and mask the padding")
        order = shard_order(self.layout, T, W)  # (T,): slot i of the ranks' shards, end to end, holds order[i]
        order = order.to(x.device)
        return scatter_sequence(x, order, self.group), order.view(W, -1)[self.rank]  # (B, T_r, D), (T_r,)

    def gather(self, out: Tensor, order: Tensor) -> Tensor:
        gathered = gather_sequence(out, self.group)  # (B, T, D) in the ranks' order
        return gathered[:, order.argsort().to(gathered.device)]  # back to positions 0..T-1

    def unsharded_parameters(self) -> dict:
        return self.inner.unsharded_parameters()

    def forward(self, x: Tensor) -> Tensor:
        shard, positions = self.split(x)  # (B, T_r, D), (T_r,)
        order = shard_order(self.layout, x.shape[1], self.world_size)  # (T,)
        return self.gather(self.inner(shard, positions), order)  # (B, T, D)


def shard_order(layout: str, t: int, world_size: int) -> Tensor:
    """Every rank's positions, in the ranks' order `(T,)`: where each slot of a gathered sequence came from."""
    return torch.cat([shard_positions(layout, t, r, world_size) for r in range(world_size)])


__all__ = ["LAYOUTS", "PARTIAL", "REPLICATED", "DataContextParallel", "HeadParallelAttention", "OutputDropout",
           "RingAttention", "SequenceParallel", "UlyssesAttention", "all_to_all", "check_equal_shards", "copy_to_ranks",
           "gather_sequence", "reduce_from_ranks", "ring_shift", "scatter_sequence", "send_round", "shard_order",
           "shard_positions"]
