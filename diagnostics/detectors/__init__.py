"""The layer detectors, one module per property family: each holds its probe, its verdict, its message and
fix, and its localiser, registered together with `@detector(..., needs=..., locate=...)`.

`MODULES` is the package's list of modules: importing this package imports them in that order, which is the
order the detectors run and are reported in. A new detector is a new module here and its name in `MODULES`.
A module may import an earlier one's public helpers (masking reads finite's localiser), never a later one's.
"""

from importlib import import_module

from .._registry import DETECTORS

MODULES = ("runs", "shape", "finite", "weights", "temperature", "variance", "locality", "masking", "causal",
           "determinism", "batch", "keys", "decoding", "gradients", "parameters", "positions",
           "pattern", "own_weights")

for _name in MODULES:
    import_module(f"{__name__}.{_name}")

__all__ = ["DETECTORS", "MODULES"]
