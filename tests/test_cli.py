"""The command line, `attention-audit module:obj` and `python -m diagnostics`, on a user's own layers in a
scratch directory: exit 0 passed, 1 failed, 2 usage errors with a one-line message, 3 inconclusive; --json
parses."""

from __future__ import annotations

import atexit
import gc
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import diagnostics
from diagnostics import DETECTORS, _cli

README = Path(__file__).resolve().parent.parent / "README.md"

# A user's own module (after conftest's `user_attention_source`): an einsum attention, correct and without the
# scale, as a layer, a class and factories.
LAYERS = '''


class EinsumAttention(Attention):  # the name these tests audit it by
    pass


class Unmasked(EinsumAttention):
    def forward(self, x):
        return super().forward(x)


def attention(q, k, v, mask=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def two_arguments(q, k):
    return q


class NeedsArguments(nn.Module):
    def __init__(self, d_model):
        super().__init__()


correct = EinsumAttention()
not_a_layer = 3
recurrent = torch.nn.LSTM(8, 8, batch_first=True)  # not attention: a usage error, not a FAILED audit


def unscaled():
    return EinsumAttention(scaled=False)


def failing_factory():
    raise RuntimeError("no GPU here")


'''


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, user_attention_source) -> Path:
    """A directory holding the user's module `userlayers.py` (and one that fails to import)."""
    path = tmp_path_factory.mktemp("scratch")
    (path / "userlayers.py").write_text(user_attention_source + LAYERS)
    (path / "badimport.py").write_text("import torch\nraise ValueError('config file missing')\n")
    return path


def _command() -> list[str]:
    script = Path(sys.executable).parent / "attention-audit"
    return [str(script)] if script.exists() else [sys.executable, "-m", "diagnostics"]


