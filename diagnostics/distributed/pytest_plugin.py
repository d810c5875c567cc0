"""A pytest fixture to audit a sharded layer from a test: `sharded_audit(layer, sharded, **options)` runs
`audit_sharded` and fails the test with the report unless it passed (`check=False` returns the report instead).
Without torch.distributed (or gloo, or fork) the test skips, saying why.

    def test_my_ring(sharded_audit):
        sharded_audit(make_layer(), lambda layer, rank, world_size, group: MyRing(layer, group), causal=True)

Loaded by pyproject's pytest11 entry point `diagnostics.distributed.pytest_plugin` (or `-p
diagnostics.distributed.pytest_plugin`). The audits fork their ranks: so that two groups never share the cores at
once, whichever worker of pytest-xdist runs them, the fixture holds `one_group_at_a_time()` (a file lock in the
temporary folder) for each audit; a test that calls `audit_sharded` itself can hold it too.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest

LOCK_NAME = "attention-audit-groups.lock"  # in the temporary folder; kept (an empty file), so that no lock races it
_held = 0  # how deep this process holds the lock: a test that holds it may call the fixture, which would wait on it


@contextlib.contextmanager
def one_group_at_a_time():
    """Hold the machine's lock on forked groups of ranks: another process holding it (another pytest worker's audit)
    finishes first. Re-entrant within a process; a no-op where there is no `fcntl` (no fork there either)."""
    global _held
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if _held or fcntl is None:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    with open(os.path.join(tempfile.gettempdir(), LOCK_NAME), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _held += 1
        try:
            yield
        finally:
            _held -= 1
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_configure(config):
    config.addinivalue_line("markers", "sharded: a test that audits a sharded layer (forks process groups)")


@pytest.fixture
def sharded_audit():
    """`sharded_audit(layer, sharded, *, check=True, **audit_sharded options) -> ShardedReport`."""
    from . import audit_sharded, distributed_available

    ok, why = distributed_available()
    if not ok:
        pytest.skip(f"sharded audit unavailable: {why}")

    def run(layer, sharded, *, check: bool = True, **options):
        __tracebackhide__ = True
        with one_group_at_a_time():
            report = audit_sharded(layer, sharded, **options)
        if check:
            report.raise_for_findings()
        return report

    return run
