"""sharded_gradients: the gradients through the sharded layer equal the unsharded layer's (a loss of the output
against one fixed random cotangent): the input's, and the parameters' where the sharded form says how its parameters
map to the unsharded ones (`unsharded_parameters()`: a part of the whole gradient on every rank, summed as the data
or context parallel all-reduce sums it; the whole gradient on every rank, replicated; or a slice, put back in place).
Backward-only bugs live here: a key/value gradient sent back to the wrong rank (the wrong ring step), a collective
whose backward is not its adjoint, a replicated parameter whose gradient reaches one rank only."""

from __future__ import annotations

import torch

from .._registry import detector
from .._result import DetectorResult
from ..model._tolerance import scale_of
from ._causes import Cause
from ._context import BACKWARD, PARAMETERS, ShardedContext
from ._judge import Parity, forward_holds, judged, token_errors, verdict

ID = "sharded_gradients"
FIX = ("give each collective its adjoint in the backward: a ring shift's gradient goes back to the rank the tensor "
       "came from, an all-gather's is its own slice, an all-reduce's (g) is the identity")
PARTIAL, REPLICATED = "partial", "replicated"  # correct.sharded's words (diagnostics never imports the catalog)


@detector(ID, "the gradients of the input (and of the parameters, where the sharded form maps them) through the "
              "sharded layer equal the unsharded layer's", fix=FIX, scope="sharded",
          targets=("key/value gradients from the wrong ring step", "a replicated parameter's gradient on one rank"),
          unlocated="names the ranks whose tokens' gradients differ, or the parameter and the ranks; the backward "
                    "runs in other processes")
def check_sharded_gradients(ctx: ShardedContext) -> DetectorResult:
    measured, notes, _ = judged(ctx, BACKWARD, what="gradients")
    params, param_notes, param_cause = _parameters(ctx)
    failed = next((p for p in measured if not p.ok), None)
    cause = None
    if failed is not None and forward_holds(ctx, failed.W):
        cause = Cause("the forward matches and the backward does not: a backward-only bug (a key/value gradient "
                      "returned to the wrong rank, a collective's backward that is not its adjoint)", FIX)
    elif failed is None and param_cause is not None:
        cause = param_cause
    return verdict(ID, measured + params, notes + param_notes,
                   ok_text="the gradients equal the unsharded layer's"
                           + (" (the input's and every parameter's)" if params else " (the input's)"),
                   fail_text="the gradients through the sharded layer differ from the unsharded layer's", fix=FIX,
                   cause=cause)


def _whole(name: str, ranks: list, shape) -> tuple[torch.Tensor, str]:
    """The unsharded parameter's gradient put together from every rank's (how, gradient), and how it was."""
    hows = {how if isinstance(how, str) else "slice" for how, _ in ranks}
    grads = [torch.zeros(shape, dtype=torch.float64) if g is None else g.double() for _, g in ranks]
    if hows == {PARTIAL}:
        return sum(grads), PARTIAL
    if hows == {REPLICATED}:
        return grads[0], REPLICATED
    whole = torch.zeros(shape, dtype=torch.float64)
    for (how, _), g in zip(ranks, grads):
        if isinstance(how, str):
            raise ValueError(f"`{name}` is mapped as {sorted(hows)} on different ranks")
        dim, index = how
        whole.index_add_(dim, index.long(), g)
    return whole, "slice"


