"""Naming the cause of a sharded output that differs, from the evidence only (each reader returns a sentence and a
fix, or None when its evidence is not there), tried in this order:

    constant offset      the difference is one vector at every token, a whole multiple k of one of the layer's
                         (D,) biases: that bias added k more times (on each of the k + 1 ranks)
    token permutation    every output token equals some token of the unsharded output, in another order: the layout's
                         order when the gather did not undo it
    head permutation     before the output projection (read through its weights), every head equals some head of the
                         unsharded layer, in another order: the all-to-all's way back
    heads scaled         read the same way, every head's output is the unsharded head's times a factor from 1 to the
                         number of ranks, per token: the weights of a row sum to that factor, not 1 (the partial
                         results merged with the larger normaliser, not their log-sum-exp)
    fused rows cut       the output equals the unsharded layer's with its fused [W_Q; W_K; W_V] weight dealt to the
                         ranks' heads in contiguous row blocks: a column-parallel cut of the stack, not of each part
    replicas mixed       (data parallel declared) a replica's outputs move when only another replica's sequences
                         change: the context-parallel groups hold ranks of two replicas (`replica_leaks`)
    documents crossed    (packed documents declared) a document's outputs move when only another document's tokens
                         on one rank change: the document mask is not applied to that rank's keys (`document_leaks`)
    only rank 0 matches  rank 0's tokens right, every other rank's wrong: positions or causal offsets that restart
                         at 0 on every rank
and otherwise the ranks whose tokens differ.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._judge import token_errors
from .layouts import ranks_order


@dataclass(frozen=True)
class Cause:
    text: str
    fix: str


def named_cause(ctx, W: int, test: Tensor, target: Tensor, x: Tensor, allowed: float, scale: float) -> Cause:
    """The first reader whose evidence holds, else the ranks whose tokens differ. `test` and `target` (B, T, D) in
    float64; `x` the input they answer; `allowed` the tolerance relative to `scale`."""
    for reader in (replicas_mixed, documents_crossed, constant_offset, token_permutation, head_permutation,
                   heads_scaled, fused_rows_cut, only_rank_zero):
        try:
            cause = reader(ctx, W, test, target, x, allowed, scale)
        except Exception:  # a reader that cannot read this layer says nothing
            cause = None
        if cause is not None:
            return cause
    return differing_ranks(ctx, W, test, target, allowed, scale)


def constant_offset(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    diff = test - target  # (B, T, D)
    if not bool(torch.isfinite(diff).all()):
        return None
    offset = diff.flatten(0, -2).mean(0)  # (D,)
    if float((diff - offset).abs().max()) / scale > allowed or float(offset.abs().max()) / scale <= allowed:
        return None  # not one vector at every token, or none at all
    for name, p in ctx.layer.named_parameters():
        if not name.endswith("bias") or p.shape != offset.shape:
            continue
        bias = p.detach().double()
        k = float(offset @ bias / (bias @ bias)) if float(bias @ bias) > 0 else 0.0
        if round(k) >= 1 and abs(k - round(k)) < 1e-3 and float((offset - round(k) * bias).abs().max()) / scale <= allowed:
            k = round(k)
            ranks = f"on each of the {W} ranks" if k == W - 1 else f"{k + 1} times"
            return Cause(f"every output is off by one constant vector, {k} x `{name}`: the bias is added {ranks} "
                         f"before the sum over ranks",
                         f"add `{name}` once, after the all-reduce (or on rank 0 only), not on every rank")
    return Cause(f"every output is off by one constant vector (largest entry {float(offset.abs().max()) / scale:.3g} "
                 f"of the outputs' RMS), a multiple of none of the layer's biases",
                 "look for a term added per rank before the all-reduce (a bias, a residual, a norm's shift)")


def _matching(test: Tensor, target: Tensor, scale: float, allowed: float) -> Tensor | None:
    """(N,) for each row of `test` (N, F) the row of `target` it equals, or None unless every row equals one."""
    distance = torch.cdist(test, target, p=float("inf")) / scale  # (N, N): the greatest entry's difference
    best = distance.min(dim=1)
    if not bool((best.values <= allowed).all()):
        return None
    return best.indices


def token_permutation(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    B, T, _ = test.shape
    perms = [_matching(test[b], target[b], scale, allowed) for b in range(B)]
    if any(p is None for p in perms) or any(not torch.equal(p, perms[0]) for p in perms):
        return None
    perm = perms[0]
    if torch.equal(perm, torch.arange(T)) or len(set(perm.tolist())) != T:
        return None
    moved = [f"{i}<-{int(j)}" for i, j in enumerate(perm) if i != int(j)]
    if torch.equal(perm, ranks_order(ctx.layout, T, W)):
        return Cause(f"the tokens come back in the ranks' order, not in the sequence's: the {ctx.layout} order is not "
                     f"undone on the output (output position <- token: {', '.join(moved[:6])}"
                     f"{', ...' if len(moved) > 6 else ''})",
                     "index the gathered output with the inverse of the layout's order (its argsort) before returning it")
    return Cause(f"the tokens come back permuted ({len(moved)} of {T} moved; output position <- token: "
                 f"{', '.join(moved[:6])}{', ...' if len(moved) > 6 else ''})",
                 "undo the order the sequence was cut in when the shards are gathered")


def _output_projection(layer: nn.Module, x: Tensor, out: Tensor) -> tuple[nn.Linear, Tensor] | None:
    """The square Linear whose output is the layer's output, and its input (the merged heads) on `x`."""
    seen: dict = {}
    hooks = [m.register_forward_hook(lambda m, args, result: seen.setdefault(m, (args[0], result)))
             for m in layer.modules() if isinstance(m, nn.Linear) and m.in_features == m.out_features]
    try:
        with torch.no_grad():
            layer(x)
    finally:
        for h in hooks:
            h.remove()
    for m, (inp, result) in seen.items():
        if result.shape == out.shape and torch.allclose(result.double(), out, rtol=1e-6, atol=1e-9):
            return m, inp.double()
    return None


