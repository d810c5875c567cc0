"""`parameters_used`: every weight tensor the layer owns moves its output, measured exactly with autograd.

On a float64 copy of the layer, the backward pass of `(out ** 2).sum()` that the `gradients` check takes (one for
both: `_common.gradient_probe`, batch 2, 6 tokens) gives every parameter its gradient. A parameter the output
depends on gets a non-zero gradient on random inputs (the cotangent, 2 * out, has no zero entry on them); one it
does not depend on gets exactly zero: not small, zero, because no path of the graph reaches it (or every path
multiplies it by a structural zero). So the verdict is exact at every dtype: a tensor whose gradient is zero
everywhere, everywhere off its diagonal (an einsum that reads only `W[i, i]`), or on whole rows of a weight (output
features computed and dropped) is a finding, naming the parameter. Where that probe carries a padding mask (keys an
input apart from the queries), this check takes a forward and backward of its own without it (see
`check_parameters_used`).

A zero gradient is then confirmed by the forward pass itself: the zero-gradient entries are changed at random
and the output compared. If it moves, the output does depend on them and their gradient is cut on its way (a
`.detach()`: the `gradients` detector's finding, named in the evidence here); if it does not, they are unused.
What is unused is asked again at the audit's length, where a short probe could have hidden a use (a layer that pools
its keys sees one key there). The probe's tokens are scaled by a gain read on those very tokens (`gradient_gain`), so
that their median softmax row is neither uniform nor one-hot: a softmax one-hot to the last bit in every row gives q and
k a gradient of exactly 0, as a gain read on other tokens once did (d_model 1 in bfloat16,
tests/test_parameters_saturated.py).

A whole parameter that is unused yet equal to a block of rows of a parameter that is used is a kept copy: the
projections fused into one (to_qkv) and the originals kept to unfuse later (diffusers' `fuse_projections`). That is a
warning naming where it is kept, not a failure (`kept_copy`); a projection left out has values of its own.

A scale the layer multiplies its activations by (a gain, a learned temperature) that a normalisation after it divides
back out still gets a gradient, a direction, but the output is the same at any multiple of it: vit-pytorch 1.8.4's
nViT multiplied q and k by their learned scales before the l2 norm, so the logits stayed cosines. The gradient says
so exactly: <grad, P>, the loss's change as P grows by a factor, is rounding (`SIZE_MOVES`, `size_removed`). A weight
a matmul reads before a norm (QK-norm's projections) is scale-free by design and is not asked.

One parameter is legitimately inert: the key bias. It adds `q_i · b_k` to every score of row i, a constant over
the keys, which the softmax removes exactly. Its gradient is rounding noise in float64, rarely exactly zero, so
it is not flagged; where a parameter's gradient is exactly zero, the check asks the same question directly
(perturb it, and see whether the scores reaching the softmax move by a per-row constant only) and explains it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from .._core import skip
from .._observe import Observer, per_query_head
from .._probe import Probe
from .._registry import LONG, Need, detector
from .._result import DetectorResult, ProbeShape, Site
from .._tracing import MATMULS, computing, op_site, producer, trace_call
from ._common import (GradientProbe, float64_copy_or_skip, grad_of, gradient_probe, graph_call, logit_gain, pack,
                      result, zeros_drawn)
from ._heads_out import heads_out_seen

DET = "parameters_used"

OWNS_PARAMETERS = Need("a module with trainable parameters",
                       lambda p: isinstance(p.subject.layer, nn.Module)
                       and any(t.requires_grad for t in p.subject.layer.parameters()),
                       "the layer owns no trainable parameters (a function, or a module without weights)")

FORWARD_MOVES = 1e-9
"""How much (relative to the outputs' RMS, float64) changing a zero-gradient part must move the output to count
as the output depending on it. Unused weights measured exactly 0; a weight behind a .detach() moves it by O(1);
a key bias by rounding, below 1e-15 (it is then explained by the shift test below)."""

SHIFT_INERT = 1e-9
"""How constant over the keys a parameter's change of the scores must be (max spread over a row / largest change)
to count as a per-row shift the softmax ignores. float64: a key bias measured 0 to 1e-16; any weight that acts
through the keys spreads its change over them by the order of the change itself."""


SIZE_MOVES = 1e-9  # knob: which scales are doubled (a cost); the doubled forward pass decides the verdict
"""A scale the layer multiplies its activations by is asked whether the output depends on its size where the loss
changes by at most this much (relative to (out ** 2).sum(), float64) per unit of the scale's relative size,
<grad, P> / sum(out ** 2); the forward pass then decides (the output with the scale doubled, moved by at most
FORWARD_MOVES). A scale a normalisation after it divides back out (nViT's q_scale before its l2 norm, vit-pytorch
1.8.4) measured at most 5.1e-17; scales that act 2.8e-7 and more, which is a sum of terms of both signs and can come
near 0 by chance, hence the forward pass (`python benchmarks/margins.py --sizes`)."""

SIZE_ONLY = "in its size"  # where a scale's "unused" part lies: its size, which a later normalisation removes


@dataclass(frozen=True)
class ParameterReplay:
    """What the verdict was computed on: the float64 inputs and mask, and the parameters found unused."""

    inputs: tuple  # (query[, key[, value]]) in float64, detached
    allowed: Tensor | None
    unused: tuple[tuple[str, str], ...]  # (parameter name, where its gradient is zero)


def _runs(flags: Tensor) -> str:
    """'3-5, 9' for the True entries of a 1-D bool tensor."""
    idx = [int(i) for i in flags.nonzero().flatten()]
    spans, start = [], None
    for a, b in zip([None] + idx, idx + [None]):
        if start is None:
            start = b
        elif b is None or b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(spans)


def structural_zeros(grad: Tensor | None, *, table: bool = False) -> str:
    """Where a gradient is exactly zero in a way no correct use of the tensor gives: '' when it is not. `table`: a
    lookup table (an nn.Embedding's weight, such as T5's relative position buckets), whose rows are entries a short
    probe need not reach, not output features: only a table never read at all is a finding."""
    if grad is not None and int(torch.count_nonzero(grad)) == grad.numel():
        return ""  # the common case, in one pass and no temporary: no zero at all (a bool copy and its three
        # reductions took 2.8 ms over MultiHeadAttention(512, 8)'s million weights, this 0.6)
    nonzero = None if grad is None else grad.ne(0)  # one pass over the gradient, read three ways
    if nonzero is None or not bool(nonzero.any()):
        return "everywhere"
    if table:
        return ""
    if grad.dim() == 2 and grad.shape[0] == grad.shape[1] > 1:
        if int(nonzero.sum()) == int(nonzero.diagonal().sum()):
            return "everywhere off its diagonal"
    if grad.dim() == 2 and grad.shape[0] > 1:
        dead = ~nonzero.any(1)  # output features none of whose weights reach the output
        if bool(dead.any()):
            return f"on rows {_runs(dead)} of {grad.shape[0]} (output features that reach nothing)"
    return ""


def _rows_grow(short: Tensor | None, long: Tensor | None, t_short: int, t_long: int) -> str:
    """Where the rows a parameter's gradient reaches are one block of consecutive rows at both probe lengths, the
    longer probe's block holds the shorter's, and it grew by as many rows as the tokens did, or twice as many (a table
    read by position, or by distance i - j: T or 2T - 1 rows): '11 of 8192 rows at the short probe, 31 at the audit's
    length', else ''. Transformer-XL's biases sliced to the length (labml-nn's `key_pos_bias[P - T_k:P + T_q]`) read
    2T - 1 rows at every length; a table whose distances are clipped grows until the clip and no further, which is no
    such growth; a projection's weight (an nn.Linear's, a convolution's) is never asked: its rows are output features
    (`F.linear(h, W[:T])` drops the rest)."""
    if short is None or long is None or short.dim() < 1 or short.shape != long.shape:
        return ""
    used = [g.reshape(g.shape[0], -1).ne(0).any(1).nonzero().flatten() for g in (short, long)]
    if any(len(u) == 0 or int(u[-1] - u[0]) + 1 != len(u) for u in used):
        return ""  # not one block of consecutive rows
    (a, b), (c, d) = (int(used[0][0]), int(used[0][-1])), (int(used[1][0]), int(used[1][-1]))
    grew = (d - c) - (b - a)
    if not (c <= a and b <= d and grew in (t_long - t_short, 2 * (t_long - t_short)) and grew > 0):
        return ""
    return f"{b - a + 1} of {short.shape[0]} rows at the short probe, {d - c + 1} at the audit's length"


def _zero_part(grad: Tensor | None, param: Tensor) -> Tensor:
    """The entries of `param` whose gradient is exactly zero."""
    return torch.ones_like(param, dtype=torch.bool) if grad is None else grad.eq(0)


def _forward_moves(sub, name: str, part: Tensor, qkv, allowed, out: Tensor, gen: torch.Generator) -> float:
    """How much the output moves (relative to its RMS) when the entries `part` of the parameter change at random;
    the parameter is restored afterwards."""
    param = dict(sub.layer.named_parameters())[name]
    noise = torch.randn(param.shape, generator=gen, dtype=param.dtype).to(param.device)
    return _moved_by(sub, name, lambda p: p.add_(torch.where(part, noise, torch.zeros_like(noise))), qkv, allowed, out)


def _moved_by(sub, name: str, change, qkv, allowed, out: Tensor) -> float:
    """How much the output moves (relative to its RMS) with `change` done in place to the parameter `name`; the
    parameter is restored afterwards."""
    param = dict(sub.layer.named_parameters())[name]
    saved = param.detach().clone()
    with torch.no_grad():
        change(param)
        try:
            moved = sub(*qkv, allowed).out
        finally:
            param.copy_(saved)
    scale = float(out.detach().square().mean().sqrt()) or 1.0
    return float((moved - out.detach()).abs().max()) / scale


def _scores(sub, qkv, allowed) -> list[Tensor]:
    """The scores that reach each softmax (or fused attention) of one observed call, in float64."""
    observer = Observer()
    with torch.no_grad(), observer:
        sub(*qkv, allowed)
    rec = observer.record
    out = [sm.input.double() for sm in rec.softmaxes]
    out += [(f.q.double() @ per_query_head(f.k.double(), f.q).transpose(-2, -1)) * f.scale for f in rec.fused]
    return out


def _shift_inert(sub, name: str, qkv, allowed, gen: torch.Generator) -> bool:
    """True when changing the parameter shifts every row of the scores by a constant only (the softmax removes
    it exactly): the key bias. The parameter is restored afterwards."""
    param = dict(sub.layer.named_parameters())[name]
    before = _scores(sub, qkv, allowed)
    saved = param.detach().clone()
    with torch.no_grad():
        param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype).to(param.device))
    try:
        after = _scores(sub, qkv, allowed)
    finally:
        with torch.no_grad():
            param.copy_(saved)
    if not before or len(before) != len(after):
        return False
    moved = False
    for old, new in zip(before, after):
        if old.shape != new.shape:
            return False
        if not old.numel():  # scores over no key (a stream the call gives no tokens): nothing to shift
            continue
        both = torch.isfinite(old) & torch.isfinite(new)  # blocked scores (-inf) are not compared
        delta = torch.where(both, new - old, torch.nan)
        size = float(delta.nan_to_num(0).abs().max())
        if size == 0:
            continue
        moved = True
        spread = (delta.nan_to_num(-math.inf).amax(-1) - delta.nan_to_num(math.inf).amin(-1))
        spread = spread[torch.isfinite(spread)]
        if spread.numel() and float(spread.max()) > SHIFT_INERT * size:
            return False
    return moved


def kept_copy(name: str, params: dict, unused: set) -> str:
    """Where the whole parameter `name`, unused, is kept as a copy of a block of rows of a parameter that is used
    ("rows 0-31 of to_qkv.weight"): the projections fused into one and the originals kept to unfuse later (diffusers'
    `fuse_projections`), a design, not a projection left out; or of a whole one
    ("processor.to_q_custom_diffusion.weight"): the layer's own projection replaced by a copy another module holds
    (diffusers' Custom Diffusion processors, loaded from the layer's to_q, to_k, to_v and to_out by its training
    script). '' when no used parameter holds its values, or when they are all one number: a constant (a norm's
    weight of ones, a bias of zeros, as initialised) equals every constant block, which shows no copying."""
    kept = params[name]
    if kept.numel() and bool((kept.detach() == kept.detach().reshape(-1)[0]).all()):
        return ""
    for other, tensor in params.items():
        if other in unused or other == name or tensor.dim() != kept.dim() or tensor.shape[1:] != kept.shape[1:] \
                or tensor.shape[0] < kept.shape[0] or tensor.shape[0] % kept.shape[0]:
            continue
        if tensor.shape == kept.shape:
            if torch.equal(tensor.detach(), kept.detach()):
                return other
            continue
        blocks = tensor.detach().split(kept.shape[0])  # a fused weight stacks its projections' rows
        at = next((i for i, block in enumerate(blocks) if torch.equal(block, kept.detach())), None)
        if at is not None:
            rows = kept.shape[0]
            return f"rows {at * rows}-{(at + 1) * rows - 1} of {other}"
    return ""


def _unpadded(probe: Probe, sub, inputs, params: dict, what: str = "") -> GradientProbe:
    """The gradient checks' forward and backward again, on their inputs without their padding mask (the audit's own
    masks only: causal, a pattern); the inputs' gradients are not taken (None). `what` is added to the probe's label."""
    B, T = inputs[0].shape[0], inputs[0].shape[sub.time_dim]
    allowed = probe.allowed(B, T, T)
    probe.passes += 3  # forward and backward (counted as two)
    probe.shapes[DET].append(ProbeShape(f"float64 copy, forward and backward (B={B}, T={T}{what})", B, T, T,
                                        None if allowed is None else allowed.cpu(), len(inputs) == 1, backward=True))
    made = {"inputs": inputs, "allowed": allowed, "padded": False, "params": tuple(params.items())}
    try:
        probe.seed_layer_rng()
        with torch.enable_grad():
            out = graph_call(sub, *pack(inputs), allowed)
            grads = grad_of((out ** 2).sum(), list(params.values()))
    except Exception as error:  # noqa: BLE001 - the layer's own failure under autograd: a skip that says so
        return GradientProbe(**made, out=None, grads=None, failed="backward", error=error)
    return GradientProbe(**made, out=out, grads=(None,) * len(inputs) + tuple(grads))


def elementwise_scales(trace, params: dict) -> set[str]:
    """The names of `params` (name -> tensor, the traced layer's own) that an op of `trace` multiplies or divides
    the activations by elementwise, themselves or through a view (q_scale.view(h, 1, d), an expand): the op's other
    operand is computed from the inputs. A weight read by a matmul, or normalised by its own norm, is not one."""
    ids = {id(t): name for name, t in params.items()}
    scales = set()
    for op in trace.ops:
        if op.short in _VIEWS and op.in_ids and op.in_ids[0] in ids:
            ids.update({o: ids[op.in_ids[0]] for o in op.out_ids})
        elif op.short in ("mul", "div", "mul_", "div_") and op.sources:
            scales |= {ids[i] for i in op.in_ids[:2] if i in ids}
    return scales


def size_moves(param: Tensor, grad: Tensor | None, loss: float) -> float:
    """<grad, P> / loss: how much (out ** 2).sum() changes, relative to itself, as P grows by a factor 1 + eps, per
    eps. Rounding where a normalisation after P divides it back out."""
    if grad is None or not loss:
        return math.inf
    return abs(float((grad.double() * param.detach().double()).sum())) / loss


def size_removed(sub, inputs, allowed, params: dict, grads: dict, out: Tensor, skip_names: set, seed,
                 gen: torch.Generator) -> list[str]:
    """The scales whose size the output does not depend on: parameters that multiply (or divide) the activations
    elementwise (`elementwise_scales`: a gain, a learned temperature, nViT's q_scale) with `size_moves` under
    SIZE_MOVES. A normalisation after such a scale divides it back out: it can learn a direction, never the size that
    is what it is for. A weight read by a matmul before a norm is scale-free by design (QK-norm's projections) and is
    not asked. Nor is a scale whose every change leaves the output as it is (changed at random, it moves nothing: the
    probe does not exercise it at all, e.g. a query's gain where each query sees one key), which is no matter of its
    size. The trace is taken only where some parameter's size moves nothing."""
    loss = float((out.double() ** 2).sum())  # finite: the caller skips a layer whose output is not
    small = [name for name, p in params.items() if name not in skip_names and p.numel() and bool(p.detach().any())
             and size_moves(p, grads.get(name), loss) <= SIZE_MOVES]
    if not small:
        return []
    scales = elementwise_scales(trace_call(sub, *pack(inputs), allowed, seed=seed), params)
    # the gradient's <grad, P> can vanish by chance (a sum of terms of both signs): the output with the scale doubled
    # decides (a scale that acts moves it by the order of itself, one a norm removes by rounding)
    qkv = pack(inputs)
    return [name for name in small if name in scales
            and _moved_by(sub, name, lambda p: p.mul_(2), qkv, allowed, out) <= FORWARD_MOVES
            and _forward_moves(sub, name, torch.ones_like(params[name], dtype=torch.bool), qkv, allowed, out, gen)
            > FORWARD_MOVES]


def _gated_by_zeros(probe: Probe, sub, inputs, params: dict, unused: list, tables: set, gen: torch.Generator
                    ) -> tuple[list[str], list[str]]:
    """([unused parameters that the output depends on once the all-zero parameters are drawn], [those all-zero
    parameters]). A parameter whose every entry is 0 cuts every path through it: a zero-initialised gate (Flamingo's
    tanh(alpha) at alpha = 0, LLaMA-Adapter's, ReZero's) or output projection (DiT's adaLN-Zero, ControlNet's zero
    convolutions, modded-nanogpt's c_proj) leaves everything before it with a gradient of exactly 0 at
    initialisation, by design, while a parameter the code never reads stays at 0 whatever the others hold. So the
    gradients are taken again on the float64 copy with the all-zero parameters drawn (N(0, 1) / sqrt(fan-in), then
    restored); a parameter that gets a gradient then is used."""
    zeros = [name for name, p in params.items() if p.numel() and not bool(p.detach().any())
             and name not in {n for n, _ in unused}]
    if not unused or not zeros:
        return [], []
    with zeros_drawn(params, zeros, gen):
        again = _unpadded(probe, sub, inputs, params)
    if again.grads is None:
        return [], []
    at = dict(zip(params, again.grads[len(inputs):]))
    gated = [name for name, _ in unused if not structural_zeros(at[name], table=name in tables)]
    return gated, (zeros if gated else [])


def given_nothing(sub, qkv, allowed, names) -> list[str]:
    """Of the parameters `names`, those whose module was given only empty tensors (no token) in every call of one
    forward, where the layer's own call was handed an empty tensor: projections of a stream the call gives no tokens
    (a joint attention declared with `encoder_hidden_states=x[:, :0]`: its text stream's own projections, JoyImage's
    `txt_attn_*`, PRX's `txt_kv_proj`). Nothing reaches them on this call, so their use is not measured here, not
    absent. A module never called is not among them (the code does not read it), nor one the layer hands an empty
    slice of its own making (a split at a wrong index): [] where the layer's call was handed no empty tensor."""
    if not names:
        return []
    owners = {name: name.rpartition(".")[0] for name in names}
    modules = dict(sub.layer.named_modules())
    seen: dict[str, list[bool]] = {"": []}  # "": the layer's own call, which must be handed an empty tensor itself

    def hook(path):
        def record(module, args, kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            seen.setdefault(path, []).append(bool(tensors) and all(t.numel() == 0 for t in tensors))
        return record

    def handed_empty(module, args, kwargs):  # the layer's call: was it given a tensor of no element (x[:, :0])?
        # also inside a tuple or list it takes (IP-Adapter's memory: (text tokens, [image tokens]))
        seen[""].append(any(isinstance(a, Tensor) and a.numel() == 0 for a in tree_leaves((args, kwargs))))

    handles = [modules[path].register_forward_pre_hook(hook(path), with_kwargs=True)
               for path in set(owners.values()) if path and path in modules]
    handles.append(sub.layer.register_forward_pre_hook(handed_empty, with_kwargs=True))
    try:
        with torch.no_grad():
            sub(*qkv, allowed)
    finally:
        for handle in handles:
            handle.remove()
    if not any(seen[""]):  # an empty tensor made inside the layer (a slice at a wrong index) is its own doing
        return []
    never = {path for path in set(owners.values()) if path and path in modules and not seen.get(path)}
    given = _called_given_tokens(sub, qkv, allowed, modules, never) if never else set()
    return [name for name, path in owners.items() if path and (seen.get(path) and all(seen[path]) or path in given)]


FILLED = 4  # knob: how many tokens `_called_given_tokens` gives each empty stream (1, 16: the same modules called)


def _called_given_tokens(sub, qkv, allowed, modules: dict, paths: set) -> set:
    """Of the modules at `paths`, never called on a forward whose call was handed an empty tensor, those called once
    each empty tensor the layer's call is handed (of no token: (B, 0, ...)) is given FILLED tokens instead: modules
    the layer calls only on tokens of a stream the call leaves empty (an image prompt's projections, which a layer
    may skip for a prompt of no token: `if image.shape[1]:`), not measured here rather than unused. A module the
    layer never calls, given tokens or not, is not among them; nor any where that call raises."""
    called: set = set()
    gen = torch.Generator().manual_seed(0)

    def filled(t):
        if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] == 0 and t.shape[0] > 0:
            shape = (t.shape[0], FILLED, *t.shape[2:])
            return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=t.dtype, device=t.device) \
                if t.is_floating_point() else torch.ones(shape, dtype=t.dtype, device=t.device)
        return t

    def give_tokens(module, args, kwargs):
        return tree_map(filled, (args, kwargs))

    def mark(path):
        return lambda module, args: called.add(path)

    handles = [modules[path].register_forward_pre_hook(mark(path)) for path in paths]
    handles.append(sub.layer.register_forward_pre_hook(give_tokens, with_kwargs=True))
    try:
        with torch.no_grad():
            sub(*qkv, allowed)
    except Exception:  # noqa: BLE001 -- tokens the layer cannot take there: nothing counts as given nothing
        return set()
    finally:
        for handle in handles:
            handle.remove()
    return called


_VIEWS = {"transpose", "t", "permute", "expand", "view", "_unsafe_view", "reshape", "clone", "contiguous", "alias"}


def _root(trace, tensor_id: int) -> int:
    """Back through views of the same values (not slices of them) to the tensor they show."""
    for _ in range(64):
        op = producer(trace, tensor_id)
        if op is None or op.short not in _VIEWS or not op.in_ids:
            return tensor_id
        tensor_id = op.in_ids[0]
    return tensor_id


def _self_products(trace) -> list:
    """Matmuls of the user's code whose two operands show the same tensor (q @ q.T where q @ k.T belongs)."""
    return [op for op in trace.ops if op.short in MATMULS and op.frames and len(op.in_ids) >= 2
            and _root(trace, op.in_ids[-2]) == _root(trace, op.in_ids[-1])]


def parameter_sites(probe, result: DetectorResult) -> list[Site]:
    """For each unused parameter: the first op of the user's code that reads it (a diagonal taken, a slice
    dropped), else the line that reads a same-shaped sibling where it belongs (values from the key projection)."""
    replay = result.replay
    if replay is None or not isinstance(probe.subject.layer, nn.Module):
        return []
    s = probe.subject
    q, k, v = pack([x.to(s.dtype) for x in replay.inputs])
    trace = trace_call(s, q, k, v, replay.allowed, seed=probe.seed)
    params = dict(s.layer.named_parameters())
    sites = []
    for name, where in replay.unused:
        tensor = params.get(name)
        if tensor is None:
            continue
        readers = [op for op in trace.ops if id(tensor) in op.in_ids and op.frames]
        if readers and where == SIZE_ONLY:  # the scale's product, then the norm that divides it back out
            products = ("mul", "div", "mul_", "div_")
            scaled = [r for r in readers if r.short in products] or [
                op for op in trace.ops for r in readers if op.frames and set(r.out_ids) & set(op.in_ids)
                and op.short in products] or readers
            sites.append(op_site(computing(trace, scaled[0]), f"multiplies by {name}, whose size the output does not "
                                                              f"depend on: a normalisation after this removes it"))
            continue
        if readers:
            sites.append(op_site(computing(trace, readers[0]), f"reads {name}, whose gradient is zero {where}"))
            if where.startswith("on rows"):  # the rows that are used: often one slice read in place of another
                sites += [op_site(op, f"both operands of this product are the same tensor: the rows of {name} "
                                      f"meant for one of them reach nothing") for op in _self_products(trace)[:1]]
            continue
        siblings = {id(t): n for n, t in params.items() if n != name and t.shape == tensor.shape}
        reads = [(op, siblings[i]) for op in trace.ops if op.frames for i in op.in_ids if i in siblings]
        counted: dict[str, list] = {}
        for op, sibling in reads:
            counted.setdefault(sibling, []).append(op)
        twice = [(sib, ops) for sib, ops in counted.items() if len({o.frames[0] for o in ops}) > 1]
        if twice:
            sibling, ops = twice[0]
            sites.append(op_site(computing(trace, ops[-1]),
                                 f"{name} is never read; {sibling}, shaped like it, is read here a second time"))
    return [x for x in sites if x is not None]


@detector("parameters_used", "every weight tensor the layer owns moves the output: autograd gives each a non-zero "
          "gradient, also off the diagonal of a square weight and on every row of a projection; a scale the layer "
          "multiplies its activations by moves it by its size",
          targets=("a projection computed and never used (values from the key projection: W_v unused)",
                   "keys from the query projection in one-stream self-attention (W_k unused)",
                   "an einsum that reads only the diagonal of W_O",
                   "a learned scale applied before the norm that removes it (nViT's q_scale before its l2 norm)"),
          fix="use every projection for its stream: q = W_q(query), k = W_k(key), v = W_v(value), and the full "
              "output projection (x @ W_O.T, not its diagonal)",
          needs=(OWNS_PARAMETERS, LONG), locate=parameter_sites)  # one key: the softmax ignores q and k
def check_parameters_used(probe: Probe) -> DetectorResult:
    det = DET
    sub = float64_copy_or_skip(probe, det)
    if isinstance(sub, DetectorResult):
        return sub
    # the gradient check's forward and backward (made once for both): structural zeros do not depend on the
    # length, so its short probe costs a constant, and its gradient w.r.t. every parameter is what is read here
    made = gradient_probe(probe, sub)
    inputs, params = made.inputs, dict(made.params)
    if made.padded:
        # a padding mask leaves a mask bug room to starve a projection on this probe (polarity inverted, each query
        # attends the one key blocked, and q and k get no gradient): a finding of mask_honoured's, not of this
        # check's, which reads a backward of its own without the padding
        made = _unpadded(probe, sub, inputs, params)
    if made.failed:
        error = made.error
        return skip(det, f"the layer does not run with autograd as a float64 copy ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:160] if str(error) else ''}); see `gradients`")
    if made.grads is None:
        return skip(det, "no gradient reaches the float64 copy's output (it has no grad_fn), so its parameters' "
                         "gradients say nothing; see `gradients`")
    allowed, out = made.allowed, made.out.detach()
    if not bool(torch.isfinite(out).all()):
        return skip(det, "the output is not finite on an ordinary input, so its gradients say nothing (see "
                         "finite_output)")
    gen = probe.generator()
    grads = made.grads[len(inputs):]
    grad_by_name = dict(zip(params, grads))
    tables = {f"{owner}.{n}" if owner else n for owner, m in sub.layer.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for n, _ in m.named_parameters(recurse=False)}
    # an empty parameter (a bias of zero features, a table of no entries) has no entry to use or to leave unused
    zero = {name: structural_zeros(g, table=name in tables) for name, g in grad_by_name.items() if params[name].numel()}
    zero = {name: where for name, where in zero.items() if where}
    cut, explained, unused, moved_by, flat = [], [], [], {}, []
    for name, where in zero.items():
        part = _zero_part(grad_by_name[name], params[name])
        moved_by[name] = _forward_moves(sub, name, part, pack(inputs), allowed, out, gen)
        if moved_by[name] > FORWARD_MOVES and not bool(out.any()):
            flat.append(name)  # an output of zeros: (out ** 2).sum() is flat there, and gives nothing a gradient
        elif moved_by[name] > FORWARD_MOVES:
            cut.append(name)  # the output depends on it: its gradient is cut (the gradients detector's finding)
        elif where == "everywhere" and _shift_inert(sub, name, pack(inputs), allowed, gen):
            explained.append(name)
        else:
            unused.append((name, where))
    sized = size_removed(sub, inputs, allowed, params, grad_by_name, out, set(zero), probe.seed, gen)
    T, longer, positional = inputs[0].shape[sub.time_dim], [], {}
    if unused and T < probe.t:
        # a layer that pools its keys (NextViT's and PVT's spatial reduction, 4 tokens to a key) sees one key on the
        # short probe, and the softmax of one key ignores q and k: the same question again at the audit's length
        again = _unpadded(probe, sub, tuple((logit_gain(probe) * sub.make(gen, inputs[0].shape[0], probe.t))
                                            .requires_grad_(True) for _ in inputs), params)
        if again.grads is not None:
            at = dict(zip(params, again.grads[len(inputs):]))
            longer = [name for name, _ in unused if not structural_zeros(at[name], table=name in tables)]
            features = {f"{owner}.{n}" if owner else n for owner, m in sub.layer.named_modules()
                        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) for n, _ in m.named_parameters(recurse=False)}
            positional = {name: grown for name, where in unused if where.startswith("on rows") and name not in features
                          and (grown := _rows_grow(grad_by_name[name], at[name], T, probe.t))}
            unused = [(name, where) for name, where in unused if name not in longer and name not in positional]
    gated, zeros = _gated_by_zeros(probe, sub, inputs, params, unused, tables, gen)
    unused = [(name, where) for name, where in unused if name not in gated]
    empty = given_nothing(sub, pack(inputs), allowed, [name for name, where in unused if where == "everywhere"])
    unused = [(name, where) for name, where in unused if name not in empty]
    whole = {name for name, where in unused if where == "everywhere"}
    copies = {name: at for name in whole if (at := kept_copy(name, params, whole))}
    unused = [(name, where) for name, where in unused if name not in copies]
    heads = heads_out_seen(probe) if any(where == "everywhere" for _, where in unused) else None
    left = "" if heads is None or heads.projection is None else heads.projection
    caller = [name for name, where in unused if left and where == "everywhere" and name.startswith(left + ".")]
    unused = [(name, where) for name, where in unused if name not in caller]
    note = (f"; {', '.join(explained)}: zero gradient, and changing it shifts every row of the scores by a "
            f"constant, which the softmax removes exactly (a key bias is inert by design)" if explained else "")
    kept = "; ".join(f"{name} is a copy of {at}" for name, at in sorted(copies.items()))
    if longer:
        note += (f"; {', '.join(longer)}: zero gradient at {T} tokens but not at {probe.t}, so used (a layer that "
                 f"pools its keys, spatial reduction, sees too few of them on a short probe)")
    if positional:
        note += "".join(f"; {name}: the rows it reads grow with the tokens ({grown}): a table read by position (a "
                        f"relative bias sliced to the length), whose rows past a probe's reach no shorter sequence "
                        f"reads" for name, grown in positional.items())
    if flat:
        note += (f"; {', '.join(flat)}: zero gradient because the output is zero everywhere on this probe (the "
                 f"loss, (out ** 2).sum(), is flat there), and changing {'them' if len(flat) > 1 else 'it'} moves the "
                 f"output, so used")
    if gated:
        note += (f"; {', '.join(gated)}: zero gradient only while {', '.join(zeros)} "
                 f"{'are' if len(zeros) > 1 else 'is'} all zeros (zero-initialised, as a gate or an output projection "
                 f"that starts the layer as the identity of its residual is), so used: with "
                 f"{'them' if len(zeros) > 1 else 'it'} drawn at random, {'they move' if len(gated) > 1 else 'it moves'} "
                 f"the output")
    if cut:
        them, their = ("them", "their") if len(cut) > 1 else ("it", "its")
        note += (f"; {', '.join(cut)}: the output depends on {them}, yet autograd gives {them} no gradient: {their} "
                 f"gradient is cut on its way (see gradients)")
    checked = f"{len(params)} parameter tensors ({sum(p.numel() for p in params.values())} weights)"
    if sized:
        them = "them" if len(sized) > 1 else "it"
        note += (f"; the output does not depend on the size of {', '.join(sized)} (a scale multiplying the "
                 f"activations: growing {them} by a factor changes (out ** 2).sum() by less than {SIZE_MOVES:.0e} of "
                 f"itself), so a normalisation after {them} divides {them} back out")
    if sized and not unused:
        return result(det, "fail", f"the output does not depend on the size of {', '.join(sized)}: a normalisation "
                                   f"after {'these scales' if len(sized) > 1 else 'this scale'} divides "
                                   f"{'them' if len(sized) > 1 else 'it'} back out",
                      value=None, threshold=SIZE_MOVES,
                      evidence=f"{'; '.join(f'{n} {tuple(params[n].shape)}' for n in sized)} multiply the "
                               f"activations elementwise and get a gradient, but one orthogonal to themselves: the "
                               f"output is the same at any multiple of them, so they can learn a direction and never "
                               f"the size a scale is for (a temperature that never reaches the softmax); every other "
                               f"parameter moves the output ({checked}){note}",
                      replay=ParameterReplay(tuple(x.detach() for x in inputs), allowed,
                                             tuple((n, SIZE_ONLY) for n in sized)),
                      fix="apply the scale after the normalisation, not before it: q = l2norm(q) * q_scale (a norm "
                          "after a scale removes it)")
    if unused:
        listed = "; ".join(f"{name} {tuple(params[name].shape)}: gradient exactly 0 {where}" for name, where in unused)
        named = ", ".join(n if w == "everywhere" else f"{n} ({w.split(' (')[0]})" for n, w in unused)
        return result(det, "fail", f"the output does not depend on {named}",
                      value=max(moved_by[n] for n, _ in unused), threshold=FORWARD_MOVES,
                      evidence=f"{listed}; changing those entries at random moved the output by at most "
                               f"{max(moved_by[n] for n, _ in unused):.2g} of its RMS (more than {FORWARD_MOVES:.0e} "
                               f"would show a use; of {checked}){note}" + (f"; not used either, but kept copies: {kept}"
                                                                            if kept else ""),
                      replay=ParameterReplay(tuple(x.detach() for x in inputs), allowed, tuple(unused)))
    if caller:
        return result(det, "warn", f"{', '.join(caller)} not measured: the layer never reads `{left}`, and returns each "
                                   f"head's output apart, for its caller to merge and project (see output_shape)",
                      value=max(moved_by[n] for n in caller), threshold=FORWARD_MOVES,
                      evidence=f"{'; '.join(f'{n} {tuple(params[n].shape)}' for n in caller)}: gradient exactly 0 "
                               f"everywhere, `{left}`'s weights never read by the call, its width the heads' merged "
                               f"width; every other parameter moves the output ({checked}){note}",
                      fix=f"audit with the call output_shape names, which applies `{left}` as the caller does")
    if empty:
        them, owners = ("them", "their modules were") if len(empty) > 1 else ("it", "its module was")
        return result(det, "warn", f"{', '.join(empty)} not measured: {owners} given no token on this call (a stream "
                                   f"the call leaves empty)",
                      value=max(moved_by[n] for n in empty), threshold=FORWARD_MOVES,
                      evidence=f"{'; '.join(f'{n} {tuple(params[n].shape)}' for n in empty)}: gradient exactly 0 and "
                               f"changing {them} moved nothing, as every tensor {owners} given has 0 elements: a "
                               f"second stream given no tokens (a joint attention declared with an empty "
                               f"`encoder_hidden_states`) reaches nothing; every other parameter moves the output "
                               f"({checked}){note}" + (f"; kept copies: {kept}" if kept else ""),
                      fix="audit the layer with that stream given tokens to have these parameters checked (a "
                          "call= that passes them), or check by hand that they act on it")
    if copies:
        return result(det, "warn", f"{', '.join(sorted(copies))} {'are' if len(copies) > 1 else 'is'} not used: kept "
                                   f"beside the parameter {'they were' if len(copies) > 1 else 'it was'} fused into "
                                   f"or replaced by, which is used ({kept})",
                      value=max(moved_by[n] for n in copies), threshold=FORWARD_MOVES,
                      evidence=f"{kept}; each has a gradient of exactly 0 everywhere and changing it moved the output "
                               f"by at most {max(moved_by[n] for n in copies):.2g} of its RMS; every other parameter "
                               f"moves the output ({checked}){note}",
                      fix="nothing to fix if the copies are kept on purpose (to unfuse later); otherwise delete them, "
                          "or read the projection from them and drop the fused one")
    return result(det, "pass", f"every parameter moves the output ({checked})", value=None, threshold=FORWARD_MOVES,
                  evidence=f"every gradient of (out ** 2).sum() is non-zero, off the diagonal and on every row, or its "
                           f"zero part moves the output{note}")
