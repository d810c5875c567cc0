"""The mutator's own rules (benchmarks/mutations.py), on sources written here and on the package as committed: a
module constant whose assignment's first line says `# knob: <why>` is not mutated (a cost knob or a seed's salt,
checked to move no verdict at x10 and x0.1) unless `--knobs` asks for it, and the same constant without the comment
is; the rule is the comment, so every knob in the package gives its reason. Cheap: a few `git show` calls and parses.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

def _benchmark():
    """benchmarks/mutations.py as a module (benchmarks/ is not a package). It reads the committed tree at import
    (git rev-parse, ls-tree): outside a git checkout (an sdist, a mutant's copy) there is nothing to read."""
    name = "mutations_benchmark"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "mutations.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        except (OSError, subprocess.CalledProcessError) as error:
            del sys.modules[name]
            pytest.skip(f"benchmarks/mutations.py reads a git checkout: {error}", allow_module_level=True)
    return sys.modules[name]


bench = _benchmark()

SOURCE = b'''
GAIN = 3.0
SALT = 0x5EED  # knob: a salt for a draw, no threshold
COPIES = {"float32": 8, "float64": 4}  # knob: copies per call, a cost
TABLE = {  # not a knob: a threshold
    "float32": 1e-4,  # knob: on a later line, so not read
}
SEEDS = 12  # knobs are documented in the docstring, this is no mark
'''


def _mutated_constants(knobs: bool) -> set[str]:
    src = bench._Source(SOURCE)
    tree = ast.parse(src.data)
    return {name for name, node, module_constant in bench._targets(tree, src, knobs) if module_constant}


def test_a_constant_marked_knob_is_not_mutated_and_its_unmarked_twin_is():
    """`_targets` skips a constant whose first line carries `# knob:` and keeps the same kind of constant without
    it; a `# knob:` on a later line of the assignment, `# not a knob:` and `# knobs ...` are no mark."""
    assert _mutated_constants(knobs=False) == {"GAIN", "TABLE", "SEEDS"}
    assert _mutated_constants(knobs=True) == {"GAIN", "SALT", "COPIES", "TABLE", "SEEDS"}


def test_a_knob_gives_its_reason():
    src = bench._Source(SOURCE)
    reasons = {top.targets[0].id: bench.knob(src, top) for top in ast.parse(src.data).body}
    assert reasons == {"GAIN": None, "SALT": "a salt for a draw, no threshold", "COPIES": "copies per call, a cost",
                       "TABLE": None, "SEEDS": None}


def test_every_knob_in_the_package_says_why_and_is_mutated_only_on_request():
    """The package's knobs as committed (`_stacked.SEEDED_CALLS` at least): each with a reason, none among the
    mutants by default, each among them with `knobs=True` (what `--knobs` runs to check the claim)."""
    knobs = [(f, name, why) for f in bench.FILES for name, why in bench.knobs_of(f)]
    assert ("detectors/_stacked.py", "SEEDED_CALLS") in {(f, name) for f, name, _ in knobs}
    for file, name, why in knobs:
        assert len(why) > 10, (file, name, why)
        plain = {m.function for m in bench.mutants_of(file) if m.threshold}
        asked = {m.function for m in bench.mutants_of(file, knobs=True) if m.threshold}
        assert name not in plain and name in asked, (file, name)


def test_every_equivalent_mark_names_a_mutant_of_the_committed_code():
    """An EQUIVALENT mark leaves a survivor out of the score; one whose line changed or that names no mutant (a
    `#2` that counts on another line) must not linger, or a new mutant could someday match it unchecked. Read over
    every mutant of the committed tree (~1,600, about a second): a change that moves a marked line fails here, and
    its author checks the mark again."""
    assert bench.unmatched_marks(bench.all_mutants()) == []


def test_a_mark_matches_by_its_lines_text_not_by_its_line_number():
    """`equivalents`: the same mutation on two lines of a function shares a mark's name; only the line holding the
    mark's text is marked."""
    key = "detectors/weights.py:check_weight_row_sums:L*:Lt->LtE"
    text = bench.EQUIVALENT[key][0]
    make = lambda line, code: bench.Mutant(key.replace("L*", f"L{line}"), "detectors/weights.py",
                                           "check_weight_row_sums", line, "compare", "Lt->LtE", code)
    marked, other = make(40, f"    bad = {text}"), make(12, "    if n < 2:")
    assert bench.equivalents([marked, other]) == {marked.id: bench.EQUIVALENT[key][1]}


def test_no_equivalent_mark_is_written_twice():
    """A dict literal keeps the last of two equal keys without a word: a second mark for one mutant would silently
    replace the first's reason. Read from the source."""
    tree = ast.parse(Path(bench.__file__).read_text())
    marks = next(node.value for node in tree.body if isinstance(node, ast.AnnAssign)
                 and getattr(node.target, "id", "") == "EQUIVALENT")
    keys = [k.value for k in marks.keys]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_a_journal_gives_back_its_own_commits_outcomes_and_runs_nothing_it_holds(tmp_path):
    """`--journal`: a long run in pieces. The outcomes journaled at this commit with the module's test selection as it
    is now are taken as they are (nothing is run: no copy of the tree is made); a line of another commit, or one
    measured with other tests, is not reused."""
    mutant = next(m for m in bench.all_mutants(False) if m.file == "detectors/weights.py")
    tests = bench.tests_for(mutant.file)
    journal = tmp_path / "all.jsonl"
    line = lambda commit, tests, status: bench.json.dumps(dict(commit=commit, file=mutant.file, tests=tests,
                                                               id=mutant.id, status=status, seconds=1.0, detail=""))
    journal.write_text("\n".join([line("other", tests, "survived"), line("this", tests[:1] + ["x.py"], "survived"),
                                  line("this", tests, "killed")]) + "\n")
    assert {k: o.status for k, o in bench.read_journal(journal, "this").items()} == {mutant.id: "killed"}
    assert bench.read_journal(journal, "another") == {}
    logged = []
    outcomes = bench.run_mutants([mutant], 1, None, logged.append, journal, "this")
    assert [(o.id, o.status) for o in outcomes] == [(mutant.id, "killed")]
    assert logged and logged[0].startswith("1 of the 1 mutants decided at this commit already"), logged


def test_a_mutant_is_run_against_the_tests_that_enter_its_function_or_read_its_constant():
    """The covered selection: a test that never enters the changed code runs as it does unmutated, so only the tests
    that enter it are run. A function's mutant reaches its own function (a nested function lies within its lines); a
    module constant's reaches every function that reads it. A failing test is never selected (it would "kill" every
    mutant), and a wider fixture's calls count for every test that uses it (a test may only read its value)."""
    reach = bench.Reach()
    mutants = bench.all_mutants(False)
    in_code = next(m for m in mutants if m.file == "detectors/weights.py" and not m.threshold)
    spans = reach.of(in_code)
    assert len(spans) == 1 and spans[0][0] == in_code.file and spans[0][1] <= in_code.line <= spans[0][2], spans
    constant = next(m for m in mutants if m.threshold and m.function == "CONVEX")
    readers = reach.of(constant)
    assert readers and all(lo <= hi for _, lo, hi in readers), readers
    assert any(f == "detectors/variance.py" for f, _, _ in readers), readers  # where CONVEX is judged
    assert not any(lo <= constant.line <= hi for f, lo, hi in readers if f == constant.file)  # its line: no function

    f, lo, hi = spans[0]
    row = lambda own=(), setup=(), shared=(), passed=True: dict(own=own, setup=setup, shared=shared, seconds=1.0,
                                                                passed=passed)
    calls = bench.Calls.merged({
        "t::enters_nested": row(own=[[f, hi]]), "t::elsewhere": row(own=[[f, hi + 1], ["other.py", lo]]),
        "t::fails": row(own=[[f, lo]], passed=False), "t::builds_fixture": row(setup=[[f, lo]], shared=["session:x"]),
        "t::reads_fixture": row(shared=["session:x"]), "t::other_fixture": row(shared=["session:y"])})
    assert calls.tests(spans) == ["t::enters_nested", "t::builds_fixture", "t::reads_fixture"]
    assert calls.tests(((f, hi + 1, hi + 1),)) == ["t::elsewhere"]


def test_the_map_of_calls_records_what_each_passing_test_enters_and_leaves_out_failures(pytester, monkeypatch,
                                                                                       tmp_path):
    """benchmarks/_mutation_calls.py in a pytest of its own (a subprocess, as the benchmark runs it): a test that
    calls a package function is mapped to it (file, first line), one that calls none to nothing, and a failing one is
    marked so (the benchmark leaves it out: it would "kill" every mutant)."""
    root = Path(bench.__file__).resolve().parents[1]
    line = next(i for i, text in enumerate((root / "diagnostics" / "_change.py").read_text().splitlines(), 1)
                if text.startswith("def relative_change("))
    pytester.makepyfile(test_inner="""
        import torch
        from diagnostics._change import relative_change

        def test_calls():
            assert relative_change(torch.ones(2, 3), torch.ones(2, 3)).max() == 0

        def test_calls_nothing():
            assert True

        def test_fails():
            relative_change(torch.ones(2, 3), torch.ones(2, 3))
            assert False
    """)
    monkeypatch.setenv("MUTATION_COPY", str(root))
    monkeypatch.setenv("MUTATION_CALLS", str(tmp_path))
    monkeypatch.setenv("PYTEST_PLUGINS", "_mutation_calls")
    monkeypatch.setenv("PYTHONPATH", f"{root}{__import__('os').pathsep}{root / 'benchmarks'}")
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0").assert_outcomes(passed=2, failed=1)
    rows = {}
    for part in tmp_path.glob("calls-*.json"):
        rows.update(bench.json.loads(part.read_text()))
    assert ["_change.py", line] in rows["test_inner.py::test_calls"]["own"], rows["test_inner.py::test_calls"]
    assert rows["test_inner.py::test_calls_nothing"]["own"] == []
    assert [r["passed"] for r in rows.values()] == [True, True, False], rows
