"""A module whose output is each head's apart, (B, T, H, d) or (B, H, T, d), for its caller to merge and project:
the form an attention core returns (diffusers' Lumina processor, whose block merges the heads and applies the
layer's own `to_out`). Another convention, not a defect: `output_shape` names the call that merges the heads as
the caller does, `parameters_used` leaves the projection the layer never calls to that call, and `runs` writes the
merge into the call it names for a layer that needs a memory and a mask given (`runs._stream_and_mask`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import Tensor, nn

from .._probe import Probe
from .._masks import SHORTCUTS
from .._subject import call_declaration, spell


@dataclass(frozen=True)
class HeadsOut:
    """What was seen of a per-head output: its `layout` ("bthd" or "bhtd"), its `heads`, and `left`, the paths of
    the layer's nn.Linear modules from the heads' merged width to the queries' width that the call never reached.
    One of them is the caller's output projection (`projection`, "to_out.0"); several cannot be told apart."""

    layout: str
    heads: int
    left: tuple[str, ...] = ()

    @property
    def projection(self) -> str | None:
        return self.left[0] if len(self.left) == 1 else None

    def merged(self, body: str) -> str:
        """The expression that merges the heads of `body`'s output as its caller does, and projects them with the
        layer's projection that the layer leaves to its caller."""
        merged = f"{body}.flatten(2)" if self.layout == "bthd" else f"{body}.transpose(1, 2).flatten(2)"
        return f"{_attribute('layer', self.projection)}({merged})" if self.projection else merged

    def describe(self, shape: tuple) -> str:
        """`shape` in words: whose axes they are and what is done with them outside the layer."""
        axes = "(B, T, H, d)" if self.layout == "bthd" else "(B, H, T, d)"
        head = f"{shape}: each of its {self.heads} heads' output apart, {axes}, for its caller to merge"
        if self.projection:
            return f"{head} and project with `{self.projection}`, which the layer never calls"
        if self.left:
            return (f"{head}; {len(self.left)} projections to the output's width are never called "
                    f"({', '.join(f'`{p}`' for p in self.left)}), and which one the caller applies cannot be told")
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


@contextlib.contextmanager
def uncalled(layer: nn.Module, width: int):
    """Yields a list that holds, after the block, the paths of the layer's nn.Linear modules from `width` to
    `width` features that no call inside the block reached (forward pre-hooks, removed after)."""
    found = [path for path, m in layer.named_modules()
             if path and isinstance(m, nn.Linear) and m.in_features == width and m.out_features == width]
    called: set[str] = set()
    handles = [layer.get_submodule(path).register_forward_pre_hook(lambda *_, p=path: called.add(p))
               for path in found]
    left: list[str] = []
    try:
        yield left
    finally:
        for h in handles:
            h.remove()
    left.extend(path for path in found if path not in called)


def heads_out_seen(probe: Probe) -> HeadsOut | None:
    """The per-head output of a module given a stream (or a memory too), at the standard probe, with attention over
    the tokens observed; None otherwise (a layer of the right shape costs nothing; one of another shape, one call
    more, which finds the projections it never calls)."""
    if "heads_out_seen" not in probe.memo:
        probe.memo["heads_out_seen"] = _heads_out_seen(probe)
    return probe.memo["heads_out_seen"]


def _heads_out_seen(probe: Probe) -> HeadsOut | None:
    s, B, T = probe.subject, probe.BATCH, probe.t
    base = probe.base()
    if s.form not in ("self_module", "cross_module", "qkv_module") or not base.ok \
            or probe.observed_over(base, T, T) is None:  # a tensor of that shape, but no attention over the tokens
        return None

    def again():
        call = probe.call(base.query, base.key, base.value, base.allowed,
                          label="the standard probe again, the projections it calls recorded")
        return call.output.out if call.ok else None

    return heads_seen(s.layer, base.output.out, s.expected_out_shape(B, T), again)


def heads_seen(layer: nn.Module, out: Tensor, want: tuple, again) -> HeadsOut | None:
    """`out`, where `want` = (B, T, D) was expected, read as each head's output apart (`heads_layout`), with the
    nn.Linear modules of `layer` that `again()` (the same call once more: its output, or None) leaves unreached;
    None where it is not that form, or the call again gives another."""
    seen = heads_layout(out, *want)
    if seen is None:
        return None
    with uncalled(layer, want[-1]) as left:
        out = again()
    if out is None or heads_layout(out, *want) != seen:
        return None
    return HeadsOut(*seen, left=tuple(left))


def merged_call(probe: Probe, heads: HeadsOut) -> str | None:
    """The declaration under which the audit calls the layer as it does now and merges (and projects) the heads as
    the caller does: the call, with `cross=True` for a memory and the mask convention the audit read, the arguments
    a library requires given None as the audit gives them; None where the audit's call cannot be written as one (a
    call of the user's, position embeddings the audit builds) or which projection to apply cannot be told."""
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
    return ", ".join([*declare, call_declaration(params, heads.merged(f"layer({', '.join(given)})"), probe.options)])


def _attribute(owner: str, path: str) -> str:
    """`owner.to_out[0]` for the path "to_out.0": attributes, and indices where a container's are digits."""
    spelled = owner
    for part in path.split("."):
        spelled += f"[{part}]" if part.isdigit() else f".{part}" if part.isidentifier() else f".get_submodule({part!r})"
    return spelled
