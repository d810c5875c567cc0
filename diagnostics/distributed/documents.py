"""sharded_documents: with packed documents declared (`documents=`), no output of a document moves when only another
document's tokens change, whichever rank holds them. One copy of the example per (document d, rank r): the tokens rank
r holds of every document but d replaced; d's outputs must stay exactly as they were. A ring whose received key
blocks are masked by the receiving rank's own document ids (or by causal offsets only) lets the tokens right after a
document boundary attend the previous document held on another rank; the finding names the document, the ranks and
the boundary (`_causes.leak_cause`)."""

from __future__ import annotations

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ._causes import DOCUMENTS_FIX, document_leaks, leak_cause
from ._context import DECLARED_DOCUMENTS, DOCUMENTS, ShardedContext
from ._judge import named, unmeasured

ID = "sharded_documents"


@detector(ID, "with packed documents declared, no output of a document moves when another document's tokens change "
              "on any rank", fix=DOCUMENTS_FIX, needs=(DECLARED_DOCUMENTS,), scope="sharded",
          targets=("ring attention crossing document boundaries",),
          unlocated="names the document, the rank whose keys it attended and the boundary; the layer runs in other "
                    "processes")
def check_sharded_documents(ctx: ShardedContext) -> DetectorResult:
    tol = tolerance(UNCHANGED, ctx.dtype)
    lines, first, worst, probes = [], None, 0.0, 0
    for W in ctx.world_sizes:
        leaks = document_leaks(ctx, W, 0.0)  # every probe that moved at all, to report the greatest change
        if leaks is None:
            continue
        probes += len(ctx.document_copies[W])
        over = [leak for leak in leaks if leak.change > tol]
        worst = max([worst] + [leak.change for leak in leaks])
        lines.append(f"{W} ranks: {len(over)} / {len(ctx.document_copies[W])} document x rank probes moved a document "
                     f"(greatest change {max([0.0] + [leak.change for leak in leaks]):.3g} of the outputs' RMS)")
        if over and first is None:
            first = (W, over)
    notes = unmeasured(ctx, DOCUMENTS) + [f"not measured at {W} ranks (the ranks' outputs do not fit together: see "
                                          f"sharded_output)" for W in ctx.world_sizes
                                          if ctx.answers(W, DOCUMENTS) is not None and document_leaks(ctx, W, 0.0)
                                          is None]
    if not lines:
        return DetectorResult(ID, "skip", "; ".join(notes) or "not measured")
    evidence = "; ".join(lines + notes) + f" (up to {tol:.0e} allowed for {dtype_name(ctx.dtype)})"
    if first is not None:
        cause = leak_cause(ctx, *first)
        return DetectorResult(ID, "fail", f"a document sees another document's tokens under sharding: {cause.text}",
                              value=worst, threshold=tol, evidence=evidence, fix=cause.fix, extras=named(cause))
    return DetectorResult(ID, "pass", f"no document's output moves when the other documents change ({probes} document "
                                      f"x rank probes, at {', '.join(str(W) for W in ctx.world_sizes)} ranks)",
                          value=worst, threshold=tol, evidence=evidence)
