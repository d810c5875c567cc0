"""`softmax_saturation`: the softmax temperature, q·k scaled by 1/sqrt(d_k) or the declared scale."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._core import not_run, skip
from .._observe import FusedAttention as Fused
from .._observe import Matmul, Observer, Scaling, SoftmaxCall, applied_scales, zero_products
from .._probe import Call, Probe
from .._registry import NOT_APPLICABLE, detector
from .._result import DetectorResult, Site
from .._thresholds import MEASURED_SCALE_ERROR, ROW_SUM, SCALE_RATIO, tolerance
from .._tracing import (
    ancestors,
    did_nothing,
    event_op,
    factor_origins,
    op_site,
    past_zeroing,
    producer,
    short,
    site,
    through_carries,
    trace_call,
    unique,
)
from ._common import ENTROPY_ROWS, base_trace, float64_copy_or_skip, result, zeros_drawn


def scale_fix(applied: float, expected: float, d_k: int, d_model: int | None, num_heads: int | None, *,
              declared: bool = False, parts: int = 1) -> str:
    """The fix named by the factor q·k really reaches the softmax with: none, 1/sqrt(d_model), the scale twice or
    inverted; else the factor to use, said as the reading it was judged by (`parts`: 1/sqrt(parts x d_k))."""
    def near(x: float, y: float) -> bool:
        return abs(math.log(abs(x) / y)) < math.log(SCALE_RATIO) if x and y > 0 else False

    want = ("the declared scale" if declared else f"1/sqrt(d_k) = 1/sqrt({d_k})" if parts == 1 else
            f"1/sqrt({parts} x d_k) = 1/sqrt({parts * d_k}), for the {parts} products the scores sum")
    if near(applied, 1.0):
        return (f"scores = q @ k.transpose(-2, -1) / math.sqrt(d_k) before the softmax (d_k = {d_k}, the width of one "
                f"head): the scores reach it unscaled")
    if d_model and d_model != d_k and near(applied, 1.0 / math.sqrt(d_model)):
        heads = f" = sqrt(d_model / num_heads) = sqrt({d_model} / {num_heads})" if num_heads else ""
        return (f"divide by sqrt(d_k), the width of one head{heads}, not by sqrt(d_model) = sqrt({d_model})")
    if near(applied, expected ** 2):
        return (f"scale once: the scores are multiplied by {want} twice" +
                ("" if declared else f" (that is, divided by d_k = {d_k}, not by its square root)"))
    if near(applied, 1.0 / expected):
        return f"divide by sqrt(d_k), do not multiply by it: scores = q @ k.transpose(-2, -1) / math.sqrt({d_k})"
    return f"multiply q·k by {expected:.4g} ({want}) before the softmax, once"


def scale_sites(probe, result: DetectorResult) -> list[Site]:
    """On the very call the temperature was read from (`result.replay`): the q·k matmul, the softmax it feeds and
    the scaling ops on the way, or, when there is none, where the scale belongs."""
    base = result.replay
    if base is None or not base.ok:
        return []
    trace = trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed)
    rec = trace.record
    rows = _readings(probe, [(e.applied, e.d_k, e.source, e) for e in applied_scales(rec)
                             if not _by_a_weight(e, probe.subject.layer)])
    if not rows:
        return []
    reading = _worst(rows)  # the reading the verdict judged, read the same way from the replayed call
    worst, r, expected = reading.estimate, reading.ratio, reading.expected
    said = f"q·k reaches the softmax multiplied by {reading.applied:.4g}; expected {expected:.4g}"
    said += "" if probe.scale is not None else f" = 1/sqrt({reading.parts * reading.d_k})"
    fix = _fix(probe, reading)
    at = {id(e): i for i, e in enumerate(rec.order)}  # by identity: events hold tensors, which `==` cannot compare

    def scaled(e: Scaling) -> list:
        """Where a factor that is itself not the expected one was made (an attribute, a parameter), then where it
        was applied; a right factor applied twice is the applying lines' mistake, not the making line's."""
        op = event_op(trace, e)
        wrong = e.factor > 0 and abs(math.log(e.factor / expected)) > math.log(SCALE_RATIO)
        made = factor_origins(trace, e.frames, op.values, e.factor) if wrong and op is not None else []
        return [replace(x, fix=fix) for x in made] + [site(e.frames, e.op, f"multiplies by {e.factor:.4g}; {said}",
                                                           fix)]

    if worst.fused is not None:
        op = event_op(trace, worst.fused)
        scalings = [e for e in rec.order[:at[id(worst.fused)]] if isinstance(e, Scaling)]
        made = [] if op is None else factor_origins(trace, op.frames, op.values, worst.applied)
        return unique([x for e in scalings for x in scaled(e)] + [replace(x, fix=fix) for x in made]
                      + [op_site(op, said, fix=fix)])
    soft_op, mm_op = event_op(trace, worst.softmax), event_op(trace, worst.matmul)
    if worst.used_by is not None:  # the weights that multiply the values are not the softmax's output
        wv = event_op(trace, worst.used_by)
        maker = None if wv is None else past_zeroing(trace, through_carries(trace, producer(trace, wv.in_ids[0])))
        return unique([op_site(maker, f"the weights that multiply the values are made here from the softmax at "
                                        f"{short(soft_op) if soft_op else '?'}: their temperature is {r:.3g}x "
                                        f"the expected one", fix="use the softmax's output as the weights: a "
                                        "second softmax (or power) of them changes their temperature"),
                       op_site(soft_op, "the softmax of q·k")])
    i_soft = at[id(worst.softmax)]
    prev_soft = max([j for j, e in enumerate(rec.order[:i_soft]) if isinstance(e, (SoftmaxCall, Fused))] or [-1])
    scalings = [e for e in rec.order[prev_soft + 1:i_soft] if isinstance(e, Scaling)]
    if scalings:
        return unique([x for e in scalings for x in scaled(e)]
                      + [op_site(mm_op, said, fix=fix), op_site(soft_op, said, fix=fix)])
    start = mm_op.index if mm_op is not None else 0
    end = soft_op.index if soft_op is not None else len(trace.ops)
    return unique([replace(x, fix=fix) for x in did_nothing(trace, start, end, ("scale", "temperature", "sqrt"))]
                  + [op_site(mm_op, f"{said}: no scaling op between this q·k and the softmax at "
                                    f"{short(soft_op) if soft_op else '?'}; the scale belongs here", fix=fix),
                     op_site(soft_op, said, fix=fix)])


def _log_weight_scale(weights: Tensor, q: Tensor, k: Tensor) -> list[tuple[float, int]]:
    """Fit log w = s * (q . k) + c per row for (B, H, Tq, Tk) weights of (B, H, T, d) q and k: [(s, d_k)]."""
    if q.dim() != 4 or tuple(weights.shape) != (q.shape[0], q.shape[1], q.shape[2], k.shape[2]):
        return []
    qk = q.double() @ k.double().transpose(-2, -1)  # (B, H, Tq, Tk)
    logw = weights.double().log()
    ok = torch.isfinite(logw) & (weights > 0)
    if ok.sum() < 4:
        return []
    n = ok.sum(-1, keepdim=True).clamp_min(1)
    mean = lambda x: torch.where(ok, x, 0).sum(-1, keepdim=True) / n  # noqa: E731
    dq, dl = torch.where(ok, qk - mean(qk), 0), torch.where(ok, logw - mean(logw), 0)
    denom = float((dq * dq).sum())
    return [(float((dq * dl).sum()) / denom, int(q.shape[-1]))] if denom > 0 else []


EXPONENTS = frozenset({"exp", "exp_", "exp2", "_softmax", "_safe_softmax", "logsumexp", "_log_softmax"})
LINEAR = frozenset({"add", "add_", "sub", "sub_", "cat", "stack"})  # ops that read several tensors and stay linear


def _exponents_over(probe: Probe) -> str | None:
    """What the exponentials (and softmaxes) the standard probe ran are over, None where it ran none. "products":
    one is over a product of two tensors that both depend on the inputs (q·k in any layout: a matmul, an einsum, q * k
    summed by hand, bucketed windows). Else every one is over a projection of the inputs, made through ops of which
    none but a sum reads two tensors that depend on them (a linear layer's input beside its weight, a norm's beside its
    gain, x * x): "feature map" where none normalises (a kernel's exp, the Performer's), "projections" where one does:
    a token learner's or a router's logits, a linear attention's softmax of the keys, and as well attention pooling
    whose queries are the layer's own parameters (`k @ self.query.T`), whose temperature is a q·k's. Structure cannot
    tell these apart, so none is excused. A norm written out (x * rsqrt(mean(x^2))) counts as a product, which only
    keeps a temperature unjudged, never passed."""
    trace = base_trace(probe)
    exps = [op for op in trace.ops if op.short in EXPONENTS]

    def of_two(op) -> bool:  # a product (or any non-linear op) of two tensors that both depend on the inputs
        return op.short not in LINEAR and len({i for i in op.in_ids if trace.sources.get(i)}) >= 2

    if not exps:
        return None
    if any(of_two(op) or any(of_two(trace.ops[a]) for a in ancestors(trace, op)) for op in exps):
        return "products"
    return "projections" if any(op.short in NORMALISING for op in exps) else "feature map"


NORMALISING = frozenset({"_softmax", "_safe_softmax", "logsumexp", "_log_softmax"})

SOFTMAX_IS_WEIGHTS = 2e-2
"""How close (largest difference of one weight) a row of the weights read through the values must come to a row of a
softmax's output for that softmax to be the weights (attention pooling's, a token learner's), where every softmax
normalises a projection: read weights rebuild the output within ROW_SUM (bfloat16 1.35e-2, float32 2.7e-7); a linear
attention's weights, a product of its feature maps, are no softmax's rows."""


def _a_softmax_is(record, weights: Tensor) -> bool:
    """Whether some softmax of the record, read along any axis pair of its output that has the weights' (Tq, Tk)
    shape (or (Tk, Tq)), holds the weights' rows: a softmax whose output is the weights has a temperature of a q·k's
    (learned queries against the keys), a linear attention's feature maps do not."""
    if record is None:
        return True  # nothing seen: nothing excused
    Tq, Tk = weights.shape[-2:]
    rows = weights.detach().double().reshape(-1, Tk)[:ENTROPY_ROWS]
    for sm in record.softmaxes:
        out = sm.output.detach().double()
        for view in (out, out.transpose(-1, -2)):
            if view.dim() < 2 or tuple(view.shape[-2:]) != (Tq, Tk):
                continue
            theirs = view.reshape(-1, Tk)
            nearest = (rows[:, None, :] - theirs[None, :, :]).abs().amax(-1).amin(-1)
            if bool((nearest <= SOFTMAX_IS_WEIGHTS).all()):
                return True
    return False


