"""Perturb and compare: the one pipeline every invariance detector uses.

A detector states a property as "when these inputs change, these outputs must not move": future tokens
and causal outputs, blocked keys and every output, one query and the other rows. It builds the perturbed
inputs with `perturbed()`, which proves that the perturbation changed exactly what it claims (the probe's
own negative control), and hands baseline and perturbations to `compare()`, which calls the layer once on
all of them stacked along the batch, splits the output, measures each position's change relative to the
output's own scale, and words the evidence. The comparison also checks the other direction where it can:
outputs that a correct layer must move (the perturbed query's own row, rows that see the changed keys) did
move, so a layer whose output does not respond at all is "not measured", never "passed".

Change is measured relative to the baseline output's RMS (over finite values, centred on each feature's
mean so that an output bias does not inflate it): |new - old| / rms, the largest over
features. An absolute measure (or one floored at 1) lets a bug through when outputs are small,
as they are at the std-0.02 initialisation of GPT-2 and nanoGPT (outputs ~4e-3); a per-row measure divides
by zero on rows that are legitimately zero (a query with no key under torch's SDPA). NaN at the same place
in both runs is no change; NaN appearing or disappearing is an infinite one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._change import baseline_scale, relative_change
from ._errors import BlindProbe
from ._probe import Call, Probe
from ._result import DetectorResult
from ._thresholds import UNCHANGED, dtype_name, tolerance


@dataclass
class Inputs:
    """One set of layer inputs: query, key, value (one tensor for a single stream) and the extra mask,
    bool (B, Tq, Tk), True = may attend, beyond the causal mask the probe adds itself."""

    query: Tensor
    key: Tensor
    value: Tensor
    extra: Tensor | None = None

    @property
    def one_stream(self) -> bool:
        return self.query is self.key and self.key is self.value


@dataclass
class Case:
    """A perturbation of the baseline, and what a correct layer does with it.

    `hold`: bool (B, Tq), the output rows that must not move; `move`: bool (B, Tq) or None, rows that a
    correct layer does move (the positive control); `when`: how the evidence names the perturbation."""

    inputs: Inputs
    hold: Tensor
    when: str
    move: Tensor | None = None


def _position_change(new: Tensor, old: Tensor) -> Tensor:
    """(B, T): the greatest |new - old| over each position's features (and heads), in units of old's RMS (the
    probe's inputs: standard normal draws, finite, so no centring or NaN care is needed; kept cheap)."""
    wide = torch.float64 if old.dtype == torch.float64 else torch.float32
    old = old.to(wide)
    diff = (new.to(wide) - old).abs().amax(-1)  # per position, time last
    diff = diff / (float(old.square().mean().sqrt()) or 1.0)
    return diff.reshape(diff.shape[0], -1, diff.shape[-1]).amax(1).cpu()  # fold heads


def perturbed(probe: Probe, base: Inputs, positions: Tensor, streams: tuple[str, ...], *,
              gains: tuple[float, ...] = (1.0,)) -> list[Inputs]:
    """Copies of `base` with new random values at `positions` (bool (T,) or (B, T)) of the named streams
    ("query", "key", "value"; a single-stream input changes as one): x + gain * (draw - x), one copy per
    gain. A large gain makes the changed logits large whatever the initialisation, so that a weight that
    must not matter is pushed hard. Raises `BlindProbe` unless every claimed position changed by far more
    than rounding and nothing else changed."""
    s = probe.subject
    gen = probe.generator()
    B = base.query.shape[0]

    def redraw(x: Tensor) -> Tensor:
        t = x.shape[s.time_dim]
        where = positions if positions.dim() == 2 else positions.expand(B, t)  # (B, T)
        at = where.to(x.device)
        draw = torch.float64 if x.dtype == torch.float64 else torch.float32
        old = x.movedim(s.time_dim, 1)[at]  # (n, ...): the claimed positions only, drawn at those alone
        noise = torch.randn(old.shape, generator=gen, dtype=draw).to(device=x.device, dtype=x.dtype)
        # a fresh draw can land next to the old value (at d = 1, |new - old| < 0.2 one time in ten): such
        # positions move by 1 more in every feature, away from the old value, so that each claimed position
        # changes for sure and positions still differ from each other (a fixed +-2 made them all alike after
        # a large gain: equal keys, equal logits, and a correct layer that seemed to ignore its keys)
        delta = noise.to(draw) - old.to(draw)
        close = delta.abs().amax(-1, keepdim=True) < 1.0
        if bool(close.any()):  # only at small widths (every feature within 1 of the old value): at d = 512, never
            away = (delta >= 0).to(draw) * 2 - 1  # +-1 (a `where` of two Python numbers ran 0.5 ms at (2, 128, 512))
            noise = torch.where(close, (old.to(draw) + delta + away).to(x.dtype), noise)
        copies = []
        for gain in gains:
            new = x.clone()
            new.movedim(s.time_dim, 1)[at] = old + gain * (noise - old)  # written through the view
            # the negative control: the claimed positions moved (each by far more than rounding), no other did
            change = _position_change(new, x)
            moved, still = change > 10 * tolerance(UNCHANGED, x.dtype), change == 0
            if not bool((moved | ~where).all() & (still | where).all()):  # no boolean indexing: no nonzero() to sync
                raise BlindProbe(f"{probe.detector}: the perturbation of {int(where.sum())} positions changed "
                                 f"{int(moved[where].sum())} of them and {int((~still[~where]).sum())} others")
            copies.append(new)
        return copies

    if base.one_stream:
        xs = redraw(base.query) if streams else [base.query] * len(gains)
        return [Inputs(x, x, x, base.extra) for x in xs]
    n = len(gains)
    qs = redraw(base.query) if "query" in streams else [base.query] * n
    ks = redraw(base.key) if "key" in streams else [base.key] * n
    if base.value is base.key:
        vs = ks
    else:
        vs = redraw(base.value) if "value" in streams else [base.value] * n
    return [Inputs(q, k, v, base.extra) for q, k, v in zip(qs, ks, vs)]


@dataclass
class Comparison:
    """The measured changes of one `compare()`: per case, (B, [H,] Tq) relative changes and the rows held."""

    cases: list[Case]
    changes: list[Tensor]
    tol: float
    call: Call
    base: Inputs | None = None  # the baseline the cases were compared with (None: the cases' own inputs)
    # where the cases are in the call's output, in copies of the batch: cases[i] in copy first + i of `copies`
    # (0: len(cases) + 1, the baseline in copy 0 and the cases after it; a stacked probe's call holds others' too)
    first: int = 1
    copies: int = 0

    def outputs(self) -> tuple:
        """The call's output split into its copies of the batch: the baseline's first."""
        return self.call.output.out.chunk(self.copies or len(self.cases) + 1)

    def baseline_output(self):
        return self.outputs()[0]

    def case_output(self, i: int):
        return self.outputs()[self.first + i]


def compare(probe: Probe, base: Inputs, cases: list[Case], *, label: str, parts: tuple = ()) -> Comparison | DetectorResult:
    """One call on [baseline, *perturbations] stacked along the batch; the changes of each against the
    baseline. A `DetectorResult` (skip) instead when the layer raised or its output cannot be compared.
    `parts`: the call's readers, for a stacked probe (see `ProbeShape.parts`)."""
    return compared(probe, stacked_call(probe, base, cases, label=label, parts=parts), base, cases)


def stacked_call(probe: Probe, base: Inputs, cases: list[Case], *, label: str, parts: tuple = ()) -> Call:
    """The call of `compare`: baseline and cases stacked along the batch, each with its own extra mask."""
    return probe.call(*stacked_batch(probe, base, cases), label=label, parts=parts)


def stacked_batch(probe: Probe, base: Inputs, cases: list[Case]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(query, key, value, mask) of `stacked_call`: one stream stays one tensor, a value that is the key stays it."""
    s = probe.subject
    B, t_q, t_k = base.query.shape[0], base.query.shape[s.time_dim], base.key.shape[s.time_dim]
    everything = [base] + [c.inputs for c in cases]
    n = len(everything)
    Q = torch.cat([x.query for x in everything])
    K = Q if base.one_stream else torch.cat([x.key for x in everything])
    V = K if base.one_stream or base.value is base.key else torch.cat([x.value for x in everything])
    extra = None if base.extra is None else torch.cat([x.extra for x in everything])
    return Q, K, V, probe.allowed(n * B, t_q, t_k, extra)


def compared(probe: Probe, call: Call, base: Inputs, cases: list[Case]) -> Comparison | DetectorResult:
    """The changes of `stacked_call`'s cases against its baseline."""
    s, det = probe.subject, probe.detector
    B, t_q = base.query.shape[0], base.query.shape[s.time_dim]
    n = len(cases) + 1
    if not call.ok:
        return not_run(det, call)
    out = call.output.out
    rows = s.own_queries or t_q  # a row per token's query, or per query of the layer's own
    per_row = out.dim() >= 3 and out.shape[0] == n * B and out.shape[-2 if s.form == "function" else 1] == rows
    if not per_row:
        return skip(det, f"the output {tuple(out.shape)} has no row per query and batch element (see output_shape)")
    chunks = out.chunk(n)
    changes = []
    scale = baseline_scale(chunks[0], centred=True) or None  # once for all the perturbations
    for chunk in chunks[1:]:
        change = relative_change(chunk, chunks[0], centred=True, scale=scale)
        if change is None:
            return skip(det, "the output is zero or non-finite everywhere on this probe, so a change cannot be "
                             "measured against it")
        changes.append(change)
    return Comparison(cases, changes, tolerance(UNCHANGED, s.dtype), call, base)


def transposed_layout(x: Tensor) -> Tensor:
    """The same values laid out transposed in memory, not contiguous: a `.view()` that assumes the standard layout
    (a view after a transpose, without `.contiguous()`) raises on it."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


NON_CONTIGUOUS = "non-contiguous inputs"
"""The label of a probe whose inputs are laid out so: runs' own, or in a full audit output_variance's identical
tokens."""


def unravel(flat, shape) -> tuple[int, ...]:
    """`torch.unravel_index` of one flat index, in Python: torch's version calls torch._check, whose first use
    imports torch.fx.experimental.symbolic_shapes and sympy (~0.3 s, ~480 modules) on an audit's first finding."""
    flat, index = int(flat), []
    for n in reversed(tuple(shape)):
        flat, i = divmod(flat, n)
        index.append(i)
    return tuple(reversed(index))


def expand_rows(rows: Tensor, like: Tensor) -> Tensor:
    """(B, Tq) -> like's shape, (B, Tq) or (B, H, Tq); or (B, Tq, H), the rows of an output of each head apart,
    (B, T, H, d) with its features folded, where only its middle axis is Tq long."""
    rows = rows.to(like.device)
    if heads_last(rows, like):
        return rows.unsqueeze(-1).expand_as(like)
    return rows.view(rows.shape[0], *([1] * (like.dim() - 2)), rows.shape[-1]).expand_as(like)


def heads_last(rows: Tensor, like: Tensor) -> bool:
    """Whether `like` holds the rows (B, Tq) of `rows` as (B, Tq, H): an output of each head apart, (B, T, H, d), with
    its features folded (only its middle axis Tq long)."""
    return like.dim() == 3 and like.shape[1] == rows.shape[-1] != like.shape[-1]


def where_text(index: tuple[int, ...], ndim: int, *, heads_after: bool = False) -> str:
    """An index of a change as the report says it: (b, t), (b, h, t), or (b, t, h) where `heads_after` (a per-head
    output's rows: see `heads_last`)."""
    names = (("b", "t") if ndim == 2 else ("b", "t", "h") if ndim == 3 and heads_after else ("b", "h", "t") if ndim == 3
             else tuple(f"i{k}" for k in range(ndim)))
    return "(" + ", ".join(f"{n}={i}" for n, i in zip(names, index)) + ")"


def allowed_text(tol: float, dtype) -> str:
    return f"up to {tol:.2g} of the outputs' RMS about their mean allowed for {dtype_name(dtype)}"


def held(comparison: Comparison, probe: Probe, *, what: str, dtype: torch.dtype | None = None
         ) -> tuple[int, float, str, str]:
    """The verdict material for 'the held rows must not move': (bad count, worst change, evidence,
    unresponsive) where `unresponsive` is non-empty when some case's `move` rows did not move at all. `dtype`: the
    one the outputs were computed in, where not the layer's (a float64 copy's reading)."""
    tol = comparison.tol
    total = bad = 0
    worst, worst_at = 0.0, None
    silent = []
    for case, change in zip(comparison.cases, comparison.changes):
        hold = expand_rows(case.hold, change)
        checked = change[hold]
        total += int(hold.sum())
        bad += int((checked > tol).sum())
        if checked.numel() and (worst_at is None or float(checked.max()) > worst):
            masked = torch.where(hold, change, torch.full_like(change, -1.0))
            index = unravel(masked.argmax(), change.shape)
            worst, worst_at = float(checked.max()), (index, change.dim(), case.when, heads_last(case.hold, change))
        if case.move is not None and bool(case.move.any()):
            moved = change[expand_rows(case.move, change)]
            if not bool((moved > tol).any()):
                silent.append(case.when)
    if total == 0:
        return 0, 0.0, "no output rows to check", ""
    at = f" at {where_text(worst_at[0], worst_at[1], heads_after=worst_at[3])} {worst_at[2]}" if worst_at else ""
    shown = "inf (non-finite)" if math.isinf(worst) else f"{worst:.3g}"
    text = (f"{bad} / {total} {what} changed ({100 * bad / total:.1f}%); greatest change {shown}{at} "
            f"({allowed_text(tol, dtype or probe.subject.dtype)})")
    unresponsive = ("; ".join(silent) + ": no output moved, not even the rows a correct layer moves") if silent else ""
    return bad, worst, text, unresponsive


def skip(det: str, reason: str) -> DetectorResult:
    return DetectorResult(det, "skip", f"not measured: {reason}")


def not_run(det: str, call: Call) -> DetectorResult:
    if call.not_taken:  # a probe the layer as held cannot be given: not applicable, with the reason
        return skip(det, f"not applicable: {call.error.reason}; see `runs`")
    return skip(det, f"the layer raised on this detector's probe ({call.describe_error()}); see `runs`")
