"""Models made of towers: CLIP's text and vision towers, CLAP's text and audio towers, each a model that declares its
own input, which the whole takes together (`forward(input_ids, pixel_values)`). Zero-config, the audit builds the
input the whole declares (token ids) and the whole raises on it; pixels alone would leave the text tower reading no
token, and the token checks judged the vision tower (MetaCLIP 2's correct vision attention failed future_leakage).
There, each tower is audited on the example it declares, with its own causality (CLIP's text tower is causal, its
vision tower is not), and the towers' reports make one (`merged`): every path, layer and finding named by its place
in the whole model, the status the worst of the towers'. Attention outside every tower (a fusion of the streams), or
inside one that its tower does not call on its own input (BLIP's text decoder's cross-attention to the image), reads
the towers' inputs together: it is not audited, and the model is inconclusive and asks for an example.
The towers' audits leave the code that joins them unrun: the whole is then called once on the examples they built,
together (`together`), under the observer. Where it raises, the model is inconclusive (failed where it raised inside
an attention module, as `model_runs` decides for a whole model); where a softmax over (Tq, Tk) scores or fused
attention runs outside every tower (a fusion written by hand), it is inconclusive, naming where.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch

from .._guard import seed_rng, untouched
from ._find import FoundModule, ModuleWatch, innermost
from ._report import ModelReport
from ._runner import device_dtype

# the inputs a tower's audit builds from what the tower declares: token ids, images, a waveform, a spectrogram
TOWER_INPUTS = ("input_ids", "pixel_values", "input_values", "input_features")
STREAMS = (*TOWER_INPUTS, "pixel_values_videos")  # a forward that takes two of these takes streams together
WORST_FIRST = ("failed", "inconclusive", "passed")


def declared_input(module) -> str | None:
    """The one input of `TOWER_INPUTS` a module's forward takes, where it takes it first (its `main_input_name` where
    the forward takes it, a Hugging Face model's; else its first parameter: a class that inherits the default
    "input_ids" yet takes pixels); None where it takes none, or several streams (the whole again, ViLT's embeddings
    of tokens and pixels together, PE's video model of text and frames)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    main = getattr(module, "main_input_name", None)
    main = main if main in named else (named[0] if named else None)
    return main if main in TOWER_INPUTS and [n for n in named if n in STREAMS] == [main] else None


def towers(model) -> dict[str, str]:
    """{path: the input it declares} of the models a model is made of, outermost only: sub-modules with a config of
    their own whose forward takes one input the audit builds (`declared_input`): CLIP's text_model (input_ids) and
    vision_model (pixel_values). Not a layer with a config (CLAP's projections, an attention module: hidden
    states), nor an embedding of the input (a class named *Embeddings: X-CLIP's vision patches), where a tower
    starts."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or getattr(module, "config", None) is None or any(name.startswith(f + ".") for f in found):
            continue
        if type(module).__name__.endswith(("Embeddings", "Embedding")):  # where a tower starts (X-CLIP's patches)
            continue
        main = declared_input(module)
        if main is not None:
            found[name] = main
    return found


def _within(path: str, held) -> bool:
    return any(path == t or path.startswith(t + ".") for t in held)


@dataclass(frozen=True)
class Together:
    """The whole called once on its towers' examples together (`together`): `inputs`, what it was given (name:
    shape); the error it raised and the innermost module with parameters it raised in; `attends`, where a softmax over
    (Tq, Tk) scores or fused attention ran outside every tower (module paths, or the model's own forward)."""

    inputs: str
    error: str | None = None
    raised_in: str | None = None
    attends: list = field(default_factory=list)


def together(model, held: dict[str, str], examples: dict, seed: int) -> Together:
    """Call the whole once with {each tower's input name: the example its tower's audit built} (at the smallest of
    their batches), under the observer the audit finds attention with, the model untouched."""
    rows = min(x.shape[0] for x in examples.values())
    device, dtype = device_dtype(model)
    inputs = {n: (x[:rows].to(dtype) if x.is_floating_point() else x[:rows]) for n, x in examples.items()}
    said = ", ".join(f"{n} {tuple(x.shape)}" for n, x in inputs.items())
    watch = ModuleWatch(model)
    error, raised_in = None, None
    with untouched(model, device):
        seed_rng(seed, device)
        try:
            with watch, watch.observer, torch.no_grad():
                model(**inputs)
        except Exception as exc:  # the code that joins the towers raised: said, never re-raised
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            inside = [p for p in watch.open if p and any(True for _ in watch.named[p].parameters())]
            raised_in = inside[-1] if inside else None
    if error is not None:
        return Together(said, error, raised_in)
    counts = watch.counts
    left_out = {**watch.not_tokens(), **watch.per_token(), **watch.assignments(), **watch.routers()}
    attending = innermost([p for p, (s, f) in counts.items() if (s or f) and p and p not in left_out
                           and any(True for _ in watch.named[p].parameters())])
    attends = [p for p in attending if not _within(p, held)]
    # the whole's own forward (a softmax written in it): what ran in it less what ran in the modules it called
    top = [p for p in counts if p and "." not in p]
    own = [a - sum(counts[p][i] for p in top) for i, a in enumerate(counts.get("", (0, 0)))]
    if any(n > 0 for n in own):
        attends.append(f"{type(model).__name__}'s own forward")
    return Together(said, attends=attends)


def merged(whole: ModelReport, reports: dict, held: dict[str, str], *, seconds: float,
           joint: Together | None = None) -> ModelReport:
    """One report of the towers' (`reports`: {tower path: its ModelReport, or the usage error that stopped its
    audit}), with every layer, module found and model-level result named by its path in the whole model (a tower's
    model-level result by the tower's path, unless it names a layer of it). Status: failed if any tower failed; else
    inconclusive if one was, or could not be audited, or attention sits outside every tower or was not called by its
    tower on its own input, or the whole raised on its towers' examples together (`joint`, failed where it raised
    inside an attention module), or was not called so; else passed. The whole's own model_runs is kept, as that call
    measured it. A tower in which no attention module was found is named in a note and counted only where no tower
    has one."""
    # a tower with no attention in it (ALIGN's EfficientNet) has nothing to audit: said, not counted, unless no tower
    # has any
    empty = [t for t, r in reports.items() if isinstance(r, ModelReport) and not r.found]
    if len(empty) < len(reports):
        reports = {t: r for t, r in reports.items() if t not in empty}
    else:
        empty = []
    audited = {t: r for t, r in reports.items() if isinstance(r, ModelReport)}
    layers = {f"{t}.{p}": rep for t, r in audited.items() for p, rep in r.layers.items()}
    results = [replace(res, layer=f"{t}.{res.layer}" if res.layer else t) for t, r in audited.items()
               for res in r.results]
    found = [replace(f, path=f"{t}.{f.path}") for t, r in audited.items() for f in r.found]
    outside = [f for f in whole.found if not _within(f.path, held)]
    found += [FoundModule(f.path, f.cls, f.how, called=False, mixer=f.mixer) for f in outside]
    wants = ", ".join(f"{n!r}: ..." for n in dict.fromkeys(held.values()))
    ran = whole.result("model_runs")
    raised = ran.evidence.split("; ")[0].removeprefix("the example: ")
    # the whole on its towers' examples together: its model_runs, and what it ran outside the towers
    joined, inside, beyond = [], None, [f.path for f in outside]
    if joint is None:
        joined.append(f"{whole.model} was not run on its towers' examples together (a tower's could not be built): "
                      f"the code that joins them was not run; pass example={{{wants}}}")
    elif joint.error is not None:
        inside = next((f.path for f in found if joint.raised_in is not None
                       and _within(joint.raised_in, [f.path])), None)
        if inside is None:
            joined.append(f"{whole.model} raised on its towers' examples together ({joint.inputs}): {joint.error}: "
                          f"the code that joins them was not measured; pass example={{{wants}}}")
        ran = replace(ran, verdict="fail" if inside else "skip", layer=inside,
                      message="the model raised on its towers' examples together" + (
                          f" (inside {inside})" if inside else ", outside its attention modules: not measured"),
                      evidence=f"{joint.inputs}: {joint.error}")
    else:
        ran = replace(ran, verdict="pass", message=f"the model runs on its towers' examples together ({joint.inputs})",
                      evidence="")
        named = {f.path for f in outside}
        seen = [p for p in joint.attends if p not in named and not any(_within(p, [q]) for q in named)]
        found += [FoundModule(p, "", "observed softmax over (Tq, Tk) scores or fused attention when the model ran on "
                                     "its towers' examples together", called=False) for p in seen if "'s own" not in p]
        beyond += seen
    results.insert(0, ran)  # the whole's first: `report.result("model_runs")` is the model's
    inputs = ", ".join(f"{t}: {n}" for t, n in held.items())
    notes = [f"audited tower by tower: {whole.model} raised on the example built from what it declares ({raised}), "
             f"and it is made of towers that each declare their own input ({inputs}): each was audited on its own "
             f"example, with its own causality; pass example={{{wants}}} to audit the model whole"]
    notes += [f"{t} has no attention module (no torch, timm or Hugging Face attention class, and no softmax over (Tq, "
              f"Tk) scores or fused attention observed): nothing to audit there" for t in empty]
    notes += [f"{t}: {n}" for t, r in audited.items() for n in r.notes]
    statuses = {t: (r.status if isinstance(r, ModelReport) else "inconclusive") for t, r in reports.items()}
    worst = min([*statuses.values(), "failed" if inside else "passed"], key=WORST_FIRST.index)
    if worst == "failed":
        failed = [f"{r.detector} at {r.layer}" for r in results if r.verdict == "fail"] + [
            f"{p} ({', '.join(r.detector for r in rep.results if r.verdict == 'fail')})"
            for p, rep in layers.items() if rep.status == "failed"]
        reason = "failed: " + ", ".join(dict.fromkeys(failed))
    else:
        why = [f"{t}: {r.status_reason.removeprefix('inconclusive: ')}" for t, r in audited.items()
               if r.status == "inconclusive"]
        why += [f"{t} could not be audited on its own: {r}" for t, r in reports.items() if isinstance(r, str)]
        # a tower's attention its own forward did not call reads another tower's output (BLIP's text decoder's
        # cross-attention to the image): the whole calls it with both inputs, the towers never did
        idle = [f.path for f in found if not f.called and _within(f.path, audited)]
        if idle:
            why.append(f"{', '.join(idle[:3])}{' ...' if len(idle) > 3 else ''} {'is' if len(idle) == 1 else 'are'} "
                       f"not called by {'its tower' if len(idle) == 1 else 'their towers'} on "
                       f"{'its' if len(idle) == 1 else 'their'} own input (attention to another tower's output) and "
                       f"{'was' if len(idle) == 1 else 'were'} not audited: pass example={{{wants}}}")
        if beyond:
            why.append(f"{', '.join(beyond[:3])}{' ...' if len(beyond) > 3 else ''} outside the "
                       f"towers {'reads' if len(beyond) == 1 else 'read'} their inputs together and "
                       f"{'was' if len(beyond) == 1 else 'were'} not audited: pass example={{{wants}}}")
        why += joined
        worst = "inconclusive" if why else worst
        reason = "inconclusive: " + "; ".join(why) if worst == "inconclusive" else ""
    causal = any(r.causal for r in audited.values())
    source = "per tower: " + "; ".join(f"{t} {'causal' if r.causal else 'not causal'} ({r.causal_source})"
                                        for t, r in audited.items())
    return ModelReport(model=whole.model, status=worst, status_reason=reason, causal=causal, causal_source=source,
                       seq_len=max((r.seq_len for r in audited.values()), default=whole.seq_len), dtype=whole.dtype,
                       found=found, layers=layers, results=results,
                       readings={t: r.readings for t, r in audited.items()},
                       model_forwards=whole.model_forwards + sum(r.model_forwards for r in audited.values()),
                       layer_calls=sum(r.layer_calls for r in audited.values()), seconds=seconds, notes=notes)


__all__ = ["TOWER_INPUTS", "Together", "declared_input", "merged", "together", "towers"]
