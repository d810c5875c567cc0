"""A PASSED must be earned: probes prove they bite, nothing is silently dropped, an audit that measured
nothing is inconclusive, NaN is compared honestly, and bugs show at the scales people train at."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from correct import MultiHeadAttention, gpt2_init_
from diagnostics import _core, _registry
from diagnostics._core import Inputs, perturbed, relative_change
from diagnostics._errors import BlindProbe
from diagnostics._probe import Probe
from diagnostics._subject import make_subject

DOC = Path(__file__).resolve().parents[1] / "docs" / "detectors.md"  # the page with the detector table


class CrossAttention(nn.Module):
    """forward(query, key, value, mask=None): a cross-attention module, correct unless `use_mask=False`."""

    def __init__(self, d_model=16, num_heads=2, use_mask=True):
        super().__init__()
        self.d_model, self.num_heads, self.use_mask = d_model, num_heads, use_mask
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        B, Tq, D = query.shape
        H = self.num_heads
        q = self.q(query).view(B, Tq, H, -1).transpose(1, 2)  # (B, H, Tq, d)
        k = self.k(key).view(B, key.shape[1], H, -1).transpose(1, 2)  # (B, H, Tk, d)
        v = self.v(value).view(B, value.shape[1], H, -1).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
        if mask is not None and self.use_mask:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, Tq, D))


def test_a_cross_attention_module_that_ignores_its_mask_fails_mask_honoured():
    torch.manual_seed(0)
    broken = diagnostics.audit(CrossAttention(use_mask=False))
    assert broken.result("mask_honoured").verdict == "fail", str(broken)
    assert "padding mask: " in broken.result("mask_honoured").evidence
    torch.manual_seed(0)
    twin = diagnostics.audit(CrossAttention(use_mask=True))
    assert twin.passed and set(twin.fired()) <= {"fully_masked_rows"}, str(twin)  # its plain softmax: NaN rows


@pytest.mark.parametrize("layer", [nn.Linear(8, 8), nn.Identity()], ids=["Linear", "Identity"])
def test_a_layer_that_is_no_attention_is_inconclusive_not_passed(layer):
    report = diagnostics.audit(layer, d_model=8)
    assert report.status == "inconclusive" and not report.passed, str(report)
    assert "the attention itself was not measured" in report.status_reason
    assert "INCONCLUSIVE" in str(report)
    with pytest.raises(diagnostics.AttentionAuditError):
        report.raise_for_findings()


def online_attention(q, k, v, mask=None, scaled=True):
    """Flash-style: a running max and sum, no softmax op and no weights returned."""
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scaled else 1.0)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    return (p @ v) / p.sum(-1, keepdim=True)


def test_a_function_without_weights_is_read_through_identity_values():
    """Its temperature is measured from the output it gives for v = I, so the missing scale is caught."""
    broken = diagnostics.audit(lambda q, k, v, mask=None: online_attention(q, k, v, mask, scaled=False))
    assert broken.result("softmax_saturation").verdict == "fail", str(broken)
    assert "identity values" in broken.result("softmax_saturation").evidence
    twin = diagnostics.audit(online_attention)
    assert twin.passed and set(twin.fired()) <= {"fully_masked_rows"}, str(twin)  # 0 / 0 on a row with no key


class RaisesOnCrossAttention(CrossAttention):
    def forward(self, query, key, value, mask=None):
        if query.shape[1] != key.shape[1]:
            raise RuntimeError("shapes must match")
        return super().forward(query, key, value, mask)


def test_a_layer_that_raises_only_when_tq_differs_from_tk_fails_runs():
    torch.manual_seed(0)
    report = diagnostics.audit(RaisesOnCrossAttention())
    runs = report.result("runs")
    assert runs.verdict == "fail" and "shapes must match" in runs.evidence, str(report)
    assert report.status == "failed"
    shape = report.result("output_shape")
    assert shape.verdict == "skip" and "raised" in shape.message  # visible, never a silent pass


class NaNEverywhere(nn.Module):
    """Deterministic, and NaN: the same NaN twice is no change."""

    d_model, num_heads = 8, 2

    def forward(self, x, mask=None):
        return torch.full_like(x, float("nan"))


class NaNInOneRow(nn.Module):
    """The input, with token 0 NaN: deterministic, finite elsewhere. `noisy=True` adds eval-mode noise to
    the finite rows (randomness left on) while the NaN stays where it was."""

    d_model, num_heads = 8, 2

    def __init__(self, noisy=False):
        super().__init__()
        self.noisy = noisy

    def forward(self, x, mask=None):
        out = x + torch.randn_like(x) if self.noisy else x.clone()
        out[:, 0] = float("nan")
        return out


def test_a_deterministic_nan_layer_does_not_fail_eval_determinism():
    """NaN everywhere leaves nothing to compare: a skip that says so, never a pass nor a fail."""
    report = diagnostics.audit(NaNEverywhere())
    determinism = report.result("eval_determinism")
    assert determinism.verdict == "skip", str(report)
    assert "non-finite everywhere" in determinism.message, determinism.message
    assert report.result("finite_output").verdict == "fail"  # the NaN is reported where it belongs


def test_nan_at_the_same_place_in_both_calls_is_no_change_to_eval_determinism():
    """NaN in the same row of both calls is no change: the deterministic layer passes, and its twin, whose
    finite rows change between calls while the NaN stays put, fails."""
    torch.manual_seed(0)
    steady = diagnostics.audit(NaNInOneRow()).result("eval_determinism")
    assert steady.verdict == "pass", steady
    torch.manual_seed(0)
    noisy = diagnostics.audit(NaNInOneRow(noisy=True)).result("eval_determinism")
    assert noisy.verdict == "fail", noisy


def test_nan_in_both_runs_is_no_change_and_nan_appearing_is_an_infinite_one():
    old = torch.tensor([[[1.0, float("nan")], [2.0, 3.0]]])  # (B=1, T=2, D=2)
    same = relative_change(old.clone(), old)
    assert torch.equal(same, torch.zeros(1, 2))
    appeared = old.clone()
    appeared[0, 1, 0] = float("nan")
    change = relative_change(appeared, old)
    assert change[0, 0] == 0 and math.isinf(change[0, 1])


def test_change_is_relative_to_the_outputs_own_scale():
    """At GPT-2's initialisation outputs are ~1e-3: a change of 1e-3 is a change of order one."""
    torch.manual_seed(0)
    old = 1e-3 * torch.randn(2, 5, 8)
    new = old.clone()
    new[0, 2] += 1e-3
    change = relative_change(new, old, centred=True)
    assert change[0, 2] > 0.5 and (change.flatten()[:2] == 0).all()


