"""Finding a model's attention modules: torch's `nn.MultiheadAttention`, timm's and Hugging Face's attention
classes (by class), and any module that runs a softmax over (Tq, Tk) scores or a fused SDPA call in one observed
forward (the innermost such module with parameters); and a module in the place attention has in the other blocks.
Only modules that mix tokens: one whose every observed attention sums its q·k product over the tokens and has
(Tq, Tk) scores of another size (DaViT's channel attention, softmax(q^T k) over (B, H, d, d)) attends between
channels; one whose every softmax normalises a product with a weight of the model over that weight's outputs (an MoE
router's softmax(x W) over (B, T, experts), ZAYA's; or x W + c, a gate with a bias) gives each token a distribution
over classes of its own; both are left out, saying why (`Observation.not_tokens`).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._observe import Affine, Matmul, Mode, Observer, SoftmaxCall, summed_and_scores
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
    # a library attention class that computes no attention weights over the tokens (`other_mixer`): watched by the
    # model-level checks like every module the forward calls, not audited in place as softmax attention
    mixer: bool = False


def class_kind(module: nn.Module) -> str | None:
    if isinstance(module, TORCH_ATTENTION):
        return "torch nn.MultiheadAttention"
    mod, name = type(module).__module__, type(module).__name__
    if mod.startswith("timm.") and name.endswith("Attention"):
        return "timm attention class"
    if mod.startswith("transformers.") and re.search(r"Attention$", name) and "Output" not in name:
        return "Hugging Face attention class"
    return None


def kin(a: type, b: type) -> bool:
    """Whether two module classes are of one kind: the same, or sharing a base class below nn.Module (a catalog
    variant and its reference; not a hybrid's Mamba mixer beside its attention, each an nn.Module of its own)."""
    return a is b or any(not issubclass(nn.Module, c) for c in set(a.__mro__) & set(b.__mro__))


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
    weighs: frozenset = frozenset()  # modules inside which a softmax, fused or flex attention ran (see other_mixer)
    not_tokens: dict = field(default_factory=dict)  # {module path: why} of those that attend between channels
    deformable: dict = field(default_factory=dict)  # {module path: why} of deformable attention (`ModuleWatch.deformable`)


aten = torch.ops.aten


def _overloads(*names: str) -> frozenset:
    """The aten overloads named "op.overload" that this torch has (`_safe_softmax` came in torch 2.5)."""
    return frozenset(getattr(getattr(aten, n.split(".")[0]), n.split(".")[1])
                     for n in names if hasattr(aten, n.split(".")[0]))


SOFTMAX_OPS = _overloads("_softmax.default", "_safe_softmax.default")
# ops whose output holds its input's values as they were (a cast, a copy); a view shares its input's storage, and
# eval-mode dropout returns the tensor itself
KEEPS_VALUES = _overloads("_to_copy.default", "clone.default", "alias.default", "detach.default",
                          "lift_fresh.default")
DIVIDES = _overloads("div.Tensor", "div_.Tensor")


class Renormalisation(Mode):
    """Follows each softmax's output while a forward runs, by storage: the tensors that hold its values as they came
    (`kept`: a view, a cast, a copy: Hugging Face's `softmax(s, dtype=torch.float32).to(q.dtype)` makes a new one),
    and whether the softmax was renormalised over its last axis (`renormalised`): a sum over that axis of a tensor of
    its shape computed from it, then a division of such a tensor by that sum, as GroupViT's assignment does
    (`attn / (attn.sum(dim=-1, keepdim=True) + eps)` after its hard softmax over the groups). Entered outside the
    `Observer`, so that both see every op."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.kept: dict = {}  # {storage: the softmax output's storage} of the tensors holding its values as they came
        self.derived: dict = {}  # {storage: the softmax's} of tensors of its shape computed from its output
        self.sums: dict = {}  # {storage: the softmax's} of its row sums, and what is computed from them (+ eps)
        self.shapes: dict = {}  # {the softmax output's storage: its shape}
        self.renormalised: set = set()  # the softmax outputs' storages
        self._held: list = []  # keeps the storages followed alive, so that their addresses are not reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(func, torch._ops.HigherOrderOperator):
            try:
                self._note(func, args, out)
            except Exception:  # following must never break the forward
                pass
        return out

    def _follow(self, into: dict, t: Tensor, source) -> None:
        into[_storage(t)] = source
        self._held.append(t)

    def _note(self, func, args, out) -> None:
        ins = [x for a in args for x in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(x, Tensor)]
        outs = [o for o in (out if isinstance(out, (list, tuple)) else (out,)) if isinstance(o, Tensor)]
        if not ins or not outs:
            return
        if func in SOFTMAX_OPS:
            key = _storage(outs[0])
            self.shapes[key] = tuple(outs[0].shape)
            self._follow(self.kept, outs[0], key)
            self._follow(self.derived, outs[0], key)
            return
        first = _storage(ins[0])
        if func in KEEPS_VALUES and first in self.kept:
            self._follow(self.kept, outs[0], self.kept[first])
        elif func is aten.copy_.default and len(ins) > 1 and _storage(ins[1]) in self.kept:
            self._follow(self.kept, ins[0], self.kept[_storage(ins[1])])
        keys = [_storage(x) for x in ins]
        source = next((self.derived[k] for k in keys if k in self.derived), None)
        total = next((self.sums[k] for k in keys if k in self.sums), None)
        if func in DIVIDES and len(ins) > 1 and keys[1] in self.sums and keys[0] in self.derived \
                and tuple(ins[0].shape) == self.shapes[self.derived[keys[0]]]:
            self.renormalised.add(self.sums[keys[1]])
        elif func is aten.sum.dim_IntList and first in self.derived:
            shape = self.shapes[self.derived[first]]
            if tuple(ins[0].shape) == shape and [d % len(shape) for d in args[1]] == [len(shape) - 1]:
                self._follow(self.sums, outs[0], self.derived[first])
        elif total is not None and outs[0].numel() * self.shapes[total][-1] == math.prod(self.shapes[total]):
            self._follow(self.sums, outs[0], total)  # the row sums plus eps, clamped
        if source is not None and tuple(outs[0].shape) == self.shapes[source]:
            self._follow(self.derived, outs[0], source)


class ModuleWatch:
    """Hooks on every module of a model while a forward runs under the observer (`.observer`, entered by the
    caller): each call that returns is passed to `on_return(path, module, args, kwargs, out, attends)`, `attends`
    whether a softmax over (.., Tq, Tk) scores or a fused SDPA call ran inside it (`.counts`: {path: [softmaxes,
    fused calls]} summed over its calls). `.open`: the modules whose forward has not returned (where a forward that
    raised was)."""

    def __init__(self, model: nn.Module, on_return=None):
        self.named = dict(model.named_modules())
        self.paths = {id(m): p for p, m in self.named.items()}
        self.observer, self.on_return = Observer(), on_return
        self.follow = Renormalisation()  # which softmax outputs were renormalised, or cast, on their way (`_over_queries`)
        self.counts: dict = {}
        self.flex: dict = {}  # {path: flex_attention calls and softmaxes of any shape}
        self.stack: list = []
        self.handles: list = []
        self.mixes: dict = {}  # {path: [calls whose attention mixes tokens, calls whose attention mixes channels]}
        self.shapes: dict = {}  # {path: the shapes of the scores of a call that mixed channels}
        self._axes: dict = {}  # {id(softmax or fused call): (the size its q·k product sums over, its scores' shape)}
        self.routes: dict = {}  # {path: (calls whose every softmax runs over a weight's outputs, (scores, weight))}
        self.sampled: dict = {}  # {path: (scores, weight, how read)} of deformable and outlook attention (`deformable`)
        self.own: dict = {}  # {path: [calls whose every softmax weighs each token's own items (`_per_token`), scores]}
        self._weights: set | None = None  # the storages of the model's parameters (`_over_weight`), read once
        self._over: dict = {}  # {id(softmax or fused call): `_over_weight`'s answer}
        self.assigns: dict = {}  # {path: scores' shape}: every softmax over q·k's queries, none counted (`assignments`)

    @property
    def open(self) -> list[str]:
        return [self.paths[id(entry[0])] for entry in self.stack]

    def _pre(self, m, args, kwargs):
        record = self.observer.record
        self.stack.append((m, len(record.softmaxes), len(record.fused), len(record.flex), record.weighed_samples,
                           record.weighed_unfolds))

    def _post(self, m, args, kwargs, out):
        if not (self.stack and self.stack[-1][0] is m):
            return
        _, s0, f0, x0, g0, u0 = self.stack.pop()
        record = self.observer.record
        soft = [s for s in record.softmaxes[s0:] if s.output.dim() >= 3 and s.output.shape[-1] >= 2
                and (s.dim in (-1, s.output.dim() - 1) or self._over_queries(s))]
        fused = record.fused[f0:]
        path = self.paths[id(m)]
        over = [s for s in record.softmaxes[s0:] if s.dim not in (-1, s.output.dim() - 1)]
        # by design over the queries (`assignments`) only where one was seen renormalised over the keys: a softmax
        # over the queries cast on its way to the values' product (the bug in Hugging Face's form) is none
        if over and not soft and not fused and all(self._qk_columns(s) is not None for s in over) \
                and any(_storage(s.output) in self.follow.renormalised for s in over):
            self.assigns[path] = tuple(over[0].output.shape)
        entry = self.counts.setdefault(path, [0, 0])
        entry[0] += len(soft)
        entry[1] += len(fused)
        # for `other_mixer`: FlexAttention calls, and a softmax of any shape (SwiftFormer's over an axis of size 1,
        # its bug, is still a softmax the layer meant as its attention); a (T, T) product tells nothing: a chunked
        # delta rule makes one of its decays and keys, as a softmax written with an exponential of its own does
        self.flex[path] = self.flex.get(path, 0) + len(record.flex[x0:]) + len(record.softmaxes[s0:])
        gathered = "unfold" if record.weighed_unfolds > u0 else "grid_sample" if record.weighed_samples > g0 else ""
        split = [self._over_weight(c, split=True) for c in soft] if gathered and not fused else []
        if split and all(split):  # weights over sampling points or neighbours weighing values read there: `deformable`
            self.sampled[path] = (*split[0], gathered)
        elif soft or fused:
            self._mixes(path, args, kwargs, soft + fused)
        if self.on_return is not None:
            self.on_return(path, m, args, kwargs, out, bool(soft or fused))

    def _mixes(self, path: str, args, kwargs, calls: list) -> None:
        """Count the call as mixing channels where every attention in it sums its q·k product over an axis of the
        tokens' count and has (Tq, Tk) scores of another size (DaViT's channel attention, (B, H, d, d), whose heads
        may number as many as the tokens: 16 in davit_base_fl's third stage at 64 px); as mixing tokens otherwise.
        The tokens' count: the call's first tensor's second axis, (B, T, D), or its pixels, (B, C, H, W); a call
        with no such tensor counts as mixing tokens."""
        over = []
        for c in calls:
            if id(c) not in self._over:
                self._over[id(c)] = self._over_weight(c)
            over.append(self._over[id(c)])
        if all(over):  # a router's or a gate's softmax (x W over W's outputs): one distribution per token, no mixing
            entry = self.routes.setdefault(path, [0, over[0]])
            entry[0] += 1
            return
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.dim() in (3, 4)), None)
        tokens = None if x is None else int(x.shape[1]) if x.dim() == 3 else int(x.shape[2] * x.shape[3])
        for c in calls:
            if id(c) not in self._axes:
                self._axes[id(c)] = summed_and_scores(self.observer.record, c)
        if x is not None and all(_per_token(self._axes[id(c)][1], self._projected(c), x) for c in calls):
            entry = self.own.setdefault(path, [0, self._axes[id(calls[0])][1]])
            entry[0] += 1
            return
        shapes = []
        for c in calls:
            summed, shape = self._axes[id(c)]
            if tokens is None or summed != tokens or tokens in shape[-2:]:
                shapes = None
                break
            shapes.append(shape)
        entry = self.mixes.setdefault(path, [0, 0])
        entry[shapes is not None] += 1
        if shapes:
            self.shapes.setdefault(path, sorted(set(shapes)))

    def _over_queries(self, call: SoftmaxCall) -> bool:
        """Whether a softmax over the second-last axis is attention's, over the wrong axis (the bug: each key's
        column sums to 1, not each query's row): its input is q·k, a product of two activations (neither a weight
        of the model), and a later product sums that very output with values over its last axis. Linear attention's
        softmax of the keys over the tokens (k = x W_k, then k^T v) normalises a projection, not q·k; slot attention
        renormalises its softmax over the slots before the values' product: neither is counted.
        Uncounted, a user's model with that bug was "no attention found" instead of failing (its class is no
        library's). The output is followed through the ops that keep its values (`Renormalisation.kept`: a cast
        back from float32, a copy), as Hugging Face's layers write it."""
        i = self._qk_columns(call)
        if i is None:
            return False
        record = self.observer.record
        out, t_k = _storage(call.output), call.output.shape[-1]
        weights = {k for k, source in self.follow.kept.items() if source == out} | {out}
        return out is not None and any(
            isinstance(m, Matmul) and ((_storage(m.a) in weights and m.a.shape[-1] == t_k)
                                       or (_storage(m.b) in weights and m.b.dim() >= 2 and m.b.shape[-2] == t_k))
            for m in record.order[i + 1:])

    def _qk_columns(self, call: SoftmaxCall) -> int | None:
        """Where a softmax over the second-last axis of q·k (a product of two activations, neither a weight of the
        model) is in the record; None for any other softmax."""
        if call.dim not in (-2, call.output.dim() - 2) or call.output.shape[-2] < 2:
            return None
        record = self.observer.record
        i = next((j for j, o in enumerate(record.order) if o is call), None)
        product = None if i is None else next(
            (m for m in reversed(record.order[:i]) if isinstance(m, (Matmul, Affine))
             and math.prod(_shape(m)) == call.input.numel()), None)
        if not isinstance(product, Matmul) or product.a.dim() < 2 or product.b.dim() < 2:
            return None
        if {_storage(product.a), _storage(product.b)} & self._model_weights():
            return None
        return i

    def _model_weights(self) -> set:
        """The storages of the model's parameters, read once."""
        if self._weights is None:
            self._weights = {_storage(p) for m in self.named.values() for p in m.parameters(recurse=False)} - {None}
        return self._weights

    def _projected(self, call) -> bool:
        """Whether the last product before an observed softmax is x W, a weight of the model its right operand (a
        projection of the tokens' own features), not q·k of two activations."""
        if not isinstance(call, SoftmaxCall):
            return False
        record = self.observer.record
        i = next((j for j, o in enumerate(record.order) if o is call), None)
        product = None if i is None else next(
            (m for m in reversed(record.order[:i]) if isinstance(m, (Matmul, Affine))), None)
        return product is not None and _storage(product.b) in self._model_weights()

    def _over_weight(self, call, split: bool = False) -> tuple | None:
        """(the scores' shape, the weight's) where an observed softmax normalises, over its last axis, a product
        whose right operand is a weight of the model, two-dimensional, that gives the scores that axis: x W, one
        distribution per token over W's output features (an MoE router's experts, a gate's classes), never over
        keys, which come from the tokens (a learned query's scores, q W_k x^T, take their last axis from the tokens'
        keys). `split`: over a part of them instead, W's outputs viewed as (heads, that axis), more than one
        (deformable attention's weights over each head's sampling points). None otherwise (a fused call, q·k of two activations, no product
        found)."""
        if not isinstance(call, SoftmaxCall):
            return None
        record = self.observer.record
        i = next((j for j, o in enumerate(record.order) if o is call), None)
        # x W, or x W + c in one op (a gate with a bias, nn.Linear's addmm): the last product with as many numbers
        product = None if i is None else next(
            (m for m in reversed(record.order[:i]) if isinstance(m, (Matmul, Affine))
             and math.prod(_shape(m)) == call.input.numel()), None)
        width, outputs = call.input.shape[-1], product.b.shape[-1] if product is not None else 0
        if product is None or product.b.dim() != 2 or _shape(product)[-1] != outputs or not (
                (outputs == width and not split) or (split and 1 < width < outputs and outputs % width == 0)):
            return None
        if _storage(product.b) not in self._model_weights():
            return None
        return tuple(call.output.shape), tuple(product.b.shape)

    def not_tokens(self) -> dict:
        """{path: why} of the modules whose every call with attention in it mixed channels, not tokens."""
        return {p: f"its softmax runs over scores of shape {', '.join(map(str, self.shapes[p][:3]))}, whose q·k "
                   f"product sums over the tokens: it attends between channels (as DaViT's channel attention), not "
                   f"between tokens" for p, (tokens, channels) in self.mixes.items() if channels and not tokens}

    def per_token(self) -> dict:
        """{path: why} of the modules whose every call with attention in it weighed each token's own items
        (`_per_token`): hyper-connections' streams, not tokens."""
        return {p: f"its softmax runs over scores of shape {scores}, one {scores[-2]} x {scores[-1]} distribution for "
                   f"each of the {scores[1]} tokens its input starts with: it weighs each token's own items (a "
                   f"hyper-connection's streams), not other tokens"
                for p, (_, scores) in self.own.items() if not any(self.mixes.get(p, ()))}

    def assignments(self) -> dict:
        """{path: why} of the modules whose every softmax ran over the queries of q·k scores, none weighed with the
        values as it came (`_over_queries` counts that one, the bug), and one was seen renormalised over the keys
        (`Renormalisation`: a row sum, then a division by it): each key assigned among the queries, by design
        (GroupViT's grouping of patches, slot attention). The layer detectors presuppose weights normalised over the
        keys; a library class so written is left out, saying why. A softmax over the queries that nothing renormalises
        is the bug's form, whatever copies it on its way (left to `_over_queries` and the audit)."""
        return {p: f"its softmax runs over the queries of q·k scores of shape {scores}, renormalised over the keys "
                   f"before the values' product: it assigns each key among the queries (GroupViT's grouping, slot "
                   f"attention), by design, not attention normalised over the keys"
                for p, scores in self.assigns.items()}

    def routers(self) -> dict:
        """{path: why} of the modules whose every call with a softmax in it ran only softmaxes over a weight's outputs
        (`_over_weight`): routers and gates, which weigh classes, not tokens."""
        return {p: f"its softmax runs over scores of shape {scores} made by a product with a {weight[0]} x {weight[1]} "
                   f"weight of the model, over that weight's {weight[1]} outputs: each token's distribution over "
                   f"classes of its own (an MoE router's experts, a gate's), not attention between tokens"
                for p, (_, (scores, weight)) in self.routes.items() if not any(self.mixes.get(p, ()))}

    def deformable(self) -> dict:
        """{path: why} of the modules whose every softmax ran over each head's part of a weight's outputs (`_over_weight`,
        split: more outputs than the softmax's axis) and whose weights multiplied values read at points by grid_sample
        (`Record.weighed_samples`): deformable attention (Deformable DETR's, RT-DETR v2's, D-FINE's), whose weights
        are over its sampling points, made from each query alone, and whose memory is read where the query's offsets
        point, bilinearly, not through keys. No token attention the layer audit can measure (no (Tq, Tk) weights, no
        q·k): a mixer of another kind (`find_attention`), whose parameters the model-level checks still judge
        (gradient_flow: sampling offsets that move nothing fail there). One whose softmax runs over a weight's outputs
        and that weighs nothing it sampled (a grid_sample beside it, a softmax over every output at once) stays
        audited: its keys may be lost, a finding. Outlook attention (VOLO's) likewise: its weights over each location's
        k x k neighbours, made from the location alone, weigh values gathered by unfold (`Record.weighed_unfolds`)."""
        return {p: f"its softmax runs over scores of shape {scores}, each head's part of a product with a {weight[0]} x "
                   f"{weight[1]} weight of the model made from each query alone, and weighs " + (
                       "values it read at points (grid_sample): deformable attention, whose weights are over its "
                       "sampling points" if how == "grid_sample" else
                       "values it gathered from each location's neighbourhood (unfold): outlook attention (VOLO's), "
                       "whose weights are over those neighbours") +
                   ", not over keys; not audited in place as softmax attention (no (Tq, Tk) weights), the model-level "
                   "checks watch it"
                for p, (scores, weight, how) in self.sampled.items() if not any(self.mixes.get(p, ()))}

    def __enter__(self):
        try:
            for m in self.named.values():
                if isinstance(m, torch.jit.ScriptModule):  # compiled: takes no hooks (its ops count for the module
                    continue  # around it; the model audit says so, `compiled_paths`)
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        except BaseException:  # none left on the user's model
            for h in self.handles:
                h.remove()
            self.handles.clear()
            raise
        self.follow.__enter__()  # outside the observer, entered after this
        return self

    def __exit__(self, *exc):
        self.follow.__exit__(*exc)
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _shape(product: Matmul | Affine) -> tuple:
    """The shape of a product's output."""
    return tuple(product.out.shape) if isinstance(product, Matmul) else product.shape


