"""backend_parity: a Hugging Face model's attention implementations (eager, sdpa) agree, at the unmasked
positions of a batch with a right-padded row, within the float64-golden tolerance (`_tolerance.Golden`)."""

from __future__ import annotations

import torch

from .._registry import Need, detector
from .._result import DetectorResult
from ._context import ModelContext, model_copy
from ._tolerance import Golden

ID = "backend_parity"
FIX = ("give every attention implementation the same mask, in its own convention, and the same scale and "
       "causality")
IMPLEMENTATIONS = ("eager", "sdpa")


def implementation(ctx: ModelContext) -> str | None:
    """The attention implementation a Hugging Face model runs (config._attn_implementation), else None."""
    return getattr(getattr(ctx.model, "config", None), "_attn_implementation", None) if ctx.runner.hf else None


SWITCHABLE = Need("Hugging Face eager / sdpa", lambda c: implementation(c) in IMPLEMENTATIONS,
                  "the model cannot switch attention implementation (Hugging Face eager / sdpa)")


@detector(ID, "Hugging Face attention implementations (eager, sdpa) agree", fix=FIX, needs=(SWITCHABLE,),
          scope="model", unlocated="compares two whole-model implementations; the layer is not traced")
def check_backend_parity(ctx: ModelContext) -> DetectorResult:
    runner, model = ctx.runner, ctx.model
    current = implementation(ctx)
    other = "sdpa" if current == "eager" else "eager"
    try:
        twin = model_copy(model)  # its own config to switch; the model's parameters, not a copy of them
        twin.set_attn_implementation(other)
    except Exception as exc:  # transformers refuses the switch for this model: nothing to compare
        return DetectorResult(ID, "skip", f"not applicable: the model does not switch to {other} "
                                          f"({type(exc).__name__}: {exc})")
    seq = runner.inputs[:2]
    T = seq.shape[1] if runner.sequence else None
    kwargs = {}
    if runner.sequence and runner.padding_name is not None and T >= 3:
        mask = torch.ones(seq.shape[0], T, dtype=torch.long)
        mask[-1, T - max(1, T // 4):] = 0
        kwargs["attention_mask"] = mask.to(seq.device)
    mine, _ = runner(seq, **kwargs)
    theirs, _ = runner(seq, model=twin, **kwargs)
    if theirs.shape != mine.shape:  # VITS: each output's length is a rounding of durations the model predicts, which
        # a last-digit difference between two implementations moves: no position-by-position comparison
        return DetectorResult(ID, "skip", f"not measured: the model returns {tuple(mine.shape)} with {current} and "
                                          f"{tuple(theirs.shape)} with {other} (a model whose output length is "
                                          f"computed from its values): no position-by-position comparison")
    golden = ctx.golden(seq, **kwargs)
    keep = kwargs["attention_mask"].bool() if kwargs else torch.ones(mine.shape[:2], dtype=torch.bool)
    if keep.shape == mine.shape[:2]:  # the unmasked positions only: what a padded position holds is not defined
        golden, mine, theirs = (None if golden is None else golden[keep]), mine[keep], theirs[keep]
    ok, err, allowed, text = Golden(golden, mine, ctx.dtype).judge(
        theirs, f"{other} against {current} (the model's), unmasked positions")
    if not ok:
        return DetectorResult(ID, "fail", f"attention implementations disagree: {other} against {current}",
                              value=err, threshold=allowed, evidence=text, fix=FIX)
    return DetectorResult(ID, "pass", f"{current} and {other} agree", value=err, threshold=allowed, evidence=text)
