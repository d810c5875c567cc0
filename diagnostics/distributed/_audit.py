"""audit_sharded(): audit a layer split across processes against its unsharded self, at each world size."""

from __future__ import annotations

import copy
import importlib
import time
from dataclasses import replace

import torch
from torch import nn

from .._errors import AuditUsageError, expect
from .._thresholds import UNCHANGED, tolerance
from .._guard import untouched
from .._registry import SHARDED_DETECTORS, phrase, run
from .._thresholds import dtype_name
from . import MODULES
from ._context import (BACKWARD, DOCUMENTS, FORWARD, JOBS, LARGE, LOGIT_SCALE, PARAMETERS, REPLICAS, TRAIN,
                       UNEVEN, Reference, ShardedContext)
from ._ranks import Job, distributed_available, in_a_fork, run_group
from ._report import ShardedReport
from .layouts import LAYOUTS

for _name in MODULES:  # the detectors register as their modules load, in this order
    importlib.import_module(f"{__package__}.{_name}")

TAKES = ("shard", "full")
CORE = ("sharded_output",)  # an audit that did not measure it is inconclusive, never passed


def audit_sharded(layer: nn.Module, sharded, *, world_sizes=(2, 4), causal: bool = False, takes: str = "shard",
                  layout: str = "contiguous", seq_len: int = 16, batch: int = 2, num_heads: int | None = None,
                  dtype: torch.dtype | None = None, seed: int = 0, timeout: float = 30.0,
                  detectors: list[str] | None = None, call=None, check_unsharded: bool = False,
                  device: str = "cpu", draws_like_unsharded: bool = False, documents=None,
                  data_parallel: int = 1) -> ShardedReport:
    """Audit `sharded`, a layer split across processes, against `layer`, its unsharded self.

    `layer`: the unsharded module, `layer(x)` on (B, T, D) returning the output (or a tuple whose first item it is).
    `sharded(layer, rank, world_size, group)`: builds the sharded form on one rank from (a copy of) that layer, so the
    weights are the same; `group` is the process group of the ranks (gloo here). `takes="shard"`: the sharded layer
    is called `m(x_shard, positions)` on its own shard in `layout` ("contiguous", "zigzag", "striped") and the global
    positions of its tokens, and returns its shard's output, which the audit gathers; `takes="full"`: it is called
    `m(x)` on the whole sequence on every rank and returns the whole output. `call(m, x[, positions])` replaces that
    call. The audit starts `world_size` forked ranks itself for each of `world_sizes`, with a collective timeout of
    `timeout` seconds, and reports a rank that raises, hangs or exits, naming it. `causal`: the layer promises
    causality. `dtype`: the dtype to audit in (default: the layer's); float64 is judged exactly, others against a
    float64 copy. `check_unsharded=True` also runs `diagnostics.audit()` on the unsharded layer (`report.unsharded`),
    so a disagreement says which side is wrong. `device="cuda"`: the ranks run on GPUs 0..W-1 with NCCL (the
    references stay on the CPU; see docs/sharded.md). `draws_like_unsharded=True`: the layer promises that in train
    mode, every rank seeded as the unsharded layer is, it draws what the unsharded layer draws (its output equals the
    unsharded layer's train-mode output; `takes="full"`). `documents`: the sequences are packed documents, and the
    layer (sharded and not) attends within each only (causal inside it where causal): their lengths, a list of ints
    summing to `seq_len`, or the document id of each token, a (seq_len,) integer tensor; the audit then checks that
    no output moves when another document's tokens on one rank change (`sharded_documents`). `data_parallel`: the
    ranks are that many data-parallel replicas of W / data_parallel context-parallel ranks each, which the sharded
    layer groups itself (from the group of all ranks it is given): rank r is replica r // (W / data_parallel), holding
    context shard r % (W / data_parallel) of its replica's sequences (every data_parallel-th of the batch); the audit
    checks that no replica's outputs move when only another replica's sequences change (`sharded_data_parallel`).
    """
    expect(isinstance(layer, nn.Module), "layer: the unsharded nn.Module", type(layer).__name__,
           "pass the module the sharded form must agree with")
    expect(callable(sharded), "sharded: a factory (layer, rank, world_size, group) -> module", repr(sharded),
           "pass e.g. sharded=lambda layer, rank, world_size, group: RingAttention(layer, group)")
    world_sizes = tuple(world_sizes)
    expect(world_sizes and all(isinstance(w, int) and not isinstance(w, bool) and w >= 2 for w in world_sizes),
           "world sizes: ints >= 2", f"world_sizes={world_sizes!r}", "pass e.g. world_sizes=(2, 4)")
    expect(device in ("cpu", "cuda"), 'device "cpu" or "cuda"', f"device={device!r}", 'pass device="cuda" for NCCL')
    for W in (world_sizes if device == "cuda" else (2,)):
        ok, why = distributed_available(device, W)
        expect(ok, f"torch.distributed able to run {W} ranks on {device}", why,
               "install a torch build with distributed" if device == "cpu" else "see the reason")
    expect(takes in TAKES, f"takes in {TAKES}", f"takes={takes!r}",
           'takes="shard" if the sharded layer takes its own shard and positions, "full" for the whole sequence')
    expect(layout in LAYOUTS, f"layout in {LAYOUTS}", f"layout={layout!r}", "pass layout='contiguous'")
    expect(isinstance(causal, bool), "causal=True or causal=False", f"causal={causal!r}", "pass a bool")
    expect(isinstance(draws_like_unsharded, bool), "draws_like_unsharded=True or False",
           f"draws_like_unsharded={draws_like_unsharded!r}", "pass a bool")
    pieces = max(2 * w if layout == "zigzag" else w for w in world_sizes)
    expect(isinstance(seq_len, int) and seq_len >= 2 and seq_len % pieces == 0,
           f"a seq_len divisible by {pieces} (the {layout} layout over {max(world_sizes)} ranks)", f"seq_len={seq_len!r}",
           f"pass seq_len={pieces * max(1, -(-16 // pieces))}")
    ids = _document_ids(documents, seq_len, layer)
    expect(isinstance(data_parallel, int) and not isinstance(data_parallel, bool) and data_parallel >= 1
           and all(w % data_parallel == 0 for w in world_sizes) and batch % data_parallel == 0
           and (data_parallel == 1 or takes == "shard"),
           "data_parallel: an int >= 1 dividing every world size and the batch, with takes=\"shard\"",
           f"data_parallel={data_parallel!r}, world_sizes={world_sizes}, batch={batch}, takes={takes!r}",
           "pass e.g. data_parallel=2 with world_sizes=(4,) and batch=2 (a sharded layer that takes its own shard)")
    expect(timeout > 0, "a positive timeout in seconds", f"timeout={timeout!r}", "pass e.g. timeout=30")
    chosen = list(SHARDED_DETECTORS) if detectors is None else list(detectors)
    unknown = [d for d in chosen if d not in SHARDED_DETECTORS]
    expect(not unknown, f"detector ids from {sorted(SHARDED_DETECTORS)}", f"{unknown}", "check the spelling")

    started = time.perf_counter()
    with untouched(layer, torch.device("cpu")):
        ctx = _context(layer, world_sizes=world_sizes, causal=causal, takes=takes, layout=layout, seq_len=seq_len,
                       batch=batch, num_heads=num_heads, dtype=dtype, seed=seed)
        ctx.device = device
        if data_parallel > 1:
            _replica_job(ctx, data_parallel)
        if ids is not None:
            _document_job(ctx, ids)
        if draws_like_unsharded:
            ctx.draws_like_unsharded = True
            ctx.train_references = _train_references(ctx)
        jobs = {W: _jobs(ctx, sharded, W, call) for W in world_sizes}
        for W in world_sizes:
            _run(ctx, W, jobs[W], timeout, device)
        results = [_settled(run(SHARDED_DETECTORS[d], ctx, subject="sharded layer")) for d in chosen]
        unsharded = None
        if check_unsharded:
            from .._audit import audit

            unsharded = audit(ctx.layer, causal=causal, seq_len=seq_len, seed=seed)
    status, reason = _status(results, unsharded)
    return ShardedReport(layer=type(layer).__name__, status=status, status_reason=reason, results=results,
                         causal=causal, takes=takes, layout=layout, world_sizes=world_sizes, seq_len=seq_len,
                         dtype=dtype_name(ctx.dtype), seconds=time.perf_counter() - started,
                         groups={W: [(s.startup_s, s.seconds) for s in ctx.groups[W]] for W in world_sizes},
                         unsharded=unsharded, documents=None if ids is None else ids.tolist(),
                         data_parallel=data_parallel)


