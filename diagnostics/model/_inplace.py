"""Auditing a model's attention module in place: capture what the model really passes it, and wrap it as a
`forward(x)` layer that `audit()` takes.

The model is run at the audit's length T and at T - 1 (forward pre-hooks with kwargs): the arguments whose sizes
follow the sequence (masks, rotary tables, position biases) are those that change, and are cut to the prefix a
probe needs. `InPlace.forward(x)` replaces only the hidden-state input (and key / value where the model passed
that same tensor), keeps the model's masks, position embeddings and other arguments, and calls the module the
way the model called it: the same arguments positional, the same by keyword. The model's call is the convention.
With one capture only (a fixed-length input: an image), a probe at another length that the layer raises on is
one it cannot take as held (its rotary table, window grid or relative bias are tied to the captured length and
were not cut): `ProbeNotTaken`, skipped with that reason, never a `runs` failure.

A cross-attention (a memory passed beside the hidden states: BART's, Marian's and Whisper's `key_value_states`,
T5's, an nn.MultiheadAttention given another stream as key and value) is wrapped as `InPlaceCross.forward(x,
memory)`: the memory the model passed (the encoder output) is what the probes replace, and the arguments whose
last dimension follows its length (the encoder's padding mask, a position bias) are cut to the probe's memory.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from .._errors import AuditUsageError, ProbeNotTaken
from .._observe import Observer, applied_scales
from .._subject import CACHE_NAMES, HEAD_NAMES, KEY_NAMES, MEMORY_NAMES, QUERY_NAMES, VALUE_NAMES
from ._runner import Runner, first_tensor

VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _is_memory_name(name: str) -> bool:
    """Whether an argument's name says it holds a memory the module attends: one of MEMORY_NAMES, or the states of a
    cross-attention by name (BLT's, Mllama's and Dia's `cross_attention_states`). Left out, BLT's cross-attention was
    audited as a self-attention whose keys and values the probes never reached (its memory held as captured)."""
    return name in MEMORY_NAMES or (name.startswith("cross") and name.endswith("states"))


@dataclass(frozen=True)
class CapturedCall:
    """One call of a module during a model forward: its arguments as passed, and copies of them taken before
    the call (a module may change its inputs in place)."""

    args: tuple
    kwargs: dict
    args_copy: tuple
    kwargs_copy: dict
    output_shape: tuple | None = None  # of the tensor it returned (`first_tensor`), None if none


def _clone(x):
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def capture_calls(runner: Runner, modules: dict, seq: Tensor) -> tuple[dict, str | None]:
    """{path: CapturedCall} of the first call of each module in one forward of `seq`, in call order, and the
    model's error if it raised."""
    calls: dict = {}
    handles = []
    shapes: dict = {}

    def hook_for(path):
        def hook(m, args, kwargs):
            if path not in calls:
                calls[path] = CapturedCall(args, kwargs, _clone(args), _clone(kwargs))
        return hook

    def output_hook_for(path):
        def hook(m, args, out):
            if path not in shapes:
                o = first_tensor(out)
                shapes[path] = tuple(o.shape) if isinstance(o, Tensor) else None
        return hook

    for path, m in modules.items():
        handles.append(m.register_forward_pre_hook(hook_for(path), with_kwargs=True))
        handles.append(m.register_forward_hook(output_hook_for(path)))
    error = None
    try:
        runner(seq, grad=True)  # grad mode: torch's fused inference fast paths would bypass the modules
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        for h in handles:
            h.remove()
    calls = {p: replace(c, output_shape=shapes.get(p)) for p, c in calls.items()}
    return calls, error


def forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature the module's forward is called with. A forward patched on the instance without
    `functools.wraps` reads `(*args, **kwargs)`, which names no hidden-state input: the class's own forward,
    which the patch stands in for, names them."""
    sig = inspect.signature(module.forward)
    if any(p.kind not in VARIADIC for p in sig.parameters.values()):
        return sig
    try:
        own = inspect.signature(type(module).forward.__get__(module))  # bound: without self
    except (AttributeError, TypeError, ValueError):
        return sig
    return own if any(p.kind not in VARIADIC for p in own.parameters.values()) else sig


def _passed_positionally(sig: inspect.Signature, count: int) -> frozenset:
    """The names of the parameters that `count` positional arguments fill (the *args name, if they reach it)."""
    names = []
    for p in sig.parameters.values():
        if len(names) >= count:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            names.append(p.name)
            if p.kind == p.VAR_POSITIONAL:
                break
    return frozenset(names)


def _leaves(x, path=()):
    if isinstance(x, Tensor):
        yield path, x
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))


def _get(x, path):
    for p in path:
        try:
            x = x[p]
        except (KeyError, IndexError, TypeError):
            return None
    return x


class InPlace(nn.Module):
    """`forward(x)`: the wrapped module called as its model called it, with only the hidden-state input (and key /
    value where the model passed that same tensor) replaced by x (B, t, D), t <= the captured length; the
    model's other arguments cut to the first t positions along their sequence dimensions and repeated along
    the batch. Audited by `audit()` like any self-attention module."""

    own_queries: int | None = None  # rows it returns where not one per token: queries of its own (`_own_queries`)
    one_vector = False  # it returns (B, D), its one query's row without the axis

    def __init__(self, module: nn.Module, path: str, sig: inspect.Signature, arguments: dict, hidden: str,
                 same: tuple[str, ...], positional: frozenset, time_dims: dict, hidden_time_dim: int, length: int,
                 num_heads: int | None, note: str = "", folded: frozenset = frozenset(),
                 shared: frozenset = frozenset(), centred: dict | None = None, returned_width: int | None = None):
        super().__init__()
        self.inner = module
        self.audit_name = f"{path} ({type(module).__name__}, in place)"
        self.signature, self.call_arguments, self.hidden_name, self.same_as_hidden = sig, arguments, hidden, same
        self.positional = positional  # the names the model passed positionally
        self.time_dims, self.hidden_time_dim = time_dims, hidden_time_dim
        self.contiguous_input = arguments[hidden].is_contiguous()
        self.captured_dtype = arguments[hidden].dtype
        self.d_model = int(arguments[hidden].shape[-1])
        self.width_from_call = True  # d_model is the width the model passed, not a guess to check against projections
        # the width its model's call returned, where not the one it takes (Zamba2's shared attention: [hidden states;
        # embeddings] in, 2D wide, D out): the output shape the probes must find (`Subject.expected_out_shape`)
        self.returned_width = returned_width if returned_width and returned_width != self.d_model else None
        self.block_size = length
        # one capture only (fixed-length input, an image): which dimensions of the model's other arguments follow the
        # length is a guess, so a probe at another length may be one the layer as held cannot take (`_invoke`)
        self.fixed_length = bool(note)
        self.captured_batch = int(arguments[hidden].shape[1 - hidden_time_dim])  # of one input: windows in a Swin block
        if num_heads:
            self.num_heads = num_heads
        self.note = note
        self.folded = folded  # leaves with the batch folded into their first dimension (_batch_rows)
        self.shared = shared  # leaves of one row whatever the batch: the model passes them so at batch 2 (_batch_rows)
        self.centred = centred or {}  # leaf -> dims of 2T - 1 relative positions, cut around their centre

    def _adapt(self, value, path, t: int, batch: int, dtype):
        if isinstance(value, Tensor):
            dims = self.time_dims.get(path, ())
            for d in dims:
                value = value.narrow(d, 0, min(t, value.shape[d]))
            for d in self.centred.get(path, ()):  # distances -(T - 1) .. T - 1, either way round: keep |i - j| < t
                value = value.narrow(d, max(0, (value.shape[d] - (2 * t - 1)) // 2), min(2 * t - 1, value.shape[d]))
            if value.dim() >= 2 and value.shape[0] == 1 and batch > 1 and 0 not in dims and path not in self.shared:
                value = value.expand(batch, *value.shape[1:])
            elif path in self.folded and batch > 1:  # (n, ...) of one input: (batch x n, ...), batch-major
                value = value.repeat(batch, *(1,) * (value.dim() - 1))
            elif self._per_row(value, dims, batch):
                # one entry per row the layer saw (Swin's (nW, N, N) mask, a window's own): probe row b is a window,
                # given window b's entry (cycling past nW), as the model pairs row r with window r mod nW
                value = value[torch.arange(batch, device=value.device) % self.captured_batch]
            if value.is_floating_point() and value.dtype != dtype and value.dtype == self.captured_dtype:
                value = value.to(dtype)
            return value
        if isinstance(value, tuple):
            return tuple(self._adapt(v, path + (i,), t, batch, dtype) for i, v in enumerate(value))
        if isinstance(value, list):
            return [self._adapt(v, path + (i,), t, batch, dtype) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {k: self._adapt(v, path + (k,), t, batch, dtype) for k, v in value.items()}
        return value

    def _per_row(self, value: Tensor, dims: tuple, batch: int) -> bool:
        """Whether `value` has one entry per row of the layer's captured input along its first dimension, a row being
        a window (captured at batch 1 with n > 1 rows: Swin's windows), and a probe of another batch needs its own:
        then the probe's rows are windows, each given its window's entry."""
        n = self.captured_batch
        return n > 1 and batch != n and value.dim() >= 1 and value.shape[0] == n and 0 not in dims

    def _layout(self, x: Tensor) -> Tensor:
        """(B, t, D) in the module's own layout, contiguous where the model passed its input so (GPT-2's Conv1D
        views its input, harmless in the model)."""
        h = x.transpose(0, 1) if self.hidden_time_dim == 0 else x
        return h.contiguous() if self.contiguous_input else h

    def forward(self, x):
        h = self._layout(x)
        return self._invoke(x, {n: h for n in (self.hidden_name, *self.same_as_hidden)})

    def _invoke(self, x: Tensor, streams: dict):
        """Call the module with `streams` ({argument: tensor}) in place of what the model passed there, the other
        arguments adapted to x's length and batch; its output, batch-first."""
        B, t = x.shape[0], x.shape[1]  # batch, sequence length
        args, kwargs = [], {}
        for name, value in self.call_arguments.items():
            if name in streams:
                value = streams[name]
            elif name in CACHE_NAMES:
                value = None  # a cache would grow from call to call
            else:
                value = self._adapt(value, (name,), t, B, x.dtype)
            kind = self.signature.parameters[name].kind
            if kind == inspect.Parameter.VAR_POSITIONAL:
                args.extend(value)
            elif kind == inspect.Parameter.VAR_KEYWORD:
                kwargs.update(value)
            elif name in self.positional:  # positional where the model passed it so (a patched forward may not
                args.append(value)         # take by position what its signature would bind)
            else:
                kwargs[name] = value
        try:
            result = self.inner(*args, **kwargs)
        except Exception as exc:
            # the model is captured at batch 1: a layer that saw more rows (Swin's windows) may need a multiple
            if self.fixed_length and (t != self.block_size or (B % self.captured_batch and not self._windows())
                                      or self._other_memory()):
                raise ProbeNotTaken(
                    f"the layer in place holds the arguments its model passed at length {self.block_size} and batch "
                    f"{self.captured_batch}{self._memory_said()} (a fixed-length input: which of their dimensions "
                    f"follow the length or the batch is not known, so they are not cut) and raised at length {t}, "
                    f"batch {B}{self._memory_said(now=True)}, which its model never gives it") from exc
            raise
        # the output alone: what else a module returns (T5's position bias, a cache) could pass for weights;
        # the weights are read from the observed softmax or fused attention
        out = first_tensor(result)
        if out is None:
            return result  # not an attention output: the audit says so
        if self.one_vector and out.dim() == 2:  # a pooling head's (B, D): its one query's row
            return out.unsqueeze(1)
        return out.transpose(0, 1) if self.hidden_time_dim == 0 else out

    def _windows(self) -> bool:
        """Whether some argument has one entry per captured row (`_per_row`): a probe of any batch is then given its
        rows' entries, and a raise at that batch is the layer's own."""
        return self.captured_batch > 1 and any(
            tensor.dim() >= 1 and tensor.shape[0] == self.captured_batch and 0 not in self.time_dims.get(leaf, ())
            for name, value in self.call_arguments.items() if name != self.hidden_name
            for leaf, tensor in _leaves(value, (name,)))

    @property
    def probe_length(self) -> int:
        """The length its audit probes it at: the length its model called it with."""
        return self.block_size

    def _other_memory(self) -> bool:
        """Whether the call in progress has another memory length than the model's (cross-attention only)."""
        return False

    def _memory_said(self, now: bool = False) -> str:
        return ""

    def is_self_attention(self) -> bool:
        """No key/value/memory stream other than the hidden states."""
        return not any((name in KEY_NAMES + VALUE_NAMES or _is_memory_name(name)) and isinstance(value, Tensor)
                       and name not in self.same_as_hidden for name, value in self.call_arguments.items())


class InPlaceCross(InPlace):
    """`forward(x, memory)`: a cross-attention module called as its model called it, with the hidden states replaced
    by x (B, t, D) and the memory the model passed (and every argument that was that same tensor: a key and a
    value) by `memory` (B, s, D); arguments whose last dimension has the memory's length are cut to s (or, where
    they are constant along it, extended). Audited by `audit()` as a cross-attention module."""

    def __init__(self, *args, memory: str, same_as_memory: tuple[str, ...], memory_dims: frozenset, **kw):
        super().__init__(*args, **kw)
        self.memory_name, self.same_as_memory, self.memory_dims = memory, same_as_memory, memory_dims
        self.memory_length = int(self.call_arguments[memory].shape[self.hidden_time_dim])
        self._memory_now = self.memory_length  # the memory length of the call in progress
        self.audit_name = self.audit_name.replace(", in place)", f", in place, memory {memory})")

    @property
    def probe_length(self) -> int:
        """The queries' length, or the memory's where it is shorter and an argument varies along it: the layer audit's
        probes give the memory as many tokens as the queries, and a memory longer than the model's cannot be given
        (`_fit`). BLT's local encoder: its patches' queries, 34 at 16 bytes, attend the bytes under a (1, 1, 34, 16)
        mask that says which patch holds which byte; probed at 34 tokens, every probe was refused. Likewise where,
        with one capture only (a fixed-length input: an image), another argument has the memory's length along a
        dimension other than its first and last, which is not cut (`_other_memory`): DETR's decoder holds its
        encoder's position embeddings, (B, S, D); probed with 100 queries and a memory of 100, its cross-attention
        over a memory of 4 refused every probe."""
        streams = (self.hidden_name, *self.same_as_hidden, self.memory_name, *self.same_as_memory)
        varies = any(not bool((tensor == tensor[..., :1]).all()) for name, value in self.call_arguments.items()
                     for leaf, tensor in _leaves(value, (name,)) if leaf in self.memory_dims)
        # a memory of 1 is in every shape that broadcasts: a chance match, and a probe of one key judges nothing
        held = self.fixed_length and self.memory_length > 1 and any(self.memory_length in tensor.shape[1:-1]
                                         for name, value in self.call_arguments.items() if name not in streams
                                         for _, tensor in _leaves(value, (name,)))
        return min(self.block_size, self.memory_length) if varies or held else self.block_size

    def _other_memory(self) -> bool:
        # a memory of another length than the model's: arguments that follow it along another dimension than the
        # last (DETR's encoder_position_embeddings, (B, S, D)) are not cut, so the layer may not take it
        return self._memory_now != self.memory_length

    def _memory_said(self, now: bool = False) -> str:
        return f", memory {self._memory_now if now else self.memory_length}"

    def _fit(self, value: Tensor, s: int) -> Tensor:
        """`value` with its last dimension (the memory's length) made s long. Cut where a row keeps none of the
        entries above its lowest that it had (a mask row left with blocked keys only: BLT's local decoder, whose byte i
        attends its patch's memory slots 2i and 2i + 1, cut to 16 of 34 slots, left bytes 8..15 no key), the probe is
        one the layer as held cannot take: its rows fully masked by the cut, which the model never gives it, made
        `gradients` fail on the additive mask's rounding (finfo.min + q.k is finfo.min)."""
        n = value.shape[-1]
        if s <= n:
            kept = value.narrow(-1, 0, s)
            if s < n and _rows_cut_off(value, kept):
                raise ProbeNotTaken(f"the layer in place holds a mask its model passed over a memory of {n} positions: "
                                    f"cut to a memory of {s}, some query rows keep none of the keys it allows them")
            return kept
        if bool((value == value[..., :1]).all()):  # constant along the memory: any length has the same entries
            return value[..., :1].expand(*value.shape[:-1], s)
        raise ProbeNotTaken(f"the layer in place holds arguments its model passed for a memory of {n} positions, which "
                            f"vary along it (a mask over the memory), so it cannot be given a memory of {s}")

    def _adapt(self, value, path, t: int, batch: int, dtype):
        value = super()._adapt(value, path, t, batch, dtype)
        if isinstance(value, Tensor) and path in self.memory_dims:
            value = self._fit(value, self._memory_now)
        return value

    def forward(self, x, memory):
        h, m = self._layout(x), self._layout(memory)
        self._memory_now = memory.shape[1]
        return self._invoke(x, {**{n: h for n in (self.hidden_name, *self.same_as_hidden)},
                                **{n: m for n in (self.memory_name, *self.same_as_memory)}})


def _rows_cut_off(full: Tensor, kept: Tensor) -> bool:
    """Whether a row of `full` (along its last dimension) has entries above its lowest that `kept`, its first
    positions, has none of: whatever the mask's convention (additive, boolean, 0/1), a row of blocked keys only is
    constant, and a row that allows a key has two values."""
    if full.dtype == torch.bool:
        full, kept = full.to(torch.int8), kept.to(torch.int8)
    lowest = full.amin(-1, keepdim=True)
    return bool(((full != lowest).any(-1) & ~(kept != lowest).any(-1)).any())


class InPlaceGrid(InPlace):
    """`forward(x)`: a module that takes its tokens as a grid and returns them so: channels last, (B, *grid, D) (SAM's
    ViT blocks, (B, H, W, D); NesT's, (B, blocks, tokens, D)), or channels first, (B, D, H, W) (a feature map:
    EfficientViT's, LeViT's convolutional and CPUBone's attention over pixels). x (B, t, D) laid out as that grid,
    the output flattened back. Only at the captured size: a probe of another length cannot be laid out as the grid
    (`ProbeNotTaken`, skipped with that reason)."""

    def __init__(self, *args, grid: tuple[int, ...], channels_first: bool = False,
                 out_grid: tuple[int, ...] | None = None, **kw):
        super().__init__(*args, **kw)
        self.grid, self.channels_first = grid, channels_first
        # returned on a smaller grid: its positions, flattened, are queries of its own (`own_queries`)
        self.out_grid = out_grid
        shown = " x ".join(map(str, grid))
        order = "channels first" if channels_first else "channels last"
        queries = "" if out_grid is None else f", queries of its own on a {' x '.join(map(str, out_grid))} grid"
        self.audit_name = self.audit_name.replace(", in place)", f", in place, tokens of a {shown} grid, {order}"
                                                                 f"{queries})")

    def _layout(self, x: Tensor) -> Tensor:
        if x.shape[1] != math.prod(self.grid):
            raise ProbeNotTaken(f"the layer takes its tokens as a {' x '.join(map(str, self.grid))} grid (channels "
                                f"{'first' if self.channels_first else 'last'}), as its model passed them: a probe of "
                                f"{x.shape[1]} tokens cannot be laid out so")
        h = super()._layout(x)
        if self.channels_first:  # (B, t, D) -> (B, D, *grid)
            return h.transpose(1, 2).reshape(x.shape[0], x.shape[-1], *self.grid).contiguous()
        return h.reshape(x.shape[0], *self.grid, x.shape[-1])

    def _invoke(self, x: Tensor, streams: dict):
        out = super()._invoke(x, streams)
        if not isinstance(out, Tensor) or out.dim() != 2 + len(self.grid):
            return out
        if self.channels_first and tuple(out.shape[2:]) in (self.grid, self.out_grid):
            return out.flatten(2).transpose(1, 2)  # (B, D', *grid) -> (B, t, D'); on its own grid (B, Q, D')
        if not self.channels_first and tuple(out.shape[1:-1]) in (self.grid, self.out_grid):
            return out.flatten(1, -2)  # (B, *grid, D') -> (B, t, D'); on its own grid (B, Q, D')
        return out


def _grid(module: nn.Module, arguments: dict, output_shape: tuple | None):
    """(the argument, its grid, channels first) of a module whose tokens come as a grid and that returns them on the
    same grid (one output per position): a 4-D float tensor whose width is the one its first projection takes (an
    nn.Linear's in_features, an nn.Conv2d's in_channels), channels last, (B, *grid, D), or channels first, (B, D,
    H, W), a feature map (or one returned as wide as it came: EfficientViT's heads each project a slice of its
    channels); (None, None, False) otherwise (a map whose width no projection of the module takes and that it does
    not return as it came, or not on its grid: a convolution's input, a spatial gate's)."""
    first = next((m for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))), None)
    width = None if first is None else first.in_features if isinstance(first, nn.Linear) else first.in_channels
    if width is None or output_shape is None or len(output_shape) != 4:
        return None, None, False
    for name, value in arguments.items():
        if not (isinstance(value, Tensor) and value.is_floating_point() and value.dim() == 4):
            continue
        if isinstance(first, nn.Linear) and value.shape[-1] == width and tuple(output_shape[:3]) == tuple(value.shape[:3]):
            return name, tuple(int(n) for n in value.shape[1:3]), False
        # or, channels last, on a grid of fewer positions: queries of its own, pooled by a stride (HieraDet's, SAM 2's
        # q_pool, (B, 16, 16, C) in, (B, 8, 8, C') out)
        if isinstance(first, nn.Linear) and value.shape[-1] == width and output_shape[0] == value.shape[0] and \
                _smaller(output_shape[1:3], value.shape[1:3]):
            return name, tuple(int(n) for n in value.shape[1:3]), False
        same_grid = output_shape[0] == value.shape[0] and tuple(output_shape[2:]) == tuple(value.shape[2:])
        # or the very map it was given, each head's projection taking a slice of its channels (EfficientViT's cascade)
        if same_grid and (value.shape[1] == width or output_shape[1] == value.shape[1]):
            return name, tuple(int(n) for n in value.shape[2:]), True
        # or a map of fewer positions, each no larger along either axis: queries of its own, subsampled by a stride
        # (LeViT's convolutional AttentionDownsample, (B, C, 4, 4) in, (B, C', 2, 2) out)
        if value.shape[1] == width and output_shape[0] == value.shape[0] and \
                _smaller(output_shape[2:], value.shape[2:]):
            return name, tuple(int(n) for n in value.shape[2:]), True
    return None, None, False


