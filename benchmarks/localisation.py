"""How often the audit points at the right line: the never-seen broken layers of tests/test_never_seen.py.

    python benchmarks/localisation.py [--settings] [--cost [--lengths 128 1024] [--repeats 3]]

Each broken layer there marks its buggy line with a `# BUG` comment. For each one, the layer is audited as
its test audits it, and the first site (`result.where[0]`) of every detector the test requires to fail is
compared with that line: "exact" when it is the `# BUG` line, "elsewhere" when it names another line,
"none" when the audit could not tell (or no localisation exists for that detector). `--settings` also runs
the second chapter at bfloat16 and GPT-2's initialisation, as its tests do. The last line times the audits
and, apart, reading the sites of every finding (each read re-runs that finding's probe under a tracer).

`--cost`: the audit's cost with and without recording sites (diagnostics._observe.RECORD_SITES), the
reference MultiHeadAttention(512, 8) as in benchmarks/audit_cost.py, runs interleaved, medians and fastest runs.
A passing audit runs no localisation at all; only the observer's frame records differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import diagnostics  # noqa: E402
from diagnostics import _observe  # noqa: E402


def bug_lines(module) -> set[tuple[str, int]]:
    path = Path(module.__file__).resolve()
    return {(str(path), n) for n, line in enumerate(path.read_text().splitlines(), 1) if "# BUG" in line}


def cases(settings: bool):
    import test_never_seen as ns

    for name in sorted(ns.BROKEN):
        make, must, _ = ns.BROKEN[name]
        yield name, "float32, default init", make, set(must)
    for name in sorted(ns.SECOND_CHAPTER):
        make, det, _ = ns.SECOND_CHAPTER[name]
        for dtype, init in (ns.SCALES if settings else ns.SCALES[:1]):
            setting = f"{str(dtype).replace('torch.', '')}, {init} init"
            yield name, setting, (lambda make=make, dtype=dtype, init=init: ns._in_setting(*make(), dtype, init)), {det}


def localisation(settings: bool) -> None:
    import test_never_seen as ns

    bugs = bug_lines(ns)
    tally = {"exact": 0, "elsewhere": 0, "none": 0}
    rows, audit_s, where_s = [], 0.0, 0.0
    for name, setting, make, must in cases(settings):
        torch.manual_seed(0)
        layer, kw = make()
        start = time.perf_counter()
        report = diagnostics.audit(layer, **kw)
        middle = time.perf_counter()
        for result in report.findings:  # sites are found when first read: read them all, and time it
            len(result.where)
        audit_s, where_s = audit_s + middle - start, where_s + time.perf_counter() - middle
        outcome, shown = "exact", []
        for det in sorted(must):
            result = report.result(det)
            first = result.where[0] if result.where else None
            if first is None:
                outcome = "none" if outcome != "elsewhere" else outcome
                shown.append(f"{det}: -")
            else:
                hit = (str(Path(first.file).resolve()), first.line) in bugs
                if not hit:
                    outcome = "elsewhere"
                shown.append(f"{det}: line {first.line} ({first.op})")
        tally[outcome] += 1
        rows.append((outcome, name, setting, "; ".join(shown)))
    for outcome, name, setting, shown in rows:
        print(f"{outcome:<9}  {name} [{setting}]  {shown}")
    total = sum(tally.values())
    print(f"\nlocalised exactly: {tally['exact']} / {total} ({100 * tally['exact'] / total:.0f}%); another line: "
          f"{tally['elsewhere']}; no site: {tally['none']}")
    print(f"time: audits {audit_s:.2f} s; reading the sites of all their findings {where_s:.2f} s more")


def cost(lengths: list[int], repeats: int, causal: bool) -> None:
    from correct import MultiHeadAttention

    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, causal={causal}")
    print("seq_len  with sites: median, fastest (s)  without: median, fastest (s)  difference of medians, fastest")
    for t in lengths:
        torch.manual_seed(0)
        layer = MultiHeadAttention(512, 8, causal=causal)
        diagnostics.audit(layer, seq_len=t, causal=causal)  # warm-up: imports, first-call costs
        timing = {True: [], False: []}
        for _ in range(repeats):
            for record in (True, False):
                _observe.RECORD_SITES = record
                start = time.perf_counter()
                report = diagnostics.audit(layer, seq_len=t, causal=causal)
                timing[record].append(time.perf_counter() - start)
                assert report.passed, str(report)
        _observe.RECORD_SITES = True
        on, off = statistics.median(timing[True]), statistics.median(timing[False])
        fast_on, fast_off = min(timing[True]), min(timing[False])
        print(f"{t:>7}  {on:>19.3f}, {fast_on:.3f}  {off:>16.3f}, {fast_off:.3f}  {100 * (on - off) / off:+.1f}%, "
              f"{100 * (fast_on - fast_off) / fast_off:+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", action="store_true", help="the second chapter at every dtype and init")
    parser.add_argument("--cost", action="store_true", help="time audits with and without site recording")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.cost:
        cost(args.lengths, args.repeats, args.causal)
    else:
        localisation(args.settings)


if __name__ == "__main__":
    main()