def _parameters(ctx: ShardedContext) -> tuple[list[Parity], list[str], Cause | None]:
    """Each world size's worst parameter as a Parity (judged by the float64-golden rule, each parameter on its own),
    why some were not compared, and the cause of the first that failed."""
    out, notes, cause = [], [], None
    for W in ctx.world_sizes:
        answers = ctx.answers(W, PARAMETERS)
        if answers is None:
            continue
        if any(a is None for a in answers):
            notes.append(f"parameters not compared at {W} ranks (the sharded form has no unsharded_parameters() "
                         f"saying how its parameters map to the unsharded layer's)")
            continue
        rows, worst = [], None
        for name, ref in ctx.parameter_references.items():
            ranks = [a.get(name) for a in answers]
            if any(r is None for r in ranks):
                notes.append(f"`{name}` not compared at {W} ranks (not mapped on every rank)")
                continue
            try:
                whole, how = _whole(name, ranks, tuple(ref.same.shape))
            except ValueError as error:
                notes.append(f"`{name}` not compared at {W} ranks ({error})")
                continue
            tests = [(None, whole)] if how != REPLICATED else [  # a replicated gradient must be whole on every rank
                (r, torch.zeros_like(whole) if g is None else g.double()) for r, (_, g) in enumerate(ranks)]
            flat = type(ref)(None if ref.golden is None else ref.golden.reshape(1, 1, -1), ref.same.reshape(1, 1, -1),
                             ref.dtype)  # one row: the rule reads (..., features)
            for r, test in tests:
                test = test.reshape(1, 1, -1)
                test = test if ref.golden is not None else test.to(ref.same.dtype)
                ok, err, allowed, _ = flat.judge(test, f"{W} ranks")
                if worst is None or err / (allowed or 1.0) > worst[2] / (worst[3] or 1.0):
                    worst = (name, r, err, allowed, ok, test, ref)
                if not ok and cause is None:
                    cause = _parameter_cause(name, how, ranks, ref, W)
            rows.append(name)
        if worst is None:
            continue
        name, r, err, allowed, ok, test, ref = worst
        target = (ref.golden if ref.golden is not None else ref.same).double()
        where = f"`{name}`" + (f" on rank {r}" if r is not None else "")
        out.append(Parity(W, ok and err <= allowed, err, allowed, test, target,
                          f"{W} ranks: {len(rows)} parameters' gradients compared; greatest error {err:.3g} of the "
                          f"gradient's RMS at {where} (allowed {allowed:.2g})"))
    return out, notes, cause


def _parameter_cause(name: str, how: str, ranks: list, ref, W: int) -> Cause:
    target = (ref.golden if ref.golden is not None else ref.same).double().flatten()
    if how == REPLICATED:
        scale = scale_of(target.view(1, 1, -1))
        off = [r for r, (_, g) in enumerate(ranks) if g is None or
               float(token_errors(g.double().view(1, 1, -1), target.view(1, 1, -1), scale).max()) > 1e-3]
        right = [r for r in range(W) if r not in off]
        zero = [r for r, (_, g) in enumerate(ranks) if g is None or float(g.abs().max()) == 0.0]
        if right and set(zero) == set(off):
            many, s = len(off) > 1, "s" if len(right) > 1 else ""
            return Cause(f"the gradient of `{name}`, held whole on every rank, reaches rank{s} "
                         f"{', '.join(map(str, right))} only (rank{'s' if many else ''} {', '.join(map(str, off))} of "
                         f"{W} hold{'' if many else 's'} 0): backward-only: the replicated copies part at the first "
                         f"optimiser step",
                         f"add `{name}` once, after the all-reduce, on every rank (or all-reduce its gradient over "
                         f"the ranks): every copy must see the whole gradient")
        return Cause(f"the gradient of `{name}`, held whole on every rank, differs on rank"
                     f"{'s' if len(off) > 1 else ''} {', '.join(map(str, off))} of {W}", FIX)
    whole, _ = _whole(name, ranks, tuple(ref.same.shape))
    whole = whole.flatten()
    factor = float(whole @ target / (target @ target)) if float(target @ target) > 0 else 0.0
    if float((whole - factor * target).abs().max()) <= 1e-3 * float(target.abs().max()) and abs(factor - 1) > 1e-3:
        return Cause(f"the gradient of `{name}` put together from the {W} ranks is {factor:.3g} x the unsharded one "
                     f"(backward only)", f"scale `{name}`'s gradient as the unsharded layer's: sum the ranks' parts, "
                                         f"neither averaged nor counted twice")
    return Cause(f"the gradient of `{name}` put together from the {W} ranks differs from the unsharded one "
                 f"(backward only)", FIX)
