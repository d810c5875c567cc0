"""`decode_consistency` and `cache_decoding`: the last queries over all keys, and decoding through the
layer's own cache, give the full pass's rows."""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import allowed_text, not_run, relative_change, skip
from .._probe import Probe
from .._registry import CAUSAL, HAS_CACHE, LONG, LONGER, SEPARATE_QUERY, Need, detector
from .._result import DetectorResult, ProbeShape, Site
from .._thresholds import ROW_SUM, dtype_name, tolerance
from .._tracing import (
    Trace,
    declared_mask,
    first_moved,
    made_before,
    mask_sites,
    op_site,
    producer,
    tensors,
    trace_call,
)
from ._common import float64_worst, judge, logit_gain
from ._stacked import DECODING, decode_splits, decoding_calls, stacked_cases


def _split_cache(result, batch: int, t_q: int, t_k: int):
    """(out, cache) from what a cached call returned: `out`, or `(out, cache[, weights])` in any order after
    `out`; the cache is the first returned thing that is not the weights (None: nothing returned)."""
    if isinstance(result, Tensor):
        return result, None
    if not (isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor)):
        return None, None

    def weights_like(r) -> bool:
        return (isinstance(r, Tensor) and r.is_floating_point() and r.dim() in (3, 4) and r.shape[0] == batch
                and tuple(r.shape[-2:]) == (t_q, t_k))

    caches = [r for r in result[1:] if r is not None and not isinstance(r, bool) and not weights_like(r)]
    return result[0], caches[0] if caches else None


CACHE_NOISE_FACTOR = 4.0
"""How far beyond the recomputation noise (no-cache rows computed twice) a cached decode may differ. Measured:
see benchmarks/margins.py."""


