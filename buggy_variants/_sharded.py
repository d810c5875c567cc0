"""The sharded chapter: each broken layer is one of `correct/sharded.py`'s forms with exactly one step overridden,
and `SHARDED_VARIANTS[id]` is its lesson in the catalog's form (explanation, symptom, fix, the detectors expected to
catch it, when it is observable), with how `diagnostics.distributed.audit_sharded` runs it (`audit_kwargs`).

A registry of its own, not `VARIANTS`: a catalog entry there is a `correct.MultiHeadAttention` with one step
overridden, which the kill matrix and the teaching report audit in one process with `diagnostics.audit`; these need a
group of processes and their own audit. Read each class beside the method of the same name in `correct/sharded.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from correct import MultiHeadAttention
from correct.sharded import (DataContextParallel, HeadParallelAttention, OutputDropout, RingAttention, SequenceParallel,
                             UlyssesAttention,
                             all_to_all, gather_sequence, reduce_from_ranks, scatter_sequence, send_round, shard_order)

from ._registry import Observable


# ---- the broken steps ---------------------------------------------------------------------------------------------
class RingCausalOffsetPerRank(RingAttention):
    def query_positions(self, positions: Tensor) -> Tensor:
        return torch.arange(len(positions))  # every rank's queries masked as if its shard started at 0


class RingDocumentsStayHome(RingAttention):
    def received_documents(self, k_doc: Tensor | None) -> Tensor | None:
        return k_doc  # the keys travel, their document ids stay: every block masked by this rank's own documents


class RingRotaryFromZero(RingAttention):
    def rotary_positions(self, positions: Tensor) -> Tensor:
        return torch.arange(len(positions))  # every rank's tokens turned as if its shard started the sequence


class RingMergeOverflows(RingAttention):
    def merge(self, out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
        # the normalisers exponentiated themselves: exp(lse) is inf in float32 once a logit passes 88.7
        weight, part_weight = torch.exp(lse), torch.exp(part_lse)  # (B, H, T_r, 1)
        return (out * weight + part * part_weight) / (weight + part_weight), torch.log(weight + part_weight)


class RingMergeWithMax(RingAttention):
    def merge(self, out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
        new = torch.maximum(lse, part_lse)  # the running max taken for the joint normaliser: weights no longer sum to 1
        return out * torch.exp(lse - new) + part * torch.exp(part_lse - new), new  # (B, H, T_r, d_k)


class _WrongWayBack(torch.autograd.Function):
    """A ring shift whose backward sends the gradient on round the ring instead of back to where it came from."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return send_round(x, group, 1)  # from rank r-1, as ring_shift

    @staticmethod
    def backward(ctx, grad: Tensor):
        return send_round(grad, ctx.group, 1), None  # on to r+1, not back to r-1


class RingKVGradientWrongStep(RingAttention):
    def pass_on(self, x: Tensor) -> Tensor:
        return _WrongWayBack.apply(x, self.group)  # from rank r-1; its gradient goes on to r+1


class ContextGroupsAcrossReplicas(DataContextParallel):
    def context_ranks(self, replica: int, data_parallel: int, cp: int) -> list[int]:
        return list(range(replica, data_parallel * cp, data_parallel))  # rank % dp taken for the replica


class ZigzagNotUndone(SequenceParallel):
    def gather(self, out: Tensor, order: Tensor) -> Tensor:
        return gather_sequence(out, self.group)  # (B, T, D) in the ranks' order, left there