def _storage(t: Tensor):
    """The address of a tensor's storage (a view of a weight, W.t() in x @ W.t(), shares it), None where it has none
    to read (a tensor subclass, a meta tensor)."""
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _per_token(scores: tuple, projected: bool, x: Tensor) -> bool:
    """Whether scores of this shape are one distribution per token of `x` over items of the token's own: x is
    (B, S, N, D), the scores (B, S, N, N), made by a projection of the token's features (`projected`: x W, no q·k of
    two activations), and N is no count of x's tokens. GLM-5's hyper-connections: a Sinkhorn mix of each token's 4
    streams, observed as a softmax over (Tq, Tk) and audited as attention. Not axial attention over a map's rows,
    (B, H, W, W) for (B, H, W, C), which is q·k; not Longformer's bands or deformable attention's sampling points,
    (B, T, H, n) for (B, T, D): their items are other tokens."""
    if x.dim() != 4 or len(scores) != 4 or not projected:
        return False
    counts = {int(x.shape[1]), int(x.shape[2] * x.shape[3]), int(x.shape[1] * x.shape[2])}
    return tuple(scores[:2]) == tuple(x.shape[:2]) and scores[-2] == scores[-1] == int(x.shape[2]) \
        and scores[-1] not in counts


def compiled_paths(model: nn.Module) -> list[str]:
    """The paths of the model's outermost TorchScript submodules ([""] where the model itself is one): compiled, they
    take no hooks, so `ModuleWatch` leaves them out and their ops count for the module around them."""
    if isinstance(model, torch.jit.ScriptModule):
        return [""]  # the model itself
    paths = [p for p, m in model.named_modules() if p and isinstance(m, torch.jit.ScriptModule)]
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths)]