def _smaller(out_grid, grid) -> bool:
    """A grid of fewer positions than `grid`, each axis no longer: a stride's, a pooling's."""
    return all(o <= i for o, i in zip(out_grid, grid)) and math.prod(out_grid) < math.prod(grid)


def build_in_place(path: str, module: nn.Module, long_call: CapturedCall, short_call: CapturedCall | None,
                   wide_call: CapturedCall | None = None) -> InPlace:
    """The wrapper for one module from its calls at length T (and T - 1, which tells the sequence dims; and at batch
    2, which tells the arguments with the batch folded into their first dimension)."""
    sig = forward_signature(module)
    bound = sig.bind(*long_call.args_copy, **long_call.kwargs_copy)
    raw = sig.bind(*long_call.args, **long_call.kwargs).arguments
    arguments = dict(bound.arguments)
    hidden = next((n for n in QUERY_NAMES if isinstance(arguments.get(n), Tensor)
                   and arguments[n].is_floating_point() and arguments[n].dim() == 3), None)
    if hidden is None:
        hidden = next((n for n, v in arguments.items() if isinstance(v, Tensor) and v.is_floating_point()
                       and v.dim() == 3), None)
    grid, channels_first = None, False
    if hidden is None:
        hidden, grid, channels_first = _grid(module, arguments, long_call.output_shape)
    if hidden is None:
        shapes = ", ".join(f"{n} {tuple(v.shape)}" if isinstance(v, Tensor) else n for n, v in arguments.items())
        four = next((n for n, v in arguments.items() if isinstance(v, Tensor) and v.is_floating_point()
                     and v.dim() == 4), None)
        why = "" if four is None else (
            f": `{four}` is a 4-D map, channels first (B, C, H, W) or not returned as it came (a convolution's, a "
            f"spatial gate's, or attention over its pixels), whose positions are a grid of the model's size, not a "
            f"sequence the layer audit's probes can shorten, so it is audited only through the model")
        raise AuditUsageError(f"expected {path} ({type(module).__name__}) to take its hidden states as a (B, T, D) "
                              f"tensor; got {shapes}{why}")
    if grid is not None:  # the grid's positions as one sequence: (B, H, W, D) or (B, D, H, W) -> (B, H x W, D)
        grid_input = arguments[hidden]
        arguments[hidden] = grid_input.flatten(2).transpose(1, 2) if channels_first else grid_input.flatten(1, -2)
    same = tuple(n for n, v in raw.items() if n != hidden and v is raw[hidden])
    own_queries, one_vector = _own_queries(arguments[hidden], long_call.output_shape)
    out_grid = None  # a map returned on a smaller grid than it came on: its positions are the queries
    if grid is not None:
        returned_grid = tuple(long_call.output_shape[2:] if channels_first else long_call.output_shape[1:3])
        if returned_grid != grid:
            out_grid = tuple(int(n) for n in returned_grid)
            own_queries = math.prod(out_grid)
    short = None
    if short_call is not None:
        try:
            short = dict(sig.bind(*short_call.args_copy, **short_call.kwargs_copy).arguments)
        except TypeError:
            short = None
    H = arguments[hidden]
    note = ""
    if short is not None and isinstance(short.get(hidden), Tensor) and short[hidden].shape != H.shape:
        changed = [d for d in range(H.dim()) if H.shape[d] != short[hidden].shape[d]]
        hidden_time_dim = changed[0]
        T = H.shape[hidden_time_dim]
        Ts = short[hidden].shape[hidden_time_dim]  # T - 1, or another length where the model makes its own (durations)
        time_dims, centred = {}, {}
        for name, value in arguments.items():
            for leaf, tensor in _leaves(value, (name,)):
                other = _get(short, leaf)
                if isinstance(other, Tensor) and other.dim() == tensor.dim():
                    dims = tuple(d for d in range(tensor.dim()) if tensor.shape[d] == T and other.shape[d] == Ts)
                    if dims:
                        time_dims[leaf] = dims
                    # relative positions, one per distance (Conformer's and Transformer-XL's (1, 2T - 1, D)), 2Ts - 1
                    # at the other length: the probe of length t needs the 2t - 1 around the centre
                    wide = tuple(d for d in range(tensor.dim()) if tensor.shape[d] == 2 * T - 1
                                 and other.shape[d] == 2 * Ts - 1)
                    if wide:
                        centred[leaf] = wide
    else:  # one capture only (inputs of fixed length, e.g. images): sequence dims are those of the hidden's length
        centred = {}
        hidden_time_dim = 1 if H.shape[0] == 1 or H.shape[1] != 1 else 0
        # (n, 1, D) is n rows of one token where the model's batch doubles n (MobileViT's pixels of a patch, folded
        # into the batch), not one row of n tokens; a (1, n, D) whose n doubles stays one sequence: the images of the
        # batch packed into one (Pixtral's, with a block-diagonal mask), whose time is its second dimension
        if hidden_time_dim == 0 and _doubled(H, sig, hidden, wide_call) == 0:
            hidden_time_dim = 1
        T = H.shape[hidden_time_dim]
        rows = H.shape[1 - hidden_time_dim]  # > 1 at batch 1: windows stacked along the batch (Swin's)
        time_dims = {}
        for name, value in arguments.items():
            if name == hidden:
                continue
            for leaf, tensor in _leaves(value, (name,)):
                # a leading dimension as long as the windows is one entry per window, even where a window holds as
                # many tokens (SwinV2-CR's last stages: 4 windows of 4 tokens, a (4, 4, 4) mask)
                first = 1 if rows > 1 and tensor.dim() >= 3 and tensor.shape[0] == rows else 0
                dims = tuple(d for d in range(first, tensor.dim()) if tensor.shape[d] == T)
                if dims:
                    time_dims[leaf] = dims
        note = "fixed-length input: arguments' sequence dimensions taken to be those of the hidden states' length"
    heads = None
    for holder in (module, getattr(module, "config", None)):
        for name in HEAD_NAMES:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and heads is None:
                heads = value
    D = H.shape[-1]
    if heads is not None and D % heads:
        heads = None
    positional = _passed_positionally(sig, len(long_call.args))
    folded, shared = _batch_rows(sig, arguments, hidden, hidden_time_dim, wide_call)
    out = long_call.output_shape
    returned = int(out[-1]) if out is not None and len(out) == 3 and tuple(out[:2]) == tuple(H.shape[:2]) else None
    if own_queries is not None and out is not None and not one_vector:  # its rows are its own queries, any width
        returned = int(out[1] if out_grid is not None and channels_first else out[-1])
    elif grid is not None and out is not None and len(out) == 4:  # a map returned on its grid, at a width of its own
        returned = int(out[1] if channels_first else out[-1])  # (CoAtNet's first block of a stage: 256 -> 512)
    built = (module, path, sig, arguments, hidden, same, positional, time_dims, hidden_time_dim, int(T), heads, note,
             folded, shared, centred, returned)
    memory = _memory_stream(arguments, raw, hidden, same, hidden_time_dim)
    if own_queries is not None and (memory is not None or (grid is not None and out_grid is None)):
        raise AuditUsageError(f"expected {path} ({type(module).__name__}) to return one output per token of its "
                              f"hidden states, as the layer audit's probes of a grid or of a memory read it; it "
                              f"returned {own_queries} for {H.shape[hidden_time_dim]} (queries of its own), so it is "
                              f"audited only through the model")
    if grid is not None:
        wrapped = InPlaceGrid(*built, grid=grid, channels_first=channels_first, out_grid=out_grid)
        if out_grid is not None:
            wrapped.own_queries = own_queries
        return wrapped
    if memory is None:
        wrapped = InPlace(*built)
        if own_queries is not None:
            wrapped.own_queries, wrapped.one_vector = own_queries, one_vector
            wrapped.audit_name = wrapped.audit_name.replace(", in place)", f", in place, {own_queries} "
                                                            f"quer{'y' if own_queries == 1 else 'ies'} of its own)")
        return wrapped
    name, same_as_memory = memory
    length = arguments[name].shape[hidden_time_dim]
    _keys_from_both_streams(path, module, arguments, short, hidden, name, hidden_time_dim)
    streams = {hidden, *same, name, *same_as_memory}
    memory_dims = frozenset(leaf for n, value in arguments.items() if n not in streams and n not in CACHE_NAMES
                            for leaf, tensor in _leaves(value, (n,))
                            if tensor.dim() >= 1 and tensor.shape[-1] == length
                            and tensor.dim() - 1 not in time_dims.get(leaf, ()))
    return InPlaceCross(*built, memory=name, same_as_memory=same_as_memory, memory_dims=memory_dims)


