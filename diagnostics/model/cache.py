"""cache_parity: prefill plus steps of 1, 3 and an uneven split through the model's own cache give the full
forward's logits, within the float64-golden tolerance (`_tolerance.Golden`). The first attention layer whose
cached outputs differ from its full-pass outputs is where the finding is localised.
"""

from __future__ import annotations

import copy

import torch

from .._registry import Need, detector
from .._result import DetectorResult
from .._thresholds import tolerance
from ._context import CAUSAL_MODEL, SEQUENCE, ModelContext, at_least
from ._taps import NO_POSITIONS, LayerTap, first_layer, moved, per_position
from ._tolerance import GOLDEN_FLOOR, Golden, below_rounding, float64_allowed

ID = "cache_parity"
FIX = ("keep the causal mask when a cache is attached (prefill of several tokens too), offset positions (rotary, "
       "learned) by the cache length, and align the mask bottom-right")
TAKES_CACHE = Need("a cache argument (past_key_values and use_cache)", lambda c: c.runner.takes_cache,
                   "the model's forward takes no past_key_values and use_cache (the Hugging Face protocol; see the "
                   "module docstring for plain models)")


def schedules(T: int) -> dict:
    """Three schedules: a prefill then steps of 1, the same prefill then steps of 3 (one prefill serves both,
    through a copy of its cache), and an uneven split."""
    plans = {}
    prefill = T - 6 if T >= 7 else T - 3
    if T >= 4:
        plans["steps of 1"] = [prefill] + [1] * (T - prefill)
    if T >= 7:
        plans["steps of 3"] = [prefill, 3, 3]
    if T >= 5:
        a = max(1, T // 3 + 1)
        b = max(1, (T - a) // 3 + 1)
        plans["uneven"] = [a, b, T - a - b]  # T - a - b >= 1 for every T >= 5 (about 4T / 9 - 5 / 3)
    return plans


@detector(ID, "prefill plus steps of 1, 3 and an uneven split through the model's own cache give the full "
              "forward's logits", fix=FIX, needs=(SEQUENCE, CAUSAL_MODEL, TAKES_CACHE, at_least(4)), scope="model",
          unlocated="names the first attention layer whose cached outputs differ from the full pass's (its "
                    "`layer`), whose own in-place audit points at the line")
def check_cache_parity(ctx: ModelContext) -> DetectorResult:
    runner = ctx.runner
    seq = runner.inputs[:1]
    T = seq.shape[1]
    plans = schedules(T)
    with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as full_taps:
        full, _ = runner(seq)
    ctx.full = (seq, full)
    if not per_position(full, T):
        return DetectorResult(ID, "skip", NO_POSITIONS.format(shape=tuple(full.shape)))
    golden = Golden(ctx.golden(seq), full, ctx.dtype)
    readings, failed, texts = {}, [], []
    first = None
    shared = None  # (first chunk's length, its output, its cache, its layer taps)
    for name, plan in plans.items():
        outs, past, start = [], None, 0
        with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as taps:
            for i, n in enumerate(plan):
                if i == 0 and shared is not None and shared[0] == n:
                    try:
                        past = copy.deepcopy(shared[2])  # the prefill's cache, untouched by the other schedule
                        out = shared[1]
                        taps.extend(shared[3])
                        outs.append(out)
                        start += n
                        continue
                    except Exception:  # a cache that cannot be copied: prefill again
                        past = None
                out, past = runner(seq[:, start:start + n], past=past, use_cache=True)
                if past is None:
                    return DetectorResult(ID, "skip", "not measured: the model returned no cache with use_cache=True")
                if i == 0 and shared is None:
                    prefill_taps = LayerTap(ctx.modules, ctx.time_dims, ctx.model)
                    prefill_taps.extend(taps)
                    try:
                        shared = (n, out, copy.deepcopy(past), prefill_taps)
                    except Exception:  # a cache that cannot be copied: each schedule prefills its own
                        shared = None
                outs.append(out)
                start += n
        cached = torch.cat(outs, dim=1)
        if cached.shape != full.shape:
            return DetectorResult(ID, "fail", f"cached decoding returns {tuple(cached.shape)} where the full pass "
                                              f"returns {tuple(full.shape)}", evidence=f"schedule {name} {plan}", fix=FIX)
        ok, err, allowed, text = golden.judge(cached, f"{name} {plan}")
        readings[name] = {"plan": plan, "error": err, "allowed": allowed,
                          "per_position": moved(cached, full)[0].tolist()}
        texts.append(text)
        if not ok:
            failed.append(name)
            if first is None:
                first, _ = first_layer(ctx.order, full_taps, taps, lambda x: x, tolerance(GOLDEN_FLOOR, ctx.dtype))
    ctx.readings[ID] = readings
    if not failed and golden.rechecks:
        failed, texts64 = _in_float64(ctx, seq, plans, golden)
        texts += texts64
        golden.record64(ctx.readings, ID)
        if failed:
            worst = max(readings[n]["error64"] for n in failed)
            return DetectorResult(ID, "fail", f"decoding through the cache differs from the full forward "
                                              f"({', '.join(failed)}) {below_rounding(ctx.dtype)}", value=worst,
                                  threshold=float64_allowed(), evidence="; ".join(texts), fix=FIX)
    if failed:
        worst = max(readings[n]["error"] for n in failed)
        return DetectorResult(ID, "fail", f"decoding through the cache differs from the full forward "
                                          f"({', '.join(failed)})" + (f"; first at {first}" if first else ""),
                              value=worst, threshold=min(readings[n]["allowed"] for n in failed),
                              evidence="; ".join(texts), fix=FIX, layer=first)
    return DetectorResult(ID, "pass", f"prefill + {', '.join(plans)} through the model's cache match the full forward",
                          value=max(r["error"] for r in readings.values()),
                          threshold=min(r["allowed"] for r in readings.values()), evidence="; ".join(texts))


def _in_float64(ctx: ModelContext, seq, plans: dict, golden: Golden) -> tuple[list, list]:
    """The schedules again in the model's float64 copy, each judged against the copy's own full pass
    (`Golden.judge64`): the names of those that differ, and a text per schedule. Where the copy does not decode,
    nothing (the judgement at the model's own dtype stands)."""
    failed, texts = [], []
    for name, plan in plans.items():
        outs, past, start = [], None, 0
        try:
            for n in plan:
                out, past = ctx.runner(seq[:, start:start + n], past=past, use_cache=True, model=ctx.twin64())
                outs.append(out)
                start += n
            cached = torch.cat(outs, dim=1)
        except Exception:  # the float64 copy does not decode so: nothing more to say
            return [], []
        ok, ctx.readings[ID][name]["error64"], text = golden.judge64(cached, f"{name} {plan}")
        texts.append(text)
        if not ok:
            failed.append(name)
    return failed, texts
