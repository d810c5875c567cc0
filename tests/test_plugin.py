"""The pytest plugin, run by pytester in a scratch directory holding a user's own layers: one test per
detector for `--attention-audit=module:obj` and one for the audit's status, failures with evidence and fix,
inconclusive audits, --attention-require / --attention-strict, and the `attention_audit` fixture."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import torch

import diagnostics
from diagnostics import DETECTORS

pytest_plugins = ["pytester"]

# The plugin by name (also fine where its entry point loaded it); in-process runs see this package already
# imported, which pytest reports when its entry point asks to rewrite its asserts: not the subject here.
PLUGIN = ("-p", "diagnostics.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning")

# A user's own module (after conftest's `user_attention_source`): a correct attention, the same without the
# scale, and one that ignores causality.
LAYERS = '''

class NoMask(Attention):
    def forward(self, x):  # takes no mask: causal only if it builds its own, which it does not
        return super().forward(x)


correct = Attention()


def broken():
    return Attention(scaled=False)

'''


@pytest.fixture(scope="module", autouse=True)
def _audit_imports_loaded():
    """The first audit in a process imports torch's compiler stack (for its dispatch mode; ~800 modules,
    about 2 s). pytester's in-process runs drop the modules imported during a run, so load them once here."""
    diagnostics.audit(torch.nn.functional.scaled_dot_product_attention, seq_len=2)


def outcomes(source: str, target: str, **options) -> dict:
    """The plugin's outcomes for `--attention-audit=mylayers:<target>`, from the same audit run here: one test per
    detector (a pass or a warning passes, a fail or an error fails, a skip skips) and audit_status (fails only
    when the audit is inconclusive). Counted from the registry's verdicts, so that a detector added to it does
    not change what these tests check: that each verdict reaches its test."""
    namespace: dict = {}
    exec(compile(source, "mylayers.py", "exec"), namespace)
    layer = namespace[target]
    layer = layer if isinstance(layer, torch.nn.Module) else layer()  # a layer, or a factory (`broken`)
    report = diagnostics.audit(layer, **options)
    verdicts = [r.verdict for r in report.results]
    inconclusive = report.status == "inconclusive"
    return {"passed": verdicts.count("pass") + verdicts.count("warn") + (not inconclusive),
            "failed": verdicts.count("fail") + verdicts.count("error") + inconclusive,
            "skipped": verdicts.count("skip")}


@pytest.fixture
def scratch(pytester: pytest.Pytester, user_attention_source) -> pytest.Pytester:
    pytester.makepyfile(mylayers=user_attention_source + LAYERS)
    return pytester


def test_correct_layer_passes_one_test_per_detector(scratch):
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct", "-v", "-rs")
    assert result.ret == pytest.ExitCode.OK
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == len(DETECTORS) + 1  # and audit_status
    assert "failed" not in outcomes
    for detector in DETECTORS:
        result.stdout.fnmatch_lines([f"attention-audit::{detector}[[]mylayers:correct[]] *"])
    result.stdout.fnmatch_lines(["attention-audit::audit_status[[]mylayers:correct[]] PASSED*"])
    # not causal: the causal detectors skip, saying how to enable them with this plugin's own option
    result.stdout.fnmatch_lines(["*SKIPPED*future_leakage: not applicable: the layer is not audited as causal "
                                 "(pass --attention-causal if it promises causality)*"])


def test_broken_layer_fails_its_detector_with_evidence_and_fix(scratch, user_attention_source):
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:broken")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    expected = outcomes(user_attention_source + LAYERS, "broken")
    assert expected["failed"] == 2 and expected["skipped"] >= 6  # softmax_saturation, own_weights; the causal and mask ones
    result.assert_outcomes(**expected, warnings=1)  # passed includes audit_status, conclusive
    result.stdout.fnmatch_lines([
        "*attention audit of mylayers:broken: softmax_saturation*",
        "FAIL softmax_saturation: softmax is 2.83x too sharp*",
        "  layer:    Attention (a module given one stream, d_model=32 from its `d_model`, num_heads=4 from its `num_heads`)*",
        "  evidence: q·k is multiplied by 1 before the softmax*expected 0.3536*",
        "  fix:      scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)*",
        "FAILED attention-audit::softmax_saturation[[]mylayers:broken[]]*",
    ])


