"""Shared test set-up: Hypothesis profiles and the one `device` fixture that CUDA runs go through.

Profiles: `default` (fast, for every run), `thorough` (deep: `pytest --hypothesis-profile=thorough`), and
`explore` (6x the default's examples, never derandomized, no example database: `.ci/run` runs it with a
`--hypothesis-seed` read from the commit, so each commit draws other inputs and any failure replays from the
seed it prints). Under CI (the CI environment variable set) the default profile is derandomized so runs are
reproducible.

Tests marked `slow` skip, visibly and with the reason, unless pytest runs with `--slow` or selects them with
`-m slow` (CI's slow step): the full declared-pattern matrix (tests/test_pattern_matrix.py), four of the kill
matrix's six dtype x initialisation settings, the whole audit of a FlexAttention program on torch's compiling path
(tests/test_patterns.py), the importlib run of tests/test_setup.py, the fresh processes of
tests/test_cold_start.py, the teaching report written under pytest-xdist, the one-process rule below, the
controller's light start with the catalog's readers on one worker, the cycle collector's settings given back to a
caller of pytest.main() and the wheel's contents (tests/test_setup.py), examples/ run as a user runs them
(tests/test_new_user.py), the sharded audit's full matrix (tests/test_sharded.py: every correct sharded form at 2 and
4 ranks, causal and not, float32 and float64, Ctrl-C, the command line, torch's DTensor plans; about 2 minutes of
forked groups), the sharded chapter's rows of the kill matrix (tests/test_kill_matrix.py: every broken sharded variant
beside its twin at 2 and 4 ranks, and the chapter drawn from their audits; 22 audits, 30-50 s), and a fixed sample of transformers' model types through the zoo sweep,
benchmarks/sweep.py, and a sample of timm's models through it (tests/test_sweep.py: the first 57 s on a quiet
machine, 4 minutes under load; timm's 71 s under load), and two model audits of a tiny Llama, with its key/value
heads repeated in the wrong order and without (tests/test_own_weights.py, with the real extra).

The suite runs a worker per core (pytest-xdist, `--numprocesses=auto --dist=loadscope` in pyproject's addopts;
`-n 0` for one process). A command line that names test files or tests runs in one process (it starts in half
the time), unless it asks for workers (`-n auto`). Without pytest-xdist, or with `-p no:xdist`, the suite runs in
one process. The header says which. xdist's controller runs no test: it imports neither torch nor Hypothesis (unless
a `--hypothesis-*` option or `-v` asks), so the workers start 2-3 s sooner; tests/conftest.py keeps the test
modules that read the catalog's session audits on one worker.
"""

from __future__ import annotations

import gc
import os

import pytest

# A probe whose perturbation did not change what it claims is a bug in diagnostics: in this project's own
# tests it raises (for users it is a visible skip). Set before diagnostics is imported.
os.environ.setdefault("ATTENTION_AUDIT_STRICT_PROBES", "1")


