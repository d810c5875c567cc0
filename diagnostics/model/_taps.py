"""Watching the attention layers during a model forward: each layer's outputs (`LayerTap`), the blocks that hold
them, and the first layer (in call order) whose outputs moved between two runs: where a model-level finding is
localised.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._core import relative_change
from ._runner import first_tensor
from ._tolerance import scale_of

NO_POSITIONS = ("not applicable: the model's output {shape} has no sequence dimension (one output per position "
                "is what this check compares)")


def per_position(out: Tensor, T: int) -> bool:
    """Whether the model's output has one entry per position (B, T, ...)."""
    return out.dim() >= 2 and out.shape[1] == T


def moved(new: Tensor, old: Tensor) -> Tensor:
    """(B, T): each position's change against `old`, relative to the outputs' RMS (`_core.relative_change`)."""
    return relative_change(new, old, scale=scale_of(old))


class LayerTap:
    """Forward hooks on the attention modules: each call's first output tensor, batch-first."""

    def __init__(self, modules: dict, time_dims: dict):
        self.modules, self.time_dims = modules, time_dims
        self.outputs: dict = {p: [] for p in modules}
        self.handles = []
        self.finished: list[str] = []  # the order in which the modules first returned

    def __enter__(self):
        for p, m in self.modules.items():
            def hook(m, args, out, p=p):
                t = first_tensor(out)
                if t is not None and t.dim() == 3:
                    self.outputs[p].append((t.transpose(0, 1) if self.time_dims.get(p) == 0 else t).detach())
                    if p not in self.finished:
                        self.finished.append(p)
            self.handles.append(m.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def joined(self, p: str) -> Tensor | None:
        outs = self.outputs[p]
        if not outs:
            return None
        try:
            return torch.cat(outs, dim=1)  # a prefill, then decoding steps, joined along the sequence
        except RuntimeError:
            return None


def first_layer(order: list[str], taps_a: LayerTap, taps_b: LayerTap, select, tol: float, *, select_b=None):
    """The first attention layer (in call order) whose outputs differ between two runs at the selected
    positions (`select_b` for the second run, if it differs), and {layer: number of positions that moved}."""
    first, counts = None, {}
    for p in order:
        a, b = taps_a.joined(p), taps_b.joined(p)
        if a is None or b is None:
            continue
        a, b = select(a), (select_b or select)(b)
        if a.shape != b.shape:
            continue
        counts[p] = int((moved(b, a) > tol).sum())
        if first is None and counts[p] > 0:
            first = p
    return first, counts


class Tagged:
    """A block and the attention modules inside it; LayerTap hooks `.register_forward_hook` of the block."""

    def __init__(self, module: nn.Module, attention: list):
        self.module, self.attention = module, attention

    def register_forward_hook(self, hook):
        return self.module.register_forward_hook(hook)


def blocks(model: nn.Module, modules: dict) -> dict:
    """{path: Tagged block} for the blocks that hold the attention modules: the deepest ancestor of each that
    is an item of an nn.ModuleList or nn.Sequential (`h.1` for `h.1.attn`). Each has `.attention`, the paths
    of the attention modules inside it."""
    named = dict(model.named_modules())
    found: dict = {}
    for p in modules:
        parts = p.split(".")
        for n in range(len(parts) - 1, 0, -1):
            parent, path = ".".join(parts[:n - 1]), ".".join(parts[:n])
            holder = named.get(parent) if parent else model
            if isinstance(holder, (nn.ModuleList, nn.Sequential)) and path in named and path not in modules:
                found.setdefault(path, []).append(p)
                break
    return {path: Tagged(named[path], inside) for path, inside in found.items()}


__all__ = ["NO_POSITIONS", "LayerTap", "Tagged", "blocks", "first_layer", "moved", "per_position"]
