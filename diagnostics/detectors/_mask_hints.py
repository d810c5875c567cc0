"""Which mask convention a layer behaves as if it took: words for a finding, never a choice of the audit.

When a layer that takes a mask fails on it (`mask_honoured`, or `runs` when a mask of the audit's shape makes it
raise) and nobody declared its convention, the finding says which conventions would fit: first what the layer
says or suggests (`_subject.mask_convention_hint`: its parameter's name, annotation, default, docstring), then
what it does. `honoured_conventions` gives the layer the same padding mask in each other convention (a meaning
and a shape, diagnostics._masks) and reads whether it then honours it: changing the keys that mask blocks moves
no output row, and changing a key it allows moves the rows that see it. The audit's verdict stays the one it
reached with the declared (or default) convention: a layer whose mask polarity is inverted by mistake behaves
exactly like a correct one that takes True = blocked, so behaviour can only ever be a hint, worded as one.

The search makes one call per convention tried, only for a finding, and stops at the first that is honoured.
"""

from __future__ import annotations

import copy

import torch

from .._core import Inputs, baseline_scale, perturbed, relative_change
from .._masks import MEANINGS, SHAPES, SHORTCUTS, MaskConvention
from .._probe import Probe
from .._subject import mask_convention_hint, spell, stated_bool, suggested_conventions
from .._thresholds import UNCHANGED, tolerance
from ._common import perturbation_gains
from ._heads_out import heads_out_seen

MOVED = 0.5  # of the rows that see a changed allowed key, the share that must move for a convention to count


def candidates(probe: Probe) -> list[MaskConvention]:
    """Every other convention, those the layer's parameter suggests first, then meanings and shapes in order."""
    s = probe.subject
    found = [c for c, _ in suggested_conventions(s)]
    found += [MaskConvention(m, shape) for m in MEANINGS for shape in SHAPES]
    out = []
    for c in found:
        if c != s.mask_convention and c not in out:
            out.append(c)
    return out


def _whole(out, s, batch: int, T: int) -> bool:
    """Whether a call in another convention gave an output of the probe's form: (batch, ..., T on the time axis, ...),
    or a module's per-head (batch, H, T, d), each head's output apart for its caller to merge (`_heads_out`), whose
    rows the changes below fold over the heads as a function's."""
    return out.dim() >= 3 and out.shape[0] == batch and (
        out.shape[s.time_dim] == T or out.dim() == 4 and s.time_dim == 1 and out.shape[2] == T)


def _heads_after(probe: Probe, out, T: int) -> bool:
    """Whether a module's 4-D output holds each head's output apart as (B, T, H, d), not (B, H, T, d): by its shape,
    and where H = T by the layout `heads_out_seen` reads at T + 3 tokens."""
    if out.shape[1] != T or out.shape[2] != T:
        return out.shape[1] == T
    heads = heads_out_seen(probe)
    return heads is not None and heads.layout == "bthd"