def _doubled(hidden: Tensor, sig: inspect.Signature, name: str, wide_call: CapturedCall | None) -> int | None:
    """The one of the hidden states' first two dimensions that doubles when the model's batch does (the batch,
    whatever it is folded with), from the model's call at batch 2; None where that does not tell."""
    if wide_call is None or hidden.dim() != 3:
        return None
    try:
        wide = sig.bind(*wide_call.args_copy, **wide_call.kwargs_copy).arguments.get(name)
    except TypeError:
        return None
    if not isinstance(wide, Tensor) or wide.dim() != 3:
        return None
    doubled = [d for d in (0, 1) if wide.shape[d] == 2 * hidden.shape[d] and wide.shape[1 - d] == hidden.shape[1 - d]]
    return doubled[0] if len(doubled) == 1 else None


def _batch_rows(sig: inspect.Signature, arguments: dict, hidden: str, time_dim: int,
                wide_call: CapturedCall | None) -> tuple[frozenset, frozenset]:
    """What the model's call at batch 2 says of the arguments' first dimensions, while the hidden states' batch
    doubles: (folded, shared). Folded: the leaves of n > 1 rows at batch 1 and 2n at batch 2, the batch folded with
    something else (BLOOM's ALiBi, (B x H, 1, T), batch-major). Shared: the leaves of one row at batch 1 and still
    one at batch 2, one for the whole batch (SEW-D's relative positions, (1, 1, T, T), which its layer squeezes
    and expands to the batch itself: repeated to the probe's batch, they raised in the layer)."""
    if wide_call is None:
        return frozenset(), frozenset()
    try:
        wide = dict(sig.bind(*wide_call.args_copy, **wide_call.kwargs_copy).arguments)
    except TypeError:
        return frozenset(), frozenset()
    h, w = arguments[hidden], wide.get(hidden)
    if isinstance(w, Tensor) and w.dim() == h.dim() + 1 == 4:  # a grid, flattened in h
        if w.shape[-1] == h.shape[-1] and w.shape[1:3].numel() == h.shape[1]:  # channels last, (B, H, W, D)
            w = w.flatten(1, -2)
        elif w.shape[1] == h.shape[-1] and w.shape[2:].numel() == h.shape[1]:  # channels first, (B, D, H, W)
            w = w.flatten(2).transpose(1, 2)
    batch_dim = 1 - time_dim
    if not isinstance(w, Tensor) or w.dim() != h.dim() or w.shape[batch_dim] != 2 * h.shape[batch_dim]:
        return frozenset(), frozenset()
    pairs = [(leaf, tensor, _get(wide, leaf)) for name, value in arguments.items() if name != hidden
             for leaf, tensor in _leaves(value, (name,))]
    pairs = [(leaf, a, b) for leaf, a, b in pairs if a.dim() >= 1 and isinstance(b, Tensor) and b.dim() == a.dim()]
    # a leaf of as many rows as the hidden states has one per row, not the batch folded with another axis: the layer
    # folds that axis into its own batch (LightGlue's two images of a pair, their rotary tables one per image), and
    # a probe's rows are given their rows' entries (`_per_row`); repeated to the probe's batch, every probe raised
    rows = h.shape[batch_dim]
    folded = frozenset(leaf for leaf, a, b in pairs if a.shape[0] > 1 and b.shape[0] == 2 * a.shape[0]
                       and a.shape[0] != rows)
    shared = frozenset(leaf for leaf, a, b in pairs if a.shape[0] == 1 and b.shape[0] == 1 and h.shape[batch_dim] == 1)
    return folded, shared