class PadsToEvenShards(SequenceParallel):
    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, D = x.shape
        W = self.world_size
        pieces = 2 * W if self.layout == "zigzag" else W
        padded = -(-T // pieces) * pieces
        x = torch.cat([x, x.new_zeros(B, padded - T, D)], dim=1)  # zeros to an even shard, never masked as keys
        order = shard_order(self.layout, padded, W)  # (T',)
        return scatter_sequence(x, order, self.group), order.view(W, -1)[self.rank]

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        shard, positions = self.split(x)
        order = shard_order(self.layout, shard.shape[1] * self.world_size, self.world_size)
        return self.gather(self.inner(shard, positions), order)[:, :T]  # (B, T, D): the padding's rows dropped


class UlyssesHeadsReordered(UlyssesAttention):
    def heads_back(self, x: Tensor) -> Tensor:
        B, H_r, T, d_k = x.shape
        W = self.world_size
        x = x.view(B, H_r, W, T // W, d_k).permute(2, 0, 1, 3, 4)  # (W, B, H_r, T_r, d_k): shard i to rank i
        x = all_to_all(x, self.group)  # (W, B, H_r, T_r, d_k): head group i, from rank i, of my shard
        return x.permute(1, 2, 0, 3, 4).reshape(B, W * H_r, T // W, d_k)  # (B, H, T_r, d_k): laid out (H_r, W)


class BiasOnEveryRank(HeadParallelAttention):
    def output_projection(self, x: Tensor) -> Tensor:
        partial = x @ self.out_weight.T  # (B, T, D/W) x (D/W, D) -> (B, T, D)
        if self.out_bias is not None:
            partial = partial + self.out_bias  # on every rank, before the sum: W x the bias
        return reduce_from_ranks(partial, self.group)  # (B, T, D)


class BiasGradientOnRankZero(HeadParallelAttention):
    def output_projection(self, x: Tensor) -> Tensor:
        partial = x @ self.out_weight.T  # (B, T, D/W) x (D/W, D) -> (B, T, D): my heads' part of the sum
        if self.out_bias is not None and self.rank == 0:
            partial = partial + self.out_bias  # once in the sum, on rank 0: the output is right
        return reduce_from_ranks(partial, self.group)  # (B, T, D); the bias's gradient stays on rank 0


class DropoutStreamPerRank(HeadParallelAttention):
    def replicated_dropout(self, out: Tensor) -> Tensor:
        if not self.training or self.output_dropout == 0.0:
            return out
        stream = torch.Generator(device=out.device).manual_seed(torch.initial_seed() + self.rank)  # one a rank
        keep = torch.rand(out.shape, generator=stream, device=out.device) >= self.output_dropout  # (B, T, D)
        return out * keep / (1.0 - self.output_dropout)  # each rank its own mask on the output they share


class DropoutStreamOfItsOwn(HeadParallelAttention):
    def replicated_dropout(self, out: Tensor) -> Tensor:
        if not self.training or self.output_dropout == 0.0:
            return out
        stream = torch.Generator(device=out.device).manual_seed(torch.initial_seed() + 2718)  # alike on every rank
        keep = torch.rand(out.shape, generator=stream, device=out.device) >= self.output_dropout  # (B, T, D)
        return out * keep / (1.0 - self.output_dropout)  # one mask on every rank, not the unsharded layer's


class FusedQKVContiguousRows(HeadParallelAttention):
    def shard_qkv(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        D, W, r = self.layer.d_model, self.world_size, self.rank
        rows = torch.arange(r * 3 * D // W, (r + 1) * 3 * D // W)  # a contiguous cut of the stack [W_Q; W_K; W_V]
        return weight[rows], None if bias is None else bias[rows]  # (3 D/W, D), (3 D/W,)


# ---- the entries --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedSetting:
    """One sharded audit, as far as observability depends on it."""

    world_size: int
    num_heads: int
    causal: bool
    seq_len: int
    large_logits: bool = True  # the audit scales the weights up (audit_sharded always does)


@dataclass(frozen=True)
class ShardedVariant:
    """A registry entry like `buggy_variants.Variant`: what is wrong, why it is silent, what to write instead,
    the sharded detectors expected to fail and the cause their message names; `build(layer, rank, W, group)` is the
    factory `audit_sharded` takes, `reference` the correct twin's."""

    id: str
    title: str
    cls: type
    step: str
    explanation: str
    symptom: str
    fix: str
    detectable_when: Observable
    expected_detectors: tuple[str, ...]
    cause: str = ""  # a phrase the first expected detector's message names
    also_detected_by: tuple[str, ...] = ()  # fire too in the kill matrix (2 and 4 ranks, seq_len 16, 8 heads)
    audit_kwargs: dict = field(default_factory=dict)  # takes, layout, causal
    reference_cls: type = RingAttention
    inner: type | None = None  # SequenceParallel forms: the shard layer inside
    output_dropout: float = 0.0  # > 0: the unsharded layer is OutputDropout(layer, p), both forms drop their output
    rotary: bool = False  # the unsharded layer turns q and k by their positions (RoPE)

    def _factory(self, cls: type) -> Callable:
        inner, layout, p = self.inner, self.audit_kwargs.get("layout", "contiguous"), self.output_dropout
        dp = self.audit_kwargs.get("data_parallel", 1)
        if dp > 1:
            return lambda layer, rank, world_size, group: cls(layer, dp, group)
        if inner is not None:
            return lambda layer, rank, world_size, group: cls(inner(layer, group), layout)
        if p:
            return lambda layer, rank, world_size, group: cls(layer.layer, group, output_dropout=p)
        return lambda layer, rank, world_size, group: cls(layer, group)

    @property
    def build(self) -> Callable:
        return self._factory(self.cls)

    @property
    def reference(self) -> Callable:
        return self._factory(self.reference_cls)

    def layer(self, d_model: int = 32, num_heads: int = 8, *, seed: int = 0) -> MultiHeadAttention | OutputDropout:
        """The unsharded layer both are audited against: torch's initialisation, with the output bias drawn N(0, 1)
        as a trained layer's may be (torch's is within 1/sqrt(D), small beside the outputs: a bias added twice must
        be able to show)."""
        torch.manual_seed(seed)
        lengths = self.audit_kwargs.get("documents")  # packed documents: the layer attends within each
        ids = None if lengths is None else torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        layer = MultiHeadAttention(d_model, num_heads, causal=self.audit_kwargs.get("causal", False),
                                   rotary=self.rotary, documents=ids)
        with torch.no_grad():
            layer.out.bias.normal_()
        return OutputDropout(layer, self.output_dropout) if self.output_dropout else layer


def _entries() -> list[ShardedVariant]:
    always = Observable("always", lambda s: True)
    full, zigzag = {"takes": "full"}, {"layout": "zigzag"}
    return [
        ShardedVariant(
            id="ring_causal_offset_per_rank", title="Causal offsets restart on every rank", cls=RingCausalOffsetPerRank,
            step="query_positions", reference_cls=RingAttention, audit_kwargs={"causal": True},
            explanation="Each rank builds its causal mask from local indices 0..T_r-1, as if its shard began the "
                        "sequence. Rank 0's shard does begin it, so a test of one rank, or of one shard, passes; every "
                        "later rank's queries are masked against the wrong keys. The same slip reuses the first "
                        "chunk's RoPE positions on every rank.",
            symptom="Outputs match the unsharded layer on rank 0's tokens only.",
            fix="return positions  # the shard's global positions",
            detectable_when=Observable("causal, contiguous layout", lambda s: s.causal),
            expected_detectors=("sharded_output",), cause="restart at 0 on every rank",
            also_detected_by=("sharded_causality", "sharded_large_logits", "sharded_gradients")),
        ShardedVariant(
            id="ring_rotary_from_zero", title="RoPE positions restart on every rank", cls=RingRotaryFromZero,
            step="rotary_positions", reference_cls=RingAttention, audit_kwargs={"causal": True}, rotary=True,
            explanation="Each rank turns its shard's queries and keys by local positions 0..T_r-1 (the position ids "
                        "of a model run on one chunk), not by where the shard sits in the sequence. Rank 0's shard "
                        "does begin the sequence, and within a shard the relative positions are right, so a test of "
                        "one rank or one shard passes; a key from another rank arrives turned as if it sat beside the "
                        "query, and every score across shards reads the wrong distance. The causal mask, built from "
                        "the global positions, is right, so nothing looks wrong but the values.",
            symptom="Causal: outputs match the unsharded layer on rank 0's tokens only (not causal: rank 0 attends "
                    "the later shards too, and every rank's tokens differ).",
            fix="return positions  # the tokens' global positions",
            detectable_when=Observable("a rotary layer; named as a restart when causal (rank 0 then sees its own "
                                       "shard only)", lambda s: s.causal),
            expected_detectors=("sharded_output",), cause="restart at 0 on every rank",
            also_detected_by=("sharded_large_logits", "sharded_gradients")),
        ShardedVariant(
            id="ring_documents_stay_home", title="Ring attention crossing packed documents",
            cls=RingDocumentsStayHome, step="received_documents", reference_cls=RingAttention,
            audit_kwargs={"causal": True, "documents": [5, 6, 5]},
            explanation="Packed sequences: each rank masks its queries by document, but only the keys travel round "
                        "the ring; their document ids stay home, and every received block is masked with the "
                        "receiving rank's own ids (cu_seqlens of the query shard reused for the key block). A block "
                        "from another rank is then cut at the wrong boundaries: the tokens after a boundary attend the "
                        "previous document, and some keys of their own are hidden. On one rank, or with one document, "
                        "nothing changes, which is what the usual test runs.",
            symptom="With packed documents, a document's outputs move when another document's tokens on another rank "
                    "change; rank 0's tokens are right (causal, contiguous: it receives no block it may see).",
            fix="return None if k_doc is None else send_round(k_doc, self.group, 1)  # the ids travel with the keys",
            detectable_when=Observable("packed documents declared, a document boundary inside a shard that another "
                                       "rank's block reaches", lambda s: True),
            expected_detectors=("sharded_documents", "sharded_output"),
            cause="the document mask is not applied to the key blocks received from other ranks",
            also_detected_by=("sharded_large_logits", "sharded_gradients")),
        ShardedVariant(
            id="ring_merge_overflows", title="Log-sum-exp merge overflows", cls=RingMergeOverflows, step="merge",
            explanation="The partial results are weighted by exp(lse) instead of exp(lse - new): exact in real "
                        "arithmetic, and in float32 at ordinary logits, but exp of a logit past 88.7 is inf, and "
                        "inf / inf is NaN. Trained weights and long contexts reach such logits; a unit test at init "
                        "does not.",
            symptom="Rows become NaN (or 0) only when the logits are large.",
            fix="new = torch.logaddexp(lse, part_lse); return out * exp(lse - new) + part * exp(part_lse - new), new",
            detectable_when=Observable("float32 logits past 88.7 (the audit scales the weights up)",
                                       lambda s: s.large_logits),
            expected_detectors=("sharded_large_logits",), cause="log-sum-exp merge overflows"),
        ShardedVariant(
            id="ring_merge_with_max", title="Merge normalised by the running max", cls=RingMergeWithMax, step="merge",
            explanation="The online softmax's running max and its running log-sum-exp are mixed up: the partial "
                        "results are rescaled to the larger of the two normalisers instead of their log-sum, so the "
                        "weights of a row sum to more than 1 once a second block arrives.",
            symptom="Outputs too large on every rank; a single rank (W=1) is right.",
            fix="new = torch.logaddexp(lse, part_lse)",
            detectable_when=always, expected_detectors=("sharded_output",), cause="the weights of a row sum to",
            also_detected_by=("sharded_large_logits", "sharded_gradients")),
        ShardedVariant(
            id="ring_kv_grad_wrong_step", title="Key/value gradient returned to the wrong ring step",
            cls=RingKVGradientWrongStep, step="pass_on",
            explanation="The backward of the ring's shift sends each key/value gradient on round the ring instead "
                        "of back to the rank it came from, so every rank accumulates another rank's key/value "
                        "gradient. The forward is exact, so every forward test passes.",
            symptom="The forward matches; the input's gradient does not (backward only).",
            fix="return send_round(grad, ctx.group, -1), None  # back to the rank it came from",
            detectable_when=Observable("gradients taken; 3 or more ranks (at 2, r+1 and r-1 are one rank)",
                                       lambda s: s.world_size >= 3),
            expected_detectors=("sharded_gradients",), cause="backward-only"),
        ShardedVariant(
            id="context_groups_across_replicas", title="Context-parallel groups built across data-parallel replicas",
            cls=ContextGroupsAcrossReplicas, step="context_ranks", reference_cls=DataContextParallel,
            audit_kwargs={"causal": True, "data_parallel": 2},
            explanation="With data parallelism beside context parallelism, rank r is replica r // cp and context rank "
                        "r % cp; the context-parallel groups are built with the other arithmetic (ranks r with "
                        "r % dp == i), so each ring joins ranks of two replicas and exchanges keys and values between "
                        "different sequences. Shapes and positions fit; with one replica, or with the whole world one "
                        "context group, the groups are the same, which is what the usual test runs.",
            symptom="A replica's outputs move when only another replica's sequences change; every output off but "
                    "rank 0's own block.",
            fix="return list(range(replica * cp, (replica + 1) * cp))  # adjacent ranks: rank // cp is the replica",
            detectable_when=Observable("2 or more replicas of 2 or more context ranks each (world size 4 or more)",
                                       lambda s: s.world_size >= 4),
            expected_detectors=("sharded_data_parallel", "sharded_output"),
            cause="the context-parallel groups mix the replicas' ranks",
            also_detected_by=("sharded_large_logits", "sharded_lengths", "sharded_gradients")),
        ShardedVariant(
            id="zigzag_not_undone", title="Zigzag order not undone on the output", cls=ZigzagNotUndone, step="gather",
            reference_cls=SequenceParallel, inner=RingAttention, audit_kwargs={**full, **zigzag},
            explanation="The load-balancing order (rank r holds chunks r and 2W-1-r) is applied to the input and the "
                        "gathered output is returned in the ranks' order. Each token's output is right, so a test that "
                        "compares sorted rows, or sums, passes.",
            symptom="The output is the unsharded output with its tokens permuted, in the ranks' order.",
            fix="return gathered[:, order.argsort()]  # back to positions 0..T-1",
            detectable_when=always, expected_detectors=("sharded_output",), cause="zigzag order is not undone",
            also_detected_by=("sharded_large_logits", "sharded_gradients")),
        ShardedVariant(
            id="pads_to_even_shards", title="A length the world size does not divide, padded silently",
            cls=PadsToEvenShards, step="split", reference_cls=SequenceParallel, inner=RingAttention,
            audit_kwargs=dict(full),
            explanation="The sequence is padded with zeros to a multiple of the world size so that the shards are "
                        "even, and the padding is never masked: every query attends the padding's keys. At lengths "
                        "the world size divides nothing changes, so the usual tests pass.",
            symptom="At a length the world size does not divide, every output row is off, and nothing raises.",
            fix="refuse the length, or mask the padding's keys (and drop its rows)",
            detectable_when=Observable("not causal (a causal query never sees the padding at the end)",
                                       lambda s: not s.causal),
            expected_detectors=("sharded_lengths",), cause="the padding is attended as keys, unmasked"),
        ShardedVariant(
            id="ulysses_heads_reordered", title="Heads come back in another order after the all-to-all",
            cls=UlyssesHeadsReordered, step="heads_back", reference_cls=UlyssesAttention,
            explanation="After the second all-to-all the received (rank, head of the rank) blocks are laid out as "
                        "(head of the rank, rank): each head is right, in another head's place, so the output "
                        "projection mixes them with the wrong weights. With one head a rank the two layouts are the "
                        "same, which is how the usual test (one head a rank) misses it.",
            symptom="Outputs differ; read through the output projection, each head's output is another head's.",
            fix="return x.transpose(0, 1).reshape(B, W * H_r, T // W, d_k)",
            detectable_when=Observable("two or more heads a rank", lambda s: s.num_heads // s.world_size >= 2),
            expected_detectors=("sharded_output",), cause="heads come back in another order",
            also_detected_by=("sharded_large_logits", "sharded_gradients")),
        ShardedVariant(
            id="bias_on_every_rank", title="Output projection's bias added on every rank", cls=BiasOnEveryRank,
            step="output_projection", reference_cls=HeadParallelAttention, audit_kwargs=dict(full),
            explanation="The row-parallel output projection adds its bias to each rank's partial sum before the "
                        "all-reduce, so the result carries it W times. With a zero-initialised bias it is invisible "
                        "until training moves the bias.",
            symptom="Every output is off by one constant vector, (W - 1) x the output bias.",
            fix="return out + self.out_bias  # once, after the sum",
            detectable_when=Observable("the output projection has a non-zero bias", lambda s: True),
            expected_detectors=("sharded_output",), cause="bias is added on each of the",
            also_detected_by=("sharded_large_logits", "sharded_lengths")),
        ShardedVariant(
            id="bias_grad_on_rank_zero", title="Replicated bias whose gradient reaches rank 0 only",
            cls=BiasGradientOnRankZero, step="output_projection", reference_cls=HeadParallelAttention,
            audit_kwargs=dict(full),
            explanation="The row-parallel output projection adds its bias on rank 0 only, before the all-reduce, so "
                        "that the sum holds it once: the output is exactly right. But the bias is a replicated "
                        "parameter, and its gradient now lands on rank 0 alone; without an all-reduce of that "
                        "gradient, the other ranks' copies never train and the replicas part at the first optimiser "
                        "step. Every forward test, and the input's gradient, pass.",
            symptom="The output and the input's gradient match; the output bias's gradient is whole on rank 0 and 0 on "
                    "every other rank (backward only, parameters only).",
            fix="return out if self.out_bias is None else out + self.out_bias  # after the sum, on every rank",
            detectable_when=Observable("parameter gradients compared (the form maps its parameters), a bias on the "
                                       "output projection", lambda s: True),
            expected_detectors=("sharded_gradients",), cause="reaches rank 0 only"),
        ShardedVariant(
            id="dropout_stream_per_rank", title="Replicated dropout drawn from a per-rank stream",
            cls=DropoutStreamPerRank, step="replicated_dropout", reference_cls=HeadParallelAttention,
            audit_kwargs=dict(full), output_dropout=0.1,
            explanation="The dropout after the all-reduce, on an output every rank holds alike, draws from a stream "
                        "seeded per rank (the model-parallel stream, right for the heads each rank holds alone). "
                        "Every rank drops other units, so the replicas' activations part from the first training "
                        "step; in eval mode, where every test runs, nothing differs.",
            symptom="In train mode, with every rank seeded alike, the ranks return different outputs.",
            fix="return F.dropout(out, p=self.output_dropout, training=self.training)  # the shared stream",
            detectable_when=Observable("train mode with dropout > 0 on the replicated output", lambda s: True),
            expected_detectors=("sharded_train_replicas",), cause="per-rank stream"),
        ShardedVariant(
            id="dropout_stream_of_its_own", title="Replicated dropout drawn from a stream of its own",
            cls=DropoutStreamOfItsOwn, step="replicated_dropout", reference_cls=HeadParallelAttention,
            audit_kwargs={**full, "draws_like_unsharded": True}, output_dropout=0.1,
            explanation="The dropout after the all-reduce draws from a generator of its own, seeded alike on every "
                        "rank (a model-parallel tracker's offset seed). The ranks agree, so a replica check passes; "
                        "but the masks are not the ones the unsharded layer draws under the same seed, so a layer that "
                        "promises a sharded run reproduces a run on one device (to compare the two, or to resume one "
                        "as the other) parts from it at the first training step.",
            symptom="In train mode, every rank seeded as the unsharded layer, the ranks agree with each other and "
                    "not with the unsharded layer; in eval mode nothing differs.",
            fix="return F.dropout(out, p=self.output_dropout, training=self.training)  # the unsharded layer's stream",
            detectable_when=Observable("train mode with dropout > 0, the layer promising the unsharded layer's draws",
                                       lambda s: True),
            expected_detectors=("sharded_train_draws",), cause="draws from another stream than the unsharded layer's"),
        ShardedVariant(
            id="fused_qkv_contiguous_rows", title="Fused QKV weight cut in contiguous rows", cls=FusedQKVContiguousRows,
            step="shard_qkv", reference_cls=HeadParallelAttention, audit_kwargs=dict(full),
            explanation="The stacked [W_Q; W_K; W_V] weight is cut into W contiguous row blocks, each read in thirds "
                        "as q, k and v of the rank's heads: at 4 ranks rank 0 gets query rows only and the last rank "
                        "value rows only. torch's ColwiseParallel on a fused projection makes this cut. "
                        "Shapes fit exactly, so nothing raises.",
            symptom="Outputs differ at every token on every rank.",
            fix="cut each of W_Q, W_K, W_V into the rank's heads and stack the three cuts",
            detectable_when=always, expected_detectors=("sharded_output",), cause="contiguous row blocks",
            also_detected_by=("sharded_large_logits", "sharded_lengths", "sharded_gradients")),
    ]


SHARDED_VARIANTS: dict[str, ShardedVariant] = {v.id: v for v in _entries()}

__all__ = ["SHARDED_VARIANTS", "ShardedSetting", "ShardedVariant"]