def _settled(result):
    return replace(result, message=phrase(result.message), fix=phrase(result.fix))


def _status(results, unsharded) -> tuple[str, str]:
    by_id = {r.detector: r for r in results}
    if any(r.verdict == "fail" for r in results):
        failed = [r.detector for r in results if r.verdict == "fail"]
        note = ""
        if unsharded is not None and not unsharded.passed:
            note = f"; the unsharded layer's own audit {unsharded.status} too ({', '.join(unsharded.fired())})"
        return "failed", f"failed: {', '.join(failed)}{note}"
    errors = [r.detector for r in results if r.verdict == "error"]
    core = [d for d in CORE if d in by_id and not by_id[d].measured]
    if errors or core:
        return "inconclusive", f"not measured: {', '.join(errors + core)}"
    return "passed", ""


def _inputs(gen: torch.Generator, shape, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _forward_all(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = layer(x)
    return (out[0] if isinstance(out, (tuple, list)) else out).detach()


def _gradient(layer: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    (out * cotangent.to(out.dtype)).sum().backward()
    return x.grad.detach()


def _parameter_gradients(layer: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> dict:
    """{name: the gradient of each parameter} of the unsharded layer under the backward job's loss (zeros where
    unused)."""
    layer.zero_grad(set_to_none=True)
    out = layer(x.detach())
    out = out[0] if isinstance(out, (tuple, list)) else out
    (out * cotangent.to(out.dtype)).sum().backward()
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return grads


def _scaled(layer: nn.Module, factor: float, dtype: torch.dtype) -> nn.Module:
    scaled = copy.deepcopy(layer).to(dtype).eval()
    with torch.no_grad():
        for p in scaled.parameters():
            p.mul_(factor)
    return scaled


def _reference(job_fn, layer: nn.Module, golden: nn.Module | None, dtype, *args) -> Reference:
    """The unsharded layer's answer (and its float64 copy's): the yardstick, so a layer that cannot give one is a usage
    error, not a finding about the sharded form."""
    try:
        same = job_fn(layer, *args)
        gold = None if golden is None else job_fn(golden, *(a.double() for a in args))
    except Exception as error:
        shape = tuple(args[0].shape)
        raise AuditUsageError(f"expected the unsharded layer to run as layer(x) on x of shape {shape} (B, T, D) "
                              f"and return the output or (output, ...); it raised {type(error).__name__}: "
                              f"{str(error)[:200]}. Fix: pass the unsharded self-attention module the sharded form "
                              f"was cut from (causal ones build their own mask)") from error
    return Reference(gold, same, dtype)


def _context(layer, *, world_sizes, causal, takes, layout, seq_len, batch, num_heads, dtype, seed) -> ShardedContext:
    params = [p for p in layer.parameters() if p.is_floating_point()]
    dtype = dtype or (params[0].dtype if params else torch.float32)
    main = copy.deepcopy(layer).to(dtype).eval()
    golden = None if dtype == torch.float64 else copy.deepcopy(layer).double().eval()
    heads = num_heads or next((getattr(layer, a) for a in ("num_heads", "n_head", "num_attention_heads", "heads")
                               if isinstance(getattr(layer, a, None), int)), None)
    d_model = next(p.shape[-1] for p in params) if params else None
    d_model = getattr(layer, "d_model", None) or getattr(layer, "embed_dim", None) or d_model
    T = seq_len
    cuts = tuple(sorted({0, T // 4 - 1, T // 2 - 1, 3 * T // 4 - 1, T - 2} - {-1})) if causal else ()
    ctx = ShardedContext(layer=main, golden_layer=golden, takes=takes, layout=layout, causal=causal, dtype=dtype,
                         num_heads=heads, world_sizes=world_sizes, seq_len=T, batch=batch, seed=seed, cuts=cuts)
    gen = torch.Generator().manual_seed(seed)
    x = _inputs(gen, (batch, T, d_model), dtype)
    other = _inputs(gen, (batch, T, d_model), dtype)
    copies = [x]
    for c in cuts:
        changed = x.clone()
        changed[:, c + 1:] = other[:, c + 1:]  # every token after the cut replaced, the rest kept
        copies.append(changed)
    stacked = torch.cat(copies)  # (B * (1 + cuts), T, D)
    cotangent = _inputs(gen, (batch, T, d_model), torch.float64)
    ctx.inputs = {FORWARD: stacked, BACKWARD: x, "cotangent": cotangent, LARGE: x.float()}
    def backward_references():
        return (_reference(_gradient, main, golden, dtype, x, cotangent), _parameter_gradients(main, x, cotangent),
                None if golden is None else _parameter_gradients(golden, x.double(), cotangent))

    # on a machine with a GPU a backward pass here would leave no forked rank able to run one: computed in a fork
    backward, same, gold = in_a_fork(backward_references) if torch.cuda.is_available() else backward_references()
    ctx.references = {FORWARD: _reference(_forward_all, main, golden, dtype, stacked), BACKWARD: backward}
    ctx.parameter_references = {name: Reference(None if gold is None else gold[name], g, dtype)
                                for name, g in same.items()}
    ctx.large_layer = _scaled(layer, LOGIT_SCALE, torch.float32)
    ctx.references[LARGE] = _reference(_forward_all, ctx.large_layer, _scaled(layer, LOGIT_SCALE, torch.float64),
                                       torch.float32, x.float())
    uneven, refs = {}, {}
    for W in world_sizes:
        t = next(n for n in range(T + 1, T + 4 * W) if n % W)  # the next length W does not divide
        xu = _inputs(torch.Generator().manual_seed(seed + W), (batch, t, d_model), dtype)
        uneven[W], refs[W] = xu, _reference(_forward_all, main, golden, dtype, xu)
    ctx.inputs[UNEVEN], ctx.references[UNEVEN] = uneven, refs
    return ctx


def _document_ids(documents, seq_len: int, layer: nn.Module) -> torch.Tensor | None:
    """(T,) the declared document of each token, from lengths (a list of ints) or ids (a (T,) integer tensor);
    refused with expected / seen / fix where it does not fit the audit or the layer's own documents."""
    if documents is None:
        return None
    if isinstance(documents, torch.Tensor):
        expect(documents.dim() == 1 and len(documents) == seq_len and not documents.is_floating_point(),
               f"documents: a ({seq_len},) integer tensor of document ids (or a list of lengths)",
               f"shape {tuple(documents.shape)}, dtype {documents.dtype}",
               f"pass one id per token of seq_len={seq_len}, e.g. torch.tensor([0] * 5 + [1] * {seq_len - 5})")
        ids = documents.detach().long().cpu()
    else:
        lengths = list(documents) if isinstance(documents, (list, tuple)) else None
        expect(lengths is not None and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
               and sum(lengths) == seq_len, f"documents: lengths >= 1 summing to seq_len={seq_len} (or ids per token)",
               f"documents={documents!r}", f"pass e.g. documents=[5, 6, {seq_len - 11}]")
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    own = getattr(layer, "documents", None)
    if isinstance(own, torch.Tensor):
        own = own.view(-1, own.shape[-1])
        same = own.shape[0] == 1 and own.shape[1] == seq_len and bool(
            (own[0].cpu()[:, None] == own[0].cpu()[None, :]).eq(ids[:, None] == ids[None, :]).all())
        expect(same, "the declared documents to pack the tokens as the layer's own `documents` do",
               f"declared {ids.tolist()}, the layer's {own.tolist()}",
               "declare the documents the layer was built with (or build it with these)")
    return ids


def _document_job(ctx: ShardedContext, ids: torch.Tensor) -> None:
    """The DOCUMENTS job's input at each world size: the example, then, for each document d and rank r that holds
    tokens of other documents, a copy with those tokens replaced; and the check that the unsharded layer keeps to the
    declared documents (it is the yardstick: a layer that does not is a usage error, not a finding)."""
    ctx.documents = ids
    x = ctx.inputs[BACKWARD]
    other = _inputs(torch.Generator().manual_seed(ctx.seed + 99), tuple(x.shape), ctx.dtype)
    inputs, refs = {}, {}
    for W in ctx.world_sizes:
        owner, copies, meta = ctx.owners(ctx.seq_len, W), [x], []
        for d in ids.unique().tolist():
            for r in range(W):
                replaced = (owner == r) & (ids != d)  # (T,) rank r's tokens of every other document
                if bool(replaced.any()):
                    changed = x.clone()
                    changed[:, replaced] = other[:, replaced]
                    copies.append(changed)
                    meta.append((d, r))
        inputs[W], ctx.document_copies[W] = torch.cat(copies), meta
        refs[W] = _reference(_forward_all, ctx.layer, ctx.golden_layer, ctx.dtype, inputs[W])
        out, B = refs[W].same.double(), ctx.batch
        scale = float(out[:B].square().mean().sqrt()) or 1.0
        for i, (d, r) in enumerate(meta, start=1):
            moved = float((out[i * B:(i + 1) * B, ids == d] - out[:B, ids == d]).abs().max()) / scale
            if moved > tolerance(UNCHANGED, ctx.dtype):
                raise AuditUsageError(
                    f"expected the unsharded layer to keep to the declared documents {ids.tolist()} (no output of a "
                    f"document moving when only other documents' tokens change); changing the tokens of other "
                    f"documents than {d} moved document {d}'s outputs by {moved:.3g} of their RMS. Fix: declare the "
                    f"documents the layer attends within (or build the layer with them: "
                    f"MultiHeadAttention(..., documents=ids))")
    ctx.inputs[DOCUMENTS], ctx.references[DOCUMENTS] = inputs, refs


def _replica_job(ctx: ShardedContext, dp: int) -> None:
    """The REPLICAS job's input: the example, then for each replica a copy with its sequences (rows j, j + dp, ...)
    replaced; the same at every world size."""
    ctx.data_parallel = dp
    x = ctx.inputs[BACKWARD]
    other = _inputs(torch.Generator().manual_seed(ctx.seed + 77), tuple(x.shape), ctx.dtype)
    copies = [x]
    for j in range(dp):
        changed = x.clone()
        changed[j::dp] = other[j::dp]
        copies.append(changed)
    stacked = torch.cat(copies)
    ref = _reference(_forward_all, ctx.layer, ctx.golden_layer, ctx.dtype, stacked)
    ctx.inputs[REPLICAS] = {W: stacked for W in ctx.world_sizes}
    ctx.references[REPLICAS] = {W: ref for W in ctx.world_sizes}


def _train_references(ctx: ShardedContext) -> tuple:
    """The unsharded layer's train-mode outputs on the train job's input, seeded as every rank is (`train_seeds`):
    what a layer that promises to draw like it must return. In the audit's dtype: a float64 copy draws other masks."""
    answers = []
    ctx.layer.train()
    try:
        for seed in ctx.train_seeds:
            torch.manual_seed(seed)  # the caller's RNG state comes back with the audit's guard (`untouched`)
            answers.append(_forward_all(ctx.layer, ctx.inputs[BACKWARD]))
    finally:
        ctx.layer.eval()
    return tuple(answers)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of a rank's answer: a DTensor's local output may be an async collective's result that is only
    waited for when an op reads it (the copy does), and must not be pickled before."""
    if hasattr(x, "to_local"):  # a DTensor returned as it is: its whole value, gathered
        x = x.full_tensor()
    return x.detach().clone().cpu()


def _jobs(ctx: ShardedContext, sharded, W: int, call) -> list[Job]:
    """The jobs of world size W, as closures the forked ranks run: each builds its sharded layer once per copy of
    the unsharded layer (the audit dtype's, the scaled float32 one) and calls it on its part of the input."""
    built: dict = {}  # per process after the fork: {which copy: the sharded module}

    def on(rank: int):  # the rank's device: its own GPU under NCCL
        return torch.device("cuda", rank) if ctx.device == "cuda" else torch.device("cpu")

    def module(which: str, rank: int, group) -> nn.Module:
        if which not in built:
            source = ctx.layer if which == "main" else ctx.large_layer
            m = sharded(copy.deepcopy(source).to(on(rank)), rank, W, group)
            built[which] = m.eval() if isinstance(m, nn.Module) else m
        return built[which]

    def invoke(m, x, rank, positions=None):
        x = x.to(on(rank))
        if ctx.takes == "full":
            out = call(m, x) if call is not None else m(x)
        else:
            if positions is None:
                rows, positions = ctx.piece(rank, W, x.shape[1])  # its replica's sequences, its shard of them
                positions = positions.to(on(rank))
                x = x[rows][:, positions]
            out = call(m, x, positions) if call is not None else m(x, positions)
        return out[0] if isinstance(out, (tuple, list)) else out

    def forward(job: str, which: str, x_of):
        def run_job(rank, world_size, group):
            with torch.no_grad():
                return _plain(invoke(module(which, rank, group), x_of(), rank))
        return Job(job, run_job)

    def backward(rank, world_size, group):
        m, x = module("main", rank, group), ctx.inputs[BACKWARD]
        cot = ctx.inputs["cotangent"]
        rows, positions = slice(None), torch.arange(x.shape[1])
        if ctx.takes == "shard":
            rows, positions = ctx.piece(rank, W, x.shape[1])
        leaf = x[rows][:, positions].to(on(rank)).requires_grad_(True)  # the whole input, or the rank's shard
        out = invoke(m, leaf, rank, positions.to(on(rank)) if ctx.takes == "shard" else None)
        (out * cot[rows][:, positions].to(out)).sum().backward()
        mapping = getattr(m, "unsharded_parameters", None)  # how the rank's parameters map to the unsharded ones
        parameters = None if mapping is None else {
            name: (how if isinstance(how, str) else (how[0], how[1].cpu()),
                   None if p is None or p.grad is None else _plain(p.grad)) for name, (p, how) in mapping().items()}
        return _plain(leaf.grad), parameters

    def train(rank, world_size, group):
        m, answers = module("main", rank, group), []
        m.train()
        try:
            for seed in ctx.train_seeds:
                torch.manual_seed(seed)  # every rank alike: what a data-parallel replica's training step does
                with torch.no_grad():
                    answers.append(_plain(invoke(m, ctx.inputs[BACKWARD], rank)))
        finally:
            m.eval()
        return answers

    jobs = {FORWARD: forward(FORWARD, "main", lambda: ctx.inputs[FORWARD]), BACKWARD: Job(BACKWARD, backward),
            TRAIN: Job(TRAIN, train),
            LARGE: forward(LARGE, "large", lambda: ctx.inputs[LARGE]),
            UNEVEN: forward(UNEVEN, "main", lambda: ctx.inputs[UNEVEN][W]),
            DOCUMENTS: forward(DOCUMENTS, "main", lambda: ctx.inputs[DOCUMENTS][W]),
            REPLICAS: forward(REPLICAS, "main", lambda: ctx.inputs[REPLICAS][W])}
    skip = {TRAIN} if ctx.takes == "shard" else set()  # shards have no whole to agree on
    skip |= ({DOCUMENTS} if ctx.documents is None else set()) | ({REPLICAS} if ctx.data_parallel == 1 else set())
    return [jobs[j] for j in JOBS if j not in skip]


def _run(ctx: ShardedContext, W: int, jobs: list[Job], timeout: float, device: str) -> None:
    """Every job at world size W; a job whose rank raised or exited ends that group, and the jobs after it run in a
    fresh one (a group is dead after one rank raises); after a hang, nothing more is started."""
    ctx.outputs[W], ctx.failures[W], ctx.groups[W] = {}, [], []
    remaining = list(jobs)
    while remaining:
        session = run_group(W, remaining, timeout=timeout, device=device)
        ctx.groups[W].append(session)
        ctx.outputs[W].update(session.results)
        if BACKWARD in session.results:  # (the input's gradient, the parameters' gradients) from each rank
            answers = session.results[BACKWARD]
            ctx.outputs[W][BACKWARD] = [a[0] for a in answers]
            ctx.outputs[W][PARAMETERS] = [a[1] for a in answers]
        ctx.failures[W] += session.failures
        if not session.failures:
            return
        failed = session.failed_job
        if any(f.kind == "hung" for f in session.failures) or failed == "start":
            return
        remaining = [j for j in remaining if j.name not in session.results and j.name != failed]


__all__ = ["audit_sharded"]
