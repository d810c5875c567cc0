"""What the sharded detectors are judged on: `ShardedContext`, the unsharded layer's outputs (a float64 golden copy's
and the audit dtype's) beside what every rank returned at every world size, and the `Need`s a sharded detector
declares on it, which `_registry.run()` evaluates before calling the check.

Every check reads the same few jobs the ranks ran (`JOBS`): one forward of a stacked batch (the example, then copies
with the tokens after each cut replaced), one backward, two forwards in train mode with every rank seeded alike (two
seeds; only for a layer that returns the whole output on every rank), one forward of a copy with its weights scaled
up, one forward of a length the world size does not divide; with packed documents declared, one forward of copies
with one rank's tokens of every other document replaced (`document_copies`); with data parallel replicas declared,
one forward of copies with one replica's sequences replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._registry import Need
from ..model._tolerance import Golden
from .layouts import rank_of_positions, shard_positions

FORWARD, BACKWARD, TRAIN, LARGE, UNEVEN = "forward", "backward", "train_mode", "large_logits", "uneven_length"
DOCUMENTS, REPLICAS = "documents", "replicas"
PARAMETERS = "parameter_gradients"  # not a job: what the backward job sends home beside the input's gradient
JOBS = (FORWARD, BACKWARD, TRAIN, LARGE, UNEVEN, DOCUMENTS, REPLICAS)
"""The jobs every rank runs, in this order (a job that raises ends its group; the next starts a fresh one)."""

LOGIT_SCALE = 32.0
"""Every weight of the large-logits copy is multiplied by this: q and k by 32 each, so the logits by ~1000 (input
scaling does nothing to a pre-norm layer). The reference's logits, of RMS ~0.5 at torch's default initialisation, then
reach several hundred: past float32's exp range (88.7), where a log-sum-exp merge that exponentiates overflows."""


@dataclass(frozen=True)
class Reference:
    """The unsharded layer's answer to one job's input: the float64 copy's (`golden`, None when the audit runs in
    float64) and the audit dtype's (`same`)."""

    golden: Tensor | None
    same: Tensor
    dtype: torch.dtype

    def judge(self, test: Tensor, where: str) -> tuple[bool, float, float, str]:
        """The model audit's rule (`Golden`): the sharded answer's error against the float64 copy may be 10 x the
        unsharded layer's own in this dtype, plus a floor."""
        return Golden(self.golden, self.same, self.dtype).judge(test, where)


