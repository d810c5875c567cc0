"""Finding a model's attention modules: torch's `nn.MultiheadAttention`, timm's and Hugging Face's attention
classes (by class), and any module that runs a softmax over (Tq, Tk) scores or a fused SDPA call in one observed
forward (the innermost such module with parameters); and a module in the place attention has in the other blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .._observe import Observer
from ._runner import Runner

TORCH_ATTENTION = (nn.MultiheadAttention,)


@dataclass(frozen=True)
class FoundModule:
    """An attention module found: its path in the model, its class, how it was recognised, and whether the
    model's forward called it (a module it does not call is not audited)."""

    path: str
    cls: str
    how: str
    called: bool = True


def class_kind(module: nn.Module) -> str | None:
    if isinstance(module, TORCH_ATTENTION):
        return "torch nn.MultiheadAttention"
    mod, name = type(module).__module__, type(module).__name__
    if mod.startswith("timm.") and name.endswith("Attention"):
        return "timm attention class"
    if mod.startswith("transformers.") and re.search(r"Attention$", name) and "Output" not in name:
        return "Hugging Face attention class"
    return None


def innermost(paths: list[str]) -> list[str]:
    return [p for p in paths if not any(q != p and q.startswith(p + ".") for q in paths)]


@dataclass(frozen=True)
class Observation:
    """What one observed forward showed: {module path: how} of the modules running a softmax over (.., Tq, Tk)
    scores or a fused SDPA call (innermost modules with parameters); the model's error if it raised and the
    module it raised in; a note where observing failed although the model runs; and whether the model's own
    forward ran such attention (`model_attends`: the model may be one attention layer itself)."""

    found: dict
    error: str | None = None
    raised_in: str | None = None
    note: str | None = None
    model_attends: bool = False


def observe_attention(runner: Runner) -> Observation:
    """One forward of the example's first sequence (at most 8 positions) under the observer."""
    model = runner.model
    counts: dict = {}
    stack: list = []
    observer = Observer()
    handles = []
    named = dict(model.named_modules())
    paths = {id(m): p for p, m in named.items()}

    def pre(m, args):
        stack.append((m, len(observer.record.softmaxes), len(observer.record.fused)))

    def post(m, args, out):
        if stack and stack[-1][0] is m:
            _, s0, f0 = stack.pop()
            soft = [s for s in observer.record.softmaxes[s0:] if s.output.dim() >= 3 and s.output.shape[-1] >= 2
                    and s.dim in (-1, s.output.dim() - 1)]
            fused = observer.record.fused[f0:]
            entry = counts.setdefault(paths[id(m)], [0, 0])
            entry[0] += len(soft)
            entry[1] += len(fused)

    for m in named.values():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    error, raised_in = None, None
    seq = runner.inputs[:1]
    if runner.sequence and seq.shape[1] > 8:
        seq = seq[:, :8]  # finding needs the ops, not the length: the observer records every one of them
    try:
        with observer:
            runner(seq, grad=True)
    except Exception as exc:  # a model that raises is a finding, reported by model_runs
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        # the modules whose forward did not return: the innermost one with parameters is where it raised
        inside = [paths[id(m)] for m, _, _ in stack if paths[id(m)] and any(True for _ in m.parameters())]
        raised_in = inside[-1] if inside else None
    finally:
        for h in handles:
            h.remove()
    if error is not None:
        try:  # the model, or the observer? Without the observer, a model that runs was not the one that raised
            runner(seq, grad=True)
        except Exception:
            pass
        else:
            return Observation({}, note=f"observing the forward failed ({error}): modules found by class only")
    candidates = [p for p, (s, f) in counts.items()
                  if (s or f) and p and any(True for _ in named[p].parameters())]
    found = {}
    for p in innermost(candidates):
        s, f = counts[p]
        found[p] = ("observed fused scaled_dot_product_attention" if f and not s
                    else "observed softmax over (Tq, Tk) scores")
    return Observation(found, error, raised_in, model_attends=any(counts.get("", (0, 0))))


def find_attention(model: nn.Module, observed: dict) -> list[FoundModule]:
    """Class-recognised modules (innermost), and observed modules not inside or around one of them."""
    named = dict(model.named_modules())
    by_class = innermost([p for p, m in named.items() if p and class_kind(m)])
    found = {p: f"{class_kind(named[p])}" + (f", {observed[p]}" if p in observed else "") for p in by_class}
    for p, how in observed.items():
        if not any(p == q or p.startswith(q + ".") or q.startswith(p + ".") for q in by_class):
            found[p] = how
    # A module in the place attention has in the other blocks (h.1.attn beside h.0.attn and h.2.attn) is audited
    # too, even where nothing it ran looked like attention: a layer without a softmax is a finding, not a skip.
    places = {re.sub(r"\\.\d+\\.", r"\\.\\d+\\.", re.escape(p)) for p in found if re.search(r"\.\d+\.", p)}
    for p, m in named.items():
        if p and p not in found and any(re.fullmatch(place, p) for place in places) and \
                any(True for _ in m.parameters()) and not any(p.startswith(q + ".") or q.startswith(p + ".") for q in found):
            found[p] = "in the place attention has in the other blocks; no softmax or fused attention observed in it"
    order = list(named)
    return [FoundModule(p, type(named[p]).__name__, found[p], True) for p in sorted(found, key=order.index)]


__all__ = ["TORCH_ATTENTION", "FoundModule", "Observation", "class_kind", "find_attention", "innermost",
           "observe_attention"]
