"""A module whose output is each head's apart, (B, T, H, d) or (B, H, T, d), for its caller to merge and project:
the form an attention core returns (diffusers' Lumina processor, whose block merges the heads and applies the
layer's own `to_out`). Another convention, not a defect: `output_shape` names the call that merges the heads as
the caller does, `parameters_used` leaves the projection the layer never reads to that call, and `runs` writes the
merge into the call it names for a layer that needs a memory and a mask given (`runs._stream_and_mask`)."""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

from torch import Tensor, nn

from .._masks import SHORTCUTS
from .._probe import Probe
from .._subject import Output, call_declaration, spell
from .._tracing import trace_call

INPUT_ROLE = re.compile(r"(^|_)(w?q|w?k|w?v|qk|kv|qkv|quer(y|ies)|keys?|values?)(_|$)", re.IGNORECASE)
"""The last name of a projection that makes queries, keys or values (`to_q`, `k_proj`, `wv`, `query`): one the
layer leaves unread is an unused parameter of its own (values read through the key projection), never the output
projection its caller applies."""


@dataclass(frozen=True)
class HeadsOut:
    """What was seen of a per-head output: its `layout` ("bthd" or "bhtd"), its `heads`; `left`, the paths of the
    layer's nn.Linear modules from the queries' width to it, not named for a query, key or value, whose weights the
    call never read, each with its spelling in a call (`to_out[0]`): one of them is the caller's output projection
    (`projection`), several cannot be told apart; `indexed`: the layer returns a tuple, its first the output."""

    layout: str
    heads: int
    left: tuple[tuple[str, str], ...] = ()
    indexed: bool = False

    @property
    def projection(self) -> str | None:
        return self.left[0][0] if len(self.left) == 1 else None

    def merged(self, body: str) -> str:
        """The expression that merges the heads of `body`'s output as its caller does, and projects them with the
        layer's projection that the layer leaves to its caller."""
        body += "[0]" if self.indexed else ""
        merged = f"{body}.flatten(2)" if self.layout == "bthd" else f"{body}.transpose(1, 2).flatten(2)"
        return f"{self.left[0][1]}({merged})" if self.projection else merged

    def describe(self, shape: tuple) -> str:
        """`shape` in words: whose axes they are and what is done with them outside the layer."""
        axes = "(B, T, H, d)" if self.layout == "bthd" else "(B, H, T, d)"
        head = f"{shape}: each of its {self.heads} heads' output apart, {axes}, for its caller to merge"
        if self.projection:
            return f"{head} and project with `{self.projection}`, whose weights the layer never reads"
        if self.left:
            return (f"{head}; {len(self.left)} projections to the output's width are never read "
                    f"({', '.join(f'`{p}`' for p, _ in self.left)}), and which one the caller applies cannot be told")
        return head


def heads_layout(out: Tensor, batch: int, length: int, width: int) -> tuple[str, int] | None:
    """("bthd", H) or ("bhtd", H) where `out` is a batch of `length` rows per sequence, each head's apart, H heads
    of width / H features; None otherwise. A head axis as long as the sequence cannot be told from it: None."""
    if out.dim() != 4 or out.shape[0] != batch:
        return None
    _, a, b, d = (int(n) for n in out.shape)
    if a == length and b != length and b * d == width:
        return "bthd", b
    if b == length and a != length and a * d == width:
        return "bhtd", a
    return None


@dataclass(frozen=True)
class Read:
    """One traced call: its output (the first tensor of a tuple), whether it was a tuple, and the names of the
    layer's parameters and buffers an op read."""

    out: Tensor
    indexed: bool
    read: frozenset


def traced(probe: Probe, run, query: Tensor) -> Read | None:
    """`run()` (a call of the layer, its raw result) under the tracer; None where it raised or gave no tensor."""
    t = trace_call(probe.subject, query, query, query, None, seed=probe.seed, call=run)
    raw = t.output.out if isinstance(t.output, Output) else t.output
    out = raw[0] if isinstance(raw, (tuple, list)) and raw else raw
    if not isinstance(out, Tensor):  # raised (no output), or returned no tensor
        return None
    return Read(out, isinstance(raw, (tuple, list)), frozenset(t.buffers[i] for op in t.ops for i in op.in_ids
                                                                if i in t.buffers))


def heads_out_seen(probe: Probe) -> HeadsOut | None:
    """The per-head output of a module given a stream (or a memory too), with attention over the tokens observed;
    None otherwise (a layer of the right shape costs nothing; one of another shape, one traced call more, or two
    where the longer one raises). Made once per audit, its draws seeded from its name whichever detector asks first
    (`Probe.shared`)."""
    return probe.shared("heads_out_seen", lambda: _heads_out_seen(probe))