TERMS_FIX = ("nothing to declare: the factor of a term added to q·k before the softmax (relative positions, a bias "
             "from the tokens) is not judged, as a term scaled wrong reads the same as a right one; check by hand "
             "that each term is scaled as q·k is (Transformer-XL and XLNet scale their sum; DeBERTa divides each by "
             "sqrt(d_k x the parts summed)). weight_row_sums judges the weights themselves, where it measured them")
"""What to do where softmax_saturation reads q·k's factor right beside terms whose own factors it leaves free: no
declaration measures them, so the report must not send the user to return weights or use a softmax they already use."""
TERM_SCALE_FIX = ("if the design scales its position products as q·k (Transformer-XL: (q·k + (q + v)·r) * scale; "
                  "DeBERTa: c2c, c2p and p2c each divided by sqrt(d_k x the parts summed)), the one shown is off by "
                  "that ratio; if it scales them otherwise on purpose (SAM's decomposed terms are unscaled), nothing "
                  "to declare")
GATE_SCALE_FIX = ("if the design adds the gate's log-probability as it is (softmax(q·k x scale + log p), a sparse or "
                  "forget gate), the one shown is scaled by that factor: move the gate out of the product with the "
                  "scale; if it tempers the gate on purpose, nothing to declare")
PROJECTIONS_FIX = ("nothing to declare: a softmax over a projection of the tokens (a learned query's, a router's, a "
                   "feature map's logits) has no q·k of two activations whose temperature could be judged; if queries "
                   "and keys are both meant to come from the input, check that neither is a parameter of the layer")


