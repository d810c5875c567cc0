"""What the detector modules share: the common endings of a verdict, the perturbation gains, and the
localiser of the invariance checks, which replays the comparison a verdict was computed on."""

from __future__ import annotations

import contextlib
import copy
import math
import re
import types
from dataclasses import dataclass

import torch
from torch import Tensor

from .._core import Comparison, expand_rows, held, relative_change, skip
from .._guard import cut_from
from .._observe import Mode, Observer, not_over_tokens
from .._probe import Call, Probe
from .._registry import DETECTORS, NOT_APPLICABLE
from .._result import DetectorResult, ProbeShape, Site
from .._subject import graph_kept, make_subject, spell
from .._tracing import (
    Trace,
    declared_mask,
    first_moved,
    made_apart,
    mask_sites,
    merge_fix,
    op_site,
    stream_sites,
    trace_call,
)

# ---- shared endings --------------------------------------------------------------------------------


def result(det: str, verdict: str, message: str, **kw) -> DetectorResult:
    return DetectorResult(det, verdict, message, fix=kw.pop("fix", DETECTORS[det].fix if det in DETECTORS else ""),
                          **kw)


def not_token_attention(probe: Probe, det: str, *, summed: bool = False) -> DetectorResult | None:
    """A skip saying why, where the standard probe's softmax is over something else than the tokens (channel
    attention: `_observe.not_over_tokens`, with its `summed`); None where it is over them, or where nothing was
    observed."""
    base = probe.base()
    if not base.ok or base.record is None:
        return None
    t = probe.subject.time_dim
    why = not_over_tokens(base.record, base.query.shape[t], base.key.shape[t], summed=summed)
    return DetectorResult(det, "skip", NOT_APPLICABLE + why) if why else None


def channel_attention(probe: Probe) -> str:
    """Why the layer is channel attention (`_observe.not_over_tokens` with `summed`: every softmax over scores square
    past a batch axis, (.., d, d), of q^T k, a product over the tokens; XCA's, DaViT's), read at the standard probe
    and again at four times its length (a square grid's tokens at twice the side; a reading of the audit's own, whose
    raise is no failure of the layer's: a layer of a fixed length is then no channel attention to the audit; a token
    attention whose head is as wide as the probe is long, windows of 4 tokens
    over heads of 16 at T = 16, keeps both its (4, 4) scores and its product over 16; a channel attention's product
    follows the tokens); "" where it is not. Once per audit (one observed call more where the first reading holds)."""
    return probe.shared("channel attention", lambda: _channel_attention(probe))


def _channel_attention(probe: Probe) -> str:
    base = probe.base()
    if not base.ok or base.record is None:
        return ""
    t = probe.subject.time_dim
    why = not_over_tokens(base.record, base.query.shape[t], base.key.shape[t], summed=True)
    if not why:
        return ""
    T = 4 * probe.t  # a square grid's tokens again (twice the side): an image layer takes it
    call = probe.call(*probe.streams(probe.BATCH, T), probe.allowed(probe.BATCH, T, T),
                      label=f"the standard probe at T={T} (is it channel attention?)", observe=True, reading=True)
    again = call.ok and call.record is not None and bool(not_over_tokens(call.record, T, T, summed=True))
    return why if again else ""


def own_queries_seen(probe: Probe) -> int | None:
    """Q, where the layer looks like one that attends with Q queries of its own (an attention-pooling head's learned
    query, Set Transformer's PMA, Perceiver's latents) and `queries=Q` was not declared: a module given one stream
    whose output has Q != T rows at the standard probe's length T and the same Q at another length (or is (B, D) at
    both: Q = 1), and in which attention of Q queries over the T tokens was observed (a softmax over them, a fused
    attention call): a layer that attends nothing, or attends with a query per token and keeps some rows (a class
    token's), is not told to declare queries.
    None otherwise: declared, a row per token, or a row count that moves with the length (a layer that drops or adds
    rows: a shape bug, which no declaration may make pass). One call more, at another length, only for a layer whose
    output is not (B, T, D)."""
    if "own_queries_seen" not in probe.memo:
        probe.memo["own_queries_seen"] = _own_queries_seen(probe)
    return probe.memo["own_queries_seen"]


