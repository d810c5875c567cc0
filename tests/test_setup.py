"""The set-up as a new user meets it: CI runs the README's own commands first, then a slice that explores, then
the `real` extra as the README gives it, then the `zoo` extra (pinned), tests/test_zoo.py and the diffusers sweep's
tests; where the real extra is installed, transformers' Llama classes and timm import in a fresh interpreter (no
workaround of the tests' own); the minimum torch stated in the README is the one pyproject declares, no paragraph of
the README and the docs/ pages appears twice, their links resolve, the README stays a guide of a few hundred lines, the
tests run under `--import-mode=importlib` (nothing is imported from a conftest), and a command line that names a
test file runs in one process rather than on pytest-xdist's workers."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))  # the pages the README links, by task


def _commands(text: str) -> list[str]:
    """Shell lines without comments and blank lines, a line continued with a backslash read as one."""
    text = re.sub(r"\\\n\s*", " ", text)
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
    rest = ci[first + len(readme):]
    at = next(i for i, command in enumerate(rest) if command.startswith("pip "))
    explore, extras = rest[:at], rest[at:]
    # the slow step: the tests marked slow (tests/test_pattern_matrix.py's full matrix), with the real extra installed
    assert extras == [f"pip install {REAL_PAIR}", 'pip install -e ".[test,real]"', "pytest", "pytest -m slow",
                      ZOO_INSTALL,
                      "pytest --slow tests/test_zoo.py tests/test_sweep_diffusers.py tests/test_sweep_packages.py "
                      "tests/test_required_input.py tests/test_required_stream_and_mask.py "
                      "tests/test_required_stream_names.py"]
    assert all(command in README for command in extras[:2]), "the extras as the README gives them"
    assert ZOO_INSTALL in README, "the zoo extra as the README gives it"
    runs = [command for command in explore if "pytest" in command]
    assert any("--hypothesis-profile=explore" in c and '--hypothesis-seed="$seed"' in c for c in runs), explore
    assert any(c.startswith("ATTENTION_TESTS_EVERY_SITE=1 ") and "tests/test_where.py" in c for c in runs), explore
    assert any(c.startswith("seed=") and "git rev-parse" in c for c in explore), "the seed comes from the commit"


# The torch and torchvision that load together on a CPU (see the README): PyPI's torchvision 0.28.0 cannot load
# its extension beside torch 2.13.0's CPU build, and transformers then fails to import.
REAL_PAIR = "torch==2.14.1 torchvision==0.29.1"
# The library zoo (tests/test_zoo.py) on top of the real extra; its skips name this command.
ZOO_INSTALL = 'pip install -e ".[test,real,zoo]"'


def test_the_zoo_extra_pins_each_library_and_its_skip_says_how_to_install_it():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    zoo = re.search(r"^zoo = \[(.*?)\]", pyproject, re.S | re.M).group(1)
    pins = re.findall(r'"([\w.-]+)==([\w.]+)"', zoo)
    assert [name for name, _ in pins] == ["x-transformers", "vit-pytorch", "openai-whisper", "open-clip-torch",
                                          "diffusers"], zoo
    assert len(pins) == zoo.count('"') // 2, f"every library pinned exactly: {zoo}"
    for name in ("test_zoo.py", "test_sweep_diffusers.py", "test_sweep_packages.py"):
        text = (ROOT / "tests" / name).read_text(encoding="utf-8")
        assert f"pip install {REAL_PAIR}, then {ZOO_INSTALL}" in text, f"{name}'s skips say how to install the zoo"


def test_the_explore_profile_draws_more_and_other_examples_than_the_default():
    explore, default = settings.get_profile("explore"), settings.get_profile("default")
    assert explore.max_examples > default.max_examples
    assert not explore.derandomize and explore.database is None  # the seed alone decides, and nothing is kept


FRESH_IMPORT = """
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=2, intermediate_size=64, vocab_size=64))
assert isinstance(model.model.layers[0].self_attn, LlamaAttention)
print("transformers", type(model.model.layers[0].self_attn).__name__)
try:
    import timm
except ModuleNotFoundError:
    print("no timm")
else:
    print("timm", type(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0)).__name__)
"""


def test_the_real_extra_imports_transformers_llama_classes_in_a_fresh_interpreter():
    """In a fresh interpreter, as a user's script meets them (the tests' own torchvision workaround is not
    loaded there): where the extra is installed, transformers' Llama classes build a model, and timm's too."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip(f'the real extra is not installed: pip install {REAL_PAIR}, then pip install -e ".[test,real]"')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", FRESH_IMPORT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "transformers LlamaAttention", done.stdout
    timm_installed = importlib.util.find_spec("timm") is not None
    assert lines[1] == ("timm VisionTransformer" if timm_installed else "no timm"), done.stdout