def test_causal_option_catches_a_layer_that_leaks_the_future(scratch):
    leaking = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:NoMask", "--attention-causal")
    assert leaking.ret == pytest.ExitCode.TESTS_FAILED
    leaking.stdout.fnmatch_lines(["FAIL future_leakage: outputs depend on future tokens*",
                                  "  evidence: * past outputs changed*"])
    masked = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:Attention", "--attention-causal")
    assert masked.ret == pytest.ExitCode.OK  # the audit passes it causal masks


def test_each_target_carries_its_own_declarations_over_the_sessions(scratch):
    """Twins in one run: the same leaking layer fails future_leakage where its target declares it causal, and is not
    audited for it where it does not, while a masked layer declared causal passes; a target's declaration wins over the session's option; what is not a declaration of the
    layer (an output option, a second target, a misspelling) is a collection error naming the fix."""
    run = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:NoMask --causal", "--attention-audit=mylayers:NoMask",
                            "--attention-audit=mylayers:Attention --causal", "-rA", "-k", "future_leakage")
    assert run.ret == pytest.ExitCode.TESTS_FAILED
    run.assert_outcomes(failed=1, passed=1, skipped=1, deselected=3 * len(DETECTORS))
    run.stdout.fnmatch_lines(["PASSED *future_leakage?mylayers:Attention --causal?*",
                              "SKIPPED *future_leakage: not applicable: the layer is not audited as causal*",
                              "FAILED *future_leakage?mylayers:NoMask --causal?*"])
    over = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:NoMask --causal", "--attention-causal",
                             "--attention-audit=mylayers:NoMask --seq-len 4", "-k", "future_leakage")
    over.assert_outcomes(failed=2, deselected=2 * len(DETECTORS))  # the session's --attention-causal holds for both
    for words, said in [("--json", "--json is not a declaration of the layer"),
                        ("other:layer", "a second target is not a declaration of the layer"),
                        ("--casual", "unrecognized arguments: --casual")]:
        wrong = scratch.runpytest(*PLUGIN, f"--attention-audit=mylayers:NoMask {words}")
        assert wrong.ret == pytest.ExitCode.INTERRUPTED
        wrong.stdout.fnmatch_lines([f"--attention-audit=mylayers:NoMask {words}: expected declarations after the "
                                    f"target*{said}*Fix: check `attention-audit --help`"])


def test_warning_passes_with_an_attention_audit_warning(scratch):
    # masked_fill(-inf) then softmax: a query with no key to attend gets NaN, which warns, not fails
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct", "-k", "fully_masked_rows")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, deselected=len(DETECTORS), warnings=1)  # the others and audit_status
    result.stdout.fnmatch_lines(["*mylayers.py:*: AttentionAuditWarning: *fully_masked_rows: a query whose every "
                                 "key is masked gets NaN*"])


def test_a_target_that_cannot_be_loaded_is_a_collection_error(scratch):
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:does_not_exist")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["--attention-audit=mylayers:does_not_exist: expected mylayers to define "
                                 "'does_not_exist'; got no attribute*Fix: check the name"])
    missing = scratch.runpytest(*PLUGIN, "--attention-audit=no_such_module:layer")
    assert missing.ret == pytest.ExitCode.INTERRUPTED
    missing.stdout.fnmatch_lines(["*expected an importable module 'no_such_module'*"])
    too_short = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct", "--attention-seq-len=0")
    assert too_short.ret == pytest.ExitCode.INTERRUPTED
    too_short.stdout.fnmatch_lines(["--attention-seq-len: expected a length >= 1; got 0.*"])
    too_long = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:Block", "--attention-seq-len=9")
    assert too_long.ret == pytest.ExitCode.INTERRUPTED
    too_long.stdout.fnmatch_lines(["--attention-audit=mylayers:Block: expected seq_len <= 8, the longest sequence "
                                   "the layer takes (the (1, 1, 8, 8) buffer bias); got --attention-seq-len 9. "
                                   "Fix: pass --attention-seq-len 8 or less"])


