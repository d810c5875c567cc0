"""Mutation benchmark for the detectors: flip each comparison and threshold, see whether the tests notice.

    python benchmarks/mutations.py                   # every mutant, one at a time
    python benchmarks/mutations.py --list            # the mutants, with the line each one changes
    python benchmarks/mutations.py --only _bound_check --jobs 2 --json /tmp/mutations.json
    python benchmarks/mutations.py --limit 20        # the first 20, in the fixed order of --list
    python benchmarks/mutations.py --survivors-of /tmp/mutations.json   # after adding tests: rerun survivors

Mutants (stdlib `ast`, applied as edits of the source text so that line numbers and comments stay put):
- every comparison `>`/`>=`/`<`/`<=`/`==`/`!=` in the check code: `>`<->`>=`, `<`<->`<=`, `>`<->`<`
  (`>=`<->`<=`), `==`<->`!=`;
- `not x` -> `x` and `~x` -> `x` (the tensor `not`), and `any`<->`all` (the builtins and tensor methods);
- every numeric threshold in `diagnostics/_thresholds.py` (the UNCHANGED and ROW_SUM tables, SCALE_RATIO)
  multiplied by 10 and by 0.1. The MEASURED_* tables are not thresholds (they are only quoted in the
  margin text of a result) and are left alone.
The check code is the functions of `diagnostics/_detectors.py` and `diagnostics/_core.py` whose names start
with one of FUNCTION_PREFIXES (nested functions count as their enclosing one). Ids read
`_detectors.py:check_future_leakage:L470:Gt->GtE`; a second mutant of the same kind on one line gets `#2`.

Each mutant is written into a private copy of the package tree (diagnostics/, correct/, buggy_variants/,
tests/, conftest.py, pyproject.toml; one copy per job, no bytecode written, so a same-size edit is never
hidden by a stale .pyc), and TEST_COMMAND runs there in a subprocess with CI=1, HYPOTHESIS_PROFILE=default
and OMP_NUM_THREADS=1 (on 2 shared cores, torch's thread pool makes that run 7x slower: 91 s against 13 s).
Before any mutant, a canary test checks that pytest in that copy imports `diagnostics` (and _detectors,
_core, _thresholds) from the copy, not from the repository or the editable install, and the unmutated copy
must pass. A mutant is *killed* when the tests fail, *error* when they cannot even be collected (an import
error: counted as killed, listed apart), *timeout* when they run past --timeout (counted as killed, listed
apart), and *survived* when they pass. The score is killed / total; a mutant leaves the denominator only when
EQUIVALENT below names it, with the reason, after it was checked by hand to change no behaviour.

Cost (2 shared cores, one job): ~13 s per surviving mutant (tests and start-up); killed ones stop at the
first failure (-x), 5-20 s. The full run of 146 mutants took 27 minutes at commit 28e27ce (2 cores shared
with other work, --jobs 1). After adding tests, `--survivors-of` reruns only the earlier survivors, matched
by their line's text, so that moved lines still match.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "diagnostics"
FILES = ("_detectors.py", "_core.py", "_thresholds.py")
FUNCTION_PREFIXES = ("check_", "_judge", "held", "relative_change", "_position_change", "perturbed", "_bound_check",
                     "_newest_key_seen", "runs_verdict")
THRESHOLD_TABLES = ("UNCHANGED", "ROW_SUM", "SCALE_RATIO")
TEST_COMMAND = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                "tests/test_kill_matrix.py", "tests/test_never_seen.py", "tests/test_audit.py"]
COPIED = ("diagnostics", "correct", "buggy_variants", "tests", "conftest.py", "pyproject.toml")

# Mutants checked by hand to change no behaviour: id -> (text its line must contain, why it is equivalent).
# A mark whose line no longer contains that text is ignored (with a warning), so a stale mark cannot hide a
# new mutant. Keep this short and honest: a mutant that only changes the wording of evidence is NOT
# equivalent (the tests could check the wording), it is a gap.
_TOLERANCE_EDGE = ("equivalent in practice: `>` and `>=` differ only where a measured float equals a positive float "
                   "tolerance exactly; float32/16 readings never equal 1e-4 etc. (not representable), float64 ones "
                   "would need an exact hit")
_DRAW_EDGE = "equivalent in practice: differs only where two independent continuous random draws are exactly equal"
EQUIVALENT: dict[str, tuple[str, str]] = {
    "_detectors.py:check_weight_row_sums:L196:Gt->GtE": ("(dev[rows] > tol)", _TOLERANCE_EDGE),
    "_detectors.py:check_weight_row_sums:L197:Lt->LtE": ("w < -tol", _TOLERANCE_EDGE),
    "_detectors.py:check_output_variance:L345:Gt->GtE": ("(change > tol)", _TOLERANCE_EDGE),
    "_detectors.py:_bound_check:L369:Gt->GtE": ("(excess > tol).any()", _TOLERANCE_EDGE),
    "_detectors.py:_bound_check:L370:Gt->GtE": ("(excess > tol).sum()", _TOLERANCE_EDGE),
    "_detectors.py:_newest_key_seen:L534:LtE->Lt": ("(last <= tol)", _TOLERANCE_EDGE),
    "_core.py:held:L221:Gt->GtE": ("(checked > tol)", _TOLERANCE_EDGE),
    "_core.py:held:L228:Gt->GtE": ("(moved > tol)", _TOLERANCE_EDGE),
    "_detectors.py:check_future_leakage:L476:Gt->GtE": (
        "move=_rows(B, T, t > c)", "row c joins the rows that must move, but it is also held: if it moves the "
        "verdict is fail either way, and the positive control is read only when no held row moved"),
    "_core.py:perturbed:L99:Lt->LtE": (".amax(-1, keepdim=True) < 1.0", _DRAW_EDGE),
    "_core.py:perturbed:L100:GtE->Gt": ("noise >= x", _DRAW_EDGE),
}

SWAPS = {  # ast operator -> the mutants made of it
    ast.Gt: (ast.GtE, ast.Lt), ast.GtE: (ast.Gt, ast.LtE), ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE),
    ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
}
SYMBOL = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}
OPERATOR = re.compile(rb">=|<=|==|!=|>|<")


@dataclass
class Mutant:
    id: str
    file: str
    function: str
    line: int
    mutation: str
    code: str  # the line it changes, as written
    start: int = field(repr=False)  # byte offsets of the replaced span in the file
    end: int = field(repr=False)
    replacement: str = field(repr=False)


@dataclass
class Outcome:
    id: str
    status: str  # killed | survived | error | timeout
    seconds: float
    detail: str = ""  # the first failing test, or the error


# ---- enumerating mutants ---------------------------------------------------------------------------


class _Source:
    """A file's text with (line, col) -> byte offset; ast's col_offset counts UTF-8 bytes."""

    def __init__(self, path: Path):
        self.data = path.read_bytes()
        self.lines = self.data.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def line(self, n: int) -> str:
        return self.lines[n - 1].decode().rstrip("\n")


def _targets(tree: ast.Module, filename: str):
    """(enclosing name, node) for every node the mutators look at, in source order."""
    for top in tree.body:
        if filename == "_thresholds.py":
            if isinstance(top, (ast.Assign, ast.AnnAssign)):
                names = [t.id for t in (top.targets if isinstance(top, ast.Assign) else [top.target])
                         if isinstance(t, ast.Name)]
                if any(n in THRESHOLD_TABLES for n in names):
                    for node in ast.walk(top.value):
                        yield names[0], node
        elif isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) and top.name.startswith(FUNCTION_PREFIXES):
            for node in ast.walk(top):
                yield top.name, node


def _number(x: float) -> str:
    return f"{x:.6g}"


def mutants_of(filename: str) -> list[Mutant]:
    path = ROOT / PACKAGE / filename
    src = _Source(path)
    tree = ast.parse(src.data, filename=str(path))
    found = []  # (line, col, order, function, mutation, start, end, replacement)

    def add(function, node, order, mutation, start, end, replacement):
        found.append((node.lineno, node.col_offset, order, function, mutation, start, end, replacement))

    for function, node in _targets(tree, filename):
        if filename == "_thresholds.py":
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and not isinstance(node.value, bool):
                start = src.offset(node.lineno, node.col_offset)
                end = src.offset(node.end_lineno, node.end_col_offset)
                for order, (factor, word) in enumerate(((10, "x10"), (0.1, "x0.1"))):
                    add(function, node, order, word, start, end, _number(node.value * factor))
            continue
        if isinstance(node, ast.Compare):
            left = node.left
            for i, (op, right) in enumerate(zip(node.ops, node.comparators)):
                if type(op) in SWAPS:
                    lo = src.offset(left.end_lineno, left.end_col_offset)
                    hi = src.offset(right.lineno, right.col_offset)
                    m = OPERATOR.search(src.data, lo, hi)
                    if m is None or m.group().decode() != SYMBOL[type(op)]:
                        raise RuntimeError(f"{filename}:{node.lineno}: operator {SYMBOL[type(op)]} not found")
                    for order, new in enumerate(SWAPS[type(op)]):
                        add(function, node, 10 * i + order, f"{type(op).__name__}->{new.__name__}", m.start(), m.end(),
                            SYMBOL[new])
                left = right
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert)):
            start = src.offset(node.lineno, node.col_offset)
            end = src.offset(node.operand.lineno, node.operand.col_offset)
            word = "not" if isinstance(node.op, ast.Not) else "~"
            add(function, node, 0, f"drop-{word}", start, end, "")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("any", "all"):
                end = src.offset(func.end_lineno, func.end_col_offset)
                start = end - len(func.attr)
            elif isinstance(func, ast.Name) and func.id in ("any", "all"):
                start = src.offset(func.lineno, func.col_offset)
                end = src.offset(func.end_lineno, func.end_col_offset)
            else:
                continue
            name = src.data[start:end].decode()
            other = "all" if name == "any" else "any"
            add(function, node, 0, f"{name}->{other}", start, end, other)

    found.sort(key=lambda f: (f[5], f[2]))  # by position in the file, then by mutator
    out, seen = [], defaultdict(int)
    for line_no, _, _, function, mutation, start, end, replacement in found:
        line = src.data.count(b"\n", 0, start) + 1
        base = f"{filename}:{function}:L{line}:{mutation}"
        seen[base] += 1
        mid = base if seen[base] == 1 else f"{base}#{seen[base]}"
        out.append(Mutant(mid, filename, function, line, mutation, src.line(line).strip(), start, end, replacement))
    return out


def all_mutants() -> list[Mutant]:
    return [m for f in FILES for m in mutants_of(f)]


def mutated_source(m: Mutant) -> bytes:
    data = (ROOT / PACKAGE / m.file).read_bytes()
    new = data[:m.start] + m.replacement.encode() + data[m.end:]
    compile(new, m.file, "exec")  # a mutant must be valid Python: the mutators only swap tokens
    return new


# ---- running them ----------------------------------------------------------------------------------


CANARY = '''
import os
import diagnostics, diagnostics._core, diagnostics._detectors, diagnostics._thresholds


def test_the_copy_is_what_is_imported():
    root = os.path.realpath(os.environ["MUTATION_COPY"])
    for mod in (diagnostics, diagnostics._core, diagnostics._detectors, diagnostics._thresholds):
        assert os.path.realpath(mod.__file__).startswith(root + os.sep), mod.__file__
'''


def _environment(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", CI="1", HYPOTHESIS_PROFILE="default",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MUTATION_COPY=str(copy))
    return env


def make_copy(parent: Path, n: int) -> Path:
    copy = parent / f"job{n}"
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / name)
    return copy


def _run(copy: Path, command: list[str], timeout: float) -> tuple[int | None, str, float]:
    began = time.monotonic()
    proc = subprocess.Popen(command, cwd=copy, env=_environment(copy), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), time.monotonic() - began
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the pytest this function started, and nothing else
        out, _ = proc.communicate()
        return None, out.decode(errors="replace"), time.monotonic() - began


def check_copy(copy: Path, timeout: float) -> float:
    """The canary (the copy is what pytest imports), then the unmutated tests must pass; their time."""
    canary = copy / "tests" / "test_mutation_canary.py"
    canary.write_text(CANARY)
    try:
        rc, out, _ = _run(copy, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(canary)], timeout)
    finally:
        canary.unlink()
    if rc != 0:
        sys.exit(f"the canary failed: pytest in {copy} does not import the copy of {PACKAGE}\n{out[-3000:]}")
    rc, out, seconds = _run(copy, TEST_COMMAND, timeout)
    if rc != 0:
        sys.exit(f"the unmutated tests do not pass in {copy} (rc={rc}); fix them first\n{out[-3000:]}")
    return seconds


def classify(rc: int | None, out: str) -> tuple[str, str]:
    if rc is None:
        return "timeout", ""
    if rc == 0:
        return "survived", ""
    if rc != 1 or "errors during collection" in out or "ImportError while" in out:
        lines = [ln for ln in out.splitlines() if "Error" in ln]
        return "error", (lines[-1].strip() if lines else f"pytest exit code {rc}")[:300]
    failed = re.search(r"^FAILED (\S+)", out, re.M)
    return "killed", failed.group(1) if failed else "tests failed"


def run_mutants(mutants: list[Mutant], jobs: int, timeout: float | None, log) -> tuple[list[Outcome], float]:
    sources = {m.id: mutated_source(m) for m in mutants}  # all of them valid before anything runs
    parent = Path(tempfile.mkdtemp(prefix="mutations-"))
    try:
        copies = [make_copy(parent, n) for n in range(jobs)]
        baseline = check_copy(copies[0], timeout or 600)
        for c in copies[1:]:
            check_copy(c, timeout or 600)
        limit = timeout or max(60.0, 4 * baseline)
        log(f"baseline: the unmutated tests pass in {baseline:.1f} s; timeout per mutant {limit:.0f} s; "
            f"{len(mutants)} mutants, {jobs} job(s)")
        todo: queue.Queue = queue.Queue()
        for m in mutants:
            todo.put(m)
        results: dict[str, Outcome] = {}
        lock = threading.Lock()

        def worker(copy: Path):
            while True:
                try:
                    m = todo.get_nowait()
                except queue.Empty:
                    return
                target = copy / PACKAGE / m.file
                original = target.read_bytes()
                target.write_bytes(sources[m.id])
                try:
                    rc, out, seconds = _run(copy, TEST_COMMAND, limit)
                finally:
                    target.write_bytes(original)
                status, detail = classify(rc, out)
                with lock:
                    results[m.id] = Outcome(m.id, status, round(seconds, 1), detail)
                    log(f"[{len(results)}/{len(mutants)}] {status:8s} {seconds:5.1f}s {m.id}  {detail}")

        threads = [threading.Thread(target=worker, args=(c,)) for c in copies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [results[m.id] for m in mutants], baseline
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# ---- the report ------------------------------------------------------------------------------------


def equivalents(mutants: list[Mutant], log) -> dict[str, str]:
    by_id = {m.id: m for m in mutants}
    marked = {}
    for mid, (text, reason) in EQUIVALENT.items():
        m = by_id.get(mid)
        if m is None:
            continue  # not in this selection (or gone)
        if text not in m.code:
            log(f"warning: EQUIVALENT mark for {mid} ignored: its line is now `{m.code}`")
            continue
        marked[mid] = reason
    return marked


def report(mutants: list[Mutant], outcomes: list[Outcome], marked: dict[str, str]) -> tuple[str, dict]:
    status = {o.id: o.status for o in outcomes}
    rows = defaultdict(lambda: [0, 0])
    for m in mutants:
        row = rows[(m.file, m.function)]
        row[1] += 1
        row[0] += status[m.id] != "survived"
    lines = [f"{'file':14s} {'function':24s} killed / total"]
    for (f, fn), (k, t) in rows.items():
        lines.append(f"{f:14s} {fn:24s} {k:3d} / {t:3d}")
    by_id = {m.id: m for m in mutants}
    survivors = [o for o in outcomes if o.status == "survived"]
    lines.append("")
    lines.append(f"survivors ({len(survivors)}):")
    for o in survivors:
        m = by_id[o.id]
        note = f"  [equivalent: {marked[o.id]}]" if o.id in marked else ""
        lines.append(f"  {o.id}{note}\n      {m.code}")
    for kind in ("error", "timeout"):
        listed = [o for o in outcomes if o.status == kind]
        if listed:
            lines.append(f"{kind} (counted as killed): " + ", ".join(o.id for o in listed))
    killed = sum(o.status != "survived" for o in outcomes)
    total = len(outcomes)
    counted = total - sum(1 for o in survivors if o.id in marked)
    score = killed / counted if counted else float("nan")
    lines.append("")
    lines.append(f"mutation score: {killed} / {counted} killed = {100 * score:.1f}%"
                 + (f" ({total - counted} marked equivalent and excluded; {killed} / {total} = "
                    f"{100 * killed / total:.1f}% with them)" if counted != total else ""))
    summary = dict(killed=killed, total=total, equivalent=sorted(o.id for o in survivors if o.id in marked),
                   score=score, counts={s: sum(o.status == s for o in outcomes)
                                        for s in ("killed", "error", "timeout", "survived")})
    return "\n".join(lines), summary


def _key(mutant_id: str, code: str) -> str:
    """A mutant named without its line number: file, function, mutation (and #n), and the line's code
    (without a trailing comment, which a re-measured threshold's note may have changed)."""
    return re.sub(r":L\d+:", ":", mutant_id) + " | " + re.sub(r"\s+#.*$", "", code)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--limit", type=int, help="only the first N mutants (after --only), in --list order")
    parser.add_argument("--only", action="append", help="only mutants whose id contains this text (repeatable: any)")
    parser.add_argument("--survivors-of", type=Path, metavar="JSON",
                        help="only the mutants that survived in this earlier --json output (after tests were added)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 4x the unmutated run, >= 60)")
    parser.add_argument("--json", type=Path, help="write every outcome and the score to this file")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")

    mutants = all_mutants()
    if args.survivors_of:
        earlier = json.loads(args.survivors_of.read_text())
        alive = {_key(m["id"], m["code"]) for m in earlier["mutants"] if m["status"] == "survived"}
        mutants = [m for m in mutants if _key(m.id, m.code) in alive]  # matched by code: lines may have moved
    if args.only:
        mutants = [m for m in mutants if any(text in m.id for text in args.only)]
    if args.limit is not None:
        mutants = mutants[:args.limit]
    if args.list:
        for m in mutants:
            print(f"{m.id}\n    {m.code}")
        print(f"{len(mutants)} mutants")
        return 0
    if not mutants:
        parser.error("no mutant matches")

    def log(text: str) -> None:
        print(text, flush=True)

    commit, dirty = _git("rev-parse", "HEAD"), _git("diff", "--stat", "--", PACKAGE)
    log(f"commit {commit}" + (f"; uncommitted changes in {PACKAGE}/:\n{dirty}" if dirty else f"; {PACKAGE}/ clean"))
    began = time.monotonic()
    outcomes, baseline = run_mutants(mutants, args.jobs, args.timeout, log)
    elapsed = time.monotonic() - began
    marked = equivalents(mutants, log)
    table, summary = report(mutants, outcomes, marked)
    print("\n" + table)
    print(f"ran in {elapsed / 60:.1f} min with {args.jobs} job(s); command: python benchmarks/mutations.py"
          + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    if args.json:
        by_id = {m.id: m for m in mutants}
        args.json.write_text(json.dumps(dict(
            commit=commit, uncommitted=dirty, test_command=" ".join(TEST_COMMAND[1:]), jobs=args.jobs,
            seconds=round(elapsed, 1), baseline_seconds=round(baseline, 1), **summary,
            equivalent_reasons={i: r for i, r in marked.items()},
            mutants=[{**{k: v for k, v in asdict(by_id[o.id]).items() if k not in ("start", "end", "replacement")},
                      **asdict(o)} for o in outcomes]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
