"""What the first audit of a process pays that a warm one does not: no import of torch's compiler stack.

Torch wraps a TorchDispatchMode's `__torch_dispatch__` in `torch._disable_dynamo`, which imports torch._dynamo
(~300 modules, over a second) on the first op under the mode; `torch.unravel_index` and `torch.broadcast_shapes`
import sympy through torch.fx's symbolic shapes. The audit's observers opt out (diagnostics._observe.Mode) and its
index arithmetic is plain Python, so a fresh process that audits a correct layer and a broken one, and reads the
broken one's sites, imports neither. Timings live in benchmarks/audit_cost.py; this checks the cause, not a clock.
Marked `slow` (CI's slow step, `pytest --slow`): its two fresh processes took 5-8 s of the default run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
import torch
import diagnostics
from buggy_variants import VARIANTS
from correct import MultiHeadAttention

assert diagnostics.audit(MultiHeadAttention(32, 4), causal=True).passed
broken = diagnostics.audit(VARIANTS["missing_causal_mask"].build(32, 4), causal=True)
assert not broken.passed and broken.result("future_leakage").where
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor", "sympy"))))
"""


@pytest.fixture(scope="module")
def listings() -> dict[str, subprocess.CompletedProcess]:
    """The script run in two fresh processes side by side (each pays for importing torch, the control for
    torch._dynamo too): as written, and the negative control, which imports torch._dynamo first."""
    control = SCRIPT.replace("import torch\n", "import torch\nimport torch._dynamo\n", 1)
    scripts = {"fresh": SCRIPT, "dynamo imported": control}
    assert scripts["dynamo imported"] != SCRIPT
    started = {name: subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for name, script in scripts.items()}
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def test_a_fresh_process_audits_and_localises_without_importing_dynamo_or_sympy(listings):
    run = listings["fresh"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_the_check_sees_dynamo_when_something_imports_it(listings):
    """The negative control: the same listing after an explicit import of torch._dynamo names it."""
    run = listings["dynamo imported"]
    assert run.returncode == 0, run.stderr
    assert "torch._dynamo" in run.stdout
