"""`attention_pattern`: for a declared pattern (`diagnostics.patterns`), each output row depends on exactly the
keys the pattern allows: dependence where it blocks is leakage, no dependence where it allows is over-masking.

The dependency pattern is measured by perturbing keys (and their values) and reading which output rows move, in a
fixed number of copies of the probe batch whatever the pattern's width (`MAX_COPIES` for the full pass,
`DECODE_COPIES` while decoding), stacked along the batch in one call (split to bound memory), each sequence judged
against its own row of the pattern (document ids and prefix lengths per sequence):
- by residue class: a copy perturbs, in each sequence, the keys j with j % p == r, p = (the widest row of the
  pattern) + 2, at most Tk (a class of one key). A row then meets at most one key it may see in each copy: a row
  that moves reads that key alone, one that does not move reads it ignored; and the keys one step outside a band
  (the off-by-one of a window or a chunk boundary) fall in copies where the row meets no allowed key at all, so a
  row that moves there leaks;
- which classes: all p when p <= the budget, so that every (query, key) pair is read in every sequence (a window
  of up to 7 keys, chunks of 7); otherwise the budget's worth per sequence, those that read the most edge pairs
  (`_edges`: at each end of each run of keys a row may see, the key inside and the one just outside; for a window
  of W, keys q - W and q - W + 1, q and q + 1; for chunks, each chunk's first key and the one before it), the
  second sequence taking the classes the first did not. A class reads an edge pair at about Tk / p rows: at T =
  128, a window of 16 has every edge read at about 7 rows per class, a window of 100 at one or two.
A leaking copy is then bisected to the one key that moves the row, and a row that ignored an allowed key is
measured again with that key alone, pushed both ways, before it is over-masking. A FlexAttention program's own
`mask_mod` is also compared point by point with the declared pattern on the probe's sizes.

What it cannot see: with more classes than copies (a row wider than 7 keys), only the chosen classes are read: a
pair whose key is in a class not chosen for that sequence is not measured, so a bug at a few rows that the chosen
edge pairs miss (one document boundary among many, one ignored key inside a wide band, a leak far from any edge)
can pass; a bug the same at every row (a window or chunk one off, a window on both sides, a mask aligned top-left)
shows at the rows that are read. The evidence counts the edge, allowed and blocked pairs read. A leak in a copy
where the row also meets an allowed key is read as that key's dependence. A one-stream layer (m(x)) changes a
query with its key, so the pairs (i, j) with j % p == i % p, the diagonal among them, are not measurable there (the
evidence counts them).

Audited as causal (`causal=True`, a decoder), a layer that takes a separate query is also measured decoding: the
last Tq = T // 3 positions as queries over all T keys, as with a cache of T - Tq keys, where the pattern (bottom-
right, on absolute positions) must hold too: a window dropped once a cache holds keys leaks there.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._core import Inputs, baseline_scale, not_run, perturbed, relative_change, skip
from .._probe import Probe
from .._registry import LONG, Need, detector
from .._result import DependencyMap, DetectorResult, Site
from .._thresholds import UNCHANGED, dtype_name, tolerance
from .._tracing import first_moved, mask_sites, op_site, site, text, trace_call
from ._common import perturbation_gains, result

PATTERN = Need("{pattern}", lambda p: getattr(p, "pattern", None) is not None,
               "no attention pattern is declared (pass e.g. {pattern_example})")

MAX_COPIES = 9
"""The full pass perturbs at most this many copies of the probe batch (about one forward pass each, whatever the
pattern's width): a pattern whose widest row is at most 7 keys (p <= 9 classes: the windows, chunks and documents of
the catalog and tests at T = 16) is read pair by pair in every sequence; a wider one reads 9 classes per sequence,
the two sequences different ones (18 in all), chosen for the edge pairs they read. Measured (benchmarks/
audit_cost.py --cpu --causal, MultiHeadAttention(512, 8)): with sliding_window(16) or (128) the whole audit does
1.45x the causal audit's work at T = 128 and 1.47x at 1024 (38.5 / 36.1 forward passes against 26.6 / 24.6); one
copy per residue class, up to 32, did 2.16x and 3.0x."""
DECODE_COPIES = 2
"""The decoding measurement (a causal layer with a separate query) perturbs at most this many copies of its inputs
(the last T // DECODE_SHARE queries over all T keys, 0.5-0.7 of a forward pass each), 2 classes per sequence chosen
as the full pass's are: a mask aligned top-left, or a window dropped once a cache holds keys, differs at every
decoded row, so a few rows read suffice."""
MAX_SCORES = 1 << 24
"""Stacked copies per call are limited so that a call's (rows, heads, T, T) scores stay under this many elements."""
PICTURE_CELLS = 32
"""A finding's picture (`DependencyMap`) is measured key by key on at most this many keys and rows around its first
cell: one copy of the probe batch per key, so at most 32 copies more, and only when the detector fails."""
DECODE_SHARE = 3
"""The decoding measurement's queries are the last T // DECODE_SHARE positions (at least 1): an uneven split."""


@dataclass
class PatternEvidence:
    """What the verdict was computed on, for the localiser: the baseline (its queries the last Tq of the Tk
    positions), the perturbed copy in which a held row moved (`case`, `hold`: (B, Tq) rows that must not move,
    `moved`: the perturbed key positions (B, Tk)), and a FlexAttention mask_mod that disagrees with the pattern at
    `point` (b, h, q, kv)."""

    base: Inputs | None = None
    case: Inputs | None = None
    hold: Tensor | None = None
    moved: Tensor | None = None
    tol: float = 0.0
    mask_mod: object = None
    point: tuple[int, int, int, int] | None = None
    differ: tuple[int, int, int] = (0, 0, 0)  # points that differ in all, in (b=0, h=0), and (b=0, h=0)'s total
    allows: bool = False  # what the mask_mod says at `point`
    flex_frames: tuple = ()
    fix: str = ""  # the fix of a mask found at the sites: the declared pattern's own rule, and what differs


def _streams(probe: Probe) -> tuple[str, ...]:
    return ("query", "key", "value") if not probe.subject.separate_kv else ("key", "value")


def _fold(change: Tensor) -> Tensor:
    """(B, [H,] Tq) -> (B, Tq): the most any head moved."""
    return change.amax(1) if change.dim() == 3 else change


def _sizes(probe: Probe, base: Inputs) -> tuple[int, int, int]:
    """(B, Tq, Tk) of a probe's inputs."""
    t = probe.subject.time_dim
    return base.query.shape[0], base.query.shape[t], base.key.shape[t]


def _declared(probe: Probe, B: int, t_q: int, t_k: int) -> Tensor:
    """What the layer may see, bool (B, Tq, Tk): the declared pattern (bottom-right), and the mask it is given."""
    declared = probe.pattern.allowed(B, t_q, t_k)  # (B, Tq, Tk)
    passed = probe.allowed(B, t_q, t_k)
    return declared if passed is None else declared & passed.cpu().bool().expand(B, t_q, t_k)


def _run(probe: Probe, base: Inputs, sets: list[Tensor], label: str, reference: Tensor | None = None, *,
         both_ways: bool = False) -> tuple[list[Tensor], float, list, Tensor] | DetectorResult:
    """Each of `sets` (bool (B, Tk): the keys perturbed in each sequence) as one copy of `base`, the copies stacked
    along the batch (in as few calls as `MAX_SCORES` allows) and measured against one baseline call (`reference`:
    its output, when already made): the moved rows (B, Tq) of each, the tolerance, the perturbed inputs and the
    baseline's output. A baseline in a call of its own differs from the same rows of a stacked call by at most a
    rounding (the tolerance is 2.5 or more roundings at every dtype). `both_ways`: each set as two copies, the one
    draw pushed one way and the opposite way (a key pushed to a very negative logit only loses its weight; pushed
    the other way it takes it all)."""
    det, s = probe.detector, probe.subject
    B, t_q, t_k = _sizes(probe, base)
    heads = s.num_heads or 1
    per_call = max(1, MAX_SCORES // max(1, B * heads * t_q * t_k))
    gains = perturbation_gains(probe)
    gains = gains + tuple(-g for g in gains) if both_ways else gains
    tol = tolerance(UNCHANGED, s.dtype)
    if reference is None:
        first = probe.call(base.query, base.key, base.value, probe.allowed(B, t_q, t_k),
                           label=f"{label}: the baseline")
        if not first.ok:
            return not_run(det, first)
        reference = first.output.out
        per_row = reference.dim() >= 3 and reference.shape[0] == B and reference.shape[s.time_dim] == t_q
        if not per_row:
            return skip(det, f"the output {tuple(reference.shape)} has no row per query and batch element "
                             f"(see output_shape)")
    scale = baseline_scale(reference, centred=True)
    if not scale > 0:
        return skip(det, "the output is zero or non-finite everywhere on this probe, so a change cannot be "
                         "measured against it")
    moved, inputs = [], []
    for start in range(0, len(sets), max(1, per_call // len(gains))):
        chunk = sets[start:start + max(1, per_call // len(gains))]
        xs = [x for where in chunk for x in perturbed(probe, base, where, _streams(probe), gains=gains)]
        n = len(xs)
        Q = torch.cat([x.query for x in xs])
        K = Q if base.one_stream else torch.cat([x.key for x in xs])
        V = K if base.one_stream or base.value is base.key else torch.cat([x.value for x in xs])
        call = probe.call(Q, K, V, probe.allowed(n * B, t_q, t_k), label=label)
        if not call.ok:
            return not_run(det, call)
        for out in call.output.out.chunk(n):
            change = relative_change(out, reference, centred=True, scale=scale)
            moved.append(_fold(change).cpu() > tol)
        inputs += xs
    return moved, tol, inputs, reference


def _confirmed(probe: Probe, base: Inputs, reference: Tensor, ignored: Tensor, pattern) -> Tensor:
    """The allowed (b, i, j) cells whose row did not move, measured again: each suspect key changed alone, with a
    draw of its own pushed both ways. A row that ignores a key it may see ignores it whatever the change; one whose
    change was lost in rounding (d_model 1 in bfloat16, where the output bias swamps a key that only lost its
    weight) moves now. Over-masking is where no draw moved the row."""
    if not bool(ignored.any()):
        return ignored
    B, t_k = ignored.shape[0], ignored.shape[-1]
    suspects = ignored.any(dim=1)  # (B, Tk): keys some row of that sequence ignored
    keys = suspects.any(dim=0).nonzero().flatten().tolist()
    sets = []
    for j in keys:
        where = torch.zeros(B, t_k, dtype=torch.bool)
        where[:, j] = suspects[:, j]
        sets.append(where)
    ran = _run(probe, base, sets, f"the keys no row moved for, each changed alone again, both ways ({pattern})",
               reference, both_ways=True)
    if isinstance(ran, DetectorResult):  # the verdict keeps the first reading
        return ignored
    still, moved = ignored.clone(), ran[0]
    for n, j in enumerate(keys):  # (B, Tq) each: the rows that moved when key j alone was pushed one way, the other
        still[:, :, j] &= ~(moved[2 * n] | moved[2 * n + 1])
    return still


def _mask_mod_disagrees(probe: Probe) -> PatternEvidence | None:
    """A FlexAttention program's own mask_mod against the declared pattern, point by point on the standard
    probe's sizes: the first (b, h, q, kv) where they differ, or None. (The mask_mod is the program's: one that
    raises here raised in the program's own call first, a finding of `runs`.)"""
    base = probe.base()
    if base.record is None or not base.record.flex:
        return None
    for f in base.record.flex:
        if f.mask_mod is None or getattr(f.mask_mod, "__name__", "") == "noop_mask":
            continue
        B, H, t_q, t_k = f.q.shape[0], f.q.shape[1], f.q.shape[-2], f.k.shape[-2]
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        q = torch.arange(t_q).view(1, 1, t_q, 1)  # flex's q_idx: 0..Tq-1, the probe's Tq == Tk
        kv = torch.arange(t_k).view(1, 1, 1, t_k)
        with torch.no_grad():
            program = f.mask_mod(b, h, q, kv).expand(B, H, t_q, t_k).cpu()  # (B, H, Tq, Tk)
        declared = probe.pattern.allowed(B, t_q, t_k, heads=H)  # (B, H, Tq, Tk)
        if declared.dim() == 3:
            declared = declared.unsqueeze(1)
        differ = program != declared
        if bool(differ.any()):
            point = tuple(int(i) for i in differ.nonzero()[0])
            return PatternEvidence(mask_mod=f.mask_mod, point=point, flex_frames=f.frames, allows=bool(program[point]),
                                   differ=(int(differ.sum()), int(differ[0, 0].sum()), t_q * t_k))
    return None


def _bisect(probe: Probe, base: Inputs, reference: Tensor, b: int, i: int,
            keys: Tensor) -> tuple[int | None, Inputs | None]:
    """The one key among `keys` (bool (Tk,), all blocked for row i of sequence b) that moves that row, by halving."""
    B, _, t_k = _sizes(probe, base)
    found, last = None, None
    while int(keys.sum()) > 1:
        idx = keys.nonzero().flatten()
        halves = [idx[: len(idx) // 2], idx[len(idx) // 2:]]
        sets = []
        for half in halves:
            where = torch.zeros(B, t_k, dtype=torch.bool)
            where[b, half] = True
            sets.append(where)
        ran = _run(probe, base, sets, f"bisecting the keys that move query {i} of sequence {b}", reference)
        if isinstance(ran, DetectorResult):
            return None, None
        moved, _, inputs, _ = ran
        hit = next((n for n, m in enumerate(moved) if bool(m[b, i])), None)
        if hit is None:
            return None, None  # the group moved the row and neither half does: keys that leak only together
        keys = torch.zeros(t_k, dtype=torch.bool)
        keys[halves[hit]] = True
        last = inputs[hit]
    if int(keys.sum()) == 1:
        found = int(keys.nonzero()[0])
        if last is None:  # the class held one blocked key already
            return found, None
    return found, last


@dataclass
class Tests:
    """The copies one measurement perturbs: copy c changes, in sequence b, the keys j with j % p == residue[c, b].
    p is the widest row of the pattern + 2, so that a row meets at most one key it may see in each copy, and the
    keys one step outside its band on either side are in copies where it meets none."""

    p: int
    residue: Tensor  # long (copies, B)
    keys: list  # bool (B, Tk) per copy: the keys it perturbs in each sequence
    edges: int  # the pattern's edge pairs (`_edges`) that a copy can read
    edges_read: int  # of them, those the chosen copies read
    every: bool  # every class in every sequence: each (query, key) pair read

    def __str__(self) -> str:
        n, p = len(self.keys), self.p
        chosen = (f"every class r < {p}" if self.every
                  else f"{n} of the {p} classes r per sequence, chosen for the edge pairs they read")
        return (f"{n} copies, each sequence's keys j % {p} == r changed ({chosen}; {self.edges_read} / {self.edges} "
                f"edge pairs read)")


def _edges(declared: Tensor) -> Tensor:
    """Bool (B, Tq, Tk): the pairs at each end of each run of keys a row may see, one step inside and one step
    outside (a window of W: keys q - W and q - W + 1, q and q + 1; a chunk's first key and the one before it), where
    a window one too long or short, a chunk boundary one off, or a misaligned mask first differs."""
    before = torch.cat([declared[..., :1], declared[..., :-1]], dim=-1)  # (B, Tq, Tk): the key to the left
    after = torch.cat([declared[..., 1:], declared[..., -1:]], dim=-1)  # the key to the right
    return (declared != before) | (declared != after)


def _tests(declared: Tensor, budget: int, one_stream: bool) -> Tests:
    """At most `budget` copies: every residue class mod p when there are no more, else `budget` classes per
    sequence, those that read the most edge pairs (`_edges`) not already read at the same (query, key) in an earlier
    sequence, so that sequences of one pattern read different classes. A class reads an edge pair inside the row
    (the row's only allowed key in that class) and one outside it where the row meets no allowed key in the class;
    a one-stream layer's row reads nothing in its own class (its token changes too)."""
    B, t_q, t_k = declared.shape
    lo = torch.where(declared, torch.arange(t_k), t_k).amin(-1)
    hi = torch.where(declared, torch.arange(t_k), -1).amax(-1)
    span = int((hi - lo).clamp_min(0).max()) + 1  # the widest row, in positions
    p = min(t_k, span + 2)
    residue = torch.arange(t_k) % p  # (Tk,)
    meets = torch.zeros(B, t_q, p).index_add_(2, residue, declared.float())  # (B, Tq, p): allowed keys per class
    clean = meets.index_select(2, residue) == 0  # (B, Tq, Tk): the row meets no allowed key in key j's class
    readable = _edges(declared) & (declared | clean)
    if one_stream:  # Tq == Tk: query i is token i
        readable &= residue.view(1, t_q, 1) != residue.view(1, 1, t_k)
    if p <= budget:
        chosen = torch.arange(p).view(p, 1).expand(p, B)
        read = readable
    else:
        chosen = torch.zeros(budget, B, dtype=torch.long)
        read = torch.zeros_like(readable)
        for b in range(B):
            new = readable[b] & ~read.any(0)  # (Tq, Tk)
            # new pairs first; among classes with as many, those with more pairs read at all; then the lower class
            gain = (torch.zeros(p).index_add_(0, residue, new.sum(0).float()) * (t_q * t_k + 1)
                    + torch.zeros(p).index_add_(0, residue, readable[b].sum(0).float()))
            order = sorted(range(p), key=lambda r: (-float(gain[r]), r))
            chosen[:, b] = torch.tensor(order[:budget])
            read[b] = readable[b] & torch.isin(residue, chosen[:, b]).view(1, t_k)
    keys = [residue.view(1, t_k) == chosen[c].view(B, 1) for c in range(chosen.shape[0])]  # (B, Tk) each
    return Tests(p, chosen, keys, int(readable.sum()), int(read.sum()), every=p <= budget)


@dataclass
class Reading:
    """The measured pattern of one probe, per cell of (B, Tq, Tk): seen moving its row (the only key of the row's
    pattern in its copy), not moving, or not measurable."""

    depends: Tensor  # bool (B, Tq, Tk): the row moved in a copy where this was its only allowed key
    ignored: Tensor  # bool (B, Tq, Tk): the row did not move in a copy that perturbed this key
    leaks: list  # (b, i, c): row i of sequence b moved in copy c, where it may see none of the keys perturbed
    unmeasured: Tensor  # bool (B, Tq, Tk): cells no copy could read (a one-stream layer's own class)


def _read(declared: Tensor, tests: Tests, moved: list[Tensor], one_stream: bool) -> Reading:
    B, t_q, t_k = declared.shape
    depends = torch.zeros(B, t_q, t_k, dtype=torch.bool)
    ignored, unmeasured = depends.clone(), depends.clone()
    leaks = []
    for c, (keys, m) in enumerate(zip(tests.keys, moved)):
        # a one-stream layer's perturbed token is also a perturbed query (Tq == Tk), whose own row moves whatever
        # it depends on: those rows read nothing in this copy
        readable = ~keys if one_stream else torch.ones(B, t_q, dtype=torch.bool)  # (B, Tq)
        seen = readable.view(B, t_q, 1) & keys.view(B, 1, t_k)  # (B, Tq, Tk): cells this copy reads
        unmeasured |= ~readable.view(B, t_q, 1) & keys.view(B, 1, t_k)
        allowed_here = (declared & seen).any(-1)  # (B, Tq): the row meets an allowed key (one at most, by p)
        mv = m.view(B, t_q, 1)
        ignored |= seen & ~mv
        depends |= seen & declared & mv
        leaking = m & ~allowed_here & readable  # (B, Tq): moved, may see none of them
        leaks += [(b, i, c) for b, i in leaking.nonzero().tolist()]
    unmeasured &= ~(depends | ignored)
    return Reading(depends, ignored, leaks, unmeasured)


def _cells(mask: Tensor, offset: int = 0, limit: int = 3) -> str:
    """A few (b, q, kv) cells of a bool (B, Tq, Tk) mask, in order; queries at their positions (index + offset)."""
    shown = [f"query {i + offset} -> key {j} in sequence {b}" for b, i, j in mask.nonzero()[:limit].tolist()]
    return "; ".join(shown) + (" ..." if int(mask.sum()) > limit else "")


def mask_mod_site(mask_mod, frames: tuple, note: str) -> list[Site]:
    """The line of a FlexAttention program's mask_mod (its `return`, or the lambda), and the flex_attention call."""
    sites = []
    fn = getattr(mask_mod, "mask_mod", mask_mod)  # a diagnostics Pattern passed as the mask_mod
    try:
        lines, first = inspect.getsourcelines(fn)
        file = inspect.getsourcefile(fn) or ""
        offset = next((n for n, line in enumerate(lines) if "return" in line or "lambda" in line), 0)
        line = first + offset
        sites.append(Site(file, line, getattr(fn, "__qualname__", getattr(fn, "__name__", "mask_mod")), text(file, line),
                          "mask_mod", note))
    except (OSError, TypeError):  # built in, or defined where no source is kept
        pass
    call = site(frames, "flex_attention", "the FlexAttention call that uses this mask_mod")
    return sites + ([call] if call is not None else [])


def pattern_sites(probe, result: DetectorResult) -> list[Site]:
    """Replays the evidence (`result.replay`): a mask_mod that disagrees with the pattern is its own line; a leak
    is the masking ops of the baseline call against the pattern, else the first op whose output moves at the
    held rows in the very copy where they moved; over-masking is the masking op that blocks an allowed key."""
    ev = result.replay
    if not isinstance(ev, PatternEvidence):
        return []
    if ev.mask_mod is not None:
        b, h, q, kv = ev.point
        return mask_mod_site(ev.mask_mod, ev.flex_frames, f"mask_mod(b={b}, h={h}, q_idx={q}, kv_idx={kv}) "
                                                           f"differs from the declared {probe.pattern}")
    s, base = probe.subject, ev.base
    B, t_q, t_k = _sizes(probe, base)
    allowed = probe.allowed(B, t_q, t_k)
    a = trace_call(s, base.query, base.key, base.value, allowed, seed=probe.seed)
    sites = [replace(x, fix=ev.fix) if ev.fix else x
             for x in mask_sites(a, _declared(probe, B, t_q, t_k), B, t_q, t_k)]
    if sites or ev.case is None:
        return sites
    c = trace_call(s, ev.case.query, ev.case.key, ev.case.value, allowed, seed=probe.seed)
    op = first_moved(a, c, ev.hold & ~ev.moved if base.one_stream else ev.hold, ev.tol)  # held, not perturbed
    return [op_site(op, "the first op whose output at rows the pattern holds moves when only keys it blocks "
                        "changed")] if op is not None else []


def dependency_map(probe: Probe, base: Inputs, reference: Tensor, declared: Tensor, cell: tuple[int, int, int],
                   label: str, how: str) -> DependencyMap | None:
    """The finding's picture: sequence b's rows and keys around `cell` (b, i, j), at most PICTURE_CELLS of each, each
    key perturbed alone (one copy of the probe batch per key, stacked as the tests are) and the rows that move read.
    None where a call fails: the verdict stands without its picture."""
    b, i, j = cell
    B, t_q, t_k = declared.shape
    n_q, n_k = min(t_q, PICTURE_CELLS), min(t_k, PICTURE_CELLS)
    q0, k0 = min(max(i - n_q // 2, 0), t_q - n_q), min(max(j - n_k // 2, 0), t_k - n_k)
    sets = []
    for key in range(k0, k0 + n_k):
        where = torch.zeros(B, t_k, dtype=torch.bool)
        where[b, key] = True
        sets.append(where)
    ran = _run(probe, base, sets, label, reference)
    if isinstance(ran, DetectorResult):
        return None
    moved = torch.stack([m[b, q0:q0 + n_q] for m in ran[0]], dim=-1)  # (rows, keys): row i moved when key j changed
    offset = t_k - t_q  # the queries are the last Tq positions
    rows, keys = torch.arange(q0, q0 + n_q).view(n_q, 1) + offset, torch.arange(k0, k0 + n_k).view(1, n_k)
    # a one-stream layer's token is its query too: its own row moves whatever the key does
    measurable = (rows != keys) if base.one_stream else torch.ones(n_q, n_k, dtype=torch.bool)
    return DependencyMap(pattern=str(probe.pattern), sequence=b, t=t_k, q0=q0 + offset, k0=k0,
                         declared=declared[b, q0:q0 + n_q, k0:k0 + n_k].clone(), moved=moved & measurable,
                         measurable=measurable, how=how)


def pattern_fix(pattern, leak: tuple[int, int, int] | None, over: tuple[int, int, int] | None, offset: int = 0) -> str:
    """The fix of a mask that differs from the declared pattern: what it lets through or blocks (queries at their
    positions, index + `offset`), and the pattern's own rule to build it from."""
    said = []
    if leak is not None:
        said.append(f"lets query {leak[1] + offset} see key {leak[2]} ({pattern} blocks it)")
    if over is not None:
        said.append(f"blocks query {over[1] + offset} from key {over[2]} ({pattern} allows it)")
    rule = (f"allowed = {pattern.rule} (q_idx, kv_idx: absolute positions)" if pattern.rule is not None
            else f"allowed = the declared mask_mod {pattern.name}(b, h, q_idx, kv_idx)")
    return (f"the mask built here {' and '.join(said)}: build it as {pattern} states it, {rule}, or pass the "
            f"pattern itself as FlexAttention's mask_mod")


@detector("attention_pattern", "for a declared pattern, each output row depends on exactly the keys the pattern "
          "allows (leakage where it blocks, over-masking where it allows), measured by perturbing keys; for a causal "
          "layer also while decoding (the last T // 3 queries over all T keys)",
          targets=("sliding window one too long or too short", "window applied on both sides",
                   "chunk boundary one off", "documents leaking into each other", "causal prefix",
                   "window dropped once a cache holds keys", "FlexAttention mask_mod not the pattern meant"),
          fix="build the mask from the declared pattern: mask = pattern.allowed(B, Tq, Tk) (or pass the pattern "
              "itself as FlexAttention's mask_mod)",
          needs=(PATTERN, LONG), locate=pattern_sites)
def check_attention_pattern(probe: Probe) -> DetectorResult:
    det, s, B, T = "attention_pattern", probe.subject, probe.BATCH, probe.t
    flex = _mask_mod_disagrees(probe)
    full = _measure(probe, Inputs(*probe.streams(B, T, cross=s.separate_kv)), "", MAX_COPIES)
    if isinstance(full, DetectorResult) or full.failed or flex is not None or not (probe.causal and s.separate_kv):
        return _verdict(probe, full, flex)
    # a decoder: the pattern holds while decoding too, the last Tq positions querying all T keys (a cache of T - Tq)
    t_q = max(1, T // DECODE_SHARE)
    q, k, v = probe.streams(B, T, cross=True)
    decoding = _measure(probe, Inputs(q.narrow(s.time_dim, T - t_q, t_q).contiguous(), k, v, None),
                        f" when the last {t_q} of {T} positions query all {T} keys "
                        f"(decoding with a cache of {T - t_q})", DECODE_COPIES)
    if isinstance(decoding, DetectorResult) or not decoding.failed:  # the full pass's verdict, with both measured
        return _verdict(probe, full, None, also=decoding if not isinstance(decoding, DetectorResult) else None)
    return _verdict(probe, decoding, None, also=full)


@dataclass
class Measured:
    """One measurement of the dependency pattern (the full pass, or decoding): what `_verdict` words and returns."""

    when: str  # "" for the full pass, else the decoding shape in words
    leak_text: str
    over_text: str
    measured: str  # what was measured, for the evidence
    value: float
    evidence: PatternEvidence
    picture: DependencyMap | None

    @property
    def failed(self) -> bool:
        return bool(self.leak_text or self.over_text)


def _measure(probe: Probe, base: Inputs, when: str, budget: int) -> Measured | DetectorResult:
    """The dependency pattern of `base`'s queries over its keys in at most `budget` copies (`_tests`), judged
    against the declared pattern: leaks bisected to their key, over-masking confirmed, the first finding's picture
    measured key by key."""
    det, s, pattern = "attention_pattern", probe.subject, probe.pattern
    B, t_q, t_k = _sizes(probe, base)
    one = base.one_stream
    declared = _declared(probe, B, t_q, t_k)
    tests = _tests(declared, budget, one)
    p = tests.p
    ran = _run(probe, base, tests.keys, f"keys j % {p} == r changed, one class r per copy and sequence "
                                        f"({pattern}){when}")
    if isinstance(ran, DetectorResult):
        return ran
    moved, tol, inputs, reference = ran
    if not any(bool(m.any()) for m in moved):
        return skip(det, f"the output did not respond to any key{when}, so its not moving where the pattern blocks "
                         f"proves nothing")
    reading = _read(declared, tests, moved, one)
    over = _confirmed(probe, base, reference, declared & reading.ignored, pattern)
    dt, offset = dtype_name(s.dtype), t_k - t_q  # query i is at position i + offset
    # a leak: bisect the first leaking test down to the one key that moves the row
    leak_text, ev, leak_cell, over_cell = "", PatternEvidence(base=base, tol=tol), None, None
    if reading.leaks:
        b, i, c = reading.leaks[0]
        blocked = tests.keys[c][b] & ~declared[b, i]
        key, case = _bisect(probe, base, reference, b, i, blocked)
        hold = torch.zeros(B, t_q, dtype=torch.bool)
        if case is None:
            case = inputs[c]
            sets = tests.keys[c]
            # rows of the copy that meet no allowed key (their perturbed keys all blocked), and are not perturbed
            meets = (declared & sets.view(B, 1, t_k)).any(-1)
            hold = ~meets & ~(sets if one else torch.zeros(B, t_q, dtype=torch.bool))
            moved_at = sets.clone()
        else:
            hold[b] = ~declared[b, :, key]
            if one:
                hold[b, key] = False
            moved_at = torch.zeros(B, t_k, dtype=torch.bool)
            moved_at[b, key] = True
        ev = PatternEvidence(base=base, case=case, hold=hold, moved=moved_at, tol=tol)
        rows = len({(b2, i2) for b2, i2, _ in reading.leaks})
        where = f"key {key}" if key is not None else f"keys j % {p} == {int(tests.residue[c, b])}"
        leak_cell = (b, i, key if key is not None else int(blocked.nonzero()[0]))
        leak_text = (f"query {i + offset} of sequence {b} moved when only {where} changed, which {pattern} blocks for "
                     f"it; {rows} / {B * t_q} rows seen depending on keys the pattern blocks (more than {tol:.2g} of "
                     f"the outputs' RMS about their mean, for {dt})")
    over_text = ""
    if bool(over.any()):
        b, i, j = (int(x) for x in over.nonzero()[0])
        over_cell = (b, i, j)
        over_text = (f"{int(over.sum())} / {int(declared.sum())} (query, key) pairs that {pattern} allows move no "
                     f"output, e.g. {_cells(over, offset)} (the row moved by at most {tol:.2g} of the outputs' RMS "
                     f"about their mean, {dt}, the key pushed both ways)")
    alone, blocked_zero = int((declared & reading.depends).sum()), int((~declared & reading.ignored).sum())
    unmeasured = int(reading.unmeasured.sum())
    shape = f"{B} sequences of {t_k}" if t_q == t_k else f"{B} sequences, the last {t_q} of {t_k} positions querying"
    measured = (f"{tests} on {shape}: {alone} / {int(declared.sum())} allowed pairs seen moving their row, "
                f"{int(over.sum())} not moving; {blocked_zero} / {int((~declared).sum())} blocked pairs measured "
                f"unmoved" + (f"; {unmeasured} pairs not measurable (a one-stream layer's own position moves with "
                              f"its query)" if unmeasured else ""))
    ev.fix = pattern_fix(pattern, leak_cell, over_cell, offset) if leak_cell or over_cell else ""
    first = leak_cell or over_cell
    picture = None
    if first is not None:  # a finding: its picture, measured key by key around its first cell
        how = f"each key of sequence {first[0]} changed alone" + (
            f"; the last {t_q} of {t_k} positions querying, as in decoding" if t_q != t_k else "")
        picture = dependency_map(probe, base, reference, declared, first,
                                 f"each key changed alone, for the picture of the finding ({pattern}){when}", how)
    return Measured(when, leak_text, over_text, measured, float(len(reading.leaks) + int(over.sum())), ev, picture)


def _verdict(probe: Probe, m: Measured | DetectorResult, flex: PatternEvidence | None, *,
             also: Measured | None = None) -> DetectorResult:
    """The result: a FlexAttention mask_mod that disagrees with the pattern first, else the measurement's leakage
    and over-masking, else a pass that says what was measured (`also`: the other measurement, named in the
    evidence)."""
    det, pattern = "attention_pattern", probe.pattern
    if isinstance(m, DetectorResult) and flex is None:
        return m
    measured = m if isinstance(m, Measured) else None
    told = "; ".join(x.measured for x in (measured, also) if x is not None)
    if flex is not None:
        b, h, q, kv = flex.point
        n, first_head, total = flex.differ
        program = flex.allows
        flex.base = measured.evidence.base if measured is not None else None
        found = "; ".join(x for x in (measured.leak_text, measured.over_text) if x) if measured is not None else ""
        return result(det, "fail", f"the FlexAttention program's mask_mod differs from the declared {pattern}",
                      value=float(n), threshold=0.0,
                      evidence=f"first at (b={b}, h={h}, q_idx={q}, kv_idx={kv}): the mask_mod "
                               f"{'allows' if program else 'blocks'} it, the pattern "
                               f"{'blocks' if program else 'allows'} it; {first_head} / {total} points differ in "
                               f"(b=0, h=0), {n} in all; measured: " + "; ".join(x for x in (found, told) if x),
                      fix=f"make the mask_mod return exactly the declared pattern (or pass the pattern itself as "
                          f"the mask_mod: create_block_mask({pattern.name}, ...))", replay=flex,
                      extras=_picture(measured))
    if measured.failed:
        both = measured.leak_text and measured.over_text
        message = ("outputs depend on keys the declared pattern blocks (leakage) and ignore keys it allows "
                   "(over-masking)" if both else
                   "outputs depend on keys the declared pattern blocks (leakage)" if measured.leak_text else
                   "outputs ignore keys the declared pattern allows (over-masking)")
        return result(det, "fail", f"{message}: {pattern}{measured.when}", value=measured.value, threshold=0.0,
                      evidence="; ".join(x for x in (measured.leak_text, measured.over_text, told) if x),
                      replay=measured.evidence, extras=_picture(measured))
    decoded = " (and while decoding)" if also is not None else ""
    return result(det, "pass", f"every output row depends on exactly the keys {pattern} allows{decoded}", value=0.0,
                  threshold=0.0, evidence=told)


def _picture(m: Measured | None) -> dict:
    return {"dependency_map": m.picture} if m is not None and m.picture is not None else {}