def _own_queries_seen(probe: Probe) -> int | None:
    s, B, T = probe.subject, probe.BATCH, probe.t
    base = probe.base()
    if s.own_queries or s.form != "self_module" or not base.ok:
        return None
    seen = _rows_of(base.output.out, B)
    if seen is None or seen == T:
        return None
    if probe.observed_over(base, seen, T) is None:  # no attention of Q queries over the tokens seen: no hint
        return None
    other = next(t for t in (max(2, T // 2), T + 3) if t not in (T, seen))
    call = probe.call(*probe.streams(B, other), probe.allowed(B, other, other),
                      label=f"length {other} (the output's rows at another length than {T})")
    return seen if call.ok and _rows_of(call.output.out, B) == seen else None


def _rows_of(out: Tensor, batch: int) -> int | None:
    """The rows per sequence of a module's output: (B, n, ...) -> n, (B, width) -> 1 (one vector, no row axis; its
    width may be another than the layer's, a pooling head may project it)."""
    if out.dim() < 2 or out.shape[0] != batch:
        return None
    return 1 if out.dim() == 2 else int(out.shape[1])


def no_rows(probe: Probe, out: Tensor) -> str:
    """The skip's words for an output with no row axis, (B, D): one vector per sequence."""
    seen = own_queries_seen(probe)
    declare = f" (a layer with a query of its own: declare {spell('queries', seen, probe.options)})" if seen else ""
    return f"the output {tuple(out.shape)} has no row axis, one vector per sequence{declare}"


def judge(det: str, failed: bool, fail_message: str, pass_message: str, **kw) -> DetectorResult:
    """The common ending: fail with one message or pass with the other, the same measurements either way."""
    return result(det, "fail" if failed else "pass", fail_message if failed else pass_message, **kw)


def judge_held(det: str, comparison: Comparison | DetectorResult, probe: Probe, *, what: str, fail_message: str,
                pass_message: str) -> DetectorResult:
    """The ending of every invariance check: fail if a held row moved; not measured if the layer did not
    respond even where a correct layer must; else pass."""
    if isinstance(comparison, DetectorResult):
        return comparison
    bad, worst, text, unresponsive = held(comparison, probe, what=what)
    if not bad and unresponsive:
        return skip(det, f"the output did not respond to the perturbation ({unresponsive}), so its not moving "
                         f"where it must not proves nothing")
    return judge(det, bad > 0, fail_message, pass_message, value=worst, threshold=comparison.tol, evidence=text,
                 replay=(comparison,))


def perturbation_gains(probe: Probe) -> tuple[float, ...]:
    """How hard a perturbation pushes (see `perturbed`): 1000x a fresh draw, 100x in float16 (whose range
    ends at 65504). Rows that must not move do not move however hard the rest is pushed, while a bug that
    acts through the weights shows even where the initialisation keeps logits tiny: at GPT-2's std 0.02 and
    d_k = 1, a 100x key moves a logit by ~0.04, too little to show in bfloat16."""
    return (100.0,) if probe.subject.dtype == torch.float16 else (1000.0,)



def rows(batch: int, t: int, where: Tensor) -> Tensor:
    """Bool (T,) or (B, T) -> (B, T)."""
    return where.expand(batch, t).clone() if where.dim() == 1 else where


def held_positions(probe, base, case) -> Tensor:
    s = probe.subject
    t = s.time_dim

    def changed(x, y):
        if x is y:
            return torch.zeros(x.shape[0], x.shape[t], dtype=torch.bool)
        d = (x != y)
        d = d.reshape(*d.shape[:t + 1], -1).any(-1)  # fold features
        return d.reshape(d.shape[0], -1, d.shape[-1]).any(1).cpu()  # fold heads: (B, T)

    moved = changed(base.query, case.inputs.query)
    if base.key.shape == base.query.shape:
        moved = moved | changed(base.key, case.inputs.key) | changed(base.value, case.inputs.value)
    return case.hold.cpu() & ~moved


def invariance_sites(probe, result: DetectorResult, *, note: str, use_masks: bool = False, streams: bool = False,
                     same_input: bool = False, state_fix: str = "") -> list[Site]:
    """Where a 'held rows must not move' check failed, from the comparisons its verdict was computed on
    (`result.replay`): the first case in which a held row moved, replayed on its very inputs: the masks of the
    baseline call (`use_masks`), or its input streams (`streams`: query locality of a cross-attention), else
    baseline and case traced side by side and the first op whose output moves where it must not (`note` says
    so). `same_input`: the case is the baseline again (eval determinism): the layer's RNG is left unseeded and
    every row is held; `state_fix`: the fix of a site in a state one call left for the next (`_state_sites`)."""
    for comparison in result.replay or ():
        tol = comparison.tol
        for case, change in zip(comparison.cases, comparison.changes):
            if not bool((change[expand_rows(case.hold, change)] > tol).any()):
                continue
            base = comparison.base if comparison.base is not None else case.inputs
            s = probe.subject
            B, t_q, t_k = base.query.shape[0], base.query.shape[s.time_dim], base.key.shape[s.time_dim]
            seed = None if same_input else probe.seed
            allowed = probe.allowed(B, t_q, t_k, base.extra)
            a = trace_call(s, base.query, base.key, base.value, allowed, seed=seed)
            sites: list[Site] = []
            if use_masks:
                declared, rows = declared_mask(probe, B, t_q, t_k, allowed), t_q
                if s.own_queries:  # queries of the layer's own (label queries, a pooling head's): each may attend the
                    # keys some token may, and the masking ops are read over (those queries, the keys)
                    rows = s.own_queries
                    declared = declared.any(1, keepdim=True).expand(B, rows, t_k)
                sites += mask_sites(a, declared, B, rows, t_k)
            if not sites and streams and not base.one_stream:
                sites += stream_sites(a, s)
            if not sites:
                b = trace_call(s, case.inputs.query, case.inputs.key, case.inputs.value,
                               probe.allowed(B, t_q, t_k, case.inputs.extra), seed=seed)
                P = torch.ones(B, t_q, dtype=torch.bool) if same_input else held_positions(probe, base, case)
                op = first_moved(a, b, P, tol)
                if op is not None:
                    sites.append(op_site(op, note, fix=merge_fix(op, s.num_heads)))
                elif same_input and probe.as_given is not None:
                    sites += _state_sites(probe, base, allowed, P, tol, state_fix)
            return sites
    return []


def _state_sites(probe, base, allowed, P, tol, fix: str) -> list[Site]:
    """Two eval-mode calls that differ where two more, traced now, do not: a call of the audit left a state the later
    ones read (a cache built on the first call, or rebuilt at another length). The layer's first call traced as it
    came (`Probe.as_given`), then its second; where those agree, a call as the audit's calls left it (`Probe.as_left`);
    where the later's output first moves, the line of its own path that made the value that moved, then that op
    (`made_apart`)."""
    s = probe.subject
    probe.as_given()
    first = trace_call(s, base.query, base.key, base.value, allowed, seed=None)
    second = trace_call(s, base.query, base.key, base.value, allowed, seed=None)  # on the state the first left
    ops = made_apart(first, second, P, tol)
    if not ops and probe.as_left is not None:  # a state made at another length by a later call of the audit's
        probe.as_left()
        ops = made_apart(first, trace_call(s, base.query, base.key, base.value, allowed, seed=None), P, tol)
    notes = ["made on the later call's own path (the first call took another: a state the calls left, a cache, is read "
             "here), the value that moved the output", "the first op whose output differs between the layer's first "
             "and second call on the same input"]
    return [site for op, note in zip(ops, notes[-len(ops):] if ops else [])
            if (site := op_site(op, note, fix=fix)) is not None]


def invariance_locator(note: str, **how):
    """The `locate=` of an invariance check: `invariance_sites` with this detector's note and options."""
    def locate(probe, result: DetectorResult) -> list[Site]:
        return invariance_sites(probe, result, note=note, **how)

    return locate


def base_trace(probe) -> Trace:
    base = probe.base()
    return trace_call(probe.subject, base.query, base.key, base.value, base.allowed, seed=probe.seed)


# ---- a float64 copy with its autograd graph (the gradient checks) ----------------------------------------


def float64_copy_or_skip(probe: Probe, det: str):
    """The float64 subject a gradient-taking check runs on, or that check's skip saying why none could be made. One
    copy per audit, made when first asked for (gradients and parameters_used read it; each leaves its parameters as
    it found them, bit for bit)."""
    try:
        return probe.shared("float64 copy", lambda: float64_twin(probe))
    except Exception as error:  # noqa: BLE001 -- a layer that cannot be copied or converted: say so
        return skip(det, f"no float64 copy of the layer could be made ({type(error).__name__}: {error})")


def float64_output(twin, call) -> Tensor:
    """The float64 copy's output on `call`'s own inputs, upcast (one stream stays one tensor), without autograd: a
    reading that tells a lower precision's rounding from a real difference."""
    up: dict[int, Tensor] = {}

    def wide(x):
        return up.setdefault(id(x), x.to(torch.float64))

    with torch.no_grad():
        return twin(wide(call.query), wide(call.key), wide(call.value), call.allowed).out


def float64_worst(probe: Probe, reference: Call, calls, rows) -> float | None:
    """The largest change between the float64 copy's outputs on `calls` and on `reference` (each on its call's own
    inputs, upcast), each pair cut to the rows it compares by `rows(call, got, whole) -> (got's rows, whole's rows)`,
    centred and against the reference output's scale: a reading over a tolerance taken again without the lower
    precision's rounding (decode_consistency's partial calls, blocked_keys_absent's cut sequences). None where no
    copy runs or a call raises: the verdict in the layer's own dtype stands."""
    twin = float64_copy_or_skip(probe, probe.detector)
    if isinstance(twin, DetectorResult):
        return None

    def run(c):
        probe.passes += 1
        return float64_output(twin, c)

    try:
        whole = run(reference)
        worst = 0.0
        for call in calls:
            got, want = rows(call, run(call), whole)
            change = relative_change(got, want, centred=True, scale_of=whole)
            if change is None:
                return None
            worst = max(worst, float(change.max()))
        return worst
    except Exception:  # noqa: BLE001 -- no reading, then: the verdict in the layer's own dtype stands
        return None


def float64_twin(probe: Probe):
    """A float64 subject for the same layer (a deep copy of a module, so the user's layer is untouched)."""
    s = probe.subject
    layer = s.layer if s.form == "function" else float64_copy(s.layer)
    twin = make_subject(layer, d_model=s.d_model, num_heads=s.num_heads, device=s.device, dtype=torch.float64,
                        **s.declarations())  # the user's mask convention, layout and call, as declared
    call, casts = twin._call, []

    def in_float64(*args):
        if casts and not any(casts):  # the first call cast nothing down: no need to watch every op
            return call(*args)
        with KeepFloat64() as mode:
            result = call(*args)
        casts.append(mode.kept)
        return result

    twin._call = in_float64  # every call of the copy, the per-query path of key-padding layers included
    return twin


@contextlib.contextmanager
def zeros_drawn(params: dict, names: list[str], gen: torch.Generator):
    """The all-zero parameters `names` of `params` drawn at random while inside (N(0, 1) / sqrt(fan-in), as a layer's
    init would), restored bit for bit after: what a zero-initialised gate or temperature cuts shows once it moves."""
    saved = {name: params[name].detach().clone() for name in names}
    try:
        with torch.no_grad():
            for name in names:
                p = params[name]
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) / math.sqrt(fan_in))
        yield
    finally:
        with torch.no_grad():
            for name in names:
                params[name].copy_(saved[name])


def float64_copy(layer: torch.nn.Module) -> torch.nn.Module:
    """`copy.deepcopy(layer).to(torch.float64)` without the copy in the layer's own dtype on the way: each plain
    floating-point parameter is converted once, straight into the copy (deepcopy's memo hands it out wherever the
    layer holds that parameter, so tied weights stay tied); whatever else (buffers, parameter subclasses with a
    deepcopy of their own) is deep-copied as before and converted by `.to`. A 512-wide layer's million weights were
    copied twice, the float32 copy thrown away (MultiHeadAttention(512, 8): 0.8 ms, now 0.6). A `staticmethod` or
    `classmethod` object kept on an instance, which deepcopy cannot copy (every gradient check was "not measured" on
    such a layer), is let through and made again on the copy (`_rewrapped`). A TorchScript module's parameters come
    out of its deepcopy as clones still in the graph of the user's: cut from it (`cut_from`)."""
    memo, wrapped = {}, set()
    for module in layer.modules():  # deepcopy hands functions out as they are, but raises on these wrappers of one
        for value in vars(module).values():  # (`self.apply_rotary_emb = staticmethod(...)`: rotary-embedding-torch)
            if isinstance(value, (staticmethod, classmethod)):
                memo[id(value)] = value  # let deepcopy through; made again on the copy below
                wrapped.add(id(value))
    for p in layer.parameters():
        if type(p).__deepcopy__ is torch.nn.Parameter.__deepcopy__ and p.is_floating_point():
            # copy=True: a float64 layer's own tensor would come back, and the checks change the copy in place
            memo[id(p)] = type(p)(p.detach().to(torch.float64, copy=True), p.requires_grad)
    twin = copy.deepcopy(layer, memo)
    for module in twin.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__closure__:
                module.__dict__[name] = _rebound(value, memo)
            elif id(value) in wrapped:
                module.__dict__[name] = _rewrapped(value, memo)
    return cut_from(twin, layer).to(torch.float64)


def _rewrapped(value, memo: dict):
    """A staticmethod or classmethod the layer keeps on its instance, for the copy: a plain function shared, as
    deepcopy shares functions; a closure re-made around the copy (`staticmethod(lambda y: y * self.scale)` reads the
    copy's scale); anything else (a functools.partial over a parameter) deep-copied with the copy's memo."""
    fn = value.__func__
    if isinstance(fn, types.FunctionType):
        return type(value)(_rebound(fn, memo)) if fn.__closure__ else value
    return type(value)(copy.deepcopy(fn, memo))


def _rebound(fn: types.FunctionType, memo: dict) -> types.FunctionType:
    """A function kept on a module instance (a forward patched on it: `layer.forward = wrapper`, a closure over the
    original bound method or over the layer), re-made on the copy: deepcopy hands functions out as they are, so the
    copy's forward would call the original layer, whose float32 parameters the copy's gradients never reach. Each
    closure cell is deep-copied with the copy's memo (a bound method of the layer is bound to its copy, the layer
    itself becomes the copy; a closure inside the closure is re-made the same way)."""
    def cell(c):
        try:
            value = c.cell_contents
        except ValueError:  # an empty cell
            return types.CellType()
        if isinstance(value, types.FunctionType) and value.__closure__:
            return types.CellType(_rebound(value, memo))
        return types.CellType(copy.deepcopy(value, memo))

    made = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              tuple(cell(c) for c in fn.__closure__))
    made.__kwdefaults__, made.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    made.__dict__.update(fn.__dict__)
    return made