RESOLVED = 10
"""How many times the scores' resolution (their dtype's eps at their median magnitude) q·k's RMS must exceed for
`_unfitted` not to name the rounding of the terms added to it as what hid its factor: the sparse-gating layer at
std-0.02 weights in bfloat16 reads 0.036 against 0.0054 (6.7x) and fits no factor; in float32 the same layer fits."""


def _unfitted(record) -> str:
    """Where a softmax follows a product of its input's size (q·k) and no factor fitted its scores: what was measured,
    the product's RMS against the scores' resolution in their dtype (a q·k below it, beside a term added to it such as
    a gate's log at std-0.02 weights in bfloat16, leaves the scores no trace of it); "" where no softmax does."""
    for i, event in enumerate(record.order):
        if not isinstance(event, SoftmaxCall):
            continue
        products = [m for m in record.order[:i] if isinstance(m, Matmul) and m.out.numel() == event.input.numel()]
        if not products:
            continue
        rms = float(products[-1].out.float().pow(2).mean().sqrt())
        step = float(torch.finfo(event.input.dtype).eps * event.input.float().abs().median())
        close = (f": less than {RESOLVED}x apart, the rounding of terms added to q·k (a gate's log, a bias) can "
                 f"hide its factor; audit in float32 to measure it" if rms < RESOLVED * step else "")
        return (f"a softmax over scores of a q·k product's size was observed, but no factor fits them (the "
                f"product's RMS {rms:.2g}, the scores' resolution {step:.2g} in {str(event.input.dtype)[6:]}){close}")
    return ""


@detector("softmax_saturation", "the softmax temperature: q·k is scaled by 1/sqrt(d_k) or the declared scale; normalised "
          "q and k (cosine attention), no scale declared: the logit an aligned key reaches is 0.5 to 100; at unit RMS "
          "(RMSNorm QK-norm), 1/sqrt(d_k)",
          targets=("missing 1/sqrt(d_k)", "scaled by sqrt(d_model)", "scale applied twice or inverted"),
          fix="scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  (d_k: the width of one head)", locate=scale_sites)