def test_the_readme_states_the_minimum_torch_that_pyproject_declares():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    minimum = re.search(r'dependencies = \["torch>=([\d.]+)"\]', pyproject).group(1)
    assert f"**Supported torch: {minimum} and later** (`pyproject.toml` says `torch>={minimum}`)" in README


def repeated_paragraphs(text: str) -> list[str]:
    """The paragraphs (blank-line separated, over 80 characters) that appear more than once, in order."""
    seen, repeated = set(), []
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if len(paragraph) > 80 and paragraph in seen and paragraph not in repeated:
            repeated.append(paragraph)
        seen.add(paragraph)
    return repeated


def test_no_paragraph_of_the_readme_or_the_docs_appears_twice():
    """An edit that pastes a section's new version beside its old one leaves two sets of figures (the cost section
    once did: one commit's numbers, then an older one's), and a paragraph moved to docs/ must not stay behind in the
    README; the check itself sees a doubled paragraph."""
    pages = [README, *(page.read_text(encoding="utf-8") for page in DOCS)]
    assert repeated_paragraphs("\n\n".join(pages)) == []
    first = next(p.strip() for p in README.split("\n\n") if len(p.strip()) > 80)
    assert repeated_paragraphs(README + "\n\n" + first + "\n") == [first]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """The relative links of a markdown page whose file, or whose #anchor in that file, does not exist."""
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        linked = (page.parent / target) if target else page
        if not linked.exists():
            broken.append(f"{target}#{anchor}" if anchor else target)
        elif anchor and linked.is_file():
            headings = re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{target}#{anchor}")
    return broken


def test_the_readme_is_a_guide_and_every_docs_page_is_linked_and_links_resolve(tmp_path):
    assert len(README.splitlines()) < 400, "a guide of a few hundred lines: move details to a page under docs/"
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for page in DOCS:
        assert page.name == "index.md" or f"]({page.name})" in index, f"docs/index.md links {page.name}"
    for page in [ROOT / "README.md", *DOCS]:
        assert broken_links(page) == [], page.name
    broken = tmp_path / "page.md"  # the check itself sees a missing file and a missing anchor
    broken.write_text("# Title\n\n[a](missing.md) [b](#title) [c](#nowhere) [d](https://example.com)\n")
    assert broken_links(broken) == ["missing.md", "#nowhere"]


@pytest.mark.slow  # a second pytest process that collects the whole suite again: 10 s of the default run's 160
def test_tests_run_under_import_mode_importlib():
    """`from conftest import ...` fails under importlib mode: the shared values are fixtures now. Collects
    every test module and runs a quick test of a few."""
    quick = ("json_writes_non_finite or dotted_attributes or every_fix_uses_only_public or private_name_check "
             "or options_have_their_own_group")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider", "-q",
                           "-p", "no:xdist",  # five tests: one process, not a worker per core
                           "tests", "-k", quick],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", done.stdout).group(1))
    assert passed >= 5 and "error" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