def observe_attention(runner: Runner) -> Observation:
    """One forward of the example's first sequence (at most 8 positions) under the observer."""
    model = runner.model
    watch = ModuleWatch(model)
    named = watch.named
    error, raised_in = None, None
    seq = runner.inputs[:1]
    if runner.sequence and seq.shape[1] > 8:
        seq = seq[:, :8]  # finding needs the ops, not the length: the observer records every one of them
    try:
        with watch, watch.observer:
            runner(seq, grad=True)
    except Exception as exc:  # a model that raises is a finding, reported by model_runs
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        # the modules whose forward did not return: the innermost one with parameters is where it raised
        inside = [p for p in watch.open if p and any(True for _ in named[p].parameters())]
        raised_in = inside[-1] if inside else None
    if error is not None:
        try:  # the model, or the observer? Without the observer, a model that runs was not the one that raised
            runner(seq, grad=True)
        except Exception:
            pass
        else:
            return Observation({}, note=f"observing the forward failed ({error}): modules found by class only")
    counts = watch.counts
    candidates = [p for p, (s, f) in counts.items()
                  if (s or f) and p and any(True for _ in named[p].parameters())]
    found = {}
    for p in innermost(candidates):
        s, f = counts[p]
        found[p] = ("observed fused scaled_dot_product_attention" if f and not s
                    else "observed softmax over (Tq, Tk) scores")
    not_tokens = {p: why for p, why in {**watch.not_tokens(), **watch.per_token(), **watch.assignments()}.items()
                  if p in found or class_kind(named[p])}
    found = {p: how for p, how in found.items() if p not in not_tokens}
    # a router or a gate: never a library attention class, nor of the kind of a module found attending (a layer of
    # that class whose softmax runs over its key projection's weight has lost its keys: a finding, audited)
    routers = watch.routers()
    attending = [type(named[p]) for p in found if p not in routers]
    not_tokens.update({p: why for p, why in routers.items() if p in found and not class_kind(named[p])
                       and not any(kin(type(named[p]), c) for c in attending)})
    found = {p: how for p, how in found.items() if p not in not_tokens}
    weighs = frozenset(p for p in named if any(counts.get(p, (0, 0))) or watch.flex.get(p))
    return Observation(found, error, raised_in, model_attends=any(counts.get("", (0, 0))), weighs=weighs,
                       not_tokens=not_tokens, deformable={p: why for p, why in watch.deformable().items() if p in found})


