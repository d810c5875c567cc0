"""What a new user hit (issue 18, items 4, 9 and 10), each with the case that failed before: a `layout="bthd"`
function without a gradient check, wording that misled, and errors caught late or not at all."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from correct import gpt2_init_


def flash_style(q, k, v, mask=None):
    """flash-attn's layout: (B, T, H, d) in and out, SDPA inside."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def flash_style_detached(q, k, v, mask=None):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).detach() @ v).transpose(1, 2)


def test_a_bthd_function_gets_its_gradient_check():
    report = diagnostics.audit(flash_style, layout="bthd", strict=True)
    assert report.result("gradients").verdict == "pass" and report.passed, str(report)


def test_a_bthd_function_with_a_detached_softmax_fails_it():
    result = diagnostics.audit(flash_style_detached, layout="bthd").result("gradients")
    assert result.verdict == "fail" and "disagrees" in result.message, result


def test_a_failing_gradient_check_prints_numbers_that_differ():
    torch.manual_seed(0)
    layer = VARIANTS["detached_softmax"].build(4, 2)
    gpt2_init_(layer)
    result = diagnostics.audit(layer, seq_len=4).result("gradients")
    assert result.verdict == "fail"
    # the first two numbers (a retry at a finer step may follow them)
    parts = result.evidence.split("gives ")[1].split("differences ")[:2]
    ad, fd = (part.split(" and")[0].split(":")[0] for part in parts)
    assert ad.strip() != fd.strip(), result.evidence


def test_a_size_found_by_a_trial_or_assumed_is_said_once():
    class Bare(nn.Module):  # no attribute names its sizes
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8) * 0.1)

        def forward(self, x):
            return ((x @ self.w) @ x.transpose(-2, -1) / math.sqrt(8)).softmax(-1) @ x

    described = diagnostics.audit(Bare()).layer
    assert described.count("d_model=") == 1 and described.count("num_heads=") == 1, described


def test_too_flat_says_the_logits_are_divided_too_much():
    class Overscaled(nn.Module):  # divides by d_k instead of sqrt(d_k): scaled by too little
        def __init__(self):
            super().__init__()
            self.d_model, self.num_heads = 32, 2
            self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return self.out(((q @ k.transpose(-2, -1) / 16).softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))

    torch.manual_seed(0)
    result = diagnostics.audit(Overscaled()).result("softmax_saturation")
    assert result.verdict == "fail" and "too flat" in result.message and "divided too much" in result.message
    assert "more than" not in result.message, result.message


def test_to_html_into_a_missing_folder_is_a_usage_error(tmp_path):
    report = diagnostics.audit(flash_style, layout="bthd")
    with pytest.raises(diagnostics.AuditUsageError, match="folder does not exist.*create"):
        report.to_html(tmp_path / "missing" / "x.html")


@pytest.mark.parametrize("causal", ["yes", 1, None])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(diagnostics.AuditUsageError, match="causal=True or causal=False"):
        diagnostics.audit(flash_style, layout="bthd", causal=causal)


