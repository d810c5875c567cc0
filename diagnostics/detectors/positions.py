"""`relative_positions`: a layer whose positions are relative (rotary, ALiBi, T5's buckets) gives its tokens the
same outputs when every position is shifted by the same offset.

Applicability is measured, never assumed. One stacked call holds the probe tokens, the same tokens with the keys'
positions permuted (all but the newest one reversed; in one-stream self-attention the queries move with them),
and the probe tokens again. A layer without a positional mechanism is equivariant to that permutation: every
output row that sees the same keys is unchanged, and the detector is not applicable. The third copy is the
randomness control: two copies of one input in one call that differ mean randomness the shift would be read
through (dropout left on), and nothing is measured.

The shift: P tokens before the probe's, which every real query is blocked from by the mask (left padding; the
padding queries attend the padding keys too, so no row is fully blocked). The real tokens' outputs must equal the
unshifted ones. A layer that takes no mask cannot be shifted: a visible skip saying what would make it measurable.
(Positions driven through a Hugging Face layer's own position argument and an empty cache were a second method, for
a layer with rotary positions and a cache but no mask: no attention class of transformers 5.25 is one, so no test
could reach it, and it was removed.)

The shifted call carries B more rows, identical tokens shifted alike, and is the one observed: on them the scores
differ only by what positions add, which tells ALiBi's sign (a bias linear in the distance must fall with it). The
permuted call is not observed, so a layer without positions pays no observer (a layer that takes no mask gets a
call of the identical tokens alone).

What breaks shift invariance legitimately, and how each is told apart:
- positions absolute by design (learned or sinusoidal absolute embeddings added inside the layer): declared, the
  detector is not applicable (`positions="absolute"`, or a `position_embedding_type` of "absolute" on the layer
  or its config, Hugging Face's name); undeclared, the failure names that declaration;
- a declared attention pattern that depends on absolute positions (chunked blocks): compared at this shift, and
  not applicable where the pattern's mask moves with the shift (a sliding window does not);
- the layer's own causal mask from a fixed buffer: bottom-right over P + T tokens, so the real block is the same;
  a context the layer declares bounds P + T (`probe_context`: a `block_size` it runs beyond is a tile, no bound);
- dropout in training mode: the audit runs in eval mode, and randomness left on is the control above;
- length-dependent rotary scaling (dynamic NTK, LongRoPE's factors past a length): P + T stays within the
  probe's own length bound, below any length such a rule switches at in the suite; beyond it, audit with a
  seq_len that keeps P + T below the switch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._core import baseline_scale, not_run, relative_change, skip, unravel, where_text
from .._masks import expressible
from .._observe import Observer
from .._probe import Probe
from .._registry import NOT_APPLICABLE, Need, detector
from .._result import DetectorResult, ProbeShape, Site
from .._subject import probe_context
from .._thresholds import UNCHANGED, dtype_name, tolerance
from .._tracing import (
    SOFTMAXES,
    UNRESCALED_FIX,
    Op,
    ancestors,
    branch_of,
    fused_ops,
    last_rows,
    moved,
    op_site,
    producer,
    through_carries,
    trace_call,
    unrescaled_accumulators,
    user,
)
from ._common import float64_copy_or_skip, logit_gain, result, zeros_drawn
from ._rotary import rotary_pair_sites

DET = "relative_positions"

SHIFT_TOKENS = 5
"""P, the shift: odd and not a power of two, so that no block size or period of a positional rule is a multiple of it
by accident (chunked blocks of 2, 4, 8; a rotary frequency whose period divides P)."""

POSITION_TOKENS = 12
"""The probe length of the shift (the audit's seq_len, capped): the shifted call has P + T tokens, its cost
independent of seq_len."""

SHIFT_MOVES = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,  # correct layers measured 1.9e-6 (margin 10.7x); the broken rotaries at least 2.1
    torch.float16: 4e-2,  # measured 9.5e-3 (margin 4.2x); broken at least 2.1 (52x over)
    torch.bfloat16: 0.3,  # measured 9.8e-2 (margin 3.1x); broken at least 2.1 (7x over)
}
"""How far (relative to the outputs' RMS about their mean, the largest over features) a real token's output may
move when every position is shifted: rounding only, since the compared rows see the same keys at the same
distances, but the angles of a rotary embedding are computed (and rounded, cos and sin to the layer's dtype) at
other positions. Measured with `python tests/test_relative_positions.py` (5 seeds x default and std-0.02
initialisation x causal and not: our rotary of both pairings, ALiBi and T5-bias layers, and the two broken
rotaries); the Hugging Face rotary and T5 layers of tests/test_real_layers.py stay below it too (measured there,
see that test's comment)."""

PERMUTATION_MOVES = UNCHANGED
"""How far the permutation of the keys' positions may move an output of a layer without positions (only the order of
the sums changes): the "unchanged" tolerance. A reading above it only means the shift is measured: a layer without
positions then passes it, so a low bar costs one call, never a false finding."""


UNDERFLOW = math.log(torch.finfo(torch.float32).tiny)  # -87.3
"""A score this far below its row's largest has a float32 softmax weight under the smallest normal number (0 or
subnormal): its key is blocked, whatever blocked it: -inf, or the finite fill of Hugging Face's finfo.min, -1e4 or
-1e9, which left the blocked keys in the distance reading as scores 1e4 to 3e38 below the rest, no line, so a flipped
ALiBi behind such a mask passed (BLOOM's, transformers 5.25). ALiBi's own penalty on the probe's 12 tokens is at most
11 x its steepest slope (2^-0.5, 16 heads): 7.8, far inside it."""


def shift_tolerance(dtype) -> float:
    return SHIFT_MOVES.get(dtype, SHIFT_MOVES[torch.float32])


ENOUGH_TOKENS = Need("seq_len >= 3", lambda p: p.t >= 3,
                     "needs a probe length of 3 or more ({seq_len} 3 or more): the keys' positions are permuted "
                     "around the newest one, which takes two others")


@dataclass(frozen=True)
class DistanceReplay:
    """The identical tokens the distance reading was made on (one copy of the stacked call), and their mask."""

    query: Tensor
    key: Tensor
    value: Tensor
    allowed: Tensor | None


@dataclass(frozen=True)
class LostReplay:
    """The stacked call whose keys' permutation moved nothing, though positions were declared."""

    query: Tensor
    key: Tensor
    value: Tensor
    allowed: Tensor | None


@dataclass(frozen=True)
class OrderReplay:
    """The probe tokens whose keys' order moved the output, where no shift was possible, and their mask."""

    query: Tensor
    key: Tensor
    value: Tensor
    allowed: Tensor | None


@dataclass(frozen=True)
class ShiftReplay:
    """What the verdict was computed on: the unshifted call and the shifted one (its inputs and mask)."""

    query: Tensor
    key: Tensor
    value: Tensor
    allowed: Tensor | None
    shifted: tuple  # (query, key, value) with the P padding tokens first
    shifted_allowed: Tensor | None
    shift: int
    tol: float

    @property
    def consequence_of(self) -> tuple[str, ...]:
        """Detectors whose failure explains this one: padding that the mask blocks yet moves the real tokens follows
        from a layer that lets blocked keys in (a second softmax gives them weight back): fix that first."""
        return ("mask_honoured",)


def declared_positions(probe: Probe) -> tuple[str | None, str]:
    """('absolute' | 'relative' | None, where it was declared): audit's `positions=` (set on the probe), else the
    layer's or its config's `position_embedding_type` (Hugging Face's name: "absolute", "relative_key", "rotary")."""
    given = getattr(probe, "positions", None)
    if given is not None:
        return str(given), f'positions="{given}"'
    layer = probe.subject.layer
    for holder, name in ((layer, "the layer's"), (getattr(layer, "config", None), "its config's")):
        value = getattr(holder, "position_embedding_type", None) if holder is not None else None
        if isinstance(value, str):
            kind = "absolute" if value == "absolute" else "relative"
            return kind, f'{name} position_embedding_type="{value}"'
    return None, ""


def _identical(s, q: Tensor, k: Tensor, v: Tensor, n: int) -> tuple:
    """(query, key, value) of `n` tokens, every one the first of q's (k's, v's), one tensor where q is k (is v)."""
    t = s.time_dim
    alike = lambda x: x.narrow(t, 0, 1).expand(*x.shape[:t], n, *x.shape[t + 1:]).contiguous()  # noqa: E731
    if q is k:
        return (alike(q),) * 3
    key = alike(k)
    return alike(q), key, key if v is k else alike(v)


def _stack(*calls) -> tuple:
    """The (query, key, value) of several calls stacked along the batch, one tensor wherever each call had one."""
    q = torch.cat([c[0] for c in calls])
    k = q if all(c[1] is c[0] for c in calls) else torch.cat([c[1] for c in calls])
    v = k if all(c[2] is c[1] for c in calls) else torch.cat([c[2] for c in calls])
    return q, k, v


def _cat_time(s, pad: Tensor, x: Tensor) -> Tensor:
    return torch.cat([pad, x], dim=s.time_dim).contiguous()


def _rows(s, out: Tensor, start: int, n: int) -> Tensor:
    return out.narrow(s.time_dim, start, n)


def _shift_mask(probe: Probe, B: int, P: int, T: int) -> Tensor:
    """(B, P + T, P + T), True = may attend: every real query blocked from the padding keys; the padding queries
    see every key (causally: the padding keys before them), so that no row is fully blocked. For a key-padding layer
    audited as not causal, one row for every query (the padding keys blocked for all)."""
    n = P + T
    i, j = torch.arange(n).unsqueeze(-1), torch.arange(n)
    real_keys = (j >= P).expand(n, n)
    if probe.subject.convention == "key_padding" and not probe.causal:
        mask = real_keys
    else:
        mask = real_keys | (i < P)
    return mask.expand(B, n, n).clone()


def _pattern_moves(probe: Probe, B: int, P: int, T: int) -> bool:
    """Whether the declared pattern's mask over the real tokens changes when they are shifted by P."""
    if probe.pattern is None:
        return False
    shifted = probe.pattern.allowed(B, P + T, P + T)[:, P:, P:]
    return not torch.equal(shifted.cpu(), probe.pattern.allowed(B, T, T).cpu())


def reach_period(probe: Probe) -> int:
    """The least shift p under which the keys the layer's queries reach (`Probe.own_reach`) are the same pattern,
    reach[i + p, j + p] = reach[i, j]: a block-local attention's window (local-attention's buckets of 4 with their
    look-around: 4), whose bounds sit at absolute positions by design, so that a shift by a multiple of p moves no
    bound. 1 where the layer reaches every key, or its reach is a band or a triangle (any shift keeps it), or none
    below half the tokens keeps it."""
    reach = probe.own_reach()
    if reach is None:
        return 1
    n = reach.shape[0]
    return next((p for p in range(1, n // 2 + 1) if torch.equal(reach[p:, p:], reach[:-p, :-p])), 1)


@detector(DET, "for a layer whose positions are relative (rotary, ALiBi, T5 buckets), shifting every position by the "
          "same offset leaves the real tokens' outputs unchanged, a linear distance bias penalises distance, and a "
          "bidirectional layer's positions tell apart the keys on both sides of its query",
          targets=("rotary pairs rotated in one layout, their cos/sin table laid out in the other",
                   "rotary applied over the head axis of a (B, T, H, d) tensor",
                   "a position bias of absolute, not relative, positions",
                   "ALiBi slopes with the wrong sign (far keys rewarded)",
                   "a bidirectional layer given the causal form of its position buckets (every later key in the "
                   "query's own)"),
          fix="let positions reach the scores only through j - i: rotate q and k with the same pairing as the cos/sin "
              "table (interleaved pairs (2m, 2m+1) with freqs.repeat_interleave(2), half-split pairs (m, m + d/2) with "
              "torch.cat([freqs, freqs])), along the time axis; if the layer's positions are absolute by design "
              "(position embeddings added inside it), declare positions=\"absolute\"",
          needs=(ENOUGH_TOKENS,), locate=lambda probe, result: shift_sites(probe, result))
def check_relative_positions(probe: Probe) -> DetectorResult:
    s, B = probe.subject, probe.BATCH
    if s.own_queries:
        return DetectorResult(DET, "skip", f"{NOT_APPLICABLE}the layer attends with {s.own_queries} quer"
                                           f"{'y' if s.own_queries == 1 else 'ies'} of its own, which have no position "
                                           f"among the tokens: no distance between a query and a key to be relative")
    T = min(probe.t, POSITION_TOKENS)
    period = reach_period(probe)
    P = SHIFT_TOKENS if period == 1 else period * -(-SHIFT_TOKENS // period)
    limit = probe_context(s, T + P)
    if limit is not None and T + P > limit[0]:
        P = max(0, limit[0] - T)
        if P < 1:
            T, P = limit[0] - 1, 1
    if T < 3:
        return skip(DET, f"the layer's context ({limit[1] if limit else '?'}) leaves no room to shift 3 tokens")
    tol = shift_tolerance(s.dtype)
    gain = logit_gain(probe)  # tokens whose logits spread (std-0.02 initialisation gives near-uniform attention)
    cross = s.separate_kv and not probe.causal
    query, key, value = probe.streams(B, T, cross=cross)
    # scaled as the streams are shared: a memory that is key and value stays one tensor (torch's MultiheadAttention
    # packs its key and value projections when `key is value`; a layer may take nothing else)
    q = gain * query
    k = q if key is query else gain * key
    v = k if value is key else gain * value
    one = q is k  # not cross: probe.streams gave one tensor (x, x, x), kept one above
    t = s.time_dim
    # the keys' positions permuted: all but the newest reversed (the newest query sees every key, causal or not)
    perm = torch.cat([torch.arange(T - 2, -1, -1), torch.tensor([T - 1])]).to(q.device)
    inverse = torch.argsort(perm)
    pq = q.index_select(t, perm) if one else q
    pk = k.index_select(t, perm)
    pv = pk if (one or v is k) else v.index_select(t, perm)
    everything = [(q, k, v), (pq, pk, pv), (q, k, v)]
    Q = torch.cat([x[0] for x in everything])
    K = Q if one else torch.cat([x[1] for x in everything])
    V = K if (one or v is k) else torch.cat([x[2] for x in everything])
    n = len(everything)
    extra = torch.ones(n * B, T, T, dtype=torch.bool) if s.takes_mask else None
    # not observed: a layer without positions (the common case) needs no scores, and the distance reading below
    # observes the shifted call, made anyway (MultiHeadAttention(512, 8) at seq_len 128, one thread: 8 ms -> 4 for
    # this detector, 0.4 of a forward pass; a rotary layer's, its shifted call observed instead, 12 -> 13 to 14 ms)
    stacked = probe.call(Q, K, V, probe.allowed(n * B, T, T, extra), label=f"keys' positions permuted ({T} tokens)")
    if not stacked.ok:
        return not_run(DET, stacked)
    out = stacked.output.out
    if out.dim() < 3 or out.shape[0] != n * B or out.shape[t] != T:
        return skip(DET, f"the output {tuple(out.shape)} has no row per query and batch element (see output_shape)")
    base_out, perm_out, again = out.chunk(n)
    scale = baseline_scale(base_out, centred=True)
    if not scale > 0:
        return skip(DET, "the output is zero or non-finite everywhere, so a change cannot be measured against it")
    noise = relative_change(again, base_out, centred=True, scale=scale)
    if noise is not None and float(noise.max()) > tol:
        return skip(DET, f"two copies of the same input in one call differ by {float(noise.max()):.3g} of the outputs' "
                         f"RMS (randomness left on: see eval_determinism), so a shift cannot be told from it")
    # rows that see the same keys after the permutation: every row of a non-causal layer (its queries put back in
    # order where they moved too), the newest one only of a causal layer
    back = perm_out.index_select(t, inverse) if one else perm_out
    rows = torch.arange(T) if not probe.causal else torch.tensor([T - 1])
    permuted = relative_change(_pick(s, back, rows), _pick(s, base_out, rows), centred=True, scale=scale)
    uses = float(permuted.max()) if permuted is not None else 0.0
    which = "every query" if not probe.causal else f"query {T - 1}, which sees every key"
    bar = tolerance(PERMUTATION_MOVES, s.dtype)
    if uses <= bar and getattr(probe, "positions", None) == "relative":
        # the user promised positions (rotary, ALiBi, a relative bias): a layer with none has lost them, e.g. a
        # rotation applied over the head axis, which cancels in q·k; only where rounding cannot hide them
        if s.dtype in (torch.float32, torch.float64):
            return result(DET, "fail", 'positions="relative" is declared, but the outputs do not depend on positions '
                                       "at all: the rotation or bias is lost", value=uses, threshold=bar,
                          replay=LostReplay(Q, K, V, probe.allowed(n * B, T, T, extra)),
                          evidence=f"permuting the keys' positions moved the output of {which} by {uses:.3g} of the "
                                   f"outputs' RMS at most (up to {bar:.2g} is rounding); a layer that uses positions "
                                   f"moves it", fix="apply the rotation over each head's feature pairs, by each token's "
                                   "position along the sequence axis (not the head axis), before q·k")
        return skip(DET, f'not measured: positions="relative" is declared, but permuting the keys moved the output '
                         f"by {uses:.3g} at most, within {dtype_name(s.dtype)} rounding ({bar:.2g}): audit in float32 "
                         f"to tell a lost rotation from rounding")
    if uses <= bar:
        return DetectorResult(DET, "skip", NOT_APPLICABLE + f"the layer has no positional mechanism (none that shows "
                              f"above {dtype_name(s.dtype)} rounding): permuting the keys' positions moved the output of "
                              f"{which} by {uses:.3g} of the outputs' RMS at most (up to {bar:.2g} is rounding)")
    kind, where = declared_positions(probe)
    if kind == "absolute":
        return DetectorResult(DET, "skip", NOT_APPLICABLE + f"the layer's positions are absolute by design ({where})")
    if _pattern_moves(probe, B, P, T):
        return DetectorResult(DET, "skip", NOT_APPLICABLE + f"the declared attention pattern depends on absolute "
                              f"positions: its mask over the real tokens changes when they are shifted by {P}")
    seen = f"permuting the keys' positions moved {which} by {uses:.3g} of the outputs' RMS: the layer uses positions"
    # identical tokens (every one the first), so that the scores differ only by what positions add to them: B more
    # rows of the shifted call, shifted alike, and read over the real tokens (positions P.., the same distances)
    same, twins = _identical(s, q, k, v, T), _identical(s, q, k, v, P + T)
    base_allowed = probe.allowed(B, T, T, extra[:B] if extra is not None else None)
    record, copies, skipped, call = None, 1, 0, None
    if s.takes_mask:
        pads = [gain * x for x in probe.streams(B, P, cross=cross)]
        sq = _cat_time(s, pads[0], q)
        if one:
            sk = sv = sq
        else:
            sk = _cat_time(s, pads[1], k)
            sv = sk if v is k else _cat_time(s, pads[2], v)
        shifted = (sq, sk, sv)
        shifted_allowed = probe.allowed(B, P + T, P + T, _shift_mask(probe, B, P, T))
        both = _stack(shifted, twins)
        call = probe.call(*both, probe.allowed(2 * B, P + T, P + T, _shift_mask(probe, 2 * B, P, T)),
                          label=f"{P} padding tokens before {T}, blocked by the mask (and {T} identical tokens)",
                          observe=True)
        if call.ok and call.output.out.shape[0] == 2 * B:
            got, record, copies, skipped = call.output.out[:B], call.record, 2, P
        how = f"{P} padding tokens before them, which the mask blocks for every real query"
        if period > 1:
            how += (f"; {P}, a multiple of {period}: the layer's own windows repeat every {period} tokens (the keys "
                    f"its queries reach, `own_reach`), and a shift of {SHIFT_TOKENS} would move their bounds")
    if record is None:  # no shifted call carried the identical tokens (none is possible, or it raised): alone
        alone = probe.call(*same, base_allowed, label=f"{T} identical tokens", observe=True)
        record, copies, skipped = (alone.record if alone.ok else None), 1, 0
    rewarded = distance_reward(record, copies, B, T, s.dtype, skip=skipped)
    if rewarded and s.dtype != torch.float64:
        rewarded = _rewarded_in_float64(probe, DistanceReplay(*same, base_allowed), rewarded)
    if rewarded:
        return result(DET, "fail", "the position bias rewards distance: on identical tokens the scores grow with the "
                                   "distance to the key, so far keys win over near ones",
                      value=rewarded[0], threshold=0.0, evidence=f"{rewarded[1]}; {seen}",
                      fix=f"make the bias penalise distance: {BIAS_SIGN_FIX}",
                      replay=DistanceReplay(*same, base_allowed))
    flat = one_sided(record, copies, B, T, s.dtype, skip=skipped) if not probe.causal and probe.pattern is None \
        else None
    if flat:
        flat = _one_sided_in_float64(probe, OneSidedReplay(*same, base_allowed), flat)
    if flat:
        return result(DET, "fail", f"positions tell apart the keys {flat[1]} a query but not those {flat[2]} it: on "
                                   f"identical tokens a query scores every key {flat[2]} it alike",
                      value=flat[0], threshold=one_sided_bound(s.dtype), evidence=f"{flat[3]}; {seen}",
                      fix=ONE_SIDED_FIX, replay=OneSidedReplay(*same, base_allowed))
    if call is not None and not call.ok:
        return not_run(DET, call)
    if call is None:
        # no shift is possible, but the order the keys come in moved the output: an online softmax that adds a block of
        # keys to a running value not rescaled when the running max grew weighs the keys by the block they come in (a
        # function form is caught by output_variance, given value rows apart from its keys; one stream never is)
        order = OrderReplay(q, k, v, base_allowed)
        probe.passes += 1
        if unrescaled_accumulators(trace_call(s, q, k, v, base_allowed, seed=probe.seed)):
            return result(DET, "fail", "the outputs depend on the order of the keys, through a running value of the "
                                       "layer's online softmax that is not rescaled when the running max grows",
                          value=uses, threshold=bar,
                          evidence=f"permuting the keys' positions moved {which} by {uses:.3g} of the outputs' RMS "
                                   f"(up to {bar:.2g} is rounding; attention without positions is unmoved), and the "
                                   f"traced call adds a block of keys to a running value kept relative to the old "
                                   f"running max, after the max grew",
                          fix=UNRESCALED_FIX, replay=order)
        return skip(DET, f"{seen}, but no shift of its positions is possible: the layer takes no mask (left padding "
                         f"needs one to block the padding). Give forward a mask "
                         f"argument (forward(x, mask=None)), or audit it through a wrapper that passes "
                         f"positions offset by P, to make it measurable")
    if call is not None and call.output.out.shape[0] != 2 * B:
        return skip(DET, f"the shifted call's output {tuple(call.output.out.shape)} has no row per batch element (see "
                         f"output_shape)")
    real = _rows(s, got, P, T)
    if tuple(real.shape) != tuple(base_out.shape):
        return skip(DET, f"the shifted call's output {tuple(got.shape)} does not match the unshifted {tuple(base_out.shape)}")
    if not bool(torch.isfinite(real).all()) and bool(torch.isfinite(base_out).all()):
        # the padding's mask made them non-finite (scores of -inf that reach the output without a softmax): a failure
        # of the mask's path, which moves no position, and which `gradients` (a padding mask) measures
        return skip(DET, f"the real tokens' outputs are non-finite once {P} padding tokens blocked by the mask come "
                         f"before them (finite without them), so a shift of positions cannot be measured: the mask's "
                         f"path gives inf or NaN (see `gradients` and `fully_masked_rows`)")
    change = relative_change(real, base_out, centred=True, scale=scale)
    if change is None:
        return skip(DET, "the shifted output is zero or non-finite everywhere, so a change cannot be measured")
    bad = change > tol
    worst = float(change.max())
    at = where_text(unravel(change.argmax(), change.shape), change.dim())
    evidence = (f"{int(bad.sum())} / {bad.numel()} outputs of the real tokens changed ({100 * float(bad.float().mean()):.1f}%) "
                f"when every position was shifted by {P} ({how}); greatest change {worst:.3g} at {at} (up to "
                f"{tol:.2g} of the outputs' RMS about their mean allowed for {dtype_name(s.dtype)}); {seen}")
    replay = ShiftReplay(q, k, v, base_allowed, shifted, shifted_allowed, P, tol)
    if bool(bad.any()):
        # before any finding, the shifted call once more: the in-call control above can miss randomness by chance
        # (dropout left on over a few weights can drop the same ones in both copies), and a shift read through it
        # would blame positions; only a failing audit pays this call
        again = probe.call(*shifted, shifted_allowed, label="the shifted call again (randomness control)")
        repeat = again.output.out if again.ok else None
        drift = relative_change(repeat, got, centred=True, scale=scale) if repeat is not None else None
        if drift is not None and float(drift.max()) > tol:
            return skip(DET, f"the same shifted input gave outputs {float(drift.max()):.3g} of their RMS apart in two "
                             f"calls (randomness left on: see eval_determinism), so a shift cannot be told from it")
    if bool(bad.any()):
        flag = _mask_is_a_flag(probe, shifted, shifted_allowed, got, P, T, tol)
        if flag:
            # the padding shifted nothing: its mask was never read, so no position was measured; the finding is the
            # mask's (mask_honoured blocks keys in the past, which such a layer lets in), not the positions'
            return skip(DET, f"the left padding meant to shift the positions is not blocked: the layer reads its mask "
                             f"only as a flag ({flag}), so a shift cannot be measured through it (see mask_honoured); "
                             f"{evidence}")
    if bool(bad.any()):
        declared = f"; {where} says they are relative" if kind == "relative" else ""
        return result(DET, "fail", f"the outputs depend on absolute positions: shifting every position by {P} moves "
                                   f"them{declared}", value=worst, threshold=tol, evidence=evidence, replay=replay)
    return result(DET, "pass", f"shifting every position by {P} (padding) leaves the real tokens' outputs unchanged: "
                               f"positions are relative", value=worst, threshold=tol, evidence=evidence)


DISTANCE_LINEAR = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,  # ALiBi measured <= 2.9e-7 of the scores' spread; rotary >= 0.69, T5 >= 0.94
    torch.float16: 5e-2,  # ALiBi measured <= 1.4e-2 (margin 3.7x); rotary >= 0.69 (14x over)
    torch.bfloat16: 0.3,  # ALiBi measured <= 0.116 (margin 2.6x: a bias added in bfloat16); rotary >= 0.69 (2.3x)
}
"""How exactly (largest residual over the largest centred score) the scores of identical tokens must follow a
straight line in the distance |i - j|, per head, for the bias to be read as ALiBi's and its slope's sign judged.
Rotary (cosines of the distance) and T5 (a learned value per bucket) are far from a line and are not judged.
Measured on tests/test_relative_positions.py's ALiBi, rotary and T5 layers, 3 seeds x default
and std-0.02 initialisation x causal and not, at float32, bfloat16 and float16 (108 audits), and the real-bug
benchmark's SDPA ALiBi pair (residual <= 1.3e-7 at every dtype: its bias is added in float32)."""


def _scores_seen(record, n: int, B: int, T: int, skip: int = 0) -> list[Tensor]:
    """The last copy's scores (B, heads, T, T) in float64, -inf where blocked, from the record's first softmax over
    (skip + T, skip + T) of the stacked batch, or its first fused attention (q·k times its scale, plus a float mask);
    over the last T queries and keys (the first `skip` are padding). A batch with the heads folded in, (nB*H, N, N),
    is read in both orders it can be folded in (`_per_copy`); [] where nothing was observed."""
    if record is None:
        return []
    N = skip + T
    for sm in record.softmaxes:
        x = sm.input
        if x.dim() >= 3 and tuple(x.shape[-2:]) == (N, N) and x.shape[0] % (n * B) == 0:
            return _per_copy(_blocked(x.double()), n, B, skip)
    for f in record.fused:
        # every axis before (N, d) is a batch of scores: torch 2.14 hands SDPA's (B*H, N, d) to its kernel as
        # (1, B*H, N, d), so the copies are counted over all of them, not over the first
        if f.q.shape[:-2].numel() % (n * B) or f.q.shape[-2] != N or f.k.shape[-2] != N or \
                f.q.shape[:-2] != f.k.shape[:-2]:
            continue
        x = (f.q.double() @ f.k.double().transpose(-2, -1)) * f.scale  # (nB, H, N, N) or (nB*H, N, N)
        if f.attn_mask is not None:
            m = f.attn_mask.expand_as(x) if f.attn_mask.dim() <= x.dim() else None
            if m is None:
                return []
            x = x.masked_fill(~m, -torch.inf) if m.dtype == torch.bool else x + m.double()
        if f.is_causal:
            x = x.masked_fill(torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1), -torch.inf)
        x = x if x.shape[0] % (n * B) == 0 else x.reshape(-1, N, N)  # (1, nB*H, N, N): its batch, unfolded
        return _per_copy(_blocked(x), n, B, skip)
    return []


def _blocked(x: Tensor) -> Tensor:
    """Scores with -inf where their weight underflows (`UNDERFLOW` below the row's largest): a finite fill's keys."""
    return x.masked_fill(x - x.amax(-1, keepdim=True) < UNDERFLOW, -torch.inf)


def _per_copy(x: Tensor, n: int, B: int, skip: int) -> list[Tensor]:
    """(nB, [H,] N, N) scores of `n` copies of a batch of B as the last copy's (B, heads, T, T), over the last T queries
    and keys. Heads folded into the batch, (nB*H, [1,] N, N), are unfolded batch-major first (each sequence's heads
    together: `reshape(B * H, T, d)` of (B, H, T, d), as torch's MultiheadAttention, fairseq and BLOOM lay them out),
    then heads first (`torch.cat(x.split(d, -1), 0)`, older hand-written layers). Every copy's rows carry the same
    bias per head, so the wrong order mixes in other copies' content only: their scores are then no line in the
    distance, or, where the content is too small to show, a line of the bias's own slopes."""
    N, folded = x.shape[-1], x.shape[0] // (n * B)
    orders = [x.reshape(n * B, -1, N, N)]  # (nB, H, N, N)
    if folded > 1:  # (H*nB, [1,] N, N) -> (H, nB, N, N) -> (nB, H, N, N)
        orders.append(x.reshape(folded, n * B, -1, N, N).transpose(0, 1).reshape(n * B, -1, N, N))
    return [o[(n - 1) * B:, :, skip:, skip:] for o in orders]  # (B, H, T, T)


def distance_reward(record, n: int, B: int, T: int, dtype, *, skip: int = 0) -> tuple[float, str] | None:
    """(the largest slope, evidence) when the scores of identical tokens are a straight line in |i - j| for every
    head, with a slope > 0 for some (the bias grows with distance: ALiBi's sign flipped); None otherwise. The tokens
    are the last copy of `n` in the call `record` observed, after `skip` padding tokens the mask blocks for them. Of
    the orders heads folded into the batch can be read in, the first that is a line decides."""
    for scores in _scores_seen(record, n, B, T, skip):
        i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
        dist = (i - j).abs().double().to(scores.device).expand_as(scores)  # (B, H, T, T)
        seen = torch.isfinite(scores)
        count = seen.sum(-1, keepdim=True)
        if not bool((count >= 2).any()):
            continue
        zero = torch.zeros_like(scores)
        mean = lambda x: torch.where(seen, x, zero).sum(-1, keepdim=True) / count.clamp(min=1)
        sc = torch.where(seen, scores - mean(scores), zero)  # per row, centred over the keys it sees
        dc = torch.where(seen, dist - mean(dist), zero)
        slope = (sc * dc).sum((0, 2, 3)) / (dc * dc).sum((0, 2, 3)).clamp(min=1e-300)  # (H,)
        residual = sc - slope.view(1, -1, 1, 1) * dc
        spread = float(sc.abs().max())
        if not spread > 0 or float(residual.abs().max()) > DISTANCE_LINEAR.get(dtype, 1e-3) * spread:
            continue  # not a straight line in the distance (rotary, T5 buckets, content): not ALiBi's to judge
        if not bool((slope > 0).any()):
            return None
        worst = int(slope.argmax())
        return float(slope.max()), (f"on {T} identical tokens the scores are a straight line in the distance |i - j| "
                                    f"(residual {float(residual.abs().max()) / spread:.2g} of their spread) with slope "
                                    f"{float(slope[worst]):+.3g} per token in head {worst} (slopes per head: "
                                    f"{', '.join(f'{float(x):+.3g}' for x in slope)}); a bias that penalises distance "
                                    f"has every slope < 0")
    return None


ONE_SIDED = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 2e-2,
    torch.bfloat16: 5e-2,
}
"""How flat one side of a query's scores on identical tokens must be, as a fraction of the other side's spread, for
positions to be read as one-sided (`one_sided`): a bidirectional layer's keys after its query all scored as the query
itself. Measured on tests/test_relative_positions.py's layers (rotary in both pairings, ALiBi, T5 buckets: the correct
ones and the one-sided T5 twin), 5 seeds x default and std-0.02 initialisation x 8 and 12 tokens, at float32, bfloat16
and float16, the query itself left out of both sides: a correct layer's flat side is at least 0.37 of the other's
(366x the float32 bound, 7.4x bfloat16's), the one-sided twin's exactly 0 (its later keys' scores are one
computation); the bounds leave room for a kernel's rounding of scores far larger than the bias's spread. A reading in
a lower precision is taken again on the float64 copy (`_one_sided_in_float64`)."""


def one_sided_bound(dtype) -> float:
    return ONE_SIDED.get(dtype, 1e-4)


ONE_SIDED_FIX = ("let positions reach the scores on both sides of the query in a bidirectional layer: bucket or bias "
                 "the signed distance j - i, keys after the query in buckets of their own (T5's bidirectional buckets: "
                 "num_buckets // 2 per side, `ret += (n < 0) * num_buckets`), not the causal form that clamps every "
                 "later key to the query's own bucket (`n = max(n, 0)`); if the layer is causal, audit it so "
                 "(causal=True)")


RELATIVE_ONLY = 0.25
"""How far the varying side of a one-sided reading may stray from a function of j - i (the most two scores at one
offset differ, over the rows read, as a fraction of that side's spread): positions that make it (a bucket, a bias, a
rotation of j - i) keep it to rounding, at most 4e-7 in float32, 2.9e-3 in float16 and 0.016 in bfloat16 over
tests/test_relative_positions.py's correct layers and one-sided twin (5 seeds x 2 inits x 8 and 12 tokens; 16x under
the bound); an edge made by zero padding (a causal convolution of the keys, a token shift, a layer without a mask read
from position 0) varies with the row by about its whole spread, and is no one-sided position."""


def _flat_side(scores: Tensor, bound: float) -> tuple[float, str, str, int, dict] | None:
    """(the flat side's spread over the other's, the side that varies, the flat side, the rows read, the spreads)
    where, over the rows of these (.., T, T) scores whose query sees 3 keys or more on each side of it (itself left
    out of both), one side is flat to `bound` of the other's spread, and the other side's scores are a function of
    j - i (`RELATIVE_ONLY`) taking 3 values or more (DeBERTa with `max_relative_positions=2` tells apart 2 distances
    on a side, by its table's size, no buckets' direction); None otherwise."""
    T = scores.shape[-1]
    i, j = torch.arange(T, device=scores.device).unsqueeze(-1), torch.arange(T, device=scores.device)
    seen = torch.isfinite(scores)
    sides = {"before": seen & (j < i), "after": seen & (j > i)}
    rows = (sides["before"].sum(-1) >= 3) & (sides["after"].sum(-1) >= 3)  # (.., T)
    if not bool(rows.any()):
        return None
    spread = {}
    for name, side in sides.items():
        hi = torch.where(side, scores, -torch.inf).amax(-1)
        lo = torch.where(side, scores, torch.inf).amin(-1)
        spread[name] = float(torch.where(rows, hi - lo, torch.zeros_like(hi)).max())
    varies, flat = ("before", "after") if spread["before"] >= spread["after"] else ("after", "before")
    if not spread[varies] > 0 or spread[flat] > bound * spread[varies]:
        return None
    stray, levels = 0.0, []  # the varying side, offset by offset: one score in every row read, where positions make it
    for offset in (range(-1, -T, -1) if varies == "before" else range(1, T)):
        diagonal = scores.diagonal(offset, -2, -1)  # (.., T - |offset|): row i's score of key i + offset
        read = rows[..., max(0, -offset):T - max(0, offset)] & torch.isfinite(diagonal)
        if not bool(read.any()):
            continue
        hi = torch.where(read, diagonal, -torch.inf).amax(-1)
        lo = torch.where(read, diagonal, torch.inf).amin(-1)
        any_read = read.any(-1)
        stray = max(stray, float(torch.where(any_read, hi - lo, torch.zeros_like(hi)).max()))
        level = torch.where(any_read, hi, torch.zeros_like(hi))  # this offset's score, per (batch, head)
        if all(float((level - other).abs().max()) > 1e-3 * spread[varies] for other in levels):
            levels.append(level)
    if stray > RELATIVE_ONLY * spread[varies] or len(levels) < 3:
        return None
    return spread[flat] / spread[varies], varies, flat, int(rows.sum()), spread


def one_sided(record, n: int, B: int, T: int, dtype, *, skip: int = 0) -> tuple[float, str, str, str] | None:
    """For a layer audited as not causal, with no pattern declared: (the flat side's spread over the other side's,
    the side that varies, the flat side, evidence) where, on identical tokens, every query's scores over the keys on
    one side of it are equal while its scores over the keys on the other side differ by j - i: positions
    tell apart the keys before a query and not those after it, or the reverse. T5's bucketed bias built one-sided
    in a bidirectional layer (x-transformers 0.6.6 tests `if causal:` for `if not causal:`: every key after its query
    falls in the query's own bucket) scores so; rotary, ALiBi's |i - j| and T5's two-sided buckets vary on both sides,
    and a layer without positions on neither. Rows are read where the query sees 3 keys or more on each side (a
    window that shows no later key is not read); `_per_copy`'s orders, the first that shows one side flat decides."""
    bound = one_sided_bound(dtype)
    for scores in _scores_seen(record, n, B, T, skip):
        found = _flat_side(scores, bound)
        if found is None:
            continue
        ratio, varies, flat, rows, spread = found
        return ratio, varies, flat, (f"on {T} identical tokens, the {rows} (row, head) pairs whose query sees 3 keys "
                                     f"or more on each side: scores over the keys {varies} the query spread by up to "
                                     f"{spread[varies]:.3g}, each a function of j - i, over the keys {flat} it by "
                                     f"{spread[flat]:.3g} ({ratio:.2g} of that; up to {bound:.2g} is read as flat in "
                                     f"{dtype_name(dtype)})")
    return None


def _float64_record(probe: Probe, r: DistanceReplay, *, draw_zeros: bool = False) -> tuple:
    """The float64 copy of the layer (the gradient checks' copy, `float64_copy_or_skip`) called on `r`'s identical
    tokens upcast, observed; with `draw_zeros`, its all-zero trainable parameters drawn at random for the call
    (`zeros_drawn`, put back after). (its record, the names drawn, "") or (None, [], why no reading was made)."""
    twin = float64_copy_or_skip(probe, probe.detector)
    if isinstance(twin, DetectorResult):
        return None, [], f"not read again on a float64 copy ({twin.message})"
    s = probe.subject
    B, T = r.query.shape[0], r.query.shape[s.time_dim]
    up: dict[int, Tensor] = {}  # one stream stays one tensor

    def wide(x):
        return up.setdefault(id(x), x.to(torch.float64))

    layer = getattr(twin, "layer", None)
    params = dict(layer.named_parameters()) if draw_zeros and isinstance(layer, torch.nn.Module) else {}
    zeros = [name for name, p in params.items() if p.requires_grad and p.is_floating_point() and p.numel()
             and not bool(p.detach().any())]
    probe.passes += 1
    probe.shapes[probe.detector].append(ProbeShape(f"float64 copy: {T} identical tokens"
                                                   + (f", {', '.join(zeros)} drawn" if zeros else ""), B, T, T,
                                                   None if r.allowed is None else r.allowed.cpu(), r.query is r.key))
    observer = Observer()
    try:
        with zeros_drawn(params, zeros, probe.generator()), torch.enable_grad(), observer:
            twin(wide(r.query), wide(r.key), wide(r.value), r.allowed)
    except Exception as error:  # noqa: BLE001 -- no reading, then: the verdict in the layer's own dtype stands
        return None, [], f"not read again on the float64 copy, whose call raised ({type(error).__name__})"
    return observer.record, zeros, ""


def _one_sided_in_float64(probe: Probe, r: DistanceReplay, reading: tuple) -> tuple | None:
    """A one-sided reading (`one_sided`) taken again on the float64 copy of the layer on the same identical tokens,
    its all-zero trainable parameters drawn where it has any (a look-ahead slope or bias initialised at 0 makes a
    bidirectional layer one-sided at its initialisation only, by design): the reading with both in its evidence where
    the copy reads one-sided too, at float64's bound; None where it does not (a lower precision's rounding: ALiBi
    whose look-ahead slope is 1/32 of its look-back one read flat in bfloat16; or a zero parameter that moves); the
    reading, saying it was not confirmed, where no copy can be made or its call raises."""
    record, zeros, why = _float64_record(probe, r, draw_zeros=True)
    if record is None:
        return (*reading[:3], f"{reading[3]}; {why}: a lower precision's rounding or a parameter at zero is not "
                              f"ruled out")
    again = one_sided(record, 1, r.query.shape[0], r.query.shape[probe.subject.time_dim], torch.float64)
    if again is None:
        return None
    drawn = f", with {', '.join(zeros)} (all zero) drawn at random" if zeros else ""
    return reading[0], reading[1], reading[2], f"{reading[3]}; on the float64 copy of the layer{drawn}: {again[3]}"


@dataclass(frozen=True)
class OneSidedReplay(DistanceReplay):
    """The identical tokens on which one side of each query's scores was flat, and their mask."""


def _consumers(trace) -> dict[int, list[Op]]:
    """tensor id -> the ops that read it, in order: made once per trace for `_reaches_scores`."""
    consumers: dict[int, list[Op]] = {}
    for op in trace.ops:
        for tensor_id in op.in_ids:
            consumers.setdefault(tensor_id, []).append(op)
    return consumers


def _reaches_scores(consumers: dict, op: Op, limit: int = 4096) -> bool:
    """Whether what `op` made reaches an op that the probe's inputs reach too (the scores it is added to, the weights):
    a term of the attention, not a mask built and left unused, nor a side computation."""
    todo, seen = list(op.out_ids), set()
    while todo and len(seen) < limit:
        tensor_id = todo.pop()
        if tensor_id in seen:
            continue
        seen.add(tensor_id)
        for later in consumers.get(tensor_id, ()):
            if later.index <= op.index:
                continue
            if later.sources:
                return True
            todo.extend(i for i in later.out_ids if i != tensor_id)
    return False


def one_sided_sites(probe, r: OneSidedReplay) -> list[Site]:
    """On the identical tokens the verdict read: the first op of the user's code that makes a (.., Tq, Tk) tensor from
    positions alone (no probe input reaches it) that is flat on one side of the query and varies on the other (the
    clamp that puts every later key in the query's own bucket) and reaches the scores (`_reaches_scores`: not a mask
    made and left unused), after the `if` whose other branch makes the same name another way (`branch_of`: the
    condition that chose the one-sided form). Traced with the mask as one call of the layer takes it (`_at_once`)."""
    s = probe.subject
    T = r.query.shape[s.time_dim]
    trace = trace_call(s, r.query, r.key, r.value, _at_once(s, r.allowed), seed=probe.seed)
    consumers = _consumers(trace)
    first = next((op for op in trace.ops if op.frames and not op.sources and op.outs and op.outs[0] is not None
                  and op.outs[0].dtype != torch.bool and op.outs[0].dim() >= 2
                  and tuple(op.outs[0].shape[-2:]) == (T, T) and not _constant(trace, op)
                  and _flat_side(op.outs[0].double(), 1e-9) is not None and _reaches_scores(consumers, op)), None)
    if first is None:
        return []
    note = ("makes the positions' (query, key) term from positions alone, flat on one side of each query: every key "
            "on that side is given one value")
    sites = [branch_of(first, "the condition the one-sided term was made under", fix=ONE_SIDED_FIX),
             op_site(first, note, fix=ONE_SIDED_FIX)]
    return [site for site in sites if site is not None]


def _rewarded_in_float64(probe: Probe, r: DistanceReplay, reading: tuple[float, str]) -> tuple[float, str] | None:
    """A low-precision reading of a distance-rewarding line, read again on the float64 copy of the layer (the gradient
    checks' copy, `float64_copy_or_skip`) on the same identical tokens upcast: the reading with both readings in its
    evidence where the float64 scores are a line too (at float64's DISTANCE_LINEAR) with a slope > 0; None where they
    are not (the low-precision line was rounding); the reading as it was where no copy runs or the call raises.

    Few distances make a weak line: three tokens give three distances, and bfloat16's residual bound (0.3 of the
    scores' spread) then lets the cosines of a correct rotary pass for a line. The reference's rotary at head_dim 2,
    three tokens, bfloat16 (an exploring CI seed's draw, SHIFTED_COSINE_DRAW in the tests): residual 0.29, slope
    +2.56 in bfloat16; on the float64 copy the same scores are no line. A bias that is linear in the distance stays
    one in float64 (ALiBi added in float64: residual ~1e-16; added in float32 by the layer: <= 1.3e-7)."""
    record, _, _ = _float64_record(probe, r)
    if record is None:
        return reading
    again = distance_reward(record, 1, r.query.shape[0], r.query.shape[probe.subject.time_dim], torch.float64)
    if again is None:
        return None
    return reading[0], f"{reading[1]}; on the float64 copy of the layer: {again[1]}"


def _mask_is_a_flag(probe: Probe, shifted, shifted_allowed, got: Tensor, P: int, T: int, tol: float) -> str:
    """After the left padding moved the real tokens: the same call with nothing blocked beyond what the audit itself
    passes (causal, a pattern) instead of the padding's mask. The same outputs (within `tol`): the layer never read
    which keys the mask blocks, only that a mask was given; its evidence then, else ''. One call, on failure only."""
    B = shifted[0].shape[0]
    if shifted_allowed is None:
        return ""
    opened = probe.allowed(B, P + T, P + T, torch.ones(B, P + T, P + T, dtype=torch.bool))
    if bool((opened.cpu() == shifted_allowed.cpu()).all()):
        return ""
    call = probe.call(*shifted, opened, label=f"{P} padding tokens before {T}, the mask blocking none of them")
    if not call.ok or tuple(call.output.out.shape) != tuple(got.shape):
        return ""
    change = relative_change(call.output.out, got, centred=True)
    if change is None or float(change.max()) > tol:
        return ""
    return (f"with a mask that blocks none of the padding the outputs were the same (greatest change "
            f"{float(change.max()):.3g} of the outputs' RMS)")


def _pick(s, out: Tensor, rows: Tensor) -> Tensor:
    return out.index_select(s.time_dim, rows.to(out.device))


# ---- where ----------------------------------------------------------------------------------------------------


def _score_like(op: Op, n: int) -> bool:
    return any(o is not None and o.dim() >= 2 and tuple(o.shape[-2:]) == (n, n) for o in op.outs)


def _at_once(s, allowed: Tensor | None) -> Tensor | None:
    """`allowed` (B, Tq, Tk) as one call of the layer takes it, for tracing the shift. A layer that takes a (B, Tk)
    key mask is given a causal mask a copy per query (`_subject._per_query`): (B x T) copies at one length, (B x
    (P + T)) at the other, whose ops no cut of the last T rows lines up, so no site was found (a user's causal block
    with rotary-embedding-torch 0.0.11's mispaired rotation). The keys some query may attend (the padding) reach it
    at once instead: the real tokens' outputs of a layer whose positions are relative do not move with the shift under
    that mask either, and the two traces are traced alike."""
    if allowed is None or not getattr(s, "takes_mask", False) or not s.mask_convention.per_key or \
            expressible(allowed, s.mask_convention):
        return allowed
    return allowed.any(dim=1, keepdim=True).expand_as(allowed)


def shift_sites(probe, result: DetectorResult) -> list[Site]:
    """The shifted and the unshifted call (`result.replay`) traced side by side: the first op over (query, key)
    pairs (scores, a bias added to them, the weights) or the first fused attention whose rows for the real tokens
    differ; then, for a product, the op that made each operand (the rotation of q or k, most likely the mistake)."""
    r = result.replay
    if isinstance(r, OneSidedReplay):
        return one_sided_sites(probe, r)
    if isinstance(r, DistanceReplay):
        return distance_sites(probe, r)
    if isinstance(r, LostReplay):
        return lost_sites(probe, r)
    if isinstance(r, OrderReplay):
        return unrescaled_accumulators(trace_call(probe.subject, r.query, r.key, r.value, r.allowed, seed=probe.seed))
    if not isinstance(r, ShiftReplay):
        return []
    s = probe.subject
    T, P = r.query.shape[s.time_dim], r.shift
    a = trace_call(s, r.query, r.key, r.value, _at_once(s, r.allowed), seed=probe.seed)
    n = P + T
    b = trace_call(s, *r.shifted, _at_once(s, r.shifted_allowed), seed=probe.seed)
    if a.output is None or b.output is None:
        return []
    online = unrescaled_accumulators(b)  # keys summed block by block, a running value not rescaled: order matters
    if online:
        return online
    try:  # a rotation whose partner or factor pairs other features than its table
        paired = rotary_pair_sites(b)
    except Exception:  # noqa: BLE001 -- reading the rotation must never cost the shift its other sites
        paired = []
    fused = {id(op) for op in fused_ops(b)}
    first = None
    for x, y in zip(a.ops, b.ops):  # the same program on other lengths: ops in the same order
        if x.name != y.name:
            break
        if not y.sources or not (id(y) in fused or _score_like(y, n) or y.short in SOFTMAXES):
            continue
        for ox, oy in zip(x.outs, y.outs):
            if ox is None or oy is None:
                continue
            cut = last_rows(oy, ox.shape, T)
            if cut is not None and cut.shape == ox.shape and bool(moved(cut, ox, r.tol).any()):
                first = y
                break
        if first is not None:
            break
    if first is None:
        return paired or _value_sites(a, b, fused, T, r.tol, P)
    note = (f"the first op over (query, key) pairs whose values for the real tokens change when every position is "
            f"shifted by {P}: the scores depend on absolute positions")
    product = first if first.short in PRODUCTS or id(first) in fused else next(
        (made for made in (through_carries(b, producer(b, i)) for i in first.in_ids)
         if made is not None and made.short in PRODUCTS), None)
    rotary = any(op.short in ("sin", "cos") for op in b.ops)  # a rotary table computed in the call
    sites = []
    for tensor_id in (product.in_ids[:2] if product is not None else ()):
        made = through_carries(b, producer(b, tensor_id))
        if made is not None and user(made) and made is not product and made.short not in PRODUCTS:
            why = ("a rotation that depends on absolute positions (rotary pairs and their cos/sin table in two "
                   "layouts, or turned over another axis than time)" if rotary else
                   "absolute positions reach it (a position embedding added on the way?)")
            sites.append(op_site(made, f"makes an operand of the (query, key) product that changes with the shift "
                                       f"({made.short}): {why}", fix=ROTATION_FIX if rotary else EMBEDDING_FIX))
    sites.append(op_site(first, note, fix="" if product is not None else BIAS_FIX))
    return paired + [site for site in sites if site is not None]


VALUE_POSITIONS_FIX = ("let the values carry relative positions only: a rotation applied to the values by their "
                       "positions is undone on the output by the query's (RoPER: rotate v once, then the weighted sum "
                       "back by -position), never applied twice or left in; or add no absolute position to them")


def _value_sites(a, b, fused: set, T: int, tol: float, P: int) -> list[Site]:
    """No op over (query, key) pairs moved with the shift, yet the output did: the positions reach the values. The
    first op of the user's code after the last weights (a softmax, a fused attention call) whose entries for the real
    tokens change: the values' own rotation or position embedding. Where the values the weighted sum reads were made
    by a later op that moves too, fed by that one, positions were applied to them a second time, and that op is the
    site, the first beside it (RoPER's values rotated twice, labml-nn 0.4.136: the second rotation, the line its fix
    removed; a correct RoPER rotates them once, as the first site shows)."""
    ops = list(zip(a.ops, b.ops))
    last = max((i for i, (_, y) in enumerate(ops) if y.short in SOFTMAXES or id(y) in fused), default=None)
    if last is None:
        return []

    def moves(i: int) -> bool:  # op i's entries for the real tokens change with the shift
        x, y = ops[i]
        for ox, oy in zip(x.outs, y.outs):
            cut = last_rows(oy, ox.shape, T) if ox is not None and oy is not None else None
            if cut is not None and cut.shape == ox.shape and bool(moved(cut, ox, tol).any()):
                return True
        return False

    for i in range(last + 1, len(ops)):
        x, y = ops[i]
        if x.name != y.name:
            return []
        if not y.frames or not y.sources or not moves(i):
            continue
        first = op_site(y, f"the first op after the attention weights whose values for the real tokens change when "
                           f"every position is shifted by {P} ({y.short}): the weights do not move, so absolute "
                           f"positions reach the values", fix=VALUE_POSITIONS_FIX)
        again = _moved_again(b, ops, i, moves)
        if again is None:
            return [first]
        return [op_site(again, f"the values the weighted sum reads were moved by their positions again here "
                               f"({again.short}), after an earlier op had already done so: positions applied to "
                               f"the values twice, so absolute positions reach the values",
                        fix=VALUE_POSITIONS_FIX), first]
    return []


def _moved_again(b, ops: list, start: int, moves) -> Op | None:
    """The op of the user's code that made the values operand of the weighted sum after `start` (the first product
    past it), where that op comes after the one at `start` and moves with the shift too: positions applied again."""
    index = {id(y): j for j, (_, y) in enumerate(ops)}
    product = next((y for _, y in ops[start + 1:] if y.short in PRODUCTS), None)
    for tensor_id in (product.in_ids[:2] if product is not None else ()):
        made = through_carries(b, producer(b, tensor_id))
        j = index.get(id(made)) if made is not None else None
        if j is not None and j > start and user(made) and made.short not in PRODUCTS and moves(j) and \
                ops[start][1].index in ancestors(b, made):
            return made
    return None


def lost_sites(probe, r: LostReplay) -> list[Site]:
    """Positions declared, none reach the output: the first product of q or k (a tensor of the inputs) with a table
    computed in the call from sin or cos and no input, whose positions run along another axis of q or k than the
    sequence's (a (B, T, H, d) tensor turned along its axis -2, the heads: the same rotation for every token, which
    q·k cancels). The line that made the positions the table was computed for first (their count is the other
    axis's size), then the product."""
    s = probe.subject
    trace = trace_call(s, r.query, r.key, r.value, r.allowed, seed=probe.seed)
    T = r.query.shape[s.time_dim]
    for op in trace.ops:
        if op.short not in ("mul", "mul_") or not op.frames or len(op.in_ids) < 2 or \
                not all(isinstance(x, Tensor) for x in op.args[:2]):
            continue
        fed = [bool(trace.sources.get(i)) for i in op.in_ids[:2]]
        if fed[0] == fed[1]:
            continue
        x, table = (op.args[0], op.args[1]) if fed[0] else (op.args[1], op.args[0])
        made = producer(trace, op.in_ids[1] if fed[0] else op.in_ids[0])
        if made is None or table.dim() < 2 or table.dim() > x.dim():
            continue
        before = sorted(ancestors(trace, made) | {made.index})
        if not any(trace.ops[i].short in ("sin", "cos") for i in before):
            continue
        axes = [x.dim() - table.dim() + n for n in range(table.dim() - 1) if table.shape[n] > 1]
        if len(axes) != 1 or x.shape[axes[0]] == T or T not in tuple(x.shape):
            continue
        n = x.shape[axes[0]]
        seq = tuple(x.shape).index(T) - x.dim()
        where = (f"the rotation's table varies along axis {axes[0] - x.dim()} of the {tuple(x.shape)} q or k it "
                 f"turns (size {n}), not along the sequence (axis {seq}, {T} tokens): every token is turned alike "
                 f"and q·k cancels the rotation")
        counted = [trace.ops[i] for i in before if user(trace.ops[i]) and not trace.ops[i].sources
                   and trace.ops[i].outs and trace.ops[i].outs[0] is not None
                   and tuple(trace.ops[i].outs[0].shape) == (n,)]
        # positions are counted in integers (torch.arange(T)); a frequency vector of as many elements is a float
        positions = min(counted, key=lambda o: (o.outs[0].is_floating_point(), o.index), default=None)
        return [site for site in (op_site(positions, f"makes the {n} positions the rotation is computed for; {where}",
                                          fix=ROTATION_AXIS_FIX),
                                  op_site(op, where, fix=ROTATION_AXIS_FIX)) if site is not None]
    return []


ROTATION_AXIS_FIX = ("turn q and k along their sequence axis: positions = torch.arange(T) for T the sequence length, "
                     "the table (T, d/2) against q and k laid out (..., T, d) (transpose (B, T, H, d) to (B, H, T, d) "
                     "first)")


def distance_sites(probe, r: DistanceReplay) -> list[Site]:
    """On the identical tokens the verdict read: the first op of the user's code that makes a (.., Tq, Tk) tensor
    from positions alone (no probe input reaches it: the distances, or the bias made of them), then the one that
    adds such a tensor to the scores."""
    s = probe.subject
    T = r.query.shape[s.time_dim]
    trace = trace_call(s, r.query, r.key, r.value, r.allowed, seed=probe.seed)
    made = [op for op in trace.ops if op.frames and not op.sources and op.outs and op.outs[0] is not None
            and op.outs[0].dim() >= 2 and tuple(op.outs[0].shape[-2:]) == (T, T) and not _constant(trace, op)]
    if not made:
        return []
    sites = [op_site(made[0], "makes the positions' (query, key) term from positions alone: its sign decides whether "
                              "distance is penalised or rewarded", fix=BIAS_SIGN_FIX)]
    return [site for site in sites if site is not None]


CONSTANTS = ("ones", "zeros", "empty", "full", "tril", "triu")
"""Ops that make a (.., T, T) tensor of no positions: a causal mask of ones, or a bias's starting zeros (torch's SDPA
reference and layers written after it begin `attn_bias = torch.zeros(L, S)` and add the positions' term to it)."""


def _constant(trace, op: Op) -> bool:
    """Made of CONSTANTS alone (itself one, or every op before it one: a detached copy, a masked fill of two)."""
    before = ancestors(trace, op)
    return op.short in CONSTANTS or bool(before) and all(trace.ops[i].short in CONSTANTS for i in before)


BIAS_SIGN_FIX = "ALiBi adds -slope * |i - j| (slope > 0): slope * (j - i) for the past keys j <= i, not slope * (i - j)"
EMBEDDING_FIX = ("positions added to the tokens inside the layer are absolute: use rotary or a bias of j - i instead, or, "
                 "if absolute positions are meant, declare positions=\"absolute\"")
BIAS_FIX = ("index the position bias by the distance j - i (ALiBi: -slope * |i - j|; T5: a bucket of j - i), not by the "
            "query's or the key's own position")
PRODUCTS = {"bmm", "mm", "matmul", "baddbmm", "einsum"}
ROTATION_FIX = ("rotate pairs in the layout of the cos/sin table (interleaved (2m, 2m+1) with freqs.repeat_interleave(2), "
                "half-split (m, m + d/2) with torch.cat([freqs, freqs])), along the time axis of q and k")


__all__ = ["SHIFT_MOVES", "SHIFT_TOKENS", "check_relative_positions", "declared_positions"]
