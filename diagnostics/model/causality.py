"""prefix_causality: for a causal model, changing tokens after t leaves every output at and before t unchanged.

One batched forward: the example, and copies of it with every token after a cut replaced (cuts 0, T // 2 and
T - 2). The attention modules and the blocks that hold them are tapped: the first of them (in the order they
returned) whose past outputs moved is where the leak starts; a block that moved while its attention did not
leaks outside attention (a norm over time, an MLP mixing positions).
"""

from __future__ import annotations

import torch

from .._registry import detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ._context import CAUSAL_MODEL, SEQUENCE, ModelContext
from ._taps import NO_POSITIONS, LayerTap, blocks, moved, per_position

ID = "prefix_causality"
FIX = ("build the causal mask for every attention layer (and for every path: padding, cached and uncached), "
       "aligned bottom-right")


@detector(ID, "for a causal model, changing tokens after t leaves every output at and before t unchanged; the "
              "first layer a future change reaches is reported", fix=FIX, needs=(CAUSAL_MODEL, SEQUENCE),
          scope="model",
          unlocated="names the first attention layer (or block) a future change reaches (its `layer`), whose own "
                    "in-place audit points at the line")
def check_prefix_causality(ctx: ModelContext) -> DetectorResult:
    runner = ctx.runner
    seq = runner.inputs[:1]
    T = seq.shape[1]
    cuts = sorted({0, T // 2, T - 2})
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    other = runner.other_tokens(seq, gen)
    rows = [seq]
    for c in cuts:
        row = seq.clone()
        row[:, c + 1:] = other[:, c + 1:]
        rows.append(row)
    batch = torch.cat(rows)  # (1 + cuts, T)
    held = blocks(ctx.model, ctx.modules)  # a leak outside attention (an MLP, a norm over time) shows there
    with LayerTap({**ctx.modules, **held}, ctx.time_dims, ctx.model) as taps:
        out, _ = runner(batch)
    if not per_position(out, T):
        return DetectorResult(ID, "skip", NO_POSITIONS.format(shape=tuple(out.shape)))
    base, tol = out[:1], tolerance(UNCHANGED, ctx.dtype)
    worst, where, moved_own = 0.0, None, True
    bad = total = 0
    for i, c in enumerate(cuts, start=1):
        change = moved(out[i:i + 1], base)[0]  # (T,)
        past = change[:c + 1]
        total += c + 1
        bad += int((past > tol).sum())
        if float(past.max()) > worst:
            worst, where = float(past.max()), (c, int(past.argmax()))
        moved_own = moved_own and bool((change[c + 1:] > tol).any())
    # per layer: how many past positions a change after the middle cut reaches; the first module to return a
    # moved past position (attention modules and their blocks, in the order they finished) is where it starts
    c = cuts[len(cuts) // 2]
    first, reach, block_reach = None, {}, {}
    for p, r in taps.calls():  # a looped layer's cycles each in their place (its first cycle's reach is shown)
        layer_out = taps.joined(p, r)
        if layer_out is None or layer_out.shape[0] != batch.shape[0] or layer_out.shape[1] != T:
            continue
        ref = layer_out[:1]
        ch = moved(layer_out[cuts.index(c) + 1:cuts.index(c) + 2], ref)[0]  # (T,)
        (block_reach if p in held else reach).setdefault(p, int((ch[:c + 1] > tol).sum()))
        for j, cj in enumerate(cuts, start=1):
            if first is None and bool((moved(layer_out[j:j + 1], ref)[0][:cj + 1] > tol).any()):
                first = p
    ctx.readings["prefix_reach"] = {"cut": c, "positions": c + 1, "reach": reach, "blocks": block_reach}
    if bad:
        where_text = ""
        if first in held:
            where_text = (f"; the change first appears at the output of {first}, whose attention "
                          f"({', '.join(held[first].attention)}) did not move: the leak is outside attention")
        elif first:
            where_text = f"; the change first appears at {first}"
        return DetectorResult(ID, "fail", "outputs see the future: changing tokens after t moves outputs at or "
                                          "before t" + where_text, value=worst, threshold=tol, fix=FIX, layer=first,
                              evidence=f"{bad} / {total} past outputs changed; greatest change {worst:.3g} of the "
                                       f"outputs' RMS at t={where[1]} when only t>{where[0]} was changed (up to "
                                       f"{tol:.0e} allowed for {dtype_name(ctx.dtype)}); past positions reached per "
                                       f"layer (cut {c}): " + ", ".join(f"{p}: {n}/{c + 1}" for p, n in reach.items()))
    if not moved_own:
        return DetectorResult(ID, "skip", "not measured: changing the later tokens did not move the later outputs")
    return DetectorResult(ID, "pass", f"no output moves when later tokens change (cuts {', '.join(map(str, cuts))})",
                          value=worst, threshold=tol)
