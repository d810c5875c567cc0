"""audit(): run every detector on a layer and leave the layer, the RNG and the inputs as they were."""

from __future__ import annotations

import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import replace

import torch

from ._errors import expect
from ._guard import compiled_simply, denormals_flushed, registries, untouched
from ._memory import check_memory
from ._probe import Probe
from ._progress import default_progress
from ._registry import NOT_APPLICABLE, phrase, run
from ._report import CORE, NEEDS_DECLARATION, AuditReport
from ._result import DetectorResult, Sites
from ._subject import check_seq_len, make_subject, spell
from ._thresholds import dtype_name
from ._tracing import unique
from .detectors import DETECTORS
from .detectors.runs import raised_at_probe_length, runs_verdict
from .patterns import as_pattern


@compiled_simply
def audit(layer, *, causal: bool = False, d_model: int | None = None, num_heads: int | None = None,
          scale: float | None = None, seq_len: int | None = None, device=None, dtype=None, seed: int = 0,
          need_weights: bool = True, detectors: list[str] | None = None, require: list[str] | None = None,
          strict: bool = False, progress=None, mask=None, layout: str | None = None,
          pattern=None, call=None, cross: bool = False, positions: str | None = None, queries: int | None = None,
          _options: dict | None = None) -> AuditReport:
    """Run the detectors on `layer` and return an `AuditReport` whose `status` is "passed", "failed" or
    "inconclusive" (the core properties, weight row sums and softmax temperature, were not measured).

    `layer`: a function f(q, k, v, mask=None) on (B, H, T, d) tensors; a module m(query, key, value,
    mask=None) or m(x[, mask]) on (B, T, D); or torch.nn.MultiheadAttention. Outputs may be `out` or
    `(out, weights)`. Masks passed to functions and modules are bool (B, 1, Tq, Tk), True = may attend.
    `causal=True`: the layer promises causality; a layer that takes a mask (and has no truthy `causal` /
    `is_causal` attribute saying it builds its own) is given causal masks. `scale`: the softmax scale the
    layer declares, if not 1/sqrt(d_k). `seq_len`: probe length (default 16; audit at your context
    length). `require`: detector ids that must measure the layer: a skip of one of them is a failure.
    `strict=True`: every detector that applies to the layer must measure it (a "not measured" skip fails;
    one whose needs do not hold, e.g. future_leakage without causal=True, stays a skip). `progress`:
    a callable(detector_id, index, total) called before each detector; None (the default): a tqdm-style bar on
    stderr where it is a terminal and the audit is estimated long (`_progress`); False: nothing. `_options`: for front ends, how the user
    spells each option ({"causal": "--causal"}), used in the messages. `mask`: the convention the layer
    takes its mask in, a meaning and a shape (`diagnostics.MaskConvention`, or its spelling): "allowed" (bool
    (B, 1, Tq, Tk), True = may attend; the default), "blocked" (True = blocked), "additive" (float, 0 keep, large
    negative block), "key_padding" ((B, Tk) bool, True = padding), "key_keep" ((B, Tk), True = keep), or
    MEANING:SHAPE such as "additive:B,Tq,Tk", "blocked:B*H,Tq,Tk", "allowed:Tq,Tk"; library layers' own
    conventions are known, and so is one the layer states (a `key_padding_mask` parameter, its docstring).
    `layout`: a function's tensors, "bhtd" (default) or "bthd"; a module's tokens, "btd" (default) or "tbd"
    (sequence first, (T, B, D), read from the layer where it says so: a docstring's (T, B, D), `batch_first` False;
    its output is read back as (B, T, D)). `call`: how to call a layer whose inputs have
    names the audit cannot know, `call(layer, x[, mask])` (self-attention), `call(layer, query, memory[, mask])`
    (cross-attention) or `call(layer, query, key, value[, mask])`, e.g. `call=lambda layer, x, memory, mask:
    layer(x, xa=memory, mask=mask)`; for a function, `call(f, q, k, v[, mask])`. `cross=True`: the layer is
    cross-attention, so a raise when the memory's length differs from the query's is a failure; otherwise a layer
    that runs with Tq = Tk and raises only with Tq != Tk is audited as self-attention only (those probes skip,
    saying so).
    `pattern`: the attention pattern the layer promises, a `diagnostics.patterns` pattern (`sliding_window(W)`,
    `chunked(C)`, `prefix_lm(P)`, `document(ids)`, combined with & and |) or a mask_mod(b, h, q_idx, kv_idx);
    a layer that takes a mask is given the pattern's mask, and `attention_pattern` measures which keys each
    output row depends on against it. `positions`: "absolute" for a layer that adds absolute position embeddings
    itself (then `relative_positions` does not apply), "relative" to say that its positions are meant to be relative.
    `queries`: the layer attends with Q queries of its own (a pooling head's learned query, Set Transformer's PMA
    seeds, Perceiver's latent array), not one per token: its output is (B, Q, D), or (B, D) where Q = 1; the weights
    are read over (Q, Tk) and masks reach it per key (padding), as no query is a token's.
    """
    expect(isinstance(causal, bool), "causal=True or causal=False", f"causal={causal!r}",
           "pass a bool: causal=True if the layer promises causality")
    expect(seq_len is None or (isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 1),
           "an int seq_len >= 1", f"seq_len={seq_len!r}", "pass the context length you train with, e.g. seq_len=128")
    expect(scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0),
           "a positive scale or None", f"scale={scale!r}", "pass the factor your layer multiplies q·k by, e.g. scale=1.0")
    expect(detectors is None or (isinstance(detectors, (list, tuple)) and all(isinstance(d, str) for d in detectors)),
           "detectors: a list of detector ids", f"detectors={detectors!r}", f"e.g. detectors={list(DETECTORS)[:2]}")
    expect(progress is None or progress is False or callable(progress),
           "progress a callable(detector_id, index, total), None (a bar on a terminal for long audits) or False",
           f"progress={progress!r} ({type(progress).__name__})",
           'pass a function, e.g. progress=lambda det, i, n: print(f"{i}/{n} {det}"), or leave progress out')
    chosen = list(DETECTORS) if detectors is None else list(detectors)
    required = list(require or [])
    unknown = [d for d in chosen + required if d not in DETECTORS]
    expect(not unknown, f"detector ids from {sorted(DETECTORS)}", f"{unknown}", "check the spelling")
    expect(pattern is None or callable(pattern), "pattern: a diagnostics.patterns pattern or a mask_mod",
           f"pattern={pattern!r}", "pass e.g. pattern=diagnostics.patterns.sliding_window(4)")
    pattern = None if pattern is None else as_pattern(pattern)
    expect(positions in (None, "relative", "absolute"), 'positions "absolute", "relative" or None',
           f"positions={positions!r}", 'pass positions="absolute" for a layer that adds absolute position embeddings itself')
    not_chosen = [d for d in required if d not in chosen]
    expect(not not_chosen, "required detectors among those run", f"require={not_chosen} not in detectors",
           "add them to detectors=[...] or drop them from require")
    expect(isinstance(cross, bool), "cross=True or cross=False", f"cross={cross!r}",
           "pass cross=True if the layer is cross-attention (its memory may be longer or shorter than the query)")
    subject = make_subject(layer, d_model=d_model, num_heads=num_heads, device=device, dtype=dtype,
                           need_weights=need_weights, mask=mask, layout=layout, call=call, cross=cross,
                           queries=queries, options=_options)
    # its queries are no token's: no order between them and the keys for a causal mask or a pattern to follow
    for name, given, example in (("causal", causal, True), ("pattern", pattern is not None, "...")):
        expect(queries is None or not given, f"queries or {name}, not both", f"{spell('queries', queries, _options)} "
               f"with {spell(name, example, _options)}", f"leave {name} out: the layer's {queries} queries of its own "
               f"have no position among the tokens, so no key is in their future or outside their window")
    seq_len = check_seq_len(subject, seq_len, options=_options)  # within the context the layer declares
    check_memory(subject, seq_len, options=_options)  # refused before anything runs if it would not fit
    bar = default_progress(subject, seq_len) if progress is None else None  # a terminal's bar for a long audit
    progress = bar if progress is None or progress is False else progress
    probe = Probe(subject, causal=causal, scale=scale, seq_len=seq_len, seed=seed, options=_options, pattern=pattern,
                  cross=cross)
    probe.positions = positions  # read by detectors/positions.declared_positions
    probe.chosen = tuple(chosen)  # `runs` leaves to output_shape and weight_row_sums the shapes they probe
    started = time.perf_counter()
    measured: dict[str, DetectorResult] = {}
    with untouched(layer, subject.device) as as_given, denormals_flushed(), bar or nullcontext():
        probe.as_given = as_given
        for n, det_id in enumerate(chosen):
            if progress is not None:
                progress(det_id, n, len(chosen))
            probe.detector = det_id
            measured[det_id] = _run_one(DETECTORS[det_id], probe, _options)
        if measured.get("runs") is not None and (measured["runs"].verdict in ("pass", "fail")
                                                 or measured["runs"].declaration):
            # settled last: besides its own probes, it reports every other detector's probe that raised
            measured["runs"] = replace(runs_verdict(probe), probes=measured["runs"].probes)
        elif measured.get("runs") is not None and "length_rule" in measured["runs"].extras:
            # a length the layer refuses: settled last where other probes show a mask convention to declare, or
            # raised at the probe's own length, which the layer takes (a mask it refuses in every convention); a
            # raise at another multiple of its rule stays the skip (an image adapter's 3 x 4 map for 12 tokens)
            settled = runs_verdict(probe)
            # a measured rule is settled on every call: a later raise at a multiple of it, or in another line, is no
            # refusal of the rule, and the lengths it refused are said as they are at the end
            if settled.declaration or settled.verdict == "fail" and raised_at_probe_length(probe) or \
                    measured["runs"].extras.get("measured"):
                measured["runs"] = replace(settled, probes=measured["runs"].probes)
        measured = under_a_mask_undeclared(consequences(measured))
        probe.as_left = registries(layer)  # what the calls left in the layer, for a locator's replay (lazy: after)
        measured = localise(probe, measured, layer, subject.device)  # findings only, found when first read
        base = probe.base()
    results = [_settled(measured[d], d in required, strict, _options) for d in chosen]
    status, reason = _status(results, probe, base, _options)
    zeros = _zero_gates(layer, base) if status != "failed" else []  # none left in the copy: no second round
    if zeros:
        try:
            drawn = copy.deepcopy(layer)
        except Exception as exc:  # a layer that cannot be copied: its zeros stay, and so does what they hide
            drawn = None
            status, reason = "inconclusive", (
                f"inconclusive: the output is zero everywhere while {', '.join(zeros)} "
                f"{'are' if len(zeros) > 1 else 'is'} all zero (a zero gate or output projection), and the layer "
                f"could not be copied to draw them ({type(exc).__name__}); audit it with them drawn: "
                f"torch.nn.init.normal_(p, std=0.02) on each")
        if drawn is not None:
            probe.release()
            return _audited_with_gates_drawn(drawn, zeros, seed, dict(
                causal=causal, d_model=d_model, num_heads=num_heads, scale=scale, seq_len=seq_len, device=device,
                dtype=dtype, seed=seed, need_weights=need_weights, detectors=detectors, require=require,
                strict=strict, progress=False, mask=mask, layout=layout, pattern=pattern, call=call, cross=cross,
                positions=positions, queries=queries), _options)
    weights, source = probe.weights(base) if base.ok else (None, "")
    probe.release()  # a report kept for its findings' sites keeps the probe, not the standard probe's record
    return AuditReport(layer=subject.describe(), results=results, causal=causal, seq_len=probe.t,
                       dtype=dtype_name(subject.dtype), device=str(subject.device), forward_passes=probe.passes,
                       seconds=time.perf_counter() - started,
                       settings={"form": subject.form, "d_model": subject.d_model, "num_heads": subject.num_heads,
                                 "takes_mask": subject.takes_mask, "pass_causal_mask": probe.pass_causal_mask},
                       weights=None if weights is None else weights.detach().cpu(), weights_source=source,
                       status=status, status_reason=reason)


