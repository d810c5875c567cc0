"""`own_weights`: the layer's output is the attention its own weights define. For each attention module whose
projections can be identified (`diagnostics._projections`: torch's nn.MultiheadAttention, Hugging Face's q_proj /
k_proj / v_proj / o_proj modules, a fused qkv projection such as timm's Attention or this project's reference), the
standard probe's call of that module is captured, the attention is recomputed by the reference from the module's
weights on the very inputs it was given (its mask, its rotary tables), and compared with what it returned.

It sees the bugs that keep every property a black-box check measures: grouped key/value heads repeated in the wrong
order are the same function as a correct layer with its query heads permuted; no perturbation tells them apart, the
layer's own weights do. Where the output differs, the one-step changes of the reference (`_projections.STEPS`) say
which step the layer did otherwise, when one of them reproduces it.

The mask: the one the call passed, and the causal one where it reproduces the output better (causality is the
causal detectors' property, not this one's; a layer that builds its own causal mask, an `is_causal` flag, is
recomputed either way). Where the projections cannot be identified the check is not applicable, with the reason.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._core import baseline_scale, not_run, relative_change, skip, unravel, where_text
from .._probe import Probe
from .._registry import NOT_APPLICABLE, detector
from .._result import DetectorResult
from .._thresholds import FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR, dtype_name, tolerance
from .._projections import STEPS, NotApplicable, Projections, attend, bind, recognise
from ._common import not_token_attention, result

ID = "own_weights"

# The float64-golden rule of the model audit (FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR in diagnostics/_thresholds.py):
# the layer's error against the float64 recompute may be at most FUDGE x the error of the same recompute in the
# layer's dtype, plus FLOOR, both relative to the float64 recompute's RMS. `python tests/test_own_weights.py --margins
# 5` (CPU; the grouped-query layer, nn.MultiheadAttention, the reference causal and not, Llama eager and sdpa, timm's
# Attention with QK-norm; 5 seeds x torch's and GPT-2's initialisation; /work/venv-real: transformers 5.24.0):
#   float32   correct layers reach 0.071 of the allowed error (margin 14x); the wrong-order heads 1.3e5x over it
#   bfloat16  correct layers reach 0.49 (margin 2.1x: nn.MultiheadAttention, whose fused kernel rounds apart from
#             the recompute in bfloat16); the wrong-order heads 50x over it
#   float64   the floor is float32's, not 1e-10: Hugging Face's eager attention takes its softmax in float32 whatever
#             the layer's dtype, 2.6e-7 off (margin 38x); the wrong-order heads 2e10x over the 1e-10 floor
FLOOR = {**GOLDEN_FLOOR, torch.float64: GOLDEN_FLOOR[torch.float32]}  # float64: float32's floor, as measured above
MEASURED = {torch.float64: "38x (2.6e-7, Llama eager)", torch.float32: "14x", torch.bfloat16: "2.1x"}


FIXES = {  # the fix of each step that reproduced a layer's output, in the user's terms
    STEPS[0]: "share each key/value head with H / G consecutive query heads: k.repeat_interleave(H // G, dim=1) (Hugging "
              "Face's repeat_kv), not k.repeat(1, H // G, 1, 1), which pairs query head h with key/value head h % G",
    STEPS[1]: "split the heads as x.view(B, T, H, d).transpose(1, 2): heads first, each head's width last",
    STEPS[2]: "merge the heads as out.transpose(1, 2).reshape(B, T, H * d): move the heads next to their width first",
    STEPS[3]: "apply the output projection to the merged heads",
    STEPS[4]: "multiply the scores by the layer's own scale (its `scaling` / `scale`, 1/sqrt(head_dim) by default)",
    STEPS[5]: "multiply the values by the number the layer states for them (its `v_scale` / `value_scale`) before "
              "they are attended, or drop the attribute if the layer means none",
    STEPS[6]: "apply the mask the call passes to the scores before the softmax (scores + the additive mask, or "
              "scores.masked_fill(~allowed, float('-inf'))), and the causal mask where the layer is causal",
}


def _close(out: Tensor, golden: Tensor, same: Tensor | None) -> tuple[float, float, tuple]:
    """(the error of `out` against `golden`, the error allowed, where the worst error is)."""
    scale = baseline_scale(golden) or 1.0
    change = relative_change(out, golden, scale=scale)
    err = float(change.max()) if change is not None and change.numel() else 0.0
    where = unravel(change.argmax(), change.shape) if change is not None and change.numel() else ()
    dtype = out.dtype
    own = 0.0
    if same is not None and dtype != torch.float64:
        ref = relative_change(same, golden, scale=scale)
        own = float(ref.max()) if ref is not None and ref.numel() else 0.0
    return err, FUDGE_BY_DTYPE.get(dtype, FUDGE) * own + tolerance(FLOOR, dtype), where


def _find(layer) -> tuple[dict, list[str]]:
    """{path: Projections} of the identified attention modules in `layer` (itself included), and why others that
    looked like attention were not."""
    found, why = {}, []
    for path, module in layer.named_modules() if isinstance(layer, torch.nn.Module) else ():
        if any(path.startswith(p + ".") or p == "" and path for p in found):
            continue  # inside an identified module
        got = recognise(module)
        if isinstance(got, Projections):
            found[path] = got
        elif isinstance(got, str):
            why.append(f"{_name(path, module)}: {got}")
    return found, why


def _name(path: str, module) -> str:
    """The module's class, and its path inside the audited layer (none for the layer itself or a model audit's
    in-place wrapper's `inner`)."""
    return type(module).__name__ + (f" ({path})" if path and path != "inner" else "")


