"""`keys_matter`: the output depends on the keys and on the values."""

from __future__ import annotations

import torch

from .._core import (
    Case,
    Inputs,
    baseline_scale,
    compare,
    not_run,
    perturbed,
    relative_change,
    skip,
)
from .._thresholds import UNCHANGED, dtype_name, tolerance
from .._probe import Probe, part_replaced
from .._registry import LONG, NOT_APPLICABLE, SEPARATE_QUERY, detector
from .._result import DetectorResult, Site
from .._tracing import MATMULS, op_site, stream_sites, trace_call
from ._common import channel_attention, judge, not_token_attention, perturbation_gains
from ._stacked import SEPARATE_STREAMS, separate_streams, stacked, stacked_cases


def keys_sites(probe, result: DetectorResult) -> list[Site]:
    """On the baseline of the draw that showed an input ignored (`result.replay`): the q·k or weights·v operand
    computed from the wrong input stream."""
    base = result.replay
    if base is None:
        return _values_sites(probe, result.extras["values_moved"]) if "values_moved" in result.extras else []
    s = probe.subject
    B, T = base.query.shape[0], base.query.shape[s.time_dim]
    trace = trace_call(s, base.query, base.key, base.value, probe.allowed(B, T, T), seed=probe.seed)
    return stream_sites(trace, s)


ROUNDING_BOUND = 10.0
"""A change of more than this many times the "unchanged" tolerance of the dtype (1e-4 of the outputs' RMS in
float32, 0.16 in bfloat16) is no rounding: the input moved the output, and keys_matter needs no null twin call to
tell. Below it (a layer that ignores the input moved by 2.8e-7 through batch-position rounding; a correct bfloat16
layer at d_k 1 and GPT-2's init by 0.5%), the moved rows are compared with the same call with nothing changed."""

PACKED_KEYS = 8
"""From this many positions keys_matter changes keys and values in different sequences of one copy."""


KEYS_FIX = ("weight the values by the attention over the keys: out = weights @ v (for linear attention, q @ (k^T v): "
            "its context is k^T v, not q^T k)")

VALUE_TRIES = 3
"""The most value projections keys_matter tries, in `Probe.value_projection`'s order, before a FAIL (each try: one call
to find it, one to move its values; only where the one before moved no other row)."""

VALUE_GAIN = 10.0  # knob: how far one token's values move, in units of the values' RMS (x10, x0.1: no verdict moves)


def _moving(gain: float, rms: float):
    """Token 0's values moved by `gain` x `rms`, the others kept: a function of the value projection's output."""
    return lambda v: torch.cat([v[:, :1] + gain * rms, v[:, 1:]], 1)


def _values_sites(probe: Probe, found) -> list[Site]:
    """For `_values_read`'s FAIL: the standard probe traced twice, with token 0's values as they were (moved by 0) and
    moved, through the same ops; the first product of the values with something made of the tokens (a product with a
    weight of the layer's projects them, `v @ W`) whose output the move reaches is where the values are weighted, and
    there they reached no other row (perceiver's `v @ context`, its context q^T k). [] where the two traces do not
    line up op for op or no such product was reached."""
    base = probe.base()
    rms = float(found.values.float().pow(2).mean().sqrt()) or 1.0
    traces = []
    for gain in (0.0, VALUE_GAIN):
        handle = found.module.register_forward_hook(lambda m, args, out, g=gain: part_replaced(found.part,
                                                                                               _moving(g, rms))(out))
        try:
            traces.append(trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed))
        finally:
            handle.remove()
    kept, moved = traces
    if kept.error is not None or moved.error is not None or len(kept.ops) != len(moved.ops):
        return []
    for a, b in zip(kept.ops, moved.ops):
        if a.short not in MATMULS or a.name != b.name or not a.outs or not b.outs or a.outs[0] is None or \
                b.outs[0] is None or a.outs[0].shape != b.outs[0].shape or torch.equal(a.outs[0], b.outs[0]):
            continue
        if any(not kept.sources.get(i) for i in a.in_ids):
            continue  # a product with a weight of the layer's (a projection of the values), no weighting of tokens
        site = op_site(a, f"the first product the values reach (token 0's moved in the output of {found.name}); no "
                          f"other row of the output moved, so this product takes each token's own values instead of "
                          f"summing them over the keys", fix=KEYS_FIX)
        return [site] if site is not None else []
    return []


