"""packed_documents: documents packed into one sequence, their position ids restarting at each document's start,
do not see each other: changing one document's tokens moves its own outputs and no other document's.

One batched forward of the packed example (three documents, position ids 0.. per document, no attention mask, as
packed training passes them) and of copies with one document's tokens replaced. The attention modules are tapped:
the first (in the order they returned) whose outputs in another document moved is where the leak is seen. Where
documents do see each other, the same forward is replayed with every module watched (`leak_source`): the first
module to return whose outputs crossed while its inputs had not is where the leak starts. A leak that starts in a
module running no softmax over (Tq, Tk) scores or fused attention (a state-space scan, linear attention, a
convolution over the sequence: mixers that do not restart at a document's start) is a true property of the model,
reported as a warning that names that mixer, not as a failure of an attention layer.

Where a model separates packed documents at all:
- `audit_model(model, packed=True)`: the model says so (its attention builds a block-diagonal mask from the
  position ids); `packed=False` does not check;
- `packed=None` (the default): a Hugging Face model whose mask transformers builds with its packed-sequence mask
  (`masking_utils.packed_sequence_mask_function`, applied by `create_causal_mask` and its sliding and chunked
  kin when position ids restart and no attention mask or cache is passed), watched during the forward. Any other
  model skips, saying why: nothing says its attention separates documents.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from .._registry import Need, detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, dtype_name, tolerance
from ._context import SEQUENCE, ModelContext, at_least
from ._find import ModuleWatch
from ._runner import first_tensor
from ._taps import NO_POSITIONS, LayerTap, moved, per_position
from ._tolerance import rechecked_in_float64

ID = "packed_documents"
FIX = ("mask attention block-diagonal over the packed documents, causal inside each: document ids from where the "
       "position ids restart, doc = (position_ids == 0).cumsum(-1), and a query attends a key only when "
       "doc[q] == doc[kv] (with transformers, pass position_ids and no attention_mask, or a 4-D block-diagonal "
       "mask)")
TAKES_POSITIONS = Need("position_ids", lambda c: c.runner.takes_positions,
                       "the model's forward takes no position_ids, through which packed documents restart")
NOT_ASKED = Need("packed is not False", lambda c: c.packed is not False, "packed=False: not checked")


def documents(T: int) -> list[tuple[int, int]]:
    """Three documents over T positions, as (start, end): T // 3, T // 3 and the rest."""
    a = T // 3
    return [(0, a), (a, 2 * a), (2 * a, T)]


@contextlib.contextmanager
def _watch_packed_mask():
    """Whether transformers applied its packed-sequence mask during the block: a list that fills when it does."""
    used: list = []
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "packed_sequence_mask_function", None) if masking is not None else None
    if original is None:
        yield None
        return

    def watched(packed_sequence_mask):
        used.append(packed_sequence_mask)
        return original(packed_sequence_mask)

    masking.packed_sequence_mask_function = watched
    try:
        yield used
    finally:
        masking.packed_sequence_mask_function = original


def _crosses(t, rows: int, T: int, row: int, s: int, e: int, tol: float) -> bool | None:
    """Whether a module's tensor `t` (rows, T, ...) moved outside document s..e-1 when row `row` changed it
    (against row 0); None where `t` is not one entry per row and position, batch-first."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2 or t.shape[:2] != (rows, T):
        return None
    # (1, T, features): a (rows, T) tensor, one value per position (a gate), as one feature; flatten(2) raised on it
    change = moved(t[row:row + 1].reshape(1, T, -1), t[:1].reshape(1, T, -1))  # (1, T)
    if change is None:
        return None
    change = change[0].clone()
    change[s:e] = 0
    return bool((change > tol).any())


def leak_source(ctx: ModelContext, batch, positions, row: int, s: int, e: int, tol: float, model=None):
    """(path, class, attends) of the first module to return whose outputs crossed outside document s..e-1 while
    none of its tensor inputs had, replaying the packed forward with every module watched; `attends`: whether a
    softmax over (Tq, Tk) scores or fused attention ran inside it. None where no module's tensors could be read.
    `model`: the float64 copy, whose module paths are the model's (`traced_leak`)."""
    rows, T = batch.shape[:2]
    found: list = []

    def on_return(path, module, args, kwargs, out, attends):
        if found or not path:
            return
        if not _crosses(first_tensor(out), rows, T, row, s, e, tol):
            return
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(_crosses(a, rows, T, row, s, e, tol) for a in inputs):
            return  # the leak came in with its inputs
        found.append((path, type(module).__name__, attends))

    watch = ModuleWatch(model or ctx.model, on_return)
    try:
        with watch, watch.observer:
            ctx.runner(batch, position_ids=positions, model=model)
    except Exception:  # the same forward ran once already: a replay that raises under the hooks points nowhere
        return None
    return found[0] if found else None


def traced_leak(ctx: ModelContext, batch, positions, row: int, s: int, e: int, tol: float):
    """`leak_source` in the model, or, for a model in bfloat16 or float16 (`_tolerance.rechecked_in_float64`), in its
    float64 copy at float32's tolerance first: a mixer's leak smaller than the low precision's rounding at its own
    output is amplified later, and at that precision the trace named the attention layer after it (Zaya's CCA
    projection in bfloat16)."""
    twin = ctx.twin64() if rechecked_in_float64(ctx.dtype) else None
    source = leak_source(ctx, batch, positions, row, s, e, tolerance(UNCHANGED, torch.float32), model=twin) \
        if twin is not None else None
    return source or leak_source(ctx, batch, positions, row, s, e, tol)