def _zero_gates(layer, base) -> list[str]:
    """The trainable parameters of `layer` whose every entry is 0, where the standard probe's output is 0 everywhere
    because of them: a zero-initialised gate or output projection (DiT's adaLN-Zero, Flamingo's tanh gate at 0,
    ControlNet's zero convolutions) starts the layer as nothing, by design, and hides every output-level property
    (masks, locality, causality, batch independence: "not measured") of the attention behind it. [] otherwise: a
    function, a layer whose output is not all zero, or one whose zeros are frozen (then they stay zero)."""
    if not isinstance(layer, torch.nn.Module) or not base.ok or base.output is None:
        return []
    out = base.output.out
    if not isinstance(out, torch.Tensor) or not out.numel() or bool(out.detach().any()):
        return []
    return [name for name, p in layer.named_parameters() if p.requires_grad and p.numel() and p.is_floating_point()
            and not bool(p.detach().any())]


def _audited_with_gates_drawn(copy_, zeros: list[str], seed: int, kwargs: dict, options: dict | None) -> AuditReport:
    """The audit of `copy_`, a deep copy of the user's layer, with its all-zero parameters (`zeros`) drawn from
    N(0, 1/fan_in) (seeded by the audit's seed; the user's layer is not touched), so that the attention behind a zero
    gate is measured; the report says which were drawn and why."""
    params = dict(copy_.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in zeros:
            p = params[name]
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)).to(p.dtype))
    report = audit(copy_, **kwargs, _options=options)
    why = (f"; audited with {', '.join(zeros)} drawn from N(0, 1/fan_in) in a copy: all zero at its initialisation "
           f"(a zero-initialised gate or output projection), {'they' if len(zeros) > 1 else 'it'} made the output zero "
           f"everywhere and hid the attention behind {'them' if len(zeros) > 1 else 'it'}")
    report.layer += why
    report.settings["drawn"] = tuple(zeros)
    return report