class KeepFloat64(Mode):
    """Casts from float64 down to a lower precision stay float64: a layer that computes its softmax in float32
    on purpose (Hugging Face's eager Llama and Gemma: softmax(..., dtype=torch.float32)) would otherwise add
    float32 rounding to the float64 copy, and the finite differences, which divide by the step, would measure
    that noise (2.5e-7 of |grad| |direction| measured on a correct eager Llama layer) instead of the gradient."""

    kept = 0  # casts kept at float64

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and args and isinstance(args[0], Tensor)
                and args[0].dtype == torch.float64 and kwargs.get("dtype") in (torch.float32, torch.float16,
                                                                                torch.bfloat16)):
            kwargs = {**kwargs, "dtype": torch.float64}
            self.kept += 1
        return func(*args, **kwargs)


GRADIENT_TOKENS = 6
"""The probe length of the gradient checks: gradient bugs (a detached softmax, a wrong backward, a weight no path
reaches) do not need long sequences, and a short probe keeps their cost constant in seq_len."""


@dataclass(frozen=True)
class GradientProbe:
    """The float64 copy's one forward and backward that both gradient checks read: `gradients` compares its
    gradient with finite differences, `parameters_used` reads which parameters' gradients are structurally zero.
    One backward for both: in float64 a wide layer's calls at a few tokens cost what moving its weights costs, whatever
    the tokens (MultiHeadAttention(512, 8) at 6 tokens: 1.7 ms a forward, 5.7 a backward, on one thread where its
    float32 forward at seq_len 128 takes 9), and parameters_used's own forward and backward made it 0.9 forward passes
    of the audit's time at seq_len 128; reading this one, 0.1."""

    inputs: tuple  # (query[, key[, value]]) in float64, scaled by `gradient_gain`, leaves that require grad
    allowed: Tensor | None
    padded: bool  # the last key blocked for every query by a padding mask (see `gradient_probe`)
    params: tuple  # (name, parameter) of the copy's trainable parameters
    out: Tensor | None  # the output with its graph, which a causal audit keeps for one more backward (gradients')
    grads: tuple | None  # d (out ** 2).sum() / d (inputs + params), None entries where unused; None: no backward
    failed: str = ""  # "forward" or "backward": which of them raised `error`
    error: Exception | None = None
    gain: float = 1.0  # the factor the tokens were scaled by (`gradient_gain`)

    @property
    def pack(self) -> tuple:
        """(query, key, value) from the one, two or three inputs."""
        return pack(self.inputs)


