"""The set-up as a new user meets it: CI runs the README's own commands first, the minimum torch stated in
the README is the one pyproject declares, and the tests run under `--import-mode=importlib` (nothing is
imported from a conftest)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _commands(text: str) -> list[str]:
    """Shell lines without comments and blank lines."""
    lines = (re.sub(r"(^|\s+)#.*$", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line]


def _readme_set_up() -> list[str]:
    section = README.split("## Set up and run\n", 1)[1].split("\n## ", 1)[0]
    return _commands(re.findall(r"```bash\n(.*?)```", section, re.S)[0])


def test_ci_runs_the_readme_set_up_first_exactly_then_the_extras():
    readme = _readme_set_up()
    assert readme[-1] == "pytest" and any(c.startswith("pip install -e") for c in readme), readme
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "set -euo pipefail" in script
    ci = [command for command in _commands(script) if not command.startswith("echo ")]
    first = next(i for i, command in enumerate(ci) if command.startswith("pip "))
    assert ci[first:first + len(readme)] == readme, "the README's set-up, exactly, before anything else is installed"
    assert "venv" in " ".join(ci[:first]), "in a fresh virtual environment"
    extras = ci[first + len(readme):]
    assert extras == ["pip install torch==2.13.0 torchvision==0.28.0", 'pip install -e ".[test,real]"', "pytest"]
    assert all(command in README for command in extras[:2]), "the extras as the README gives them"


def test_the_readme_states_the_minimum_torch_that_pyproject_declares():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    minimum = re.search(r'dependencies = \["torch>=([\d.]+)"\]', pyproject).group(1)
    assert f"**Supported torch: {minimum} and later** (`pyproject.toml` says `torch>={minimum}`)" in README


def test_tests_run_under_import_mode_importlib():
    """`from conftest import ...` fails under importlib mode: the shared values are fixtures now. Collects
    every test module and runs a quick test of a few."""
    quick = ("json_writes_non_finite or dotted_attributes or every_fix_uses_only_public or private_name_check "
             "or options_have_their_own_group")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider", "-q",
                           "tests", "-k", quick],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", done.stdout).group(1))
    assert passed >= 5 and "error" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
