"""What a catalog entry is: the broken layer, the lesson, and when the bug can be seen at all."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from correct import MultiHeadAttention, causal_mask, mask_from_mod


@dataclass(frozen=True)
class Setting:
    """One call of a layer, as far as observability depends on it.

    `mask` is the mask passed to `forward` (bool, True = may attend, broadcastable to (B, H, Tq, Tk)) or None;
    `self_attention` says whether query, key and value are one tensor; `batch` how many sequences the call
    has; `backward` whether gradients were taken (a bug that only changes gradients shows nowhere else);
    `pattern` the layer's own pattern, a mask_mod(b, h, q_idx, kv_idx) over absolute positions (the queries the
    last Tq of the Tk), or None (see `promised_pattern`).
    """

    d_model: int
    num_heads: int
    t_q: int
    t_k: int
    mask: Tensor | None = None
    self_attention: bool = True
    causal: bool = False
    dropout: float = 0.0
    training: bool = False
    batch: int = 1  # sequences in the call (a bug that mixes them needs two)
    backward: bool = False  # the call's gradients are compared too, not only its output
    pattern: Callable | None = None  # the layer's own mask_mod (a window, chunks, a prefix, documents)

    @property
    def d_k(self) -> int:
        return self.d_model // self.num_heads

    def allowed(self, *, align: str | None = "bottom_right", user_mask: bool = True,
                pattern: Callable | None = None) -> Tensor:
        """Boolean (..., Tq, Tk): which keys each query may attend, from the causal mask (if the layer is
        causal and `align` is given), the layer's own pattern (`pattern` in its place if given) and the user's
        mask (if `user_mask`)."""
        allowed = torch.ones(self.t_q, self.t_k, dtype=torch.bool)
        if self.causal and align is not None:
            allowed = allowed & causal_mask(self.t_q, self.t_k, align=align)
        pattern = self.pattern if pattern is None else pattern
        if pattern is not None:
            allowed = allowed & mask_from_mod(pattern, self.t_q, self.t_k, batch=self.batch)  # (B, 1, Tq, Tk)
        if user_mask and self.mask is not None:
            allowed = allowed & self.mask.to("cpu")
        return allowed

    @property
    def has_fully_masked_row(self) -> bool:
        return bool((~self.allowed().any(dim=-1)).any())

    @property
    def has_choice(self) -> bool:
        """Some query may attend two or more keys; with one key per row the softmax is 1 whatever the logits."""
        return bool((self.allowed().sum(dim=-1) >= 2).any())

    @property
    def attends_anything(self) -> bool:
        return bool(self.allowed().any())

    @property
    def has_partly_masked_row(self) -> bool:
        allowed = self.allowed()
        return bool((allowed.any(dim=-1) & ~allowed.all(dim=-1)).any())


def promised_pattern(layer: MultiHeadAttention) -> Callable | None:
    """The pattern the layer's configuration promises (its window, chunk, prefix, documents) as the reference builds
    it, a mask_mod over absolute positions; None when it has none. A variant's own steps are not consulted: they may
    be the bug. One reference per configuration: the tests ask for every row of every call they record."""
    documents = layer.documents
    config = (layer.sliding_window, layer.attention_chunk_size, layer.prefix,
              None if documents is None else (tuple(documents.shape), tuple(documents.flatten().tolist())))
    if all(part is None for part in config):
        return None  # no pattern of its own: the causal flag says it all
    return _reference_pattern(config)


@functools.lru_cache(maxsize=64)
def _reference_pattern(config: tuple) -> Callable:
    window, chunk, prefix, documents = config
    ids = None if documents is None else torch.tensor(documents[1]).view(documents[0])
    return MultiHeadAttention(1, 1, sliding_window=window, attention_chunk_size=chunk, prefix=prefix,
                              documents=ids).pattern


@dataclass(frozen=True)
class Observable:
    """When a bug shows at all: a sentence for people and the same condition as a predicate for tests."""

    text: str
    holds: Callable[[Setting], bool]

    def __call__(self, setting: Setting) -> bool:
        return bool(self.holds(setting))

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Variant:
    """A registry entry, like a linter rule: what is wrong, why it is silent, what to write instead."""

    id: str
    title: str
    cls: type[MultiHeadAttention]
    step: str  # the one method of MultiHeadAttention that the variant overrides
    explanation: str
    symptom: str
    fix: str
    detectable_when: Observable
    expected_detectors: tuple[str, ...] = ()  # fire wherever `detectable_when` holds
    # Fire too in the kill matrix (d_model=32, 4 heads, seq_len 16), but not at every observable
    # configuration: e.g. dropout may happen to keep every weight of a tiny probe.
    also_detected_by: tuple[str, ...] = ()
    # Fire at some other observable sizes, not in the kill matrix: e.g. with Tk = 2 a causal mask that blocks
    # the diagonal leaves one key per query, and the output stops depending on the keys at all.
    detected_at_other_sizes_by: tuple[str, ...] = ()
    # The audit's outcome: "fail" (report.passed is False) or "warn" (it passes with a warning: NaN on a row
    # with no key to attend, which correct layers such as nn.MultiheadAttention also give).
    expected_severity: str = "fail"
    layer_kwargs: dict = field(default_factory=dict)  # e.g. causal=True for the decoder bugs
    # The attention pattern the layer promises (a diagnostics.patterns pattern), which the audit is told with
    # `pattern=`; None: the causal flag says it all.
    pattern: object = None

    def audit_kwargs(self, layer: MultiHeadAttention) -> dict:
        """How the variant (and its reference twin) is audited: as it promises, causal layers with causal=True and
        a layer with a pattern of its own with `pattern=` that pattern."""
        return {"causal": layer.causal} | ({} if self.pattern is None else {"pattern": self.pattern})

    def build(self, d_model: int, num_heads: int, **kw) -> MultiHeadAttention:
        """The broken layer, configured like `reference(d_model, num_heads, **kw)`."""
        return self.cls(d_model, num_heads, **{**self.layer_kwargs, **kw})

    def reference(self, d_model: int, num_heads: int, **kw) -> MultiHeadAttention:
        """The correct layer with the same configuration (load the variant's state_dict to share weights)."""
        return MultiHeadAttention(d_model, num_heads, **{**self.layer_kwargs, **kw})
