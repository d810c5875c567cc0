"""Parity tolerances of the model audit (cache, padding, batch, backend), after the float64-golden rule of
PyTorch's own tests: the tested path's error against a float64 copy of the model may be at most `FUDGE` times
the error of the same-dtype reference path against it (`FUDGE_BY_DTYPE` where a dtype needs its own), plus a
floor (`GOLDEN_FLOOR`), both relative to the RMS of the float64 outputs (`_core.baseline_scale`, the one
"outputs' RMS" of every message).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._core import baseline_scale, relative_change
from .._thresholds import FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR, tolerance

# FUDGE, FUDGE_BY_DTYPE and GOLDEN_FLOOR, with their measurements, live in diagnostics/_thresholds.py: the layer
# detector own_weights, below this wing, applies the same rule


def scale_of(x: Tensor) -> float:
    """The outputs' RMS a model-level change is measured in; 1 where the outputs are all zero."""
    return baseline_scale(x) or 1.0


def worst_change(new: Tensor, old: Tensor, scale: float) -> float:
    """The greatest change of `new` against `old` over every position, relative to `scale`
    (`_core.relative_change`: NaN in both at the same place is no change, non-finite in one only is inf)."""
    if not new.numel():
        return 0.0
    change = relative_change(new, old, scale=scale)
    return float(change.max()) if change is not None and change.numel() else 0.0


@dataclass
class Golden:
    """Parity against a float64 copy: error of the tested path <= FUDGE (FUDGE_BY_DTYPE) x error of the same-dtype
    full pass + floor."""

    golden: Tensor | None  # float64 copy's output, or None (the same-dtype full pass is then the reference)
    reference: Tensor
    dtype: torch.dtype
    worst64: float = 0.0  # the largest error `judge64` measured (the margins' reading)
    unlike: str = ""  # why a float64 copy that ran is not compared: it answered in another shape

    def __post_init__(self):
        if self.golden is not None and self.golden.shape != self.reference.shape:  # a count that depends on the
            # values (LightGlue's matches kept above a threshold: 79 in float64, 3600 in bfloat16): no copy to compare
            self.unlike = (f"the float64 copy returned {tuple(self.golden.shape)} where the model returns "
                           f"{tuple(self.reference.shape)}")
            self.golden = None

    def judge(self, test: Tensor, where: str) -> tuple[bool, float, float, str]:
        target = self.golden if self.golden is not None else self.reference
        scale = scale_of(target)
        err_ref = worst_change(self.reference, target, scale) if self.golden is not None else 0.0
        err = worst_change(test, target, scale)
        fudge = FUDGE_BY_DTYPE.get(self.dtype, FUDGE)
        floor = tolerance(GOLDEN_FLOOR, self.dtype)
        allowed = fudge * err_ref + floor
        text = (f"{where}: error {err:.3g} of the outputs' RMS against the float64 copy, the full pass's own "
                f"{err_ref:.3g} (allowed {fudge:g} x that + {floor:.0e})"
                if self.golden is not None else
                f"{where}: differs by {err:.3g} of the outputs' RMS (allowed {floor:.0e}; "
                f"{self.unlike or 'no float64 copy of the model could be made'})")
        return err <= allowed, err, allowed, text

    @property
    def rechecks(self) -> bool:
        """Whether a check that passed runs its tested path again in the float64 copy: a low-precision model
        (`rechecked_in_float64`) whose float64 copy ran and computes what the model computes, its full pass within
        `COPY_AGREES` of the copy's (a model that draws noise in its forward, VibeVoice's acoustic tokenizer, is
        6.4 of its outputs' RMS off its copy: the copy says nothing about it)."""
        return self.golden is not None and rechecked_in_float64(self.dtype) and \
            worst_change(self.reference, self.golden, scale_of(self.golden)) <= COPY_AGREES

    def record64(self, readings: dict, detector: str) -> None:
        """The largest float64-copy error in the report's readings, `readings["float64 copy"][detector]`
        (`benchmarks/model_audit_cost.py --margins` reads it)."""
        readings.setdefault("float64 copy", {})[detector] = self.worst64

    def judge64(self, test64: Tensor, where: str) -> tuple[bool, float, str]:
        """The float64 copy's tested path against the copy's own full pass, at a float32 model's floor
        (`float64_allowed`): (within, error, text)."""
        if test64.shape != self.golden.shape:  # the copy answered otherwise: nothing to compare, nothing judged
            return True, 0.0, f"{where} in the float64 copy: not compared ({tuple(test64.shape)} returned)"
        if not bool(torch.isfinite(test64).all()):  # the copy's own artefact: eager Hugging Face layers add
            # finfo(float64).min to the scores and take a float32 softmax, -inf in every key of a padded query's
            # row, NaN that the next layer's zero weights carry into real tokens (Llama, Gemma, Phi-3 under left
            # padding); the model at its own dtype computes nothing of the kind
            return True, 0.0, f"{where} in the float64 copy: not compared (the copy's output is not finite)"
        err = worst_change(test64, self.golden, scale_of(self.golden))
        self.worst64 = max(self.worst64, err)
        return err <= float64_allowed(), err, (f"{where} in the float64 copy: error {err:.3g} of the outputs' RMS "
                                               f"against its own full pass (allowed {float64_allowed():.0e}, a "
                                               f"float32 model's)")


def below_rounding(dtype: torch.dtype) -> str:
    """How a failure found only in the float64 copy is worded."""
    return (f"in the model's float64 copy: by less than {str(dtype).replace('torch.', '')}'s own rounding, but the "
            f"same code at any precision")


# A model in bfloat16 or float16 rounds its outputs by about 1e-2 of their RMS, so a parity check at its own
# tolerance cannot see a difference below that: Mamba's restarted scan (a KNOWN transformers bug, 7e-3 of the RMS
# in its tiny float32 model) passed cache_parity in bfloat16. Where a check passes at such a dtype, its schedules run
# again in the float64 copy, judged as a float32 model would be (`RECHECKED_AS`): code that computes another
# function computes it at any precision; a difference only the low precision makes stays with the first judgement.
LOW_PRECISION = (torch.bfloat16, torch.float16)
RECHECKED_AS = torch.float32
# the model's own full pass against its float64 copy's, as a fraction of the outputs' RMS, above which the copy is
# not the same function: correct bfloat16 models measure at most 0.026 (`python benchmarks/model_audit_cost.py
# --margins --dtype bfloat16`: t5 sdpa, 24 models x 2 seeds; 10x margin), a model drawing noise 6.4 (VibeVoice)
COPY_AGREES = 0.25


def rechecked_in_float64(dtype: torch.dtype) -> bool:
    """Whether a parity check that passed at `dtype` runs again in the float64 copy (`LOW_PRECISION`)."""
    return dtype in LOW_PRECISION


def float64_allowed() -> float:
    """What the float64 copy's tested path may differ from its own full pass, the reference itself: a float32
    model's floor. Measured: `python benchmarks/model_audit_cost.py --margins --dtype bfloat16` prints the largest
    error of correct models (docs/auditing-a-model.md)."""
    return tolerance(GOLDEN_FLOOR, RECHECKED_AS)


__all__ = ["FUDGE", "FUDGE_BY_DTYPE", "GOLDEN_FLOOR", "Golden", "LOW_PRECISION", "below_rounding",
           "float64_allowed", "rechecked_in_float64", "scale_of", "worst_change"]