def check_softmax_saturation(probe: Probe) -> DetectorResult:
    det, base = "softmax_saturation", probe.base()
    if not base.ok:
        return not_run(det, base)
    found = applied_scales(base.record) if base.record else []
    weighted = [e for e in found if _by_a_weight(e, probe.subject.layer)]
    # a softmax over a projection's output (a dynamic convolution's kernel taps, ConvBERT's; a router's logits) has
    # no 1/sqrt(d_k) of its own: q·k multiplies two activations, never a parameter of the layer
    estimates = [(e.applied, e.d_k, e.source, e) for e in found if e not in weighted]
    if not estimates and probe.subject.form == "function":
        weights, source = ((base.output.weights, "returned weights") if base.output.weights is not None
                           else probe.recovered_weights())
        if weights is not None:
            estimates = [(s, d, f"log-weights vs q·k of the {source}", None)
                         for s, d in _log_weight_scale(weights, base.query, base.key)]
    over = None if estimates else _exponents_over(probe)
    if not estimates and probe.subject.form != "function" and over in (None, "feature map"):
        weights, source = probe.recovered_weights()
        if weights is not None:
            return DetectorResult(det, "skip", NOT_APPLICABLE + f"no softmax and no exponential of q·k scores, "
                                  f"and no fused attention call: the weights ({source}) are a kernel's (linear "
                                  f"attention), which has no temperature; weight_row_sums judges them")
    if over == "projections":
        weights, source = probe.recovered_weights()
        if weights is not None and not _a_softmax_is(base.record, weights):
            return DetectorResult(det, "skip", NOT_APPLICABLE + f"the weights ({source}) are no softmax's output: "
                                  f"each softmax normalises a projection of the tokens on its own (a linear attention's "
                                  f"feature maps: q over its features, k over the tokens) and the weights are a kernel "
                                  f"made of them, which has no q·k temperature; weight_row_sums judges them")
        return replace(skip(det, "every softmax normalises a projection of the tokens, made through the "
                    "layer's own weights with no product of two activations: a linear attention's feature map, a token "
                    "learner's or a router's logits, or attention pooling whose queries are parameters of the layer "
                    "(k @ query.T), whose temperature is a q·k's; structure cannot tell them apart, so none is judged"),
                       fix=PROJECTIONS_FIX)
    if not estimates and base.record and zero_products(base.record):
        return _zero_scores_judged(det, probe, base)
    if not estimates:
        said = f" (softmaxes seen: {len(weighted)}, each over a product with a parameter of the layer, a " \
               f"projection's output, not q·k)" if weighted else ""
        unfitted = _unfitted(base.record) if base.record and not weighted else ""
        if unfitted:
            return skip(det, unfitted + said)
        return skip(det, "no softmax over q·k and no fused attention call was observed, and no weights to fit" + said)
    rows = _readings(probe, estimates)
    worst = _worst(rows)
    if worst.cosine is not None:
        return _judged_cosine(worst, base)
    ratio, applied, expected, d_k, source, estimate = (worst.ratio, worst.applied, worst.expected, worst.d_k,
                                                       worst.source, worst.estimate)
    declared = _said(probe, worst)
    evidence = (f"q·k is multiplied by {applied:.4g} before the softmax ({source}); expected {expected:.4g} = "
                f"{declared}; ratio {ratio:.3g} (allowed {1 / SCALE_RATIO:.2f} to {SCALE_RATIO:.2f})"
                f"{_entropy_text(base, ratio, expected, estimate)}")
    fix = _fix(probe, worst)
    if worst.unit_rms:  # QK-norm: the norm sets the rows' size, the scale still divides q·k by sqrt(d_k)
        evidence += "; q and k reach q·k at unit RMS (every row of norm sqrt(d_k): QK-norm), which keeps 1/sqrt(d_k)"
        fix += ("; the norm does not replace 1/sqrt(d_k): normalised to unit RMS, q·k still grows as d_k x their "
                "cosine (ViT-22B's QK-norm, Flux's, Qwen's keep the 1/sqrt(d_k))")
    if ratio > SCALE_RATIO and not worst.undecided:
        return result(det, "fail", f"softmax is {ratio:.2f}x too sharp: logits are multiplied by more than {declared} "
                                   f"(not divided enough)",
                       value=ratio, threshold=SCALE_RATIO, evidence=evidence, replay=base, fix=fix)
    if ratio < 1 / SCALE_RATIO and not worst.undecided:
        flat = f"{1 / ratio:.2f}x too flat" if ratio else "flat, every weight equal"  # a temperature of 0
        return result(det, "fail", f"softmax is {flat}: logits are multiplied by less than {declared} (divided too "
                                   f"much)",
                       value=ratio, threshold=1 / SCALE_RATIO, evidence=evidence, replay=base, fix=fix)
    undecided = next((r for r in rows if r.undecided), None)
    if undecided is not None:
        return DetectorResult(det, "skip", f"not measured: {undecided.undecided}", value=undecided.applied,
                              evidence=evidence, fix="declare the scale the layer is meant to have (1/sqrt(d_k) unless "
                                                     "its design states another) to have its temperature judged")
    terms = next((r for r in rows if getattr(r.estimate, "terms", 0)), None)
    ratios = getattr(terms.estimate, "term_ratios", ()) if terms is not None else ()
    if ratios and getattr(terms.estimate, "term_tables", ()) and not _tables_token_free(probe):
        ratios = ()  # a table of each token's own, made from the tokens (one sample's keys, a batch mean): unread
    if ratios and all(r is not None for r in ratios):
        # each term a product of q·k's queries (or keys) with positions, read through moves and constant factors
        # (`_observe._term_ratios`): one at q·k's factor (Transformer-XL's (q + v)·r, DeBERTa's c2p and p2c) is
        # vouched for; one at another is not measured, never failed
        worst_term = max(ratios, key=lambda r: math.inf if r <= 0 else _off(r))
        gates = getattr(terms.estimate, "term_gates", ()) or (False,) * len(ratios)
        products = [r for r, gate in zip(ratios, gates) if not gate]
        logp = [r for r, gate in zip(ratios, gates) if gate]
        shown = ", ".join(f"{r:.3g}" for r in products)
        gated = [f"the log-probabilit{'ies' if len(logp) > 1 else 'y'} of the layer's own added to q·k (a gate: "
                 f"softmax(s + log p) weighs each key by p) reach{'' if len(logp) > 1 else 'es'} the scores at "
                 f"{', '.join(f'{r:.3g}' for r in logp)} times {'their' if len(logp) > 1 else 'its'} own value"] \
            if logp else []
        if worst_term <= 0 or _off(worst_term) > math.log(SCALE_RATIO):
            # not a failure: designs differ (SAM's and MViTv2's decomposed terms are unscaled beside a scaled q·k,
            # Gemma's audio attention scales its keys and not its relative keys), so only a term at q·k's factor (a
            # gate at its own value) is vouched for
            read = "; ".join([f"a relative-position product added to it reaches the scores at {shown} times q·k's "
                              f"factor"] * bool(products) + gated)
            vouched = ("a product at q·k's factor and a gate at 1 are" if products else "a gate at 1 is") if logp \
                else "one at q·k's factor is"
            off_gate = bool(logp) and (not products or worst_term in logp)
            return DetectorResult(det, "skip", f"not measured: q·k's own factor matches {_said(probe, terms)}, and "
                                               f"{read}: designs scale such terms differently, so only {vouched} "
                                               f"vouched for",
                                  value=worst_term, threshold=SCALE_RATIO, evidence=evidence,
                                  fix=GATE_SCALE_FIX if off_gate else TERM_SCALE_FIX)
        evidence += "; " + "; ".join([f"the {len(products)} product{'s' if len(products) > 1 else ''} added to q·k "
                                      f"(relative positions) reach the scores at {shown} times q·k's factor"]
                                     * bool(products) + gated)
    elif terms is not None:
        # each term added to q·k is read with a factor of its own, free: a position term left unscaled, or x100,
        # reads the same as a right one, so the softmax's temperature as a whole is not vouched for
        n = terms.estimate.terms
        added = f"the {n} terms added to it before the softmax (relative positions, a bias from the tokens) keep " \
                f"factors" if n > 1 else "the term added to it before the softmax (relative positions, a bias from " \
                "the tokens) keeps a factor"
        return DetectorResult(det, "skip", f"not measured: q·k's own factor matches {_said(probe, terms)} (ratio "
                                           f"{terms.ratio:.4f}), but {added} the fit leaves free, so a term scaled "
                                           f"wrong reads the same; only a wrong factor on q·k is judged there",
                              value=terms.ratio, threshold=SCALE_RATIO, evidence=evidence, fix=TERMS_FIX)
    return result(det, "pass", f"softmax temperature matches {declared} (ratio {ratio:.4f})", value=ratio,
                   threshold=SCALE_RATIO, evidence=evidence,
                   margin=f"correct layers measured |ratio - 1| <= {MEASURED_SCALE_ERROR:.1e}")


def _tables_token_free(probe: Probe) -> bool:
    """Whether every table a term beside q·k was read against per query (`ScaleEstimate.term_tables`: Shaw's
    relative embeddings gathered per (query, key), an operand with no batch axis) is made from no probe input, by the
    standard call's trace: one of each such product's operands depends on none of the query, key and value. A table
    of one sample's keys expanded, or of the batch's mean, depends on them; so is not a position table, and the term
    stays unjudged."""
    trace = base_trace(probe)
    traced = [e for e in applied_scales(trace.record) if getattr(e, "term_tables", ())]
    products = [m for e in traced for m in e.term_tables]
    if not products:
        return False  # read on the standard call, not on its trace: unconfirmed
    for m in products:
        op = event_op(trace, m)
        if op is None or all(trace.sources.get(i) for i in op.in_ids[:2]):
            return False
    return True


