"""Fixtures shared by the test modules, and the hook that adds the teaching report to `pytest --html`.

Nothing here is imported by the tests (`from conftest import ...` breaks under `--import-mode=importlib`):
shared values are fixtures, or live in importable modules (`buggy_variants.teaching_report.KILL_MATRIX_SIZE`).
The teaching report itself is `buggy_variants/teaching_report.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _teaching_report():
    """`buggy_variants.teaching_report`, imported when first needed: it imports torch and the catalog, which
    pytest-xdist's controller needs only to write a report (`--html`). None without torch: then only the
    structural tests (test_architecture.py) can run."""
    try:
        from buggy_variants import teaching_report
    except ImportError:
        return None
    return teaching_report


# A user's own attention module, as the command-line and plugin tests write it into a scratch directory:
# correct as built, without the 1/sqrt(d_k) when scaled=False. Each test module appends its own variations.
_USER_ATTENTION_SOURCE = '''
import math
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d_model=32, num_heads=4, scaled=True):
        super().__init__()
        self.d_model, self.num_heads, self.scaled = d_model, num_heads, scaled
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
        if self.scaled:
            scores = scores / math.sqrt(D // self.num_heads)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out(torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v).transpose(1, 2).reshape(B, T, D))


class LinearOnly(nn.Module):  # no attention at all: nothing the audit needs can be measured
    def __init__(self):
        super().__init__()
        self.d_model, self.num_heads, self.proj = 32, 4, nn.Linear(32, 32)

    def forward(self, x, mask=None):
        return self.proj(x)


linear_only = LinearOnly()


class Block(Attention):  # nanoGPT's way: a registered causal mask as long as the context
    def __init__(self, block_size=8):
        super().__init__()
        causal = torch.tril(torch.ones(block_size, block_size))  # (T, T)
        self.register_buffer("bias", causal.view(1, 1, block_size, block_size))

'''


@pytest.fixture(scope="session")
def std_002():
    """`std_002(layer)`: GPT-2's initialisation of the layer's projections (nn.Linear: std 0.02, biases 0), in place,
    the layer's own scales and temperatures left as it makes them (`correct.gpt2_init_` draws every parameter, a
    learned temperature too, which no layer is built with); returns the layer."""
    from torch import nn

    def init(layer):
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        return layer
    return init


@pytest.fixture(scope="session")
def user_attention_source() -> str:
    """Source of a module `Attention(d_model=32, num_heads=4, scaled=True)`, forward(x, mask=None): a user's own
    layer for the command-line and plugin tests to write into a scratch directory and extend; also
    `linear_only` (no attention at all) and `Block` (a registered causal mask as long as its context)."""
    return _USER_ATTENTION_SOURCE


@pytest.fixture(scope="session")
def reference_audit():
    """`reference_audit(variant, recipe, audit)`: the report `audit()` gives (it builds the correct layer configured
    like `variant` and audits it as the variant promises), made once per session for each (reference configuration,
    recipe). Variants that share their reference's configuration (14 of the catalog's 27 are the plain reference)
    share its twin audit: the same layer, weights, inputs and seed give the same report, so auditing it again for
    each measured nothing new. `recipe`: everything the audit depends on besides the variant (sizes, seed, dtype,
    initialisation); the report is only read."""
    reports: dict = {}

    def once(variant, recipe, audit):
        config = tuple((name, tuple(value.flatten().tolist()) if hasattr(value, "flatten") else value)
                       for name, value in sorted(variant.layer_kwargs.items()))  # a tensor by its values, in full
        key = (config, repr(variant.pattern), recipe)
        if key not in reports:
            reports[key] = audit()
        return reports[key]

    return once


@pytest.fixture(scope="session")
def catalog_audits():
    """{variant id: audit of its layer}, each built with torch.manual_seed(0) at
    `teaching_report.KILL_MATRIX_SIZE`, audited as it promises (causal layers with causal=True). Used by the
    kill matrix, the fix tests and the teaching report."""
    teaching_report = _teaching_report()
    if teaching_report is None:
        pytest.skip("torch is not installed: pip install torch==2.13.0")
    return teaching_report.audit_catalog()


@pytest.fixture(scope="session")
def teaching_report_html(catalog_audits) -> str:
    """The teaching report's HTML for the whole catalog, as `pytest --html` puts it above the results."""
    return _teaching_report().teaching_html(catalog_audits)


SHARED_AUDITS = ("catalog_audits", "teaching_report_html")
"""The session fixtures that audit the whole catalog (2-3 s) and draw its teaching report (3 s more): each process
that runs a test asking for them computes them once."""


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist=loadscope` (pyproject's addopts), every test module that names one of SHARED_AUDITS runs on
    the same worker, so that the catalog is audited and drawn once per run instead of once per worker (measured:
    twice in a 2-worker run, 6.5 s of the summed durations); every other module is a unit of its own, as before."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getoption("dist") != "loadscope" or not hasattr(LoadScopeScheduling, "_split_scope"):
        return None
    readers: dict[str, bool] = {}

    def reads_shared_audits(path: str) -> bool:
        if path not in readers:
            try:
                text = (config.rootpath / path).read_text()
            except OSError:
                text = ""
            readers[path] = any(name in text for name in SHARED_AUDITS)
        return readers[path]

    class SharedAuditsOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "the catalog's shared audits" if reads_shared_audits(path) else super()._split_scope(nodeid)

    return SharedAuditsOnOneWorker(config, log)


def pytest_configure(config):
    if config.getoption("htmlpath", None):  # pytest-html writes a report: the teaching report joins it
        teaching_report = _teaching_report()
        if teaching_report is not None:
            teaching_report.register(config)


@pytest.fixture
def sweep_benchmark():
    """benchmarks/sweep.py, loaded by path as tests/test_sweep.py loads it (one module, "sweep_benchmark", so that its
    dataclasses resolve), for tests that drive the sweep on one model type."""
    if "sweep_benchmark" not in sys.modules:
        where = Path(__file__).resolve().parent.parent / "benchmarks" / "sweep.py"
        spec = importlib.util.spec_from_file_location("sweep_benchmark", where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["sweep_benchmark"]


@pytest.fixture
def hf_transformers():
    """transformers, imported after test_real_layers' torchvision guard (loaded by path: tests import no test
    module); the test skips, saying how to install it, where the real extra is absent."""
    if "real_layers_tests" not in sys.modules:
        spec = importlib.util.spec_from_file_location("real_layers_tests", Path(__file__).with_name("test_real_layers.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    sys.modules["real_layers_tests"]._import_torchvision()
    return pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