def test_an_inconclusive_audit_fails_its_status_test_with_the_reason(scratch):
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:linear_only")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert result.parseoutcomes()["failed"] == 1
    result.stdout.fnmatch_lines(["*attention audit of mylayers:linear_only: status*",
                                 "INCONCLUSIVE LinearOnly (a module given one stream, d_model=32 from its `d_model`, num_heads=4 from its `num_heads`)",
                                 "  inconclusive: the attention itself was not measured*",
                                 "FAILED attention-audit::audit_status[[]mylayers:linear_only[]]*"])


def test_strict_and_require_turn_skips_into_failures(scratch, user_attention_source):
    strict = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:linear_only", "--attention-strict")
    strict.stdout.fnmatch_lines(["FAIL weight_row_sums: required but not measured*",
                                 "*evidence: --attention-strict demands that weight_row_sums measures the layer*"])
    assert "FAILED attention-audit::audit_status" not in strict.stdout.str()  # failed, so no longer inconclusive
    required = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct", "--attention-require=future_leakage")
    expected = outcomes(user_attention_source + LAYERS, "correct", require=["future_leakage"])
    assert expected["failed"] == 1  # future_leakage, required
    required.assert_outcomes(**expected, warnings=1)
    required.stdout.fnmatch_lines(["FAIL future_leakage: required but not applicable*",
                                   "*evidence: --attention-require demands that future_leakage measures the layer*"])
    unknown = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct", "--attention-require=no_such")
    assert unknown.ret == pytest.ExitCode.INTERRUPTED
    unknown.stdout.fnmatch_lines(["--attention-require: expected detector ids from *; got no_such. Fix: *"])


def test_a_detector_that_crashes_fails_its_test_with_the_internal_error(scratch):
    scratch.makeconftest("""
        import dataclasses

        from diagnostics import DETECTORS, _core

        saved = DETECTORS["eval_determinism"]


        def crash(probe):  # raises inside diagnostics' own code: an error, not a finding about the layer
            return _core.baseline_scale(None)


        def pytest_configure(config):
            DETECTORS["eval_determinism"] = dataclasses.replace(saved, check=crash)


        def pytest_unconfigure(config):
            DETECTORS["eval_determinism"] = saved
    """)
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct")
    result.stdout.fnmatch_lines(["ERROR eval_determinism: the detector crashed: AttributeError: *",
                                 "*evidence: an internal error of diagnostics*",
                                 "FAILED attention-audit::eval_determinism[[]mylayers:correct[]]*",
                                 "FAILED attention-audit::audit_status[[]mylayers:correct[]]*"])
    assert result.parseoutcomes()["failed"] == 2


def test_audit_items_join_the_users_own_tests(scratch, user_attention_source):
    scratch.makepyfile(test_mine="def test_mine():\n    assert True\n")
    result = scratch.runpytest(*PLUGIN, "--attention-audit=mylayers:correct", "--attention-audit=mylayers:broken")
    correct, broken = (outcomes(user_attention_source + LAYERS, target) for target in ("correct", "broken"))
    assert correct["failed"] == 0 and broken["failed"] == 2  # softmax_saturation, own_weights
    result.assert_outcomes(passed=1 + correct["passed"] + broken["passed"], failed=2,
                           skipped=correct["skipped"] + broken["skipped"], warnings=2)