def _zero_scores_judged(det: str, probe: Probe, base) -> DetectorResult:
    """q·k is 0 for every query and key, and only the mask reaches the softmax: every weight is equal whatever q·k is
    multiplied by. Where drawing the layer's all-zero parameters at random (on its float64 copy) makes q·k move, a
    learned factor at its init of 0 made it so (Zaya's key temperature): the temperature is not applicable until it
    moves. Where none does, a factor of 0 is in the layer's code (`1 // math.sqrt(d_k)`, 0 in integer division): the
    softmax is flat, a failure."""
    zeros = _zeros_making_scores(probe, det, base)
    if zeros is None:
        return skip(det, "q·k is 0 for every query and key, and whether a parameter of the layer at 0 makes it so "
                         "could not be measured (no float64 copy of the layer ran)")
    if zeros:
        return DetectorResult(det, "skip", NOT_APPLICABLE + f"q·k is 0 for every query and key at these weights, "
                              f"and with the layer's all-zero parameters drawn at random ({', '.join(zeros[:4])}"
                              f"{', ...' if len(zeros) > 4 else ''}) it is not: one of them is a learned temperature "
                              f"or gate at its init of 0, so every weight is the same whatever q·k is multiplied by; no "
                              f"temperature to read until that factor moves; weight_row_sums judges the weights",
                              fix="audit the layer with trained weights to have its temperature judged")
    return result(det, "fail", "softmax is flat, every weight equal: q·k is 0 for every query and key",
                  value=0.0, threshold=1 / SCALE_RATIO, replay=base,
                  evidence="the product of q and k reaching the softmax is exactly 0 everywhere, and no parameter of "
                           "the layer at 0 makes it so (drawn at random, it stays 0): a factor of 0 applied to q or k "
                           "in its code (an integer division such as 1 // math.sqrt(d_k) is 0)",
                  fix="scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  (a float division; d_k: the width of one "
                      "head)")


def _zeros_making_scores(probe: Probe, det: str, base) -> list[str] | None:
    """The layer's all-zero parameters, where drawing them at random on its float64 copy makes q·k other than 0 on
    `base`'s inputs ([] where it stays 0, or where the layer holds none); None where the copy cannot run."""
    layer = probe.subject.layer
    zeros = [name for name, p in layer.named_parameters() if p.numel() and not bool(p.detach().any())] \
        if isinstance(layer, torch.nn.Module) else []
    if not zeros:
        return []
    twin = float64_copy_or_skip(probe, det)
    if isinstance(twin, DetectorResult):
        return None
    wide = {id(x): x.to(torch.float64) for x in (base.query, base.key, base.value)}
    observer = Observer()
    try:
        with zeros_drawn(dict(twin.layer.named_parameters()), zeros, probe.generator()), torch.no_grad(), observer:
            twin(wide[id(base.query)], wide[id(base.key)], wide[id(base.value)], base.allowed)
    except Exception:  # noqa: BLE001 -- a copy that does not run: not measured
        return None
    if not any(isinstance(e, SoftmaxCall) for e in observer.record.order):
        return None  # the copy's call showed no softmax to read q·k at
    return [] if zero_products(observer.record) else zeros


def _readings(probe: Probe, estimates: list[tuple]) -> list[_Reading]:
    """Each estimate (applied, d_k, source, the record's estimate) read against the factor it is judged by: the
    declared scale (or its square, split over q and k; times a factor the layer states), 1/sqrt(d_k), 1/sqrt(parts x
    d_k) beside position terms where that is not the whole-width bug, or the cosine bounds of normalised q and k. The
    verdict and the localiser both read here."""
    rows = []
    for applied, d_k, source, estimate in estimates:
        expected = probe.scale if probe.scale is not None else 1.0 / math.sqrt(d_k)
        split = probe.scale is not None and _split_over_q_and_k(applied, probe.scale, d_k)
        expected = expected ** 2 if split else expected
        # normalised q and k are judged by the logits they can reach, not by 1/sqrt(d_k) (unless a scale is declared,
        # and q or k is multiplied by no other number the layer states: see _stated_temperature)
        cosine = _cosine_bound(estimate, probe.subject.dtype, d_k)
        if probe.scale is not None and cosine is not None:
            cosine = _stated_temperature(probe.subject.layer, applied / expected, expected, cosine)
        if probe.scale is None and cosine is not None and cosine.unit_rms:
            cosine = _stated_in_words(probe.subject.layer, cosine)
        unit_rms = cosine is not None and cosine.unit_rms
        stated, undecided, read_parts = "", "", 1
        parts = getattr(estimate, "parts", 1)
        wide = expected / math.sqrt(parts)
        if probe.scale is None and cosine is None and parts > 1 and _off(applied / wide) < _off(applied / expected):
            # scores that sum q·k and parts - 1 position products, each divided by sqrt(parts x d_k), keep the
            # variance of one scaled product (DeBERTa's 1/sqrt(3 d_k) for c2p and p2c beside q·k); Transformer-XL's
            # keep 1/sqrt(d_k): either is the layer's temperature, unless 1/sqrt(parts x d_k) is also 1/sqrt(d_model)
            # (parts = heads), the whole-width bug: a convention under which the bug passes is no convention
            d_model, heads = probe.subject.d_model, probe.subject.num_heads
            if d_model is None or parts == heads or _off(math.sqrt(parts * d_k / d_model)) < math.log(SCALE_RATIO):
                if _off(applied / wide) < math.log(SCALE_RATIO) <= _off(applied / expected):
                    undecided = (f"q·k is multiplied by {applied:.4g} before the softmax, 1/sqrt({parts} x d_k) = "
                                 f"1/sqrt({parts * d_k}) for the {parts} products its scores sum (q·k and its "
                                 f"position terms), but also 1/sqrt(d_model)" + (f" = 1/sqrt({d_model})" if d_model
                                                                                  else "") +
                                 f", the whole-width bug; declare the layer's scale (scale={applied:.4g} if it is "
                                 f"meant, or scale={1 / math.sqrt(d_k):.4g} = 1/sqrt(d_k)) to have it judged")
            else:
                expected, read_parts = wide, parts
                stated = f" / sqrt({parts}), for the {parts} products the scores sum (q·k and its position terms)"
        if probe.scale is not None and cosine is None and not split:
            # unnormalised q and k multiplied by a number the layer states beside its declared scale (LongCat-Flash's
            # MLA: q times mla_scale_q_lora = sqrt(hidden_size / q_lora_rank), a low-rank projection's own gain): the
            # layer's temperature is the declared scale times it (times its square: the same number on q and on k)
            found = _stated_factor(probe.subject.layer, applied / expected, expected, STATED_NAMES)
            if found is not None:
                cls, name, value = found
                times = value if math.isclose(value, applied / expected, rel_tol=1e-6) else value * value
                expected *= times
                stated = f" x {times:.4g}, the layer's own factor on q·k ({cls}.{name} = {value:.4g})"
        rows.append(_Reading(applied / expected, applied, expected, d_k, source, estimate,
                             None if unit_rms else cosine, unit_rms, split, stated, read_parts, undecided))
    return rows