def _own_queries(hidden: Tensor, out: tuple | None) -> tuple[int | None, bool]:
    """(Q, one vector) of a module whose output has another number of rows than its hidden states has tokens: queries
    of its own (CrossViT's fusion attention and CaiT's class attention: the class token's query over every token; a
    pooling head's learned query; Hiera's and MViTv2's queries pooled by a stride), kept in the wrapper so that the
    probes expect Q rows and read (Q, Tk) weights; one vector: the module returned (B, D), one row without its axis.
    (None, False) for one output per token. At the captured length only: a probe of another length is not one the
    layer as held takes (`ProbeNotTaken`, a fixed-length input)."""
    if out is None or hidden.dim() != 3:
        return None, False
    if len(out) == 2 and out[-1] == hidden.shape[-1] and out[0] in (hidden.shape[0], hidden.shape[1]) and \
            hidden.shape[0] != hidden.shape[1]:  # (B, D): one vector per sequence, no token axis (a pooling head)
        return 1, True
    if len(out) != 3:
        return None, False
    same_batch = [d for d in (0, 1) if out[d] == hidden.shape[d]]
    if len(same_batch) != 1:
        return None, False
    time_dim = 1 - same_batch[0]
    if out[time_dim] != hidden.shape[time_dim]:  # whatever its width (Hiera's stage widens as it pools)
        return int(out[time_dim]), False
    return None, False


