"""Rules of the package's structure, read from the source with `ast` (no tool, no import of what is checked):

- floors, not circles: no import cycle among `diagnostics` modules, function-level imports counted (an import
  placed inside a function to dodge a loop is still a loop);
- no module imports another module's `_private` name (private *modules* are how internals live; a private name
  inside one is that module's own);
- every registered detector, of a layer or of a model, points at the line (`locate=`) or says why it cannot
  (`unlocated=`); the README's detector table comes from the registry (tests/test_verdicts.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import diagnostics

PACKAGE = Path(diagnostics.__file__).resolve().parent


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = ("diagnostics",) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]  # a module's package; a package is its own
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: Path = PACKAGE) -> dict[str, list[tuple[str, list[str], int]]]:
    """{module: [(imported module, names taken from it, line)]}, every import statement anywhere in the file
    (module level, inside functions, under TYPE_CHECKING), restricted to diagnostics' own modules. `from . import
    x` where x is a submodule imports the submodule."""
    known = modules(root)
    out: dict[str, list[tuple[str, list[str], int]]] = {}
    for name, path in known.items():
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(a.name, [], node.lineno) for a in node.names if a.name in known]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node)
                if target not in known:
                    continue
                names = []
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in known:  # a submodule: an arrow to it, not a name taken from the package
                        found.append((sub, [], node.lineno))
                    else:
                        names.append(alias.name)
                if names:
                    found.append((target, names, node.lineno))
        out[name] = found
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module, or a module importing itself."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def arrows(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules it imports. Importing a package's submodule runs the package's `__init__` first, but
    that is Python's order of loading, not an arrow of the design: a submodule's own parent is not counted."""
    graph = {}
    for name, found in imports(root).items():
        graph[name] = {t for t, _, _ in found if not name.startswith(t + ".")}
    return graph


def test_no_import_cycle_among_diagnostics_modules_counting_function_level_imports():
    circles = cycles(arrows())
    detail = []
    for circle in circles:
        ties = [f"{a} -> {t} (line {n})" for a in circle for t, _, n in imports()[a] if t in circle and t != a]
        detail.append(" ; ".join(ties))
    assert not circles, "import circles (move the shared piece down a floor):\n" + "\n".join(detail)


def test_the_cycle_check_sees_a_circle_hidden_in_a_function(tmp_path):
    """The rule's negative control: a copy of a two-module package whose second module imports the first inside a
    function, as the old `_subject` took `_audit._untouched`, is a circle."""
    package = tmp_path / "diagnostics"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_low.py").write_text("def helper():\n    from ._high import audit  # _high imports this module\n")
    (package / "_high.py").write_text("from ._low import helper\n\ndef audit():\n    return helper()\n")
    assert cycles(arrows(package)) == [["diagnostics._high", "diagnostics._low"]]


def test_no_module_imports_another_modules_private_name():
    taken = [f"{name} takes {t}.{n} (line {line})" for name, found in imports().items()
             for t, names, line in found for n in names if n.startswith("_") and not n.startswith("__")]
    assert not taken, "private names taken across modules (name them as shared where they live):\n" + "\n".join(taken)


def test_the_private_name_rule_sees_a_private_import(tmp_path):
    package = tmp_path / "diagnostics"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text("def _secret():\n    return 1\n")
    (package / "_b.py").write_text("from ._a import _secret\nfrom . import _a  # a private module: allowed\n")
    found = imports(package)["diagnostics._b"]
    assert ("diagnostics._a", ["_secret"], 1) in found and ("diagnostics._a", [], 2) in found


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_every_registered_detector_points_at_the_line_or_says_why_not(scope):
    pytest.importorskip("torch", reason="the registry fills as the detector modules, which use torch, load")
    from diagnostics import _registry

    registry = _registry.REGISTRIES[scope]
    if scope == "model":
        diagnostics.audit_model  # noqa: B018  (loads the model wing, which registers its detectors)
    else:
        diagnostics.DETECTORS  # noqa: B018
    assert registry, f"no {scope} detector is registered"
    silent = [d.id for d in registry.values() if d.locate is None and not d.unlocated]
    assert not silent, f"{silent}: register with locate= or unlocated='why none'"


def test_registering_a_detector_without_a_localiser_or_a_reason_is_refused():
    from diagnostics import _registry  # the registry itself imports no torch

    with pytest.raises(ValueError, match="locate="):
        _registry.detector("no_such_detector", "a property", fix="a fix")(lambda probe: None)
    assert "no_such_detector" not in _registry.DETECTORS
