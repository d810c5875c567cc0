"""sliding_window: a layer that declares a sliding window w sees exactly the last w positions. In place, per
layer that declares one (an attribute `sliding_window`, or its config's): with the hidden state changed at
position s only, outputs at t >= s + w must not move, and t = s + w - 1 must."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .._registry import Need, detector
from .._result import DetectorResult
from .._thresholds import UNCHANGED, tolerance
from ._context import SEQUENCE, ModelContext
from ._runner import device_dtype, first_tensor
from ._taps import moved

ID = "sliding_window"
FIX = "allow keys j with i - w < j <= i: mask (i - j) >= w, not > w"


def declared_window(module: nn.Module) -> int | None:
    """The sliding window a layer declares: its own `sliding_window` attribute where it has one (None there: a
    full-attention layer, as in Gemma 2's alternating layers), else its config's (unless `use_sliding_window`
    is False, Qwen2's switch)."""
    if hasattr(module, "sliding_window"):
        value = module.sliding_window
    else:
        config = getattr(module, "config", None)
        value = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            value = None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def windows(ctx: ModelContext) -> dict:
    """{path: w} of the attention layers that declare a sliding window."""
    return {p: w for p, w in ((p, declared_window(m)) for p, m in ctx.modules.items()) if w is not None}


DECLARES_WINDOW = Need("a layer that declares a sliding window", lambda c: bool(windows(c)),
                       "no attention layer declares a sliding window")


@contextlib.contextmanager
def _eval(module: nn.Module):
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


@detector(ID, "a layer that declares a sliding window w sees exactly the last w positions", fix=FIX,
          needs=(SEQUENCE, DECLARES_WINDOW), scope="model",
          unlocated="names the layer whose window is not the declared width (its `layer`); the window's mask is "
                    "not traced to a line")
def check_sliding_window(ctx: ModelContext) -> DetectorResult:
    checked, bad = [], []
    for p, w in windows(ctx).items():
        wrapper = ctx.wrappers.get(p)
        if wrapper is None:
            continue
        T = wrapper.block_size
        if T < w + 1:
            checked.append(f"{p}: window {w} >= seq_len {T}, not measured")
            continue
        s = 0
        gen = torch.Generator().manual_seed(ctx.seed + 41)
        device, dtype = device_dtype(wrapper.inner)
        x = torch.randn(1, T, wrapper.d_model, generator=gen).to(device, dtype)
        y = x.clone()
        y[:, s] = torch.randn(wrapper.d_model, generator=gen).to(device, dtype) * 1000
        try:
            with torch.no_grad(), _eval(wrapper):
                a, b = first_tensor(wrapper(x)), first_tensor(wrapper(y))
        except Exception as exc:  # the layer raised on the probe: reported, the other layers still checked
            checked.append(f"{p}: raised {type(exc).__name__}")
            continue
        ctx.layer_calls += 2
        change = moved(b, a)[0]  # (T,)
        tol = tolerance(UNCHANGED, dtype)
        outside = change[s + w:]
        edge = float(change[s + w - 1])
        if bool((outside > tol).any()):
            t = int((outside > tol).nonzero()[0]) + s + w
            bad.append((p, f"{p} declares sliding_window={w}, yet changing position {s} moved the output at t={t} "
                           f"by {float(outside.max()):.3g} of the RMS (t - s >= w must not move; up to {tol:.0e})"))
        elif not edge > tol:
            bad.append((p, f"{p} declares sliding_window={w}, yet changing position {s} did not move the output at "
                           f"t={s + w - 1} ({edge:.3g}): the window is narrower than declared"))
        else:
            checked.append(f"{p}: window {w} exact")
    if bad:
        return DetectorResult(ID, "fail", f"a sliding window is not the declared width ({', '.join(p for p, _ in bad)})",
                              evidence="; ".join(t for _, t in bad), fix=FIX, layer=bad[0][0])
    if not any("exact" in c for c in checked):
        return DetectorResult(ID, "skip", "not measured: " + "; ".join(checked))
    return DetectorResult(ID, "pass", f"every declared sliding window is exact ({len(checked)} layers)",
                          evidence="; ".join(checked))
