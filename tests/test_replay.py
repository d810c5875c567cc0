"""Localisation replays the failing case: for every detector that can fail, the first call its localiser traces
is made on the very inputs the verdict was computed on, never on a fresh draw or a copy of the recipe.

Every call of the layer is recorded (the subject's `__call__` and `call_cached`, whatever calls them), tagged with
the detector the audit was running and, after the audit, with "where" while one finding's sites are read. The
first "where" input must be one the same detector passed (or the standard probe's, which detectors share): the
same tensor, a sequence of a batch stacked for comparison, or a window of time a cached step took. The old
localisers failed this: the decoding sites multiplied fresh tokens by 10 where the check used its own gain, the
alignment sites took T // 2 queries where the check took min(T // 2, 8), and every rebuilt probe drew under
`where/<id>`, a seed no check used.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from diagnostics import _audit, _probe, _subject


def _sibling(name: str):
    """A test module of this folder, loaded from its file (the suite also runs under --import-mode=importlib)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"replay_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


never_seen, parameters_tests = _sibling("test_never_seen"), _sibling("test_parameters")
positions_tests = _sibling("test_relative_positions")


class NaNOnOrdinaryInput(nn.Module):
    """Divides the weights by a row sum that is zero for one head: NaN on any input (finite_output fails)."""

    def __init__(self, d_model=16, num_heads=2):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-2, -1) / (D // self.num_heads) ** 0.5).softmax(-1)
        w = w / (w.sum(-1, keepdim=True) - 1)  # a row sum of 1 minus 1: division by zero
        return self.out((w @ v).transpose(1, 2).reshape(B, T, D))


def variant(vid, d_model=16, heads=2):
    def make():
        torch.manual_seed(0)
        layer = VARIANTS[vid].build(d_model, heads)
        return layer, dict(causal=layer.causal)
    return make


FAILING = {  # detector: a layer that fails it (and the audit's options)
    "runs": variant("non_contiguous_view"),
    "output_shape": variant("swapped_self_cross"),
    "finite_output": lambda: (NaNOnOrdinaryInput(), {}),
    "weight_row_sums": variant("no_softmax"),
    "softmax_saturation": variant("missing_scale"),
    "output_variance": variant("no_softmax"),
    "query_locality": variant("swapped_self_cross"),
    "mask_honoured": variant("mask_polarity_inverted"),
    "fully_masked_rows": variant("fully_masked_row_nan"),
    "future_leakage": variant("missing_causal_mask"),
    "causal_alignment": variant("causal_mask_misaligned"),
    "eval_determinism": variant("dropout_in_eval"),
    "batch_independence": variant("heads_merged_sequence_first"),
    "keys_matter": variant("keys_from_query_stream"),
    "decode_consistency": variant("rotary_not_offset"),
    "cache_decoding": lambda: (never_seen.CachedRotary(24, 3, bug="mask"), dict(causal=True)),
    "gradients": variant("detached_softmax"),
    "parameters_used": lambda: (parameters_tests.SeparateProjections(bug="values from keys"), {}),
    "relative_positions": lambda: (positions_tests.build(bug="head axis"), {}),
}


@pytest.fixture
def calls(monkeypatch):
    """[(phase, query)] of every call of the layer: phase is the detector the audit was running, "base" for the
    standard probe, "where" while sites are read."""
    log = {"phase": None, "calls": []}

    def record(query):
        log["calls"].append((log["phase"], query.detach().clone()))

    def wrap(cls, name):
        original = getattr(cls, name)

        def recorded(self, query, *args, **kwargs):
            record(query)
            return original(self, query, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    wrap(_subject.Subject, "__call__")
    wrap(_subject.TorchMHASubject, "__call__")
    wrap(_subject.ModuleSubject, "call_cached")
    run, base = _audit.run, _probe.Probe.base

    def running(det, probe, options=None, **kw):
        log["phase"] = det.id
        return run(det, probe, options, **kw)

    def standard(self):
        asking, log["phase"] = log["phase"], "base"
        try:
            return base(self)
        finally:
            log["phase"] = asking

    monkeypatch.setattr(_audit, "run", running)
    monkeypatch.setattr(_probe.Probe, "base", standard)
    return log


def part_of(traced, given) -> bool:
    """`traced` is `given`, one batch block of it (a comparison stacks [baseline, *cases]), or a window of its
    time axis (a cached step's new tokens); values compared in `traced`'s dtype (the gradient check's inputs are
    float64, its mask localiser reads them in the layer's own)."""
    given = given.to(traced.dtype)
    if traced.dim() != given.dim():
        return False
    if traced.shape == given.shape:
        return torch.equal(traced, given)
    B = traced.shape[0]
    if traced.shape[1:] == given.shape[1:] and given.shape[0] % B == 0:
        return any(torch.equal(traced, block) for block in given.split(B))
    if traced.shape[0] == given.shape[0] and traced.shape[2:] == given.shape[2:]:
        n = traced.shape[1]
        return any(torch.equal(traced, given[:, i:i + n]) for i in range(given.shape[1] - n + 1))
    return False


@pytest.mark.parametrize("det", sorted(FAILING))
def test_the_localiser_traces_the_very_inputs_the_verdict_was_computed_on(det, calls):
    layer, options = FAILING[det]()
    report = diagnostics.audit(layer, seq_len=12, **options)
    result = report.result(det)
    assert result.fired, f"{det} did not fire on its layer:\n{report}"
    assert result.replay is not None, f"{det} failed without its evidence as data"
    calls["phase"] = "where"
    sites = list(result.where)
    assert sites, f"{det}: no site found\n{report}"
    traced = [q for phase, q in calls["calls"] if phase == "where"]
    assert traced, f"{det}: the sites were found without replaying any call"
    given = [q for phase, q in calls["calls"] if phase in (det, "base")]
    for shape in result.probes:  # a probe several detectors read (Probe.shared), made by whichever ran first
        readers = {r.detector for r in report.results if any(p is shape for p in r.probes)}
        if shape.label.startswith("the standard probe (") or len(readers) < 2:
            continue
        given += [q for phase, q in calls["calls"]
                  if phase in readers and q.shape[0] == shape.batch and q.shape[1] == shape.t_q]
    assert any(part_of(traced[0], q) for q in given), (
        f"{det}: the first traced input {tuple(traced[0].shape)} is none of the {len(given)} inputs the detector "
        f"passed: the localiser drew its own")


def test_the_decoding_sites_use_the_gain_of_the_check_not_a_fixed_ten(calls):
    """The first drift, fixed by construction: the localiser reads the check's own tokens (`replay`), so its
    scale is the check's gain whatever that is."""
    layer, options = FAILING["decode_consistency"]()
    result = diagnostics.audit(layer, seq_len=12, **options).result("decode_consistency")
    calls["phase"] = "where"
    assert list(result.where)
    traced = next(q for phase, q in calls["calls"] if phase == "where")
    assert torch.equal(traced, result.replay.query)
    # the check's calls are made by the first of their readers (output_shape reads the last for a causal layer); the
    # full pass is copy 0 of a stacked call (future_leakage's cuts after it, pushed 1000x)
    fresh = next(q for phase, q in calls["calls"] if phase in ("output_shape", "decode_consistency"))
    assert fresh.shape[0] > traced.shape[0]
    assert float(traced.abs().mean()) == pytest.approx(float(fresh[:traced.shape[0]].abs().mean()))


def test_the_alignment_sites_take_as_many_queries_as_the_check(calls):
    """The second drift: with separate key and value inputs, the check caps its queries at 8 (only the newest is
    read); the localiser replays that very query tensor, at seq_len 24 eight queries, not T // 2 = 12."""
    torch.manual_seed(0)

    class Misaligned(nn.Module):  # top-left causal mask over separate query, key, value inputs
        causal = True

        def __init__(self, d_model=16, num_heads=2):
            super().__init__()
            self.attention = nn.MultiheadAttention(d_model, num_heads, batch_first=True)
            self.d_model, self.num_heads = d_model, num_heads

        def forward(self, query, key, value):
            t_q, t_k = query.shape[1], key.shape[1]
            blocked = torch.ones(t_q, t_k, dtype=torch.bool).triu(1)  # top-left: wrong when Tq < Tk
            return self.attention(query, key, value, attn_mask=blocked, need_weights=False)[0]

    result = diagnostics.audit(Misaligned(), causal=True, seq_len=24).result("causal_alignment")
    assert result.verdict == "fail", result
    calls["phase"] = "where"
    assert list(result.where)
    traced = next(q for phase, q in calls["calls"] if phase == "where")
    assert traced.shape[1] == 8 == result.replay.query.shape[1]