@pytest.fixture(scope="module")
def runs(scratch) -> dict[str, subprocess.CompletedProcess]:
    """The command run for real, in the scratch directory, the two runs side by side (each pays for a fresh
    Python importing torch, 3 s of CPU on this project's 2-core machine): `python -m diagnostics` on a broken
    layer, and the installed command on a correct one whose reader closes the pipe before the report is written
    (`| head` stopping early). What needs no process of its own (the JSON, a usage error's exit 2 and its one
    line) runs in-process below, through the same `main`. One thread each: layers far too small to gain from more."""
    argvs = {
        "broken": [sys.executable, "-m", "diagnostics", "userlayers:unscaled"],
        "closed_pipe": _command() + ["userlayers:correct"],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)  # the command's own warnings, as a user sees them
    started = {name: subprocess.Popen(argv, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for name, argv in argvs.items()}
    started["closed_pipe"].stdout.close()  # the reader is gone long before the audit (seconds away) prints
    done = {}
    for name, process in started.items():
        if name == "closed_pipe":
            out, err = "", process.stderr.read()
            process.wait(timeout=300)
        else:
            out, err = process.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(argvs[name], process.returncode, out, err)
    return done


def test_command_exits_0_on_a_correct_layer_and_json_parses(in_scratch, capsys):
    assert _cli.main(["userlayers:correct", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["status"] == "passed" and report["status_reason"] == ""
    assert [r["detector"] for r in report["results"]] == list(DETECTORS)
    assert report["layer"].startswith("EinsumAttention (a module given one stream, d_model=32 from its `d_model`, num_heads=4 from its `num_heads`)")


def test_command_exits_1_on_a_broken_layer_and_prints_the_table(runs):
    run = runs["broken"]
    assert run.returncode == 1, run.stderr
    assert run.stdout.startswith("attention audit of EinsumAttention (a module given one stream, d_model=32 from its `d_model`, num_heads=4 from its `num_heads`): FAILED")
    assert re.search(r"^  softmax_saturation +FAIL +softmax is 2\.83x too sharp", run.stdout, re.M)
    assert "fix:      scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)" in run.stdout


def test_command_prints_no_numpy_warning_where_numpy_is_absent(runs):
    """The README's CPU set-up installs torch without NumPy, and torch warns about it at import: the command
    silences that one warning (this venv has no NumPy, as the README's set-up; elsewhere there is nothing to
    silence and the test still holds)."""
    for name, run in runs.items():
        assert "NumPy" not in run.stderr and "Warning" not in run.stderr, (name, run.stderr)


def test_a_reader_that_stops_early_gets_no_traceback(runs):
    run = runs["closed_pipe"]
    assert "BrokenPipeError" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 0  # the audit's own status: it passed, only the reader stopped


def test_only_the_command_itself_freezes_the_collector_at_exit(in_scratch, monkeypatch, capsys):
    """The command (argv read from sys.argv) skips the interpreter's last walk over every object for cycles by
    freezing them at exit; a caller that passes argv keeps its collector as it was."""
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: registered.append(fn))
    assert _cli.main(["userlayers:correct"]) == 0 and registered == []
    monkeypatch.setattr(sys, "argv", ["attention-audit", "userlayers:correct"])
    assert _cli.main() == 0 and registered == [gc.freeze]
    capsys.readouterr()


def test_console_script_is_installed():
    try:
        distribution = importlib.metadata.distribution("attention-mistakes")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the package is not installed here: pip install -e \".[test]\" adds the command")
    scripts = {ep.name: ep.value for ep in distribution.entry_points if ep.group == "console_scripts"}
    assert scripts == {"attention-audit": "diagnostics._cli:main"}
    assert _command()[0].endswith("attention-audit")  # the closed-pipe run above used it


# ---- the same entry point in-process: every path through it, at the audit's own cost --------------------


@pytest.fixture
def in_scratch(scratch, monkeypatch):
    """Run `_cli.main` as if from the scratch directory; sys.path and the user's modules are put back after."""
    monkeypatch.chdir(scratch)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("userlayers", "badimport"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in ("userlayers", "badimport"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("target, causal, status", [
    ("userlayers:correct", False, 0),  # a layer
    ("userlayers:EinsumAttention", True, 0),  # a class, built with no arguments; causal through its mask
    ("userlayers:unscaled", False, 1),  # a zero-argument factory
    ("userlayers:attention", True, 0),  # an attention function f(q, k, v, mask=None)
    ("userlayers:Unmasked", True, 1),  # takes no mask and is not causal: leaks
])
def test_exit_status_follows_the_audit(in_scratch, capsys, target, causal, status):
    assert _cli.main([target] + (["--causal"] if causal else [])) == status
    out = capsys.readouterr().out
    assert out.startswith("attention audit of ") and ("PASSED" if status == 0 else "FAILED") in out.splitlines()[0]
    if target == "userlayers:Unmasked":
        assert re.search(r"^  future_leakage +FAIL +outputs depend on future tokens", out, re.M)


@pytest.mark.parametrize("argv, words", [
    (["userlayers"], "expected a target of the form pkg.module:object; got 'userlayers'"),
    (["userlayers:does_not_exist"], "expected userlayers to define 'does_not_exist'; got no attribute 'does_not_exist'"),
    (["no_such_module:layer"], "expected an importable module 'no_such_module'"),
    (["badimport:layer"], "expected module 'badimport' to import; it raised ValueError: config file missing"),
    (["userlayers:not_a_layer"], "expected an attention layer, a class or a zero-argument factory; got "
                                 "userlayers:not_a_layer = int 3"),
    (["userlayers:NeedsArguments"], "expected class userlayers:NeedsArguments to build with no arguments"),
    (["userlayers:recurrent"], "expected an attention layer: a function f(q, k, v, mask=None) or an nn.Module; got "
                               "torch.nn.LSTM, a recurrent layer"),
    (["userlayers:failing_factory"], "expected factory userlayers:failing_factory() to return a layer; it raised "
                                     "RuntimeError: no GPU here"),
    (["userlayers:two_arguments"], "expected a function f(q, k, v, mask=None) on (B, H, T, d) tensors; got a "
                                   "function of 2 positional argument(s)"),
    (["userlayers:correct", "--seq-len", "0"], "expected --seq-len >= 1; got 0"),
    (["userlayers:correct", "--num-heads", "5"], "expected d_model divisible by num_heads (a head takes d_model / "
                                                 "num_heads of the width); got d_model=32 and num_heads=5"),
    (["userlayers:correct", "--num-heads", "0"], "expected num_heads >= 1; got --num-heads 0"),
    (["userlayers:EinsumAttention", "--d-model", "30"], "expected d_model to match the width of the layer's "
                                                        "projections (nn.Linear in_features [32]); got --d-model 30. "
                                                        "Fix: pass the layer's width, --d-model 32"),
    (["userlayers:Block"], "expected seq_len <= 8, the longest sequence the layer takes (the (1, 1, 8, 8) buffer "
                           "bias); got --seq-len 16 (the default). Fix: pass --seq-len 8 or less"),
    (["userlayers:Block", "--seq-len", "9"], "got --seq-len 9. Fix: pass --seq-len 8 or less"),
    (["userlayers:attention", "--d-model", "32", "--num-heads", "3"], "got d_model=32 and num_heads=3"),
])
def test_usage_errors_exit_2_with_one_line_saying_what_was_expected(in_scratch, capsys, argv, words):
    assert _cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("attention-audit: error: ")
    assert words in captured.err and "Fix: " in captured.err


def test_html_report_or_a_usage_error_where_the_html_writer_is_absent(in_scratch, capsys, scratch):
    page = scratch / "report.html"
    status = _cli.main(["userlayers:correct", "--html", str(page)])
    captured = capsys.readouterr()
    try:
        import diagnostics._html  # noqa: F401  (written separately; absent in some versions)
    except ImportError:
        assert status == 2 and captured.out == ""
        assert "expected HTML reports (diagnostics._html)" in captured.err
    else:
        assert status == 0 and page.exists() and f"wrote {page}" in captured.err


def test_html_path_in_a_missing_directory_is_a_usage_error_before_the_audit(in_scratch, capsys, monkeypatch):
    def no_audit(*args, **kwargs):
        raise AssertionError("the audit ran although its report could not be written")

    monkeypatch.setattr("diagnostics._audit.audit", no_audit)
    assert _cli.main(["userlayers:correct", "--html", "/no/such/dir/a.html"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("attention-audit: error: expected --html /no/such/dir/a.html in an existing "
                                   "directory; got no directory '/no/such/dir'. Fix: create it first")


def test_an_audit_that_measured_nothing_exits_3_and_says_why(in_scratch, capsys):
    assert _cli.main(["userlayers:linear_only"]) == _cli.EXIT_INCONCLUSIVE == 3
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("attention audit of LinearOnly") and "INCONCLUSIVE" in out.splitlines()[0]
    assert "inconclusive: the attention itself was not measured" in out


def test_strict_and_require_turn_skips_into_failures(in_scratch, capsys):
    assert _cli.main(["userlayers:linear_only", "--strict"]) == 1  # its "not measured" skips now fail
    assert re.search(r"^  weight_row_sums +FAIL +required but not measured", capsys.readouterr().out, re.M)
    assert _cli.main(["userlayers:correct", "--require", "future_leakage", "--require", "causal_alignment"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^  future_leakage +FAIL +required but not applicable", out, re.M)
    assert "evidence: --require demands that causal_alignment measures the layer" in out
    assert _cli.main(["userlayers:correct", "--require", "no_such_detector"]) == 2
    assert "no_such_detector" in capsys.readouterr().err


def test_messages_name_the_commands_own_options(in_scratch, capsys):
    assert _cli.main(["userlayers:correct", "--json"]) == 0
    results = {r["detector"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert results["future_leakage"]["verdict"] == "skip"
    message = results["future_leakage"]["message"]
    assert "--causal" in message and "causal=True" not in message, message


def test_json_carries_the_status_and_its_reason(in_scratch, capsys):
    assert _cli.main(["userlayers:linear_only", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "inconclusive" and report["passed"] is False
    assert report["status_reason"].startswith("inconclusive: the attention itself was not measured")


def test_help_documents_every_exit_status(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 passed, 1 failed, 2 usage error, 3 inconclusive" in text
    assert "--require DET" in text and "--strict" in text
    for status in ("0  passed", "1  failed", "2  usage", "3  inconclusive"):
        assert status in _cli.__doc__


def test_a_layer_that_fits_its_block_size_is_audited(in_scratch, capsys):
    """The twin of the block_size usage error: at the length the layer takes, the audit runs."""
    assert _cli.main(["userlayers:Block", "--seq-len", "8"]) == 0
    assert "PASSED (seq_len=8" in capsys.readouterr().out


class _Terminal:
    def __init__(self, tty: bool):
        self.tty, self.written = tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.written.append(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty, seq_len, shown", [(True, 32, True), (True, 16, False), (False, 32, False)])
def test_progress_bar_on_a_terminal_for_long_audits_only(in_scratch, capsys, monkeypatch, tty, seq_len, shown):
    """A tqdm-style bar on stderr, redrawn before each detector and erased at the end, where stderr is a terminal
    and the audit is estimated long (here: from seq_len 32 on, the 4-head float32 layer's maps of 256 KiB); a short
    audit, or one whose stderr is a file or a pipe, shows nothing."""
    from diagnostics import _memory, _progress

    long_maps = _memory.estimate(seq_len=32, num_heads=4, dtype=torch.float32) - _memory.BASE
    monkeypatch.setattr(_progress, "LONG_MAPS", long_maps)
    stderr = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    assert _cli.main(["userlayers:correct", "--seq-len", str(seq_len)]) == 0
    text = "".join(stderr.written)
    if not shown:
        assert text == ""
        return
    total = len(DETECTORS)
    draws = text.split("\r\x1b[K")[1:]
    assert draws[-1] == ""  # erased at the end: the report starts on a clean line
    assert [re.match(r"auditing +\d+%\|[#█ ]{20}\| (\d+)/(\d+) \[\d\d:\d\d<(\?|\d\d:\d\d)\] (\w+)$", d).group(1, 2, 4)
            for d in draws[:-1]] == [(str(i), str(total), det) for i, det in enumerate(DETECTORS)]


def test_progress_false_turns_the_bar_off_in_python(monkeypatch):
    from diagnostics import _progress

    monkeypatch.setattr(_progress, "LONG_MAPS", 0)  # every audit is long
    stderr = _Terminal(True)
    monkeypatch.setattr(sys, "stderr", stderr)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    diagnostics.audit(sdpa, seq_len=4, detectors=["runs", "weight_row_sums"], progress=False)
    assert stderr.written == []
    diagnostics.audit(sdpa, seq_len=4, detectors=["runs", "weight_row_sums"])  # the twin: None, the default, shows it
    assert "".join(stderr.written).count("/2 [") == 2


def test_a_model_audit_draws_no_bar_per_layer(monkeypatch):
    """audit_model audits each layer with audit(); on a terminal, where every audit counts as long, no layer's bar is
    drawn over the model audit's own stages (one per layer would be noise); a layer audit there shows its bar."""
    from buggy_variants.teaching_model import TinyGPT
    from diagnostics import _progress

    monkeypatch.setattr(_progress, "LONG_MAPS", 0)  # every audit is long
    stderr = _Terminal(True)
    monkeypatch.setattr(sys, "stderr", stderr)
    torch.manual_seed(0)
    model = TinyGPT(n_layer=1)
    diagnostics.audit_model(model, seq_len=8, causal=True)
    assert "auditing " not in "".join(stderr.written)
    diagnostics.audit(model.h[0].attn, seq_len=8, causal=True, detectors=["runs"])  # the twin: one layer, a bar
    assert "auditing " in "".join(stderr.written)


def test_json_writes_non_finite_numbers_as_strings():
    assert _cli._jsonable({"a": [math.inf, -math.inf, math.nan, 1.5, "x"]}) == {"a": ["inf", "-inf", "nan", 1.5, "x"]}


def test_targets_resolve_dotted_attributes_inside_the_module():
    assert _cli.resolve("torch.nn.functional:scaled_dot_product_attention") is \
        torch.nn.functional.scaled_dot_product_attention
    assert _cli.resolve("diagnostics:AuditReport.to_dict") is diagnostics.AuditReport.to_dict


# ---- the README's example ---------------------------------------------------------------------------------


def _readme_section_blocks(title: str) -> list[str]:
    section = README.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_audit_your_own_layer_example_runs(capsys):
    example = _readme_section_blocks("Audit your own layer")[0]
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    assert "attention audit of MyAttention" in capsys.readouterr().out


# ---- one loader and one command for layers and models ------------------------------------------------------


MODELS = '''
import torch
from buggy_variants import VARIANTS
from buggy_variants.teaching_model import TinyGPT, inject


def unscaled_model():
    torch.manual_seed(0)
    return inject(TinyGPT(n_layer=2), 1, VARIANTS["missing_scale"])


class Mixer(torch.nn.Module):  # takes embeddings, and has no nn.Embedding to draw token ids for
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def embeddings():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))  # (B, T, D)
'''


def test_the_command_and_both_plugins_load_targets_through_one_loader():
    from diagnostics import _load, pytest_plugin
    from diagnostics.model import _plugin

    assert _cli.resolve is _load.resolve and _cli.load_layer is _load.load_layer
    assert pytest_plugin.load_layer is _load.load_layer and _plugin.load_model is _cli.load_model is _load.load_model


def test_a_models_findings_are_printed_with_their_sites_as_file_line_annotations(in_scratch, capsys):
    Path("usermodels.py").write_text(MODELS)
    assert _cli.main(["--model", "usermodels:unscaled_model", "--junit-xml", "model.xml"]) == _cli.EXIT_FINDINGS
    out = capsys.readouterr().out
    suite, = ET.parse("model.xml").getroot()  # the model's own suite: its detectors, then each layer's
    failed = {(case.get("classname"), case.get("name")) for case in suite if case.find("failure") is not None}
    assert ("usermodels:unscaled_model.h.1.attn", "softmax_saturation") in failed
    assert ("usermodels:unscaled_model.h.0.attn", "softmax_saturation") not in failed  # the correct block
    assert "FAIL softmax_saturation at h.1.attn: " in out
    # the scratch directory is the working directory: the catalog's file is shown by its absolute path
    assert re.search(r"^  where: +\S*buggy_variants/_catalog\.py:\d+ in MissingScale\.scale", out, re.M), out
    assert re.search(r"^\S*buggy_variants/_catalog\.py:\d+: error: softmax_saturation: .* \(at h\.1\.attn\)$", out, re.M), out


def test_a_models_example_is_named_on_the_command_line_with_example(in_scratch, capsys):
    Path("usermodels.py").write_text(MODELS)
    assert _cli.main(["--model", "usermodels:Mixer"]) == _cli.EXIT_USAGE  # nothing to build its inputs from
    err = capsys.readouterr().err
    assert "expected --example MODULE:OBJECT naming ..., or a model whose inputs can be built" in err
    assert "Fix: pass --example MODULE:OBJECT naming torch.randint(vocab, (2, 16))" in err and "example=" not in err
    assert _cli.main(["--model", "usermodels:Mixer", "--example", "usermodels:embeddings"]) == _cli.EXIT_PASSED
    out = capsys.readouterr().out
    assert out.startswith("model audit of Mixer: PASSED") and "seq_len=8" in out.splitlines()[0]
    assert _cli.main(["userlayers:correct", "--example", "usermodels:embeddings"]) == _cli.EXIT_USAGE
    assert "expected --example with --model" in capsys.readouterr().err


# ---- declarations on the command line: --mask MEANING:SHAPE, --pattern, --call, --cross ---------------------------

DECLARED = '''
import torch
import torch.nn.functional as F


def windowed(q, k, v, width=4):  # a causal sliding window of `width` keys, the query's own included; no mask
    i = torch.arange(q.shape[-2]).unsqueeze(-1) + k.shape[-2] - q.shape[-2]  # (Tq, 1): absolute positions
    j = torch.arange(k.shape[-2])  # (Tk,)
    own = (j <= i) & (i - j < width)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=own)


def windowed_5(q, k, v):  # BUG: one key too many
    return windowed(q, k, v, width=5)


def per_query_additive(q, k, v, mask=None):  # mask: additive (B, Tq, Tk), no head axis
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.unsqueeze(1))


def needs_bias(q, k, v, bias):  # its additive mask under a name the audit cannot know, and required
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def call_with_bias(f, q, k, v, mask):
    return f(q, k, v, bias=mask)


not_callable = 3
'''


@pytest.fixture
def declared(tmp_path, monkeypatch):
    (tmp_path / "declaredlayers.py").write_text(DECLARED)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "declaredlayers", raising=False)
    yield
    sys.modules.pop("declaredlayers", None)


def test_the_command_takes_a_pattern_a_mask_shape_and_a_call(declared, capsys):
    assert _cli.main(["declaredlayers:windowed", "--pattern", "sliding_window(4)"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert _cli.main(["declaredlayers:windowed_5", "--pattern", "sliding_window(4)"]) == 1  # the twin: W + 1 keys
    assert "attention_pattern" in capsys.readouterr().out
    assert _cli.main(["declaredlayers:per_query_additive", "--mask", "additive:B,Tq,Tk"]) == 0
    capsys.readouterr()
    assert _cli.main(["declaredlayers:per_query_additive", "--mask", "additive"]) == 1  # a (B, 1, Tq, Tk) mask
    capsys.readouterr()
    assert _cli.main(["declaredlayers:needs_bias", "--call", "declaredlayers:call_with_bias", "--mask",
                      "additive"]) == 0
    assert "called through the declared call" in capsys.readouterr().out


def test_a_skipped_detector_names_a_pattern_as_the_command_takes_it(declared, capsys):
    """The fix of attention_pattern's and cache_decoding's skip, in the command's spelling (`--pattern "..."`, the
    grammar quoted for the shell); the twin: audit() itself says it as Python."""
    assert _cli.main(["declaredlayers:windowed", "--json"]) == 0
    results = {r["detector"]: r["message"] for r in json.loads(capsys.readouterr().out)["results"]}
    for detector in ("attention_pattern", "cache_decoding"):
        assert 'e.g. --pattern "sliding_window(4)")' in results[detector], results[detector]
        assert "diagnostics.patterns" not in results[detector] and "causal=True" not in results[detector]
    import declaredlayers
    said = {r.detector: r.message for r in diagnostics.audit(declaredlayers.windowed).results}
    for detector in ("attention_pattern", "cache_decoding"):
        assert "e.g. pattern=diagnostics.patterns.sliding_window(4))" in said[detector], said[detector]
    from diagnostics import pytest_plugin  # the plugin's spelling, through the same _options
    said = {r.detector: r.message for r in diagnostics.audit(declaredlayers.windowed, detectors=["attention_pattern"],
                                                             _options=pytest_plugin.OPTIONS).results}
    assert 'e.g. --attention-pattern "sliding_window(4)")' in said["attention_pattern"], said


def test_a_models_seq_len_past_its_context_is_refused_as_the_command_spells_it(in_scratch, capsys):
    """TinyGPT's block_size is 32: --seq-len 64 is a usage error whose fix is `--seq-len 32`, not Python's
    `seq_len=32`; the twin: --seq-len 32 audits the model."""
    Path("usermodels.py").write_text(MODELS)
    assert _cli.main(["--model", "usermodels:unscaled_model", "--seq-len", "64"]) == _cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "expected seq_len <= 32, the model's context; got --seq-len 64. Fix: pass --seq-len 32 or less" in err, err
    assert "seq_len=" not in err
    assert _cli.main(["--model", "usermodels:unscaled_model", "--seq-len", "32"]) == _cli.EXIT_FINDINGS
    assert "seq_len=32" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("argv, words", [
    (["declaredlayers:windowed", "--pattern", "sliding_window(4"], "expected --pattern to name patterns (causal, "
                                                                  "sliding_window, chunked, prefix_lm, document)"),
    (["declaredlayers:windowed", "--pattern", "__import__('os').system('true')"], "a character the grammar does "
                                                                                 "not take"),
    (["declaredlayers:windowed", "--pattern", "window(4)"], "unknown pattern 'window'"),
    (["declaredlayers:windowed", "--mask", "additive:B,T"], "expected a mask convention from the shortcuts allowed, "
                                                            "blocked, additive, key_padding, key_keep, mha_blocked, "
                                                            "or MEANING:SHAPE"),
    (["declaredlayers:needs_bias"], "got `bias` with no default"),
    (["declaredlayers:needs_bias", "--call", "declaredlayers:not_callable"], "expected --call to name a function"),
    (["--model", "declaredlayers:windowed", "--cross"], "expected only --example, --causal, --seq-len, --seed, "
                                                        "--detectors, --json and --html with --model (--junit-xml too); got --cross"),
])
def test_a_declaration_that_does_not_parse_is_a_usage_error(declared, capsys, argv, words):
    assert _cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and words in captured.err, captured.err


# ---- first contact (issue 35): the version, Ctrl-C, an unwritable --html, the API's options, a shadowing module ----


def test_version_is_the_packages_and_the_command_prints_it(capsys):
    assert diagnostics.__version__ == importlib.metadata.version("attention-mistakes")
    with pytest.raises(SystemExit) as exited:
        _cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"attention-audit {diagnostics.__version__}\n"


def test_ctrl_c_ends_the_command_with_one_line_and_exit_130(in_scratch, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("diagnostics._audit.audit", interrupted)
    assert _cli.main(["userlayers:correct"]) == _cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "attention-audit: interrupted\n"


def test_html_into_a_folder_where_no_file_can_be_made_is_a_usage_error_before_the_audit(in_scratch, capsys, monkeypatch,
                                                                                        tmp_path):
    """Root passes `os.access` on /sys, where creating a file fails all the same: the check creates one. The message
    does not ask to create a folder that exists."""
    def no_audit(*args, **kwargs):
        raise AssertionError("the audit ran although its report could not be written")

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(13, "Permission denied")
        return opened(path, *args, **kwargs)

    opened = open
    monkeypatch.setattr("diagnostics._audit.audit", no_audit)
    monkeypatch.setattr("builtins.open", refuse)
    assert _cli.main(["userlayers:correct", "--html", str(tmp_path / "a.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "create" not in err.split("Fix:")[1], err
    assert f"got {str(tmp_path)!r}, where creating one fails (PermissionError: Permission denied)" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_passed_audit_whose_html_is_not_written_does_not_exit_0(in_scratch, capsys, monkeypatch, tmp_path):
    def refuse(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("diagnostics._report.AuditReport.to_html", refuse)
    assert _cli.main(["userlayers:correct", "--html", str(tmp_path / "a.html")]) == _cli.EXIT_USAGE
    assert "HTML report was not written" in capsys.readouterr().err


def test_dtype_device_seed_and_detectors_reach_the_audit_as_the_python_api_spells_them(in_scratch, capsys):
    assert _cli.main(["userlayers:correct", "--dtype", "bfloat16", "--device", "cpu", "--seed", "3",
                      "--detectors", "softmax_saturation,future_leakage", "--detectors", "runs", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["dtype"], report["device"]) == ("bfloat16", "cpu"), report
    assert [r["detector"] for r in report["results"]] == ["softmax_saturation", "future_leakage", "runs"]  # as given
    assert _cli.main(["userlayers:correct", "--detectors", "no_such_detector"]) == 2
    assert "got ['no_such_detector']" in capsys.readouterr().err
    assert _cli.main(["userlayers:correct", "--device", "nowhere"]) == 2
    assert capsys.readouterr().err.startswith("attention-audit: error: expected --device nowhere to be a device")


def test_a_users_diagnostics_module_in_the_directory_is_named_in_one_line_and_the_command_uses_its_own(
        in_scratch, capsys, scratch, monkeypatch, tmp_path):
    (tmp_path / "diagnostics.py").write_text("raise SystemExit('the user\\'s diagnostics.py was imported')\n")
    (tmp_path / "userlayers.py").write_text((scratch / "userlayers.py").read_text()
                                            + "\nimport diagnostics\nAUDIT = diagnostics.audit\n")
    monkeypatch.chdir(tmp_path)
    assert _cli.main(["userlayers:correct", "--detectors", "runs"]) == 0
    note, = capsys.readouterr().err.splitlines()
    assert note.startswith(f"attention-audit: note: {tmp_path / 'diagnostics.py'} is shadowed by this tool's package")
    assert sys.modules["userlayers"].AUDIT is diagnostics.audit
    # the installed command, from that directory: its own package (no torch is imported for --version)
    done = subprocess.run(_command() + ["--version"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("attention-audit ") and not done.stderr, done


def test_the_readme_layer_is_the_examples_layer():
    """The README's first example and examples/my_attention.py are one layer: the class, line for line."""
    example = (README.parent / "examples" / "my_attention.py").read_text()
    layer = example[example.index("class MyAttention"):]
    assert layer in _readme_section_blocks("Audit your own layer")[0]


# ---- several layers in one command: each report, a summary table, the worst exit status, JUnit XML -------------


def test_several_layers_each_report_then_a_summary_and_the_worst_exit_status(in_scratch, capsys):
    assert _cli.main(["userlayers:correct", "userlayers:attention"]) == _cli.EXIT_PASSED  # the twin: all pass
    out = capsys.readouterr().out
    assert out.count("attention audit of ") == 2 and "summary of 2 audits: 2 passed" in out
    assert re.search(r"^  userlayers:attention +PASSED +-$", out, re.M), out
    argv = ["userlayers:correct", "userlayers:linear_only", "userlayers:unscaled", "userlayers:does_not_exist"]
    assert _cli.main(argv[:3]) == _cli.EXIT_FINDINGS  # a failed layer is worse than an inconclusive one
    out = capsys.readouterr().out
    assert [line.split(": ")[0] for line in out.splitlines() if line.startswith("attention audit of ")] == [
        "attention audit of EinsumAttention (a module given one stream, d_model=32 from its `d_model`, num_heads=4 "
        "from its `num_heads`)", "attention audit of LinearOnly (a module given one stream, d_model=32 from its "
        "`d_model`, num_heads=4 from its `num_heads`)", "attention audit of EinsumAttention (a module given one "
        "stream, d_model=32 from its `d_model`, num_heads=4 from its `num_heads`)"]
    summary = out[out.index("summary of 3 audits"):].splitlines()
    assert summary[0] == "summary of 3 audits: 1 passed, 1 inconclusive, 1 failed"
    assert re.fullmatch(r"  target +verdict +failing detectors", summary[1])
    # own_weights too: recomputed from the layer's own projections, its output is the reference's with another scale
    assert re.fullmatch(r"  userlayers:unscaled +FAILED +softmax_saturation, own_weights", summary[4]), summary
    assert re.fullmatch(r"  userlayers:linear_only +INCONCLUSIVE +inconclusive: the attention itself was not "
                        r"measured.*", summary[3]), summary
    assert _cli.main(argv) == _cli.EXIT_USAGE  # a target that cannot be audited is the worst; the others still run
    captured = capsys.readouterr()
    assert captured.out.count("attention audit of ") == 3
    assert re.search(r"^  userlayers:does_not_exist +USAGE ERROR +expected userlayers to define 'does_not_exist'",
                     captured.out, re.M)
    assert captured.err.startswith("attention-audit: error: userlayers:does_not_exist: expected userlayers to define")


def test_several_layers_as_json_hold_every_report(in_scratch, capsys):
    assert _cli.main(["userlayers:correct", "userlayers:unscaled", "userlayers:nope", "--json",
                      "--detectors", "runs,softmax_saturation"]) == _cli.EXIT_USAGE
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "usage error" and data["exit_status"] == 2
    assert [(t["target"], t["status"]) for t in data["targets"]] == [
        ("userlayers:correct", "passed"), ("userlayers:unscaled", "failed"), ("userlayers:nope", "usage error")]
    assert [r["detector"] for r in data["targets"][1]["report"]["results"]] == ["runs", "softmax_saturation"]
    assert data["targets"][2]["error"].startswith("expected userlayers to define 'nope'")


def test_html_takes_one_target_only(in_scratch, capsys):
    assert _cli.main(["userlayers:correct", "userlayers:unscaled", "--html", "a.html"]) == _cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and "expected one target with --html" in captured.err and "--junit-xml" in captured.err


def test_junit_xml_a_testsuite_per_target_and_a_testcase_per_detector(in_scratch, capsys, tmp_path):
    path = tmp_path / "audit.xml"
    assert _cli.main(["userlayers:correct", "userlayers:unscaled", "userlayers:nope", "--junit-xml", str(path)]) == 2
    assert f"wrote {path}" in capsys.readouterr().err
    root = ET.parse(path).getroot()  # it parses back
    assert root.tag == "testsuites"
    suites = {suite.get("name"): suite for suite in root}
    assert list(suites) == ["userlayers:correct", "userlayers:unscaled", "userlayers:nope"]
    for name in ("userlayers:correct", "userlayers:unscaled"):
        assert [case.get("name") for case in suites[name]] == list(DETECTORS)
        assert {case.get("classname") for case in suites[name]} == {name}
    outcome = {name: {case.get("name"): [child.tag for child in case] for case in suites[name]}
               for name in ("userlayers:correct", "userlayers:unscaled")}
    assert outcome["userlayers:unscaled"]["softmax_saturation"] == ["failure"]
    assert outcome["userlayers:correct"]["softmax_saturation"] == []  # the twin: passed, an empty testcase
    failure = suites["userlayers:unscaled"].find("testcase[@name='softmax_saturation']/failure")
    assert failure.get("message").startswith("softmax is 2.83x too sharp") and "fix:" in failure.text
    skipped = suites["userlayers:correct"].find("testcase[@name='future_leakage']/skipped")
    assert "--causal" in skipped.get("message")  # a skip says why, in the command's spelling
    assert outcome["userlayers:unscaled"]["own_weights"] == ["failure"]  # another scale than its own weights give
    assert suites["userlayers:unscaled"].get("failures") == "2" and int(root.get("tests")) == 2 * len(DETECTORS) + 1
    error = suites["userlayers:nope"].find("testcase[@name='setup']/error")
    assert error.get("message").startswith("expected userlayers to define 'nope'")


def test_junit_xml_to_an_unwritable_path_is_a_usage_error_before_the_audit(in_scratch, capsys, monkeypatch):
    def no_audit(*args, **kwargs):
        raise AssertionError("the audit ran although its report could not be written")

    monkeypatch.setattr("diagnostics._audit.audit", no_audit)
    assert _cli.main(["userlayers:correct", "--junit-xml", "/no/such/dir/a.xml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("attention-audit: error: expected --junit-xml /no/such/dir/a.xml in an existing "
                                   "directory; got no directory '/no/such/dir'. Fix: create it first")


def test_a_passed_audit_whose_junit_xml_is_not_written_does_not_exit_0(in_scratch, capsys, monkeypatch, tmp_path):
    def refuse(outcomes, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_cli, "_write_junit", refuse)
    assert _cli.main(["userlayers:correct", "--junit-xml", str(tmp_path / "a.xml"),
                      "--detectors", "runs,weight_row_sums"]) == _cli.EXIT_USAGE
    assert "JUnit XML report was not written" in capsys.readouterr().err
