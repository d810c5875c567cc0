"""Shared test set-up: Hypothesis profiles and the one `device` fixture that CUDA runs go through.

Profiles: `default` (fast, for every run), `thorough` (deep: `pytest --hypothesis-profile=thorough`), and
`explore` (6x the default's examples, never derandomized, no example database: `.ci/run` runs it with a
`--hypothesis-seed` read from the commit, so each commit draws other inputs and any failure replays from the
seed it prints). Under CI (the CI environment variable set) the default profile is derandomized so runs are
reproducible.

Tests marked `slow` (the full declared-pattern matrix, tests/test_pattern_matrix.py) skip, visibly and with the
reason, unless pytest runs with `--slow` or selects them with `-m slow`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

try:  # every test but the structural ones (tests/test_architecture.py, which read the source) needs torch
    import torch
except ImportError:
    torch = None

_COMMON = dict(
    deadline=None,
    # `device` is a parameter, not state: reusing it across examples is safe.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
# default: 10 examples per property keeps the whole run near a minute on 2 cores (20 cost about 12 s more in one
# run); CI's explore step draws 60 others per commit, and `thorough` 400
settings.register_profile("default", max_examples=10, derandomize=bool(os.environ.get("CI")), **_COMMON)
settings.register_profile("thorough", max_examples=400, **_COMMON)
settings.register_profile("explore", max_examples=60, derandomize=False, database=None, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# A probe whose perturbation did not change what it claims is a bug in diagnostics: in this project's own
# tests it raises (for users it is a visible skip). Set before diagnostics is imported.
os.environ.setdefault("ATTENTION_AUDIT_STRICT_PROBES", "1")

# The suite's tensors are tiny: intra-op threads only add hand-off cost (a 2x2x4x4 softmax took 320 us with two
# threads on a busy 2-core machine, 2.6 us with one), so the tests run torch single-threaded.
if torch is not None:
    torch.set_num_threads(1)

SLOW_REASON = "slow: run with --slow (CI runs them in its slow step)"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (the full declared-pattern matrix)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or "slow" in (config.getoption("markexpr") or ""):
        return  # asked for: `-m slow` selects them, `-m "not slow"` deselects them before they could skip
    skip = pytest.mark.skip(reason=SLOW_REASON)
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


DEVICES = ["cpu", "cuda"]


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device-aware test runs once per device; CUDA skips with a reason where no GPU is present."""
    if torch is None:
        pytest.skip("torch is not installed: pip install torch==2.13.0")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available: no GPU on this machine (torch.cuda.is_available() is False)")
    return torch.device(request.param)
