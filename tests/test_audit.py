"""audit() as a tool: it never crashes on a broken layer, leaves everything as it found it, explains
misuse, and costs a constant number of forward passes."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from correct import MultiHeadAttention
from diagnostics import AttentionAuditError, AuditUsageError, audit


class Counting(MultiHeadAttention):
    """A correct layer with state the audit must restore: a call counter (persistent buffer), a
    non-persistent counter, and a cache the forward pass replaces with a tensor of another shape."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("hidden_calls", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("cache", torch.zeros(4))

    def forward(self, query, key=None, value=None, mask=None):
        self.calls += 1
        self.hidden_calls += 1
        self.cache = torch.zeros(query.shape[1])  # a position cache that grows with the sequence
        return super().forward(query, key, value, mask)


def test_audit_leaves_layer_rng_and_grads_untouched():
    torch.manual_seed(0)
    layer = Counting(16, 2, dropout=0.1).train()
    layer.out.weight.grad = torch.ones_like(layer.out.weight)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    rng = torch.get_rng_state()
    report = audit(layer)
    assert report.passed, str(report)
    assert layer.training and all(m.training for m in layer.modules())
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "parameters or buffers changed"
    assert int(layer.calls) == 0, "a buffer the forward pass updates was not restored"
    assert int(layer.hidden_calls) == 0, "a non-persistent buffer was not restored"
    assert layer.cache.shape == (4,), "a buffer the forward pass replaced was not put back"
    assert torch.equal(layer.out.weight.grad, torch.ones_like(layer.out.weight)) and layer.qkv.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng), "the global RNG state moved"


class CachedOnFirstCall(MultiHeadAttention):
    """A correct layer that makes its caches on its first call (PaLM's causal mask and ALiBi bias): one buffer
    registered as None and set then, one registered only then, non-persistent."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.register_buffer("bias", None, persistent=False)

    def forward(self, query, key=None, value=None, mask=None):
        if self.bias is None:
            self.register_buffer("bias", torch.zeros(query.shape[1]), persistent=False)
            self.register_buffer("made_later", torch.ones(()), persistent=False)
        return super().forward(query, key, value, mask)


def test_audit_leaves_a_cache_made_on_the_first_call_unmade():
    """Before, a buffer registered as None and set by the audit's calls stayed set, and one registered by them stayed
    registered: the user's first call after the audit took the cached path."""
    layer = CachedOnFirstCall(16, 2)
    assert audit(layer).passed
    assert layer.bias is None and "bias" in layer._buffers, "a buffer the audit's calls set was left set"
    assert "made_later" not in layer._buffers and not hasattr(layer, "made_later"), "a buffer the calls made stayed"
    assert "made_later" not in layer._non_persistent_buffers_set


class TableBuiltOnce(MultiHeadAttention):
    """A correct layer that builds a position table on its first call and records it in plain attributes (a `built`
    flag and the table's length, as Hugging Face's rotary caches keep `max_seq_len_cached`): `registered` says whether
    the table is a None buffer from __init__ or registered on that call."""

    def __init__(self, *a, registered: bool = False, **kw):
        super().__init__(*a, **kw)
        self.built, self.length = False, 0
        if not registered:
            self.register_buffer("table", None, persistent=False)

    def forward(self, query, key=None, value=None, mask=None):
        if not self.built:
            self.register_buffer("table", torch.zeros(64, query.shape[-1]), persistent=False)
            self.built, self.length = True, 64
        return super().forward(query + self.table[: query.shape[1]], key, value, mask)


@pytest.mark.parametrize("registered", [False, True], ids=["None buffer", "registered on the first call"])
def test_audit_leaves_a_cache_and_what_records_it_as_they_came(registered):
    """A review of the cache guard: unsetting the table but not its `built` flag made every later call of the audit
    raise (a false `runs` failure) and left the layer unusable. The plain attributes go back with the buffers."""
    layer = TableBuiltOnce(16, 2, registered=registered)
    assert audit(layer).passed
    assert (layer.built, layer.length, getattr(layer, "table", None)) == (False, 0, None)
    layer(torch.randn(2, 5, 16))  # the layer works after the audit, building its table as on a first call


def test_audit_restores_eval_mode_too():
    layer = MultiHeadAttention(16, 2).eval()
    audit(layer)
    assert not layer.training


class Raises(nn.Module):
    d_model = 8

    def forward(self, x):
        raise ValueError("boom")


class ReturnsNone(nn.Module):
    d_model = 8

    def forward(self, x):
        return None


class WrongShape(nn.Module):
    d_model = 8

    def forward(self, x):
        return x[:, :1]


class ReturnsNaN(nn.Module):
    d_model = 8

    def forward(self, x):
        return x * float("nan")


@pytest.mark.parametrize("layer, detector, words", [
    (Raises(), "runs", "ValueError: boom"),
    (ReturnsNone(), "runs", "returned NoneType"),
    (WrongShape(), "output_shape", "expected (2, 16, 8)"),
    (ReturnsNaN(), "finite_output", "NaN/inf"),
])
def test_a_broken_layer_is_a_finding_never_a_crash(layer, detector, words):
    report = audit(layer)
    assert not report.passed
    result = report.result(detector)
    assert result.verdict == "fail" and words in result.evidence, str(report)