def pack(xs) -> tuple:
    """(query, key, value) from a gradient check's one, two or three inputs."""
    return (xs[0], xs[1], xs[2]) if len(xs) == 3 else (xs[0], xs[1], xs[1]) if len(xs) == 2 else (xs[0], xs[0], xs[0])


def gradient_probe(probe: Probe, sub) -> GradientProbe:
    """The gradient checks' forward and backward on `sub` (the float64 copy), made once per audit."""
    return probe.shared("float64 forward and backward", lambda: _gradient_probe(probe, sub))


def _gradient_probe(probe: Probe, sub) -> GradientProbe:
    s = probe.subject
    B, T = probe.BATCH, min(probe.t, GRADIENT_TOKENS)
    gen = probe.generator()
    cross = s.separate_kv and not probe.causal
    # tokens scaled so that the softmax is neither uniform nor one-hot: at GPT-2's std-0.02 initialisation and
    # d_model 1 the logits are tiny and a detached softmax changed the directional derivative by 4.6e-10 of it,
    # under GRADIENT_AGREEMENT (10 of 12 seeds caught); at the gain, by 3.8e-8 or more (12 of 12), while correct
    # layers stayed at 2.1e-11 (seeds 0-5, T 3 and 5, gpt2 init)
    n = 3 if s.form == "function" else 2 if cross else 1
    drawn = tuple(sub.make(gen, B, T) for _ in range(n))
    # where keys are an input apart from the queries, a padding mask: keys it blocks for every query must get
    # exactly zero gradient, read from the same backward pass
    # (only the last key, from T >= 3: every query keeps a choice of keys, which a detached softmax needs to show)
    padded = s.takes_mask and n >= 2 and T >= 3
    allowed = probe.allowed(B, T, T, (torch.arange(T) < T - 1).expand(B, T, T) if padded else None)
    g = gradient_gain(probe, sub, drawn, allowed)
    inputs = tuple((g * x).requires_grad_(True) for x in drawn)
    params = tuple((name, p) for name, p in (sub.layer.named_parameters() if isinstance(sub.layer, torch.nn.Module)
                                             else ()) if p.requires_grad)
    probe.passes += 3  # forward and backward (counted as two)
    probe.shapes[probe.detector].append(ProbeShape(f"float64 copy, forward and backward (B={B}, T={T}"
                                                   f"{', a padding mask' if padded else ''})", B, T, T,
                                                   None if allowed is None else allowed.cpu(), n == 1, backward=True))
    made = {"inputs": inputs, "allowed": allowed, "padded": padded, "params": params, "gain": g}
    try:
        probe.seed_layer_rng()  # every call draws the same randomness (the audit restores the RNG)
        with torch.enable_grad():
            out = graph_call(sub, *pack(inputs), allowed)
    except Exception as error:  # noqa: BLE001 -- each check says what this means for it
        return GradientProbe(**made, out=None, grads=None, failed="forward", error=error)
    if out.grad_fn is None:  # no gradient reaches the output (each check says what that means for it)
        return GradientProbe(**made, out=out, grads=None)
    try:
        with torch.enable_grad():
            # inputs and parameters: a detached softmax hides little from the inputs' gradient of a layer whose
            # logits are tiny (std-0.02 weights), but everything from W_Q's and W_K's; a causal audit keeps the
            # graph for gradients' second backward (outputs up to the middle), which then needs no forward of its own
            grads = grad_of((out ** 2).sum(), list(inputs) + [p for _, p in params],
                            retain_graph=probe.causal and T >= 2)
    except Exception as error:  # noqa: BLE001
        return GradientProbe(**made, out=out, grads=None, failed="backward", error=error)
    return GradientProbe(**made, out=out, grads=tuple(grads))