def consequences(measured: dict[str, DetectorResult]) -> dict[str, DetectorResult]:
    """A finding that follows from another (its evidence names the detectors whose failure explains it, as
    `replay.consequence_of`) says so, and its fix points at the first cause."""
    out = dict(measured)
    for det_id, result in measured.items():
        causes = [c for c in getattr(result.replay, "consequence_of", ()) if c in measured and measured[c].verdict == "fail"]
        if result.fired and causes:
            out[det_id] = replace(result, message=f"{result.message} (a consequence of {', '.join(causes)})",
                                  fix=f"fix {causes[0]} first: this finding follows from it ({measured[causes[0]].fix})")
    return out


def under_a_mask_undeclared(measured: dict[str, DetectorResult]) -> dict[str, DetectorResult]:
    """Where the mask's convention needs a declaration (`mask_honoured` or `runs` found the layer taking its mask in
    another convention than the one the audit gave, which nothing declared or stated), a failure of another detector
    whose every probe gave the layer a mask in that convention says nothing yet of the layer (a mask of True = blocked
    read as True = may attend blocks every key of an unmasked row, whose NaN fully_masked_rows then sees spread): it
    needs the same declaration, never a FAIL. Failures on a probe without a mask stand."""
    needed = next((r for r in measured.values() if r.declaration and r.extras.get("mask_convention")), None)
    if needed is None:
        return measured
    out = dict(measured)
    for det_id, result in measured.items():
        if result.verdict == "fail" and result.probes and all(p.allowed is not None for p in result.probes):
            out[det_id] = replace(result, verdict="skip", declaration=needed.declaration,
                                  message=f"needs a declaration, {needed.declaration}: every probe of {det_id} gave the "
                                          f"layer its mask in a convention it does not take (see {needed.detector}), "
                                          f"so this reading says nothing of the layer yet: {result.message}",
                                  fix=f"audit with {needed.declaration} if that is the layer's convention (see "
                                      f"{needed.detector}), and this detector measures it again")
    return out