def other_mixer(path: str, named: dict, observed: dict, weighs: frozenset) -> bool:
    """Whether a module found by its class name computes no attention weights over the tokens: no softmax, fused or
    flex attention ran inside it in the observed forward, nor in a module of its kind (`kin`: a layer of the same
    class beside it that ran a softmax makes this one a layer that lost its own, which is a finding). RWKV's time
    mixing (a recurrence) and a hybrid's delta-rule "attention" (BailingHybrid's linear attention beside its softmax
    layers) are such mixers: properties of softmax weights (a convex combination of the values, a temperature) are
    not theirs, and `output_variance` failed them. The model-level checks still watch them. Never a class that routes
    its attention through transformers' attention functions (`routes_attention`). A library class that writes its
    softmax with an exponential of its own and has no kin that calls one would be read so too: left out of the
    in-place audit, named in the report, never failed."""
    if path in weighs or any(q.startswith(path + ".") for q in weighs):
        return False
    cls = type(named[path])
    return not routes_attention(cls) and not any(kin(cls, type(named[q])) for q in observed)


_ROUTES: dict = {}


def routes_attention(cls: type) -> bool:
    """Whether a class's forward hands its q, k and v to transformers' attention functions (`ALL_ATTENTION_FUNCTIONS`,
    an `attention_interface`): the library's own word that it computes softmax attention, so that one without a softmax
    seen in any layer is one whose attention function lost it (a user's own, registered for every layer), a finding."""
    if cls not in _ROUTES:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _ROUTES[cls] = "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source
    return _ROUTES[cls]


