"""`future_leakage` and `causal_alignment`: a causal layer sees no later token, and its newest query sees the
newest key (bottom-right alignment)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from .._core import Case, Inputs, compare, held, not_run, perturbed, skip, unravel
from .._observe import keys_are_queries
from .._probe import Probe
from .._registry import CAUSAL, LONG, NOT_APPLICABLE, Need, detector
from .._result import DetectorResult, Site
from .._thresholds import dtype_name
from .._tracing import SOFTMAXES, ancestors, declared_mask, mask_sites, qk_matmul, trace_call
from ._common import base_trace, invariance_locator, judge, perturbation_gains, result
from ._stacked import DECODING, PADDED, other_sequence_changed, stacked, stacked_cases


def alignment_sites(probe, result: DetectorResult) -> list[Site]:
    """The masks of the very call the alignment was judged on (`result.replay`: its inputs) against the declared
    bottom-right causal mask."""
    inputs = result.replay
    if inputs is None:
        return []
    s = probe.subject
    B, t_q, t_k = inputs.query.shape[0], inputs.query.shape[s.time_dim], inputs.key.shape[s.time_dim]
    allowed = probe.allowed(B, t_q, t_k)
    trace = trace_call(s, inputs.query, inputs.key, inputs.value, allowed, seed=probe.seed)
    return mask_sites(trace, declared_mask(probe, B, t_q, t_k, allowed), B, t_q, t_k)


@detector("future_leakage", "for a causal layer, changing tokens after t leaves outputs at and before t unchanged, "
          "with no mask and with a padding mask",
          targets=("missing causal mask", "heads merged without transpose in a decoder",
                   "padding mask replacing (or ORed with) the causal mask"),
          fix="mask the future before the softmax: scores.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq), float('-inf')) "
              "(True marks key j > i + Tk - Tq: the future, aligned bottom-right)",
          needs=(CAUSAL, LONG),
          locate=invariance_locator("the first op whose output at past positions moves when only later tokens change",
                                    use_masks=True))
def check_future_leakage(probe: Probe) -> DetectorResult:
    """With no mask, and (for layers that take one) with a padding mask too: a decoder that builds its own
    causal mask and lets the user's padding mask replace it (or ORs them) is causal only in the first. Without a
    mask, the cuts are cases of the DECODING stack (decode_consistency's full pass is their baseline); with a
    padding mask, of the PADDED stack (mask_honoured's padding scenario), for a function in a call of its own."""
    det, cuts = "future_leakage", future_cuts(probe.t)
    scenarios = [("no mask", lambda: stacked(probe, DECODING, det))]
    if probe.subject.takes_mask:
        scenarios.append(("a padding mask", lambda: _padded(probe)))
    readings = []
    for name, read in scenarios:
        comparison = read()
        if isinstance(comparison, DetectorResult):
            return comparison
        readings.append((name, comparison, *held(comparison, probe, what="past outputs")))
    bad = [name for name, _, b, _, _, _ in readings if b]
    if not bad and all(silent for *_, silent in readings):
        return skip(det, "the output did not respond to later tokens at all, so its not moving proves nothing")
    return judge(det, bool(bad), "outputs depend on future tokens" + (f" (with {', '.join(bad)})" if bad else ""),
                  f"no output moved when only later tokens changed (cuts at t={cuts}; "
                  f"{' and '.join(n for n, *_ in readings)})",
                  value=max(w for _, _, _, w, _, _ in readings), threshold=readings[0][1].tol,
                  evidence="; ".join(f"{name}: {text}" for name, _, _, _, text, _ in readings),
                  replay=tuple(c for _, c, *_ in readings))


def _padded(probe: Probe):
    """The cut at 0 under a padding mask: in the call of mask_honoured's padding scenario, or for a function (which
    future_leakage probes in three streams) in a call of its own. One cut, at 0: every sequence keeps at least its
    first two keys once T >= 4, so key 1 is visible."""
    B, T = probe.BATCH, probe.t
    if probe.subject.form != "function":
        return stacked(probe, PADDED, "future_leakage")
    pad = probe.padding(B, T, T)  # (B, Tq, Tk): trailing keys blocked, at least max(1, T // 2) kept: key 0 is
    base = Inputs(*probe.streams(B, T, cross=True), pad)
    return compare(probe, base, cut_cases(probe, base, [[0] * B], "a padding mask"),
                   label="tokens after t in [0] changed, a padding mask")


def future_cuts(T: int) -> list[int]:
    """Where future_leakage cuts (the outputs up to t held, every token after t perturbed): 0, T // 2 and T - 2, each
    with a token after it (at T = 2, T // 2 has none: 0 alone, in every sequence, so that two rows, not one, show
    the output responding to the perturbed token)."""
    return sorted({c for c in (0, T // 2, T - 2) if c < T - 1})


def unmasked_copies(probe: Probe) -> list[list[int]]:
    """The cuts without a mask, one list per copy of the batch (sequence b of copy n cut at `copies[n][b]`): every
    cut of `future_cuts` measured, in as few copies as the batch allows."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    cuts = future_cuts(T)
    # a layer that takes a mask is cut at 0 with a padding mask too, which holds row 0 against every later token as
    # the unmasked cut at 0 does: the unmasked copies then measure the other cuts, one copy of the batch fewer where
    # that saves one (B = 2: cuts T // 2 and T - 2 in one copy, not three cuts in two)
    unmasked = [c for c in cuts if c != 0] if s.takes_mask and T >= 4 else cuts
    unmasked = unmasked if -(-len(unmasked) // B) < -(-len(cuts) // B) else cuts
    # each copy of the batch cuts its sequences at their own t (sequence b of copy n at unmasked[(n * B + b) %
    # len(unmasked)])
    return [[unmasked[(n * B + b) % len(unmasked)] for b in range(B)] for n in range(-(-len(unmasked) // B))]


def cut_cases(probe: Probe, base: Inputs, copies: list[list[int]], name: str) -> list[Case]:
    """One copy of the batch per entry of `copies`, sequence b cut at its own t (`copies[n][b]`): every token after
    it perturbed, the outputs up to it held."""
    B, T = probe.BATCH, probe.t
    t = torch.arange(T)
    allowed = probe.allowed(B, T, T, base.extra)
    attends = torch.ones(B, T, dtype=torch.bool) if allowed is None else allowed.cpu().any(-1)
    cases = []
    for at in copies:
        after = t.view(1, T) > torch.tensor(at).view(B, 1)  # (B, T): the perturbed positions of each sequence
        shown = (f"t>={at[0] + 1} was" if len(set(at)) == 1 else
                 " and ".join(f"t>={c + 1} of sequence {b}" for b, c in enumerate(at)) + " were")
        gains = perturbation_gains(probe)
        cases += [Case(x, hold=~after & attends, move=after & attends,
                       when=f"when only {shown} perturbed (x{gain:g}, {name})")
                  for gain, x in zip(gains, perturbed(probe, base, after, ("query", "key", "value"), gains=gains))]
    return cases


@stacked_cases(PADDED, "future_leakage")
def padded_cut_cases(probe: Probe, base: Inputs) -> tuple[list[Case], str]:
    """A causal audit's cut at 0 under the padding mask, on the stack's streams (one, as future_leakage draws them
    for every form but a function, which it probes in three streams of its own call)."""
    if not probe.causal or probe.t < 2 or probe.subject.form == "function":
        return [], ""
    return cut_cases(probe, base, [[0] * probe.BATCH], "a padding mask"), "tokens after t in [0] changed, a padding mask"


@stacked_cases(DECODING, "future_leakage")
def unmasked_cut_cases(probe: Probe, base: Inputs) -> tuple[list[Case], str]:
    """A causal audit's cuts without a mask, on decode_consistency's tokens (`decoding_inputs`: scaled by logit_gain,
    and pushed as hard on top). Measured against the unscaled tokens of a call of its own (missing_causal_mask and a
    one-stream layer without its causal mask, 1-8 heads of width 1-64, T = 3-16, float32, bfloat16 and float16,
    torch's and GPT-2's init, seeds 0-1: 592 leaks): every leak still caught, about the same share of past outputs
    moved (98.5-100%), the greatest move 2-4x smaller (median) and at least 2.46 of the outputs' RMS (150x bfloat16's
    tolerance; 1.44 before). At T = 2 the tokens are unscaled (see `decoding_inputs`)."""
    if not probe.causal or probe.t < 2:
        return [], ""
    copies = unmasked_copies(probe)
    shown = sorted({c for at in copies for c in at})
    return cut_cases(probe, base, copies, "no mask"), f"tokens after t in {shown} changed, no mask"


@detector("causal_alignment", "for a causal layer, the newest query sees the newest key (bottom-right "
          "alignment for cached decoding, diagonal included)",
          targets=("top-left causal mask with a KV cache", "causal mask blocking the diagonal"),
          fix="allow keys j <= i + (Tk - Tq), the query's own position included: block "
              "torch.ones(Tq, Tk, dtype=torch.bool).triu(1 + Tk - Tq)",
          needs=(CAUSAL,), locate=alignment_sites)
def check_causal_alignment(probe: Probe) -> DetectorResult:
    det, s = "causal_alignment", probe.subject
    if s.separate_kv:
        return _newest_key_seen(probe)
    base = probe.base()
    if not base.ok:
        return not_run(det, base)
    weights, source = probe.weights(base)
    if weights is None:
        return skip(det, "one input stream and no weights: a key cannot change without its query")
    B = base.query.shape[0]
    if weights.dim() == 3 and weights.shape[0] != B and weights.shape[0] % B == 0:
        weights = weights.reshape(B, -1, *weights.shape[-2:])  # heads folded into the batch, (B x H, T, T)
    room = causal_room(weights, base.allowed, probe.pattern)
    diag = weights.double().diagonal(dim1=-2, dim2=-1)  # (..., T): each query's weight on its own position
    if bool((diag <= 0).any()):
        k = top_k(weights, room)
        if k is not None:  # sparse by design: which keys a query keeps depends on the scores, not the positions
            return skip(det, f"not applicable: the layer keeps only the {k} largest weights of each query (every row "
                             f"keeps min({k}, its allowed keys) and no more: top-k attention), so a query's own "
                             f"position is dropped wherever its score is not among them ({int((diag <= 0).sum())} / "
                             f"{diag.numel()} queries here, {source}); with one input stream a key cannot move "
                             f"without its query, so the alignment is not measured")
        alone = alone_on_itself(weights, room)
        if alone is not None and bool((diag[alone] > ALONE_ON_ITSELF).all()) and keys_are_queries(base.record) \
                and keys_made_from_queries(base_trace(probe)):
            return result(det, "pass", f"every query attends its own position where it has no other key, and only "
                          f"there ({source}): its keys are its queries (each key parallel to its token's query in the "
                          f"product before the softmax, made from them by no projection of their own), and shared-QK "
                          f"attention keeps a token from attending itself wherever another key is allowed (Reformer), "
                          f"by design", value=float(diag[alone].min()),
                          threshold=ALONE_ON_ITSELF,
                          evidence=f"{int(alone.sum())} / {diag.numel()} queries have no key but their own and give "
                                   f"it weight {float(diag[alone].min()):.3g} or more (more than {ALONE_ON_ITSELF} "
                                   f"required: all of it, but for rounding); {int((diag <= 0).sum())} give it 0 beside "
                                   f"other keys")
        idx = unravel(diag.argmin(), diag.shape)
        return result(det, "fail", "a query gives zero weight to its own position", value=float(diag.min()),
                       threshold=0.0, evidence=f"{int((diag <= 0).sum())} / {diag.numel()} queries give their own "
                                               f"position weight 0, e.g. at {idx} ({source})",
                       replay=Inputs(base.query, base.key, base.value))
    return result(det, "pass", f"every query attends its own position ({source})", value=float(diag.min()),
                   threshold=0.0)


ALONE_ON_ITSELF = 0.99
"""The weight a query with no allowed key but its own must give it for causal_alignment to read a shared-QK layer's
self-exclusion as by design: all of it, less rounding (bfloat16's eps 0.0078; a mask that blocks the first query's own
key too spreads its weight over every key, 1/T each)."""


PROJECTIONS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "einsum"})


def keys_made_from_queries(trace) -> bool:
    """Whether the keys of the q·k product before the first softmax come from the queries by no product of their own:
    every projection (a matmul, a linear, a convolution) the key operand depends on, the query operand depends on too
    (Reformer's keys are its queries l2-normalised). A key projection of its own, even with weights equal to the
    query projection's (a copy, a typo calling W_q twice), is one: its self-exclusion is not shared-QK's."""
    first = next((i for i, op in enumerate(trace.ops) if op.short in SOFTMAXES), None)
    product = qk_matmul(trace, first) if first is not None else None
    if product is None or len(product.in_ids) < 2:
        return False
    query, key = (ancestors(trace, SimpleNamespace(in_ids=(i,), index=product.index)) for i in product.in_ids[:2])
    return not any(trace.ops[i].short in PROJECTIONS for i in key - query)


def causal_room(weights: Tensor, allowed: Tensor | None, pattern=None) -> Tensor:
    """The keys each query of these (B, [H,] T, T) causal weights may attend: the causal ones, under the audit's mask
    (B, T, T) and a declared pattern (a window or chunks the layer builds itself, which reach no mask)."""
    T = weights.shape[-1]
    room = torch.ones(T, T, dtype=torch.bool, device=weights.device).tril()  # (Tq, Tk): the causal keys
    B = weights.shape[0]
    for mask in (allowed, pattern.allowed(B, T, T) if pattern is not None else None):
        if mask is not None:
            mask = mask.to(weights.device)
            room = room & (mask.unsqueeze(1) if weights.dim() == 4 and mask.dim() == 3 else mask)
    return room


def alone_on_itself(weights: Tensor, room: Tensor) -> Tensor | None:
    """Where each query of these (B, [H,] T, T) causal weights has no key in its `room` (`causal_room`) but its own
    (the first, and any whose earlier keys the mask or the pattern blocks), as a bool of the diagonal's shape; None
    where no query is so (nothing to tell a design that excludes the diagonal from a mask that blocks it) or any
    other query's own weight is not 0."""
    alone = (room.sum(-1) == 1) & room.diagonal(dim1=-2, dim2=-1)
    alone = alone.expand(weights.shape[:-1])
    diag = weights.diagonal(dim1=-2, dim2=-1)
    if not bool(alone.any()) or bool((diag[~alone] != 0).any()):
        return None
    return alone


def top_k(weights: Tensor, room: Tensor) -> int | None:
    """k where every query of these (B, [H,] T, T) causal weights keeps exactly min(k, the keys in its `room`,
    `causal_room`) non-zero weights and some query keeps fewer than it is allowed: top-k attention. None otherwise (a
    mask that blocks the diagonal keeps one key fewer than allowed in every row, the first row none: no k fits)."""
    kept = (weights > 0).sum(-1)  # (B, [H,] Tq)
    room = room.sum(-1).expand_as(kept)
    k = int(kept.max()) if kept.numel() else 0
    if k < 1 or not bool((kept < room).any()):
        return None
    return k if torch.equal(kept, room.clamp(max=k)) else None


NEWEST_KEY_GAINS = (100.0, -100.0)
"""How hard causal_alignment's cached-decoding probe pushes key T-1, one copy of the batch each. A third copy at x1
changed no verdict and not the smallest margin over 640 correct layers (MultiHeadAttention, d_model 1-64, 1-4 heads,
float32/bfloat16/float16/float64, torch's and GPT-2's init, seeds 0-3, T 2-16: the newest query moved by at least
770x the tolerance with or without it; its reading was the largest move in 12 of them, whose reading without it stayed
above that): dropped, one copy of four."""


def _newest_key_seen(probe: Probe) -> DetectorResult:
    """Cached decoding: the last Tq positions query all T keys; changing key T-1 must move query T-1."""
    det, s, B, T = "causal_alignment", probe.subject, probe.BATCH, probe.t
    t_q = max(1, min(T // 2, 8))  # several queries (a layer may special-case one), the newest read; capped: cost
    if s.form == "function":
        q = probe.make(B, t_q)
        k, v = probe.make(B, T), probe.make(B, T)
    else:
        k = v = probe.make(B, T)
        q = k[:, T - t_q:].clone()
    base = Inputs(q, k, v)
    newest = torch.arange(T) == T - 1
    # A blocked key moves nothing. A visible one moves the output, and a large change of it in both
    # directions makes one draw's logit dominate, so a correct layer moves far above rounding noise.
    gains = NEWEST_KEY_GAINS
    cases = [Case(x, hold=torch.zeros(B, t_q, dtype=torch.bool), when=f"key {T - 1} x{gain:g}")
             for gain, x in zip(gains, perturbed(probe, base, newest, ("key", "value"), gains=gains))]
    comparison = compare(probe, base, cases, label=f"{t_q} newest queries over {T} keys, key {T - 1} changed")
    if isinstance(comparison, DetectorResult):
        return comparison
    change = torch.stack(comparison.changes).amax(0)  # (B, [H,] Tq): the most any gain moved each row
    last = change[..., -1]  # the newest query, at position T - 1
    tol = comparison.tol
    if bool((last <= tol).any()):
        return result(det, "fail", "the newest query does not see the newest key (causal mask misaligned "
                       "or blocking the diagonal)", value=float(last.min()), threshold=tol,
                       evidence=f"with {t_q} queries at positions {T - t_q}..{T - 1} over {T} keys, changing "
                                f"key {T - 1} (by up to 100x, both signs) moved the output of query {T - 1} by "
                                f"at most {float(last.min()):.3g} of the outputs' RMS about their mean in some row (more than "
                                f"{tol:.2g} expected for {dtype_name(s.dtype)}): query i must see keys "
                                f"<= i + Tk - Tq, its own position included", replay=base)
    return result(det, "pass", f"the newest of {t_q} queries sees the newest of {T} keys (bottom-right)",
                   value=float(last.min()), threshold=tol)


NOT_CAUSAL = Need("not {causal}", lambda p: not p.causal and p.pattern is None,
                  "the layer is audited as causal (or with a declared pattern), whose detectors judge its mask")


def own_mask_sites(probe, result: DetectorResult) -> list[Site]:
    """The masking op of the standard probe that blocks keys by position, judged as if nothing were blocked."""
    base = result.replay
    if base is None or not base.ok:
        return []
    s = probe.subject
    B, t_q, t_k = base.query.shape[0], base.query.shape[s.time_dim], base.key.shape[s.time_dim]
    trace = trace_call(s, base.query, base.key, base.value, base.allowed, seed=probe.seed)
    return mask_sites(trace, torch.ones(B, t_q, t_k, dtype=torch.bool), B, t_q, t_k, origins=False)


@detector("undeclared_causality", "a layer audited as not causal blocks no key by its position on its own: one whose "
          "weights are exactly zero on one side of the diagonal masks the future (or the past) and should be "
          "audited as causal", targets=("a causal layer audited without causal=True (its causality unchecked)",
                                        "an anti-causal mask (blocking the past)"),
          fix="audit the layer as causal ({causal}) if it is meant to be; if not, remove the mask it builds itself",
          needs=(NOT_CAUSAL, LONG), locate=own_mask_sites)
def check_undeclared_causality(probe: Probe) -> DetectorResult:
    """A hint, never a failure: the weights of the standard probe (which passes no mask) are read for a triangle
    of exact zeros. Exact zeros on a whole triangle are a mask: no softmax of finite scores gives them. Dropout
    left on gives exact zeros too, at random places (at T = 2 one weight per row is above the diagonal: p = 0.1 zeroes
    both rows of the probe one time in a hundred), so a triangle found is read again in a second call on the same
    input: sequence 0 of batch_independence's call (seeded apart, made anyway). A mask zeroes it again; dropout's
    zeros land elsewhere (at T = 2, p = 0.1, both calls alike one time in a thousand). Sequence 1 of that call is
    pushed 1000x, which can outweigh a finite mask (-1e4), so it is not read."""
    det, base = "undeclared_causality", probe.base()
    if probe.subject.own_queries:
        return DetectorResult(det, "skip", f"{NOT_APPLICABLE}the layer attends with queries of its own, which have no "
                                           f"position among the tokens: no key is in their future")
    if not base.ok:
        return not_run(det, base)
    weights, source = probe.weights(base)
    if weights is None:  # read through the values, or over the layer's own partition by tagging the tokens
        weights, source = probe.recovered_weights()
    T = probe.t
    if weights is None or tuple(weights.shape[-2:]) != (T, T):
        return skip(det, "no (Tq, Tk) weights were returned or observed, so a mask of the layer's own cannot be seen")
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    sides = (("future", j > i), ("past", j < i))

    def zero_sides(weights) -> list[str]:
        zero = weights.detach().reshape(-1, T, T) == 0
        return [name for name, side in sides if bool(zero[:, side.to(zero.device)].all())]

    blocks = zero_sides(weights)
    again = ""
    if blocks:
        _, other = other_sequence_changed(probe)
        second, _ = probe.weights(other) if other.ok else (None, "")
        if second is not None and tuple(second.shape[-2:]) == (T, T):
            repeated = [name for name in blocks if name in zero_sides(second[:1])]  # sequence 0: the same input
            if not repeated:
                return result(det, "pass", "no key is blocked by its position: the layer attends both ways, as "
                                           "audited", value=0.0, threshold=0.0,
                              evidence=f"the standard probe's weights ({source}) are exactly 0 on the whole "
                                       f"{blocks[0]} side, but not for the same input in a second call (sequence 0 "
                                       f"of batch_independence's): zeros at random places (dropout left on?), not a mask")
            blocks, again = repeated, ", and again for the same input in a second call (batch_independence's)"
    if blocks:
        side = blocks[0]
        what = ("it masks the future itself: a causal layer, whose causality this audit does not check" if side ==
                "future" else "it masks the past: no causal layer does that (a triu where tril belongs?)")
        return result(det, "warn", f"every weight {'above' if side == 'future' else 'below'} the diagonal is exactly 0 "
                                   f"though no mask was passed: {what}",
                      value=1.0, threshold=0.0, replay=base,
                      # the declaration the hint names, as data (a sweep follows it as a user would)
                      extras={"suggests": {"causal": True}} if side == "future" else {},
                      evidence=f"the standard probe ({source}): all {int(dict(sides)[side].sum())} "
                               f"(query, key) pairs with the key {'after' if side == 'future' else 'before'} the "
                               f"query get weight 0 in all {weights.reshape(-1, T, T).shape[0]} rows of weights{again}",
                      fix=("audit it as causal ({causal}): future_leakage, causal_alignment and the decoding checks "
                           "then measure its mask" if side == "future" else
                           "block the future, not the past: the allowed keys are torch.ones(T, T, dtype=torch.bool)"
                           ".tril(), or audit it as causal ({causal}) to have its mask judged"))
    return result(det, "pass", "no key is blocked by its position: the layer attends both ways, as audited",
                  value=0.0, threshold=0.0)
