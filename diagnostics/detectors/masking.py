"""`mask_honoured` and `fully_masked_rows`: keys the mask blocks change nothing, and a query with no key
allowed gives a finite output.

`mask_honoured` blocks keys in three ways: trailing padding (every query), a causal mask (audited as not causal), and
keys in the past (keys 1..cut for every query, audited as not causal). The last is the one a layer that reads its
mask only as a flag fails: it applies a fixed pattern (a causal mask, a window) whenever a mask is given, never the
mask's values (Whisper's `is_causal=mask is not None`), and the first two block only keys such a pattern hides
anyway. The finding then says so, from two more calls (`read_as_flag`): a mask that blocks nothing gives the same
outputs, no mask gives others."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._core import (
    Case,
    Inputs,
    allowed_text,
    compare,
    compared,
    expand_rows,
    held,
    not_run,
    perturbed,
    relative_change,
    skip,
    stacked_batch,
    unravel,
    where_text,
)
from .._probe import Call, Probe
from .._registry import LONG, TAKES_MASK, detector
from .._result import DetectorResult, Site
from .._subject import Output
from .._thresholds import ROW_SUM, UNCHANGED, dtype_name, tolerance
from .._tracing import declared_mask, first_moved, first_out, masking_ops, op_site, trace_call
from .._tracing import mask_sites as tracing_mask_sites  # this module's `mask_sites` is mask_honoured's locator
from ._common import (
    float64_copy_or_skip,
    float64_output,
    float64_worst,
    invariance_sites,
    judge,
    perturbation_gains,
    result,
)
from ._mask_hints import convention_hint, honoured_as_given, undeclared_convention
from ._stacked import PADDED, stacked, stacked_baseline, stacked_cases, stacked_inputs
from .finite import ROW_FILLS, nonfinite_sites


@detector("mask_honoured", "changing a key the mask blocks changes nothing (padding, causal and, audited as not "
          "causal, past-key masks)",
          targets=("mask polarity inverted", "mask applied after softmax", "mask ignored or misshaped",
                   "mask read only as a flag (a fixed causal or window pattern applied whenever a mask is given)"),
          fix="apply the mask to the scores before the softmax: scores.masked_fill(~allowed, -inf)",
          needs=(TAKES_MASK, LONG),
          locate=lambda probe, result: mask_sites(probe, result))
def check_mask_honoured(probe: Probe) -> DetectorResult:
    det, B, T = "mask_honoured", probe.BATCH, probe.t
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    cut = (T - 1) // 2
    # the padding scenario's mask is the stack's: trailing keys blocked for every query (see Probe.padding)
    scenarios = [("padding", None, None, PADDED_KEYS)]
    if not probe.causal and not probe.subject.own_queries:  # queries of its own are no token's: none is causal
        # a causal mask passed to a layer audited as causal blocks what the layer's own causality (or the causal
        # mask the audit passes) blocks already: that probe is future_leakage's, which runs on such layers
        scenarios.append(("causal", (j <= i).expand(B, T, T), (j > cut).expand(B, T),
                          f"when only keys after t={cut} changed"))
    if not probe.causal and cut >= 1:
        # keys in the past blocked for every query (key 0 kept, so that no query is left without a key): keys that
        # trailing padding and a causal mask never block. A layer that reads its mask only as a flag (applies a
        # fixed causal or windowed pattern whenever a mask is given, whatever it holds) lets the later queries see
        # them; the two scenarios above cannot tell, as the fixed pattern hides every key they block. Not in a
        # causal audit: there the causal mask is what the layer was declared to apply, and a layer switched causal
        # by the mask's presence does what its model asks of it where the model passes it only that mask
        # (Whisper's decoder)
        past = (j >= 1) & (j <= cut)  # (Tk,)
        scenarios.append(("past-key", (~past).expand(B, T, T), past.expand(B, T), PAST_KEYS.format(cut=cut)))
    results, unmeasured, base, blocked = [], None, None, {}
    # the rows a correct layer moves are named in every scenario but past-key's (see below)
    moves = {name: name != "past-key" for name, *_ in scenarios}
    for name, mask, keys, when in scenarios:
        control = name == "padding"
        if control:  # one call with future_leakage's padded cut (detectors/_stacked.py)
            comparison = stacked(probe, PADDED, det)
        else:
            base = Inputs(*probe.streams(B, T), mask)
            # no positive control in the past-key scenario: the changed queries may attend key 0 alone (a layer
            # causal by itself), whose output no query moves; the padding scenario's control proves the probe bites
            comparison = compare(probe, base, blocked_key_cases(probe, base, keys, when, control=False,
                                                                moves=moves[name]),
                                 label=f"{name} mask, blocked keys changed")
        if isinstance(comparison, DetectorResult):  # not measured with this mask (see below)
            unmeasured = unmeasured or comparison
            continue
        base = comparison.base
        keys = ~base.extra[:, 0, :] if control else keys  # (B, Tk): the blocked keys
        blocked[name] = (keys, when)
        rows = _rows(probe, base, keys)
        # per case, the rows whose own token changed (one stream): their moving shows no key reaching another query;
        # none where the layer's queries are its own
        none = torch.zeros(B, probe.subject.own_queries or T, dtype=torch.bool)
        tokens = base.one_stream and not probe.subject.own_queries
        owns = [keys if tokens else none] * len(perturbation_gains(probe))
        if control:
            owns.append(rows.changed if tokens else none)
        # no control (the causal scenario): it proves nothing either way, and never says the mask works backwards
        reading = allowed_key_reading(comparison, rows.attends, probe.subject.dtype) if control else (None, "")
        results.append((name, comparison, reading, crosses(comparison, owns)))
    if not results:
        return unmeasured
    readings = [(name, *held(c, probe, what="outputs")) for name, c, _, _ in results]
    bad = [name for name, b, _, _, _ in readings if b]
    # keys the mask allows do nothing where the output does respond to others: the mask works the wrong way round
    # (it may hold every blocked row still, by zeroing the very rows it should keep)
    backwards = [(name, text) for name, _, (moved, text), cross in results if cross and moved is False]
    if not bad and backwards:
        return result(det, "fail", f"keys the mask allows have no effect on the queries that may attend them "
                                   f"({', '.join(n for n, _ in backwards)} mask), while the output responds to other "
                                   f"changes: the mask works the wrong way round",
                      value=0.0, threshold=results[0][1].tol, evidence="; ".join(f"{n} mask: {t}" for n, t in backwards),
                      fix=_with_hint(probe, "pass the mask as the layer reads it (True = may attend, or declare its "
                                            "convention), so that the keys it allows are the ones attended"))
    # one scenario that did not respond proves nothing: neither the rows a correct layer moves when blocked keys
    # change, nor those that may attend key 0
    silent = [name for (name, _, _, _, quiet), (_, _, (moved, _), _) in zip(readings, results) if quiet and not moved]
    # a mask whose probe could not be compared (the output zero or non-finite everywhere) leaves the detector not
    # measured, as the hold rows of the others may be the same non-finite values (-inf logits times the values);
    # only the backwards finding above stands beside it, read from rows that did not move at all
    if unmeasured:
        return unmeasured
    if not bad and silent:
        return skip(det, f"the output did not respond to changed keys with the {' and '.join(silent)} mask (not even "
                         f"the rows a correct layer moves), so its not moving where the mask blocks them proves nothing")
    if not bad and base.one_stream and not any(cross for *_, cross in results):
        return skip(det, "no changed key moved any other query's output (each output moves with its own token "
                         "only): the layer mixes no tokens, so the mask has nothing to block")
    pushed = _pushed_only(probe, results, readings, blocked, moves) if bad else ""
    if pushed:
        return result(det, "warn", f"keys the mask blocks move the rows that may not attend them only when pushed "
                                   f"{perturbation_gains(probe)[0]:g}x; at the inputs' own scale they change nothing: "
                                   f"the mask is removed after the softmax (its kept weights underflow when a blocked "
                                   f"score dominates), or a finite fill is overcome",
                      value=max(w for _, _, w, _, _ in readings), threshold=results[0][1].tol, evidence=pushed,
                      fix=PUSHED_FIX, replay=tuple(c for _, c, *_ in results))
    found = judge(det, bool(bad), f"outputs depend on keys the mask blocks ({', '.join(bad)})",
                    f"keys the mask blocks have no effect ({_listed([name for name, *_ in results])} "
                    f"mask{'s' if len(results) > 1 else ''})",
                    value=max(w for _, _, w, _, _ in readings), threshold=results[0][1].tol,
                    evidence="; ".join(f"{name} mask: {text}" for name, _, _, text, _ in readings),
                    replay=tuple(c for _, c, *_ in results))
    if found.verdict == "fail":
        flag = read_as_flag(probe, [r for r in results if r[0] in bad])
        if flag:
            return DetectorResult(det, "fail", f"the mask's content is ignored; only its presence changes the output: "
                                               f"the layer reads its mask only as a flag ({found.message})",
                                  value=found.value, threshold=found.threshold,
                                  evidence=f"{found.evidence}; {flag}", fix=FLAG_FIX, replay=found.replay,
                                  extras={"read_as_flag": True})
    undeclared = undeclared_convention(probe) if found.verdict == "fail" else None
    if undeclared is not None:
        # nobody said the mask's convention, and the layer honours it in another: the same behaviour is an inverted
        # (or added) mask under the audit's default reading and right under the other, so no FAIL: a declaration
        declare, hint, convention = undeclared
        given = probe.subject.mask_convention
        return DetectorResult(det, "skip", f"needs a declaration, {declare}: given its mask in the audit's default "
                                           f"convention, {given} ({given.describe()}), which nothing the layer says "
                                           f"confirms, {found.message}; {hint}",
                              value=found.value, threshold=found.threshold, evidence=found.evidence,
                              fix=f"declare the convention the layer takes: {hint}", replay=found.replay,
                              declaration=declare, extras={"mask_convention": convention})
    if found.verdict == "fail":
        # before saying the mask is ignored: the layer's mask may be another convention, as its parameter's name,
        # annotation, default or docstring says or as it behaves; a hint only where the layer states a convention
        # (or the user or its library does), and the verdict stays: a mask it states and inverts must fail
        hint = convention_hint(probe)
        if hint:
            found = DetectorResult(det, "fail", f"{found.message}; {hint}", value=found.value,
                                   threshold=found.threshold, evidence=found.evidence,
                                   fix=f"{hint}; {found.fix}", replay=found.replay)
        else:  # the convention given is honoured where the mask is the same for every query: say so, hint nothing
            words = honoured_as_given(probe)
            if words:
                found = replace(found, message=f"{found.message}; {words}")
    return found


def _pushed_only(probe: Probe, results, readings, blocked, moves) -> str:
    """After held rows moved under the hard push: the scenarios that moved them again, their blocked keys
    (`blocked`: {name: (keys (B, Tk), when)}) redrawn at the inputs' own scale (gain 1), on the layer's float64 copy,
    the rows a correct layer moves named as before (`moves`: {name: bool}) and moved there too. Their evidence where
    no held row moves there (beyond float64's "unchanged" tolerance), else ''.

    A mask applied after the softmax and renormalised (`w * m / w.sum()`) is right in exact arithmetic, but a blocked
    key pushed 1000x takes every weight, and the kept ones underflow to 0 / 0; a finite fill that a pushed score
    overcomes lets it in only then too. (With an epsilon, `/ (w.sum() + 1e-9)`, the blocked keys keep a 1e-9 share
    through the normaliser, which float64 reads: a FAIL, as gradients' is.) At the inputs' own scale in float64 nothing
    moves. A mask that lets blocked keys in moves held rows at any scale: at std-0.02 in bfloat16 a mask applied after
    the softmax moves them by less than the layer's tolerance unless pushed, which is why the reading is float64's,
    whose tolerance (1e-10) no such leak stays under. No copy, or a call of it that raises: '' (the FAIL stands)."""
    twin = float64_copy_or_skip(probe, probe.detector)
    if isinstance(twin, DetectorResult):
        return ""
    texts = []
    for (name, comparison, *_), (_, bad, _, pushed, _) in zip(results, readings):
        if not bad:
            continue
        base = comparison.base
        keys, when = blocked[name]
        cases = blocked_key_cases(probe, base, keys, when, control=False, moves=moves[name], gains=(1.0,))
        query, key, value, allowed = stacked_batch(probe, base, cases)
        replay = Call(query, key, value, allowed, None, None, label=f"float64 copy: {name} mask, blocked keys "
                                                                        f"changed at the inputs' own scale")
        probe.passes += 1
        try:
            replay.output = Output(float64_output(twin, replay), None)
        except Exception:  # noqa: BLE001 -- no reading, then: the verdict in the layer's own dtype stands
            return ""
        again = compared(probe, replay, base, cases)
        if isinstance(again, DetectorResult):
            return ""
        again = replace(again, tol=tolerance(UNCHANGED, torch.float64))
        moved, _, text, unresponsive = held(again, probe, what="outputs", dtype=torch.float64)
        if moved or unresponsive:
            return ""
        texts.append(f"{name} mask: pushed, {pushed}; at the inputs' own scale on a float64 copy, {text}")
    return "; ".join(texts)


PUSHED_FIX = ("block the keys in the scores before the softmax with -inf (scores.masked_fill(~mask, -inf), or attn_mask= "
              "to scaled_dot_product_attention) instead of zeroing and renormalising the weights after it, or adding a "
              "finite fill a large score overcomes: a padded token with a large score then cannot take the kept ones' "
              "weight")


def mask_sites(probe: Probe, result: DetectorResult) -> list[Site]:
    """The first op whose output moves when only keys the mask blocks change (or the masking op that lets them in);
    for a mask read only as a flag, the same sites with the flag's fix: what they block is a fixed pattern."""
    sites = invariance_sites(probe, result, use_masks=True,
                             note="the first op whose output moves when only keys the mask blocks change")
    if not result.extras.get("read_as_flag"):
        return sites
    return [replace(site, note=f"the mask's values do not reach it, only whether one is given: {site.note}",
                    fix=FLAG_FIX) for site in sites]


PADDED_KEYS = "when only padded keys changed"
PAST_KEYS = "when only keys 1..{cut}, which the mask blocks for every query, changed"
FLAG_FIX = ("the mask is read only as a flag: use its values, not `mask is not None`: apply them to the scores "
            "(scores.masked_fill(~mask, -inf), or attn_mask=mask to scaled_dot_product_attention) rather than "
            "switching a fixed pattern on whenever a mask is given (is_causal=mask is not None); if the layer's model "
            "only ever passes it one fixed mask, or none, audit it as it is called: declare the call, e.g. "
            "call=lambda layer, x: layer(x)")


def read_as_flag(probe: Probe, results) -> str:
    """After blocked keys moved the output: whether the layer reads its mask only as a flag. On the first of the
    failing scenarios' (`results`) inputs whose mask blocks something, the same call with a mask that blocks nothing
    beyond what the audit itself passes (causal, a pattern) and with no mask at all: the opened mask gives the same
    outputs (within the "unchanged" tolerance: the keys it blocked were never read) while no mask gives others (its
    presence switches something on). Its evidence, else '' (also where the mask is ignored altogether: no mask then
    changes nothing either). Two calls, on failure only."""
    B, T = probe.BATCH, probe.t
    for name, comparison, _, _ in results:
        base = comparison.base
        blocked = probe.allowed(B, T, T, base.extra)
        opened = probe.allowed(B, T, T, torch.ones(B, T, T, dtype=torch.bool))
        if bool((opened.cpu() == blocked.cpu()).all()):
            continue
        masked = comparison.baseline_output()
        calls = [probe.call(base.query, base.key, base.value, mask,
                            label=f"{name} scenario's inputs, {what}")
                 for mask, what in ((opened, "a mask that blocks none of them"), (None, "no mask"))]
        if not all(c.ok and tuple(c.output.out.shape) == tuple(masked.shape) for c in calls):
            return ""
        same = relative_change(calls[0].output.out, masked, centred=True)
        switched = relative_change(calls[1].output.out, calls[0].output.out, centred=True)
        if same is None or switched is None:
            return ""
        tol = comparison.tol
        if float(same.max()) > tol or not float(switched.max()) > tol:
            return ""
        return (f"with a mask that blocks none of the keys the {name} mask blocks the outputs were the same (greatest "
                f"change {float(same.max()):.3g} of the outputs' RMS, {allowed_text(tol, probe.subject.dtype)}), and "
                f"with no mask they changed by up to {float(switched.max()):.3g}")
    return ""


@dataclass
class _Rows:
    """A scenario's rows, (B, Tq): held (they may attend some key and none of the changed ones), seen (a correct
    layer moves them), and for the padding scenario's control the positions it changes and the rows that attend
    key 0."""

    hold: Tensor
    sees: Tensor
    changed: Tensor
    attends: Tensor


def _rows(probe: Probe, base: Inputs, keys: Tensor) -> _Rows:
    B, T = probe.BATCH, probe.t
    # what the layer is given, causal included, within a window of its own (a query with no allowed key in it holds
    # nothing)
    allowed = probe.within_reach(probe.allowed(B, T, T, base.extra).cpu())
    if probe.subject.own_queries:
        return _own_query_rows(allowed, keys, probe.subject.own_queries)
    # rows that must not move: they may attend some key, and none of the changed ones
    hold = allowed.any(-1) & ~(allowed & keys.unsqueeze(1)).any(-1)  # (B, Tq)
    sees = (allowed & keys.unsqueeze(1)).any(-1)  # (B, Tq): rows a correct layer moves
    if base.one_stream:
        hold &= ~keys  # in self-attention the changed positions are also changed queries
        sees |= keys & allowed.any(-1)
    # the padding scenario's negative control that does not rest on the blocked rows (a layer may zero the
    # outputs of masked queries, as x-transformers does, and in one stream the padded keys are those
    # queries): key 0, which the mask allows, changed alone must move the rows that may attend it (not its
    # own query, nor the padded queries, in one stream); its hold is empty, so held() and the localiser pass over it. The causal
    # scenario needs none: the rows after the cut attend the changed keys and are never masked queries.
    # In one stream the last key (padded in every batch row) changes with it: the other padded queries
    # that attend it (a mask inverted on its way in) show that the layer mixes tokens where key 0 moves
    # nothing, so a layer that mixes none (each output its own token's) is told apart
    changed = torch.zeros(B, T, dtype=torch.bool)
    changed[:, 0] = True
    attends = allowed[..., 0].clone()  # (B, Tq)
    if base.one_stream:  # not read there: the changed queries, and the padded ones (key T-1 may reach them)
        changed[:, T - 1] = True
        attends &= ~changed & ~keys
    return _Rows(hold, sees, changed, attends)


def _own_query_rows(allowed: Tensor, keys: Tensor, queries: int) -> _Rows:
    """`_rows` for a layer with `queries` queries of its own, (B, Q): none is a token's, so none changes with the
    changed keys; each is given the mask's one row (`own_query_mask`: the same for every query), and is held where it
    may attend some key and none of the changed ones, moved where it attends one. The control changes key 0 alone."""
    B, _, T = allowed.shape  # batch, queries, keys
    row = allowed[:, 0]  # (B, Tk): every query's row
    changed = torch.zeros(B, T, dtype=torch.bool)
    changed[:, 0] = True

    def per_query(x: Tensor) -> Tensor:  # (B,) -> (B, Q)
        return x.unsqueeze(1).expand(B, queries)

    return _Rows(hold=per_query(row.any(-1) & ~(row & keys).any(-1)), sees=per_query((row & keys).any(-1)),
                 changed=changed, attends=per_query(row[:, 0]))


def blocked_key_cases(probe: Probe, base: Inputs, keys: Tensor, when: str, *, control: bool,
                      moves: bool = True, gains: tuple[float, ...] | None = None) -> list[Case]:
    """The keys `keys` (B, Tk) blocks changed, and with `control` (the padding scenario) key 0 changed alone;
    `moves`: the rows a correct layer moves are named (Case.move), the cases' positive control; `gains`: how hard
    (`perturbation_gains` unless given)."""
    B, T = probe.BATCH, probe.t
    rows = _rows(probe, base, keys)
    gains = perturbation_gains(probe) if gains is None else gains
    none = torch.zeros(B, probe.subject.own_queries or T, dtype=torch.bool)
    cases = [Case(x, hold=rows.hold, move=rows.sees if moves else None, when=f"{when} (x{gain:g})")
             for gain, x in zip(gains, perturbed(probe, base, keys, ("key", "value"), gains=gains))]
    if control:
        also = f" and key {T - 1}, which it blocks," if base.one_stream and not probe.subject.own_queries else ""
        cases.append(Case(perturbed(probe, base, rows.changed, ("key", "value"), gains=gains[:1])[0],
                          hold=none, when=f"when only key 0, which the mask allows,{also} changed (x{gains[0]:g})"))
    return cases


@stacked_cases(PADDED, "mask_honoured")
def padded_key_cases(probe: Probe, base: Inputs) -> tuple[list[Case], str]:
    """The padding scenario: the padded keys changed, and key 0 alone (the control); none where mask_honoured does
    not apply (one token: weight_row_sums reads the stack's baseline alone)."""
    if probe.t < 2 or not probe.subject.takes_mask:
        return [], ""
    return blocked_key_cases(probe, base, ~base.extra[:, 0, :], PADDED_KEYS, control=True), \
        "padding mask, blocked keys changed"


def crosses(comparison, owns) -> bool:
    """Did some case move an output row other than those whose own token it changed (`owns`, per case)?"""
    return any(bool(((change > comparison.tol) & ~expand_rows(own, change)).any())
               for change, own in zip(comparison.changes, owns))


def allowed_key_reading(comparison, attends, dtype) -> tuple[bool, str]:
    """The control case (the last): (did a row that may attend key 0 move, evidence). No finite row that may
    attend key 0: nothing to prove either way, read as moved."""
    tol, change = comparison.tol, comparison.changes[-1]
    # rows whose baseline is NaN or inf cannot show a move (the same inf again is no change): not counted
    baseline = comparison.baseline_output()
    finite = torch.isfinite(baseline).all(-1).to(change.device)  # change's shape: (B, [H,] Tq)
    rows = change[expand_rows(attends, change) & finite]
    moved = bool((rows > tol).any()) if rows.numel() else True  # no row to move proves nothing either way
    worst = float(rows.max()) if rows.numel() else 0.0
    text = (f"{int((rows > tol).sum())} / {rows.numel()} outputs that may attend key 0 moved when only key 0 changed; "
            f"greatest change {worst:.3g} ({allowed_text(tol, dtype)})")
    return moved, text


def _listed(names: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


def _with_hint(probe: Probe, fix: str) -> str:
    hint = convention_hint(probe)
    return f"{hint}; {fix}" if hint else fix


@detector("blocked_keys_absent", "a sequence under a padding mask gives the rows of the same sequence cut to its "
          "length: keys the mask blocks take no weight at all, and each batch row reads its own mask",
          targets=("blocked tokens' features zeroed instead of their scores blocked (they still take weight)",
                   "another batch row's mask applied (row 0's for every row, the mask broadcast across the batch)",
                   "mask applied after softmax", "mask polarity inverted"),
          fix="block keys in the scores before the softmax, each batch row by its own mask: "
              "scores.masked_fill(~keep[:, None, None, :], -inf) for a (B, Tk) mask, True = keep",
          needs=(TAKES_MASK, LONG), locate=lambda probe, result: blocked_keys_sites(probe))
def check_blocked_keys_absent(probe: Probe) -> DetectorResult:
    """mask_honoured's padding probe (`PADDED`: batch row b keeps its first L_b keys, the lengths apart) against
    the same sequences cut to each L_b, given a mask that blocks nothing: a correct layer gives row b's first L_b
    rows (its every row, for queries of its own) alike, within the rounding of a recomputation (`ROW_SUM`, as
    decode_consistency's). mask_honoured changes the blocked keys' contents and cannot see a blocked key that
    still takes weight with contents the layer fixed (features zeroed), nor a key blocked that the row's own mask
    allows (another row's mask). The control: the padded inputs with a mask that blocks nothing give other rows,
    so the padding reaches the kept rows unless the mask blocks it. One call per length, and the control's; in a
    causal or patterned audit the same again with the batch reversed, whose kept rows never see the trailing keys,
    so that a row given a longer row's mask is given a shorter one's in one of the two orders."""
    det, s, B, T = "blocked_keys_absent", probe.subject, probe.BATCH, probe.t
    padded = stacked_baseline(probe, PADDED)
    if not padded.ok:
        return not_run(det, padded)
    base, t, own = stacked_inputs(probe, PADDED), s.time_dim, s.own_queries
    out = padded.output.out
    if out.dim() < 3 or out.shape[0] != B or out.shape[t] != (own or T):
        return skip(det, f"the output {tuple(out.shape)} has no row per query and batch element (see output_shape)")
    lengths = base.extra[:, 0, :].sum(-1).tolist()  # (B,): the keys each row keeps
    tol = tolerance(ROW_SUM, s.dtype)
    hidden = probe.causal or probe.pattern is not None
    # in a causal audit (or under a declared pattern) a row's kept rows never see the trailing keys, so a row given a
    # longer row's mask (`mask[:1]`, `mask[-1:]`) shows nothing: the batch reversed gives each row the other's place
    orders = [(base, padded, lengths, "")]
    if hidden and B > 1:
        memo: dict[int, Tensor] = {}  # one stream stays one tensor, a memory both key and value

        def reversed_(x: Tensor) -> Tensor:
            return memo.setdefault(id(x), x.flip(0))

        flipped = Inputs(*(reversed_(x) for x in (base.query, base.key, base.value)), base.extra.flip(0))
        again = probe.call(flipped.query, flipped.key, flipped.value, probe.allowed(B, T, T, flipped.extra),
                           label="the padding probe's batch reversed")
        if again.ok and again.output.out.shape == out.shape:
            orders.append((flipped, again, lengths[::-1], ", the batch reversed"))
    readings, compared = [], []
    for inputs, whole, rows_kept, how in orders:
        calls = []
        for length in sorted(set(rows_kept)):
            cut = _cut(inputs, length, t)
            call = probe.call(cut.query, cut.key, cut.value, probe.allowed(B, length, length, cut.extra),
                              label=f"the padding probe's sequences cut to {length} of {T} tokens, nothing blocked"
                                    f"{how}")
            if not call.ok:
                return skip(det, f"the layer raised on the sequences cut to {length} of {T} tokens "
                                 f"({call.describe_error()}), so they cannot be compared with the padded ones")
            got = call.output.out
            if got.shape[0] != B or got.dim() != out.dim() or got.shape[t] != (own or length):
                return skip(det, f"the output {tuple(got.shape)} of the sequences cut to {length} tokens has no row "
                                 f"per query and batch element")
            rows = [b for b, n in enumerate(rows_kept) if n == length]
            kept = own or length
            change = relative_change(got[rows].narrow(t, 0, kept), whole.output.out[rows].narrow(t, 0, kept),
                                     centred=True, scale_of=whole.output.out)
            if change is None:
                return skip(det, "the output is zero or non-finite everywhere, so a difference cannot be measured")
            readings.append((length, rows, float(change.max()), int((change > tol).sum()), change.numel(), how))
            calls.append(call)
        compared.append((whole, calls, rows_kept))
    worst = max(r[2] for r in readings)
    evidence = "; ".join(f"sequence{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))} ({n} of {T} keys kept"
                         f"{how}): {bad} / {total} rows differ from the sequence cut to {n} tokens, by up to {m:.3g}"
                         for n, rows, m, bad, total, how in readings) + f" ({allowed_text(tol, s.dtype)})"
    failed = worst > tol
    calls = [c for whole, cuts, _ in compared for c in (whole, *cuts)]
    if failed and s.dtype != torch.float64:
        exact = max((_float64_worst(probe, whole, cuts, rows_kept) for whole, cuts, rows_kept in compared),
                    key=lambda x: math.inf if x is None else x)
        if exact is not None and exact <= tolerance(ROW_SUM, torch.float64):
            failed = False
            evidence += (f"; a float64 copy of the layer on the same inputs measured {exact:.2g} (up to "
                         f"{tolerance(ROW_SUM, torch.float64):.0e}): the {dtype_name(s.dtype)} difference is rounding")
        elif exact is not None:
            evidence += f"; a float64 copy of the layer on the same inputs measured {exact:.3g}: not rounding"
    if failed:
        return result(det, "fail", "a padded sequence's rows differ from those of the sequence cut to its length: "
                                   "the padded tokens still act on the kept rows", value=worst, threshold=tol,
                      evidence=evidence, replay=tuple(calls))
    opened = probe.call(base.query, base.key, base.value, probe.allowed(B, T, T, torch.ones_like(base.extra)),
                        label="the padding probe's inputs, nothing blocked")
    change = relative_change(opened.output.out, out, centred=True) if opened.ok and \
        opened.output.out.shape == out.shape else None
    # the kept rows only, where they may attend the padding: a layer may zero its padded queries' outputs under a
    # mask (x-transformers does), which moves only those rows. A causal audit's (or a declared pattern's) kept rows
    # never see the trailing padding, so there any row that moved shows the layer reads the mask
    hidden = probe.causal or probe.pattern is not None
    kept_rows = torch.ones(B, own or T, dtype=torch.bool) if own or hidden else \
        torch.arange(T) < torch.tensor(lengths).unsqueeze(-1)  # (B, Tq)
    reach = None if change is None else change[expand_rows(kept_rows, change)]
    if reach is None or not float(reach.max()) > tol:
        return skip(det, "the padded keys, given a mask that blocks nothing, moved no kept row either, so the rows' "
                         "agreement with the cut sequences proves nothing about the mask")
    return result(det, "pass", "each padded sequence gives the rows of the sequence cut to its length", value=worst,
                  threshold=tol, evidence=f"{evidence}; with nothing blocked the same inputs moved the rows by up to "
                                          f"{float(reach.max()):.3g}")


def blocked_keys_sites(probe: Probe) -> list[Site]:
    """Where the padding probe's mask goes wrong: the masking ops judged against the audit's mask (`mask_sites`:
    another row's mask, a mask after the softmax, no mask before it). Where no op masks the scores before the softmax,
    led by the first op of the layer's own, reading the inputs, whose output the mask changes (the padded call against
    the same inputs with a mask that blocks nothing): where the mask acts instead, on the keys' features for the bug
    this check alone catches. The padded and the cut calls differ in length and cannot be compared op by op; these
    two calls can. One or two traced calls, on failure only."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    base = stacked_inputs(probe, PADDED)
    allowed = probe.allowed(B, T, T, base.extra)
    masked = trace_call(s, base.query, base.key, base.value, allowed, seed=probe.seed)
    declared = declared_mask(probe, B, T, T, allowed)
    rows = s.own_queries or T
    if s.own_queries:  # as invariance_sites reads queries of the layer's own
        declared = declared.any(1, keepdim=True).expand(B, rows, T)
    sites = tracing_mask_sites(masked, declared, B, rows, T)
    if any(before for *_, before in masking_ops(masked, B, rows, T)):  # the scores are masked: judged above
        return sites
    opened = trace_call(s, base.query, base.key, base.value, probe.allowed(B, T, T, torch.ones_like(base.extra)),
                        seed=probe.seed)
    op = first_moved(opened, masked, torch.ones(B, T, dtype=torch.bool), tolerance(UNCHANGED, s.dtype),
                     reads_inputs=True)
    shape = () if op is None or first_out(op) is None else tuple(first_out(op).shape)
    first = None if op is None else op_site(
        op, f"the first op the mask changes, on a tensor {shape}, and no op masks the scores over the keys before the "
            f"softmax: a key whose features are zeroed or replaced here still takes softmax weight",
        fix="block the keys in the scores before the softmax, scores.masked_fill(~keep[:, None, None, :], -inf), "
            "instead of changing their features")
    if first is None or any((x.file, x.line) == (first.file, first.line) for x in sites):  # mask_sites says why there
        return sites
    return [first, *sites]


def _cut(base: Inputs, length: int, t: int) -> Inputs:
    """`base`'s first `length` positions along the time axis `t` (one stream stays one tensor), with a mask that
    blocks nothing."""
    cut: dict[int, Tensor] = {}

    def first(x: Tensor) -> Tensor:
        return cut.setdefault(id(x), x.narrow(t, 0, length).clone())

    B = base.query.shape[0]
    return Inputs(first(base.query), first(base.key), first(base.value),
                  torch.ones(B, length, length, dtype=torch.bool))


def _float64_worst(probe: Probe, padded, cuts, lengths) -> float | None:
    """blocked_keys_absent's largest change measured again on the float64 copy of the layer, on the padded call's
    inputs and each cut call's, upcast; None where no copy runs or a call raises."""
    t, own = probe.subject.time_dim, probe.subject.own_queries

    def rows(call, got, whole):  # the sequences of the call's length, their kept rows
        length = call.query.shape[t]
        kept, at = own or length, [b for b, n in enumerate(lengths) if n == length]
        return got[at].narrow(t, 0, kept), whole[at].narrow(t, 0, kept)

    return float64_worst(probe, padded, cuts, rows)


@detector("fully_masked_rows", "a query whose every key is masked gives a finite output (warns on NaN), and NaN "
          "never reaches a query that has keys to attend",
          targets=("plain softmax over an all -inf row", "a -inf mask applied after the softmax"),
          fix="zero the weights of rows with no allowed key (torch's SDPA does), or never build such rows",
          needs=(TAKES_MASK,), locate=lambda probe, result: nonfinite_sites(probe, result, fills=ROW_FILLS))
def check_fully_masked_rows(probe: Probe) -> DetectorResult:
    det, B, T = "fully_masked_rows", probe.BATCH, probe.t
    r = T // 2
    own = probe.subject.own_queries
    extra = torch.ones(B, T, T, dtype=torch.bool)
    extra[0, r, :] = False  # batch 0, query r may attend nothing
    if own:  # queries of its own are given a mask per key (`own_query_mask`): sequence 0's every key blocked
        extra[0] = False
    elif T >= 3:
        # and every query before the last has a blocked key beside the ones it may attend: a -inf fill that reaches
        # the output (a mask applied after the softmax, no softmax at all) makes NaN in rows that have keys to
        # attend; the last query keeps that key, so that no key is blocked for every query (a softmax over the
        # queries then has no all -inf column: that is weight_row_sums' finding, not this one)
        extra[:, :T - 1, T - 1] = False
    q, k, v = probe.streams(B, T)
    allowed = probe.allowed(B, T, T, extra)
    call = probe.call(q, k, v, allowed, label="a query with no key to attend")
    if not call.ok:
        return not_run(det, call)
    finite = torch.isfinite(call.output.out).all(-1)  # (B, T) or (B, H, T); (B, Q) for queries of its own
    empty = ~allowed.cpu().any(-1)  # (B, Tq): rows with no key to attend, the causal mask's included
    if own:
        empty = empty[:, :1].expand(B, own)
    empty = expand_rows(empty, finite)
    who = "sequence 0's every query (of the layer's own)" if own else f"query (b=0, t={r})"
    if (~finite & ~empty).any():
        n = int((~finite & ~empty).sum())
        first = unravel((~finite & ~empty).flatten().nonzero()[0, 0], finite.shape)
        blocked = f" and the queries before t={T - 1} have key {T - 1} blocked" if T >= 3 and not own else ""
        return result(det, "fail", "NaN spreads beyond the query whose every key is masked",
                       value=float(n), threshold=0.0,
                       evidence=f"{n} output rows that have keys to attend are NaN/inf, first at "
                                f"{where_text(first, finite.dim())}, when only {who} has no key{blocked}",
                       replay=call,
                       fix="keep NaN out of rows that have keys: apply the mask to the scores before the softmax "
                           "(scores.masked_fill(~allowed, -inf), then softmax; a -inf that reaches the weights or the "
                           "output is NaN there), and zero the weights of rows with no allowed key (torch's SDPA does)")
    if (~finite & empty).any():
        return result(det, "warn", "a query whose every key is masked gets NaN (torch's SDPA gives zeros)",
                       value=1.0, threshold=0.0,
                       evidence=f"output {'of ' + who if own else f'at (b=0, t={r})'} is NaN/inf when "
                                f"{'it' if own else 'that query'} may attend no key; it will "
                                f"poison the loss and the gradients unless such rows are dropped", replay=call)
    return result(det, "pass", "a query with no key to attend gives a finite output, and every other query too",
                  value=0.0, threshold=0.0)
