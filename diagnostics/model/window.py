"""sliding_window: each attention layer keeps the pattern it declares, a sliding window or a chunk, read from the
layer or its config (`declared_pattern`), in place: with the hidden state changed at one position s only, the
outputs the pattern blocks for key s must not move, and the farthest output it allows must.

Where a layer declares its pattern, first match wins:
- a `diagnostics.patterns.Pattern` (or a bare `mask_mod(b, h, q_idx, kv_idx)`) the module carries as
  `attention_pattern` (a layer of one's own);
- its config's `layer_types[layer_idx]` (Gemma 2/3, Qwen2, Llama 4, ...): "sliding_attention" is
  `sliding_window(config.sliding_window)`, "chunked_attention" `chunked(config.attention_chunk_size)`, any other
  type (full attention) none;
- its own `sliding_window` attribute (None there: a full-attention layer, as in Gemma 2's alternating layers);
- its config's `sliding_window` (unless `use_sliding_window` is False, Qwen2's switch), else its
  `attention_chunk_size`.
A layer that says it is not causal (`is_causal = False`, as Hugging Face's encoder layers do: ModernBERT's
local layers) declares its window on both sides of the query, `two_sided_window(w)`: keys j with |i - j| <= w, as
transformers' own `sliding_window_bidirectional_overlay` builds it (masking_utils.py line 147). A config with
`use_bidirectional_attention` (Gemma 3's embedding variant, whose own overlay keeps |i - j| < w, one fewer) declares
no pattern read here: its layers are not checked.
Hugging Face counts `sliding_window` as we do, W keys including the query's own (`diagnostics.patterns`):
transformers 5.24 masking_utils.py line 97, `sliding_window_overlay`, keeps `kv_idx > q_idx - sliding_window`
under the causal mask, and modeling_flash_attention_utils.py line 692 passes flash-attention
`window_size=(sliding_window - 1, sliding_window - 1)`.

The probe columns: s = 0, and s = band - 1 (the last position of the first window or chunk, where a chunk
boundary one late leaks into the next chunk) where the sequence holds the rows after it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .._registry import Need, detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, tolerance
from ..patterns import Pattern, as_pattern, chunked, sliding_window
from ._context import SEQUENCE, ModelContext
from ._runner import device_dtype, first_tensor
from ._taps import moved

ID = "sliding_window"
FIX = ("build the layer's mask from its declared pattern: a window w allows keys j with i - w < j <= i (mask "
       "(i - j) >= w, not > w); a chunk of c allows j <= i with i // c == j // c")


@dataclass(frozen=True)
class Declared:
    """The pattern a layer declares, where it says so, and its span (the window w or chunk c)."""

    pattern: Pattern
    source: str
    band: int

    @property
    def kind(self) -> str:
        """"window", "chunk", or "" for a pattern of the layer's own."""
        name = self.pattern.name
        return "window" if name.startswith(("sliding_window(", "two_sided_window(")) else \
            "chunk" if name.startswith("chunked(") else ""

    @property
    def label(self) -> str:
        """"window 5", "chunk 4", or the pattern's name."""
        return self.pattern.name if self.pattern.name.startswith("two_sided") else \
            f"{self.kind} {self.band}" if self.kind else self.pattern.name


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def two_sided_window(w: int) -> Pattern:
    """w keys on each side of the query and its own: |q - kv| <= w (an encoder's local attention)."""
    return Pattern(lambda b, h, q, kv: (q - kv).abs() <= w, f"two_sided_window({w})", f"abs(q_idx - kv_idx) <= {w}")


def declared_pattern(module: nn.Module) -> Declared | None:
    """The window or chunk a layer declares (see the module docstring for where it is read), or None; a window of
    a layer that is not causal (`is_causal = False`) on both sides of the query."""
    declared = _declared(module)
    if declared is None or declared.kind != "window" or getattr(module, "is_causal", None) is not False:
        return declared
    w = declared.band
    return Declared(two_sided_window(w), f"{declared.source}, on both sides ({type(module).__name__}.is_causal = "
                                         f"False)", w + 1)


