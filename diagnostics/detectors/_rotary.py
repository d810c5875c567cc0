"""Where a rotary embedding's pairs disagree: the localiser `relative_positions` tries first on a traced call.

A rotary embedding turns q and k as `x * cos + partner(x) * sin`, where `partner` takes each feature i to the feature
its cos/sin table pairs it with (the table repeats each frequency twice: interleaved, (2m, 2m + 1), or in halves,
(m, m + d/2)) with the sign that makes the pair turn (one of the two negated). It is a rotation, and q·k depends on
j - i only, where both agree with the table's pairs, and any factor both halves multiply in besides (xPos's decay) is
the same for both features of a pair. Two released bugs break exactly that, and the shift's first moving op (the
product of q and k, the `cat` that assembles the rotated features) is lines away from the line that made the wrong
value:

- `partner` pairs other features than the table (rotary-embedding-torch 0.0.11: the interleaved pairs taken apart
  and joined again as halves, `torch.cat((-x2, x1))`), or takes a pair with one sign: the op that made `partner(x)`
  is the site;
- a factor differs inside a pair (rotary-embedding-torch 0.7.0: xPos's scale laid out in halves,
  `torch.cat((scale, scale))`, while the table is interleaved): the op that made the factor is the site.

Read from the traced values alone, no names: the table's pairs from the columns of the cos table as multiplied in
that are equal at every position, x as the tensor below the cos factor that the sin branch's tensor is a signed
permutation of, columns matched by a fingerprint (N x d work) and confirmed exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._result import Site
from .._tracing import Op, Trace, op_site, producer, through_carries

PAIR_FIX = ("make the rotation's partner features the pairs of the cos/sin table: interleaved (2m, 2m+1), the table "
            "freqs.repeat_interleave(2), with x.unflatten(-1, (-1, 2)) turned to (-x2, x1) and flattened back; or "
            "half-split (m, m + d/2), the table torch.cat([freqs, freqs]), with torch.cat((-x[..., d/2:], "
            "x[..., :d/2]), -1)")
FACTOR_FIX = ("lay out a factor applied to the rotated features (xPos's scale) as the cos/sin table is laid out, "
              "the same for both features of a pair: repeat_interleave(2) for an interleaved table, torch.cat([s, s]) "
              "for a half-split one")


def pairs_of(table: Tensor) -> list[int] | None:
    """For a cos table (..., d) whose entries come in pairs equal at every position: partner[i], the other feature of
    i's pair; None where the features do not pair up one to one (a frequency used more than twice, a constant)."""
    if table.dim() < 1 or table.shape[-1] < 2 or table.shape[-1] % 2:
        return None
    cols = table.reshape(-1, table.shape[-1])
    return _match_columns(cols, cols, exclude_self=True)


