"""A pytest fixture to audit a sharded layer from a test: `sharded_audit(layer, sharded, **options)` runs
`audit_sharded` and fails the test with the report unless it passed (`check=False` returns the report instead).
Without torch.distributed (or gloo, or fork) the test skips, saying why.

    def test_my_ring(sharded_audit):
        sharded_audit(make_layer(), lambda layer, rank, world_size, group: MyRing(layer, group), causal=True)

Loaded by pyproject's pytest11 entry point `diagnostics.distributed.pytest_plugin` (or `-p
diagnostics.distributed.pytest_plugin`). The audits fork their ranks: keep such tests in one module, which
`--dist=loadscope` runs on one worker, so that two groups never share the cores at once.
"""

from __future__ import annotations

import pytest


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
        report = audit_sharded(layer, sharded, **options)
        if check:
            report.raise_for_findings()
        return report

    return run