def _keys_from_both_streams(path: str, module: nn.Module, arguments: dict, short: dict | None, hidden: str,
                            memory: str, time_dim: int) -> None:
    """A module given a memory whose keys are its own tokens and the memory's together (T5Gemma 2's merged
    attention: one softmax over [self keys; memory keys], its mask (B, 1, T, T + M)) is not audited in place: the layer
    audit's cross-attention probes vary the queries apart from the keys, and here every query is also a key. Told by
    an argument with a dimension of T + M at length T and of T - 1 + M at T - 1, the memory's length M unchanged.
    Raises AuditUsageError (a note, the layer audited through the model only)."""
    if short is None or not isinstance(short.get(hidden), Tensor) or not isinstance(short.get(memory), Tensor):
        return
    T, Ts = arguments[hidden].shape[time_dim], short[hidden].shape[time_dim]
    M, Ms = arguments[memory].shape[time_dim], short[memory].shape[time_dim]
    if T == Ts or M != Ms:  # the memory kept at its length: a dimension of T + M is then not 2T - 1 by chance
        return
    for name, value in arguments.items():
        if name in (hidden, memory):
            continue
        for leaf, tensor in _leaves(value, (name,)):
            other = _get(short, leaf)
            if isinstance(other, Tensor) and other.dim() == tensor.dim() and any(
                    tensor.shape[d] == T + M and other.shape[d] == Ts + M for d in range(tensor.dim())):
                raise AuditUsageError(
                    f"expected {path} ({type(module).__name__}) to attend either its own tokens or its memory "
                    f"`{memory}`; its `{'.'.join(map(str, leaf))}` {tuple(tensor.shape)} spans both, {T} of its own "
                    f"tokens + {M} of the memory's (a merged self- and cross-attention: every query is also a key), "
                    f"which the layer audit's cross-attention probes cannot vary apart, so it is audited only "
                    f"through the model")