def _capture(probe: Probe, found: dict) -> tuple[dict, object]:
    """{path: (bound arguments, output)} of each identified module's first call in a replay of the standard probe."""
    seen, handles = {}, []
    for path, p in found.items():
        def pre(m, args, kwargs, path=path):
            if path not in seen:
                seen[path] = [_clone((args, kwargs)), None]

        def post(m, args, kwargs, out, path=path):
            if path in seen and seen[path][1] is None:
                seen[path][1] = _clone(out)

        handles.append(p.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(p.module.register_forward_hook(post, with_kwargs=True))
    base = probe.base()
    try:
        call = probe.call(base.query, base.key, base.value, base.allowed,
                          label=f"the standard probe (B={probe.BATCH}, T={probe.t}), its attention modules' calls read")
    finally:
        for h in handles:
            h.remove()
    return seen, call


def _clone(x):
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _judge(p: Projections, args: tuple, kwargs: dict, returned) -> tuple[str, str, float, float, str]:
    """(verdict, evidence, error, allowed, the fix of the step found or "") of one module's call."""
    c = p.inputs(bind(p.module, args, kwargs))
    out = p.output(returned)
    dtype = out.dtype
    if not dtype.is_floating_point:
        raise NotApplicable(f"the module returned {dtype}")
    # the causal mask where the module declares its own, else whichever of the two reproduces its output
    options = [p.causal] if p.causal is not None else [False, True]
    if c.query.shape[1] < 2:
        options = options[:1]
    # rotary tables passed to a layer that applies none of its own choice (a hybrid model's layers without positions,
    # NoPE: Exaone 4's global layers skip `apply_rotary_pos_emb` where their config says so): with and without them,
    # whichever reproduces the output; a rotary of another base or pairing is neither, and still fails
    calls = [c] if c.rotary is None else [c, replace(c, rotary=None)]
    ranked = []  # (error, recompute, causal, call) of each reading, the closest first
    try:
        for causal in options:
            for call in calls:
                golden = attend(p, call, dtype=torch.float64, causal=causal)
                if golden.shape != out.shape:
                    raise NotApplicable(f"the module returned {tuple(out.shape)}, the recompute gives "
                                        f"{tuple(golden.shape)}")
                ranked.append((_close(out, golden, None)[0], golden, causal, call))
        ranked.sort(key=lambda r: r[0])  # stable: at a tie, the call as read and the declared mask first
        _, golden, causal, chosen = ranked[0]
        # the same recompute in the layer's dtype, for the reading chosen: how far rounding alone moves it
        same = attend(p, chosen, dtype=dtype, causal=causal) if dtype != torch.float64 else None
    except (RuntimeError, ValueError) as error:  # shapes the recognised projections do not fit (a (B, T, D) unpacked
        # from a module's 4-D grid of tokens, NesT's): not what was read
        raise NotApplicable(f"the recompute does not run on this call ({str(error).splitlines()[0][:160]})") from None
    err, allowed, where = _close(out, golden, same)
    explained = []
    if err > allowed:
        # no reading reproduces the output: the first, closest first, that one step of the reference explains is the
        # one reported (a bug in a layer with rotary tables is judged with them, not by the reading without them
        # that happened to differ less: Llama's grouped heads in the wrong order were "no single step" so)
        for e, g, k, call in ranked:
            explained = _explained(p, call, k, out, e, allowed)
            if explained:
                err, _, where = _close(out, g, None)
                golden, causal, chosen = g, k, call
                break
    if chosen is not c:
        c = replace(chosen, read=tuple(r for r in c.read if not r.startswith("rotary tables from")) + (
            "rotary tables passed but not applied by the module (no positions of its own in this layer)",))
    mask = ("the causal mask" if causal else "no causal mask") + (", the call's mask" if c.bias is not None else "")
    read = "; ".join([*p.read, *c.read, f"recomputed with {mask}"])
    if err <= allowed:
        return "pass", f"{read}: greatest difference {err:.3g} of the output's RMS (allowed {allowed:.3g} for " \
                       f"{dtype_name(dtype)})", err, allowed, ""
    where_at = where_text(where, out.dim() - 1) if where else ""
    if not explained and c.unread:
        raise NotApplicable(f"the output differs from the attention its weights compute by {err:.3g} of its RMS "
                            f"(allowed {allowed:.3g}), no one step of the reference explains it, and the call passed "
                            f"{', '.join(c.unread)}, which the recompute does not read (positions or a bias the "
                            f"module applies in its own way)")
    if not explained and not p.known:
        raise NotApplicable(f"the output differs from the attention its weights compute by {err:.3g} of its RMS "
                            f"(allowed {allowed:.3g}), and no one step of the reference explains it: "
                            f"{type(p.module).__name__} may have a step of its own (rotary positions, ALiBi, a bias) "
                            f"that the recompute cannot see")
    cause = (f"; the output is reproduced with one step changed: {explained[0][0]}" if explained else
             "; no single step of the reference reproduces it (the projections, heads, scale, merge or output "
             "projection: more than one, or another)")
    return "fail", f"{read}: greatest difference {err:.3g} of the output's RMS{' at ' + where_at if where_at else ''}" \
                   f" (allowed {allowed:.3g} for {dtype_name(dtype)}){cause}", err, allowed, \
        explained[0][1] if explained else ""


def _explained(p: Projections, c, causal: bool, out: Tensor, err: float, allowed: float) -> list[tuple[str, str]]:
    """[(the step, its fix)] of the one-step changes of the reference (`STEPS`, and other scales) that reproduce `out`
    on the reading (`c`, `causal`) whose own recompute differs by `err`: within `allowed`, and clearly closer."""
    explained = []
    for step in STEPS:
        if step == STEPS[0] and p.heads == p.kv_heads or step == STEPS[3] and p.o is None or \
                step == STEPS[5] and p.value_scale == 1.0 or step == STEPS[6] and c.bias is None and not causal:
            continue
        scales = (1.0, 1.0 / p.head_dim, (p.heads * p.head_dim) ** -0.5, p.scale ** 2, p.head_dim ** 0.5) \
            if step == STEPS[4] else (None,)
        for s in scales:
            if s is not None and abs(s - p.scale) <= 1e-9 * p.scale:
                continue
            try:
                other = attend(p, c, dtype=torch.float64, causal=causal, step=step, scale=s)
            except RuntimeError:  # a step that does not apply to these shapes
                continue
            e, _, _ = _close(out, other, None)
            if e <= allowed and e <= err / 10:  # reproduced, and clearly closer than the reference itself
                explained.append((step if s is None else f"the scale: the layer applies {s:.4g}, its weights' "
                                                         f"{p.scale:.4g} expected", FIXES[step]))
    return explained


def _margin(dtype: torch.dtype) -> str:
    measured = MEASURED.get(dtype)
    return f"correct layers measured inside the allowed error by {measured}" if measured else ""


@detector(ID, "the output equals the attention recomputed by the reference from the layer's own projections "
              "(where they can be identified)",
          targets=("grouped key/value heads repeated in the wrong order", "heads split or merged in the wrong order",
                   "a scale other than the layer's own", "output projection skipped",
                   "the mask the call passed (or the causal one) not applied"),
          fix="compute the attention from the projections as the reference does: key/value head g serves query "
              "heads g*H/G .. (g+1)*H/G - 1 (repeat_interleave, not repeat), heads split as (B, T, H, d) and merged "
              "back the same way, scores times the layer's own scale, then the output projection",
          unlocated="names the module (its path) and the step of the reference that reproduces its output; the "
                    "line is in that module's forward")
def check_own_weights(probe: Probe) -> DetectorResult:
    found, why = _find(probe.subject.layer)
    if not found:
        reason = "; ".join(why) if why else ("no attention projections identified (nn.MultiheadAttention; q_proj, "
                                             "k_proj, v_proj and o_proj; query, key and value; qkv and proj)")
        return DetectorResult(ID, "skip", NOT_APPLICABLE + reason)
    other = not_token_attention(probe, ID)
    if other is not None:
        return other
    seen, call = _capture(probe, found)
    if not call.ok:
        return not_run(ID, call)
    verdicts, notes, worst, fixes = [], [], (0.0, 0.0), []
    for path, p in found.items():
        name = _name(path, p.module)
        if path not in seen or seen[path][1] is None:
            notes.append(f"{name}: not called by the standard probe")
            continue
        (args, kwargs), returned = seen[path]
        try:
            with torch.no_grad():
                verdict, text, err, allowed, fix = _judge(p, args, kwargs, returned)
        except NotApplicable as na:
            notes.append(f"{name}: {na}")
            continue
        verdicts.append((verdict, name))
        fixes += [fix] if fix and fix not in fixes else []
        notes.append(f"{name}: {text}")
        if verdict == "fail" or err / allowed > worst[0] / (worst[1] or 1.0):
            worst = (err, allowed)
    evidence = "; ".join(notes)
    if not verdicts:
        return DetectorResult(ID, "skip", NOT_APPLICABLE + evidence)
    failed = [name for verdict, name in verdicts if verdict == "fail"]
    if failed:
        return result(ID, "fail", f"the output of {', '.join(failed)} is not the attention its own weights compute",
                      **({"fix": "; ".join(fixes)} if fixes else {}), value=worst[0], threshold=worst[1], evidence=evidence, margin=_margin(probe.subject.dtype))
    return result(ID, "pass", "the output equals the attention recomputed from the layer's own weights",
                  value=worst[0], threshold=worst[1], evidence=evidence, margin=_margin(probe.subject.dtype))