class FixedBuffer(nn.Module):
    """A causal mask buffer of 8 positions, sliced to the input, and no attribute saying the context is 8."""

    causal = True

    def __init__(self):
        super().__init__()
        self.d_model, self.num_heads = 16, 2
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.register_buffer("tri", torch.ones(8, 8).tril())

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(self.tri[:T, :T] == 0, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def test_a_seq_len_past_a_hidden_context_says_so_and_within_it_the_layer_passes():
    torch.manual_seed(0)
    runs = diagnostics.audit(FixedBuffer(), causal=True, seq_len=16).result("runs")
    fix, general = runs.remedy
    assert runs.verdict == "fail" and not general and "maximum length below 16" in fix, fix
    torch.manual_seed(0)
    assert diagnostics.audit(FixedBuffer(), causal=True, seq_len=8).passed


def test_an_html_report_that_cannot_be_written_leaves_the_audits_status(tmp_path, monkeypatch, capsys):
    """The command checks --html before the audit; should writing fail after it anyway, the exit status is still
    the audit's (here 1, failed), and stderr says the page was not written."""
    from diagnostics import _cli
    from diagnostics._report import AuditReport

    (tmp_path / "mylayer.py").write_text("from test_new_user import FixedBuffer as broken\n")

    def refuse(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(AuditReport, "to_html", refuse)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    status = _cli.main(["mylayer:broken", "--causal", "--seq-len", "16", "--html", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert status == 1 and "HTML report was not written" in err and "No space left" in err, err


@pytest.mark.parametrize("seq_len", [12, 16])  # 16: the head width, which the old site search mistook for positions
@pytest.mark.parametrize("causal", [True, False])
def test_the_merge_without_transpose_is_located_at_the_reshape_whatever_the_sizes(seq_len, causal):
    torch.manual_seed(0)
    report = diagnostics.audit(VARIANTS["heads_merged_without_transpose"].build(64, 4), seq_len=seq_len, causal=causal)
    for det in ("query_locality", "output_variance", "mask_honoured"):
        site = report.result(det).where[0]
        assert site.function.endswith("merge_heads") and "reshape" in site.code, (det, site.describe())


def test_the_header_counts_work_and_runs_counts_calls_and_each_says_which():
    """The header's number (forward passes of work: a backward counts two) and runs' (calls of the layer) differ
    by design; each now names what it counts."""
    report = diagnostics.audit(flash_style, layout="bthd")
    header, runs = str(report).splitlines()[0], report.result("runs").message
    assert f"{report.forward_passes} forward passes of work" in header, header
    assert "calls in all" in runs, runs


# ---- examples/ (issue 35): each script runs as a user runs it, and the README shows the same code -------------

EXAMPLES = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples"


def _readme_block_after(heading: str) -> str:
    readme = (EXAMPLES.parent / "README.md").read_text()
    section = readme.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_model_example_is_examples_audit_model():
    script = (EXAMPLES / "audit_model.py").read_text()
    assert _readme_block_after("Audit a whole model") == script[script.index("import diagnostics"):]


@pytest.mark.slow  # four fresh processes, each importing torch, and a model audit: about 15 s on 2 cores
def test_every_example_runs_as_a_user_runs_it(tmp_path):
    import os
    import subprocess
    import sys

    root = str(EXAMPLES.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    commands = {
        "audit_layer.py": [sys.executable, str(EXAMPLES / "audit_layer.py")],
        "audit_model.py": [sys.executable, str(EXAMPLES / "audit_model.py")],
        "html_report.py": [sys.executable, str(EXAMPLES / "html_report.py"), str(tmp_path / "audit.html")],
        "test_my_attention.py": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                 "--rootdir", str(EXAMPLES), str(EXAMPLES / "test_my_attention.py")],
    }
    assert sorted(commands) == sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "my_attention.py")
    started = {name: subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True) for name, argv in commands.items()}
    out = {name: process.communicate(timeout=300)[0] for name, process in started.items()}
    assert all(process.returncode == 0 for process in started.values()), out
    assert "PASSED" in out["audit_layer.py"] and "FAILED" in out["audit_model.py"], out
    assert (tmp_path / "audit.html").stat().st_size > 1000 and "1 passed" in out["test_my_attention.py"], out
    assert not any("Failed to initialize NumPy" in text for text in out.values()), out


# ---- the memory guard (issue 35): an audit that would not fit is refused before it runs, with what would fit ----


def sdpa_function(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_an_audit_far_past_the_memory_is_refused_before_it_runs_with_the_length_that_fits(monkeypatch):
    """`audit(fn, seq_len=100000)` once grew to 20 GB and was killed: now the estimate (4.7 TB) is refused at once."""
    from diagnostics import _memory

    monkeypatch.setenv(_memory.ENV, "2G")  # the same answer on every machine
    with pytest.raises(diagnostics.AuditUsageError) as refused:
        diagnostics.audit(sdpa_function, seq_len=100000)
    message = str(refused.value)
    fits = _memory.longest_that_fits(2 * 2 ** 30, num_heads=2, dtype=torch.float32)
    assert message.startswith(f"expected an audit that fits in memory ({_memory.ENV}=2G: 2 GB); got seq_len=100000, "
                              "estimated at 4.66 TB"), message
    assert f"Fix: seq_len={fits} or less" in message and 2000 < fits < 3000, message
    assert _memory.estimate(seq_len=fits, num_heads=2, dtype=torch.float32) <= 2 * 2 ** 30
    assert _memory.estimate(seq_len=fits + 1, num_heads=2, dtype=torch.float32) > 2 * 2 ** 30


def test_an_audit_within_the_memory_runs_and_the_cap_is_read_in_the_users_units(monkeypatch):
    from diagnostics import _memory

    monkeypatch.setenv(_memory.ENV, "200M")
    fits = _memory.longest_that_fits(200 * 2 ** 20, num_heads=2, dtype=torch.float32)
    report = diagnostics.audit(sdpa_function, seq_len=fits, detectors=["output_shape"])  # not refused: it runs
    assert report.result("output_shape").verdict == "pass" and report.seq_len == fits
    with pytest.raises(diagnostics.AuditUsageError, match=f"Fix: seq_len={fits} or less"):
        diagnostics.audit(sdpa_function, seq_len=fits + 1, detectors=["output_shape"])
    assert [_memory.parse_size(s) for s in ("8G", "500M", "1.5g", "123456", "2 GiB")] == [
        8 * 2 ** 30, 500 * 2 ** 20, int(1.5 * 2 ** 30), 123456, 2 * 2 ** 30]
    monkeypatch.setenv(_memory.ENV, "lots")
    with pytest.raises(diagnostics.AuditUsageError, match="expected ATTENTION_AUDIT_MEMORY to be a size such as 8G"):
        diagnostics.audit(sdpa_function)


def test_the_command_spells_the_memory_fix_as_an_option(tmp_path, monkeypatch, capsys):
    from diagnostics import _cli, _memory

    (tmp_path / "fnlayer.py").write_text("from test_new_user import sdpa_function as layer\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    monkeypatch.setenv(_memory.ENV, "200M")
    assert _cli.main(["fnlayer:layer", "--seq-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "got --seq-len 100000" in err and "Fix: --seq-len " in err, err