def _cache_plan(T: int, band: int | None = None) -> list[int]:
    """Token counts of the cached calls: a prefill of half, steps of 1, 1 and 3, then the uneven remainder. Under
    a declared pattern whose rows span `band` < T - 1 positions (a sliding window W, a chunk C): a prefill of
    W - 1, then the tokens at t = W - 1, W, 2W - 1 and 2W decoded alone (the cache fills to the window, then
    passes it: a cache of W slots rolls over at t = W and again at 2W), the tokens between them as one call of
    several, and the remainder in one call."""
    if band is not None and band < T - 1:
        W = band
        plan, at = [max(1, W - 1)], max(1, W - 1)
        for t in sorted({W - 1, W, 2 * W - 1, 2 * W}):
            if t < at or t >= T:
                continue
            if t > at:
                plan.append(t - at)  # several new tokens at once over a cache that holds the window already
                at = t
            plan.append(1)
            at += 1
        return plan + ([T - at] if at < T else [])
    plan, rest = [max(1, T // 2)], T - max(1, T // 2)
    for n in (1, 1, 3):
        if rest:
            plan.append(min(n, rest))
            rest -= plan[-1]
    return plan + ([rest] if rest else [])


def pattern_band(probe, T: int) -> int | None:
    """The widest row of the declared pattern on T positions (W of sliding_window(W), C of chunked(C)): the span
    the cached-decoding plan steps across one token at a time; None without a pattern."""
    pattern = getattr(probe, "pattern", None)
    if pattern is None or T < 2:
        return None
    allowed = pattern.allowed(probe.BATCH, T, T)  # (B, Tq, Tk)
    lo = torch.where(allowed, torch.arange(T), T).amin(-1)
    hi = torch.where(allowed, torch.arange(T), -1).amax(-1)
    return int((hi - lo).clamp_min(0).max()) + 1


def causal_pattern(probe) -> bool:
    """A declared pattern that blocks every future key (sliding_window, chunked, document & causal, ...): a layer
    that keeps it can decode through a cache."""
    pattern = getattr(probe, "pattern", None)
    if pattern is None:
        return False
    T = max(probe.t, 2)
    return not bool(pattern.allowed(probe.BATCH, T, T).triu(1).any())


CAUSAL_OR_PATTERN = Need("{causal}, or {pattern} blocking the future", lambda p: p.causal or causal_pattern(p),
                         "the layer is not audited as causal (pass {causal} if it promises causality, or a pattern that "
                         "blocks the future, e.g. {pattern_example})")


def _declared(probe, B: int, t_q: int, t_k: int, allowed) -> torch.Tensor:
    """What the audit declares for these queries over these keys: the mask passed, causal for a causal audit, and
    the declared pattern, bottom-right (a layer given no mask keeps its pattern itself)."""
    declared = declared_mask(probe, B, t_q, t_k, allowed)
    pattern = getattr(probe, "pattern", None)
    return declared if pattern is None else declared & pattern.allowed(B, t_q, t_k)


POSITIONS_FIX = ("give the new queries their true positions: offset them by the number of keys before them "
                 "(Tk - Tq, the cache length): positions = torch.arange(Tk - Tq, Tk) for rotary or position embeddings")


def decode_sites(probe, result: DetectorResult) -> list[Site]:
    """On the very tokens the verdict was computed on (`result.replay`: the full pass's inputs, copy 0 of the DECODING
    stack's call, traced alone): for each split,
    the masks of the partial call, else the first op whose output for the last n queries differs from the same
    rows of the full pass."""
    full_call = result.replay
    if full_call is None:
        return []
    s = probe.subject
    q, k, v = full_call.query, full_call.key, full_call.value
    B, T = q.shape[0], q.shape[s.time_dim]
    t = s.time_dim
    full = trace_call(s, q, k, v, probe.allowed(B, T, T), seed=probe.seed)
    if full.output is None:
        return []
    tol = tolerance(ROW_SUM, s.dtype)
    for n in decode_splits(T):
        tail = q.narrow(t, T - n, n).clone()
        part = trace_call(s, tail, k, v, probe.allowed(B, n, T), seed=probe.seed)
        if part.output is None or part.output.out.shape != full.output.out.narrow(t, T - n, n).shape:
            continue
        sites = mask_sites(part, _declared(probe, B, n, T, probe.allowed(B, n, T)), B, n, T)
        if sites:
            return sites
        op = first_moved(full, part, None, tol, tail=n)
        if op is not None:  # the masks agree, so what differs is where the queries are: their positions
            return [op_site(op, f"the first op whose output for the last {n} queries differs from the same rows of "
                                 f"the full pass", fix=POSITIONS_FIX)]
    return []


def cache_sites(probe, result: DetectorResult) -> list[Site]:
    """cache_decoding: replays the detector's plan (prefill, then steps through the layer's own cache) on the very
    tokens it decoded (`result.replay`); at the first step whose rows differ from the full pass over the same
    tokens, its masks, else the first op whose output for the new tokens differs from the same rows of that full
    pass."""
    x = result.replay
    if x is None:
        return []
    s, B, T = probe.subject, x.shape[0], x.shape[1]
    tol = tolerance(ROW_SUM, s.dtype)
    cache, filled, start = None, False, 0
    for n in _cache_plan(T, pattern_band(probe, T)):
        chunk, allowed = x[:, start:start + n], probe.allowed(B, n, start + n)
        step = trace_call(s, chunk, chunk, chunk, allowed, seed=probe.seed,
                          call=lambda: s.call_cached(chunk, allowed, cache))
        if step.output is None:
            return []
        out, returned = _split_cache(step.output, B, n, start + n)
        if start == 0 and returned is None and not filled:  # a container the layer fills, passed in
            cache, filled = {}, True
            step = trace_call(s, chunk, chunk, chunk, allowed, seed=probe.seed,
                              call=lambda: s.call_cached(chunk, allowed, cache))
            out, returned = _split_cache(step.output, B, n, start + n)
        if out is None:
            return []
        whole = x[:, :start + n]
        full = trace_call(s, whole, whole, whole, probe.allowed(B, start + n, start + n), seed=probe.seed)
        if full.output is None:
            return []
        change = relative_change(out, full.output.out[:, start:], centred=True, scale_of=full.output.out)
        if change is not None and bool((change > tol).any()):
            sites = mask_sites(step, _declared(probe, B, n, start + n, allowed), B, n, start + n)
            op = None if sites else first_moved(full, step, None, tol, tail=n)
            # a value it reads that an earlier call made and a cache handed back (rotary-embedding-torch 0.2.6's
            # frequencies keyed by the length alone): the line that returned it first, the op after
            cached = made_before(step, op, full)
            moved = op_site(op, f"the first op whose output for the {n} new tokens differs from the same rows of "
                                f"the full pass over {start + n} tokens", fix=POSITIONS_FIX)
            return sites or [found for found in (cached, moved) if found is not None]
        cache = cache if filled else returned
        if cache is None:
            return []
        if start == 0:  # the prefill's cache must hold n positions: told by a prefill one token longer
            longer = _cache_of(s, x[:, :n + 1], probe.allowed(B, n + 1, n + 1), filled)
            short = _cache_short(step, cache, longer, n)
            if short:
                return short
        start += n
    return []


def _cache_of(s, x: Tensor, allowed, filled: bool):
    try:
        with torch.no_grad():
            cache = {} if filled else None
            result = s.call_cached(x, allowed, cache)
        return cache if filled else _split_cache(result, x.shape[0], x.shape[1], x.shape[1])[1]
    except Exception:
        return None


def _cache_short(trace: Trace, cache, longer, tokens: int) -> list[Site]:
    """A cache tensor whose position axis (the one a prefill one token longer makes one longer) does not hold
    `tokens` positions (a key dropped or repeated): the op that made it."""
    def flat(c):
        return [y for item in (c.values() if isinstance(c, dict) else [c]) for y in tensors(item)]

    mine, other = flat(cache), flat(longer) if longer is not None else []
    for x, y in zip(mine, other):
        if x.dim() != y.dim():
            continue
        axes = [a for a in range(x.dim()) if y.shape[a] == x.shape[a] + 1]
        made = producer(trace, id(x))
        if len(axes) == 1 and x.shape[axes[0]] != tokens and made is not None and made.frames:
            return [op_site(made, f"the cache returned after {tokens} tokens holds {x.shape[axes[0]]} positions "
                                   f"along dim {axes[0]} {tuple(x.shape)}",
                            fix=f"keep every key and value in the cache: after {tokens} tokens it holds {tokens} "
                                f"positions (append the new ones to the past along dim {axes[0]}, drop none)")]
    return []


@detector("decode_consistency", "for a causal layer, the last Tq queries over all Tk keys give exactly the last "
          "Tq rows of the full pass (decoding with a cache equals the full pass), for Tq = 1, 3 and an uneven split",
          targets=("causal mask top-left or dropped once queries are fewer than keys",
                   "positions of new queries not offset by the cache length"),
          fix="build the causal mask bottom-right (torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq) marks the blocked keys) and offset the "
              "positions of new queries by the number of cached tokens",
          needs=(CAUSAL, SEPARATE_QUERY, LONGER), locate=decode_sites)
def check_decode_consistency(probe: Probe) -> DetectorResult:
    det, s, T = "decode_consistency", probe.subject, probe.t
    (_, full), *parts = decoding_calls(probe)  # output_shape reads the last partial call
    if not full.ok:
        return not_run(det, full)
    t = s.time_dim
    splits = decode_splits(T)  # three calls at every length: a constant cost
    readings, worst = [], 0.0
    # the same rows from matmuls of other shapes: summed in another order, so rounding may differ (nn.MHA in
    # float32 measured 1.5e-5); the row-sum tolerance is that of a recomputation
    tol = tolerance(ROW_SUM, s.dtype)
    for n, part in parts:
        if not part.ok:
            return not_run(det, part)
        expected = full.output.out.narrow(t, T - n, n)
        if part.output.out.shape != expected.shape:
            return skip(det, f"the output {tuple(part.output.out.shape)} has no row per query (see output_shape)")
        change = relative_change(part.output.out, expected, centred=True, scale_of=full.output.out)
        if change is None:
            return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
        bad = int((change > tol).sum())
        worst = max(worst, float(change.max()))
        readings.append((n, bad, change.numel(), float(change.max())))
    failed = [r for r in readings if r[1]]
    evidence = "; ".join(f"last {n} of {T} queries: {bad} / {total} rows differ from the full pass, by up to "
                         f"{m:.3g}" for n, bad, total, m in readings) + f" ({allowed_text(tol, s.dtype)})"
    if failed and s.dtype != torch.float64:
        exact = _float64_reading(probe, full, parts)
        if exact is not None and exact <= tolerance(ROW_SUM, torch.float64):
            # at a tiny width (heads of width 1 in bfloat16) the calls' own rounding can pass the bound; a float64
            # copy on the same inputs has none of it, while a mask built top-left differs there as much as before
            failed = []
            evidence += (f"; a float64 copy of the layer on the same inputs measured {exact:.2g} (up to "
                         f"{tolerance(ROW_SUM, torch.float64):.0e}): the {dtype_name(s.dtype)} difference is rounding")
        elif exact is not None:
            evidence += f"; a float64 copy of the layer on the same inputs measured {exact:.3g}: not rounding"
    return judge(det, bool(failed), "decoding the last queries over all keys differs from the full pass",
                  f"the last Tq queries over all keys reproduce the full pass (Tq = {splits})", value=worst,
                  threshold=tol, evidence=evidence, replay=full)


def _float64_reading(probe: Probe, full, parts) -> float | None:
    """decode_consistency's largest change measured again on the float64 copy of the layer, on the very inputs of
    the full pass and of each partial call upcast; None where no copy runs or a call raises."""
    t, T = probe.subject.time_dim, probe.t
    return float64_worst(probe, full, [part for _, part in parts],
                         lambda call, got, whole: (got, whole.narrow(t, T - call.query.shape[t], call.query.shape[t])))


@stacked_cases(DECODING, "decode_consistency")
def _reads_the_full_pass(probe: Probe, base) -> tuple[list, str]:
    return [], ""  # the baseline copy only: the full pass whose last rows the partial calls must give


@detector("cache_decoding", "for a causal layer (or one with a causal declared pattern) with a cache of its own, "
          "prefilling and decoding the rest through that cache gives the rows of the full pass: half the tokens, then "
          "steps of 1, 1, 3 and the remainder; under a sliding window W (or chunk), single tokens where the cache "
          "fills past W and rolls over (t = W - 1, W, 2W - 1, 2W)",
          targets=("rotary positions of new tokens not offset by the cache length",
                   "the causal mask dropped or misaligned once a cache is attached",
                   "a cache that loses or repeats keys",
                   "the sliding window (or chunk) dropped, or rolled over late, once a cache holds keys"),
          fix="offset the positions of new tokens by the cache length, mask new tokens bottom-right against cached "
              "and new keys (torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq) marks the blocked ones), and append every new key and value; "
              "under a sliding window W, keep the window when the cache holds keys: a new token at position p sees the "
              "keys p - W < j <= p, so a cache keeps the last W - 1 keys before it appends the new ones",
          needs=(CAUSAL_OR_PATTERN, LONG, HAS_CACHE), locate=cache_sites)
def check_cache_decoding(probe: Probe) -> DetectorResult:
    """Drives the layer's own cache: the cache argument left at None with use_cache=True must return a cache
    (fed back on the next call), or a dict passed in must be filled (passed again). Calls the layer raises on
    are the audit guessing a protocol wrong, so they skip with the error, never fail `runs`; a layer that
    refuses several new tokens at once is decoded one token at a time there, and the report says so."""
    det, s, B, T = "cache_decoding", probe.subject, probe.BATCH, probe.t
    name = s.cache_name
    if (probe.pass_causal_mask or probe.pass_pattern_mask) and s.convention == "key_padding":
        return skip(det, "the layer's mask is a key-padding mask, which cannot carry the causal mask of several "
                         "new tokens")
    x = logit_gain(probe) * probe.make(B, T)  # as in decode_consistency
    full = probe.call(x, x, x, probe.allowed(B, T, T), label=f"the full pass, {T} tokens")
    if not full.ok:
        return not_run(det, full)
    expected = full.output.out
    if expected.shape[:2] != (B, T):
        return skip(det, f"the output {tuple(expected.shape)} has no row per token (see output_shape)")

    def cached(start: int, n: int, cache):
        chunk = x[:, start:start + n].contiguous()  # (B, n, D): a slice of time is not contiguous (see `runs`)
        allowed = probe.allowed(B, n, start + n)
        probe.passes += 1
        probe.shapes[det].append(ProbeShape(f"{n} new tokens over a cache of {start}", B, n, start + n,
                                            None if allowed is None else allowed.cpu(), True))
        with torch.no_grad():
            result = s.call_cached(chunk, allowed, cache, start=start)
        out, returned = _split_cache(result, B, n, start + n)
        if out is None or tuple(out.shape[:2]) != (B, n):
            raise ValueError(f"returned {type(result).__name__} with no (B, {n}, D) output first")
        return out.detach(), returned

    outs, notes, start = [], [], 0
    band = pattern_band(probe, T)
    try:
        plan = _cache_plan(T, band)
        library = s.new_cache()  # a Hugging Face layer's: an empty DynamicCache it fills
        if library is not None:
            cache, how = library, f"a {type(library).__name__} it fills"
            out, _ = cached(0, plan[0], cache)
        else:
            out, cache = cached(0, plan[0], None)
            how = "the cache it returns"
            if cache is None:  # no cache returned: a container the layer fills, passed in
                cache, how = {}, "a dict it fills"
                out, _ = cached(0, plan[0], cache)
                if not cache:
                    return skip(det, f"called with {name}=None (and use_cache=True where it takes it) the layer "
                                     f"returned no cache, and it did not fill a dict passed as {name}: the audit cannot "
                                     f"drive its cache (an object of its own type, or a cache kept inside the module)")
        filled = how != "the cache it returns"
        outs.append(out)
        start = plan[0]
        for n in plan[1:]:
            try:
                out, returned = cached(start, n, cache)
                got = [out]
            except Exception as error:
                if n == 1:
                    raise
                notes.append(f"it raised on {n} new tokens at once ({type(error).__name__}), so those were "
                             f"decoded one at a time")
                got = []
                for at in range(start, start + n):
                    out, returned = cached(at, 1, cache)
                    got.append(out)
                    cache = cache if filled else returned
            else:
                cache = cache if filled else returned
            if cache is None:
                return skip(det, f"the layer stopped returning a cache after {start} tokens")
            outs += got
            start += n
    except Exception as error:
        text = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return skip(det, f"decoding through {name} raised after {start} tokens ({type(error).__name__}: {text}); "
                         f"the audit passes {name}=None, then what the layer returned (or a dict it fills)")
    got = torch.cat(outs, dim=1)
    change = relative_change(got, expected, centred=True, scale_of=expected)
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
    # the same rows computed twice without a cache (the first half alone, and within the full pass) differ by
    # the rounding of a recomputation, which sharp attention in half precision amplifies: a cached decode
    # must agree as well as that, within CACHE_NOISE_FACTOR
    P = plan[0]
    first = x[:, :P].contiguous()
    prefix = probe.call(first, first, first, probe.allowed(B, P, P), label=f"the first {P} tokens, no cache")
    if not prefix.ok:
        return not_run(det, prefix)
    noise = relative_change(prefix.output.out, expected[:, :P], centred=True, scale_of=expected)
    noise = 0.0 if noise is None else float(noise.max())
    tol = max(tolerance(ROW_SUM, s.dtype), CACHE_NOISE_FACTOR * noise)
    readings, at = [], 0
    for i, n in enumerate(plan):
        part = change[:, at:at + n]
        what = f"prefill of {n}" if i == 0 else f"{n} new token{'s' if n > 1 else ''} at t={at}"
        readings.append((what, int((part > tol).sum()), part.numel(), float(part.max())))
        at += n
    bad = [r for r in readings if r[1]]
    named = "" if probe.pattern is None else f" under {probe.pattern}"
    under = named
    if probe.pattern is not None:
        if band is not None and band < T - 1:
            singles, at = [], plan[0]
            for n in plan[1:]:
                singles += [at] if n == 1 else []
                at += n
            rolls = [t for t in (band, 2 * band) if t < T]
            under += (f" (the pattern's rows span {band} positions: single tokens at t={', '.join(map(str, singles))}, "
                      f"where the cache fills to {band} and where a cache of {band} slots rolls over, t="
                      + " and ".join(map(str, rolls))
                      + ("" if 2 * band < T else f"; its second roll-over, t={2 * band}, is past seq_len {T}: pass "
                                                  f"seq_len >= {2 * band + 1} to decode it") + ")")
        else:
            under += f" (its rows span {band} of {T} positions: no window the cache can pass at this length)"
    evidence = (f"through {name} ({how}){under}: " + "; ".join(f"{what}: {b} / {total} rows differ from the full pass "
                                                              f"by up to {m:.3g}" for what, b, total, m in readings)
                + f" (up to {tol:.2g} of the outputs' RMS about their mean allowed: {tolerance(ROW_SUM, s.dtype):.2g} "
                  f"for {dtype_name(s.dtype)}, or {CACHE_NOISE_FACTOR:g}x the {noise:.2g} by which the first {P} "
                  f"tokens alone differ from the full pass without a cache)" + "".join(f"; {note}" for note in notes))
    return judge(det, bool(bad), f"decoding through the layer's cache{named} differs from the full "
                  f"pass (from the {bad[0][0] if bad else ''})",
                  f"decoding through the layer's cache ({'+'.join(map(str, plan))} tokens){named} gives "
                  f"the full pass", value=float(change.max()), threshold=tol, evidence=evidence, replay=x)
