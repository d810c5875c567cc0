"""benchmarks/pypi_bugs.py (real bugs audited from the PyPI releases that have them and the releases that fixed
them): its table and its line logic here, without the network; one case end to end in the slow run, skipped with
the reason where its releases can be neither found in the cache nor downloaded."""

from __future__ import annotations

import importlib.util
import io
import sys
import zipfile
from pathlib import Path

import pytest


def _benchmark():
    """benchmarks/pypi_bugs.py as a module (benchmarks/ is not a package; this also runs under importlib mode)."""
    name = "pypi_bugs_benchmark"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "pypi_bugs.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = _benchmark()


def test_cases_are_well_formed():
    """Unique ids; two distinct versions, the fixed one later; a commit, issue or pull-request URL; a build that
    compiles and defines the layer and its declarations; deps pinned as NAME==VERSION."""
    ids = [c.id for c in bench.CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 8
    for case in bench.CASES:
        buggy, fixed = (tuple(int(p) for p in v.split(".")) for v in (case.buggy, case.fixed))
        assert buggy < fixed, case.id
        assert case.url.startswith("https://github.com/") and any(f"/{kind}/" in case.url
                                                                   for kind in ("commit", "issues", "pull"))
        assert case.fix_line > 0 and case.file.endswith(".py") and case.what and case.kind
        code = compile(case.build, case.id, "exec")
        assert {"layer", "declarations"} <= set(code.co_names), case.id
        for dep in case.deps:
            assert bench._dist_name(dep)[1], dep


def test_changed_lines_on_both_sides():
    """A replaced line is itself on both sides; an insertion in the fixed release is, on the buggy side, the
    lines around where it goes; a deletion the other way round."""
    buggy = ["a", "b", "c", "d"]
    assert bench.changed_lines(buggy, ["a", "B", "c", "d"]) == ([2], [2])
    assert bench.changed_lines(buggy, ["a", "b", "new", "c", "d"]) == ([2, 3], [3])
    assert bench.changed_lines(buggy, ["a", "c", "d"]) == ([2], [1, 2])
    assert bench.changed_lines(buggy, buggy) == ([], [])


def test_check_case_refuses_a_fix_line_that_did_not_change(tmp_path):
    case = bench.Case("x", "k", "pkg", "1.0", "1.1", "m.py", 2, "https://github.com/o/r/commit/abc", "w", "")
    (tmp_path / "b").mkdir(), (tmp_path / "f").mkdir()
    (tmp_path / "b" / "m.py").write_text("a\nx = 1\nc\n")
    (tmp_path / "f" / "m.py").write_text("a\nx = 2\nc\n")
    assert bench.check_case(case, tmp_path / "b", tmp_path / "f") == [2]
    wrong = bench.Case("x", "k", "pkg", "1.0", "1.1", "m.py", 3, case.url, "w", "")
    with pytest.raises(ValueError, match="expected the fix at m.py:3"):
        bench.check_case(wrong, tmp_path / "b", tmp_path / "f")
    (tmp_path / "f" / "m.py").write_text("a\nx = 1\nc\n")
    with pytest.raises(ValueError, match="is the same"):
        bench.check_case(case, tmp_path / "b", tmp_path / "f")


def test_release_dir_unpacks_a_cached_wheel_and_refuses_offline(tmp_path):
    """A wheel already in the cache is unpacked once, its root is the import root; with --offline a release
    that is not cached is an error that names the fix, not a download."""
    folder = tmp_path / "pkg-1.0"
    folder.mkdir()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("pkg/__init__.py", "X = 1\n")
        z.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    (folder / "pkg-1.0-py3-none-any.whl").write_bytes(buffer.getvalue())
    root = bench.release_dir("pkg==1.0", tmp_path, offline=True)
    assert (root / "pkg" / "__init__.py").read_text() == "X = 1\n"
    assert bench.release_dir("pkg==1.0", tmp_path, offline=True) == root
    with pytest.raises(FileNotFoundError, match="without --offline"):
        bench.release_dir("other==2.0", tmp_path, offline=True)


def test_localise_reads_the_site_then_its_callers(tmp_path):
    case = bench.Case("x", "k", "pkg", "1.0", "1.1", "m.py", 1, "https://github.com/o/r/commit/abc", "w", "")
    (tmp_path / "m.py").write_text("\n" * 40)
    target, other = str(tmp_path / "m.py"), str(tmp_path / "einops.py")
    assert bench.localise(case, tmp_path, [10], [["d", target, 12, []]])[:2] == (True, True)
    assert bench.localise(case, tmp_path, [10], [["d", target, 13, []]])[:2] == (False, False)
    assert bench.localise(case, tmp_path, [10], [["d", other, 10, [[target, 9]]]])[:2] == (False, True)


def _outcome(kind, buggy, fixed, localised=False, error=""):
    case = bench.Case(f"{kind}-{buggy}-{fixed}", kind, "pkg", "1.0", "1.1", "m.py", 1,
                      "https://github.com/o/r/commit/abc", "w", "")
    return bench.Outcome(case, [1], {"status": buggy, "fired": {"runs": "fail"} if buggy == "failed" else {}},
                         {"status": fixed, "fired": {}}, localised, localised, [], 1.0, error)


def test_table_and_totals_per_kind():
    outcomes = [_outcome("masking", "failed", "passed", True), _outcome("masking", "passed", "inconclusive"),
                _outcome("crash", "failed", "passed"), _outcome("crash", "-", "-", error="pip download failed")]
    text = bench.table(outcomes)
    assert "| yes (failed: runs) | yes | yes |" in text and "| no (passed) | no (inconclusive) | - |" in text
    assert "not run: pip download failed" in text
    totals = bench.totals(outcomes).splitlines()
    assert "- crash: caught 1/1, fixed passed 1/1, localised 0/1" in totals[0] and "1 not run" in totals[0]
    assert totals[1].startswith("- masking: caught 1/2, fixed passed 1/2, localised 1/1")
    assert totals[2].startswith("- all: caught 2/3, fixed passed 2/3, localised 1/2")


@pytest.mark.slow
def test_one_case_end_to_end(tmp_path):
    """The talking-heads case from its two releases: the buggy release fails at the fix's line, the fixed passes.
    Uses the default cache where it holds the releases, else downloads them; skips saying why when it cannot."""
    case = next(c for c in bench.CASES if c.id == "xtr_talking_heads_post_softmax")
    try:
        outcome = bench.run_case(case, bench.CACHE)
    except Exception as error:  # noqa: BLE001 (any failure to reach the index is a reason to skip, said)
        pytest.skip(f"releases not available: {error}")
    if outcome.error:
        pytest.skip(f"releases not available (no cache at {bench.CACHE} and no package index): {outcome.error}")
    assert outcome.buggy["status"] == "failed" and outcome.fixed["status"] == "passed", outcome
    assert outcome.localised, outcome.sites


def test_a_true_finding_is_said_and_counted_apart():
    case = bench.Case("t", "batch", "pkg", "1.0", "1.1", "m.py", 1, "https://github.com/o/r/commit/abc", "w", "",
                      true_finding="the padding mask zeroes values only (confirmed by a script)")
    outcome = bench.Outcome(case, [1], {"status": "failed", "fired": {"runs": "fail"}},
                            {"status": "failed", "fired": {"mask_honoured": "fail"}}, True, True, [], 1.0)
    assert "no (failed: mask_honoured), a true finding confirmed outside the audit" in bench.table([outcome])
    assert "zeroes values only" in bench.table([outcome], verbose=True)
    assert "fixed passed 0/1 (+1 failed for a confirmed true finding)" in bench.totals([outcome])


def test_a_release_that_does_not_build_is_not_run_not_a_miss():
    """A release that cannot be built under this torch (performer 1.1.x calls torch.qr, gone in torch 2.14) says so
    and is left out of the totals, not counted as a bug the audit missed."""
    case = bench.Case("b", "batch", "pkg", "1.0", "1.1", "m.py", 1, "https://github.com/o/r/commit/abc", "w", "")
    outcome = bench.Outcome(case, [1], {"status": "did not build", "error": "RuntimeError: torch.qr was removed"},
                            {"status": "did not build", "error": "RuntimeError: torch.qr was removed"})
    assert "not run: buggy release did not build: RuntimeError: torch.qr was removed" in bench.table([outcome])
    assert bench.totals([outcome]).splitlines()[-1] == "- all: caught 0/0, fixed passed 0/0, localised 0/0 " \
                                                       "(0/0 counting the lines that called a site's op); 1 not run"


_MAX_BEFORE_MASK = """
import torch
from torch import nn

class Layer(nn.Module):
    # one head over (B, T, 32): the row max subtracted before (or after) the padding mask, as {where}
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3))

    def forward(self, x, mask=None):
        s = self.q(x) @ self.k(x).transpose(-2, -1) / 32 ** 0.5  # (B, T, T)
        if {before}:
            s = s - s.amax(-1, keepdim=True).detach()
        s = s.masked_fill(~mask[:, None, :], -torch.finfo(s.dtype).max)
        if not {before}:
            s = s - s.amax(-1, keepdim=True).detach()
        return s.softmax(-1) @ self.v(x)

layer = Layer()
"""


@pytest.mark.parametrize("before", [True, False])
def test_the_padded_keys_script_asserts_a_max_over_padded_keys_and_only_that(before):
    """The script that confirms memory-efficient-attention 0.0.5's true finding, on a layer that takes its row max
    over every key before masking (as 0.0.5 does: the padded tokens move the bfloat16 outputs) and on its twin that
    takes it after (as 0.0.14 does: they move them by exactly 0, and the script refuses)."""
    import torch

    build = _MAX_BEFORE_MASK.format(before=before, where="0.0.5 does" if before else "0.0.14 does")
    torch.manual_seed(0)
    script = bench.padded_keys_move_outputs("bfloat16", least=0.1)
    if before:
        exec(script, {"BUILD": build})
    else:
        with pytest.raises(AssertionError, match="moved by 0.00e\\+00 of their RMS: the mask is honoured"):
            exec(script, {"BUILD": build})


_VIEW_OR_RESHAPE = """
import torch
from torch import nn

class Layer(nn.Module):
    # dot attention of (B, Tq, D) queries over a (B, Tk, D) context, its query flattened with {how}
    def __init__(self):
        super().__init__()
        self.linear_in = nn.Linear(32, 32, bias=False)

    def forward(self, query, context):
        B, T, D = query.shape  # batch, query length, width
        query = self.linear_in(query.{how}(B * T, D)).{how}(B, T, D)
        return (query @ context.transpose(1, 2)).softmax(-1) @ context

layer = Layer()
"""


@pytest.mark.parametrize("how", ["view", "reshape"])
def test_the_non_contiguous_query_script_asserts_a_view_and_only_that(how):
    """The script that confirms pytorch-nlp 0.2.0's true finding, on a layer that flattens its query with `.view` (a
    transposed query raises, as 0.2.0's does) and on its twin with `.reshape` (it runs, and the script refuses)."""
    script = bench._NON_CONTIGUOUS_QUERY_RAISES
    if how == "view":
        exec(script, {"BUILD": _VIEW_OR_RESHAPE.format(how=how), "load": None})
    else:
        with pytest.raises(AssertionError, match="a non-contiguous query ran"):
            exec(script, {"BUILD": _VIEW_OR_RESHAPE.format(how=how), "load": None})


_NORM_APPLIED_OR_NOT = """
import torch
from torch import nn

class Block(nn.Module):
    # one-head attention over the pixels of a (B, C, H, W) image, its GroupNorm {where}
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(8, 32)
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        B, C, H, W = x.shape  # batch, channels, height, width
        t = ({applied}).flatten(2).transpose(1, 2)  # (B, T, C)
        q, k, v = self.qkv(t).chunk(3, -1)
        out = (q @ k.transpose(1, 2) / C ** 0.5).softmax(-1) @ v  # (B, T, C)
        return out.transpose(1, 2).reshape(B, C, H, W) + x

layer = Block()
"""


@pytest.mark.parametrize("applied", [False, True])
def test_the_norm_script_asserts_a_norm_never_applied_and_only_that(applied):
    """The script that confirms labml-nn 0.4.131's true finding, on a block that never applies its GroupNorm (as
    0.4.131's does) and on its twin that applies it (the output moves with its parameters, and the script refuses)."""
    build = _NORM_APPLIED_OR_NOT.format(where="applied" if applied else "never applied",
                                        applied="self.norm(x)" if applied else "x")
    if not applied:
        exec(bench._NORM_NEVER_APPLIED, {"BUILD": build, "load": None})
    else:
        with pytest.raises(AssertionError, match="move the output: it is applied"):
            exec(bench._NORM_NEVER_APPLIED, {"BUILD": build, "load": None})