def _declared(module: nn.Module) -> Declared | None:
    own = getattr(module, "attention_pattern", None)
    if own is not None and callable(own):  # a Pattern, or a bare mask_mod(b, h, q_idx, kv_idx)
        own = as_pattern(own)
        try:
            band = _span(own)
        except Exception:  # the layer's own callable, not a mask_mod of index tensors: no pattern to read
            band = None
        return Declared(own, f"{type(module).__name__}.attention_pattern", band) if band else None
    config = getattr(module, "config", None)
    if getattr(config, "use_bidirectional_attention", False) is True:
        return None  # Gemma 3's embedding variant: a window on both sides of the query, not a causal pattern
    types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        kind, where = types[idx], f"config.layer_types[{idx}] = {types[idx]!r}"
        if kind == "sliding_attention" and _positive_int(getattr(config, "sliding_window", None)):
            w = config.sliding_window
            return Declared(sliding_window(w), f"{where}, config.sliding_window = {w}", w)
        if kind == "chunked_attention" and _positive_int(getattr(config, "attention_chunk_size", None)):
            c = config.attention_chunk_size
            return Declared(chunked(c), f"{where}, config.attention_chunk_size = {c}", c)
        return None
    if hasattr(module, "sliding_window"):
        w = _positive_int(module.sliding_window)
        if w:
            return Declared(sliding_window(w), f"{type(module).__name__}.sliding_window = {w}", w)
    c = _positive_int(getattr(module, "attention_chunk_size", None))
    if c:
        return Declared(chunked(c), f"{type(module).__name__}.attention_chunk_size = {c}", c)
    if hasattr(module, "sliding_window"):
        return None
    if config is None:
        return None
    w = _positive_int(getattr(config, "sliding_window", None))
    if w and getattr(config, "use_sliding_window", True) is not False:
        return Declared(sliding_window(w), f"config.sliding_window = {w}", w)
    c = _positive_int(getattr(config, "attention_chunk_size", None))
    return Declared(chunked(c), f"config.attention_chunk_size = {c}", c) if c else None


def _span(pattern: Pattern, T: int = 64) -> int | None:
    """The widest row of a causal pattern on T positions, if narrower than T (a window or chunk), else None."""
    allowed = pattern.allowed(1, T, T)[0]  # (Tq, Tk)
    if bool(allowed.triu(1).any()):
        return None
    lo = torch.where(allowed, torch.arange(T), T).amin(-1)
    span = int((torch.arange(T) - lo).clamp_min(0).max()) + 1
    return span if span < T else None


def declared_window(module: nn.Module) -> int | None:
    """The sliding window w a layer declares (None for a chunk, or no pattern)."""
    d = declared_pattern(module)
    return d.band if d is not None and d.kind == "window" else None


def _attends_memory(ctx: ModelContext, path: str) -> bool:
    """Whether the model called the layer with a memory its keys come from (its wrapper a cross-attention's)."""
    wrapper = ctx.wrappers.get(path)
    return wrapper is not None and not wrapper.is_self_attention()


def _own_pattern(module: nn.Module) -> Declared | None:
    """The pattern a layer carries itself (`attention_pattern`), read as `_declared` reads it."""
    declared = _declared(module) if getattr(module, "attention_pattern", None) is not None else None
    return declared if declared is not None and declared.source.endswith(".attention_pattern") else None


def patterns(ctx: ModelContext) -> dict:
    """{path: Declared} of the attention layers that declare a window or a chunk. A layer that attends a memory
    declares only a pattern of its own: the window or chunk of its config (or attribute) is its model's
    self-attention's, over the tokens' own positions, not over the memory's. BLT's local encoder config's
    sliding_window (512) read by its cross-attention, whose patches attend their own bytes under the model's mask, was
    measured as a two-sided window over the bytes and failed as over-masking."""
    found = ((p, _own_pattern(m) if _attends_memory(ctx, p) else declared_pattern(m)) for p, m in ctx.modules.items())
    return {p: d for p, d in found if d is not None}


DECLARES_WINDOW = Need("a layer that declares a sliding window or chunk", lambda c: bool(patterns(c)),
                       "no attention layer declares a sliding window or a chunk (an `attention_pattern`, "
                       "`sliding_window`, `attention_chunk_size` or `layer_types` on the layer or its config)")


