"""Other tokens in the batch change nothing at a sequence's real tokens:

- padding_invariance: right padding (with two pad contents), and left padding with the position ids it needs,
  leave the outputs at real tokens unchanged; localised to the first attention layer whose outputs at the real
  tokens moved.
- batch_invariance: a sequence alone gives what it gives inside a batch of sequences of other lengths.

Both within the float64-golden tolerance (`_tolerance.Golden`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._registry import Need, detector
from .._result import DetectorResult
from .._thresholds import tolerance
from ._context import SEQUENCE, ModelContext, at_least
from ._runner import pad_tokens
from ._taps import NO_POSITIONS, LayerTap, first_layer, per_position
from ._tolerance import GOLDEN_FLOOR, Golden, below_rounding, float64_allowed

PADDING_FIX = ("combine the padding mask with the causal mask (AND), and derive position ids from the attention "
               "mask under left padding: position_ids = attention_mask.cumsum(-1) - 1")
BATCH_FIX = ("make each sequence's computation independent of the others (masks and positions per row, no "
             "statistics over the batch)")
TAKES_PADDING = Need("an attention_mask", lambda c: c.runner.padding_name is not None,
                     "the model's forward takes no attention_mask (padding mask)")


@detector("padding_invariance", "right padding, and left padding with the position ids it needs, leave the outputs "
                                "at real tokens unchanged, whatever the padded tokens contain", fix=PADDING_FIX,
          needs=(SEQUENCE, TAKES_PADDING, at_least(3)), scope="model",
          unlocated="names the first attention layer whose outputs at real tokens moved (its `layer`), whose own "
                    "in-place audit points at the line")
def check_padding_invariance(ctx: ModelContext) -> DetectorResult:
    det, runner = "padding_invariance", ctx.runner
    seq = runner.inputs[:1]
    T = seq.shape[1]
    P = max(1, T // 4)
    L = T - P
    real = seq[:, :L]
    gen = torch.Generator().manual_seed(ctx.seed + 23)
    left = runner.takes_positions
    # positions given on both sides: a model that numbers its own positions from the ids (RoBERTa's start at
    # padding_idx + 1) would otherwise sit the unpadded reference elsewhere than the padded rows
    own = {"position_ids": torch.arange(L, device=seq.device)[None]} if left else {}
    with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as ref_taps:
        ref, _ = runner(real, **own)
    if not per_position(ref, L):
        return DetectorResult(det, "skip", NO_POSITIONS.format(shape=tuple(ref.shape)))
    golden = Golden(ctx.golden(real, **own), ref, ctx.dtype)
    pads = torch.cat([pad_tokens(runner, (1, P) + tuple(seq.shape[2:]), gen) for _ in range(2)])  # two contents
    ones, zeros = torch.ones(1, L, dtype=torch.long), torch.zeros(1, P, dtype=torch.long)
    # rows: right padding with either pad contents; left padding with the position ids it needs (one call)
    rows = [torch.cat([real, pads[:1]], 1), torch.cat([real, pads[1:]], 1)]
    masks = [torch.cat([ones, zeros], 1)] * 2
    if left:
        rows.append(torch.cat([pads[:1], real], 1))
        masks.append(torch.cat([zeros, ones], 1))
    mask = torch.cat(masks).to(seq.device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0) if left else None  # real tokens at 0 .. L-1 in every row
    with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as taps:
        out, _ = runner(torch.cat(rows), attention_mask=mask, position_ids=positions)
    cases = [(0, slice(0, L), "right padding, pad contents 1"), (1, slice(0, L), "right padding, pad contents 2")]
    if left:
        cases.append((2, slice(P, T), "left padding with position_ids = cumsum(mask) - 1"))
    texts, failed, first, worst = [], [], None, (0.0, tolerance(GOLDEN_FLOOR, ctx.dtype))  # all 0: the floor
    for row, where, label in cases:
        ok, err, allowed, text = golden.judge(out[row:row + 1, where], label)
        worst = max(worst, (err, allowed), key=lambda e: e[0] / e[1])
        texts.append(text)
        if not ok:
            failed.append(label.split()[0])
            first = first or first_layer(ctx.order, ref_taps, taps, lambda x: x[:, :L],
                                         tolerance(GOLDEN_FLOOR, ctx.dtype),
                                         select_b=lambda x, r=row, w=where: x[r:r + 1, w])[0]
    encoder = _encoder_padding(ctx, seq, gen)
    if encoder is not None:
        worst = max(worst, (encoder.err, encoder.allowed), key=lambda e: e[0] / e[1])
        texts.append(encoder.text)
        if not encoder.ok:
            failed.append("encoder")
            first = first or encoder.at
    if not left:
        texts.append("left padding not checked: the forward takes no position_ids, so left-padded tokens would sit "
                     "at other positions")
    if not failed and golden.rechecks:  # a low precision's rounding may hide what the same code does at any
        out64 = ctx.float64_output(torch.cat(rows), attention_mask=mask, position_ids=positions)
        for row, where, label in cases if out64 is not None else ():
            ok, err, text = golden.judge64(out64[row:row + 1, where], label)
            texts.append(text)
            if not ok:
                failed.append(label.split()[0])
                worst = max(worst, (err, float64_allowed()), key=lambda e: e[0] / e[1])
        for ok, err, text in encoder.recheck() if encoder is not None else ():  # the encoder's padding too
            texts.append(text)
            if not ok:
                failed.append("encoder")
                worst = max(worst, (err, float64_allowed()), key=lambda e: e[0] / e[1])
        golden.worst64 = max(golden.worst64, encoder.golden.worst64 if encoder is not None else 0.0)
        golden.record64(ctx.readings, det)
        if failed:
            return DetectorResult(det, "fail", f"padding changes the outputs at real tokens "
                                               f"({', '.join(sorted(set(failed)))} padding) "
                                               f"{below_rounding(ctx.dtype)}", value=worst[0], threshold=worst[1],
                                  evidence="; ".join(texts), fix=PADDING_FIX)
    if failed:
        return DetectorResult(det, "fail", f"padding changes the outputs at real tokens "
                                           f"({', '.join(sorted(set(failed)))} padding)"
                                           + (f"; first at {first}" if first else ""),
                              value=worst[0], threshold=worst[1], evidence="; ".join(texts), fix=PADDING_FIX,
                              layer=first)
    return DetectorResult(det, "pass", f"outputs at the {L} real tokens unchanged by {P} padding tokens (right, two "
                                       f"contents{', and left' if left else ''})"
                                       + ("; and by padding the encoder's ids" if encoder is not None else ""),
                          value=worst[0], threshold=worst[1], evidence="; ".join(texts))


@dataclass
class EncoderPadding:
    """The encoder-padding scenario's judgement at the model's dtype, and its float64 re-run (`recheck`)."""

    ok: bool
    err: float
    allowed: float
    text: str
    at: str | None  # the first layer the change shows in, where it failed
    golden: Golden
    recheck: Callable[[], list]  # [(within, error, text)] of the padded rows in the float64 copy; [] where not rechecked


def _encoder_padding(ctx: ModelContext, seq, gen) -> EncoderPadding | None:
    """An encoder-decoder's encoder ids padded on the right (the decoder's inputs as they are): the decoder's outputs
    must not move. The decoder padding above never reaches the encoder, whose layers are given no mask where
    nothing is padded: a mask bug in an encoder layer went unseen (T5Gemma's, 2026-12-04). Judged as the rest, one
    call against the unpadded one; None where the model is no encoder-decoder taking `input_ids` and `attention_mask`
    beside its decoder's inputs."""
    runner = ctx.runner
    ids = runner.fixed.get("input_ids")
    if not (runner.encoder_decoder and runner.padding_name == "decoder_attention_mask"
            and runner.takes("attention_mask") and isinstance(ids, torch.Tensor) and ids.dim() == 2
            and ids.shape[1] >= 3):
        return None
    Te = ids.shape[1]
    Pe = max(1, Te // 4)
    real = ids[:1, :Te - Pe]
    # two pad contents drawn from the encoder's own ids: in its vocabulary, which may not be the decoder's (Dia's)
    pads = ids[0, torch.randint(Te, (2, Pe), generator=gen)].to(ids.device)
    rows = torch.cat([real.expand(2, -1), pads], 1)
    mask = torch.cat([torch.ones(2, Te - Pe, dtype=torch.long), torch.zeros(2, Pe, dtype=torch.long)], 1)
    with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as ref_taps:
        ref, _ = runner(seq, extra={"input_ids": real})
    with LayerTap(ctx.modules, ctx.time_dims, ctx.model) as taps:
        out, _ = runner(seq.expand(2, -1), extra={"input_ids": rows, "attention_mask": mask.to(ids.device)})
    golden = Golden(ctx.float64_output(seq, extra={"input_ids": real}), ref, ctx.dtype)
    label = f"the encoder's ids right-padded by {Pe} ({Te - Pe} real)"
    results = [golden.judge(out[i:i + 1], f"{label}, pad contents {i + 1}") for i in range(2)]
    ok = all(r[0] for r in results)
    err, allowed = max(((r[1], r[2]) for r in results), key=lambda e: e[0] / e[1])
    L = Te - Pe  # the encoder layers' real positions; the decoder layers' first L
    tol = tolerance(GOLDEN_FLOOR, ctx.dtype)
    first = None if ok else first_layer(ctx.order, ref_taps, taps, lambda x: x[:, :L], tol,
                                        select_b=lambda x: x[:1, :L])[0]

    def recheck() -> list:
        """At a low precision the same padded call in the float64 copy (`Golden.rechecks`), as the decoder's rows."""
        if not golden.rechecks:
            return []
        out64 = ctx.float64_output(seq.expand(2, -1), extra={"input_ids": rows, "attention_mask": mask.to(ids.device)})
        return [] if out64 is None else [golden.judge64(out64[i:i + 1], f"{label}, pad contents {i + 1}")
                                         for i in range(2)]

    return EncoderPadding(ok, err, allowed, "; ".join(r[3] for r in results), first, golden, recheck)


@detector("batch_invariance", "a sequence alone gives what it gives inside a batch of sequences of other lengths",
          fix=BATCH_FIX, scope="model",
          unlocated="compares the model's outputs only; which layer mixes the batch is not traced")
def check_batch_invariance(ctx: ModelContext) -> DetectorResult:
    det, runner = "batch_invariance", ctx.runner
    seq = runner.inputs[:1]
    gen = torch.Generator().manual_seed(ctx.seed + 31)
    if ctx.full is not None and torch.equal(ctx.full[0], seq):
        alone = ctx.full[1]  # the same forward, already made by cache_parity
    else:
        alone, _ = runner(seq)
    golden = Golden(ctx.golden(seq), alone, ctx.dtype)
    if runner.sequence and runner.padding_name is not None and seq.shape[1] >= 3:
        T = seq.shape[1]
        others = runner.other_tokens(torch.cat([seq, seq]), gen)
        batch = torch.cat([others[:1], seq, others[1:]])
        mask = torch.ones(3, T, dtype=torch.long)
        mask[0, T - T // 3:] = 0  # rows of other lengths around it
        mask[2, T - 1:] = 0
        kw = {"attention_mask": mask.to(seq.device)}
        how = "between two sequences of other lengths (right-padded)"
    else:
        others = runner.other_tokens(torch.cat([seq, seq]), gen) if runner.sequence else \
            torch.randn(torch.cat([seq, seq]).shape, generator=gen).to(seq.device, seq.dtype)
        batch = torch.cat([others[:1], seq, others[1:]])
        kw = {}
        how = "between two other inputs"
    out, _ = runner(batch, **kw)
    if out[1:2].shape != alone.shape:  # FastSpeech 2: each sequence's length comes from its own predicted durations
        return DetectorResult(det, "skip", f"not measured: the sequence's output is {tuple(alone.shape[1:])} alone "
                                           f"and {tuple(out.shape[1:])} in the batch {how} (a model whose output "
                                           f"length depends on its batch): no row-by-row comparison")
    ok, err, allowed, text = golden.judge(out[1:2], f"the sequence {how}")
    out64 = ctx.float64_output(batch, **kw) if ok and golden.rechecks else None
    if out64 is not None:  # a low precision's rounding may hide what the same code does at any precision
        ok, err64, text64 = golden.judge64(out64[1:2], f"the sequence {how}")
        golden.record64(ctx.readings, det)
        text += "; " + text64
        if not ok:
            return DetectorResult(det, "fail", f"a sequence's output depends on the other sequences of its batch "
                                               f"{below_rounding(ctx.dtype)}", value=err64,
                                  threshold=float64_allowed(), evidence=text, fix=BATCH_FIX)
    if not ok:
        return DetectorResult(det, "fail", "a sequence's output depends on the other sequences of its batch",
                              value=err, threshold=allowed, evidence=text, fix=BATCH_FIX)
    return DetectorResult(det, "pass", f"a sequence alone gives its output {how}", value=err, threshold=allowed,
                          evidence=text)