def _heads_out_seen(probe: Probe) -> HeadsOut | None:
    s, B, T = probe.subject, probe.BATCH, probe.t
    base = probe.base()
    if s.form not in ("self_module", "cross_module", "qkv_module") or not base.ok \
            or probe.observed_over(base, T, T) is None:  # a tensor of that shape, but no attention over the tokens
        return None

    def at(t: int) -> Read | None:
        q, k, v = probe.streams(B, t)
        allowed = probe.allowed(B, t, t)
        probe.passes += 1
        return traced(probe, (lambda: s.layer(**s._kwargs(q, k, v, allowed))) if s.call is None else
                      (lambda: s(q, k, v, allowed)), q)

    return heads_seen(s.layer, base.output.out, s.expected_out_shape(B, T), at)


def heads_seen(layer: nn.Module, out: Tensor, want: tuple, at) -> HeadsOut | None:
    """`out`, where `want` = (B, T, D) was expected, read as each head's output apart: the form `heads_layout` reads
    at T + 3 tokens (`at(length)`: a traced call, or None where it raises), which must be `out`'s at T (the head
    axis told apart where H = T; a width that follows the length, returned weights, is no head's); where the layer
    raises at T + 3 (one length only), the form `out` has at T. With the nn.Linear modules that call left unread."""
    B, T, width = want
    if out.dim() != 4 or out.shape[0] != B or T not in out.shape[1:3] or out[0].numel() != T * width:
        return None  # no form of T rows of the width split into heads: no call made
    other = T + 3
    got = at(other)
    if got is None:
        other, got = T, at(T)
    seen = None if got is None else heads_layout(got.out, B, other, width)
    if seen is None or tuple(out.shape) != _form(seen, B, T, width):
        return None
    left = tuple((path, _spelled(layer, path)) for path, m in layer.named_modules()
                 if path and isinstance(m, nn.Linear) and m.in_features == width == m.out_features
                 and f"{path}.weight" not in got.read and not INPUT_ROLE.search(path.rsplit(".", 1)[-1]))
    return HeadsOut(*seen, left=left, indexed=got.indexed)


def _form(seen: tuple[str, int], batch: int, length: int, width: int) -> tuple:
    layout, heads = seen
    return (batch, length, heads, width // heads) if layout == "bthd" else (batch, heads, length, width // heads)


def merged_call(probe: Probe, heads: HeadsOut, undeclared: str | None = None) -> str | None:
    """The declaration under which the audit calls the layer as it does now and merges (and projects) the heads as
    the caller does: the call, with `cross=True` for a memory and the mask convention the audit read (or
    `undeclared`, the declaration of the one `mask_honoured` would name once the heads are merged, where the audit
    read none), the arguments a library requires given None as the audit gives them; None where the audit's call
    cannot be written as one (a call of the user's, position embeddings the audit builds) or which projection to
    apply cannot be told."""
    s = probe.subject
    if s.call is not None or s.extra is not None or heads.left and not heads.projection:
        return None
    streams = {"self_module": ("x",), "cross_module": ("x", "memory"), "qkv_module": ("query", "key", "value")}[s.form]
    names = {"self_module": (s.sig.query,), "cross_module": (s.sig.query, s.sig.memory),
             "qkv_module": (s.sig.query, s.sig.key, s.sig.value)}[s.form]
    given = [x if n == s.sig.first and i == 0 else f"{n}={x}" for i, (n, x) in enumerate(zip(names, streams))]
    given += [f"{m}=mask" for m in s.mask_names] + [f"{n}=None" for n in s.sig.fixed if n not in names]
    params = ", ".join(["layer", *streams, *(["mask"] if s.mask_names else [])])
    declare = [spell("cross", True, probe.options)] if s.form == "cross_module" else []
    if s.mask_names and str(s.mask_convention) != str(SHORTCUTS["allowed"]):  # under a call, the audit's default
        declare.append(spell("mask", str(s.mask_convention), probe.options))
    elif s.mask_names and undeclared:  # one declaration measures the layer, not two in turn
        declare.append(undeclared)
    return ", ".join([*declare, call_declaration(params, heads.merged(f"layer({', '.join(given)})"), probe.options)])


def _spelled(layer: nn.Module, path: str) -> str:
    """How a call reaches the submodule at `path`: `layer.to_out[0]` (attributes; a list's or a sequence's index;
    a dict's key), else `layer.get_submodule('path')` (a name Python cannot write as an attribute)."""
    spelled, module = "layer", layer
    for part in path.split("."):
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and part.isdigit():
            spelled += f"[{part}]"
        elif isinstance(module, nn.ModuleDict):
            spelled += f"[{part!r}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            spelled += f".{part}"
        else:
            return f"layer.get_submodule({path!r})"
        module = module.get_submodule(part)
    return spelled