def _values_read(probe: Probe) -> DetectorResult:
    """A module given one stream, whose keys cannot change without its queries: its values can, through the output of
    its value projection (`Probe.value_projection`). Token 0's values moved alone (VALUE_GAIN x the values' RMS) must
    move some other token's output that may attend it: an attention whose every output row reads its own token's
    value only mixes no tokens (perceiver-pytorch 0.11.0's experimental LinearAttention: its context is q^T k, not
    k^T v, and each output row its own value times that). A projection whose move reaches no other row may be
    another's that doubles the output too (a linear gate named unlike one, `out = attn * w(x)`; q's, in a layer
    without a softmax, named unlike one): up to VALUE_TRIES of them are tried, and the first that reaches another row
    is the values. A skip where no value projection is found."""
    det = "keys_matter"
    other = not_token_attention(probe, det)  # channel attention (XCA's) reads each token's own value by design
    channels = channel_attention(probe) if other is not None else ""
    if other is not None and not channels:
        return other
    sig = getattr(probe.subject, "sig", None)
    if sig is not None and sig.required_kv and getattr(probe.subject, "call", None) is None:
        return _values_apart(probe, sig.required_kv[0])  # a shared-QK core: its values are an input of their own
    first = None
    for nth in range(VALUE_TRIES):
        found = probe.value_projection(nth)
        if found is None:
            break
        read = _read_through(probe, found, channels=channels)
        if read.verdict == "pass":
            return read
        first = first or read
    if first is not None:
        return first
    if channels:
        return other
    return DetectorResult(det, "skip", NOT_APPLICABLE + "the layer takes one input stream, so a query cannot change "
                          "without its key, and no value projection was found to change its values alone (an "
                          "nn.Linear, or the last half or third of one, whose output, doubled, doubles what the output "
                          "projection is given)")


CHANNELS_FIX = ("merge the heads back with the channels before the tokens: out (B, H, d, T) -> out.permute(0, 3, 1, "
                "2).reshape(B, T, H x d), not out.reshape(B, T, H x d)")


def _values_apart(probe: Probe, name: str) -> DetectorResult:
    """A shared-QK core (`forward(qk, v)`): its values are an input of their own, `name`, given the query's stream on
    every other probe; here token 0's values moved alone through it (its keys are its queries, held)."""
    base = probe.base()
    if not base.ok:
        return not_run("keys_matter", base)
    rms = float(base.value.float().pow(2).mean().sqrt()) or 1.0
    call = probe.call(base.query, base.key, _moving(VALUE_GAIN, rms)(base.value), base.allowed,
                      label=f"the standard probe with token 0's values moved (its `{name}`)")
    moved = call.output.out if call.ok else None
    return _judge_values(probe, moved, base.output.out, f"its `{name}`")


def _read_through(probe: Probe, found, *, channels: str = "") -> DetectorResult:
    """`_values_read` through the value projection `found`: token 0's values moved, the other rows that may attend
    it must move; in a channel attention (`channels`: why it is one), where every row is its own token's value
    times weights between channels, none of them may."""
    rms = float(found.values.float().pow(2).mean().sqrt()) or 1.0
    moved = probe.with_values(_moving(VALUE_GAIN, rms),
                              f"the standard probe with token 0's values moved (the output of {found.name})", found)
    return _judge_values(probe, moved, found.attended, f"the output of {found.name}", channels=channels,
                         extras={"values_moved": found})