def test_fixture_returns_the_report_and_fails_with_it(scratch):
    scratch.makepyfile(test_uses_fixture='''
        import mylayers

        def test_correct(attention_audit):
            report = attention_audit(mylayers.correct, causal=True)
            assert report.passed and report.causal

        def test_broken(attention_audit):
            attention_audit(mylayers.broken())

        def test_inconclusive(attention_audit):
            attention_audit(mylayers.linear_only)
    ''')
    result = scratch.runpytest(*PLUGIN)
    result.assert_outcomes(passed=1, failed=2, warnings=2)
    result.stdout.fnmatch_lines(["*test_inconclusive*", "attention audit of LinearOnly*: INCONCLUSIVE*"])
    result.stdout.fnmatch_lines([
        "*test_broken*",
        "attention audit of Attention (a module given one stream, d_model=32 from its `d_model`, num_heads=4 from its `num_heads`): FAILED*",
        "FAIL softmax_saturation: softmax is 2.83x too sharp*",
        "  fix:      scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)*",
    ])
    assert "def check(" not in result.stdout.str()  # the user's failure, not the plugin's frames


def test_a_marker_declares_one_targets_options_for_the_fixture(scratch):
    """Per-target declarations: the same leaking layer fails where a marker declares it causal and passes beside
    it where none does; a module's marker reaches every test, the closest marker wins, the call's keywords win over
    markers, and a parametrized case carries its own."""
    scratch.makepyfile(test_declared='''
        import pytest

        import mylayers

        pytestmark = pytest.mark.attention_audit(seq_len=8)  # every audit in this file

        @pytest.mark.attention_audit(causal=True)
        def test_declared_causal(attention_audit):
            attention_audit(mylayers.NoMask())  # leaks the future: fails

        def test_undeclared(attention_audit):  # the twin: the same layer, not declared causal
            report = attention_audit(mylayers.NoMask())
            assert report.seq_len == 8 and not report.causal

        @pytest.mark.attention_audit(causal=True)
        def test_the_call_wins(attention_audit):
            assert not attention_audit(mylayers.NoMask(), causal=False).causal

        @pytest.mark.attention_audit(seq_len=6)
        class TestClass:
            @pytest.mark.attention_audit(seq_len=4)
            def test_closest_wins(self, attention_audit):
                assert attention_audit(mylayers.correct).seq_len == 4

            def test_class_over_module(self, attention_audit):
                assert attention_audit(mylayers.correct).seq_len == 6

        @pytest.mark.parametrize("layer", [
            pytest.param(mylayers.NoMask(), id="causal", marks=pytest.mark.attention_audit(causal=True)),  # fails
            pytest.param(mylayers.NoMask(), id="not_causal"),
        ])
        def test_per_case(attention_audit, layer):
            attention_audit(layer)

        @pytest.mark.attention_audit(causl=True)
        def test_misspelt(attention_audit):
            pass
    ''')
    result = scratch.runpytest(*PLUGIN)
    result.assert_outcomes(passed=5, failed=2, errors=1, warnings=2)
    result.stdout.fnmatch_lines(["*test_declared_causal*", "*FAIL future_leakage*"])
    result.stdout.fnmatch_lines(["FAILED test_declared.py::test_declared_causal - *",
                                 "FAILED test_declared.py::test_per_case[[]causal[]] - *"])
    result.stdout.fnmatch_lines(["*ERROR at setup of test_misspelt*", "*expected @pytest.mark.attention_audit(...) "
                                 "to name audit()'s keywords only (causal, d_model, *); got causl=. Fix: e.g. *"])


def test_options_have_their_own_group(scratch):
    result = scratch.runpytest(*PLUGIN, "--help")
    result.stdout.fnmatch_lines(["audit attention layers for silent mistakes*", "*--attention-audit=MODULE:OBJECT*",
                                 "*--attention-causal*", "*--attention-seq-len=N*", "*--attention-require=DET*",
                                 "*--attention-strict*"])


