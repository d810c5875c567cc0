"""A pytest plugin for benchmarks/mutations.py: which of the package's functions each test of the suite calls.

benchmarks/mutations.py copies this file into its copy of the tree and loads it (PYTEST_PLUGINS) in one run of the
default suite. A trace function that looks only at `call` events (it returns None, so no line is traced) notes the
code objects of the package that each test's setup, call and teardown enter: (path under the package, first line).
A mutant inside a function can change only the tests that enter that function; they are the ones run against it.

Calls made while a test sets up a fixture of a wider scope (module, class, package, session) are that fixture's: a
test that only reads the fixture's value after another test built it depends on them too, so they are credited to
every test that uses the fixture (`shared`). Only tests that passed are kept: a mutant must never be "killed" by a
test that fails without it. Each process (pytest-xdist workers included) writes its own file into MUTATION_CALLS; a
pytest a test runs in this process (pytester) is not the suite's and is ignored, and one it runs in a subprocess
writes tests outside tests/, which benchmarks/mutations.py leaves out.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

_PACKAGE = "diagnostics"
_ROOTS = tuple({os.path.join(p, _PACKAGE) + os.sep
                for p in (os.environ["MUTATION_COPY"], os.path.realpath(os.environ["MUTATION_COPY"]))})
_calls: set[tuple[str, int]] = set()
_tests: dict[str, dict] = {}
_outer = None  # the run's own config: a test that runs pytest in this process (pytester) configures another


def _trace(frame, event, arg):
    if event == "call":
        name = frame.f_code.co_filename
        for root in _ROOTS:
            if name.startswith(root):
                _calls.add((name[len(root):].replace(os.sep, "/"), frame.f_code.co_firstlineno))
                break
    return None  # no line events: only which functions are entered


def pytest_configure(config):
    global _outer
    if _outer is None:
        _outer = config
        sys.settrace(_trace)
        threading.settrace(_trace)


def _wider_fixtures(item) -> list[str]:
    """The fixtures of a scope wider than the test that `item` uses, as keys shared by every test using them."""
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for name, defs in (getattr(info, "name2fixturedefs", None) or {}).items():
        scope = getattr(defs[-1], "scope", "function") if defs else "function"
        if scope in ("module", "class"):
            keys.append(f"{scope}:{item.nodeid.split('::')[0]}:{name}")
        elif scope in ("package", "session"):
            keys.append(f"{scope}:{name}")
    return keys


def _entry(item) -> dict:
    return _tests.setdefault(item.nodeid, dict(own=set(), setup=set(), shared=_wider_fixtures(item), seconds=0.0,
                                               passed=True))


def _recorded(item, key: str):
    """Around one phase of a test: the package's functions it enters, into that test's `key` set."""
    if item.config is not _outer:  # an inner run's test (pytester): its calls are the outer test's
        yield
        return
    _calls.clear()
    yield
    _entry(item)[key].update(_calls)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _recorded(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _recorded(item, "own")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _recorded(item, "own")


def pytest_runtest_logreport(report):
    entry = _tests.get(report.nodeid)
    if entry is None:
        return
    entry["seconds"] += report.duration
    if report.failed or (report.when == "call" and not report.passed) or (report.when == "setup" and report.skipped):
        entry["passed"] = False


def pytest_sessionfinish(session):
    if session.config is not _outer:
        return
    sys.settrace(None)
    threading.settrace(None)
    folder = os.environ["MUTATION_CALLS"]
    rows = {nodeid: dict(own=sorted(e["own"]), setup=sorted(e["setup"]), shared=e["shared"],
                         seconds=round(e["seconds"], 3), passed=e["passed"]) for nodeid, e in _tests.items()}
    with open(os.path.join(folder, f"calls-{os.getpid()}.json"), "w") as f:
        json.dump(rows, f)
