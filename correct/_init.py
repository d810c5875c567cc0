"""Initialisation at the scale people train at: GPT-2's (also nanoGPT's), std 0.02 for every weight matrix
and 0.02 / sqrt(2 * n_layers) for the projections that write into the residual stream, zero biases.

Outputs of a layer so initialised are ~1e-3 to 1e-2, not ~1: a tolerance that acts as an absolute number
passes bugs at this scale, which is why the suite tests detectors here as well as at torch's default init.
"""

from __future__ import annotations

import math

import torch
from torch import nn

RESIDUAL_PROJECTIONS = ("out", "out_proj", "c_proj", "o_proj", "proj", "dense")
"""Names of the output projections (the last component of a parameter's module path) given the smaller std."""


def gpt2_init_(module: nn.Module, *, n_layers: int = 12, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Re-initialise `module` in place like GPT-2, reproducibly from `seed`; returns it."""
    if n_layers < 1:
        raise ValueError(f"expected n_layers >= 1; got {n_layers}. Fix: pass the depth of the model, e.g. 12")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            owner = name.rsplit(".", 1)[0].rsplit(".", 1)[-1] if "." in name else ""
            if p.dim() >= 2:
                scale = std / math.sqrt(2 * n_layers) if owner in RESIDUAL_PROJECTIONS else std
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale)
            elif name.endswith("bias"):
                p.zero_()
    return module
