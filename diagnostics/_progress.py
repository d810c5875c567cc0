"""Progress shown by default for long audits: a tqdm-style line on stderr, only where stderr is a terminal and the
audit is estimated to take long (`audit(fn, seq_len=4096)` once ran 15 s in silence); nothing in a pipe, a log file,
pytest's captured output or a notebook, where a self-updating line would only be noise.

"Long" is read from the shapes before anything runs, with the memory guard's estimate (`_memory.estimate`): the
attention maps' bytes grow with the work. Measured (the wall time of `diagnostics.audit(layer, causal=True,
seq_len=T)`, one after another in one process, float32, CPU, 2026-12-03, load average ~10 on 2 cores): an SDPA
function (d_model 16, 2 heads) took 2.7 / 3.4 / 4.4 / 7.6 s at T = 128 / 256 / 512 / 1024 (maps of 8 / 32 / 128 /
512 MiB), the reference `MultiHeadAttention(64, 4)` 1.6 / 4.1 / 11.0 / 25.5 s (16 / 64 / 256 / 1024 MiB). From
LONG_MAPS = 32 MiB on, an audit took 3.4 s or more: there the bar is worth its line; below, the audit is done about
as soon as a bar would show.
"""

from __future__ import annotations

import sys
import time

import torch

from ._memory import BASE, estimate

LONG_MAPS = 32 * 2 ** 20  # bytes of attention maps from which an audit is long: >= 3.4 s measured (docstring)
WIDTH = 20  # the bar's cells


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes:02d}:{seconds:02d}"


class ProgressBar:
    """A line redrawn in place before each detector (a `progress` callable for `audit()`) and erased when the audit
    ends (a context manager): `auditing  45%|█████████           | 9/20 [00:04<00:05] future_leakage`."""

    def __init__(self, stream, label: str = "auditing"):
        self.stream, self.label, self.started = stream, label, time.perf_counter()
        utf8 = (getattr(stream, "encoding", None) or "").lower().replace("-", "") == "utf8"
        self.cell = "█" if utf8 else "#"  # a terminal that cannot encode the block gets ASCII, not an error

    def __call__(self, detector: str, index: int, total: int) -> None:
        elapsed = time.perf_counter() - self.started
        left = elapsed / index * (total - index) if index else None
        filled = WIDTH * index // max(total, 1)
        self.stream.write(f"\r\x1b[K{self.label} {100 * index // max(total, 1):3d}%|{self.cell * filled}"
                          f"{' ' * (WIDTH - filled)}| {index}/{total} [{_clock(elapsed)}<"
                          f"{_clock(left) if left is not None else '?'}] {detector}")
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.stream.write("\r\x1b[K")  # the line is gone: the report (or the traceback) starts clean
        self.stream.flush()


def is_long(*, seq_len: int, num_heads: int, dtype: torch.dtype) -> bool:
    """Whether an audit at these shapes is estimated to take long enough for a progress bar (LONG_MAPS)."""
    return estimate(seq_len=seq_len, num_heads=num_heads, dtype=dtype) - BASE >= LONG_MAPS


def default_progress(subject, seq_len: int) -> ProgressBar | None:
    """The bar `audit(progress=None)` shows: on stderr where it is a terminal and the audit is long, else None."""
    stream = sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()):
        return None
    return ProgressBar(stream) if is_long(seq_len=seq_len, num_heads=subject.num_heads, dtype=subject.dtype) else None


__all__ = ["LONG_MAPS", "ProgressBar", "default_progress", "is_long"]