@contextlib.contextmanager
def _eval(module: nn.Module):
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


def _column(wrapper, s: int, T: int, x, gen, tol, declared: Declared, path: str, ctx) -> tuple[str, str | None]:
    """Position s changed alone: (what was measured, the finding or None)."""
    device, dtype = x.device, x.dtype
    y = x.clone()
    y[:, s] = torch.randn(wrapper.d_model, generator=gen).to(device, dtype) * 1000
    with torch.no_grad(), _eval(wrapper):
        a, b = first_tensor(wrapper(x)), first_tensor(wrapper(y))
    ctx.layer_calls += 2
    change = moved(b, a)[0]  # (T,)
    allows = declared.pattern.allowed(1, T, T)[0, :, s]  # (Tq,): the outputs that may see key s
    name = declared.pattern.name
    leaked = (~allows & (change > tol)).nonzero().flatten()
    if len(leaked):
        t = int(leaked[0])
        return "", (f"{path} declares {name} ({declared.source}), yet changing position {s} moved the output at "
                    f"t={t} by {float(change[t]):.3g} of the RMS, which {name} blocks from key {s} "
                    f"({len(leaked)} such outputs; up to {tol:.0e} allowed): the pattern is wider than declared")
    first, edge = int(allows.nonzero().flatten().min()), int(allows.nonzero().flatten().max())
    if not float(change[edge]) > tol:
        return "", (f"{path} declares {name} ({declared.source}), yet changing position {s} did not move the output "
                    f"at t={edge} ({float(change[edge]):.3g}), the farthest {name} allows to see key {s}: the pattern "
                    f"is narrower than declared")
    return f"s={s}: t={first}..{edge} moved, the {int((~allows).sum())} others not", None


@detector(ID, "a layer that declares a sliding window w (or a chunk c) in itself or its config sees exactly its last w "
          "positions (its chunk)", fix=FIX, needs=(SEQUENCE, DECLARES_WINDOW), scope="model",
          unlocated="names the layer whose window is not the declared width (its `layer`); the window's mask is "
                    "not traced to a line")
def check_sliding_window(ctx: ModelContext) -> DetectorResult:
    checked, bad, exact = [], [], 0
    for p, declared in patterns(ctx).items():
        wrapper = ctx.wrappers.get(p)
        if wrapper is None:
            continue
        T, w = wrapper.block_size, declared.band
        if T < w + 1:
            checked.append(f"{p}: {declared.label}" + ("" if declared.kind else f" spans {w}")
                           + f" >= seq_len {T}, not measured")
            continue
        gen = torch.Generator().manual_seed(ctx.seed + 41)
        device, dtype = device_dtype(wrapper.inner)
        x = torch.randn(1, T, wrapper.d_model, generator=gen).to(device, dtype)
        tol = tolerance(UNCHANGED, dtype)
        readings, finding = [], None
        for s in sorted({0, w - 1}):
            if s > 0 and s + w >= T:  # no row past this column's window in the sequence
                continue
            try:
                reading, finding = _column(wrapper, s, T, x, gen, tol, declared, p, ctx)
            except Exception as exc:  # the layer raised on the probe: reported, the other layers still checked
                readings.append(f"raised {type(exc).__name__}")
                break
            if finding:
                break
            readings.append(reading)
        if finding:
            bad.append((p, finding))
        elif readings and not readings[-1].startswith("raised"):
            exact += 1
            checked.append(f"{p}: {declared.label} exact ({declared.source}; " + "; ".join(readings) + ")")
        else:
            checked.append(f"{p}: " + "; ".join(readings))
    if bad:
        return DetectorResult(ID, "fail", f"a layer's window or chunk is not the one it declares "
                                          f"({', '.join(p for p, _ in bad)})",
                              evidence="; ".join(t for _, t in bad), fix=FIX, layer=bad[0][0])
    if not exact:
        return DetectorResult(ID, "skip", "not measured: " + "; ".join(checked))
    return DetectorResult(ID, "pass", f"every declared window and chunk is exact ({exact} layers)",
                          evidence="; ".join(checked))