def _probe(layer, **kw) -> Probe:
    subject = make_subject(layer)
    probe = Probe(subject, causal=False, scale=None, seq_len=6, seed=0, **kw)
    probe.detector = "test"
    return probe


def test_a_perturbation_that_changes_nothing_is_a_blind_probe():
    probe = _probe(MultiHeadAttention(8, 2))
    base = Inputs(*probe.streams(2, 6))
    positions = torch.arange(6) >= 3
    [changed] = perturbed(probe, base, positions, ("query",))
    assert not torch.equal(changed.query[:, 3:], base.query[:, 3:]) and torch.equal(changed.query[:, :3],
                                                                                      base.query[:, :3])
    with pytest.raises(BlindProbe):
        perturbed(probe, base, positions, ("query",), gains=(0.0,))  # x + 0 * (draw - x) = x


def test_a_blind_probe_is_a_visible_skip_for_users(monkeypatch):
    monkeypatch.setattr(_registry, "STRICT_PROBES", False)
    monkeypatch.setattr(_core, "_position_change", lambda new, old: torch.zeros(
        new.shape[0], new.shape[-2]))  # as if no perturbation ever bit
    report = diagnostics.audit(MultiHeadAttention(8, 2), causal=True)
    blind = report.result("future_leakage")
    assert blind.verdict == "skip" and "the probe's own control failed" in blind.message, str(report)


def test_salts_are_allocated_by_the_probe_never_shared():
    probe = _probe(MultiHeadAttention(8, 2))
    draws = [probe.make(1, 4) for _ in range(3)]
    probe.detector = "other"
    draws.append(probe.make(1, 4))
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])


def test_a_detector_that_crashes_is_an_error_and_the_audit_inconclusive(monkeypatch):
    det = diagnostics.DETECTORS["query_locality"]

    def crash(probe):  # an exception raised inside diagnostics' own code (here _core), not in the layer's
        return _core.baseline_scale(None)

    monkeypatch.setitem(diagnostics.DETECTORS, "query_locality", _registry.Detector(
        det.id, det.description, det.targets, det.fix, crash, det.needs))
    report = diagnostics.audit(MultiHeadAttention(8, 2))
    assert report.result("query_locality").verdict == "error"
    assert report.status == "inconclusive" and "crashed" in report.status_reason, str(report)


def test_an_exception_the_layer_raises_inside_a_detector_is_a_finding_about_the_layer(monkeypatch):
    """The crash rule's other side: the same registry entry, but the exception comes from the layer's own code
    (called directly by the check, as the gradient check calls its float64 copy): a failure, not an error."""
    det = diagnostics.DETECTORS["query_locality"]

    class Raises(MultiHeadAttention):
        def forward(self, *args, **kwargs):
            raise ZeroDivisionError("the layer's own bug")

    def calls_the_layer(probe):
        return Raises(8, 2)(torch.zeros(1, 2, 8))

    monkeypatch.setitem(diagnostics.DETECTORS, "query_locality", _registry.Detector(
        det.id, det.description, det.targets, det.fix, calls_the_layer, det.needs, unlocated="a test"))
    report = diagnostics.audit(MultiHeadAttention(8, 2))
    result = report.result("query_locality")
    assert result.verdict == "fail" and "ZeroDivisionError: the layer's own bug" in result.message, str(report)
    assert report.status == "failed", str(report)