def grad_of(loss: Tensor, tensors, *, retain_graph: bool = False) -> tuple:
    """d loss / d tensors, None for those the loss does not reach (autograd.grad's allow_unused), through
    `loss.backward()`: a layer checkpointed with `torch.utils.checkpoint(use_reentrant=True)` takes .backward()
    only (autograd.grad, or backward with `inputs=`, raises there). The tensors' own `.grad` are as before
    afterwards; other leaves the graph reaches (the float64 copy's, the probe's own inputs) keep what it adds."""
    tensors = list(tensors)
    kept = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        loss.backward(retain_graph=retain_graph)
        return tuple(t.grad for t in tensors)
    finally:
        for t, g in zip(tensors, kept):
            t.grad = g


def graph_call(sub, q, k, v, allowed) -> Tensor:
    """Call `sub` and return its output with the autograd graph (Subject outputs are otherwise detached), laid out
    and cut as every probe reads it: a mask its convention cannot hold at once reaches the layer in parts (a causal
    mask to a layer that takes a (B, Tk) key mask: one copy of each row per query), and the output is the rows of
    those parts, with their graph."""
    with graph_kept():
        return sub(q, k, v, allowed).out


# ---- tokens scaled to a softmax that is neither uniform nor one-hot (the decoding and gradient checks) ----

