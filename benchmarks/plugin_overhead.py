"""What the installed pytest plugin costs a pytest run that does not use it.

    python benchmarks/plugin_overhead.py [--runs 15]

Runs a one-test file in a scratch directory (no conftest, no config of this project) with `python -m pytest`,
alternately with the plugin (as its `pytest11` entry point loads it wherever the package is installed) and
with `-p no:diagnostics.pytest_plugin`, and prints the median wall time of each and their difference. The
plugin imports torch and the audit only when `--attention-audit` is given or a test requests the
`attention_audit` fixture, so the difference should stay far below the 0.2 s target (importing torch alone
costs over a second). It also checks, in a fresh process, that loading the plugin leaves torch unimported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 0.2


def _entry_point_installed() -> bool:
    try:
        distribution = importlib.metadata.distribution("attention-mistakes")
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(ep.group == "pytest11" for ep in distribution.entry_points)


def _time(argv: list[str], cwd: str, env: dict) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"pytest failed ({done.returncode}):\n{done.stdout}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each configuration (default 15)")
    args = parser.parse_args()

    env = {**os.environ}
    env.pop("PYTEST_ADDOPTS", None)
    with_plugin: list[str] = []
    if not _entry_point_installed():  # not installed: load it by name, from this checkout
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        with_plugin = ["-p", "diagnostics.pytest_plugin"]
        print("the package is not installed: loading the plugin with -p diagnostics.pytest_plugin")
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "test_trivial.py").write_text("def test_trivial():\n    assert True\n")
        base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_trivial.py"]
        configs = {"with the plugin": base + with_plugin, "without it": base + ["-p", "no:diagnostics.pytest_plugin"]}
        check = [sys.executable, "-c", "import sys, diagnostics.pytest_plugin; print('torch' in sys.modules)"]
        torch_loaded = subprocess.run(check, cwd=scratch, env=env, capture_output=True, text=True).stdout.strip()
        _time(configs["with the plugin"], scratch, env)  # warm the file cache
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.runs):
            for name, argv in configs.items():  # interleaved, so that drift hits both alike
                times[name].append(_time(argv, scratch, env))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:>16}: median {medians[name]:.3f} s (min {min(values):.3f}, max {max(values):.3f}, "
              f"{len(values)} runs)")
    difference = medians["with the plugin"] - medians["without it"]
    fastest = min(times["with the plugin"]) - min(times["without it"])  # less noisy on a busy machine
    print(f"overhead: {difference:+.3f} s between medians ({medians['with the plugin'] / medians['without it']:.2f}x), "
          f"{fastest:+.3f} s between the fastest runs; target < {TARGET_S} s; torch imported by loading the plugin: "
          f"{torch_loaded}")


if __name__ == "__main__":
    main()