def honoured_conventions(probe: Probe) -> list[tuple[MaskConvention, str]]:
    """[(convention, evidence)] for the first other convention in which the layer honours a padding mask, or []
    (also where the convention was declared by the user or is the library's: nothing to hint). Cached on the
    probe: `runs` is judged twice."""
    s = probe.subject
    if "honoured" in probe.mask_hints:
        return probe.mask_hints["honoured"]
    found: list[tuple[MaskConvention, str]] = []
    probe.mask_hints["honoured"] = found
    if s.convention_by in ("user", "library") or not s.takes_mask or probe.t < 2:
        return found
    B, T = probe.BATCH, probe.t
    q, k, v = probe.streams(B, T)
    pad = probe.padding(B, T, T)  # (B, Tq, Tk): the same keys blocked for every query of a batch row
    blocked = ~pad[:, 0, :]  # (B, Tk)
    base = Inputs(q, k, v, pad)
    gains = perturbation_gains(probe)[:1]
    moved_blocked = perturbed(probe, base, blocked, ("key", "value"), gains=gains)[0]
    first = torch.arange(T) == 0  # key 0: allowed by every padding row (and by the causal mask)
    moved_allowed = perturbed(probe, base, first, ("key", "value"), gains=gains)[0]
    stacked = [base, moved_blocked, moved_allowed]
    Q = torch.cat([x.query for x in stacked])
    K = Q if base.one_stream else torch.cat([x.key for x in stacked])
    V = K if base.one_stream or base.value is base.key else torch.cat([x.value for x in stacked])
    allowed = probe.allowed(3 * B, T, T, pad.repeat(3, 1, 1))  # causal included where the audit passes it
    seen = allowed[:B].cpu()  # (B, Tq, Tk): what one copy allows
    # the rows held: every row that sees a key, as none sees a changed one (`seen` lies within the padding mask,
    # which blocks them for every query); within the layer's own reach, where its weights show one (a local window the
    # padding covers wholly leaves its queries no key: see `_rows` of masking.py)
    seen = probe.within_reach(seen)
    hold = seen.any(-1)
    if base.one_stream:
        hold &= ~blocked
    sees_first = seen[:, :, 0]  # (B, Tq): rows a correct layer moves when key 0 changes
    tol = tolerance(UNCHANGED, s.dtype)

    def honours(subject) -> str | None:
        """The evidence that `subject` (the layer in one convention) honours the padding mask, else None."""
        probe.passes += 1
        try:
            with torch.no_grad():
                out = probe.output_of(subject, Q, K, V, allowed).out
        except Exception:  # noqa: BLE001 - a convention the layer cannot take at all
            return None
        if not _whole(out, s, 3 * B, T):
            return None
        chunks = out.chunk(3)
        scale = baseline_scale(chunks[0], centred=True) or None
        changes = [relative_change(c, chunks[0], centred=True, scale=scale) for c in chunks[1:]]
        if any(c is None for c in changes):
            return None
        if out.dim() == 4 and s.time_dim == 1 and _heads_after(probe, out, T):  # (B, T, H, d): (B, T, H) changes
            changes = [c.amax(-1) for c in changes]
        held_change, moved_change = (c.reshape(B, -1, T).amax(1).cpu() for c in changes)  # (B, Tq), heads folded
        worst = float(held_change[hold].max()) if bool(hold.any()) else 0.0
        moved = moved_change[sees_first] > tol
        if worst <= tol and bool(moved.any()) and float(moved.float().mean()) >= MOVED:
            return (f"changing the keys it blocks moved no output row (greatest change {worst:.2g} of the outputs' "
                    f"RMS, up to {tol:.2g} allowed) and changing a key it allows moved {int(moved.sum())} of "
                    f"{moved.numel()} rows that see it")
        return None

    # the probe's own negative control: the layer as the audit called it must fail this probe, else the probe cannot
    # tell conventions apart (a layer that mixes query rows honours a padding mask, the same for every query, in
    # every convention it runs in) and honouring it elsewhere says nothing of the layer's convention
    given = honours(s)
    if given is not None:
        probe.mask_hints["given"] = given
        return found
    for convention in candidates(probe):
        evidence = honours(s.with_convention(convention))
        if evidence is not None:
            found.append((convention, evidence))
            break
    return found


def conventions_run(probe: Probe) -> list[MaskConvention]:
    """The other conventions in which the layer runs the standard probe's shapes, given a padding mask in each: at one
    token (`probe.t < 2`) no key can be blocked, so whether a convention is honoured cannot be read
    (`honoured_conventions` says nothing there) and running is the only evidence of a convention there is. For a
    layer that takes a mask in a convention nobody declared (its caller, `runs`, asks only then). One call per
    convention, cached on the probe."""
    s = probe.subject
    if "ran" in probe.mask_hints:
        return probe.mask_hints["ran"]
    ran: list[MaskConvention] = []
    probe.mask_hints["ran"] = ran
    B, T = probe.BATCH, probe.t
    q, k, v = probe.streams(B, T)
    allowed = probe.allowed(B, T, T, probe.padding(B, T, T))
    for convention in candidates(probe):
        probe.passes += 1
        try:
            with torch.no_grad():
                out = s.with_convention(convention)(q, k, v, allowed).out
        except Exception:  # noqa: BLE001 - a convention the layer cannot take at all
            continue
        if _whole(out, s, B, T) and bool(out.isfinite().all()):
            ran.append(convention)
    return ran


def adds_bool_mask(probe: Probe) -> bool:
    """Whether the layer adds its bool mask to the scores: its output is the same when the same mask comes as 0./1.
    floats (a layer that blocks with a bool mask cannot take a float one alike: masked_fill needs bools, and a
    multiplication would zero, not shift). Two calls, for the words of a hint only."""
    s = probe.subject
    if s.mask_convention.meaning == "additive" or not s.takes_mask:
        return False
    as_float = copy.copy(s)
    as_float._mask = lambda allowed, heads=None: s._mask(allowed, heads).to(s.dtype)  # True -> 1.0, False -> 0.0
    B, T = probe.BATCH, probe.t
    q, k, v = probe.streams(B, T)
    allowed = probe.allowed(B, T, T, probe.padding(B, T, T))
    try:
        with torch.no_grad():
            outputs = [subject(q, k, v, allowed).out for subject in (s, as_float)]
    except Exception:  # noqa: BLE001 - a layer that refuses float masks does not add them
        return False
    finally:
        probe.passes += 2
    bool_out, float_out = outputs
    if bool_out.shape != float_out.shape or not bool(torch.isfinite(bool_out).all()):
        return False
    change = relative_change(float_out, bool_out, centred=True)
    return change is not None and float(change.max()) <= tolerance(UNCHANGED, s.dtype)