def _judge_values(probe: Probe, moved, attended, through: str, *, channels: str = "",
                  extras: dict | None = None) -> DetectorResult:
    """Token 0's values moved alone (`through`): `moved` against `attended`, what the output projection is given (or
    the layer's output) before and after."""
    det, s, B, T = "keys_matter", probe.subject, probe.BATCH, probe.t
    if moved is None or moved.shape != attended.shape or moved.dim() < 2:
        return skip(det, f"with token 0's values moved ({through}) the layer raised or returned another shape")
    change = relative_change(moved, attended)  # (B, T): each row's most moved feature, of the RMS
    if change is None:
        return skip(det, "the output is zero or non-finite everywhere on this probe, so a change cannot be measured")
    change = change.cpu().reshape(B, -1)  # (B, T), or (B, Q) for queries of the layer's own
    allowed, own = probe.base().allowed, bool(s.own_queries)
    may = torch.ones_like(change, dtype=torch.bool) if allowed is None or own else \
        allowed[..., 0].cpu().reshape(B, -1).clone()
    if not own:
        # the queries that may attend token 0: under the audit's mask, the declared pattern and the layer's own reach
        # (a window of one token attends its own key alone, by design)
        everything = torch.ones(B, T, T, dtype=torch.bool)
        pattern = probe.pattern.allowed(B, T, T).cpu() if probe.pattern is not None else everything
        rule = probe.within_reach(pattern)[..., 0]
        if rule.shape == may.shape:
            may &= rule
        may[:, 0] = False  # token 0's own row, which moves whatever the weights do
    tol = tolerance(UNCHANGED, s.dtype)
    rows = change[may]
    if rows.numel() == 0:
        return skip(det, "no other query may attend token 0")
    worst = float(rows.max())
    others = f"{rows.numel()} {'' if own else 'other '}rows that may attend it"
    text = (f"token 0's values moved alone ({VALUE_GAIN:g}x their RMS, through {through}): the {others} moved by at "
            f"most {worst:.3g} of the outputs' RMS (up to {tol:.2g} counts as unmoved for {dtype_name(s.dtype)})")
    if channels:  # each output row is its own token's value times the weights between channels
        if worst <= tol:
            return DetectorResult(det, "pass", "each output row reads its own token's value only, through weights "
                                               "between channels (channel attention)", value=worst, threshold=tol,
                                  evidence=f"{text}; {channels}")
        return DetectorResult(det, "fail", "an output row reads other tokens' values, in a channel attention whose "
                                           "rows each read their own token's", value=worst, threshold=tol,
                              evidence=f"{text}; {channels}", fix=CHANNELS_FIX)
    if worst <= tol:
        return DetectorResult(det, "fail", "no query reads another token's value: each output row moves with its own "
                                           "token's value only", value=worst, threshold=tol, evidence=text,
                              fix=KEYS_FIX, extras=extras or {})
    return DetectorResult(det, "pass", f"the output depends on the values of other tokens: changing token 0's values "
                                       f"alone moved {int((rows > tol).sum())} of the {others}", value=worst,
                          threshold=tol, evidence=text)


@detector("keys_matter", "the output depends on the keys and on the values: changing either input alone "
          "moves it", targets=("q @ v^T instead of q @ k^T", "keys or values projected from the wrong stream",
                               "a context of q^T k instead of k^T v (each row reads its own value only)"),
          fix="scores = q @ k.transpose(-2, -1) with k = W_k(key); out = weights @ v with v = W_v(value)",
          needs=(LONG,), locate=keys_sites)  # with one key per query, the weights are 1 whatever the keys
def check_keys_matter(probe: Probe) -> DetectorResult:
    det, B, T = "keys_matter", probe.BATCH, probe.t
    if not probe.subject.separate_kv:  # one stream: its values changed alone, through its value projection
        return _values_read(probe) if probe.subject.form == "self_module" else \
            DetectorResult(det, "skip", NOT_APPLICABLE + SEPARATE_QUERY.unmet)
    streams, gains, rows, packed = _plan(probe)
    nothing = torch.zeros(B, T, dtype=torch.bool)
    baselines: list[Inputs] = []  # each draw's baseline: the localiser replays the last

    def attempt(draw: int) -> list[float] | DetectorResult:
        if draw == 0:  # the first draw: the call query_locality stacks its case in too
            comparison = stacked(probe, SEPARATE_STREAMS, det)
        else:
            base = separate_streams(probe)
            cases, label = key_cases(probe, base)
            comparison = compare(probe, base, cases, label=label)
        if isinstance(comparison, DetectorResult):
            return comparison
        base = comparison.base
        baselines.append(base)

        def most(changes):  # per stream, the most its rows moved
            if packed:  # (B, [H,] Tq): each stream changed its own sequences
                return [float(changes[0][rows[stream][:, 0]].max()) for stream in streams]
            return [float(c.max()) for c in changes]

        # a change far above what rounding can do is a move; only below that is the null twin needed
        against_base = most(comparison.changes)
        if all(m > ROUNDING_BOUND * comparison.tol for m in against_base):
            return against_base
        # "moved" is then measured against a null twin of the same call (the baseline stacked as often, nothing
        # changed), not against the baseline rows: CPU kernels round a row by its place in the batch (a layer
        # that ignores its values moved sequence 1 by 2.8e-7 of its RMS, against the baseline in rows 0-1, from
        # rows 2-3 of the same call), while the same inputs in the same place give the same numbers exactly
        copies = comparison.copies or len(comparison.cases) + 1
        null = compare(probe, base, [Case(base, hold=nothing, when="nothing changed")] * (copies - 1),
                       label="keys, values: the same call with nothing changed")
        if isinstance(null, DetectorResult):
            return null
        twin = null.call.output.out.chunk(copies)
        scale = baseline_scale(comparison.baseline_output(), centred=True) or None
        changes = [relative_change(comparison.case_output(i), twin[comparison.first + i], centred=True, scale=scale)
                   for i in range(len(comparison.cases))]
        if any(c is None for c in changes):
            return skip(det, "the output is zero or non-finite everywhere on this probe, so a change cannot be "
                             "measured against it")
        return most(changes)

    # moved at all: a layer that ignores an input computes the same numbers and moves by exactly 0 on every
    # draw, while a correct layer at d_k = 1 and std-0.02 initialisation in bfloat16 moved by as little as 0.5%
    # of its RMS, and by exactly 0 on one draw in a few hundred (keys that round alike, a query near 0): an input
    # that did not move the output is drawn again, up to KEY_DRAWS times in all
    tol, moved, draws = 0.0, None, 0
    while draws < KEY_DRAWS and (moved is None or not all(m > tol for m in moved)):
        reading = attempt(draws)
        if isinstance(reading, DetectorResult):
            return reading
        moved = reading if moved is None else [max(a, b) for a, b in zip(moved, reading)]
        draws += 1
    dead = [stream for stream, m in zip(streams, moved) if not m > tol]
    evidence = "; ".join(f"changing every {stream}" + (f" of sequence {b}" if packed else "") +
                         f" (x{gains[stream][0]:g}) moved the output by at most {m:.3g} of its RMS"
                         for b, (stream, m) in enumerate(zip(streams, moved)))
    # one memory stream (keys and values the same input) changes both at once: the words say what was changed,
    # never that the keys and the values were each found to be read
    if len(streams) == 1:
        evidence += " (the memory: its keys and values, one input)"
        depends, missing = f"its memory ({ONE_MEMORY})", "its memory (its keys and values, one input)"
    else:
        depends, missing = "the keys and on the values", f"the {' or the '.join(d + 's' for d in dead)}"
    drawn = f", over {draws} independent draws" if draws > 1 else ""
    return judge(det, bool(dead), f"the output does not depend on {missing}",
                  f"the output depends on {depends}", value=min(moved), threshold=tol,
                  evidence=f"{evidence}{drawn} (any change expected; a layer that ignores the input moves by exactly 0)",
                 replay=baselines[-1])