@dataclass
class ShardedContext:
    layer: nn.Module  # the unsharded layer, in the audit's dtype (a copy: the user's stays untouched)
    golden_layer: nn.Module | None  # its float64 copy, None when the audit runs in float64
    takes: str  # "shard": the sharded layer takes its shard and the positions; "full": the whole sequence
    layout: str
    causal: bool
    dtype: torch.dtype
    num_heads: int | None
    world_sizes: tuple[int, ...]
    seq_len: int
    batch: int
    seed: int
    cuts: tuple[int, ...]  # the forward batch: the example, then a copy per cut with the tokens after it replaced
    inputs: dict = field(default_factory=dict)  # {job: Tensor or {W: Tensor}} the unsharded input of each job
    references: dict = field(default_factory=dict)  # {job: Reference or {W: Reference}}
    outputs: dict = field(default_factory=dict)  # {W: {job: [each rank's answer]}}
    failures: dict = field(default_factory=dict)  # {W: [RankFailure]} in the order they happened
    groups: dict = field(default_factory=dict)  # {W: [Session]} the groups started, for timings
    readings: dict = field(default_factory=dict)
    large_layer: nn.Module | None = None  # the float32 copy with every weight scaled by LOGIT_SCALE
    device: str = "cpu"  # where the ranks run: "cpu" (gloo) or "cuda" (NCCL, rank r on GPU r)
    draws_like_unsharded: bool = False  # the layer promises its train-mode draws are the unsharded layer's
    train_references: tuple = ()  # the unsharded layer's train-mode outputs under TRAIN_SEEDS, when promised
    documents: Tensor | None = None  # (T,) the declared document id of each token (packed sequences), or None
    document_copies: dict = field(default_factory=dict)  # {W: [(document d, rank r)]}: copy i + 1 of the DOCUMENTS
    # job's input replaces the tokens rank r holds of every document but d (the example is copy 0)
    parameter_references: dict = field(default_factory=dict)  # {unsharded parameter name: Reference of its gradient}
    data_parallel: int = 1  # replicas: rank r is replica r // (W / data_parallel), context rank r % (W / data_parallel)

    def piece(self, rank: int, W: int, t: int) -> tuple[slice, Tensor]:
        """What rank `rank` of W holds of a (B, t) input: the rows of its replica (every data_parallel-th sequence
        from its replica's index) and the positions of its context rank's shard."""
        cp = W // self.data_parallel
        return slice(rank // cp, None, self.data_parallel), shard_positions(self.layout, t, rank % cp, cp)

    @property
    def train_seeds(self) -> tuple[int, int]:
        """The seeds the train-mode job sets on every rank (and the unsharded layer's draws are taken under)."""
        return self.seed, self.seed + 1

    def failure(self, W: int, job: str):
        """The first failure at world size W in `job` (None if it ran everywhere)."""
        return next((f for f in self.failures.get(W, []) if f.job == job), None)

    def answers(self, W: int, job: str) -> list | None:
        return self.outputs.get(W, {}).get(job)

    def reference(self, job: str, W: int) -> Reference:
        ref = self.references[job]
        return ref[W] if isinstance(ref, dict) else ref

    def job_input(self, job: str, W: int) -> Tensor:
        x = self.inputs[job]
        return x[W] if isinstance(x, dict) else x

    def gathered(self, W: int, job: str, rank: int = 0) -> Tensor:
        """The sharded layer's whole answer to `job` at world size W: the ranks' shards put back at their positions
        (takes="shard"), or rank `rank`'s whole output (takes="full"). ValueError with the shapes when a rank's
        answer does not fit."""
        answers = self.answers(W, job)
        expected = tuple(self.reference(job, W).same.shape)
        if self.takes == "full":
            if tuple(answers[rank].shape) != expected:
                raise ValueError(f"rank {rank} returned shape {tuple(answers[rank].shape)} for the whole sequence; "
                                 f"expected {expected} like the unsharded layer's")
            return answers[rank]
        x = self.job_input(job, W)
        t, first = x.shape[1], answers[0]
        whole = torch.full((x.shape[0], t, *first.shape[2:]), float("nan"), dtype=first.dtype)
        for r, part in enumerate(answers):
            rows, positions = self.piece(r, W, t)
            n = len(range(*rows.indices(x.shape[0])))
            if part.dim() < 2 or part.shape[0] != n or part.shape[1] != len(positions) or \
                    part.shape[2:] != first.shape[2:]:
                raise ValueError(f"rank {r} returned shape {tuple(part.shape)} for its shard of {len(positions)} "
                                 f"tokens; expected ({n}, {len(positions)}, ...) like rank 0's")
            whole[rows, positions] = part
        if tuple(whole.shape) != expected:
            raise ValueError(f"the gathered shards have shape {tuple(whole.shape)}; expected {expected} like the "
                             f"unsharded layer's")
        return whole

    def owners(self, t: int, W: int) -> Tensor:
        """(T,) the rank that holds each position in the declared layout (its context rank, with data parallel)."""
        return rank_of_positions(self.layout, t, W // self.data_parallel)

    def holder(self, row: int, position: int, t: int, W: int) -> int:
        """The rank of W that holds token `position` of the job input's sequence `row` (of length t): its replica's
        (row % data_parallel, as `piece` deals them) context rank for that position; without data parallelism, the
        context rank itself."""
        cp = W // self.data_parallel
        return (row % self.data_parallel) * cp + int(self.owners(t, W)[position])


def _applies(takes: str):
    return lambda ctx: ctx.takes == takes


CAUSAL_SHARDED = Need("{causal}", lambda ctx: ctx.causal,
                      "the layer is not audited as causal (pass {causal} if it promises causality)")
FULL_OUTPUT = Need('takes="full"', _applies("full"),
                   'each rank returns its own shard (takes="shard"): there is no output the ranks must share')
PROMISED_DRAWS = Need("draws_like_unsharded=True", lambda ctx: ctx.draws_like_unsharded,
                      "the layer does not promise that its train-mode draws are the unsharded layer's (pass "
                      "draws_like_unsharded=True if it does)")
DECLARED_DOCUMENTS = Need("documents=", lambda ctx: ctx.documents is not None,
                          "no packed documents declared (pass documents= the document lengths or ids per token if "
                          "the layer attends within documents)")
DATA_PARALLEL = Need("data_parallel= 2 or more", lambda ctx: ctx.data_parallel > 1,
                     "no data parallelism declared beside the context parallelism (pass data_parallel= the number "
                     "of replicas if the sharded layer builds its context-parallel groups inside data-parallel ones)")
KNOWN_HEADS = Need("the number of heads", lambda ctx: ctx.num_heads is not None,
                   "the number of heads is unknown: pass num_heads= (or give the layer a num_heads attribute)")

__all__ = ["BACKWARD", "CAUSAL_SHARDED", "DATA_PARALLEL", "DECLARED_DOCUMENTS", "DOCUMENTS", "FORWARD", "PARAMETERS",
           "REPLICAS", "FULL_OUTPUT", "JOBS", "KNOWN_HEADS", "LARGE", "LOGIT_SCALE",
           "PROMISED_DRAWS", "Reference", "ShardedContext", "TRAIN", "UNEVEN"]