@pytest.mark.slow  # three pytest processes side by side, each importing torch: about 10 s
def test_a_named_file_runs_in_one_process_unless_workers_are_asked_for():
    """pyproject's addopts start a worker per core (pytest-xdist); a command line that names a test file runs it in
    one process, and says so, unless it asks for workers itself; `-p no:xdist` runs in one process and says so."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: pip install -e '.[test]'")
    one = ["tests/test_setup.py", "-k", "explore_profile"]
    argvs = {"named": one, "asked": ["-n", "2", *one], "blocked": ["-p", "no:xdist", *one]}
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    started = {name: subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for name, argv in argvs.items()}
    out = {name: process.communicate(timeout=300)[0] for name, process in started.items()}
    assert all(process.returncode == 0 for process in started.values()), out
    assert "one process: the command line names test files or tests" in out["named"], out["named"]
    assert "workers" not in out["named"], out["named"]
    assert "created: 2/2 workers" in out["asked"] and "one process" not in out["asked"], out["asked"]
    assert "one process: pytest-xdist is not loaded" in out["blocked"], out["blocked"]
    assert all("1 passed" in text for text in out.values()), out


_CONTROLLER_PROBE = '''
import sys

RAN_ON = {}


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # pytest-xdist's controller: the worker that sent the report
    if node is not None and report.when == "call":
        RAN_ON.setdefault(report.nodeid.split("::")[0], set()).add(node.gateway.id)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):
        imported = [name for name in ("torch", "hypothesis", "buggy_variants") if name in sys.modules]
        print("controller imported:", ", ".join(imported) or "none of torch, hypothesis, buggy_variants")
        print("ran on:", sorted((path, sorted(workers)) for path, workers in RAN_ON.items()))
'''


@pytest.mark.slow  # a pytest run on two workers, each importing torch: about 10 s
def test_the_controller_imports_no_torch_and_the_catalogs_readers_share_a_worker(tmp_path):
    """Under pytest-xdist the controller only hands out tests: it imports neither torch, nor Hypothesis (no
    --hypothesis option is given), nor the catalog. Test modules that read the catalog's session audits
    (tests/conftest.py's SHARED_AUDITS) run on one worker, so the catalog is audited once per run."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: pip install -e '.[test]'")
    (tmp_path / "controller_probe.py").write_text(_CONTROLLER_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    cheap = "test_the_tables_cover or test_no_registered_fix or test_the_observer_records or test_ops_the_audit_runs"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "controller_probe", "-n", "2",
                           "-s", "tests/test_fixes.py", "tests/test_where.py", "-k", cheap],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert "controller imported: none of torch, hypothesis, buggy_variants" in done.stdout, done.stdout[-3000:]
    ran_on = ast.literal_eval(re.search(r"^ran on: (.*)$", done.stdout, re.M).group(1))  # [(path, [worker, ...]), ...]
    assert [path for path, _ in ran_on] == ["tests/test_fixes.py", "tests/test_where.py"], ran_on
    assert len({worker for _, workers in ran_on for worker in workers}) == 1, ran_on


_GC_PROBE = '''
import gc

SEEN = []


def pytest_runtest_call(item):
    SEEN.append((gc.get_threshold(), gc.get_freeze_count() > 0))
'''

_GC_RUN = '''
import gc, sys
import pytest
import gc_probe
gc.set_threshold(1234, 11, 12)
code = pytest.main(["-p", "no:cacheprovider", "-p", "gc_probe", "-q", "tests/test_setup.py", "-k", "explore_profile"])
print("during:", gc_probe.SEEN)
print("after:", (gc.get_threshold(), gc.get_freeze_count()))
sys.exit(code)
'''


@pytest.mark.slow  # a pytest run inside a fresh interpreter: about 5 s
def test_tests_run_with_the_collectors_thresholds_and_a_caller_of_pytest_main_gets_its_own_back(tmp_path):
    """conftest.py runs tests with the cycle collector at `GC_THRESHOLD` and what collection made frozen; a process
    that calls pytest.main() and goes on finds its own thresholds again and nothing left frozen."""
    tree = ast.parse((ROOT / "conftest.py").read_text())  # read, not imported (importlib mode: tests import no conftest)
    GC_THRESHOLD = next(ast.literal_eval(node.value) for node in tree.body
                        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "GC_THRESHOLD")
    (tmp_path / "gc_probe.py").write_text(_GC_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", _GC_RUN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    during = ast.literal_eval(re.search(r"^during: (.*)$", done.stdout, re.M).group(1))
    assert during == [(GC_THRESHOLD, True)], done.stdout[-2000:]
    assert re.search(r"^after: (.*)$", done.stdout, re.M).group(1) == "((1234, 11, 12), 0)", done.stdout[-2000:]


def test_the_license_is_the_mit_text_that_pyproject_names():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^license = \{ text = "MIT" \}', pyproject, re.M)
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n") and "WITHOUT WARRANTY OF ANY KIND" in text


def test_the_version_comes_from_the_installed_metadata_else_from_pyproject(monkeypatch):
    import importlib.metadata as metadata

    import diagnostics

    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert diagnostics.__version__ == metadata.version("attention-mistakes")

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert diagnostics._version() == f"{declared}+source"  # a source tree that pip never installed


def test_py_typed_ships_as_package_data():
    """PEP 561: the marker, and pyproject's package data that puts it into the wheel (the slow test builds one)."""
    assert (ROOT / "diagnostics" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^\[tool\.setuptools\.package-data\]\ndiagnostics = \["py\.typed"\]', pyproject, re.M)


@pytest.mark.slow  # pip builds a wheel: 7 s
def test_the_wheel_holds_py_typed_and_the_license(tmp_path):
    import shutil
    import zipfile

    tree = tmp_path / "tree"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "wheel"), str(tree)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "diagnostics/py.typed" in names and any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
