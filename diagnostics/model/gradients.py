"""gradient_flow: every attention parameter gets a finite non-zero gradient of the sum of (out ** 2).sum() over
every tensor the model returns (the logits or hidden states, and a pooled output or a second head's beside them:
a pooling head's attention feeds only the pooled output; each divided by its largest magnitude first, `squared`, so
that tiny outputs do not underflow); for a causal model, no output sends gradient to later
input embeddings (taken as a leaf at the token embedding's output).

A parameter that gets no gradient at the audit's length is unused by design where its own module's output gets a
gradient of exactly 0 (a factor after it starts at 0: Doge's dynamic-mask projection; not judged, and said so), or
where it gets one at a longer length (`LONGER`): a sparse-attention indexer or a compressor acts only past a length
(DeepSeek-V4's compressor from its compress rate); that is a warning naming the length. Either way its layer's
in-place `parameters_used`, which cannot see it, is left to this check (`unused_by_design`, read by audit_model);
a parameter used at none of the lengths fails. One that never gets a gradient yet moves the output when changed at a
longer length is a top-k choice (HY-V4's sparse-attention indexer): used there too.

A parameter whose module's own output gets no gradient from the model's output is not judged: what comes after
the module discards it at this initialisation (SwinV2's post-norms start at weight 0, a zero-initialised gate), so
no attention computed with autograd could give it one; the result says which modules, and each layer's in-place
audit (`gradients`) still checks the layer's own backward. Nor is one whose module's attention weights do not matter
on the audit's example: every softmax over one key, or over values that are the same at every key (LeViT-S8's last
stage, whose tokens near-uniform attention averaged into one before it at this initialisation): what makes the
scores gets no gradient there, whatever the layer; a detached score there cannot be seen, and is not claimed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._guard import seed_rng
from .._observe import FusedAttention, Matmul, Observer, SoftmaxCall
from .._registry import Need, detector, phrase
from .._result import DetectorResult
from ._context import ModelContext, model_copy
from ._runner import device_dtype, first_tensor, model_context, output_tensors, pad_tokens

ID = "gradient_flow"
FIX = ("compute attention with autograd on (no .detach(), no torch.no_grad()), and keep the causal mask in the "
       "backward path")
NONFINITE_FIX = ("normalise each query's scores over the keys, masked before the softmax: softmax(scores.masked_fill("
                 "mask, float('-inf')), dim=-1) gives NaN only for a query with no key at all, which a softmax over "
                 "the queries or the heads, or an all-masked row, makes common at longer lengths; audit at that "
                 "length (seq_len=) to see which check fails there")


# lengths a parameter unused at the audit's is tried at; not past 1,024: an indexer that chooses 2,048 keys
# (DeepSeek-V3.2's, HY-V4's) has 64 heads of (T, T) scores, and at 2,560 tokens one audit ran past 6 minutes on CPU
LONGER = (64, 256, 1024)


@dataclass(frozen=True)
class ByDesign:
    """Why a parameter that gets no gradient at the audit's length is still used by the model: `zeroed`, its own
    module, whose output what follows multiplies by exactly 0 at this initialisation (Doge's dynamic-mask
    projection, behind a factor A that starts at 0); `zero_input`, its own module, whose input is exactly 0 (a
    weight times 0 has no gradient: DETR's decoder starts from zero queries, and its zero-initialised value bias
    makes the next projection's input 0 too); `length`, the first of `LONGER` it gets a gradient at; or `given`, a
    mask of the model's the audit passed none of, with which (all ones) it gets one: not exercised by the audit's
    inputs (Longformer's global attention projections, used only for the tokens global_attention_mask marks)."""

    zeroed: str | None = None
    length: int | None = None
    zero_input: str | None = None  # its own module, whose input is exactly 0 here (DETR's first decoder layer)
    discarded: str | None = None  # its own module, of whose outputs it moves only those that get no gradient
    selects: bool = False  # at `length`, no gradient but changing it moves the output: a top-k choice
    given: str | None = None  # the input of the model's (a mask) it is used with, which the audit did not pass
    one_key: str | None = None  # its own module, whose every softmax normalised over one key here
    same_values: str | None = None  # its own module, whose every softmax weighed values the same at every key here
    given_zeroed: str | None = None  # with `given`, its own module runs, its output multiplied by 0 (a gate at 0)
    nonfinite: int | None = None  # not measured: the model's output is not finite at this longer length,
    nonfinite_at: str | None = None  # first in this attention module's output (None: no attention module's)

    def __str__(self) -> str:
        if self.nonfinite:
            return (f"not measured: the model's output is not finite at length {self.nonfinite}"
                    + (f", first at {self.nonfinite_at}" if self.nonfinite_at else ""))
        if self.one_key:
            return f"{self.one_key} attends one key here (a softmax of one score is 1 whatever the score)"
        if self.same_values:
            return (f"{self.same_values} weighs values that are the same at every key here (a weighted mean of equal "
                    f"values is that value whatever the weights)")
        if self.zeroed:
            return f"the output of {self.zeroed} is multiplied by 0 at this initialisation"
        if self.zero_input:
            return f"the input of {self.zero_input} is exactly 0 here"
        if self.discarded:
            return f"it moves only outputs of {self.discarded} that the model discards (they get no gradient)"
        if self.given:
            return f"used only with {self.given}, which the audit did not pass" + (
                f" (and there the output of {self.given_zeroed} is multiplied by 0 at this initialisation)"
                if self.given_zeroed else "")
        return f"used from length {self.length}" + (" (a top-k choice: no gradient)" if self.selects else "")


def squared(t: Tensor) -> Tensor:
    """(t ** 2).sum() of `t` divided by its largest magnitude (held constant): the same zero pattern of gradients, but
    no underflow where a model's outputs are tiny at its initialisation (SAM's vision encoder, initializer_range
    1e-10: its outputs are ~1e-20, (out ** 2) is ~1e-40, below float32's smallest normal number, and its attention
    weights' float32 gradients come out exactly 0 where float64's are ~1e-46)."""
    t = t if t.dtype == torch.float64 else t.float()
    scale = t.detach().abs().amax() if t.numel() else t.new_ones(())
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    # no smaller than the square root of the dtype's smallest normal number: the gradient of (t / scale) ** 2 with
    # respect to t reaches 2 / scale, which overflows for an output of denormals (MobileViT's tiny configuration
    # returns ~1e-40: 1 / 8e-40 is past float32's largest number, and every gradient came out NaN)
    scale = scale.clamp_min(torch.finfo(t.dtype).tiny ** 0.5)
    return ((t / scale) ** 2).sum()


def _loss_and_outputs(ctx: ModelContext, seq, watched: dict, extra: dict | None = None):
    """The sum of (t ** 2).sum() over every tensor the model returns on `seq` (with the model's `extra` inputs), and
    {path: the first output tensor of each watched module}."""
    returned, outputs = [], {}

    def keep(path):
        def hook(m, args, out):
            o = first_tensor(out)
            if path not in outputs and isinstance(o, Tensor) and o.requires_grad:
                outputs[path] = o
                x = first_tensor(args)
                if isinstance(x, Tensor) and x.is_floating_point() and x.numel() and not bool(x.ne(0).any()):
                    outputs.setdefault("zero inputs", set()).add(path)
        return hook

    handles = [m.register_forward_hook(keep(p)) for p, m in watched.items()]
    handles.append(ctx.model.register_forward_hook(lambda m, args, out: returned.extend(output_tensors(out))))
    try:
        seed_rng(ctx.seed, device_dtype(ctx.model)[0])
        ctx.runner(seq, grad=True, extra=extra)
    finally:
        for h in handles:
            h.remove()
    loss = sum(squared(t) for t in returned if t.requires_grad)
    return loss, outputs


MOVED_AT_MOST = 16  # parameters with no gradient at a length whose use is tried by changing them, one at a time
MOVES = 1e-6  # relative to the output's RMS: a changed top-k choice moves it by O(1); float32 rounding by ~1e-7


def _moves_output(ctx: ModelContext, seq, params: list, gen, before=None) -> bool:
    """Whether changing the parameters at random moves the model's output on `seq` (`before`: its output there, if
    already computed): a top-k selection's scores get no gradient, yet choose the keys. The parameters are
    restored."""
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            if before is None:
                before, _ = ctx.runner(seq)
            for p, old in zip(params, saved):
                p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * (float(old.float().abs().mean())
                                                                                     or 1.0))
            after, _ = ctx.runner(seq)
    except Exception:  # the model does not run so: not shown to be used
        return False
    finally:
        with torch.no_grad():
            for p, old in zip(params, saved):
                p.copy_(old)
    scale = float(before.float().square().mean().sqrt()) or 1.0
    return float((after.float() - before.float()).abs().max()) > MOVES * scale


def _moves_only(ctx: ModelContext, module: nn.Module, before: Tensor, discarded: Tensor, params: list) -> bool:
    """Whether changing `params` at random moves some of `module`'s outputs (`before`, on the audit's input) and only
    those `discarded` marks, the outputs that get no gradient of the model's: a relative-position table that reaches
    only the patch tokens of a last block whose class token alone the head reads (MViTv2's `*_cls`). The
    parameters are restored."""
    saved = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(ctx.seed + 73)
    after = {}

    def keep(m, args, out):  # the first call's output, the module's own left as it returned it
        after.setdefault("out", first_tensor(out))

    handle = module.register_forward_hook(keep)
    try:
        with torch.no_grad():
            for p, old in zip(params, saved):
                p.add_(torch.randn(p.shape, generator=gen).to(p.device, p.dtype) * (float(old.float().abs().mean())
                                                                                     or 1.0))
            seed_rng(ctx.seed, device_dtype(ctx.model)[0])
            ctx.runner(ctx.runner.inputs[:1])
    except Exception:  # the model does not run so: not shown to be used
        return False
    finally:
        handle.remove()
        with torch.no_grad():
            for p, old in zip(params, saved):
                p.copy_(old)
    out = after.get("out")
    if not isinstance(out, Tensor) or out.shape != before.shape:
        return False
    scale = float(before.detach().float().square().mean().sqrt()) or 1.0
    moved = (out.float() - before.detach().float()).abs() > MOVES * scale
    return bool(moved.any()) and not bool((moved & ~discarded).any())


def _first_output(outputs: dict, path: str):
    """A forward hook that keeps, in `outputs[path]`, the first output tensor of the module's first call that requires
    grad (does the model send it any gradient?)."""
    def hook(m, args, out):
        o = first_tensor(out)
        if path not in outputs and isinstance(o, Tensor) and o.requires_grad:
            outputs[path] = o
    return hook


def _in_float64(ctx: ModelContext, seq: Tensor, names: list[str], paths: list[str]) -> tuple[set, set] | None:
    """(the parameters of `names`, the modules of `paths`) that get a non-zero gradient of the outputs in the model's
    float64 copy, on the same input; None where there is no copy or it does not run. A gradient the model's own
    dtype rounds to exactly 0 is no cut path: SAM's vision encoder (initializer_range 1e-10) gives its attention
    weights gradients of ~1e-46 in float64, below float32's smallest number."""
    twin = ctx.twin64()
    if twin is None or not (names or paths):
        return None
    params, named = dict(twin.named_parameters()), dict(twin.named_modules())
    names = [n for n in names if n in params]
    outputs, returned = {}, []

    handles = [named[p].register_forward_hook(_first_output(outputs, p)) for p in paths if p in named]
    handles.append(twin.register_forward_hook(lambda m, args, out: returned.extend(output_tensors(out))))
    try:
        seed_rng(ctx.seed, device_dtype(twin)[0])
        out, _ = ctx.runner(seq.detach(), grad=True, model=twin)
        reached = [p for p in paths if p in outputs]
        loss = squared(out) + sum(squared(t) for t in returned if t.requires_grad and t is not out)
        grads = torch.autograd.grad(loss, [params[n] for n in names] + [outputs[p] for p in reached],
                                    allow_unused=True)
    except Exception:  # the float64 copy does not run so: nothing shown
        return None
    finally:
        for h in handles:
            h.remove()
    got = {x for x, g in zip(names + reached, grads) if g is not None and bool(g.abs().sum() > 0)}
    return {n for n in names if n in got}, {p for p in reached if p in got}


def _underflow_in_place(ctx: ModelContext, seq: Tensor, names: list[str]) -> set:
    """The parameters of `names` whose own module's output gets a non-zero gradient of the outputs, and which get one
    when that module alone is run again in float64 on the inputs it was given, its output's gradient given to it in
    float64: the product of that gradient and the module's input is below the dtype's smallest number (SLANet's
    table head: its input_to_hidden projection takes backbone features of ~1e-26, from an initializer_range of
    1e-10, and its output's gradient is ~1e-37). For models whose float64 copy does not run (SLANet's head computes
    in float32 whatever the model's dtype): the module alone is."""
    params = dict(ctx.model.named_parameters())
    named = dict(ctx.model.named_modules())
    owners = {n.rsplit(".", 1)[0] for n in names if "." in n} & set(named)
    calls: dict = {p: [] for p in owners}

    def keep(path):
        def hook(m, args, kwargs, out):
            o = first_tensor(out)
            if isinstance(o, Tensor) and o.requires_grad:
                calls[path].append((args, kwargs, o))
        return hook

    handles = [named[p].register_forward_hook(keep(p), with_kwargs=True) for p in owners]
    returned: list = []
    handles.append(ctx.model.register_forward_hook(lambda m, args, out: returned.extend(output_tensors(out))))
    found = set()
    try:
        seed_rng(ctx.seed, device_dtype(ctx.model)[0])
        out, _ = ctx.runner(seq.detach(), grad=True)
        loss = squared(out) + sum(squared(t) for t in returned if t.requires_grad and t is not out)
        flat = [(p, a, k, o) for p, cs in calls.items() for a, k, o in cs]
        outs = torch.autograd.grad(loss, [o for *_, o in flat], allow_unused=True) if flat else ()
        wide = lambda v: v.detach().double() if isinstance(v, Tensor) and v.is_floating_point() else v  # noqa: E731
        for path in owners:
            mine = [n for n in names if n.rsplit(".", 1)[0] == path]
            twin = model_copy(named[path], dtype=torch.float64)
            local = dict(twin.named_parameters())
            leaves = [local[n[len(path) + 1:]] for n in mine if n[len(path) + 1:] in local]
            total = [torch.zeros_like(w) for w in leaves]
            for (p, args, kwargs, o), g in zip(flat, outs):
                if p != path or g is None or not bool(g.abs().sum() > 0):
                    continue
                with torch.enable_grad():
                    o64 = first_tensor(twin(*[wide(a) for a in args], **{k: wide(v) for k, v in kwargs.items()}))
                    got = torch.autograd.grad(o64, leaves, g.double(), allow_unused=True)
                total = [t + x if x is not None else t for t, x in zip(total, got)]
            found |= {n for n, t in zip(mine, total) if bool(t.abs().sum() > 0)}
    except Exception:  # the module does not run alone so: nothing shown
        return found
    finally:
        for h in handles:
            h.remove()
    return found


def _frozen(ctx: ModelContext, loss: Tensor, names: list[str]) -> dict:
    """{name: the submodule} for parameters that get no gradient because a whole submodule around them, its
    feed-forwards, norms and embeddings too, gets none: a frozen sub-model the model runs without autograd on purpose
    (X-Codec's semantic model, a feature extractor run under torch.no_grad() whose output is detached). The outermost
    submodule (not the model itself) of which no trainable parameter gets a gradient, holding parameters outside
    every attention module; an attention layer run without autograd inside a block whose other parameters get one
    (the catalog's detached softmax, a forward under no_grad) is none."""
    trainable_all = [(n, w) for n, w in ctx.model.named_parameters() if w.requires_grad]
    try:
        grads = torch.autograd.grad(loss, [w for _, w in trainable_all], allow_unused=True, retain_graph=True)
    except Exception:  # nothing shown
        return {}
    zero = {n for (n, _), g in zip(trainable_all, grads) if g is None or not bool(g.abs().sum() > 0)}
    attention = tuple(p + "." for p in ctx.modules)
    found = {}
    for n in names:
        parts = n.split(".")
        for i in range(1, len(parts) - 1):
            prefix = ".".join(parts[:i]) + "."
            under = [m for m, _ in trainable_all if m.startswith(prefix)]
            if under and all(m in zero for m in under) and any(not m.startswith(attention) for m in under):
                found[n] = prefix[:-1]
                break
    return found


def _output(ctx: ModelContext, seq):
    with torch.no_grad():
        return ctx.runner(seq)[0]


def unused_by_design(ctx: ModelContext, names: list[str]) -> dict:
    """{name: ByDesign, or None where nothing says the model uses it} for parameters that get no gradient of the
    model's outputs at the audit's length: first whether their own module's output gets a gradient of exactly 0
    (what follows multiplies it by 0 at this initialisation), then the first of `LONGER` at which they get one, one
    forward and backward per length until each is found, up to the first length the model does not run at or
    past its declared context (not tried: on CUDA an index past a position table is a device-side assert). Kept on
    `ctx`: gradient_flow and audit_model both ask."""
    params = dict(ctx.model.named_parameters())
    named = dict(ctx.model.named_modules())
    todo = [n for n in dict.fromkeys(names) if n not in ctx.by_design and n in params]
    if todo:
        owners = {n.rsplit(".", 1)[0]: named.get(n.rsplit(".", 1)[0]) for n in todo if "." in n}
        owners = {p: m for p, m in owners.items() if m is not None}
        try:
            loss, outputs = _loss_and_outputs(ctx, ctx.runner.inputs[:1], owners)
            zero_inputs = outputs.pop("zero inputs", set())
            paths = list(outputs)
            grads = torch.autograd.grad(loss, [outputs[p] for p in paths], allow_unused=True) if paths and \
                torch.is_tensor(loss) else ()
        except Exception:  # the plain forward ran before: a replay that raises under the hooks says nothing
            paths, grads, zero_inputs = [], (), set()
        zeroed = {p for p, g in zip(paths, grads) if g is not None and not bool(g.abs().sum() > 0)}
        for n in list(todo):
            owner, leaf = n.rsplit(".", 1)
            if owner in zeroed:
                ctx.by_design[n] = ByDesign(zeroed=owner)
                todo.remove(n)
            elif owner in zero_inputs and leaf == "weight":  # its bias still gets one: judged
                ctx.by_design[n] = ByDesign(zero_input=owner)
                todo.remove(n)
        for p, g in zip(paths, grads):
            mine = [n for n in todo if n.rsplit(".", 1)[0] == p][:MOVED_AT_MOST]
            if mine and g is not None and p not in zeroed and _moves_only(ctx, named[p], outputs[p], g == 0,
                                                                          [params[n] for n in mine]):
                for n in mine:
                    ctx.by_design[n] = ByDesign(discarded=p)
                    todo.remove(n)
        for n, inner in _zeroed_inside(ctx, [n for n in todo if n.rsplit(".", 1)[0] in named], params, named).items():
            ctx.by_design[n] = ByDesign(zeroed=inner)
            todo.remove(n)
        for n, why in _weights_moot(ctx, todo, named).items():
            ctx.by_design[n] = why
            todo.remove(n)
    gen = torch.Generator().manual_seed(ctx.seed + 71)
    # no gradient, yet the output moves when it changes at this very length: a path cut (.detach()), not a choice
    # that acts only on longer sequences (a top-k indexer chooses every key of a short one)
    here = ctx.runner.inputs[:1]
    cut = set()
    if todo and ctx.runner.sequence and _moves_output(ctx, here, [params[n] for n in todo[:MOVED_AT_MOST]], gen):
        before = _output(ctx, here)
        cut = {n for n in todo[:MOVED_AT_MOST] if _moves_output(ctx, here, [params[n]], gen, before)}
    context = model_context(ctx.model)
    for L in LONGER:
        if L <= ctx.T or not todo or not ctx.runner.sequence:
            continue
        if context is not None and L > context:  # past its position table: an index out of range (LUKE's 512 at 1,024),
            break  # on CUDA a device-side assert that ends the process, not an exception to catch
        seq = pad_tokens(ctx.runner, (1, L), gen)
        try:
            loss, outputs = _loss_and_outputs(ctx, seq, ctx.modules)
            outputs.pop("zero inputs", None)
            if torch.is_tensor(loss) and not bool(torch.isfinite(loss)):
                # no gradient can say anything past here: an attention that gives inf or NaN on a plain input of this
                # length (a softmax over a column of -inf: the wrong axis) is the finding, not the parameters before
                # it that would have acted here (a sparse indexer ahead of the broken layer)
                first = next((p for p in ctx.order if p in outputs and not bool(torch.isfinite(outputs[p]).all())),
                             None)
                for n in todo:
                    ctx.by_design[n] = ByDesign(nonfinite=L, nonfinite_at=first)
                todo = []
                break
            grads = torch.autograd.grad(loss, [params[n] for n in todo], allow_unused=True) if torch.is_tensor(loss) \
                else (None,) * len(todo)
        except Exception:  # the model does not run at this length (a position table, a fixed size): no longer
            break
        for n, g in zip(list(todo), grads):
            if g is not None and bool(g.abs().sum() > 0):
                ctx.by_design[n] = ByDesign(length=L)
                todo.remove(n)
        choices = [n for n in todo if n not in cut][:MOVED_AT_MOST]  # no gradient but a choice: top-k keys
        if choices and _moves_output(ctx, seq, [params[n] for n in choices], gen):  # all at once, then each
            before = _output(ctx, seq)
            for n in choices:
                if _moves_output(ctx, seq, [params[n]], gen, before):
                    ctx.by_design[n] = ByDesign(length=L, selects=True)
                    todo.remove(n)
    # used only with an input the audit passed none of: a mask that turns on another path, given as all ones (every
    # token marked: Longformer's global attention for every token); the very tokens of the audit's length
    # or a second stream's token ids, with the inputs of its prefix (`Runner.optional_ids`: LUKE's entities)
    groups = [[name] for name in ctx.runner.optional_masks()] + ctx.runner.optional_ids() \
        if todo and ctx.runner.sequence else []
    for group in groups:
        if not todo:
            break
        ones = torch.ones(here.shape[:2], dtype=torch.long, device=here.device)
        name = " and ".join(group)
        # their own modules watched too: with the input, one may run behind a factor 0 at this initialisation (Evolla's
        # protein adapters, tanh(gate) with the gate at 0, as a gated cross-attention's)
        owners = {n.rsplit(".", 1)[0]: named[n.rsplit(".", 1)[0]] for n in todo if n.rsplit(".", 1)[0] in named}
        try:
            loss, outputs = _loss_and_outputs(ctx, here, owners, extra=dict.fromkeys(group, ones))
            outputs.pop("zero inputs", None)
            paths = list(outputs)
            grads = torch.autograd.grad(loss, [params[n] for n in todo] + [outputs[p] for p in paths],
                                        allow_unused=True) if torch.is_tensor(loss) else (None,) * len(todo)
        except Exception:  # the model does not take it so: says nothing
            continue
        grads, to_outputs = grads[:len(todo)], grads[len(todo):]
        zeroed = {p for p, g in zip(paths, to_outputs) if g is not None and not bool(g.abs().sum() > 0)}
        for n, g in zip(list(todo), grads):
            if g is not None and bool(g.abs().sum() > 0):
                ctx.by_design[n] = ByDesign(given=name)
                todo.remove(n)
            elif n.rsplit(".", 1)[0] in zeroed:
                ctx.by_design[n] = ByDesign(given=name, given_zeroed=n.rsplit(".", 1)[0])
                todo.remove(n)
    ctx.by_design.update(dict.fromkeys(todo))
    return {n: ctx.by_design.get(n) for n in names}


def _zeroed_inside(ctx: ModelContext, names: list[str], params: dict, named: dict) -> dict:
    """{name: the submodule} for parameters whose own module's output gets a gradient, but which reach it through a
    submodule of that module whose output gets exactly 0 (EfficientViT's attention: its projection ends in a
    BatchNorm whose weight starts at 0, and its attention-bias table is the module's own parameter): the parameter
    feeds that submodule's output (a non-zero gradient of it), and what follows multiplies it by 0."""
    owners = {n.rsplit(".", 1)[0] for n in names}
    inner = {p: m for p, m in named.items() if any(p.startswith(o + ".") for o in owners)}
    if not inner:
        return {}
    try:
        loss, outputs = _loss_and_outputs(ctx, ctx.runner.inputs[:1], inner)
        outputs.pop("zero inputs", None)
        paths = list(outputs)
        grads = torch.autograd.grad(loss, [outputs[p] for p in paths], allow_unused=True, retain_graph=True) \
            if paths and torch.is_tensor(loss) else ()
        zeroed = [p for p, g in zip(paths, grads) if g is not None and not bool(g.abs().sum() > 0)]
        found = {}
        for n in names:
            owner = n.rsplit(".", 1)[0]
            for z in (z for z in zeroed if z.startswith(owner + ".")):
                g = torch.autograd.grad(outputs[z], params[n], torch.ones_like(outputs[z]), allow_unused=True,
                                        retain_graph=True)[0]
                if g is not None and bool(g.abs().sum() > 0):
                    found[n] = z
                    break
        return found
    except Exception:  # a replay that raises under the hooks says nothing
        return {}


SAME_VALUES = 16
"""How far apart (in units of the values' dtype's eps, relative to their largest magnitude) the values a softmax's
weights sum over may be for them to be the same at every key. Measured on timm's LeViT-S8 (levit_384_s8 and
levit_conv_512_s8 at 64, 128 and 224 px, std-0.02 initialisation, float32): the last stage's values, whose tokens two
near-uniform attention downsamples averaged, differ by exactly 0; those of every other attention module by >= 3.4e3
eps: 210x above this."""


def _weights_moot(ctx: ModelContext, names: list[str], named: dict) -> dict:
    """{name: ByDesign} for parameters whose own module's attention weights do not matter on the audit's example:
    every softmax (and fused attention) of the module normalised over one key (EfficientViT's last stage at 64 px: a
    1 x 1 window; a softmax of one score is 1 whatever the score), or weighs values that are the same at every key
    (`SAME_VALUES`: LeViT-S8's last stage, whose tokens the attention downsamples before it averaged into one at
    this initialisation; a weighted mean of equal values is that value whatever the weights). Either way what makes
    the scores (a bias table, q and k) gets no gradient there, by design."""
    owners = {n.rsplit(".", 1)[0] for n in names if "." in n} & set(named)
    seen, active, handles = {}, [], []

    def enter(path):
        def hook(m, args):
            active.append(Observer())
            active[-1].__enter__()
            seen.setdefault(path, []).append(active[-1])
        return hook

    def leave(m, args, out):
        if active:
            active.pop().__exit__(None, None, None)

    for path in owners:
        handles += [named[path].register_forward_pre_hook(enter(path)), named[path].register_forward_hook(leave)]
    try:
        with torch.no_grad():
            ctx.runner(ctx.runner.inputs[:1])
    except Exception:  # the model does not run under the hooks: nothing shown
        return {}
    finally:
        for h in handles:
            h.remove()
        while active:  # a forward that raised left its observer open
            active.pop().__exit__(None, None, None)
    found = {}
    for path, observers in seen.items():
        kinds = [_how_moot(o.record) for o in observers]
        if kinds and all(kinds):
            found[path] = ByDesign(one_key=path) if all(k == "one key" for k in kinds) else ByDesign(same_values=path)
    return {n: found[n.rsplit(".", 1)[0]] for n in names if n.rsplit(".", 1)[0] in found}


def _how_moot(record) -> str | None:
    """"one key" where every softmax and fused attention of one forward of a module normalised over one key, "same
    values" where each did that or weighed values the same at every key, else None (None too where it computed
    none, or where the product that reads a softmax's weights is not found: nothing shown)."""
    kinds = []
    for i, sm in enumerate(record.order):
        if isinstance(sm, SoftmaxCall) and sm.output.dim():
            if sm.output.shape[sm.dim] == 1:
                kinds.append("one key")
                continue
            values = _values_of(record.order[i + 1:], sm.output)
            kinds.append("same values" if values is not None and _same_at_every_key(*values) else None)
        elif isinstance(sm, FusedAttention):
            kinds.append("one key" if sm.k.shape[-2] == 1 else "same values" if _same_at_every_key(sm.v, -2)
                         else None)
    if not kinds or None in kinds:
        return None
    return "one key" if all(k == "one key" for k in kinds) else "same values"


def _values_of(later: list, weights: Tensor) -> tuple | None:
    """(the other operand, the axis it is summed over) of the first later product that reads `weights` as one of its
    operands (the same numbers: `weights @ v`, or `v @ weights.transpose(-2, -1)` as LeViT's convolutional layout
    computes it), or None."""
    for m in later:
        if not isinstance(m, Matmul):
            continue
        for operand, other, axis in ((m.a, m.b, -2), (m.b, m.a, -1)):
            if operand.numel() == weights.numel() and torch.equal(
                    operand.flatten().sort().values, weights.to(operand.dtype).flatten().sort().values):
                return other, axis
    return None


def _same_at_every_key(values: Tensor, axis: int) -> bool:
    """Whether `values` are the same along `axis` (the keys), within `SAME_VALUES` eps of their largest magnitude."""
    if not values.is_floating_point() or values.numel() == 0:
        return False
    v = values.detach().float()
    spread = float((v - v.narrow(axis, 0, 1)).abs().max())
    return spread <= SAME_VALUES * torch.finfo(values.dtype).eps * float(v.abs().max())


def trainable(ctx: ModelContext) -> list:
    """[(name, parameter)] of the attention modules' trainable parameters."""
    return [(f"{p}.{n}", w) for p, m in ctx.modules.items() for n, w in m.named_parameters() if w.requires_grad]


TRAINABLE = Need("trainable attention parameters", lambda c: bool(trainable(c)),
                 "the attention modules have no trainable parameters")


def input_embedding(model: nn.Module, *, decoder: bool = False) -> nn.Module | None:
    """The model's token embedding: `get_input_embeddings()` (Hugging Face's), else its first nn.Embedding. With
    `decoder`, an encoder-decoder's decoder's own (Marian's decoder has an embedding of its own: the model's is
    the encoder's, whose every position the decoder sees through cross-attention), through every `get_decoder()`
    down to the decoder itself (Florence-2's get_decoder() is its whole BART, whose own table is the encoder's)."""
    if decoder:
        get_decoder = getattr(model, "get_decoder", None)
        try:
            inner = get_decoder() if callable(get_decoder) else None
        except Exception:  # a getter that is not implemented: the model's own embedding
            inner = None
        if isinstance(inner, nn.Module) and inner is not model:
            found = input_embedding(inner, decoder=True)
            if found is not None:
                return found
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
            if isinstance(emb, nn.Module):
                return emb
        except Exception:  # a model whose getter is not implemented: look for an nn.Embedding instead
            pass
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def prev_length(L: int, T: int) -> int:
    """The length tried before `L` (the audit's own, T, before the first of LONGER)."""
    shorter = [x for x in LONGER if T < x < L]
    return shorter[-1] if shorter else T


@detector(ID, "every attention parameter gets a finite non-zero gradient; for a causal model, no output sends "
              "gradient to later input embeddings", fix=FIX, needs=(TRAINABLE,), scope="model",
          unlocated="names the first attention layer with a parameter that gets no gradient (its `layer`), whose "
                    "own in-place audit (gradients) points at the line")
def check_gradient_flow(ctx: ModelContext) -> DetectorResult:
    runner = ctx.runner
    params = trainable(ctx)
    seq = runner.inputs[:1]
    emb = input_embedding(ctx.model, decoder=runner.encoder_decoder) if runner.tokens else None
    leaf = {}

    def hook(m, args, out):  # the token embeddings (B, T, D) as a leaf: gradients w.r.t. each position
        if isinstance(out, Tensor) and out.is_floating_point() and out.shape[:2] == seq.shape[:2]:
            x = out.detach().requires_grad_(True)
            leaf["x"] = x
            return x.clone()  # not the leaf itself: a model may scale its embeddings in place (CTRL's *= sqrt(D))
        return None

    handle = emb.register_forward_hook(hook) if emb is not None else None
    outputs: dict = {}  # attention module -> its output (the first call's): does the model send it any gradient?

    kept = [m.register_forward_hook(_first_output(outputs, p)) for p, m in ctx.modules.items()]
    returned: list = []  # every tensor the model returned, not only the one the runner reads
    kept.append(ctx.model.register_forward_hook(lambda m, args, out: returned.extend(output_tensors(out))))
    try:
        if emb is None and seq.is_floating_point():
            leaf["x"] = seq.detach().clone().requires_grad_(True)
            seq = leaf["x"].clone()  # as above: the model may edit its input in place
        seed_rng(ctx.seed, device_dtype(ctx.model)[0])
        # eval mode again (the audit's own): a module that caches in eval mode what it computes from a parameter
        # (timm's TinyViT, EfficientViT and LeViT attention biases, dropped by their train()) was filled by an earlier
        # forward without autograd, and its parameter would get no gradient; now it is computed afresh
        ctx.model.eval()
        out, _ = runner(seq, grad=True)
        paths = list(outputs)
        total = sum(squared(t) for t in returned if t.requires_grad and t is not out)
        loss = squared(out) + total
        grads = torch.autograd.grad(loss, [w for _, w in params] +
                                    [outputs[p] for p in paths], allow_unused=True, retain_graph=True)
        grads, to_outputs = grads[:len(params)], grads[len(params):]
        # modules whose output the model sends no gradient to: cut off after them (a zero-initialised post-norm or
        # gate), so their parameters cannot get one whatever the attention does; not judged, and said so
        # (a gradient of exactly 0, not None: an output the graph does not reach was detached, which is judged)
        cut = {p for p, g in zip(paths, to_outputs) if g is not None and not bool(g.abs().sum() > 0)}
        # a parameter's module: the innermost attention module holding it (an attention block may hold one)
        owner = lambda n: max((p for p in ctx.modules if n.startswith(p + ".")), key=len, default=None)  # noqa: E731
        missing = [n for (n, _), g in zip(params, grads) if (g is None or not bool(g.abs().sum() > 0))
                   and owner(n) not in cut]
        nonfinite = [n for (n, _), g in zip(params, grads) if g is not None and not bool(torch.isfinite(g).all())]
        # what got exactly 0 in the model's dtype, asked again in its float64 copy: a gradient that underflows (tiny
        # outputs at this initialisation) is no cut path
        zero_cut = sorted(cut)
        zero_params = [n for (n, _), g in zip(params, grads) if g is None or not bool(g.abs().sum() > 0)]
        wide = _in_float64(ctx, seq, zero_params, zero_cut) if missing or cut else None
        underflow = []
        if wide is not None:
            got, reached = wide
            cut -= reached
            underflow = [n for n in zero_params if n in got and owner(n) not in cut]
            missing = [n for n in zero_params if n not in got and owner(n) not in cut]
        if missing:  # not shown by a float64 copy of the model, or none could run: each module alone, in float64
            alone = _underflow_in_place(ctx, seq, missing)
            underflow += [n for n in missing if n in alone]
            missing = [n for n in missing if n not in alone]
        frozen = _frozen(ctx, loss, missing) if missing else {}
        missing = [n for n in missing if n not in frozen]
        leak = ""
        if ctx.causal and "x" in leaf and runner.sequence and out.shape[1] == seq.shape[1] and seq.shape[1] >= 2:
            T = seq.shape[1]
            c = (T - 1) // 2
            g = torch.autograd.grad(squared(out[:, :c + 1]), leaf["x"], allow_unused=True)[0]
            if g is not None:
                later = float(g[:, c + 1:].abs().max())
                if later > 1e-12 * max(float(g.abs().max()), 1e-300):
                    leak = (f"(out[:, :{c + 1}] ** 2).sum() has gradient up to {later:.3g} w.r.t. input embeddings "
                            f"after t={c} (must be exactly 0)")
    finally:
        ctx.model.eval()  # and no cache keeps this forward's graph
        if handle is not None:
            handle.remove()
        for h in kept:
            h.remove()
    if nonfinite:
        return DetectorResult(ID, "fail", "attention parameters get non-finite gradients",
                              evidence=", ".join(nonfinite[:6]), fix=FIX)
    by_design = {n: why for n, why in unused_by_design(ctx, missing).items() if why is not None} if missing else {}
    missing = [n for n in missing if n not in by_design]
    unmeasured = {n: why for n, why in by_design.items() if why.nonfinite}
    longer = {n: why.length for n, why in by_design.items() if why.length}
    zeroed = sorted({why.zeroed or why.zero_input or why.discarded or why.one_key or why.same_values
                     for why in by_design.values()
                     if why.zeroed or why.zero_input or why.discarded or why.one_key or why.same_values})
    if missing:
        owners = sorted({n.rsplit(".", 1)[0] for n in missing})
        layer = next((p for p in ctx.order if any(n.startswith(p + ".") for n in missing)), None)
        return DetectorResult(ID, "fail", f"{len(missing)} of {len(params)} attention parameters get no gradient",
                              value=float(len(missing)), threshold=0.0, fix=FIX, layer=layer,
                              evidence=f"zero or missing gradient of the outputs' (out ** 2).sum(): "
                                       f"{', '.join(missing[:8])}"
                                       f"{' ...' if len(missing) > 8 else ''} (in {', '.join(owners[:4])})")
    if unmeasured:  # the longer length that would have told: the output is not finite there
        why = next(iter(unmeasured.values()))
        return DetectorResult(ID, "fail", f"the model's output is not finite on a plain input of {why.nonfinite} "
                                          f"tokens" + (f", first at {why.nonfinite_at}" if why.nonfinite_at else ""),
                              value=float(why.nonfinite), fix=NONFINITE_FIX, layer=why.nonfinite_at,
                              evidence=f"(out ** 2).sum() is not finite at length {why.nonfinite}, where "
                                       f"{len(unmeasured)} of {len(params)} attention parameters that get no gradient "
                                       f"at length {seq.shape[1]} would be tried ({', '.join(list(unmeasured)[:4])}"
                                       f"{' ...' if len(unmeasured) > 4 else ''}): not judged")
    if leak:
        return DetectorResult(ID, "fail", "the gradient lets the future in: past outputs send gradient to later "
                                          "inputs", evidence=leak, fix=FIX)
    if longer:
        lengths = sorted(set(longer.values()))
        layer = next((p for p in ctx.order if any(n.startswith(p + ".") for n in longer)), None)
        return DetectorResult(ID, "warn", f"{len(longer)} of {len(params)} attention parameters get no gradient at "
                                          f"this length ({seq.shape[1]}), but do at {', '.join(map(str, lengths))}: "
                                          f"used only on longer sequences",
                              layer=layer,
                              evidence=", ".join(f"{n} (from {L}; not at {prev_length(L, seq.shape[1])})"
                                                 for n, L in list(longer.items())[:8])
                                       + (" ..." if len(longer) > 8 else "")
                                       + "; a sparse-attention indexer, a compressor or a dynamic mask acts only past "
                                         "a length: audit at that length (seq_len=) to check them",
                              fix=f"pass seq_len={lengths[0]} (or more) to audit them where the model uses them")
    given = {n: why.given for n, why in by_design.items() if why.given}
    if given:  # used, but only with an input the audit passed none of: not exercised, and said so
        names = sorted(set(given.values()))
        layer = next((p for p in ctx.order if any(n.startswith(p + ".") for n in given)), None)
        gated = {n: why.given_zeroed for n, why in by_design.items() if why.given_zeroed}
        return DetectorResult(ID, "warn", f"{len(given)} of {len(params)} attention parameters get no gradient from "
                                          f"the audit's inputs, but are used with {', '.join(names)} (all ones), which "
                                          f"it did not pass: not exercised", layer=layer,
                              evidence=", ".join(f"{n} (with {g}" + (f"; there behind a factor 0 at this "
                                                                      f"initialisation, after {gated[n]})"
                                                                      if n in gated else ")")
                                                 for n, g in list(given.items())[:8])
                                       + (" ..." if len(given) > 8 else ""),
                              fix=phrase("pass {example}{...} with " + " and ".join(names) + " to audit them where "
                                         "the model uses them", ctx.runner.options))
    if underflow:
        dtype = str(ctx.dtype).replace("torch.", "")
        not_judged_extra = (f"; {len(underflow)} of them only in a float64 copy (in {dtype}, their gradient is "
                            f"below the smallest number: the outputs are tiny at this initialisation), "
                            f"{', '.join(underflow[:4])}{' ...' if len(underflow) > 4 else ''}")
    else:
        not_judged_extra = ""
    unjudged = ([p for p in ctx.order if p in cut] or sorted(cut)) + zeroed  # in call order, then inner modules
    judged = sum(owner(n) not in cut and n not in by_design and n not in frozen for n, _ in params)
    if frozen:
        subs = sorted(set(frozen.values()))
        not_judged_extra += (f"; not judged: the {len(frozen)} attention parameters of {', '.join(subs[:4])}"
                             f"{' ...' if len(subs) > 4 else ''}, a frozen sub-model: none of its parameters, its "
                             f"feed-forwards and norms too, gets a gradient (run without autograd as a whole, as a "
                             f"feature extractor is)")
    not_judged = (f"; not judged: the parameters of {len(unjudged)} modules whose output the model sends no gradient "
                  f"at this initialisation (what follows them multiplies it by 0: a zero-initialised norm or gate; "
                  f"or their input is 0; or the outputs their parameters move are those the model discards; or "
                  f"they attend one key, or values that are the same at every key), "
                  f"{', '.join(unjudged[:4])}{' ...' if len(unjudged) > 4 else ''}" if unjudged else "")
    alike = sorted({why.same_values for why in by_design.values() if why.same_values})
    if alike:  # named apart: a property of the example and the initialisation, not of the layer
        not_judged += (f"; {', '.join(alike[:4])}{' ...' if len(alike) > 4 else ''} weigh values that are the same "
                       f"at every key here (their tokens are all alike: averaged into one before them, as by "
                       f"near-uniform attention at this initialisation), so the attention weights do not matter and "
                       f"what makes the scores gets no gradient")
    if (unjudged or frozen) and not judged:
        return DetectorResult(ID, "skip", f"not measured{not_judged_extra.replace('; not judged', '')}"
                                          f"{not_judged.replace('; not judged', '')}")
    return DetectorResult(ID, "pass", f"all {judged} attention parameters get finite non-zero gradients"
                          + not_judged_extra
                          + (" and no output sends gradient to later input embeddings" if ctx.causal and "x" in leaf
                             else "") + not_judged)
