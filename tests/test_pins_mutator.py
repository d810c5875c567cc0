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



def _repeated_marks(source: str) -> list[str]:
    """The keys written more than once in the EQUIVALENT literal of `source` (read from the source: the dict has
    already dropped all but the last)."""
    marks = next(node.value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.AnnAssign)
                 and isinstance(node.target, ast.Name) and node.target.id == "EQUIVALENT")
    keys = [key.value for key in marks.keys]
    return sorted({k for k in keys if keys.count(k) > 1}) or ([] if keys else ["(no marks read)"])


def test_no_equivalent_mark_is_written_twice():
    """EQUIVALENT's keys name a kind of mutant per function (`L*`), and a dict literal keeps the last of two equal
    keys: a second block marking the same kind would silently drop the first mark and its reason. Twin: a literal
    with a key written twice is read so."""
    source = (Path(__file__).resolve().parents[1] / "benchmarks" / "mutations.py").read_text(encoding="utf-8")
    assert _repeated_marks(source) == []
    assert _repeated_marks('EQUIVALENT: dict = {"a.py:f:L*:Gt->GtE": 1, "b": 2, "a.py:f:L*:Gt->GtE": 3}') == [
        "a.py:f:L*:Gt->GtE"]