def test_require_and_strict_turn_skips_into_failures():
    layer = MultiHeadAttention(8, 2)
    plain = diagnostics.audit(layer)
    assert plain.passed and plain.result("future_leakage").verdict == "skip"
    required = diagnostics.audit(layer, require=["future_leakage"])
    assert required.result("future_leakage").verdict == "fail" and not required.passed
    # strict: "not applicable" (the layer was not audited as causal) stays a skip; "not measured" fails
    assert diagnostics.audit(layer, strict=True).passed
    linear = diagnostics.audit(nn.Linear(8, 8), d_model=8, strict=True)
    assert linear.status == "failed" and linear.result("softmax_saturation").verdict == "fail"


def test_an_empty_audit_prints_and_is_inconclusive():
    report = diagnostics.audit(MultiHeadAttention(8, 2), detectors=[])
    assert report.status == "inconclusive" and "no detector" in str(report)
    with pytest.raises(diagnostics.AuditUsageError, match="detector this audit ran"):
        report.result("runs")


def test_skip_reasons_speak_the_front_ends_language():
    report = diagnostics.audit(MultiHeadAttention(8, 2), _options={"causal": "--causal"})
    assert "pass --causal if" in report.result("future_leakage").message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vid, detector", [("missing_causal_mask", "future_leakage"),
                                           ("mask_polarity_inverted", "mask_honoured"),
                                           ("heads_merged_without_transpose", "query_locality")])
def test_the_first_release_misses_are_caught_at_gpt2_scale(vid, detector, dtype):
    """Issue 8's reproduction: GPT-2 initialisation in half precision passed these three bugs."""
    variant = VARIANTS[vid]
    torch.manual_seed(0)
    layer = gpt2_init_(variant.build(32, 4)).to(dtype)
    report = diagnostics.audit(layer, causal=layer.causal)
    assert report.result(detector).verdict == "fail", str(report)
    twin = gpt2_init_(variant.reference(32, 4)).to(dtype)
    assert diagnostics.audit(twin, causal=twin.causal).passed


def _detectors_catch():
    """tests/test_detectors_catch.py's call recorder, loaded from its path (tests import nothing from each other
    by name, so that the suite also runs under --import-mode=importlib)."""
    path = Path(__file__).with_name("test_detectors_catch.py")
    spec = importlib.util.spec_from_file_location("detectors_catch_tests", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _probe_key(p) -> tuple:
    """A reported probe as the recorder keys a call: sizes, one stream or three, the mask passed (B, Tq, Tk)."""
    return (p.batch, p.t_q, p.t_k, p.self_attention, None if p.allowed is None else tuple(p.allowed.flatten().tolist()))


@pytest.mark.parametrize("causal", [False, True])
def test_every_result_lists_the_probes_it_made(causal):
    """Checked against the calls the layer really received (a forward hook, attributed to the detector running
    at the time): every probe a detector lists was made, with that mask, and every call a detector made itself
    is listed (a detector may list the standard probe it reads without calling the layer again)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2)
    calls = []
    remove, progress = _detectors_catch().record_calls(layer, calls)
    try:
        report = diagnostics.audit(layer, causal=causal, progress=progress)
    finally:
        remove()
    made = {c.key for c in calls}
    for r in report.results:
        if not r.measured:
            continue
        listed = {_probe_key(p) for p in r.probes}
        own = {c.key for c in calls if c.detector == r.detector}
        assert listed and listed <= made, f"{r.detector} lists probes never made: {sorted(listed - made)}"
        assert own <= listed, f"{r.detector} made calls it does not list: {sorted(own - listed)}"
    if causal:
        leak = report.result("future_leakage").probes
        assert leak and all(p.self_attention and p.t_q == p.t_k == 16 for p in leak)


def catalog_column() -> dict[str, str]:
    """{detector: the catalog entries it catches}; `*` marks also_detected_by (not at every size)."""
    column = {}
    for det in diagnostics.DETECTORS:
        sure = sorted(v for v, var in VARIANTS.items() if det in var.expected_detectors)
        some = sorted(v + "*" for v, var in VARIANTS.items() if det in var.also_detected_by)
        column[det] = ", ".join(sure + some) or f"(none in the catalog; see tests/{EXERCISED_IN.get(det, 'test_never_seen.py')})"
    return column


# where a detector that catches no catalog entry is exercised, when not in tests/test_never_seen.py
EXERCISED_IN = {"relative_positions": "test_relative_positions.py", "parameters_used": "test_parameters.py",
                "undeclared_causality": "test_causality_hint.py"}


def test_a_detector_outside_the_catalog_is_exercised_where_the_table_says():
    here = Path(__file__).resolve().parent
    for det, text in catalog_column().items():
        if text.startswith("(none in the catalog"):
            named = EXERCISED_IN.get(det, "test_never_seen.py")
            assert det in (here / named).read_text(), f"{det}: the docs/detectors.md table points at tests/{named}"


def test_readme_detector_table_is_the_registry():
    table = _registry.markdown_table(catalog_column())
    assert table in DOC.read_text(), "regenerate the docs/detectors.md table: python tests/test_verdicts.py"
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == list(diagnostics.DETECTORS)


if __name__ == "__main__":
    print(_registry.markdown_table(catalog_column()))
