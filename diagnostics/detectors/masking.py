"""`mask_honoured` and `fully_masked_rows`: keys the mask blocks change nothing, and a query with no key
allowed gives a finite output."""

from __future__ import annotations

import torch

from .._core import Case, Inputs, compare, held, not_run, perturbed, skip
from .._probe import Probe
from .._registry import LONG, TAKES_MASK, detector
from .._result import DetectorResult
from ._common import invariance_locator, judge, perturbation_gains, result
from ._mask_hints import convention_hint
from .finite import ROW_FILLS, nonfinite_sites


@detector("mask_honoured", "changing a key the mask blocks changes nothing (padding and causal masks)",
          targets=("mask polarity inverted", "mask applied after softmax", "mask ignored or misshaped"),
          fix="apply the mask to the scores before the softmax: scores.masked_fill(~allowed, -inf)",
          needs=(TAKES_MASK, LONG),
          locate=invariance_locator("the first op whose output moves when only keys the mask blocks change",
                                    use_masks=True))
def check_mask_honoured(probe: Probe) -> DetectorResult:
    det, B, T = "mask_honoured", probe.BATCH, probe.t
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    cut = (T - 1) // 2
    pad = probe.padding(B, T, T)  # (B, Tq, Tk)
    scenarios = (("padding", pad, ~pad[:, 0, :], "when only padded keys changed"),  # (B, Tk): the blocked keys
                 ("causal", (j <= i).expand(B, T, T), (j > cut).expand(B, T), f"when only keys after t={cut} changed"))
    if probe.causal:
        # a causal mask passed to a layer audited as causal blocks what the layer's own causality (or the causal
        # mask the audit passes) blocks already: that probe is future_leakage's, which runs on such layers
        scenarios = scenarios[:1]
    results = []
    for name, mask, keys, when in scenarios:
        q, k, v = probe.streams(B, T)
        base = Inputs(q, k, v, mask)
        allowed = probe.allowed(B, T, T, mask).cpu()  # what the layer is given, causal included
        # rows that must not move: they may attend some key, and none of the changed ones
        hold = allowed.any(-1) & ~(allowed & keys.unsqueeze(1)).any(-1)  # (B, Tq)
        sees = (allowed & keys.unsqueeze(1)).any(-1)  # (B, Tq): rows a correct layer moves
        if base.one_stream:
            hold &= ~keys  # in self-attention the changed positions are also changed queries
            sees |= keys & allowed.any(-1)
        cases = [Case(x, hold=hold, move=sees, when=f"{when} (x{gain:g})")
                 for gain, x in zip(perturbation_gains(probe), perturbed(probe, base, keys, ("key", "value"), gains=perturbation_gains(probe)))]
        comparison = compare(probe, base, cases, label=f"{name} mask, blocked keys changed")
        if isinstance(comparison, DetectorResult):
            return comparison
        results.append((name, comparison))
    readings = [(name, *held(c, probe, what="outputs")) for name, c in results]
    bad = [name for name, b, _, _, _ in readings if b]
    if not bad and any(silent for _, _, _, _, silent in readings):  # one scenario that did not respond proves nothing
        silent = [name for name, _, _, _, quiet in readings if quiet]
        return skip(det, f"the output did not respond to changed keys with the {' and '.join(silent)} mask (not even "
                         f"the rows a correct layer moves), so its not moving where the mask blocks them proves nothing")
    result = judge(det, bool(bad), f"outputs depend on keys the mask blocks ({', '.join(bad)})",
                    f"keys the mask blocks have no effect ({' and '.join(name for name, _ in results)} "
                    f"mask{'s' if len(results) > 1 else ''})",
                    value=max(w for _, _, w, _, _ in readings), threshold=results[0][1].tol,
                    evidence="; ".join(f"{name} mask: {text}" for name, _, _, text, _ in readings),
                    replay=tuple(c for _, c in results))
    if result.verdict == "fail":
        # before saying the mask is ignored: the layer's mask may be another convention, as its parameter's name,
        # annotation, default or docstring says or as it behaves; a hint only, the verdict stays: an inverted mask
        # must fail
        hint = convention_hint(probe)
        if hint:
            result = DetectorResult(det, "fail", f"{result.message}; {hint}", value=result.value,
                                    threshold=result.threshold, evidence=result.evidence,
                                    fix=f"{hint}; {result.fix}", replay=result.replay)
    return result


@detector("fully_masked_rows", "a query whose every key is masked gives a finite output (warns on NaN)",
          targets=("plain softmax over an all -inf row",),
          fix="zero the weights of rows with no allowed key (torch's SDPA does), or never build such rows",
          needs=(TAKES_MASK,), locate=lambda probe, result: nonfinite_sites(probe, result, fills=ROW_FILLS))
def check_fully_masked_rows(probe: Probe) -> DetectorResult:
    det, B, T = "fully_masked_rows", probe.BATCH, probe.t
    r = T // 2
    extra = torch.ones(B, T, T, dtype=torch.bool)
    extra[0, r, :] = False  # batch 0, query r may attend nothing
    q, k, v = probe.streams(B, T)
    call = probe.call(q, k, v, probe.allowed(B, T, T, extra), label="a query with no key to attend")
    if not call.ok:
        return not_run(det, call)
    finite = torch.isfinite(call.output.out).all(-1)  # (B, T) or (B, H, T)
    empty = torch.zeros_like(finite)
    empty[0, ..., r] = True
    if (~finite & ~empty).any():
        n = int((~finite & ~empty).sum())
        return result(det, "fail", "NaN spreads beyond the query whose every key is masked",
                       value=float(n), threshold=0.0,
                       evidence=f"{n} output rows other than (b=0, t={r}) are NaN/inf when only that query has no key",
                       replay=call)
    if (~finite & empty).any():
        return result(det, "warn", "a query whose every key is masked gets NaN (torch's SDPA gives zeros)",
                       value=1.0, threshold=0.0,
                       evidence=f"output at (b=0, t={r}) is NaN/inf when that query may attend no key; it will "
                                f"poison the loss and the gradients unless such rows are dropped", replay=call)
    return result(det, "pass", "a query with no key to attend gives a finite output", value=0.0, threshold=0.0)
