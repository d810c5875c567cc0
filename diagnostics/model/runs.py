"""model_runs: the model runs on the audit's inputs. Settled while the audit captures each attention module's
call (the example and its prefix); a model that raises there is a finding, localised to the attention module it
raised inside, and the other model-level detectors do not run. Where the audit built the example itself and the
model raised outside its attention modules (a vision tower given no pixels, a speech encoder given token ids),
the example is what is wrong, not the model: nothing is measured, and the message asks for an example."""

from __future__ import annotations

from .._registry import detector, phrase
from .._result import DetectorResult
from ._context import ModelContext
from ._towers import towers

ID = "model_runs"
FIX = "make the model accept the inputs shown (or pass {example}... in the form it takes)"  # {example}: as spelled


@detector(ID, "the model runs on the audit's inputs (the example, its prefixes, the padded and cached calls)",
          fix=phrase(FIX, {"example": "example="}), scope="model",
          unlocated="names the attention module the model raised inside (its `layer`); the line is in the "
                    "exception its evidence quotes")
def check_model_runs(ctx: ModelContext) -> DetectorResult:
    if ctx.runs and ctx.runner.built_example and ctx.raised_in not in ctx.modules:
        held = list(towers(ctx.model))  # of two or more, each is audited on its own (`_towers`): this is not seen
        each = f", or audit the model it is made of on its own (model.{held[0]})" if len(held) == 1 else ""
        return DetectorResult(ID, "skip", "not measured: the model raised on the example the audit built from what it "
                                          "declares, outside its attention modules: "
                                          + phrase("pass {example}... in the form it takes", ctx.runner.options)
                                          + each, evidence="; ".join(ctx.runs))
    if ctx.runs:
        inside = f" (inside {ctx.raised_in})" if ctx.raised_in else ""
        return DetectorResult(ID, "fail", "the model raised on the audit's inputs" + inside,
                              evidence="; ".join(ctx.runs), fix=phrase(FIX, ctx.runner.options), layer=ctx.raised_in)
    return DetectorResult(ID, "pass", "the model runs on the example and its prefix")

