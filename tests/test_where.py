"""Findings point at the line: `DetectorResult.where`.

Each catalog variant overrides one method of the reference, so the first site of each of its expected
findings must lie in that method (the site's own line, or the caller's line when the op ran in a shared
helper of `correct/_sdpa.py`). The never-seen broken layers of tests/test_never_seen.py mark their buggy line
`# BUG`: the first site must be that line. Correct layers get no finding and no site. The default run
checks float32 at torch's initialisation and a subset of the never-seen layers; the thorough profile
(`pytest --hypothesis-profile=thorough`) checks every setting the catalog is tested at and every layer, and so
does `ATTENTION_TESTS_EVERY_SITE=1 pytest tests/test_where.py`, which `.ci/run` runs (71 passed, none skipped,
in 14 s with `CI=1` on 2 shared cores).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

import correct
import diagnostics
from buggy_variants import VARIANTS
from buggy_variants.teaching_report import KILL_MATRIX_SIZE
from diagnostics import Site
from diagnostics._core import relative_change
from diagnostics._observe import Matmul, Observer, Scaling, SoftmaxCall

pytest_plugins = ["pytester"]


def _never_seen():
    """tests/test_never_seen.py's layers, loaded from its path (tests import nothing from each other by name, so
    that the suite also runs under --import-mode=importlib)."""
    path = Path(__file__).with_name("test_never_seen.py")
    spec = importlib.util.spec_from_file_location("never_seen_layers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


never_seen = _never_seen()


EVERY_SITE = "ATTENTION_TESTS_EVERY_SITE"  # set to 1: every setting and every never-seen layer, at any profile


def thorough() -> bool:
    """Every localisation case runs: under the thorough profile, or where EVERY_SITE=1 (CI sets it)."""
    return (settings().max_examples > settings.get_profile("default").max_examples
            or os.environ.get(EVERY_SITE) == "1")


UNLESS_THOROUGH = f"under --hypothesis-profile=thorough or {EVERY_SITE}=1 (as .ci/run does)"


def method_lines(vid: str) -> tuple[str, range]:
    """The file and line range of the one method the variant overrides."""
    variant = VARIANTS[vid]
    method = getattr(variant.cls, variant.step)
    lines, start = inspect.getsourcelines(method)
    return str(Path(inspect.getsourcefile(method)).resolve()), range(start, start + len(lines))


def lines_of(site: Site) -> list[tuple[str, int]]:
    """The site's line and its callers' lines: an op in a helper is read with the line that called it."""
    return [(str(Path(site.file).resolve()), site.line)] + [(str(Path(f).resolve()), n) for f, n, _ in site.callers]


def assert_in_method(report, vid: str) -> None:
    file, span = method_lines(vid)
    for det in VARIANTS[vid].expected_detectors:
        result = report.result(det)
        assert result.fired, f"{det} did not fire on {vid}"
        assert result.where, f"{det} on {vid}: no site ({result.message})"
        first = result.where[0]
        assert any(f == file and n in span for f, n in lines_of(first)), (
            f"{det} on {vid}: first site {first.describe()} is not in {VARIANTS[vid].cls.__name__}."
            f"{VARIANTS[vid].step} ({file}:{span.start}-{span.stop - 1})")


# ---- the catalog -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vid", sorted(VARIANTS))
def test_each_expected_finding_points_into_the_overridden_method(vid, catalog_audits):
    """float32, torch's initialisation, the kill matrix's size: the audits the kill matrix already made."""
    assert_in_method(catalog_audits[vid], vid)


def test_the_correct_twins_have_no_finding_and_no_site():
    for causal in (False, True):
        torch.manual_seed(0)
        layer = correct.MultiHeadAttention(**KILL_MATRIX_SIZE, causal=causal)
        report = diagnostics.audit(layer, causal=causal)
        assert report.passed and not report.findings, str(report)
        assert all(r.where == () for r in report.results)
        assert "where:" not in str(report)


OTHER_SETTINGS = [(dtype, init) for dtype in (torch.float32, torch.bfloat16, torch.float16)
                  for init in ("default", "gpt2")][1:]


@pytest.mark.parametrize("dtype, init", OTHER_SETTINGS, ids=lambda x: str(x).replace("torch.", ""))
def test_every_setting_of_the_kill_matrix_points_into_the_method(dtype, init):
    if not thorough():
        pytest.skip(f"the {len(OTHER_SETTINGS)} other settings run {UNLESS_THOROUGH}")
    for vid, variant in sorted(VARIANTS.items()):
        torch.manual_seed(0)
        layer = variant.build(**KILL_MATRIX_SIZE)
        if init == "gpt2":
            correct.gpt2_init_(layer)
        layer = layer.to(dtype)
        assert_in_method(diagnostics.audit(layer, **variant.audit_kwargs(layer)), vid)
        torch.manual_seed(0)
        twin = variant.reference(**KILL_MATRIX_SIZE)
        if init == "gpt2":
            correct.gpt2_init_(twin)
        report = diagnostics.audit(twin.to(dtype), **variant.audit_kwargs(twin))
        assert not report.findings and all(r.where == () for r in report.results), str(report)


# ---- never-seen layers -----------------------------------------------------------------------------------

BUG_LINES = {n for n, line in enumerate(Path(never_seen.__file__).read_text().splitlines(), 1) if "# BUG" in line}
NEVER_SEEN = {name: (make, set(must), twin) for name, (make, must, twin) in never_seen.BROKEN.items()}
NEVER_SEEN.update({name: (make, {det}, twin) for name, (make, det, twin) in never_seen.SECOND_CHAPTER.items()})
# Not localised to the `# BUG` line, and why (benchmarks/localisation.py counts them as misses):
KNOWN_MISSES: dict = {  # name: the op the first site names instead (a part of its name), or None for no site
    # none left: "online softmax without rescale" had no site until its accumulator's add was located
    # (`_tracing.unrescaled_accumulators`, 2026-12-04); it is checked against its # BUG line like the others
}
DEFAULT_RUN = ("einsum without scale", "padding mask read transposed", "keys centred over the batch",
               "causal mask one token too wide")


@pytest.mark.parametrize("name", sorted(NEVER_SEEN))
def test_never_seen_layers_point_at_their_bug_line(name):
    if name not in DEFAULT_RUN and not thorough():
        pytest.skip(f"every never-seen layer runs {UNLESS_THOROUGH}; the default run checks {len(DEFAULT_RUN)}")
    make, must, _ = NEVER_SEEN[name]
    located = {d for d, entry in diagnostics.DETECTORS.items() if entry.locate is not None}
    if not must <= located:
        pytest.skip(f"{', '.join(sorted(must - located))}: no localisation for this detector yet")
    torch.manual_seed(0)
    layer, kw = make()
    report = diagnostics.audit(layer, **kw)
    for det in sorted(must):
        where = report.result(det).where
        if name in KNOWN_MISSES:  # pinned as it is, so that a change of either kind is seen
            expected = KNOWN_MISSES[name]
            assert (expected in where[0].op) if where and expected else (not where and expected is None), (name, where)
            assert not where or where[0].line not in BUG_LINES
            continue
        assert where, f"{name}: {det} has no site"
        assert Path(where[0].file).resolve() == Path(never_seen.__file__).resolve() and where[0].line in BUG_LINES, (
            f"{name}: {det} points at {where[0].describe()}, not at its # BUG line")


@pytest.mark.parametrize("name", sorted(NEVER_SEEN))
def test_the_correct_twins_of_never_seen_layers_have_no_site(name):
    if name not in DEFAULT_RUN and not thorough():
        pytest.skip(f"every twin runs {UNLESS_THOROUGH}")
    make, _, make_twin = NEVER_SEEN[name]
    torch.manual_seed(0)
    _, kw = make()
    torch.manual_seed(0)  # the twin from the broken layer's seed: the same weights where the two are alike
    report = diagnostics.audit(make_twin(), **kw)
    assert report.passed and all(r.where == () for r in report.results if not r.fired), str(report)
    assert set(report.fired()) <= {"fully_masked_rows"}, str(report)


# ---- recording and showing sites -------------------------------------------------------------------------


def scaled_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)  # line +1
    scores = scores / math.sqrt(q.shape[-1])  # line +2
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0) @ v  # line +5


def unscaled_attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)  # the missing scale belongs on this line
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def test_the_observer_records_the_users_line_of_each_op():
    first = inspect.getsourcelines(scaled_attention)[1]
    q = torch.randn(2, 2, 5, 4)
    with Observer() as observer:
        scaled_attention(q, q, q)
    kinds = [(type(e).__name__, e.frames[0][1] - first, e.frames[0][0].co_name) for e in observer.record.order]
    assert kinds == [("Matmul", 1, "scaled_attention"), ("Scaling", 2, "scaled_attention"),
                     ("SoftmaxCall", 5, "scaled_attention"), ("Matmul", 5, "scaled_attention")]
    assert all(isinstance(e, (Matmul, Scaling, SoftmaxCall)) for e in observer.record.order)


def test_ops_the_audit_runs_itself_have_no_user_frame():
    """Converting a mask, cutting the output: ops of diagnostics, never a site."""
    new, old = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    with Observer() as observer:
        relative_change(new, old)  # divides (2, 3) changes by the RMS: a Scaling event
    assert observer.record.order and all(e.frames == () for e in observer.record.order)


def test_a_report_shows_its_sites_in_text_and_json():
    report = diagnostics.audit(unscaled_attention, d_model=64, num_heads=2)
    result = report.result("softmax_saturation")
    assert repr(result.where) == "Sites(<not read yet>)"  # found only when read
    line = inspect.getsourcelines(unscaled_attention)[1] + 1
    assert result.where[0].line == line and result.where[0].function == "unscaled_attention"
    assert result.where[0].code == "scores = q @ k.transpose(-2, -1)  # the missing scale belongs on this line"
    assert "multiplied by 1; expected 0.1768 = 1/sqrt(32)" in result.where[0].note
    text = str(report)
    assert f"test_where.py:{line} in unscaled_attention: scores = q @ k.transpose(-2, -1)" in text
    shown = json.loads(json.dumps(report.to_dict()))
    where = next(r for r in shown["results"] if r["detector"] == "softmax_saturation")["where"]
    assert where[0]["line"] == line and where[0]["op"] == "aten.bmm" and where[0]["file"].endswith("test_where.py")
    assert pickle.loads(pickle.dumps(report)).result("softmax_saturation").where == result.where  # as the sites
    twin = diagnostics.audit(scaled_attention, d_model=64, num_heads=2)
    assert twin.passed and all(r["where"] == [] for r in twin.to_dict()["results"])


USER_LAYER = '''
import torch


def unscaled(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0) @ v


def scaled(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0) @ v
'''


def _line_of(path: Path, code: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip() == code)


@pytest.fixture
def user_layer(tmp_path, monkeypatch):
    (tmp_path / "wherelayer.py").write_text(USER_LAYER)
    monkeypatch.delitem(sys.modules, "wherelayer", raising=False)  # each test its own scratch copy
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_command_prints_file_line_message_lines(user_layer, capsys):
    from diagnostics import _cli

    assert _cli.main(["wherelayer:unscaled", "--d-model", "64", "--num-heads", "2"]) == 1
    out = capsys.readouterr().out
    assert "\nwherelayer.py:6: error: softmax_saturation: softmax is 5.66x too sharp" in out
    assert "\nwherelayer.py:9: note: softmax_saturation: aten._softmax; " in out
    assert _cli.main(["wherelayer:scaled", "--d-model", "64", "--num-heads", "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert all(r["where"] == [] for r in shown["results"]) and shown["status"] == "passed"


def test_the_plugin_failure_shows_where(pytester, monkeypatch):
    pytester.makepyfile(wherelayer=USER_LAYER)
    monkeypatch.delitem(sys.modules, "wherelayer", raising=False)
    monkeypatch.syspath_prepend(str(pytester.path))
    broken = pytester.runpytest_inprocess("-p", "diagnostics.pytest_plugin", "--attention-audit=wherelayer:unscaled",
                                          "-k", "softmax_saturation", "-p", "no:cacheprovider")
    broken.assert_outcomes(failed=1)
    line = _line_of(pytester.path / "wherelayer.py", "scores = q @ k.transpose(-2, -1)")
    broken.stdout.fnmatch_lines([f"*where:    wherelayer.py:{line} in unscaled: scores = q @ k.transpose(-2, -1)  "
                                 "[[]aten.bmm;*"])
    correct_one = pytester.runpytest_inprocess("-p", "diagnostics.pytest_plugin", "--attention-audit=wherelayer:scaled",
                                               "-k", "softmax_saturation", "-p", "no:cacheprovider")
    correct_one.assert_outcomes(passed=1)


def test_to_html_lists_the_sites_of_each_finding(user_layer):
    import wherelayer

    broken = diagnostics.audit(wherelayer.unscaled, d_model=64, num_heads=2)
    broken.to_html(user_layer / "broken.html")
    page = (user_layer / "broken.html").read_text()
    assert '<ol class="where"><li><code class="site">wherelayer.py:6</code> in <code>unscaled</code>' in page
    assert "<pre>scores = q @ k.transpose(-2, -1)</pre>" in page
    twin = diagnostics.audit(wherelayer.scaled, d_model=64, num_heads=2)
    twin.to_html(user_layer / "twin.html")
    assert 'class="where"' not in (user_layer / "twin.html").read_text()


def test_the_teaching_report_highlights_the_line_in_each_diff(teaching_report_html):
    """Every variant's section marks a line of its method's diff as where the audit points."""
    for vid in VARIANTS:
        section = teaching_report_html.split(f'id="variant-{vid}"', 1)[1].split("</section>", 1)[0]
        assert ' hit" title="the audit points here: ' in section, vid
    missing_scale = teaching_report_html.split('id="variant-missing_scale"', 1)[1].split("</section>", 1)[0]
    assert ('<span class="add hit" title="the audit points here: softmax_saturation">+    return scores  # the '
            '1/sqrt(d_k) is gone</span>') in missing_scale
