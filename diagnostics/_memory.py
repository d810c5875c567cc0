"""The audit's peak memory, estimated from the shapes before it runs, and the guard that refuses an audit that would
not fit (`audit(fn, seq_len=100000)` once grew to 20 GB and was killed).

What grows with the length is the attention weights: one (B, H, T, T) map per call at the probe batch B = 2, and a
few calls' worth alive at once (the observer keeps the softmax it read, the perturbed and baseline passes are
compared side by side, layers that compute in float64 inside double theirs). So the estimate is

    peak ~= WEIGHT_MAPS x B x H x T^2 x itemsize(dtype) + BASE

Measured (`python benchmarks/audit_memory.py --lengths 256 512 1024`: peak RSS of one audit over the RSS before
it, in a fresh process, one thread, causal, float32, CPU; 2026-12-03, two runs): at T = 256 / 512 / 1024, in maps, a
hand-written function (d_model 16, 2 heads) 13-17 / 24-25 / 13-16, torch's SDPA in a function 9-10 / 9-14 / 10-11,
the reference `MultiHeadAttention(64, 4)`, which accumulates in float64, 29-33 / 27 / 24-25. With WEIGHT_MAPS = 32
and BASE = 64 MiB the estimate is 1.40x the largest peak at 1024 (the reference's 779 MiB), 1.49x at 512, and up to
10x a light layer at small T (a guard that lets an audit run out of memory is worse than one that asks to confirm a
large one with ATTENTION_AUDIT_MEMORY). Not measured: a declared pattern (its probe stacks up to 9 copies of the
batch in one call) and GPUs.

The limit is the memory available: MemAvailable in /proc/meminfo on the CPU (where that file exists), the free
memory of the device on CUDA, or ATTENTION_AUDIT_MEMORY (e.g. `8G`, `500M`, bytes) when set, which also replaces them.
"""

from __future__ import annotations

import math
import os
import re

import torch

from ._errors import AuditUsageError
from ._probe import Probe
from ._subject import spell

WEIGHT_MAPS = 32  # (B, H, T, T) maps alive at the peak: above every measured figure at T >= 512 (26.7 the most)
BASE = 64 * 2 ** 20  # what does not grow with T^2 (projections, allocator slack): the reference at T = 256 took 33 maps
ENV = "ATTENTION_AUDIT_MEMORY"
UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def estimate(*, seq_len: int, num_heads: int, dtype: torch.dtype) -> int:
    """The audit's peak memory in bytes, from the shapes alone (see the module docstring for the measurements)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return WEIGHT_MAPS * Probe.BATCH * num_heads * seq_len ** 2 * itemsize + BASE


def longest_that_fits(limit: int, *, num_heads: int, dtype: torch.dtype) -> int:
    """The largest seq_len whose estimate is within `limit` bytes (at least 1)."""
    per_position = estimate(seq_len=1, num_heads=num_heads, dtype=dtype) - BASE  # bytes per T^2
    length = max(1, math.isqrt(max(limit - BASE, 0) // per_position))
    while length > 1 and estimate(seq_len=length, num_heads=num_heads, dtype=dtype) > limit:
        length -= 1
    return length


def parse_size(text: str) -> int:
    """`8G`, `500M`, `1.5G`, `123456` (bytes) -> bytes; an `AuditUsageError` for anything else."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.I)
    if found is None:
        raise AuditUsageError(f"expected {ENV} to be a size such as 8G, 500M or a number of bytes; got {text!r}. "
                              f"Fix: e.g. {ENV}=8G")
    return int(float(found.group(1)) * UNITS[found.group(2).upper()])


def available(device: torch.device) -> tuple[int, str] | None:
    """(bytes, where that figure comes from) that an audit may use, or None where nothing says."""
    capped = os.environ.get(ENV)
    if capped:
        return parse_size(capped), f"{ENV}={capped}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device}"
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read(), re.M)
    except OSError:
        return None
    return (int(found.group(1)) * 1024, "MemAvailable in /proc/meminfo") if found else None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TB"


def check_memory(subject, seq_len: int, *, options: dict | None = None) -> None:
    """Refuse, before anything runs, an audit whose estimated peak memory exceeds what is available: the estimate,
    the limit and where it comes from, and the largest seq_len that fits."""
    limit = available(torch.device(subject.device))
    if limit is None:
        return
    need = estimate(seq_len=seq_len, num_heads=subject.num_heads, dtype=subject.dtype)
    if need <= limit[0]:
        return
    fits = longest_that_fits(limit[0], num_heads=subject.num_heads, dtype=subject.dtype)
    shorter = (f"{spell('seq_len', fits, options)} or less, or " if fits > 1 or estimate(
        seq_len=1, num_heads=subject.num_heads, dtype=subject.dtype) <= limit[0] else "free memory, or ")
    raise AuditUsageError(
        f"expected an audit that fits in memory ({limit[1]}: {_size(limit[0])}); got "
        f"{spell('seq_len', seq_len, options)}, estimated at {_size(need)} ({WEIGHT_MAPS} attention maps of "
        f"{Probe.BATCH} x {subject.num_heads} heads x {seq_len}^2 {str(subject.dtype).removeprefix('torch.')}). "
        f"Fix: {shorter}set {ENV} (e.g. {ENV}=64G) if the estimate is too cautious for your layer")


__all__ = ["BASE", "ENV", "WEIGHT_MAPS", "available", "check_memory", "estimate", "longest_that_fits",
           "parse_size"]