LOCALISE = os.environ.get("ATTENTION_AUDIT_WHERE", "1") != "0"
"""ATTENTION_AUDIT_WHERE=0 skips pointing at lines (findings then have no `where`): for timing what it costs."""


def localise(probe: Probe, measured: dict[str, DetectorResult], layer, device) -> dict[str, DetectorResult]:
    """Each failed or warned result with `where` to be found when first read (a `Sites`): then its detector's
    localiser replays the result's own evidence (`replay`: the inputs and calls its verdict was computed on) under
    a tracer, with `layer` in eval mode and its parameters, buffers, grads and the RNG restored afterwards, as
    during the audit. A passing audit makes no call; a report whose sites nobody reads makes none either."""
    if not LOCALISE:
        return measured
    out = dict(measured)
    for det_id, result in measured.items():
        locate = DETECTORS[det_id].locate if det_id in DETECTORS else None
        if result.verdict in ("fail", "warn") and locate is not None:
            out[det_id] = replace(result, where=Sites(resolve=lambda locate=locate, result=result:
                                                      _sites(probe, locate, result, layer, device)))
    return out


def _sites(probe: Probe, locate, result: DetectorResult, layer, device) -> tuple:
    try:
        with untouched(layer, device):
            return unique(locate(probe, result))
    except Exception:  # noqa: BLE001 -- pointing at the line must never cost the report its verdicts
        return ()


