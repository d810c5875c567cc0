"""audit_model(): every attention layer of a model audited in place, plus the properties only a model has.

1. **Find** the attention modules (`_find`): by class, or by the softmax over (Tq, Tk) scores or fused SDPA call
   they run in one observed forward.
2. **Capture** what the model really passes each of them, at the audit's length T and at T - 1, and audit each
   with `diagnostics.audit()` through an in-place wrapper (`_inplace`): the model's call is the convention.
3. **Model-level detectors** (`MODEL_DETECTORS`, one module per family in this package), on the model's own
   outputs, each run by the registry's `run()` with its needs and the one crash rule: an exception raised in the
   user's model is a finding about it, one raised in diagnostics' own code an `error` that makes the audit
   inconclusive. Parity tolerances: `_tolerance`.

The model, its modes, parameters, buffers, gradients, attention implementation and the global RNG are left as
they were (`_guard.untouched`). A model that raises on the audit's inputs is a finding (`model_runs`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from .. import detectors  # noqa: F401  (fills the layer registry, DETECTORS)
from .._audit import audit
from .._errors import AuditUsageError, expect
from .._guard import compiled_simply, seed_rng, untouched
from .._registry import DETECTORS, MODEL_DETECTORS, run
from .._report import NEEDS_DECLARATION
from .._result import DetectorResult, Sites
from .._subject import spell
from .._thresholds import dtype_name
from . import causality, gradients, runs, window  # registered (with the others) by the package's MODULES
from ._causal import declared_causal, infer_causal
from ._context import ModelContext
from ._find import class_kind, compiled_paths, find_attention, observe_attention
from ._inplace import BOTH as BOTH_READINGS
from ._inplace import build_in_place, capture_calls, declared_scale
from ._report import ModelReport
from ._runner import Runner, device_dtype, float_dtype, model_context
from ._towers import merged, together, towers


ONE_TOKEN = "one key: weight 1 whatever the scale, the mask or the softmax's axis"


def model_status(results, layers, found, *, layers_chosen: bool = True, causal: bool = False,
                 unaudited: tuple = (), single: tuple = (), stacks: tuple | None = None) -> tuple[str, str]:
    """("passed" | "failed" | "inconclusive", why). `single`: the layers the model gives one token, one key.
    `stacks`: the parts of the model that take its attention layers' sequence alone (`sequence_parts`), where its
    own input is no sequence; None where that was not looked for."""
    failed = [r.detector for r in results if r.verdict == "fail"]
    failed_layers = [p for p, rep in layers.items() if rep.status == "failed"]
    if failed or failed_layers:
        per_layer = [f"{p} ({', '.join(r.detector for r in rep.results if r.verdict == 'fail')})"
                     for p, rep in layers.items() if rep.status == "failed"]
        return "failed", "failed: " + ", ".join(failed + per_layer)
    ran = next((r for r in results if r.detector == runs.ID), None)
    if ran is not None and ran.verdict == "skip":
        return "inconclusive", f"inconclusive: {ran.message} ({ran.evidence})"
    if not found:
        return "inconclusive", ("inconclusive: no attention module was found (no torch, timm or Hugging Face attention "
                                "class, and no softmax over (Tq, Tk) scores or fused attention observed)")
    if unaudited and layers_chosen:
        return "inconclusive", f"inconclusive: {', '.join(unaudited)} could not be audited in place (see the notes)"
    mixers = [f.path for f in found if getattr(f, "mixer", False)]
    if not layers and layers_chosen and mixers and len(mixers) == len(found):
        return "inconclusive", (f"inconclusive: no softmax attention to audit: {', '.join(mixers[:3])}"
                                f"{' ...' if len(mixers) > 3 else ''} compute no attention weights over the tokens (a "
                                f"recurrence, linear attention); the model-level checks watched them")
    if not layers and layers_chosen:
        return "inconclusive", "inconclusive: no attention module was audited"
    errors = [r.detector for r in results if r.verdict == "error"]
    if errors:
        return "inconclusive", f"inconclusive: {', '.join(errors)} crashed (an internal error of diagnostics)"
    if not layers_chosen and not any(r.measured for r in results if r.detector != runs.ID):
        return "inconclusive", "inconclusive: no chosen detector could measure the model (every one skipped)"
    # a layer given one token attends one key with weight 1 whatever its scale, mask or softmax axis: nothing it did
    # there earns the model's pass, and "use a softmax" where it was inconclusive is the wrong fix (EfficientViT-M's
    # last stage at 64 px: one pixel); it fails where it fails (above), else the other layers decide, and where
    # there are none, the model is inconclusive (torch's nn.MultiheadAttention on one token passed)
    alone = [p for p in layers if p in single]
    if alone and len(alone) == len(layers):
        return "inconclusive", (f"inconclusive: {', '.join(alone)} {'sees' if len(alone) == 1 else 'see'} one token "
                                f"on this example ({ONE_TOKEN}): give the model a larger input (a larger image, a "
                                f"longer sequence)")
    open_layers = [p for p, rep in layers.items() if rep.status == "inconclusive" and p not in alone]
    if open_layers:
        first = layers[open_layers[0]].status_reason.removeprefix("inconclusive: ")
        return "inconclusive", f"inconclusive: {', '.join(open_layers)} could not be measured ({first})"
    prefix = next((r for r in results if r.detector == causality.ID), None)
    if causal and prefix is not None and not prefix.measured:
        todo = ""
        if stacks is not None and "not a sequence" in prefix.message:
            todo = (": audit the part that holds its attention layers on its own, given a sequence, as " + " and ".join(
                f"audit_model(model.{p}, example=<(B, T, {d}) embeddings>, causal=True)" for p, d in stacks)
                    if stacks else ": no part of the model takes its attention layers' sequence alone (a module "
                                   "called with (B, T, D) embeddings of their width); each layer was audited in place "
                                   "as causal")
        return "inconclusive", (f"inconclusive: the model is causal, but its causality was not measured "
                                f"({prefix.message}){todo}")
    return "passed", ""


def sequence_parts(model: nn.Module, runner, wrappers: dict) -> tuple:
    """((path, width), ...): for each stack of attention layers (the layers under one list: `encoder.layers.0.attn`,
    `encoder.layers.1.attn`), the outermost module above them, the model excepted, that the model calls with a float
    (B, T, D) tensor of the layers' width: the part that takes their sequence alone (Mimi's `encoder_transformer`,
    whose model takes a waveform). Found by one forward of the model on its example with a hook on each candidate;
    a stack with no such module names none."""
    groups: dict = {}
    for p, w in wrappers.items():
        parts = p.split(".")
        cut = next((i for i, name in enumerate(parts) if name.isdigit()), len(parts) - 1)
        groups.setdefault(tuple(parts[:cut]), set()).add(int(w.d_model))
    named = dict(model.named_modules())
    above = {g: [".".join(g[:i]) for i in range(1, len(g) + 1) if ".".join(g[:i]) in named] for g in groups}
    seen: dict = {}

    def hook(path):
        def pre(module, args, kwargs):
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            seen.setdefault(path, None if x is None else (x.dim(), x.is_floating_point(), int(x.shape[-1])))
        return pre

    handles = [named[p].register_forward_pre_hook(hook(p), with_kwargs=True) for p in set().union(*above.values())]
    try:
        with untouched(model, device_dtype(model)[0]), torch.no_grad():
            runner(runner.inputs)
    except Exception:  # noqa: BLE001 -- the advice is the audit's; a model that raises here gets none
        return ()
    finally:
        for h in handles:
            h.remove()
    stacks = []
    for g, widths in groups.items():
        part = next((p for p in above[g] if seen.get(p) is not None and seen[p][:2] == (3, True)
                     and seen[p][2] in widths), None)
        if part is not None and (part, seen[part][2]) not in stacks:
            stacks.append((part, seen[part][2]))
    return tuple(stacks)


def _one_token(wrapper) -> bool:
    """Whether the model gives the layer in place one query and one key (a cross-attention's memory counts)."""
    return wrapper.block_size == 1 and getattr(wrapper, "memory_length", 1) == 1


def _unused_by_design(ctx: ModelContext, path: str, rep) -> str:
    """The parameters a layer's in-place parameters_used found unused, where the model uses each by design
    (`gradients.unused_by_design`: at a longer length, a sparse indexer, a compressor; or behind a factor that is 0
    at this initialisation), each with why; '' if not all are."""
    found = next((r for r in rep.results if r.detector == "parameters_used" and r.verdict == "fail"), None)
    unused = getattr(getattr(found, "replay", None), "unused", None)
    if not unused:
        return ""
    names = [f"{path}.{name.removeprefix('inner.')}" for name, _ in unused]
    why = gradients.unused_by_design(ctx, names)
    if not all(why.values()):
        return ""
    return ", ".join(f"{n} ({why[n]})" for n in names[:4]) + (" ..." if len(names) > 4 else "")


def _set_aside(result: DetectorResult, said: str) -> DetectorResult:
    """The temperature finding of a layer whose scale attribute `declared_scale` set aside as the bug itself: its fix,
    and each site's (read when the sites are), also says where that number came from and the other reading."""
    sites = result.where
    return replace(result, fix=f"{result.fix}; {said}",
                   where=Sites(resolve=lambda: [replace(s, fix=f"{s.fix}; {said}") if s.fix else s for s in sites]))


def _undecided(rep, said: str) -> None:
    """A layer whose scale attribute is a legitimate scale and the bug at once (`_inplace.BOTH`): a temperature found
    off 1/sqrt(d_k) is not measured but asks for the declaration that decides, and the layer is then inconclusive
    where nothing else failed; a temperature at 1/sqrt(d_k) passes as it is."""
    value = said.split(" = ", 1)[1].split(" ", 1)[0]
    declare = f"scale={value}"
    rep.results = [replace(r, verdict="skip", message=f"not measured: {said}", declaration=declare, fix="", where=())
                   if r.detector == "softmax_saturation" and r.verdict == "fail" else r for r in rep.results]
    if rep.status == "failed" and not any(r.verdict == "fail" for r in rep.results):
        rep.status = "inconclusive"
        rep.status_reason = f"inconclusive, {NEEDS_DECLARATION}: audit with {declare} (softmax_saturation: {said})"


@compiled_simply
def audit_model(model, example=None, *, causal: bool | None = None, seq_len: int | None = None, seed: int = 0,
                detectors: list[str] | None = None, progress=None, packed: bool | None = None,
                _options: dict | None = None) -> ModelReport:
    """Audit a whole model: find its attention modules, audit each in place with the arguments the model passes
    it, and run the model-level detectors (`MODEL_DETECTORS`). Returns a `ModelReport` (status "passed",
    "failed" or "inconclusive"; `findings` each with `.layer`, the module path, or None for the model).

    `example`: token ids (B, T), embeddings (B, T, D), or a dict of the model's inputs; None builds one from the
    model (a Hugging Face config's `vocab_size` or image size, an nn.Embedding, torch's transformer stacks).
    `causal`: None infers it (a causal-LM class, `config.is_decoder`, an encoder-decoder's decoder, a truthy
    `model.causal`), else the report says it assumed non-causal. `seq_len`: the audit's length (default: the
    example's, else min(16, the model's context)). `detectors`: ids from `MODEL_DETECTORS` and the layer
    detectors (`DETECTORS`); None runs all. `progress`: callable(stage, index, total). `packed`: True if the
    model keeps documents packed into one sequence apart by their position ids (restarting at each document),
    False not to check it, None to check where transformers builds the model's packed-sequence mask
    (`packed_documents`). `_options`: for front
    ends, how the user spells each option ({"causal": "--causal"}), used in the messages."""
    expect(progress is None or progress is False or callable(progress),
           "progress a callable(stage, index, total), None or False (nothing drawn)",
           f"progress={progress!r} ({type(progress).__name__})",
           'pass a function, e.g. progress=lambda stage, i, n: print(f"{i}/{n} {stage}"), or leave progress out')
    progress = None if progress is False else progress  # as audit() takes it: False draws nothing
    expect(isinstance(model, nn.Module), "an nn.Module (the whole model)", type(model).__name__,
           "pass the model instance; to audit one layer, use diagnostics.audit(layer)")
    expect(seq_len is None or (isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 2),
           "seq_len an int >= 2 or None", spell("seq_len", seq_len, _options),
           f"pass e.g. {spell('seq_len', 16, _options)}")
    expect(packed is None or isinstance(packed, bool), "packed=True, False or None", f"packed={packed!r}",
           "pass packed=True if the model keeps packed documents apart by their position ids")
    expect(detectors is None or (isinstance(detectors, (list, tuple)) and all(isinstance(d, str) for d in detectors)),
           "detectors: a list of detector ids", f"detectors={detectors!r}", "e.g. detectors=['prefix_causality']")
    known = set(MODEL_DETECTORS) | set(DETECTORS)
    unknown = [d for d in (detectors or []) if d not in known]
    expect(not unknown, f"detector ids from {sorted(known)}", f"{unknown}", "check the spelling")
    chosen = set(known if detectors is None else detectors)
    started = time.perf_counter()
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None) if config is not None else None
    context = model_context(model)
    if seq_len is not None and context is not None:
        expect(seq_len <= context, f"seq_len <= {context}, the model's context", spell("seq_len", seq_len, _options),
               f"pass {spell('seq_len', context, _options)} or less")
    runner = Runner(model, example, seq_len=seq_len, seed=seed, options=_options)
    if seq_len is not None and runner.sequence and example is not None and runner.inputs.shape[1] != seq_len:
        runner.inputs = runner.inputs[:, :seq_len]
    T = runner.inputs.shape[1] if runner.sequence else 0
    expect(not runner.sequence or T >= 2, "an example of at least 2 positions", f"length {T}", "pass a longer example")
    said, _ = declared_causal(model, causal, runner)  # torch's stacks get the causal mask from the caller
    runner.pass_causal = bool(said) and runner.causal_mask_name is not None
    dtype = float_dtype(model)
    results: list[DetectorResult] = []
    layers: dict = {}
    notes: list[str] = []
    if runner.chosen:
        notes.append(f"the example: {runner.chosen}")
    if runner.dropped:
        notes.append(f"the example's {', '.join(runner.dropped)} not passed: each check builds the masks and positions "
                     f"it needs (token_type_ids: the model's default)")

    def tick(stage, i, n):
        if progress is not None:
            progress(stage, i, n)

    device = device_dtype(model)[0]
    with untouched(model, device):
        tick("discover", 0, 1)
        observed = observe_attention(runner)
        error, raised_in = observed.error, observed.raised_in
        if observed.note:
            notes.append(observed.note)
        found = find_attention(model, observed.found, observed.weighs if observed.error is None else None,
                               not_tokens=observed.not_tokens, deformable=observed.deformable)
        notes += [f"{p} not audited as attention: {why}" for p, why in observed.not_tokens.items()]
        compiled = compiled_paths(model)
        if compiled == [""]:
            notes.append("the model is compiled (TorchScript), which takes no hooks: its modules are found by class "
                         "only; audit the model before compiling it, or its attention layers one by one "
                         "(diagnostics.audit(layer))")
        elif compiled:
            notes.append(f"{', '.join(compiled[:4])}{', ...' if len(compiled) > 4 else ''}: compiled (TorchScript), "
                         f"which takes no hooks, so what runs inside counts for the module around it and is not found "
                         f"as attention here; audit the attention among them as a layer (diagnostics.audit(model."
                         f"{compiled[0]}) if that one is)")
        expect(found or compiled or not (observed.model_attends or class_kind(model)), "a whole model with attention layers in "
               "it", f"{type(model).__name__}, which is one attention layer itself (" + (class_kind(model) or
               "its own forward runs a softmax over (Tq, Tk) scores or fused attention") + ")",
               "audit it as one layer: diagnostics.audit(layer), attention-audit MODULE:OBJECT (without --model) or "
               "pytest --attention-audit=MODULE:OBJECT")
        named = dict(model.named_modules())
        modules = {f.path: named[f.path] for f in found}
        runs_msgs, run_layer = [], None
        if error:
            if raised_in is not None:
                run_layer = next((p for p in modules if raised_in == p or raised_in.startswith(p + ".")), raised_in)
                error = f"raised inside {run_layer} ({type(named[run_layer]).__name__}): {error}"
            runs_msgs.append(f"the example: {error}")
        long_calls, error = capture_calls(runner, modules, runner.inputs[:1]) if modules else ({}, None)
        if error and not runs_msgs:
            runs_msgs.append(f"the example: {error}")
        short_calls = {}
        if runner.sequence and T >= 3 and modules:
            short_calls, error = capture_calls(runner, modules, runner.inputs[:1, :T - 1])
            if error:
                runs_msgs.append(f"the example's first {T - 1} positions: {error}")
        # at batch 2 too: an argument with twice the rows has the batch folded into its first dimension (BLOOM's
        # ALiBi, (B x H, 1, T)), which the in-place wrapper repeats for a probe's batch instead of passing as is
        wide_calls = capture_calls(runner, modules, runner.inputs[:2])[0] if modules and len(runner.inputs) >= 2 \
            else {}
        found = [replace(f, called=f.path in long_calls) for f in found]
        # every module the forward calls is watched by the model-level checks, whether or not it can be audited
        # in place: a layer left out would pass its leak on to the next one, which would take the blame
        modules = {p: m for p, m in modules.items() if p in long_calls}
        wrappers, time_dims = {}, {}
        for p, m in modules.items():
            try:
                wrappers[p] = build_in_place(p, m, long_calls[p], short_calls.get(p), wide_calls.get(p))
                time_dims[p] = wrappers[p].hidden_time_dim
                if wrappers[p].note and wrappers[p].note not in notes:
                    notes.append(wrappers[p].note)
            except (AuditUsageError, TypeError) as exc:
                notes.append(f"{p} not audited in place: {exc}")
        order = [p for p in long_calls if p in modules]  # the capture's hooks fired in call order
        causal_, source = infer_causal(model, causal, runner, wrappers, T=T, dtype=dtype, seed=seed, options=_options)
        ctx = ModelContext(model, runner, causal_, seed, dtype, modules, wrappers, time_dims, order, runs=runs_msgs,
                           raised_in=run_layer, packed=packed)
        results.append(run(MODEL_DETECTORS[runs.ID], ctx, _options, subject="model"))
        layer_ids = [d for d in DETECTORS if d in chosen]
        mixers = {f.path for f in found if f.mixer}
        in_place = [p for p in order if p in wrappers and p not in mixers]
        # a layer that declares a window or a chunk (window.declared_pattern) is audited under it in place, so that
        # attention_pattern measures it key by key and points at the line
        declared = window.patterns(ctx)
        for i, p in enumerate(in_place):
            if not layer_ids:
                break
            tick(f"layer {p}", i, len(in_place))
            w = wrappers[p]
            # a layer whose length stayed when the sequence was one token shorter reads tokens of another stream (a
            # vision tower beside CLIP's causal text tower, given the same pixels in both): the model's causality is
            # not its own
            other_stream = w.fixed_length and p in short_calls
            layer_causal = bool(causal_ and w.is_self_attention() and not other_stream
                                and (not runner.encoder_decoder or ".decoder." in f".{p}."))
            if causal_ and other_stream and w.is_self_attention():
                notes.append(f"{p} audited as not causal: its length ({w.block_size}) stayed when the sequence was one "
                             f"token shorter, so it reads another stream than the sequence's")
            scale, said = declared_scale(w.inner, model, layer=w)
            # Hugging Face's `scaling` is on every layer: noted only where it was set aside
            if said and said not in notes and ("scaling" not in said or scale is None):
                notes.append(said)
            try:
                # progress=False: a bar per layer would draw over the model audit's own stages
                rep = audit(w, causal=layer_causal, seq_len=w.probe_length, seed=seed, detectors=layer_ids, scale=scale,
                            pattern=declared[p].pattern if p in declared else None, progress=False)
            except AuditUsageError as exc:
                notes.append(f"{p} not audited in place: {exc}")
                continue
            except Exception as exc:  # an internal error of diagnostics: the layer stays unaudited (inconclusive)
                notes.append(f"{p} not audited in place: the audit raised {type(exc).__name__}: {exc} (an internal "
                             f"error of diagnostics; please report it)")
                continue
            by_design = _unused_by_design(ctx, p, rep)
            if by_design:  # parameters the model uses past this length or after a factor 0: left to gradient_flow
                notes.append(f"{p}: parameters_used not run in place: {by_design} get no gradient at length "
                             f"{w.block_size or T} (gradient_flow judges them)")
                ctx.layer_calls += rep.forward_passes
                try:
                    rep = audit(w, causal=layer_causal, seq_len=w.probe_length, seed=seed, scale=scale,
                                detectors=[d for d in layer_ids if d != "parameters_used"],
                                pattern=declared[p].pattern if p in declared else None, progress=False)
                except Exception:  # it ran once with the same probes: keep that report
                    pass
            if scale is None and said and BOTH_READINGS in said:  # muP's scale or the bug: a declaration decides
                _undecided(rep, said)
            elif scale is None and said:  # a scale attribute set aside as the bug itself: its finding says so
                rep.results = [_set_aside(r, said) if r.detector == "softmax_saturation" and r.fired else r
                               for r in rep.results]
            layers[p] = rep
            ctx.layer_calls += rep.forward_passes
            if _one_token(w) and rep.status != "failed":
                notes.append(f"{p} sees one token on this example ({ONE_TOKEN}): its {rep.status} is not counted; a "
                             f"larger input (a larger image, a longer sequence) measures it")
        if not runs_msgs:
            ids = [d for d in MODEL_DETECTORS if d in chosen and d != runs.ID]
            for i, d in enumerate(ids):
                tick(d, i, len(ids))
                seed_rng(seed, device)
                results.append(run(MODEL_DETECTORS[d], ctx, _options, subject="model"))
        readings, layer_calls = ctx.readings, ctx.layer_calls
    if implementation is not None and getattr(config, "_attn_implementation", None) != implementation:
        config._attn_implementation = implementation
    results = [r for r in results if r.detector in chosen or r.detector == runs.ID]
    unaudited = tuple(f.path for f in found if f.called and not f.mixer and f.path not in layers)
    prefix = next((r for r in results if r.detector == causality.ID), None)
    stacks = sequence_parts(model, runner, wrappers) if causal_ and prefix is not None and not prefix.measured \
        and "not a sequence" in prefix.message else None
    status, reason = model_status(results, layers, found, layers_chosen=bool(set(DETECTORS) & chosen),
                                  causal=causal_, unaudited=unaudited,
                                  single=tuple(p for p, w in wrappers.items() if _one_token(w)), stacks=stacks)
    if not T and wrappers:
        T = next(iter(wrappers.values())).block_size  # images: the tokens the attention layers see
    report = ModelReport(model=type(model).__qualname__, status=status, status_reason=reason, causal=causal_,
                         causal_source=source, seq_len=T, dtype=dtype_name(dtype), found=found, layers=layers,
                         results=results, readings=readings, model_forwards=runner.forwards, layer_calls=layer_calls,
                         seconds=time.perf_counter() - started, notes=notes)
    # the whole raised on the example built from what it declares (model_runs skipped): a model made of towers that
    # each declare their own input (CLIP's text and vision towers) is audited tower by tower
    # not an encoder-decoder: its decoder reads its encoder's output, and its parts' own examples are not the
    # whole's (Dia's encoder reads 256 text bytes, its decoder 1,028 audio codes: ids of one given to the other)
    held = towers(model) if report.result(runs.ID).verdict == "skip" and not runner.encoder_decoder else {}
    if len(held) < 2:
        return report
    if causal is not None:
        # each tower's causality is its own (CLIP's text tower is causal, its vision tower not): one declared for the
        # whole is no tower's, and a text tower audited without it would pass without its causal mask
        report.notes.append(f"not audited tower by tower ({', '.join(held)}): {spell('causal', causal, _options)} was "
                            f"given for the model whole, and each tower's causality is its own; pass example="
                            f"{{{', '.join(f'{n!r}: ...' for n in dict.fromkeys(held.values()))}}} to audit it whole")
        return report
    reports: dict = {}
    examples: dict | None = {}
    for t in held:
        tick_t = None if progress is None else (lambda stage, i, n, t=t: progress(f"{t}: {stage}", i, n))
        try:
            # causal=None: each tower's causality is its own (CLIP's text tower is causal, its vision tower not)
            reports[t] = audit_model(model.get_submodule(t), seq_len=seq_len, seed=seed, detectors=detectors,
                                     progress=tick_t, packed=packed, _options=_options)
            if examples is not None:  # the very example its audit built, for the whole's call (`together`)
                examples[held[t]] = Runner(model.get_submodule(t), None, seq_len=seq_len, seed=seed,
                                           options=_options).inputs
        except AuditUsageError as exc:  # a tower whose example cannot be built either: inconclusive, saying why
            reports[t], examples = str(exc), None
    # the code that joins the towers, run once on their examples together: the towers' audits never ran it
    joint = together(model, held, examples, seed) if examples else None
    return merged(report, reports, held, seconds=time.perf_counter() - started, joint=joint)


__all__ = ["audit_model", "model_status"]
