"""The default suite's wall clock, against another tree's in alternating runs, measured in one run.

    python benchmarks/suite_time.py [--rounds 3] [--vs OTHER_TREE] [--gc] [-- PYTEST ARGS]

Each round runs the README's test command (`pytest`, here `python -m pytest -q -p no:cacheprovider` with `CI=1`, as
CI runs it, and whatever follows `--`) in a fresh process and times it from outside. On a shared 2-core machine the
suite's wall clock drifts by 10-20% within minutes and by up to 2x between hours (the same tree ran 49-77 s in one
session), so a before/after figure is only worth the ratio of runs made close together: `--vs OTHER_TREE` (a
checkout or `git archive` of another commit) runs that tree's suite too, alternating which goes first each round
(A B, B A, ...), and prints the median of the rounds' ratios. The other tree runs with `PYTHONPATH=OTHER_TREE` from
its own directory, with this interpreter, so that its own `diagnostics` is imported rather than the editable
install's. (A fixed calibration workload timed between the runs did not track the drift: its own spread was 0.74-1.13
s in one round, uncorrelated with the suite's, so it is not used.)

`--gc` loads `benchmarks/_gc_share.py` into every process of each run and prints, per process, the cycle collector's
collections and their share of that process's CPU time (timed by `gc.callbacks`), and its peak memory: how
conftest.py's `GC_THRESHOLD` and freeze were measured.

Prints a row per suite run (round, tree, wall seconds, pytest's own seconds and counts) and the medians. Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ passed.*?) in (?P<seconds>[\d.]+)s", re.M)


def run_suite(tree: Path, pytest_args: list[str], gc_share: bool = False) -> dict:
    """One run of the suite in `tree`, timed from outside: {wall, seconds (pytest's own), counts, rc, gc (with
    `gc_share`: a line per process from _gc_share.py)}."""
    env = dict(os.environ, CI="1")
    paths = [str(tree)] if tree != HERE else []
    plugin: list[str] = []
    if gc_share:
        paths.append(str(Path(__file__).resolve().parent))
        handle, env["ATTENTION_GC_SHARE"] = tempfile.mkstemp(prefix="gc_share_", suffix=".txt")
        os.close(handle)  # the plugin appends to it by name
        plugin = ["-p", "_gc_share"]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *pytest_args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = SUMMARY.search(done.stdout)
    if found is None:
        tail = "\n".join(done.stdout.splitlines()[-15:])
        raise SystemExit(f"the suite in {tree} printed no summary line (exit {done.returncode}); its last lines:\n{tail}")
    lines = []
    if gc_share:
        lines = Path(env["ATTENTION_GC_SHARE"]).read_text().split("\n")
        os.unlink(env["ATTENTION_GC_SHARE"])
    return {"wall": wall, "seconds": float(found["seconds"]), "counts": found["counts"].split(",")[0:2],
            "rc": done.returncode, "gc": [line.split() for line in lines if line]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="suite runs per tree (default 3)")
    parser.add_argument("--vs", type=Path, default=None, help="another tree, run alternately with this one")
    parser.add_argument("--gc", action="store_true",
                        help="per process: the cycle collector's collections and share of CPU, and peak memory")
    args = parser.parse_args(own)
    trees = [HERE] if args.vs is None else [HERE, args.vs.resolve()]
    for tree in trees[1:]:
        if not (tree / "diagnostics").is_dir():
            parser.error(f"--vs {tree}: expected a checkout of this project (a diagnostics/ folder there), found none")
    names = {HERE: "this tree", **({trees[1]: f"--vs {args.vs}"} if len(trees) > 1 else {})}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {importlib.metadata.version('torch')}, {os.cpu_count()} CPUs, load {load}; pytest -q -p no:cacheprovider "
          f"{' '.join(pytest_args)} with CI=1")
    print(f"{'round':>5}  {'tree':<24} {'wall (s)':>8} {'pytest (s)':>10}  counts")
    rows: list[tuple[int, Path, dict]] = []
    for r in range(args.rounds):
        for tree in (trees if r % 2 == 0 else trees[::-1]):
            run = run_suite(tree, pytest_args, args.gc)
            rows.append((r, tree, run))
            failed = "" if run["rc"] == 0 else f"  exit {run['rc']}"
            print(f"{r + 1:>5}  {names[tree]:<24} {run['wall']:8.1f} {run['seconds']:10.1f}  "
                  f"{','.join(run['counts'])}{failed}", flush=True)
            for role, n, seconds, cpu, peak in run["gc"]:
                print(f"{'':>7}{role:<6} cycle collector: {n:>5} collections, {float(seconds):6.2f} s of {float(cpu):6.1f} "
                      f"s CPU ({100 * float(seconds) / max(float(cpu), 1e-9):.1f}%), peak memory {peak} MiB")
    for tree in trees:
        walls = [run["wall"] for _, t, run in rows if t == tree]
        print(f"{names[tree]}: wall {min(walls):.1f}-{max(walls):.1f} s, median {statistics.median(walls):.1f}")
    if len(trees) > 1:
        wall = {(r, t): run["wall"] for r, t, run in rows}
        ratios = [wall[r, HERE] / wall[r, trees[1]] for r in range(args.rounds)]
        print(f"this tree / --vs: {statistics.median(ratios):.2f}x wall, median of {args.rounds} pairs "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")
    return 0 if all(run["rc"] == 0 for _, _, run in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