@detector(ID, "documents packed into one sequence (position ids restarting at each) do not see each other: "
              "changing one document moves its own outputs only; the first layer a change crosses into another "
              "document is reported", fix=FIX, needs=(SEQUENCE, TAKES_POSITIONS, at_least(6), NOT_ASKED),
          scope="model",
          unlocated="names the first attention layer whose outputs in another document moved (its `layer`); the "
                    "mask is not traced to a line")
def check_packed_documents(ctx: ModelContext) -> DetectorResult:
    runner = ctx.runner
    seq = runner.inputs[:1]
    T = seq.shape[1]
    docs = documents(T)
    positions = torch.cat([torch.arange(e - s) for s, e in docs]).view(1, T).to(seq.device)  # (1, T)
    gen = torch.Generator().manual_seed(ctx.seed + 53)
    other = runner.other_tokens(seq, gen)
    rows = [seq]
    for s, e in docs:
        row = seq.clone()
        row[:, s:e] = other[:, s:e]
        rows.append(row)
    batch = torch.cat(rows)  # (1 + documents, T)
    # one row of positions per sequence, each its own memory as a caller's are: an expanded view (stride 0) makes a
    # model that flattens them with .view(-1) raise (Kosmos-2.5)
    positions = positions.repeat(batch.shape[0], 1)  # (1 + documents, T)
    with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as taps, _watch_packed_mask() as used:
        out, _ = runner(batch, position_ids=positions)
    if not per_position(out, T):
        return DetectorResult(ID, "skip", NO_POSITIONS.format(shape=tuple(out.shape)))
    spans = ", ".join(f"{s}..{e - 1}" for s, e in docs)
    if ctx.packed is None and not used:
        why = ("transformers did not apply its packed-sequence mask in this model's forward (masking_utils."
               "packed_sequence_mask_function unused: a bidirectional mask, a mask the model builds itself, or an "
               "attention implementation without mask functions)" if runner.hf else
               "nothing says the model's attention separates documents packed in one sequence")
        return DetectorResult(ID, "skip", f"not measured: {why}; pass packed=True to audit_model if its attention "
                                          f"keeps packed documents apart by their position ids")
    base, tol = out[:1], tolerance(UNCHANGED, ctx.dtype)
    crossings, own_moved, worst = [], True, 0.0
    for i, (s, e) in enumerate(docs, start=1):
        change = moved(out[i:i + 1], base)[0]  # (T,)
        own_moved = own_moved and bool((change[s:e] > tol).any())
        outside = change.clone()
        outside[s:e] = 0
        if bool((outside > tol).any()):
            t = int((outside > tol).nonzero()[0])
            worst = max(worst, float(outside.max()))
            crossings.append((i - 1, s, e, t, float(change[t]), int((outside > tol).sum())))
    first = None
    if crossings:
        d, s, e = crossings[0][:3]
        for p, r in taps.calls():  # in the order of the calls: a looped layer's cycles each in their place
            layer_out = taps.joined(p, r)
            if layer_out is None or layer_out.shape[0] != batch.shape[0] or layer_out.shape[1] != T:
                continue
            ch = moved(layer_out[d + 1:d + 2], layer_out[:1])[0]  # (T,)
            ch[s:e] = 0
            if bool((ch > tol).any()):
                first = p
                break
    how = "as declared (packed=True)" if ctx.packed else "transformers applied its packed-sequence mask"
    if crossings:
        d, s, e, t, by, n = crossings[0]
        at = f"; the change first crosses at {first}" if first else ""
        verdict, fix = "fail", FIX
        source = traced_leak(ctx, batch, positions, d + 1, s, e, tol)
        if source is not None and not source[2]:  # no softmax attention where the leak starts: a mixer's state
            first, verdict = source[0], "warn"
            at = (f"; the leak starts in {source[0]} ({source[1]}), which runs no softmax attention (a state-space "
                  f"scan, linear attention or a convolution over the sequence that does not restart at a "
                  f"document's start): a property of the model's mixer, not of its attention; whether the attention "
                  f"layers after it keep documents apart is not measured (their inputs already differ)")
            fix = (f"reset {source[0]}'s state at each document's start (e.g. the sequence index a state-space or "
                   f"convolution kernel takes), or do not pack documents for this model")
        elif source is not None and source[0] != first:
            at += f" (the leak starts in {source[0]}, {source[1]})"
        return DetectorResult(ID, verdict, "packed documents see each other: changing one document moves another's "
                                           "outputs" + at, value=worst, threshold=tol, fix=fix, layer=first,
                              evidence=f"documents at {spans} (position ids restarting at each, no attention mask; "
                                       f"{how}): changing document {d} (t={s}..{e - 1}) moved {n} outputs of other "
                                       f"documents, first t={t} by {by:.3g} of the outputs' RMS (up to {tol:.0e} "
                                       f"allowed for {dtype_name(ctx.dtype)}); "
                                       + "; ".join(f"document {c[0]}: {c[5]} outside outputs moved"
                                                   for c in crossings))
    if not own_moved:
        return DetectorResult(ID, "skip", "not measured: changing a document's tokens did not move its own outputs")
    return DetectorResult(ID, "pass", f"packed documents ({spans}) see only themselves", value=0.0, threshold=tol,
                          evidence=f"{how}; each document changed alone moved its own outputs and none of the "
                                   f"others' (up to {tol:.0e} allowed for {dtype_name(ctx.dtype)})")
