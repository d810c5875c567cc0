"""Real attention bugs from public issue trackers, each audited as a fixed layer and its buggy twin.

    python benchmarks/real_bugs.py [--only ID ...] [--cheap] [--verbose]

The bugs, their URLs and the two halves of each are in benchmarks/_real_bugs_layers.py (our own code,
written in the style each bug lived in). For each pair:

- the lines that differ are found mechanically: difflib over the two methods' (or functions') sources, mapped
  to the buggy half's file lines; a deleted line counts as the lines around the deletion;
- both halves are audited as a user would (`diagnostics.audit(layer, **declarations)`, the same declarations
  for both: causal=True for a decoder, mask="key_padding" for a padding mask, the window pattern...);
- *caught*: the buggy half's audit status is "failed" (which detectors failed is shown);
- *fixed passed*: the fixed half's audit status is "passed";
- *localised*: a site of one of the buggy half's failing findings (file:line) lies on, or within 2 lines of,
  a differing line ("by a caller": only a line that called the site's op does, as a helper's op is read with
  its caller; the totals give both counts).

The table ends with the totals, the command and how long it took.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import inspect
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")

import torch

import diagnostics

NEAR = 2  # a site within this many lines of a differing line localises the bug


def layers():
    """benchmarks/_real_bugs_layers.py as a module (benchmarks/ is not a package)."""
    name = "_real_bugs_layers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _unwrap(obj):
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def differing_lines(fixed, buggy) -> tuple[str, list[int]]:
    """(file, 1-based lines of the buggy source) that differ from the fixed source, by difflib. A deletion in
    the buggy source counts as the lines on either side of where the fixed lines were."""
    fixed, buggy = _unwrap(fixed), _unwrap(buggy)
    a, _ = inspect.getsourcelines(fixed)
    b, start = inspect.getsourcelines(buggy)
    b = [b[0].replace(f"def {buggy.__name__}(", f"def {fixed.__name__}(", 1)] + b[1:]  # a function's own name is no bug
    lines: set[int] = set()
    for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            lines.update(range(j1, j2))
        elif tag == "delete":
            lines.update(n for n in (j1 - 1, j1) if 0 <= n < len(b))
    return str(Path(inspect.getsourcefile(buggy)).resolve()), sorted(start + n for n in lines)


@dataclass
class Outcome:
    bug: object
    file: str
    lines: list[int]
    fixed_status: str
    fixed_fired: dict
    buggy_status: str
    buggy_failed: list[str]
    buggy_fired: dict
    localised: bool
    via_caller: bool
    sites: list[str]
    seconds: float


def _failed(report) -> list:
    return [r for r in report.findings if r.verdict == "fail"]


def audit(make, declarations: dict):
    """The audit report, or the usage error's message where the audit refused the layer as declared."""
    torch.manual_seed(0)
    try:
        return diagnostics.audit(make(), **declarations)
    except diagnostics.AuditUsageError as error:
        return str(error)


def _status(report) -> str:
    return "usage error" if isinstance(report, str) else report.status


def _fired(report) -> dict:
    return {"usage error": report} if isinstance(report, str) else report.fired()


def run_one(bug) -> Outcome:
    start = time.perf_counter()
    file, lines = differing_lines(bug.fixed, bug.buggy)
    fixed, buggy = audit(bug.make_fixed, bug.audit), audit(bug.make_buggy, bug.audit)
    if isinstance(fixed, str) or isinstance(buggy, str):  # a usage error: the audit could not be run as declared
        return Outcome(bug, file, lines, _status(fixed), _fired(fixed), _status(buggy), [], _fired(buggy), False,
                       False, [], time.perf_counter() - start)

    def near(path: str, line: int) -> bool:
        return str(Path(path).resolve()) == file and any(abs(line - n) <= NEAR for n in lines)

    sites, localised, via_caller = [], False, False
    for result in _failed(buggy):
        for site in result.where:
            sites.append(f"{result.detector}@{Path(site.file).name}:{site.line}")
            localised = localised or near(site.file, site.line)
            via_caller = via_caller or any(near(path, line) for path, line, _ in site.callers)
    return Outcome(bug, file, lines, fixed.status, fixed.fired(), buggy.status, [r.detector for r in _failed(buggy)],
                   buggy.fired(), localised, localised or via_caller, sites, time.perf_counter() - start)


def run(bugs) -> list[Outcome]:
    return [run_one(bug) for bug in bugs]


def table(outcomes: list[Outcome], verbose: bool = False) -> str:
    rows = ["| bug | source | buggy caught (failed detectors) | fixed passed | localised | differing lines |",
            "|---|---|---|---|---|---|"]
    for o in outcomes:
        caught = "yes" if o.buggy_status == "failed" else f"no ({o.buggy_status})"
        if o.buggy_failed:
            caught += f" ({', '.join(o.buggy_failed)})"
        fixed = ("yes" if o.fixed_status == "passed" else f"no ({o.fixed_status})" if o.fixed_status == "usage error"
                 else f"no ({o.fixed_status}: {', '.join(d for d, v in o.fixed_fired.items() if v == 'fail')})")
        where = ("yes" if o.localised else "by a caller" if o.via_caller else "no") if o.buggy_status == "failed" else "-"
        rows.append(f"| `{o.bug.id}` | {o.bug.url} | {caught} | {fixed} | {where} | "
                    f"{', '.join(map(str, o.lines))} |")
        if verbose:
            rows.append(f"|   | {o.bug.what} | fired {o.buggy_fired} | fired {o.fixed_fired} | "
                        f"{'; '.join(o.sites[:6]) or '-'} | {o.seconds:.2f} s |")
    return "\n".join(rows)


def totals(outcomes: list[Outcome]) -> str:
    n = len(outcomes)
    caught = sum(o.buggy_status == "failed" for o in outcomes)
    passed = sum(o.fixed_status == "passed" for o in outcomes)
    localised = sum(o.localised for o in outcomes if o.buggy_status == "failed")
    callers = sum(o.via_caller for o in outcomes if o.buggy_status == "failed")
    return (f"caught {caught}/{n}, fixed passed {passed}/{n}, localised {localised}/{caught} "
            f"({callers}/{caught} counting the lines that called a site's op)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="the bugs with these ids")
    parser.add_argument("--cheap", action="store_true", help="only the pairs the test's default run audits")
    parser.add_argument("--verbose", action="store_true", help="a second line per bug: what it is, every finding, sites")
    args = parser.parse_args(argv)
    bugs = layers().BUGS
    if args.only:
        unknown = sorted(set(args.only) - {b.id for b in bugs})
        if unknown:
            parser.error(f"unknown ids {unknown}; known: {', '.join(b.id for b in bugs)}")
        bugs = [b for b in bugs if b.id in args.only]
    if args.cheap:
        bugs = [b for b in bugs if b.cheap]
    torch.set_num_threads(1)
    start = time.perf_counter()
    outcomes = run(bugs)
    took = time.perf_counter() - start
    print(table(outcomes, args.verbose))
    print()
    print(totals(outcomes))
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python benchmarks/real_bugs.py", *given])
    print(f"`{command}`: {len(outcomes)} pairs, {2 * len(outcomes)} audits in {took:.1f} s "
          f"(torch {torch.__version__}, 1 thread)")


if __name__ == "__main__":
    main()