def _match_columns(a: Tensor, b: Tensor, exclude_self: bool = False) -> list[int] | None:
    """For each column i of `a` (N, d), the one column j of `b` (N, d) equal to it at every row (j != i where
    `exclude_self`); None where a column has none or several. Candidates by a fingerprint (each column's product with
    one random vector: N x d work, never N x d x d), each confirmed exactly."""
    if a.shape != b.shape or a.dim() != 2 or a.shape[0] < 2:
        return None
    g = torch.randn(a.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(a.device)
    fa, fb = g @ a.double(), g @ b.double()
    found = []
    for i in range(a.shape[1]):
        near = torch.nonzero(torch.isclose(fb, fa[i], rtol=1e-9, atol=1e-300)).flatten().tolist()
        hits = [j for j in near if not (exclude_self and j == i) and torch.equal(a[:, i], b[:, j])]
        if len(hits) != 1:
            return None
        found.append(hits[0])
    return found


def _made(trace: Trace, tensor_id: int) -> Op | None:
    return through_carries(trace, producer(trace, tensor_id))


def _reaches(trace: Trace, tensor_id: int, name: str, depth: int = 12) -> Op | None:
    """The `name` op (cos, sin) a tensor was made from through views, casts and other ops of one input (a
    `freqs.cos()` cast and sliced), else None."""
    op = producer(trace, tensor_id)
    for _ in range(depth):
        if op is None:
            return None
        if op.short == name:
            return op
        if not op.in_ids:
            return None
        op = producer(trace, op.in_ids[0])
    return None


def _chain(trace: Trace, tensor_id: int, depth: int = 8) -> list[tuple[int, list[int]]]:
    """A product of a sourced tensor (q or k on their way) by tensors of no input (tables, scales), unwound one
    factor at a time: [(a sourced tensor's id, [the ids of the factors multiplied in above it])], outermost first."""
    chain, factors = [(tensor_id, [])], []
    for _ in range(depth):
        op = _made(trace, tensor_id)
        if op is not None and op.short == "mul" and len(op.in_ids) == 1:  # by a number (`* 1`, `* scale`)
            tensor_id = op.in_ids[0]
            chain.append((tensor_id, list(factors)))
            continue
        if op is None or op.short != "mul" or len(op.in_ids) != 2:
            break
        a, b = op.in_ids
        sa, sb = trace.sources.get(a), trace.sources.get(b)
        if sa and not sb:
            tensor_id, factor = a, b
        elif sb and not sa:
            tensor_id, factor = b, a
        else:
            break
        factors.append(factor)
        chain.append((tensor_id, list(factors)))
    return chain


def _branch(trace: Trace, chain: list, name: str):
    """(the factor of `chain` made by a `name` op, [the entries of the chain below it]); None where none is."""
    for depth, (_, factors) in enumerate(chain):
        hit = next((f for f in factors if _reaches(trace, f, name) is not None), None)
        if hit is not None:
            return hit, chain[depth:]
    return None


def _tensor(trace: Trace, tensor_id: int) -> Tensor | None:
    """The value of a tensor the trace recorded: the output of the op that made it."""
    op = producer(trace, tensor_id)
    if op is None:
        return None
    for out_id, out in zip(op.out_ids, op.outs):
        if out_id == tensor_id and isinstance(out, Tensor):
            return out
    return None


def _signed_permutation(x: Tensor, y: Tensor) -> tuple[list[int], list[float]] | None:
    """(pi, signs) with y[..., i] = signs[i] * x[..., pi[i]] everywhere (each feature of y one of x's, signed),
    else None."""
    if x.shape != y.shape or x.dim() < 1 or x.shape[-1] < 2:
        return None
    d = x.shape[-1]
    xs, ys = x.reshape(-1, d), y.reshape(-1, d)
    if not bool(xs.abs().sum() > 0):
        return None
    pi = _match_columns(ys.abs(), xs.abs())
    if pi is None:
        return None
    return pi, (ys * xs[:, pi]).double().sum(0).sign().tolist()


def _describe(pairs: list[int], limit: int = 3) -> str:
    shown = [f"({i}, {j})" for i, j in enumerate(pairs) if i < j][:limit]
    return ", ".join(shown) + (", ..." if len(pairs) > 2 * limit else "")


def rotary_pair_sites(trace: Trace) -> list[Site]:
    """The op that made a rotation partner pairing other features than the cos/sin table (or turning a pair without
    the minus sign), or a factor both halves of the rotation share that differs inside a pair; [] where every
    rotation found agrees with its table (or none is found)."""
    sites, seen = [], set()
    for op in trace.ops:
        if op.short not in ("add", "sub") or len(op.in_ids) != 2:
            continue
        chains = [_chain(trace, i) for i in op.in_ids]
        found = None
        for a, b in (chains, chains[::-1]):  # x * cos + partner(x) * sin, in that order or the other
            cos, sin = _branch(trace, a, "cos"), _branch(trace, b, "sin")
            if cos is not None and sin is not None:
                found = cos, sin
                break
        if found is None:
            continue
        (cos_factor, below_cos), (sin_factor, below_sin) = found
        table = _tensor(trace, cos_factor)  # the table as it is multiplied in: T rows, laid out as used
        pairs = pairs_of(table) if table is not None else None
        if pairs is None:
            continue
        # x: the tensor below the cos factor that the sin branch's tensor is a signed permutation of (QK-norm's
        # weight multiplied in before the rotation is below it, never one of its factors)
        match = next(((x_id, y_id, xf, yf, got) for x_id, xf in below_cos for y_id, yf in below_sin
                      if (x := _tensor(trace, x_id)) is not None and (y := _tensor(trace, y_id)) is not None
                      and x.shape[-1] == len(pairs) and (got := _signed_permutation(x, y)) is not None), None)
        if match is None:
            continue
        _, y_id, x_factors, y_factors, (pi, signs) = match
        made = _made(trace, y_id)
        if made is not None and id(made) not in seen:
            wrong = {i: j for i, j in enumerate(pi) if j != pairs[i]}
            unsigned = not wrong and any(signs[i] == signs[pairs[i]] for i in range(len(pairs)))
            if wrong or unsigned:
                seen.add(id(made))
                what = (f"feature i is turned with feature {_pi_text(pi, wrong)}, while the cos/sin table pairs "
                        f"{_describe(pairs)}" if wrong else
                        f"both features of a pair of the cos/sin table ({_describe(pairs)}) are taken with the same "
                        f"sign, so the pair is not turned (partner(x) needs one of them negated)")
                sites.append(op_site(made, f"makes the rotation's partner features ({made.short}): {what}: not a "
                                           f"rotation, so q·k depends on absolute positions", fix=PAIR_FIX))
        shared = [f for f in x_factors if f in y_factors and f not in (cos_factor, sin_factor)]
        for f in shared:  # a factor both halves take (xPos's decay) must be the same for both features of a pair
            value, made = _tensor(trace, f), _made(trace, f)
            if value is None or made is None or value.dim() == 0 or value.shape[-1] != len(pairs) or \
                    not _unpaired(value, pairs):
                continue
            made = _earliest_unpaired(trace, made, pairs)  # `scale ** -1` for k: back to the op that laid it out
            if id(made) not in seen:
                seen.add(id(made))
                sites.append(op_site(made, f"makes a factor of the rotated features ({made.short}) that differs "
                                           f"between the two features of a pair of the cos/sin table "
                                           f"({_describe(pairs)}): each pair is no longer turned and scaled as one, "
                                           f"so q·k depends on absolute positions", fix=FACTOR_FIX))
    return [s for s in sites if s is not None]


def _unpaired(value: Tensor, pairs: list[int]) -> bool:
    """Whether `value` (..., d) differs between the two features of a pair somewhere."""
    inside = value.index_select(-1, torch.tensor(pairs, device=value.device))
    return not torch.equal(inside, value)


def _earliest_unpaired(trace: Trace, op: Op, pairs: list[int], depth: int = 8) -> Op:
    """Back from `op` through ops of one tensor input of the same width that is unpaired too (a power, a
    reciprocal, a cast of the factor) to the op that first made it so: the line that laid the factor out."""
    for _ in range(depth):
        ins = [i for i in op.in_ids if (v := _tensor(trace, i)) is not None and v.dim() and v.shape[-1] == len(pairs)]
        if len(ins) != 1 or not _unpaired(_tensor(trace, ins[0]), pairs):
            return op
        before = _made(trace, ins[0])
        if before is None:
            return op
        op = before
    return op


def _pi_text(pi: list[int], wrong: dict) -> str:
    shown = [f"{i} -> {j}" for i, j in list(wrong.items())[:3]]
    return "pi(i) (" + ", ".join(shown) + (", ..." if len(wrong) > 3 else "") + ")"