def _run_one(det, probe: Probe, options: dict | None) -> DetectorResult:
    """One detector's result (the registry's `run`), with the probes it made."""
    return replace(run(det, probe, options), probes=tuple(probe.shapes.get(det.id, ())))


def _settled(result: DetectorResult, required: bool, strict: bool, options: dict | None) -> DetectorResult:
    """A skip becomes a failure where the user demanded a measurement."""
    if result.verdict != "skip":
        return result
    applicable = not result.message.startswith(NOT_APPLICABLE)
    if required or (strict and applicable):
        why = phrase("{require}" if required else "{strict}", options)
        return replace(result, verdict="fail", message=f"required but {result.message}",
                       evidence=f"{why} demands that {result.detector} measures the layer",
                       fix="make the layer measurable by this detector (see the message), or drop the requirement")
    return result


def _status(results: list[DetectorResult], probe: Probe, base, options) -> tuple[str, str]:
    declared = next((r for r in results if r.declaration), None)
    if any(r.verdict == "fail" for r in results):
        failed = [r.detector for r in results if r.verdict == "fail"]
        also = f"; and it {NEEDS_DECLARATION}: audit with {declared.declaration}" if declared is not None else ""
        return "failed", f"failed: {', '.join(failed)}{also}"
    if not results:
        return "inconclusive", "inconclusive: no detector was run"
    if declared is not None:  # the layer ran under another convention: not a defect, and nothing failed
        return "inconclusive", (f"inconclusive, {NEEDS_DECLARATION}: audit with {declared.declaration} "
                                f"({declared.detector}: {declared.message})")
    errors = [r.detector for r in results if r.verdict == "error"]
    if errors:
        return "inconclusive", f"inconclusive: {', '.join(errors)} crashed (an internal error of diagnostics)"
    if not any(r.measured for r in results):
        if probe.not_taken is not None:  # the layer as held (in place) could not be given the audit's probes
            return "inconclusive", f"inconclusive: not one probe could be given to the layer as held: {probe.not_taken_text()}"
        runs = next((r for r in results if r.detector == "runs" and r.verdict == "skip"), None)
        why = f" (runs: {runs.message})" if runs is not None and runs.message.startswith("not measured: the layer "
                                                                                          "raised") else ""
        return "inconclusive", f"inconclusive: no detector could measure the layer (every one skipped){why}"
    core = [r for r in results if r.detector in CORE]
    # one core property that does not apply where the other was measured (no temperature where a kernel's weights
    # were read: linear attention) leaves the attention measured
    measured = any(r.measured for r in core)
    unmeasured = [r for r in core if not r.measured and not (measured and r.message.startswith(NOT_APPLICABLE))]
    if unmeasured:
        why = "; ".join(f"{r.detector}: {r.message}" for r in unmeasured)
        # what to do: where a property states no remedy (no weights seen), make the weights observable; then each
        # skip's own remedy (a temperature beside relative-position terms, which no declaration measures)
        todo = ["return the weights as (out, weights), or use a softmax or torch's scaled_dot_product_attention"
                ] if any(not r.fix for r in unmeasured) else []
        todo += list(dict.fromkeys(r.fix for r in unmeasured if r.fix))
        return "inconclusive", (f"inconclusive: the attention itself was not measured ({why}). "
                                + "; ".join(t[0].upper() + t[1:] if i == 0 else t for i, t in enumerate(todo)))
    return "passed", ""


def assert_attention_ok(layer, **kwargs) -> AuditReport:
    """For users' own tests: audit the layer and raise `AttentionAuditError` (with the report) on failure."""
    __tracebackhide__ = True
    report = audit(layer, **kwargs)
    report.raise_for_findings()
    return report