ENTROPY_ROWS = 512
"""Rows of weights a mean or median over rows reads (the first ones: batch 0, head 0 first): the entropies of the
temperature check and the logit spread of the gain."""


LOGIT_SPREAD = 2.0
"""The spread (std over a row's keys) of the logits the decoding checks aim for by scaling their tokens."""
LOGIT_GAIN_CAP = 100.0
"""The largest factor: a 2-wide head at std-0.02 initialisation spreads its logits by ~0.06 even at 10x."""


def logit_gain(probe: Probe) -> float:
    """The factor, 1 to LOGIT_GAIN_CAP, by which the decoding and gradient checks scale their tokens so that the logits
    spread by about
    LOGIT_SPREAD over each row's keys: at GPT-2's std-0.02 initialisation attention is nearly uniform, and a
    position or mask error shows only once tokens are ~10x larger; at torch's default initialisation 10x
    makes attention one-hot, where half precision's rounding of a logit moves the output as much as a bug
    (bfloat16 measured 0.08 of the RMS between two correct computations). The spread is read from the
    standard probe's weights (a softmax's log is its logits, shifted per row); 10 where none are exposed, the
    cap where they are uniform to their rounding. Computed once per audit (several detectors ask; a localiser's
    replay after `Probe.release` dropped the standard probe's record gets exactly the gain the audit used, where
    reading it again from the weights alone differs in the last float32 digits)."""
    if "logit_gain" not in probe.memo:
        probe.memo["logit_gain"] = _logit_gain(probe)
    return probe.memo["logit_gain"]