def _memory_stream(arguments: dict, raw: dict, hidden: str, same: tuple, time_dim: int):
    """(the memory's argument, the others that were that same tensor) of a cross-attention call: a (B, s, D)
    float tensor under a memory or key name, other than the hidden states, with the hidden states' batch and
    width; None for self-attention (or keys and values from two different streams)."""
    H = arguments[hidden]
    batch_dim = 1 - time_dim
    names = MEMORY_NAMES + tuple(n for n in arguments if _is_memory_name(n) and n not in MEMORY_NAMES) + KEY_NAMES
    for name in names:
        value = arguments.get(name)
        if name == hidden or name in same or not isinstance(value, Tensor) or not value.is_floating_point() or \
                value.dim() != 3 or value.shape[-1] != H.shape[-1] or value.shape[batch_dim] != H.shape[batch_dim]:
            continue
        also = tuple(n for n, v in raw.items() if n != name and v is raw[name])
        values = [n for n in VALUE_NAMES if isinstance(arguments.get(n), Tensor)]
        if any(n not in also for n in values):  # a value stream of its own: not one memory
            return None
        return name, also
    return None


UNSCALED_FAMILIES = ("t5", "mt5", "umt5", "longt5", "gpt_neo", "switch_transformers")  # q·k multiplied by 1