def test_the_plugin_is_installed_as_a_pytest11_entry_point():
    try:
        distribution = importlib.metadata.distribution("attention-mistakes")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the package is not installed here: pip install -e \".[test]\" registers the plugin")
    names = {ep.name: ep.value for ep in distribution.entry_points if ep.group == "pytest11"}
    # the layer and model audit's plugin, and the sharded audit's fixture (its own, so that it loads no torch either)
    assert names == {"diagnostics.pytest_plugin": "diagnostics.pytest_plugin",
                     "diagnostics.distributed.pytest_plugin": "diagnostics.distributed.pytest_plugin"}


def test_loading_the_plugin_imports_no_torch(pytester):
    """The entry point loads the plugin into every pytest run wherever the package is installed: a run that
    uses neither its options nor its fixture must not pay for importing torch (over a second)."""
    pytester.makepyfile(test_light="""
        import sys

        def test_torch_not_imported():
            assert "diagnostics.pytest_plugin" in sys.modules
            assert "torch" not in sys.modules, "the plugin imported torch"
    """)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_readme_fixture_example_runs_on_the_readme_layer(pytester):
    readme = Path(__file__).resolve().parent.parent / "README.md"
    section = readme.read_text().split("## Audit your own layer\n", 1)[1].split("\n## ", 1)[0]
    layer, test_file = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    assert "class MyAttention" in layer and test_file.startswith("# test_my_attention.py")
    pytester.makepyfile(my_attention=layer, test_my_attention=test_file)
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=1, warnings=1)  # the README says: it warns of NaN on a fully masked row


DECLARED = '''
import torch
import torch.nn.functional as F


def windowed(q, k, v, width=4):  # a causal sliding window of `width` keys, the query's own included; no mask
    i = torch.arange(q.shape[-2]).unsqueeze(-1) + k.shape[-2] - q.shape[-2]  # (Tq, 1)
    j = torch.arange(k.shape[-2])  # (Tk,)
    own = (j <= i) & (i - j < width)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=own)


def windowed_5(q, k, v):  # BUG: one key too many
    return windowed(q, k, v, width=5)


def per_query_additive(q, k, v, mask=None):  # mask: additive (B, Tq, Tk), no head axis
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.unsqueeze(1))
'''


def test_the_plugin_takes_a_pattern_and_a_mask_shape_and_refuses_what_does_not_parse(pytester):
    pytester.makepyfile(declaredlayers=DECLARED)
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    pytester.syspathinsert()
    args = [*PLUGIN, "-p", "no:randomly"]
    windowed = pytester.runpytest(*args, "--attention-audit=declaredlayers:windowed",
                                  "--attention-pattern=sliding_window(4)")
    assert windowed.ret == 0, windowed.stdout.str()
    twin = pytester.runpytest(*args, "--attention-audit=declaredlayers:windowed_5", "--attention-pattern=sliding_window(4)")
    assert twin.ret == pytest.ExitCode.TESTS_FAILED
    twin.stdout.fnmatch_lines(["*attention_pattern*declaredlayers:windowed_5*"])
    shaped = pytester.runpytest(*args, "--attention-audit=declaredlayers:per_query_additive",
                                "--attention-mask-convention=additive:B,Tq,Tk")
    assert shaped.ret == 0, shaped.stdout.str()
    bad = pytester.runpytest(*args, "--attention-audit=declaredlayers:windowed", "--attention-pattern=sliding_window(")
    assert bad.ret == pytest.ExitCode.INTERRUPTED
    bad.stdout.fnmatch_lines(["*expected --attention-pattern to name patterns*"])
    bad_mask = pytester.runpytest(*args, "--attention-audit=declaredlayers:windowed",
                                  "--attention-mask-convention=sideways")
    assert bad_mask.ret == pytest.ExitCode.INTERRUPTED
    bad_mask.stdout.fnmatch_lines(["*expected a mask convention from the shortcuts*got --attention-mask-convention "
                                   "sideways*"])