def _logit_gain(probe: Probe) -> float:
    base = probe.base()
    gain = _gain_of(probe, base) if base.ok else None
    return 10.0 if gain is None else gain


def _gain_of(probe: Probe, call: Call) -> float | None:
    """The gain that spreads `call`'s logits by about LOGIT_SPREAD over each row's keys (a median over rows); None
    where no weights are exposed, or no row has two keys."""
    weights = probe.weights(call)[0]
    if weights is None:
        return None
    w = weights.detach().flatten(0, -2)[:ENTROPY_ROWS].double()  # (rows, Tk): a sample, as for the entropy
    seen = w > 0
    n = seen.sum(-1)
    logits = torch.where(seen, w.log(), torch.zeros_like(w))  # log(0) = -inf only where not seen: replaced
    # the softmax's own input where it was observed: weights rounded to half precision are 0.5 / 0.5 for
    # logits 0.01 apart, whose spread they would read as 0
    sm = next((sm for sm in reversed(call.record.softmaxes) if sm.input.numel() == weights.numel()), None) \
        if call.record is not None else None
    if sm is not None:
        raw = sm.input.detach().reshape(-1, w.shape[-1])[:ENTROPY_ROWS].double()
        seen = seen & torch.isfinite(raw)
        n = seen.sum(-1)
        logits = torch.where(seen, raw, torch.zeros_like(raw))
    mean = logits.sum(-1) / n.clamp_min(1)
    var = (torch.where(seen, logits - mean.unsqueeze(-1), torch.zeros_like(w)) ** 2).sum(-1) / (n - 1).clamp_min(1)
    rows = n >= 2
    if not bool(rows.any()):
        return None
    spread = float(var[rows].sqrt().median())
    if not math.isfinite(spread):
        return None
    if spread <= 0:  # uniform to the weights' rounding: as hard as allowed
        return LOGIT_GAIN_CAP
    return min(LOGIT_GAIN_CAP, max(1.0, math.sqrt(LOGIT_SPREAD / spread)))  # logits grow as the square of the tokens