KEY_DRAWS = 3
"""Independent draws keys_matter makes before an input that never moved the output is called ignored."""

ONE_MEMORY = "keys and values are one input here, changed together: whether each is read is not told apart"


def _plan(probe: Probe) -> tuple[tuple[str, ...], dict, dict, bool]:
    """(the streams changed, their gains, the rows each changes (B, T), packed: in one copy of the batch)."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    # the keys act only through the softmax: at d_k = 1 and std-0.02 initialisation a bfloat16 layer whose W_Q
    # drew 0.0012 moved its output by exactly 0 (below its rounding) for keys pushed 10000x (15 of 400 seeds),
    # so keys are pushed a million-fold outside float16 (whose range ends at 65504)
    gains = {"key": (100.0,) if s.dtype == torch.float16 else (1e6,), "value": perturbation_gains(probe)}
    # a cross-attention module takes one memory stream: its value cannot change without its key
    streams = ("key", "value") if getattr(s, "separate_value", True) else ("key",)
    # with PACKED_KEYS positions or more, one copy of the batch: the keys of sequence 0 changed and the values of
    # sequence 1 (batch_independence checks that sequences do not mix; each row is read alone); with fewer, one copy
    # per stream, every sequence changed: at seq_len 2 a correct bfloat16 layer's one sequence moved by exactly 0 when
    # only its keys changed. One memory stream (key and value) has nothing to pack: its keys change in every
    # sequence at every length, and its evidence names no sequence
    packed = T >= PACKED_KEYS and 1 < len(streams) <= B
    rows = {stream: torch.zeros(B, T, dtype=torch.bool) if packed else torch.ones(B, T, dtype=torch.bool)
            for stream in streams}
    if packed:
        for b, stream in enumerate(streams):
            rows[stream][b::len(streams)] = True
    return streams, gains, rows, packed


@stacked_cases(SEPARATE_STREAMS, "keys_matter")
def key_cases(probe: Probe, base: Inputs) -> tuple[list[Case], str]:
    """The keys and the values changed alone: in one copy of the batch, or one copy each (see `_plan`)."""
    streams, gains, rows, packed = _plan(probe)
    nothing = torch.zeros(probe.BATCH, probe.t, dtype=torch.bool)
    changed = {stream: perturbed(probe, base, rows[stream], (stream,), gains=gains[stream])[0] for stream in streams}
    if packed:
        cases = [Case(Inputs(base.query, changed["key"].key, changed["value"].value), hold=nothing,
                      when="when only the keys of sequence 0 and the values of sequence 1 changed")]
    else:
        cases = [Case(changed[stream], hold=nothing, when=f"when only the {stream}s changed") for stream in streams]
    return cases, "keys, values changed alone"
