"""How much one output moved from another, per position, in the outputs' own scale: the one measure every comparison
of the audit is judged by (`relative_change` against a tolerance of diagnostics._thresholds). Apart from
diagnostics._core so that the probe itself can compare two calls (diagnostics._probe: a row alone against the same row
in a batch) without importing the detectors' machinery."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _rms(x: Tensor, centred: bool = False) -> float:
    """RMS of the finite values; `centred`: of their deviation from each feature's mean over batch and
    positions, so that a constant offset (an output bias) does not hide how much the output varies."""
    if x.numel():  # the common case, every value finite, in a few kernels
        # centred: two passes, the deviations from each feature's mean squared (as accurate as `var`, whose
        # reduction over the leading axis of (N, features) ran 10x slower on CPU: 0.8 ms against 0.08 at (2, 128, 512))
        rows = x.flatten(0, -2)  # (N, features)
        fast = float(((rows - rows.mean(0)) if centred else x).square().mean().sqrt())
        if math.isfinite(fast):
            return fast
    if centred:
        finite = torch.isfinite(x)
        n = finite.flatten(0, -2).sum(0).clamp_min(1)  # (features,)
        mean = torch.where(finite, x, 0).flatten(0, -2).sum(0) / n
        x = torch.where(finite, x - mean, torch.nan)
    finite = x[torch.isfinite(x)]
    return float(finite.square().mean().sqrt()) if finite.numel() else 0.0


def relative_change(new: Tensor, old: Tensor, *, centred: bool = False, scale_of: Tensor | None = None,
                    scale: float | None = None) -> Tensor | None:
    """Per position (features folded): max |new - old| / RMS, where RMS is the baseline's (finite values;
    the new output's where the baseline is zero), in float64 for float64 layers and float32 otherwise. NaN (or the same inf) in both is
    no change; non-finite in one only is inf. None when neither has a finite non-zero value to measure
    against. `centred` measures against how much the outputs vary (see `_rms`): for comparisons of
    random inputs, whose outputs vary from row to row; not for an expected output that is constant. `scale`:
    the baseline's, already measured (`baseline_scale`), when one baseline is compared with several outputs."""
    wide = torch.float64 if old.dtype == torch.float64 else torch.float32
    new, old = new.to(wide), old.to(wide)
    # the baseline's scale (a perturbation pushed 1000x must not loosen the tolerance of the rows it may not
    # move); the new output's only where the baseline is zero, so that zeros against a moved output still count
    if scale is None:
        scale = baseline_scale(old, new, centred=centred, scale_of=scale_of)
    if not scale > 0:
        return None
    fast = (new - old).abs().amax(dim=-1)  # NaN or inf wherever either is not finite
    if bool(torch.isfinite(fast).all()):  # the common case
        return fast / scale
    same = (new == old) | (torch.isnan(new) & torch.isnan(old))
    diff = torch.where(same, torch.zeros_like(old), (new - old).abs() / scale).nan_to_num(nan=math.inf)
    return diff.amax(dim=-1)


def baseline_scale(old: Tensor, new: Tensor | None = None, *, centred: bool = False,
                   scale_of: Tensor | None = None) -> float:
    """The RMS a change against `old` is measured in (see `relative_change`); 0.0 when there is none."""
    wide = torch.float64 if old.dtype == torch.float64 else torch.float32
    if scale_of is not None:  # a larger output the compared rows belong to (a few rows' RMS is noisy)
        old_scale = scale_of.to(wide)
        return _rms(old_scale, centred) or _rms(old_scale)
    old = old.to(wide)
    scale = _rms(old, centred) or _rms(old)
    if not scale and new is not None:
        new = new.to(wide)
        scale = _rms(new, centred) or _rms(new)
    return scale
