"""One comparison every parity check makes: the sharded answer to a job at each world size against the unsharded
layer's, by the float64-golden rule, with the evidence in the project's words (count, fraction, worst token and the
rank that holds it, what was allowed)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .._result import DetectorResult
from .._thresholds import tolerance
from ..model._tolerance import FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR, scale_of
from ._context import FORWARD


@dataclass(frozen=True)
class Parity:
    """One world size's comparison: whether it held, the error and what was allowed (relative to the outputs' RMS),
    the test and target (float64), and the evidence sentence."""

    W: int
    ok: bool
    error: float
    allowed: float
    test: Tensor
    target: Tensor
    evidence: str


def token_errors(test: Tensor, target: Tensor, scale: float) -> Tensor:
    """(B, T) each token's greatest change against `target`, relative to `scale` (the outputs' RMS); NaN is inf."""
    return (test.double() - target.double()).abs().amax(dim=-1).nan_to_num(nan=float("inf")) / scale


def parity(ctx, job: str, W: int, test: Tensor, *, rows: slice = slice(None), what: str = "outputs",
           fudge: float | None = None) -> Parity:
    """`fudge`: the multiple of the unsharded layer's own error allowed, where a check needs its own (measured)."""
    ref = ctx.reference(job, W)
    test = test[rows]
    golden = None if ref.golden is None else ref.golden[rows]
    ok, err, allowed, _ = type(ref)(golden, ref.same[rows], ref.dtype).judge(test, f"{W} ranks")
    rule = FUDGE_BY_DTYPE.get(ref.dtype, FUDGE)
    if fudge is not None and golden is not None:  # the same rule, another multiple: floor + fudge x own error
        floor = tolerance(GOLDEN_FLOOR, ref.dtype)
        allowed = floor + (allowed - floor) * fudge / rule
        ok, rule = err <= allowed, fudge
    target = (golden if golden is not None else ref.same[rows]).double()
    scale = scale_of(target)
    per_token = token_errors(test, target, scale)  # (B, T)
    bad = per_token > allowed
    flat = int(per_token.argmax())
    b, t = divmod(flat, per_token.shape[1])
    owner = ctx.holder(range(*rows.indices(ref.same.shape[0]))[b], t, per_token.shape[1], W)
    evidence = (f"{W} ranks: {int(bad.sum())} / {bad.numel()} {what} off ({100 * float(bad.float().mean()):.1f}%); "
                f"greatest error {err:.3g} of the {what}' RMS at (b={b}, t={t}), a token of rank {owner} "
                + (f"(allowed {allowed:.2g}: {rule:g} x the unsharded layer's own error against its float64 copy + a "
                   f"floor)"
                   if golden is not None else f"(allowed {allowed:.0e} in float64)"))
    return Parity(W, ok, err, allowed, test.double(), target, evidence)


def judged(ctx, job: str, *, rows: slice = slice(None), what: str = "outputs",
           fudge: float | None = None) -> tuple[list[Parity], list[str], list[str]]:
    """Every world size's parity on `job`: (the comparisons made, why some world sizes have none, the errors of
    answers that do not fit together, which `sharded_output` reports)."""
    measured, unfit = [], []
    for W in ctx.world_sizes:
        if ctx.answers(W, job) is None:
            continue
        try:
            test = ctx.gathered(W, job)  # rank 0's whole answer where each returns one: sharded_ranks_agree
        except ValueError as error:
            unfit.append(f"{W} ranks: {error}")
            continue
        measured.append(parity(ctx, job, W, test, rows=rows, what=what, fudge=fudge))
    notes = unmeasured(ctx, job) + [f"not measured at {text.split(':')[0]} (the ranks' answers do not fit together: "
                                    f"see sharded_output)" for text in unfit]
    return measured, notes, unfit


def forward_holds(ctx, W: int) -> bool:
    """The plain forward at world size W ran and matched: a later check's difference is its own."""
    if ctx.answers(W, FORWARD) is None:
        return False
    try:
        return parity(ctx, FORWARD, W, ctx.gathered(W, FORWARD), rows=slice(0, ctx.batch)).ok
    except ValueError:
        return False


def unmeasured(ctx, job: str) -> list[str]:
    """Why `job` has no answer at some world sizes: the failure that stopped it there."""
    notes = []
    for W in ctx.world_sizes:
        if ctx.answers(W, job) is None:
            f = ctx.failure(W, job)
            notes.append(f"not measured at {W} ranks ({f.describe() if f else 'an earlier job stopped the group'})")
    return notes


def named(cause) -> dict:
    """A failing result's extras where the evidence named its cause: its fix is that cause's, not the detector's
    general one (`DetectorResult.remedy`)."""
    return {} if cause is None else {"cause": cause.text}


def verdict(det: str, passes: list[Parity], notes: list[str], *, ok_text: str, fail_text: str, fix: str,
            cause=None) -> DetectorResult:
    """The result over every world size: fail if any failed (the worst first), skip if none was measured."""
    if not passes:
        return DetectorResult(det, "skip", "; ".join(notes) or "not measured")
    failed = [p for p in passes if not p.ok]
    worst = max(failed or passes, key=lambda p: p.error / (p.allowed or 1.0))
    evidence = "; ".join([p.evidence for p in sorted(passes, key=lambda p: p.ok)] + notes)
    if failed:
        message = fail_text + (f": {cause.text}" if cause is not None else "")
        return DetectorResult(det, "fail", message, value=worst.error, threshold=worst.allowed, evidence=evidence,
                              fix=cause.fix if cause is not None else fix, extras=named(cause))
    sizes = ", ".join(str(W) for W in sorted({p.W for p in passes}))  # a world size may have several comparisons
    return DetectorResult(det, "pass", ok_text + f" (at {sizes} ranks)",
                          value=worst.error, threshold=worst.allowed, evidence=evidence)


__all__ = ["Parity", "forward_holds", "judged", "parity", "token_errors", "unmeasured", "verdict"]