def gradient_gain(probe: Probe, sub, drawn: tuple, allowed: Tensor | None) -> float:
    """The gain of the gradient checks' tokens, read on those very tokens: the float64 copy's forward on them at their
    plain size, observed. The standard probe's gain (`logit_gain`) reads other tokens, and at a few tokens of width 1
    the logits' spread is one product per row, which differs between draws by 100x: at torch's default init, two
    tokens, the standard probe's rows spread by 0.005 (gain 19) where the gradient checks' spread by ~1, and at that
    gain their float64 softmax was one-hot to the last bit, a detached softmax invisible (its gradient through the
    weights is 0 either way). The standard probe's gain where this forward raises or shows no weights."""
    q, k, v = pack(drawn)
    B, T = q.shape[0], q.shape[sub.time_dim]
    probe.passes += 1
    probe.shapes[probe.detector].append(ProbeShape(f"float64 copy, the gradient checks' tokens at their plain size, "
                                                   f"for their gain (B={B}, T={T})", B, T, T,
                                                   None if allowed is None else allowed.cpu(), len(drawn) == 1))
    try:
        observer = Observer()
        with torch.enable_grad(), observer:  # under grad mode, as the standard probe is observed (fused fast paths)
            probe.seed_layer_rng()
            out = sub(q, k, v, allowed)
    except Exception:  # noqa: BLE001 -- the gradient probe's own forward says what a raising layer means
        return logit_gain(probe)
    gain = _gain_of(probe, Call(q, k, v, allowed, out, None, observer.record))
    return logit_gain(probe) if gain is None else gain


LENGTH_RULE = re.compile(r"(?:divisible by|multiple of)\D{0,40}?(\d+)", re.I)


def length_rule(error: BaseException | None) -> int:
    """The multiple W of tokens a layer's own check names where it refuses a length (local attention's AssertionError
    "sequence length 1 must be divisible by window size 4": 4), else 0."""
    stated = LENGTH_RULE.search(str(error)) if isinstance(error, (AssertionError, ValueError)) else None
    return int(stated.group(1)) if stated else 0