def _worst(rows: list[_Reading]) -> _Reading:
    """The reading furthest outside what is allowed, else furthest from 1."""
    return max(rows, key=lambda r: (r.outside(), abs(math.log(abs(r.ratio) or 1e-300))))


def _said(probe: Probe, r: _Reading) -> str:
    """The factor a reading was judged by, in words."""
    said = "the declared scale" if probe.scale is not None else f"1/sqrt(d_k) (d_k={r.d_k})"
    said = f"the square of the declared scale, 1/sqrt(d_k) (d_k={r.d_k})" if r.split else said
    return said + r.stated


def _fix(probe: Probe, r: _Reading) -> str:
    return scale_fix(r.applied, r.expected, r.d_k, probe.subject.d_model, probe.subject.num_heads,
                     declared=probe.scale is not None, parts=r.parts)


def _off(ratio: float) -> float:
    """How far a ratio is from 1, in log."""
    return abs(math.log(abs(ratio) or 1e-300))


def _by_a_weight(estimate, layer) -> bool:
    """Whether the product the estimate fitted against multiplies by one of the layer's own parameters (a linear
    projection's weight): then its softmax normalises a projection's output, not q·k."""
    m = getattr(estimate, "matmul", None)
    if m is None or not isinstance(layer, torch.nn.Module):
        return False
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return any(t.untyped_storage().data_ptr() in weights for t in (m.a, m.b) if t.numel())


COSINE_FLAT = 0.5
"""Normalised q and k (QK-norm, cosine attention): the softmax is too flat where a key aligned with its query
(cosine 1) reaches a logit under this, so that no key can take more than e^(2 x 0.5) = 2.7x the weight of another.
Correct layers measured >= 1.0 in float32, bfloat16 and float64 (Restormer's learned temperature at its init of 1;
per-head LayerNorm then 1/sqrt(d_k): sqrt(d_k); nGPT's sqrt(d_k); Swin v2's 10): margin 2x. The bug, 1/sqrt(d_k) kept
after the norm, reads 1/sqrt(d_k): 0.354 at d_k = 8 (1.41x under), 0.125 at 64; at d_k <= 4 it is not told from a
layer's own small temperature."""

COSINE_SHARP = 100.0
"""Normalised q and k: too sharp where an aligned key's logit exceeds this, the largest temperature Swin v2 lets its
learned logit scale reach (clamped at log(1 / 0.01)). Correct layers measured <= 10 at init (margin 10x); a cosine
multiplied by d_k * 1000 reads far past it."""


@dataclass(frozen=True)
class _Cosine:
    """q and k reach q·k normalised: the logit a key aligned with its query gets (the scale times both norms)."""

    bound: float
    seen: str  # what was read, for the evidence
    unit_rms: bool = False  # every row of norm sqrt(d_k): the scaled dot product's convention, not a cosine's
    factor: float = 0.0  # the number q·k itself is multiplied by


@dataclass(frozen=True)
class _Reading:
    ratio: float  # the factor applied / the one expected
    applied: float
    expected: float
    d_k: int
    source: str
    estimate: object
    cosine: _Cosine | None  # set where q and k are normalised (not at unit RMS) and no scale was declared
    unit_rms: bool = False  # q and k normalised to unit RMS (QK-norm): judged by 1/sqrt(d_k)
    split: bool = False  # the declared scale applied to q and to k each: q·k multiplied by its square
    stated: str = ""  # a factor on q·k the layer states beside its declared scale, said in the evidence
    parts: int = 1  # judged by 1/sqrt(parts x d_k): the products the scores sum (DeBERTa's 3)
    undecided: str = ""  # why neither reading can judge it: 1/sqrt(parts x d_k) is also the whole-width bug

    def outside(self) -> float:
        """How far (in log) the reading lies outside what is allowed: 0 inside (and where it is undecided)."""
        if self.undecided:
            return 0.0
        if self.cosine is not None:
            b = self.cosine.bound
            return max(0.0, math.log(COSINE_FLAT / b) if b > 0 else math.inf, math.log(b / COSINE_SHARP) if b > 0
                       else 0.0)
        return max(0.0, abs(math.log(abs(self.ratio) or 1e-300)) - math.log(SCALE_RATIO))


RMS_NORMED = 0.02
"""q and k normalised to unit RMS (an RMSNorm or LayerNorm over each head, the QK-norm of Flux, SD3, Qwen, OLMo 2):
every row's norm is sqrt(d_k), as an unnormalised row's is on average, so the scaled dot product's 1/sqrt(d_k) applies
and a missing scale reads as one (a cosine times d_k, not sqrt(d_k)). Rows within this relative distance of sqrt(d_k)
are judged by 1/sqrt(d_k); the norm's eps keeps them off it by at most 8.5e-5 in float32 and float64 and 2.7e-3 in
bfloat16 (diffusers' QK-norm layers at d_k = 8: margin 7x), while l2-normalised rows (cosine attention: Swin v2,
Restormer, nGPT), of norm 1, lie 0.29 away at d_k = 2 and 0.65 at d_k = 8 (margin 14x). A trained norm's gain moves
the rows off sqrt(d_k): then the layer's temperature is its own, judged by the cosine bounds. So is a scale the layer
passes to scaled_dot_product_attention itself, other than 1/sqrt(d_k) (vit-pytorch's NaViT: scale=1 after its
RMSNorm, "RMSNorm already includes sqrt(dim) scaling"): the same function as the missing scale, where the layer's
own words decide."""