HEAD_WIDTH_NAMES = ("head_dim", "head_size", "attention_head_size", "dim_head")  # a head's width, as layers state it

BOTH = "a legitimate scale and the bug at once:"
"""How `scale_bug` begins where the value is a legitimate scale and the bug at once (muP's 1/d_k where the width is
d_k squared: 8 heads of 8, a learner's d_model 64): the layer's temperature is then left unjudged, asking for the
declaration, neither passed under the attribute nor failed against 1/sqrt(d_k)."""

SCALE_FORM_TOLERANCE = 1e-6
"""A scale attribute is one of the bug forms (`scale_bug`) where it lies within this relative distance of it. The
attributes met are computed in Python floats, d ** -0.5 or 1 / math.sqrt(d): within 2e-16 of the form (float32 would
be 6e-8). The nearest other value met is Gemma 2's query_pre_attn_scalar ** -0.5 beside a head width it differs from
by 12% (144 vs 128), and DIFF Transformer's (d_k / 2) ** -0.5, 41% from 1/sqrt(d_k)."""


def declared_scale(module: nn.Module, model: nn.Module | None = None, *, layer: nn.Module | None = None
                   ) -> tuple[float | None, str]:
    """The softmax scale a module declares: its `scaling` attribute (Hugging Face's), else a number `scale` or
    `softmax_scale` (timm's), or 1 for the families that fold the scale into their initialisation (T5) or use none
    (GPT-Neo); None: 1/sqrt(d_k). The family is the module's own config's, else the model's: a module that keeps no
    config (LongT5's local and transient-global attention) is of its model's family.

    An attribute whose value is itself the common bug relative to the head width its q·k has (`scale_bug`: the whole
    width's 1/sqrt(H * d_k), `self.scale = dim ** -0.5`, or sqrt(d_k), the inverse) is no declaration: the layer is
    judged against 1/sqrt(d_k), as `audit(layer)` judges it, and the note names the attribute and both readings.
    `layer`: the module as the audit calls it (its in-place wrapper), run once to observe that head width."""
    for name in ("scaling", "scale", "softmax_scale"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            where = f"{type(module).__name__}.{name}"
            bug = scale_bug(float(value), module, layer if layer is not None else module)
            if bug.startswith(BOTH):
                return None, (f"{where} = {float(value):.4g} is {bug}: which one the layer means decides its "
                              f"temperature, so it is not judged; declare the scale meant: diagnostics.audit(layer, "
                              f"scale={float(value):.6g}) for muP's")
            if bug:
                return None, (f"{where} = {float(value):.4g} is {bug}: judged against 1/sqrt(d_k), as "
                              f"audit(layer) judges it, not as a declared scale; if that scale is meant (the one a "
                              f"trained model's weights expect), declare it: diagnostics.audit(layer, "
                              f"scale={float(value):.6g})")
            return float(value), f"scale {float(value):.4g} from {where}"
    config = getattr(module, "config", None)
    if config is None and model is not None:
        config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family in UNSCALED_FAMILIES:
        return 1.0, f"scale 1 ({family} multiplies q·k by nothing)"
    return None, ""


def scale_bug(value: float, module: nn.Module, layer: nn.Module) -> str:
    """What a scale attribute's value is where it is one of the bugs of the scale itself relative to the head width
    d_k of the q·k the layer's softmax reads (observed by one call of `layer`): the whole width's, 1/sqrt(W) for W the
    width the layer takes or H * d_k, wider than a head (the whole model width in place of a head's: vit-pytorch
    #65, ng-video-lecture PR #6; CvT's original code), or sqrt(d_k), the scale inverted; "" otherwise. A value that is
    1/sqrt(the head width the module states) is the standard scale, read without a call. Over transformers 5.25 and
    timm 1.0.31, every other attribute value met (T5's 1, Gemma's query_pre_attn_scalar ** -0.5, Granite's
    attention_multiplier, muP's 1/d_k, a d_k ** -0.25 on q and on k) is none of these forms (docs/auditing-a-model.md).
    muP's 1/d_k is the whole width's where the width is d_k squared (8 heads of 8): that value begins with `BOTH`."""
    stated = next((v for n in HEAD_WIDTH_NAMES if isinstance(v := getattr(module, n, None), int) and v > 0), None)
    if stated and math.isclose(value * math.sqrt(stated), 1.0, rel_tol=SCALE_FORM_TOLERANCE):
        return ""
    seen = observed_heads(layer)
    if seen is None:
        return ""
    d_k, heads = seen
    width = getattr(layer, "d_model", None)  # the width the model passed the layer
    for whole in sorted({w for w in (width, heads * d_k if heads else None) if w and w > d_k}):
        if math.isclose(value * math.sqrt(whole), 1.0, rel_tol=SCALE_FORM_TOLERANCE):
            if whole == d_k * d_k:  # muP's 1/d_k is the same number: a legitimate scale or the bug, not told apart
                return (f"{BOTH} 1/d_k = 1/{d_k} (muP's scale) and 1/sqrt({whole}), the whole width's (the bug: a "
                        f"head's is 1/sqrt({d_k})), one number where the width is d_k squared")
            return f"1/sqrt({whole}), the whole width's, not a head's 1/sqrt(d_k) = 1/sqrt({d_k})"
    if d_k > 1 and math.isclose(value, math.sqrt(d_k), rel_tol=SCALE_FORM_TOLERANCE):
        return f"sqrt(d_k) = sqrt({d_k}), the inverse of 1/sqrt(d_k)"
    return ""


def observed_heads(layer: nn.Module) -> tuple[int, int | None] | None:
    """(d_k, the number of heads where q·k has a head axis) of the q·k the layer's softmax (or fused attention call)
    reads, from one observed call on random hidden states of the width and length its model passed it; None where
    the call raised or no one width was read."""
    if not isinstance(layer, InPlace) or not layer.block_size:
        return None
    captured = layer.call_arguments[layer.hidden_name]
    draw = torch.Generator().manual_seed(0)  # its own draws: the audit's seeded ones stay as they were
    shapes = [((layer.captured_batch, layer.block_size, layer.d_model), captured)]
    if isinstance(layer, InPlaceCross):
        memory = layer.call_arguments[layer.memory_name]
        shapes.append(((layer.captured_batch, layer.memory_length, memory.shape[-1]), memory))
    args = [torch.randn(shape, generator=draw).to(like.device, like.dtype) for shape, like in shapes]
    observer = Observer()
    try:
        with torch.enable_grad(), observer:  # grad mode, as the audit's probes: fused fast paths hide q·k
            layer(*args)
        seen = set()
        for e in applied_scales(observer.record):
            q = e.fused.q if e.fused is not None else e.matmul.a if e.matmul is not None else None
            seen.add((e.d_k, int(q.shape[-3]) if q is not None and q.dim() == 4 else None))
    except Exception:  # noqa: BLE001 -- the layer's raise (its own probes say what it raises) or a reading of its
        return None  # scores that failed: no head width observed, so the attribute is taken as it is stated
    return seen.pop() if len(seen) == 1 else None


__all__ = ["CapturedCall", "InPlace", "InPlaceCross", "build_in_place", "capture_calls", "declared_scale", "forward_signature", "observed_heads",
           "scale_bug", "BOTH"]