@pytest.mark.parametrize("call, words", [
    (lambda: audit(42), "an attention layer"),
    (lambda: audit(nn.Identity()), "pass d_model=... to audit()"),
    (lambda: audit(lambda q, k: q), "a function f(q, k, v, mask=None)"),
    (lambda: audit(MultiHeadAttention(8, 2), seq_len=0), "seq_len >= 1"),
    (lambda: audit(MultiHeadAttention(8, 2), scale=-1.0), "a positive scale"),
    (lambda: audit(MultiHeadAttention(8, 2), detectors=["nope"]), "detector ids from"),
    (lambda: audit(nn.MultiheadAttention(8, 2), mask="additive"), "no mask convention for nn.MultiheadAttention"),
    (lambda: audit(MultiHeadAttention(8, 2), mask="inverted"), "expected a mask convention from the shortcuts allowed, "
                                                               "blocked"),
    (lambda: audit(MultiHeadAttention(8, 2), cross="yes"), "expected cross=True or cross=False"),
    (lambda: audit(MultiHeadAttention(8, 2), call="layer(x)"), "expected call a function call(layer, x, mask)"),
    (lambda: audit(MultiHeadAttention(8, 2), dtype=torch.float16), "dtype=torch.float32 (the layer's parameters)"),
])
def test_misuse_says_what_was_expected_seen_and_the_fix(call, words):
    with pytest.raises(AuditUsageError) as info:
        call()
    text = str(info.value)
    assert words in text and text.startswith("expected ") and "; got " in text and "Fix: " in text


def test_cost_is_a_constant_number_of_forward_passes():
    layer = MultiHeadAttention(16, 2, causal=True)
    passes = {t: audit(layer, causal=True, seq_len=t).forward_passes for t in (4, 32, 96)}
    assert len(set(passes.values())) == 1, passes
    assert passes[4] <= 40  # the budget: within 40 forward passes (benchmarks/audit_cost.py)


def test_report_reads_and_raises():
    good = audit(MultiHeadAttention(16, 2))
    text = str(good)
    assert "PASSED" in text and all(d in text for d in diagnostics.DETECTORS)
    good.raise_for_findings()
    assert diagnostics.assert_attention_ok(MultiHeadAttention(16, 2)).passed
    bad = audit(VARIANTS["missing_causal_mask"].build(16, 2), causal=True)
    with pytest.raises(AttentionAuditError, match="FAIL future_leakage"):
        bad.raise_for_findings()
    finding = bad.findings[0]
    assert (finding.detector, finding.severity) == ("future_leakage", "fail") and finding.fix and finding.evidence
    assert json.loads(json.dumps(bad.to_dict()))["passed"] is False


def test_evidence_reads_like_assert_close():
    report = audit(VARIANTS["missing_causal_mask"].build(16, 2), causal=True)
    evidence = report.result("future_leakage").evidence
    one = (r"\d+ / \d+ past outputs changed \(\d+\.\d%\); greatest change [\d.e+-]+ at \(b=\d+, t=\d+\) "
           r"when only (t>=\d+ was|t>=\d+ of sequence 0 and t>=\d+ of sequence 1 were) perturbed \(x[\d.]+, {mask}\) "
           r"\(up to 1e-05 of the outputs' RMS about their mean "
           r"allowed for float32\)")
    pattern = "no mask: " + one.format(mask="no mask") + "; a padding mask: " + one.format(mask="a padding mask")
    assert re.fullmatch(pattern, evidence), evidence


def test_registry_and_public_surface_agree():
    assert diagnostics.__all__ == sorted(diagnostics.__all__, key=lambda n: (not n.isupper(), n))
    for det_id, det in diagnostics.DETECTORS.items():
        assert det.id == det_id and det.description and det.targets and det.fix and callable(det.check)
    for variant in VARIANTS.values():
        named = variant.expected_detectors + variant.also_detected_by + variant.detected_at_other_sizes_by
        assert set(named) <= set(diagnostics.DETECTORS)


def test_diagnostics_never_imports_the_catalog():
    import pathlib

    for path in pathlib.Path(diagnostics.__file__).parent.rglob("*.py"):  # the detectors and model wings too
        imports = re.findall(r"^\s*(?:from|import)\s+(buggy_variants|correct)\b", path.read_text(), re.M)
        assert not imports, f"{path.name} imports {imports}: detectors must not know any implementation"


@pytest.mark.parametrize("seed", [28, 183, 365])  # the seeds a fixed +-2 redraw and 10000x keys failed on
def test_keys_matter_on_a_correct_bfloat16_layer_whose_keys_barely_act_and_not_on_its_keyless_twin(seed):
    """d_model 1, two tokens, GPT-2's initialisation, bfloat16: W_Q draws ~0.001, so keys move the output by
    rounding-sized amounts. The correct layer must pass keys_matter; the same weights with keys projected from
    the query stream (the catalog's keys_from_query_stream) ignore the key input and must fail it."""
    from correct import gpt2_init_

    results = []
    for make in (MultiHeadAttention, VARIANTS["keys_from_query_stream"].cls):
        torch.manual_seed(seed)
        layer = make(1, 1, causal=True)
        gpt2_init_(layer, seed=seed)
        results.append(audit(layer.to(torch.bfloat16), seq_len=2, seed=seed, causal=True).result("keys_matter"))
    correct_result, keyless = results
    assert correct_result.verdict == "pass", correct_result.evidence
    assert keyless.verdict == "fail" and "changing every key" in keyless.evidence, keyless.evidence