NORMS_APART = 0.02
"""Normalised q and k: every query row's norm (and every key row's) within this relative distance of the others'.
A norm's eps pulls a small row under the rest, by eps / (2 r^2) for an RMSNorm of a row of RMS r: Gemma 4's ViT (timm,
RMSNorm eps 1e-6 with a learned gain at 1, then scale=1) spreads its rows by 2e-4 at init in float32, past ROW_SUM's
1e-4, and was judged by 1/sqrt(d_k), 8x too sharp. Unnormalised rows (Gaussian, 128 of them, 20 draws) spread by at
least 3.1x at d_k = 8, 1.46x at 64, 1.10x at 1,024 and 1.05x at 4,096 (margin 2.5x there)."""


def _cosine_bound(estimate, dtype, d_k: int) -> _Cosine | None:
    """Where q and k reach q·k normalised, every query row and every key row of one norm (QK-norm, cosine attention):
    the logit an aligned key gets, the scale q·k is multiplied by times both norms, and whether that norm is sqrt(d_k)
    (`RMS_NORMED`: unit RMS, then judged by 1/sqrt(d_k) as an unnormalised layer is). None otherwise."""
    m, f = getattr(estimate, "matmul", None), getattr(estimate, "fused", None)
    if m is not None and m.a.dim() >= 2 and m.b.dim() >= 2 and m.factor:
        norms = [m.a.double().norm(dim=-1), m.b.double().norm(dim=-2)]  # the queries' rows, the keys' (columns of k^T)
        per_product = estimate.applied / m.factor  # the factor of the product of these very operands
    elif f is not None and f.given is not None:
        norms = [f.q.double().norm(dim=-1), f.k.double().norm(dim=-1)]  # what the fused call was given
        per_product = f.given
    else:
        return None
    apart = max(tolerance(ROW_SUM, dtype), NORMS_APART)  # an RMS or L2 norm with a uniform gain, its eps
    if not all(n.numel() and float(n.min()) > 0 and float(n.max() / n.min()) < 1 + apart for n in norms):
        return None
    q_norm, k_norm = float(norms[0].mean()), float(norms[1].mean())
    # a fused call told another scale than 1/sqrt(d_k) in so many words keeps it as the layer's own temperature
    stated = f is not None and m is None and f.stated and abs(per_product * math.sqrt(d_k) - 1) > RMS_NORMED
    return _Cosine(abs(per_product) * q_norm * k_norm,
                   f"q and k reach q·k normalised (every query's norm {q_norm:.3g}, every key's {k_norm:.3g}), "
                   f"multiplied by {per_product:.4g}" + (" (the scale= the layer passes)" if stated else ""),
                   not stated and all(abs(n / math.sqrt(d_k) - 1) < RMS_NORMED for n in (q_norm, k_norm)),
                   per_product)


SCALE_IN_WORDS = re.compile(r"\bscal(?:e|ing)\b[^.\n]{0,24}?(?:=|:|\bof\b|\bis\b)\s*"
                            r"(\d+(?:\.\d+)?(?:e-?\d+)?)(?![\d/*^(]|\.\d)", re.IGNORECASE)
"""A scale stated in so many words in a docstring ("Attention scale = 1.0 (since QK are normalized)", Gemma 4's ViT
in timm; "scale of 1", a sentence's full stop after it): a plain number, not the start of an expression ("scale =
1/sqrt(d)")."""

SCALE_WORDS = 5e-3
"""How close (relative) a number the docstring states must be to the factor applied for the words to state it. The
factor is read from the graph, exactly (QK-norm by hand, float32 and bfloat16, torch's and GPT-2's init: 1.0 to the
last bit); the distance is the writing's: a number written to three significant digits lies within 5e-3 of the value
it rounds (0.354 for 1/sqrt(8) = 0.35355: 1.3e-3 off), and one 1% off states another number. Pinned from both sides
(tests/test_timm_causes.py: 1.004 for 1 counts, 1.006 does not)."""


def _stated_in_words(layer, cosine: _Cosine) -> _Cosine:
    """q and k at unit RMS multiplied by a number that the layer's docstring (its forward's or its class's own, not one
    it inherits) states as its scale: the layer's own temperature, judged by the cosine bounds as a `scale=` handed to
    scaled_dot_product_attention is. Unsaid, the same numbers are the missing scale (a QK-norm layer that dropped its
    1/sqrt(d_k)) and stay judged by 1/sqrt(d_k): the function is the same, so the layer's own words decide, never the
    audit's guess."""
    for module in (layer, getattr(layer, "inner", None)):
        if module is None:
            continue
        # its own words only: a docstring inherited from a parent class speaks for the parent
        fn = getattr(type(module), "forward", None) if isinstance(module, torch.nn.Module) else module
        texts = [getattr(fn, "__doc__", None), vars(type(module)).get("__doc__") if isinstance(module, torch.nn.Module)
                 else None]
        for text in map(inspect.cleandoc, filter(None, texts)):
            for found in SCALE_IN_WORDS.finditer(text):
                if math.isclose(float(found.group(1)), cosine.factor, rel_tol=SCALE_WORDS):
                    line = text[text.rfind("\n", 0, found.start()) + 1:].split("\n", 1)[0].strip()
                    return replace(cosine, unit_rms=False,
                                   seen=f"{cosine.seen}, the scale the layer states ({type(module).__name__}: "
                                        f"{line!r})")
    return cosine


def _stated_temperature(layer, factor: float, declared: float, cosine: _Cosine) -> _Cosine | None:
    """With a scale declared (the model audit reads a module's `scaling`, the number its attention kernel is given):
    where q and k reach q·k normalised and q·k is multiplied by `factor` times that scale, `factor` is the layer's own
    temperature if the layer holds it as a number (MuseSpark's `qk_scale_factor`, 5.473, multiplying q after its RMS
    norm), or holds its square root (the same number on q and on k): then the cosine bounds judge the logits it
    reaches. A factor the layer does not state (a missing or doubled scale) is judged against the declared scale as
    before, and so are q and k at unit RMS; so is a factor that is the declared scale again (applied twice), whatever
    attribute holds it. None: the declared scale judges."""
    if cosine.unit_rms:
        return None
    stated = _stated_factor(layer, factor, declared)
    if stated is None:
        return None
    return replace(cosine, seen=f"{cosine.seen}; {stated[2]:.4g} in those norms is the layer's own temperature "
                                f"({stated[0]}.{stated[1]}), beside the declared scale")