def _read_heads(ctx, test, target, x) -> tuple[Tensor, Tensor] | None:
    """Both outputs read back through the layer's output projection, head by head: (the sharded one's, the unsharded
    one's), each (B*T, H, d_k); None where the layer has no square output projection or its heads are unknown."""
    H = ctx.num_heads
    layer = ctx.golden_layer if ctx.golden_layer is not None else ctx.layer
    found = _output_projection(layer, x.double(), target) if H else None
    if found is None:
        return None
    proj, merged = found  # (B, T, D): the heads, side by side, before the output projection
    weight = proj.weight.detach().double()  # (D, D)
    bias = proj.bias.detach().double() if proj.bias is not None else 0.0
    read = torch.linalg.solve(weight, (test - bias).flatten(0, -2).T).T  # (B*T, D): undo out = z W^T + b
    return read.view(-1, H, merged.shape[-1] // H), merged.flatten(0, -2).view(-1, H, merged.shape[-1] // H)


def _head_tolerance(allowed: float) -> float:
    """What reading through the output projection's inverse may add (its condition number times the tolerance)."""
    return max(allowed, 1e-6) * 100


def head_permutation(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    found = _read_heads(ctx, test, target, x)
    if found is None:
        return None
    read, merged = found  # (B*T, H, d_k)
    H = read.shape[1]
    heads = lambda z: z.transpose(0, 1).flatten(1)  # (H, B*T*d_k)  # noqa: E731
    head_scale = float(merged.square().mean().sqrt()) or 1.0
    perm = _matching(heads(read), heads(merged), head_scale, _head_tolerance(allowed))
    if perm is None or torch.equal(perm, torch.arange(H)) or len(set(perm.tolist())) != H:
        return None
    moved = [f"{i}<-{int(j)}" for i, j in enumerate(perm) if i != int(j)]
    return Cause(f"the heads come back in another order after the all-to-all ({len(moved)} of {H} heads moved; slot "
                 f"<- head: {', '.join(moved[:6])}{', ...' if len(moved) > 6 else ''}): each head is right, its place "
                 f"is not", "after the all-to-all back, lay the heads out as (rank, head of the rank), the order the "
                        "first all-to-all sent them in")


def heads_scaled(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    """Each (token, head) output a multiple c of the unsharded one, 1 <= c <= W: a merge whose joint normaliser is the
    larger of the partial ones gives exactly exp(logsumexp(l) - max(l)) x the right output, between 1 and the number
    of blocks merged (the ranks)."""
    found = _read_heads(ctx, test, target, x)
    if found is None:
        return None
    read, merged = found  # (B*T, H, d_k)
    head_scale = float(merged.square().mean().sqrt()) or 1.0
    size = merged.square().sum(-1)  # (B*T, H)
    live = size > (1e-6 * head_scale) ** 2 * merged.shape[-1]  # a head whose output is ~0 has no factor to read
    factor = torch.where(live, (read * merged).sum(-1) / size.clamp_min(1e-300), torch.ones_like(size))  # (B*T, H)
    left = float((read - factor[..., None] * merged).abs().amax()) / head_scale
    tol = _head_tolerance(allowed)
    low, high = float(factor[live].min()), float(factor[live].max())
    if left > tol or low < 1 - tol or high > W + tol or high <= 1 + 10 * tol:
        return None
    grown = int((factor[live] > 1 + 10 * tol).sum())
    return Cause(f"read through the output projection, every head's output is the unsharded head's times a factor "
                 f"from {low:.3g} to {high:.3g} ({grown} of {int(live.sum())} token-heads above 1; at most the {W} "
                 f"ranks' blocks): the weights of a row sum to that factor, not 1: the partial results are rescaled to "
                 f"the larger normaliser, not to their log-sum-exp",
                 "merge with the joint normaliser: new = logaddexp(lse, part_lse); out = out * exp(lse - new) + "
                 "part * exp(part_lse - new)")


def _fused_projection(layer: nn.Module) -> tuple[str, nn.Linear] | None:
    """The one Linear (D -> 3D) that stacks W_Q, W_K, W_V, and its name."""
    fused = [(name, m) for name, m in layer.named_modules()
             if isinstance(m, nn.Linear) and m.out_features == 3 * m.in_features]
    return fused[0] if len(fused) == 1 else None


def contiguous_cut_rows(D: int, W: int) -> Tensor:
    """(3D,) the rows of the stack [W_Q; W_K; W_V] each row of an honest per-head cut holds when the stack is cut in W
    contiguous blocks instead: rank r's block, read in thirds as its heads' q, k and v rows."""
    rows = torch.empty(3 * D, dtype=torch.long)
    for r in range(W):
        for part in range(3):  # q, k, v
            mine = torch.arange(part * D + r * D // W, part * D + (r + 1) * D // W)  # where the honest cut reads
            rows[mine] = torch.arange(r * 3 * D // W + part * D // W, r * 3 * D // W + (part + 1) * D // W)
    return rows


def fused_rows_cut(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    layer = ctx.golden_layer if ctx.golden_layer is not None else ctx.layer
    found = None if layer is None else _fused_projection(layer)
    if found is None:
        return None
    name, fused = found
    D = fused.in_features
    if D % W or (ctx.num_heads is not None and ctx.num_heads % W):
        return None
    rows = contiguous_cut_rows(D, W)
    replay = copy.deepcopy(layer)
    proj = dict(replay.named_modules())[name]
    with torch.no_grad():
        proj.weight.copy_(fused.weight[rows])
        if fused.bias is not None:
            proj.bias.copy_(fused.bias[rows])
        out = replay(x.to(fused.weight.dtype))
    out = (out[0] if isinstance(out, (tuple, list)) else out).double()
    if out.shape != test.shape or float(token_errors(test, out, scale).max()) > allowed:
        return None
    first = " and ".join(("W_Q", "W_K", "W_V")[: -(-3 // W)])  # what rank 0's 3D/W rows hold
    return Cause(f"the output equals the unsharded layer's with `{name}.weight`, the stack [W_Q; W_K; W_V], cut in {W} "
                 f"contiguous row blocks, each read in thirds as its heads' q, k and v (rank 0's block holds {first} "
                 f"rows only)",
                 f"cut each of W_Q, W_K and W_V of `{name}` by heads and stack the rank's three cuts (a column-parallel "
                 f"plan on a fused projection cuts the stack: split it into q, k, v, or shard it by parts)")


@dataclass(frozen=True)
class Leak:
    """Document d's outputs that moved when only rank r's tokens of other documents were replaced: their positions,
    the ranks that hold them, and the greatest change (relative to the outputs' RMS)."""

    document: int
    rank: int
    moved: tuple[int, ...]
    owners: tuple[int, ...]
    change: float


def document_leaks(ctx, W: int, tol: float) -> list[Leak] | None:
    """Every (document, rank) copy of the DOCUMENTS job at world size W whose document's outputs moved by more than
    `tol`, the greatest first; None where the job has no answer there (or its answers do not fit together)."""
    from ._context import DOCUMENTS
    from ..model._tolerance import scale_of

    if ctx.documents is None or ctx.answers(W, DOCUMENTS) is None:
        return None
    try:
        out = ctx.gathered(W, DOCUMENTS).double()  # (B * (1 + copies), T, D)
    except ValueError:
        return None
    B, ids, owner = ctx.batch, ctx.documents, ctx.owners(ctx.seq_len, W)
    base = out[:B]
    scale = scale_of(base)
    leaks = []
    for i, (d, r) in enumerate(ctx.document_copies[W], start=1):
        change = token_errors(out[i * B:(i + 1) * B], base, scale).amax(dim=0)  # (T,)
        moved = torch.nonzero((change > tol) & (ids == d)).flatten()
        if len(moved):
            leaks.append(Leak(d, r, tuple(moved.tolist()), tuple(owner[moved].tolist()), float(change[moved].max())))
    return sorted(leaks, key=lambda leak: -leak.change)


DOCUMENTS_FIX = ("mask every key block by its keys' own document ids: send them round the ring with the keys (or read "
                 "them at the keys' global positions), never the receiving rank's own, causal inside the document")


def leak_cause(ctx, W: int, leaks: list[Leak]) -> Cause:
    """The sentence for the greatest leak: which tokens (document, rank, positions, where the document starts) attend
    which document's keys on which rank, and whether they crossed ranks to do it."""
    leak, ids, owner = leaks[0], ctx.documents, ctx.owners(ctx.seq_len, W)
    q = max(set(leak.owners), key=leak.owners.count)  # the rank holding most of the moved tokens
    mine = [t for t, o in zip(leak.moved, leak.owners) if o == q]
    start = int(torch.nonzero(ids == leak.document)[0])
    seen = sorted({int(i) for i in ids[(owner == leak.rank) & (ids != leak.document)].tolist()})
    which = ("the previous document" if seen == [leak.document - 1] else
             "earlier documents" if all(s < leak.document for s in seen) else
             f"document{'s' if len(seen) > 1 else ''} {', '.join(map(str, seen))}")
    where = (f"held on rank {leak.rank}: the document mask is not applied to the key blocks received from other ranks"
             if q != leak.rank else "held on their own rank: the document mask is not applied")
    listed = ", ".join(map(str, mine[:6])) + (", ..." if len(mine) > 6 else "")
    return Cause(f"the tokens of document {leak.document} on rank {q} (positions {listed}; the document starts at "
                 f"{start}) attend {which}, {where} ({len(leaks)} document x rank "
                 f"probe{'s' if len(leaks) != 1 else ''} leaked at {W} ranks)",
                 DOCUMENTS_FIX)


def documents_crossed(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    from .._thresholds import UNCHANGED, tolerance

    leaks = document_leaks(ctx, W, tolerance(UNCHANGED, ctx.dtype))
    return leak_cause(ctx, W, leaks) if leaks else None


def replica_leaks(ctx, W: int, tol: float) -> list[tuple[int, int, tuple[int, ...], float]] | None:
    """[(replica i, replica j, the ranks of i whose outputs moved, the greatest change)] for every pair where changing
    only replica j's sequences moved replica i's outputs by more than `tol`, the greatest first; None where the
    REPLICAS job has no answer at W."""
    from ._context import REPLICAS
    from ..model._tolerance import scale_of

    dp = ctx.data_parallel
    if dp == 1 or ctx.answers(W, REPLICAS) is None:
        return None
    try:
        out = ctx.gathered(W, REPLICAS).double()  # (B * (1 + dp), T, D)
    except ValueError:
        return None
    B, cp, owner = ctx.batch, W // dp, ctx.owners(ctx.seq_len, W)
    base = out[:B]
    scale = scale_of(base)
    leaks = []
    for j in range(dp):
        change = token_errors(out[(j + 1) * B:(j + 2) * B], base, scale)  # (B, T)
        for i in range(dp):
            if i == j:
                continue
            moved = change[i::dp].amax(dim=0)  # (T,) replica i's sequences
            if float(moved.max()) > tol:
                ranks = tuple(sorted({i * cp + int(c) for c in owner[moved > tol].tolist()}))
                leaks.append((i, j, ranks, float(moved.max())))
    return sorted(leaks, key=lambda leak: -leak[3])


REPLICAS_FIX = ("build the context-parallel groups from adjacent ranks: replica i's group is ranks i * cp .. "
                "(i + 1) * cp - 1 (rank // cp is the replica, rank % cp the context rank), the layout the data is "
                "given in")


def replica_cause(ctx, W: int, leaks) -> Cause:
    i, j, ranks, change = leaks[0]
    dp = ctx.data_parallel
    cp = W // dp
    swapped = [sorted(range(k, W, dp)) for k in range(dp)]
    return Cause(f"replica {i}'s outputs on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} move "
                 f"when only replica {j}'s sequences change (by up to {change:.3g} of the outputs' RMS): the "
                 f"context-parallel groups mix the replicas' ranks (at {W} ranks as {dp} replicas x {cp}: replica "
                 f"{i} is ranks {i * cp}..{(i + 1) * cp - 1}; groups built by rank % {dp} would be "
                 f"{', '.join(map(str, swapped))})", REPLICAS_FIX)


def replicas_mixed(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    from .._thresholds import UNCHANGED, tolerance

    leaks = replica_leaks(ctx, W, tolerance(UNCHANGED, ctx.dtype))
    return replica_cause(ctx, W, leaks) if leaks else None


def only_rank_zero(ctx, W, test, target, x, allowed, scale) -> Cause | None:
    errors = token_errors(test, target, scale).amax(dim=0)  # (T,)
    owner = ctx.owners(test.shape[1], W)
    worst = [float(errors[owner == r].max()) for r in range(W)]
    if worst[0] <= allowed and all(w > allowed for w in worst[1:]):
        return Cause(f"the outputs match on rank 0's tokens only (every other rank's are off, by up to "
                     f"{max(worst[1:]):.3g} of the outputs' RMS): positions or causal offsets restart at 0 on every "
                     f"rank", "give each rank its shard's global positions (the causal mask and any positional "
                              "encoding must see where the shard sits in the sequence)")
    return None


def differing_ranks(ctx, W, test, target, allowed, scale) -> Cause:
    errors = token_errors(test, target, scale).amax(dim=0)  # (T,)
    owner = ctx.owners(test.shape[1], W)
    bad = [r for r in range(W) if float(errors[owner == r].max()) > allowed]
    return Cause(f"the tokens of rank{'s' if len(bad) != 1 else ''} {', '.join(map(str, bad))} of {W} differ",
                 "compare the sharded layer with the unsharded one step by step on those ranks' tokens")


__all__ = ["Cause", "DOCUMENTS_FIX", "Leak", "REPLICAS_FIX", "document_leaks", "leak_cause", "named_cause",
           "replica_cause", "replica_leaks"]