def find_attention(model: nn.Module, observed: dict, weighs: frozenset | None = None, *,
                   not_tokens: dict | None = None, deformable: dict | None = None) -> list[FoundModule]:
    """Class-recognised modules (innermost), and observed modules not inside or around one of them; none of
    `not_tokens` (`Observation.not_tokens`: modules that attend between channels). With `weighs` (an observed
    forward's modules in which attention ran), class-recognised modules that are mixers of another kind
    (`other_mixer`) are marked so, as are `deformable` ones (`Observation.deformable`), class-recognised or not."""
    named, not_tokens, deformable = dict(model.named_modules()), not_tokens or {}, deformable or {}
    by_class = [p for p in innermost([p for p, m in named.items() if p and class_kind(m)]) if p not in not_tokens]
    found = {p: f"{class_kind(named[p])}" + (f", {observed[p]}" if p in observed else "") for p in by_class}
    mixers = {p for p in by_class if weighs is not None and other_mixer(p, named, observed, weighs)}
    for p in mixers:
        found[p] += ("; no softmax, fused or flex attention observed in it or in a module of its kind: a token mixer "
                     "of another kind (a recurrence, linear attention), not audited in place as softmax attention")
    for p, how in observed.items():
        if not any(p == q or p.startswith(q + ".") or q.startswith(p + ".") for q in by_class):
            found[p] = how
    for p, why in deformable.items():
        if p in found and p not in mixers:
            mixers.add(p)
            found[p] += f"; {why}"
    # A module in the place attention has in the other blocks (h.1.attn beside h.0.attn and h.2.attn) is audited
    # too, even where nothing it ran looked like attention: a layer without a softmax is a finding, not a skip. Not
    # a module of another kind in that place (a hybrid's Mamba mixer, MoE or MLP in Nemotron-H's `mixer`): only one
    # whose class is kin to the attention's there (`kin`: as a catalog variant is to its reference).
    # The index may end the path: a ModuleList of attention layers itself (layers.1 beside layers.0).
    places: dict = {}  # {place pattern: the classes found there}
    for p in found:
        if re.search(r"\.\d+(\.|$)", p):
            places.setdefault(re.sub(r"\\.\d+(?=\\.|$)", r"\\.\\d+", re.escape(p)), []).append(type(named[p]))
    for p, m in named.items():
        in_place = any(re.fullmatch(place, p) and any(kin(type(m), c) for c in classes)
                       for place, classes in places.items())
        if p and p not in found and p not in not_tokens and in_place and any(True for _ in m.parameters()) \
                and not any(p.startswith(q + ".") or q.startswith(p + ".") for q in found):
            found[p] = "in the place attention has in the other blocks; no softmax or fused attention observed in it"
    order = list(named)
    return [FoundModule(p, type(named[p]).__name__, found[p], True, p in mixers)
            for p in sorted(found, key=order.index)]


__all__ = ["TORCH_ATTENTION", "FoundModule", "ModuleWatch", "Observation", "class_kind", "find_attention",
           "innermost", "observe_attention", "other_mixer"]
