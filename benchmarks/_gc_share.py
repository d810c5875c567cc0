"""A pytest plugin for `suite_time.py --gc`: each process that loads it appends one line to the file named by
ATTENTION_GC_SHARE: its role, the cycle collector's collections and seconds (timed by `gc.callbacks`), its CPU
seconds and its peak resident memory."""

from __future__ import annotations

import gc
import os
import resource
import time

_started: list[float] = []
_spent = [0.0, 0]  # seconds, collections


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        _spent[0] += time.perf_counter() - _started.pop()
        _spent[1] += 1


gc.callbacks.append(_timed)


def pytest_unconfigure(config):
    role = config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"
    cpu = time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open(os.environ["ATTENTION_GC_SHARE"], "a") as out:
        out.write(f"{role} {_spent[1]} {_spent[0]:.3f} {cpu:.2f} {peak:.0f}\n")