def _load_profiles() -> None:
    """Register the Hypothesis profiles and load the one asked for (HYPOTHESIS_PROFILE, else `default`); pytest's
    `--hypothesis-profile` then picks among them."""
    from hypothesis import HealthCheck, settings

    common = dict(
        deadline=None,
        # `device` is a parameter, not state: reusing it across examples is safe.
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )
    # default: 10 examples per property keeps the whole run near a minute on 2 cores (20 cost about 12 s more in
    # one run); CI's explore step draws 60 others per commit, and `thorough` 400
    settings.register_profile("default", max_examples=10, derandomize=bool(os.environ.get("CI")), **common)
    settings.register_profile("thorough", max_examples=400, **common)
    settings.register_profile("explore", max_examples=60, derandomize=False, database=None, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _single_threaded_torch() -> None:
    """The suite's tensors are tiny: intra-op threads only add hand-off cost (a 2x2x4x4 softmax took 320 us with
    two threads on a busy 2-core machine, 2.6 us with one), so the tests run torch single-threaded. Every test but
    the structural ones (tests/test_architecture.py, which read the source) needs torch; without it they skip."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def _distributes(config) -> bool:
    """This process is pytest-xdist's controller: it hands the tests to its workers and runs none itself, so it needs
    neither torch nor the catalog (2-3 s of its start-up, before the first worker starts), unless it writes the
    teaching report (`--html`: it audits the catalog itself, single-threaded like the workers)."""
    return (not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
            and bool(config.getoption("tx", None)) and not config.getoption("collectonly"))


def _asks_hypothesis(config) -> bool:
    """A `--hypothesis-*` option is on the command line, or `-v`: Hypothesis's own plugin then loads a profile, or
    names the one loaded in the header, in the controller too."""
    return config.option.verbose >= 1 or any(value not in (None, False) for name, value in vars(config.option).items()
                                             if name.startswith("hypothesis_"))


SLOW_REASON = "slow: run with --slow (CI runs them in its slow step)"


def pytest_addoption(parser, pluginmanager):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (the full declared-pattern matrix and more: conftest.py)")
    if not pluginmanager.has_plugin("xdist"):
        # pyproject's addopts ask pytest-xdist for a worker per core (`--numprocesses=auto --dist=loadscope`);
        # where it is not installed, or blocked with `-p no:xdist`, the options are taken and ignored, and the
        # header says so
        for option in ("--numprocesses", "--dist"):
            parser.addoption(option, default=None,
                             help="pytest-xdist is not loaded: ignored, the suite runs in one process")


def _names_tests(config) -> bool:
    """The command line names test files or tests (not a directory), and asks for no workers itself."""
    typed = config.invocation_params.args
    asked = any(arg.startswith(("-n", "--numprocesses", "--tx", "--dist")) for arg in typed)
    return (not asked and config.args_source == pytest.Config.ArgsSource.ARGS
            and not any((config.invocation_params.dir / arg.split("::")[0]).is_dir() for arg in config.args))


GC_THRESHOLD = (50_000, 20, 10)
"""The cycle collector's thresholds in a process that runs tests (Python's: 700, 10, 10), from its configuration on,
so that importing torch and collecting are covered too. The suite allocates fast and keeps little: at Python's, a
worker of the default run made 3,400-3,700 collections, 5.5-7.2% of its CPU; at these, with the freeze after
collection, 64-65, 1.5-1.8% (`python benchmarks/suite_time.py --gc`, which prints them with the peak memory, unchanged)."""
_GC_BEFORE = pytest.StashKey[tuple]()  # the thresholds to give back at the end


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own (trylast) configure starts the workers
def pytest_configure(config):
    """The whole suite, or a directory of it, runs on a worker per core; a command line that names test files or
    tests runs them in one process, which starts in half the time (one file: 5.7 s against 12.2 s on 2 cores),
    unless it asks for workers itself (`-n auto`)."""
    if config.pluginmanager.has_plugin("xdist") and _names_tests(config):
        config.option.numprocesses, config.option.dist, config.option.tx = 0, "no", []
    runs_tests = not _distributes(config)
    # before any test module is imported (their @settings read the profile); the controller only when asked
    if runs_tests or _asks_hypothesis(config):
        _load_profiles()
    if runs_tests:
        config.stash[_GC_BEFORE] = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLD)
    if runs_tests or config.getoption("htmlpath", None):  # the controller audits the catalog for --html
        _single_threaded_torch()


def pytest_collection_finish(session):
    """What a test process holds once it has collected (torch, Hypothesis, the test modules and their parameters:
    about 250,000 objects) lives until the run ends, yet every full collection walked all of it again. Frozen, it is
    left out of those walks (`pytest_unconfigure` gives it back)."""
    if _GC_BEFORE in session.config.stash:
        gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker is about to exit: its interpreter would first walk every object it holds for cycles
    (torch's alone make that 0.55 s of a 0.75 s `python -c "import torch"`), the controller waiting. Freezing them
    leaves the walk nothing to do (0.2 s). Only in workers: a process that runs pytest.main() goes on after it, and
    gets back for collection what `pytest_collection_finish` froze."""
    if hasattr(config, "workerinput"):
        gc.freeze()
    elif _GC_BEFORE in config.stash:
        gc.unfreeze()
        gc.set_threshold(*config.stash[_GC_BEFORE])


def pytest_report_header(config):
    if not config.pluginmanager.has_plugin("xdist"):
        return ["one process: pytest-xdist is not loaded (pip install -e '.[test]' brings it; with it the suite "
                "runs a worker per core)"]
    if _names_tests(config):
        return ["one process: the command line names test files or tests (-n auto spreads them over the cores)"]
    return []


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
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available: no GPU on this machine (torch.cuda.is_available() is False)")
    return torch.device(request.param)