def honoured_as_given(probe: Probe) -> str | None:
    """Where the hints' padding probe is honoured in the convention the audit gave (so that no convention is hinted):
    the words that say so, for the finding's message (never its fix: they name no remedy); else None."""
    honoured_conventions(probe)
    if "given" not in probe.mask_hints:
        return None
    s = probe.subject
    return (f"given as the audit gave it, {s.mask_convention} ({s.mask_convention.describe()}), a padding mask (the "
            f"same keys blocked for every query) is honoured ({probe.mask_hints['given']}), so the mask's convention "
            f"is not the cause")


def convention_hint(probe: Probe) -> str | None:
    """The words a mask finding adds: the conventions the layer says, suggests or behaves as if it took, with
    what to declare if one of them is the layer's; None where nothing points at one (or it was declared)."""
    s, options = probe.subject, probe.options
    said = mask_convention_hint(s, options)
    found = honoured_conventions(probe)
    if "given" in probe.mask_hints:  # honoured as given: no convention would change the finding, so none is named
        return None
    if not found:
        return said
    convention, evidence = found[0]
    declare = spell("mask", str(convention), options)
    if convention.meaning == "additive" and convention.shape == s.mask_convention.shape and adds_bool_mask(probe):
        what = (f"the layer adds its mask to the scores: the bool mask passed as 0./1. floats gives the same output, "
                f"so True shifts the allowed logits by 1 and blocks nothing, and given as additive floats "
                f"({convention.describe()}) the mask is honoured ({evidence})")
        # one behaviour, a bug for a bool mask and correct for an additive one: never suggest the declaration under
        # which the bug would pass where the layer's own words say bool; where they say nothing, both readings
        words = stated_bool(s)
        if words:
            return (f"{what}; {words}, so adding it is the bug: block with scores.masked_fill(~mask, "
                    f"float('-inf')) instead of adding the mask")
        return (f"{what}; the audit cannot tell which is meant: if the layer takes additive floats, audit with "
                f"{declare}; if it takes bool masks, adding them is the bug: block with scores.masked_fill(~mask, "
                f"float('-inf'))")
    what = f"given its mask as {convention} ({convention.describe()}), the layer honours it ({evidence})"
    if s.convention_by == "layer":
        hint = (f"{what}, yet the layer states {s.mask_convention} ({s.convention_why}): either that statement is "
                f"wrong, and {declare} declares what it does, or the layer misreads its own mask")
    else:
        hint = f"{what}; if that is its convention, audit with {declare}"
        if {s.mask_convention.meaning, convention.meaning} == {"allowed", "blocked"}:
            meant = SHORTCUTS[s.mask_convention.meaning].describe()
            hint += f"; if it is meant to take {meant}, its mask's polarity is inverted (~mask was meant)"
    # what its name or docstring suggested was tried first (see `candidates`): a suggestion it does not honour is
    # not repeated beside the one it does
    return hint


def undeclared_convention(probe: Probe) -> tuple[str, str, str] | None:
    """(the declaration, the hint that says both readings, the convention honoured) where nobody said the mask's convention (the audit gave
    its default: no declaration, no library's, nothing the layer states) and the layer honours its mask in another
    (`honoured_conventions`): one behaviour, a bug under the default reading and right under the other (open_clip's
    Attention fills -inf where a bool mask is True, as nn.MultiheadAttention reads it), which only the layer's author
    can tell apart. A mask finding is then a convention mismatch, not a defect: the audit needs a declaration. None
    otherwise (a convention the layer states and misreads is its bug: the finding stays)."""
    s = probe.subject
    if s.convention_by != "default" or not s.takes_mask:
        return None
    found = honoured_conventions(probe)
    if not found or (found[0][0].meaning == "additive" and stated_bool(s)):
        return None  # a mask the layer's own words say is bool, honoured only as added floats: adding it is the bug
    convention = str(found[0][0])
    return spell("mask", convention, probe.options), convention_hint(probe), convention


__all__ = ["adds_bool_mask", "candidates", "convention_hint", "honoured_as_given", "honoured_conventions",
           "undeclared_convention"]
