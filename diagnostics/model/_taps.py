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
    """Forward hooks on the attention modules: each call's first output tensor, batch-first, with its round (the
    module's how-manieth call within one forward of `model`: a looped model, HRM's or Dory's, calls a layer once per
    cycle; a shared layer, once per place) and the calls of the first forward in the order they returned
    (`sequence`). Without `model`, every call is round 0."""

    def __init__(self, modules: dict, time_dims: dict, model: nn.Module | None = None):
        self.modules, self.time_dims, self.model = modules, time_dims, model
        self.outputs: dict = {p: [] for p in modules}
        self.rounds: dict = {p: [] for p in modules}
        self.handles = []
        self.finished: list[str] = []  # the order in which the modules first returned
        self.sequence: list[tuple[str, int]] = []  # (module, round) of the first forward's calls, in order
        self._calls: dict = {}  # {module: calls in the current forward}
        self._forwards = 0

    def _begin(self, *args):
        self._calls, self._forwards = {}, self._forwards + 1

    def __enter__(self):
        if self.model is not None:
            self.handles.append(self.model.register_forward_pre_hook(self._begin))
        for p, m in self.modules.items():
            def hook(m, args, out, p=p):
                t = first_tensor(out)
                if t is not None and t.dim() == 3:
                    r = self._calls.get(p, 0) if self.model is not None else 0
                    self._calls[p] = r + 1
                    self.outputs[p].append((t.transpose(0, 1) if self.time_dims.get(p) == 0 else t).detach())
                    self.rounds[p].append(r)
                    if self._forwards <= 1 and (p, r) not in self.sequence:
                        self.sequence.append((p, r))
                    if p not in self.finished:
                        self.finished.append(p)
            self.handles.append(m.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def extend(self, other: "LayerTap") -> None:
        """Another tap's calls as if this one had seen them (a prefill shared between decoding schedules)."""
        for p in self.outputs:
            self.outputs[p].extend(other.outputs.get(p, ()))
            self.rounds[p].extend(other.rounds.get(p, ()))
        self.sequence += [c for c in other.sequence if c not in self.sequence]
        self.finished += [p for p in other.finished if p not in self.finished]

    def joined(self, p: str, round: int | None = None) -> Tensor | None:
        """The module's outputs joined along the sequence (a prefill, then decoding steps); `round`: only its
        round-th call of each forward (a looped layer's first cycle)."""
        outs = [o for o, r in zip(self.outputs[p], self.rounds[p]) if round is None or r == round]
        if not outs:
            return None
        try:
            return torch.cat(outs, dim=1)
        except RuntimeError:
            return None

    def calls(self) -> list[tuple[str, int | None]]:
        """(module, round) in the order the first forward made them: where a change first shows. Without a model
        to count rounds by, each module once in the order it first returned, all its calls joined."""
        return list(self.sequence) if self.model is not None else [(p, None) for p in self.finished]


def first_layer(order: list[str], taps_a: LayerTap, taps_b: LayerTap, select, tol: float, *, select_b=None):
    """The first attention layer (in call order: a looped layer's first cycle before the next layer's, its second
    after) whose outputs differ between two runs at the selected positions (`select_b` for the second run, if it
    differs), and {layer: number of positions that moved}."""
    first, counts = None, {}
    for p in order:  # each module's calls joined: how many positions moved
        a, b = taps_a.joined(p), taps_b.joined(p)
        if a is None or b is None:
            continue
        a, b = select(a), (select_b or select)(b)
        if a.shape != b.shape:
            continue
        counts[p] = int((moved(b, a) > tol).sum())
        if first is None and counts[p] > 0:
            first = p
    for p, r in taps_a.calls() if taps_a.model is not None else ():  # round by round, in the order of the calls
        a, b = taps_a.joined(p, r), taps_b.joined(p, r)
        if a is None or b is None or select(a).shape != (select_b or select)(b).shape:
            continue
        if bool((moved((select_b or select)(b), select(a)) > tol).any()):
            return p, counts
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