STATED_NAMES = ("scale", "temperature", "factor")
"""Where q and k are not normalised, the words an attribute's name must hold for its number to count as the layer's
own factor on q·k (LongCat-Flash's `mla_scale_q_lora`): a dropout probability or a norm's eps that happens to equal
a wrong factor is not one."""


def _stated_factor(layer, factor: float, declared: float, names: tuple[str, ...] = ()) -> tuple[str, str, float] | None:
    """(the class, the attribute, its value) of a number the layer holds that is `factor` (the applied scale over the
    declared one), or its square root (the same number on q and on k), under a name holding one of `names` (any name
    where none are given); None where none is, or where the factor is 1 or the declared scale again, its square root or
    its inverse (a scale applied twice, or a missing one: sqrt(d_k)), whatever attribute holds it."""
    if math.isclose(factor, 1.0, rel_tol=1e-6) or any(
            math.isclose(factor, d, rel_tol=1e-6) for d in (declared, math.sqrt(declared), 1 / declared)):
        return None
    for module in (layer, getattr(layer, "inner", None)):
        for name, value in (vars(module).items() if isinstance(module, torch.nn.Module) else ()):
            if isinstance(value, float) and value > 0 and (not names or any(n in name.lower() for n in names)) \
                    and any(math.isclose(value, f, rel_tol=1e-6) for f in (factor, math.sqrt(abs(factor)))):
                return type(module).__name__, name, value
    return None


def _split_over_q_and_k(applied: float, declared: float, d_k: int) -> bool:
    """Whether the declared scale is d_k ** -0.25, applied to q and to k each, so that q·k is multiplied by its
    square, 1/sqrt(d_k) (OpenAI's privacy filter: `scaling = head_dim ** -0.25` on both, the attention call given 1):
    the declared scale squared is 1/sqrt(d_k) and the applied factor matches it. A standard scale applied twice
    (1/d_k) is not: its square is not 1/sqrt(d_k)."""
    square = declared * declared  # a declared power of d_k: exact up to float rounding
    return math.isclose(square * math.sqrt(d_k), 1.0, rel_tol=1e-6) and 1 / SCALE_RATIO <= applied / square <= SCALE_RATIO


def _judged_cosine(r: _Reading, base: Call) -> DetectorResult:
    """Normalised q and k: the temperature is the layer's own, judged by the logits it lets q·k reach (a cosine times
    the scale and both norms), not by 1/sqrt(d_k), which is for unnormalised q and k whose q·k grows with d_k."""
    det, b = "softmax_saturation", r.cosine.bound
    evidence = (f"{r.cosine.seen} ({r.source}): a key aligned with its query gets a logit of {b:.3g}, one opposed "
                f"-{b:.3g} (allowed {COSINE_FLAT:g} to {COSINE_SHARP:g}){_entropy_text(base, 1.0, r.applied, None)}")
    if b < COSINE_FLAT:
        return result(det, "fail", f"softmax is too flat for normalised q and k: q·k is a cosine in [-1, 1] and its "
                                   f"logits stay within ±{b:.3g}, so no key can take more than {math.exp(2 * b):.3g}x "
                                   f"the weight of another", value=b, threshold=COSINE_FLAT, evidence=evidence,
                      replay=base, fix=f"multiply the cosine by a temperature of the layer's own, not by 1/sqrt(d_k) "
                                       f"= {1 / math.sqrt(r.d_k):.3g} (that is for q and k left unnormalised): a "
                                       f"learned one (Swin v2: logit_scale = log(10), clamped at log(100), then exp()) "
                                       f"or sqrt(d_k) = {math.sqrt(r.d_k):.3g}")
    if b > COSINE_SHARP:
        return result(det, "fail", f"softmax is too sharp for normalised q and k: a cosine multiplied by "
                                   f"{b:.4g} saturates the weights onto the best-aligned key", value=b,
                      threshold=COSINE_SHARP, evidence=evidence, replay=base,
                      fix=f"keep the temperature of the cosine at or under {COSINE_SHARP:g} (Swin v2 clamps its "
                          f"learned logit scale at log(100) before exp())")
    return result(det, "pass", f"q and k are normalised: the softmax temperature is the layer's own, and a cosine "
                               f"times {b:.3g} is neither flat nor saturated", value=b, threshold=COSINE_SHARP,
                  evidence=evidence)


def _entropy_text(call: Call, ratio: float, expected: float, estimate) -> str:
    """The mean entropy of the weights the layer used (its last softmax), and of the weights a correct scale
    gives: softmax(expected * q·k) over the keys the layer gave weight, from the observed q·k matmul; without
    one, softmax(log w / ratio) (log w is the scaled logits shifted per row: exact for one softmax)."""
    if call.record is None or not call.record.softmaxes:
        return ""
    w = call.record.softmaxes[-1].output
    flat = w.reshape(-1, w.shape[-1])[:ENTROPY_ROWS].double()  # a sample of rows: a mean needs no more
    keep = (flat.sum(-1) > 0.5) & torch.isfinite(flat).all(-1)  # rows that attend somewhere
    if not bool(keep.any()):
        return ""

    def entropy(p: Tensor) -> float:
        return float(-(p * p.clamp_min(1e-300).log()).sum(-1)[keep].mean())

    text = f"; mean weight entropy {entropy(flat):.3g} nats"
    m = getattr(estimate, "matmul", None)
    if m is not None and m.out.numel() == w.numel() and m.factor:
        qk = m.out.reshape(-1, w.shape[-1])[:ENTROPY_ROWS].double() / m.factor  # (rows, Tk)
        logits = torch.where(flat > 0, expected * qk, torch.full_like(qk, -math.inf))
        text += f", {entropy(torch.softmax(logits, -1).nan_to_num(0.0)):.3g} at the expected scale"
    elif math.isfinite(ratio) and ratio > 0:
        text += f", {entropy(torch.softmax(flat.clamp_min(1e-300).log() / ratio, -1)):.3g} at the expected scale"
    return text + f" (uniform over {w.shape[-1]} keys: {math.log(w.shape[-1]):.3g})"
