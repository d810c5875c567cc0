"""Where a rotary embedding's pairs disagree: the localiser `relative_positions` tries first on a traced call.

A rotary embedding turns q and k as `x * cos + partner(x) * sin`, where `partner` takes each feature i to the feature
its cos/sin table pairs it with (the table repeats each frequency twice: interleaved, (2m, 2m + 1), or in halves,
(m, m + d/2)) with the sign that makes the pair turn. It is a rotation, and q·k depends on j - i only, where both agree
with the table's pairs, and any factor multiplied in besides (xPos's decay) is the same for both features of a pair.
Two released bugs break exactly that, and the shift's first moving op (the product of q and k, the `cat` that
assembles the rotated features) is lines away from the line that made the wrong value:

- `partner` pairs other features than the table (rotary-embedding-torch 0.0.11: the interleaved pairs taken apart
  and joined again as halves, `torch.cat((-x2, x1))`): the op that made `partner(x)` is the site;
- a factor differs inside a pair (rotary-embedding-torch 0.7.0: xPos's scale laid out in halves,
  `torch.cat((scale, scale))`, while the table is interleaved): the op that made the factor is the site.

Read from the traced values alone: the table's pairs from the entries of a cos output equal at every position, the
partner as a signed permutation of x's features found in the values, no names read.
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
    d = table.shape[-1]
    if d < 2 or d % 2:
        return None
    return _one_each(_equal_columns(table.reshape(-1, d), table.reshape(-1, d)), exclude_self=True)


def _equal_columns(a: Tensor, b: Tensor) -> Tensor:
    """(d, d) bool: column i of `a` equals column j of `b` at every row."""
    return (a.double()[:, :, None] == b.double()[:, None, :]).all(0)


def _one_each(equal: Tensor, exclude_self: bool = False) -> list[int] | None:
    """For each row of a (d, d) bool, the one column it is True at; None where a row has none or several."""
    if exclude_self:
        equal = equal & ~torch.eye(equal.shape[0], dtype=torch.bool, device=equal.device)
    if not bool((equal.sum(1) == 1).all()):
        return None
    return equal.float().argmax(1).tolist()


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


def _factors(trace: Trace, tensor_id: int, depth: int = 6):
    """A product of a sourced tensor (q or k on their way) by tensors of no input (tables, scales), unwound:
    (the sourced tensor's id, [the ids of the factors]); None where it is no such product."""
    factors = []
    for _ in range(depth):
        op = _made(trace, tensor_id)
        if op is not None and op.short == "mul" and len(op.in_ids) == 1:  # by a number (`* 1`, `* scale`)
            tensor_id = op.in_ids[0]
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
    return (tensor_id, factors) if factors else None


def _tensor(trace: Trace, tensor_id: int) -> Tensor | None:
    """The value of a tensor the trace recorded: the output of the op that made it."""
    op = producer(trace, tensor_id)
    if op is None:
        return None
    for out_id, out in zip(op.out_ids, op.outs):
        if out_id == tensor_id and isinstance(out, Tensor):
            return out
    return None


def _signed_permutation(x: Tensor, y: Tensor) -> list[int] | None:
    """pi with y[..., i] = +-x[..., pi[i]] everywhere (each feature of y one of x's, signed), else None."""
    if x.shape != y.shape or x.shape[-1] < 2:
        return None
    d = x.shape[-1]
    xs, ys = x.reshape(-1, d).abs(), y.reshape(-1, d).abs()
    if xs.shape[0] < 2 or not bool(xs.sum() > 0):
        return None
    return _one_each(_equal_columns(ys, xs))


def _describe(pairs: list[int], limit: int = 3) -> str:
    shown = [f"({i}, {j})" for i, j in enumerate(pairs) if i < j][:limit]
    return ", ".join(shown) + (", ..." if len(pairs) > 2 * limit else "")


def rotary_pair_sites(trace: Trace) -> list[Site]:
    """The op that made a rotation partner pairing other features than the cos/sin table, or a factor on the rotated
    features that differs inside a pair; [] where every rotation found agrees with its table (or none is found)."""
    sites, seen = [], set()
    for op in trace.ops:
        if op.short not in ("add", "sub") or len(op.in_ids) != 2:
            continue
        parts = [_factors(trace, i) for i in op.in_ids]
        if None in parts:
            continue
        (xa, fa), (xb, fb) = parts
        cos_a = next((c for c in (_reaches(trace, f, "cos") for f in fa) if c is not None), None)
        sin_b = next((s for s in (_reaches(trace, f, "sin") for f in fb) if s is not None), None)
        if cos_a is None or sin_b is None:  # x * cos + partner(x) * sin, in that order or the other
            cos_a, sin_b = (next((c for c in (_reaches(trace, f, "cos") for f in fb) if c is not None), None),
                            next((s for s in (_reaches(trace, f, "sin") for f in fa) if s is not None), None))
            (xa, fa), (xb, fb) = (xb, fb), (xa, fa)
        if cos_a is None or sin_b is None or not cos_a.outs or not isinstance(cos_a.outs[0], Tensor):
            continue
        pairs = pairs_of(cos_a.outs[0])
        x, y = _tensor(trace, xa), _tensor(trace, xb)
        if pairs is None or x is None or y is None or x.shape[-1] != len(pairs):
            continue
        pi = _signed_permutation(x, y)
        made = _made(trace, xb)
        if pi is not None and pi != pairs and made is not None and id(made) not in seen:
            seen.add(id(made))
            wrong = {i: j for i, j in enumerate(pi) if j != pairs[i]}
            sites.append(op_site(made, f"makes the rotation's partner features ({made.short}): feature i is turned "
                                       f"with feature {_pi_text(pi, wrong)}, while the cos/sin table pairs "
                                       f"{_describe(pairs)}: not a rotation, so q·k depends on absolute positions",
                                 fix=PAIR_FIX))
        for f in fa + fb:
            if _reaches(trace, f, "cos") is not None or _reaches(trace, f, "sin") is not None:
                continue
            value, made = _tensor(trace, f), _made(trace, f)
            if value is None or made is None or id(made) in seen or value.dim() == 0 or \
                    value.shape[-1] != len(pairs):
                continue
            if not _unpaired(value, pairs):
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
