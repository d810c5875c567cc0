"""Pins for the rest of the seed-21 mutation sample's survivors at 000bb4a (issue 37; tests/test_pins_seed21.py holds
the first part): guards that turn a measurement no layer can give into a visible skip, and constants read at a
boundary. As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each side), and constants
are quoted as literals (a test that read them from the module would follow a mutated value).

- cache_parity shares the prefill of the first schedule (i == 0) with the schedules that start with a chunk of the
  same length. At T = 7 the prefill is 1 token, and so would be the second chunk of "steps of 1": shared from the
  wrong step, "steps of 3" would start from a cache of 2 tokens and fail a correct model. T = 8 (prefill 2) is the
  twin, and the rotary-offset bug still fails at 7.
- softmax_saturation's `_stated_temperature` takes a factor within rel_tol 1e-6 of 1 for the declared scale itself
  (the declared scale judges, whatever float the layer holds): 1 + 5e-7 is that, 1 + 5e-6 is a temperature the layer
  states.
- attention_pattern: a layer whose output reads no key is a skip (its not moving where the pattern blocks proves
  nothing), its twin that reads its keys passes; a decoder that raises when the queries are fewer than the keys is
  judged on the full pass (the decoding measurement's baseline call is not run), its twin also while decoding.
- relative_positions: an output without a row per query (the newest row dropped) is a skip naming output_shape.
- parameters_used's `_gated_by_zeros` draws an all-zero parameter as N(0, 1) / sqrt(fan-in), fan-in 1 for a vector
  (`p.dim() > 1`): a zero-initialised per-feature gate of 64 entries that opens a side path only past 0.5 (a dead
  zone, softshrink) opens it at N(0, 1) draws (the side projection is used: pass); drawn at N(0, 1) / 8 it stays shut
  and the side projection would be called unused. Its twin that never reads the side projection fails.
- output_variance: learned key/value slots whose weighted sum no matmul shows (a broadcast product summed over the
  keys) are a skip saying so; the same layer with `w @ v` passes.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from buggy_variants.teaching_model import ProtocolGPT
from correct import MultiHeadAttention
from diagnostics._guard import seed_rng
from diagnostics.detectors.temperature import _Cosine, _stated_temperature
from diagnostics.patterns import sliding_window



def _sibling(name: str):
    """A test module beside this one, loaded by its path (importable under --import-mode=importlib too)."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PositionalAttention = _sibling("test_relative_positions").PositionalAttention  # rotary, half-split pairs

# ---- cache_parity: the prefill shared at i == 0 -------------------------------------------------------------------


@pytest.mark.parametrize("T", [7, 8])
def test_cache_parity_shares_the_first_chunk_only_and_passes_a_correct_model_at_t7_and_t8(T):
    """At T = 7 every schedule's plan is read and a correct rotary model passes (a prefill shared from step i = 1
    instead of 0 fails it there); the rotary-offset bug fails on the same T."""
    seed_rng(0)
    good = ProtocolGPT(rotary=True)
    seed_rng(1)
    report = diagnostics.audit_model(good, seq_len=T, detectors=["cache_parity"])
    result = report.result("cache_parity")
    assert result.verdict == "pass", str(report)
    plans = {name: r["plan"] for name, r in report.readings["cache_parity"].items()}
    assert plans["steps of 3"][0] == plans["steps of 1"][0] == T - 6, plans
    if T == 7:
        seed_rng(0)
        bad = ProtocolGPT(rotary=True, layer_bugs={1: "rotary_no_offset"})
        seed_rng(1)
        assert diagnostics.audit_model(bad, seq_len=T, detectors=["cache_parity"]).result(
            "cache_parity").verdict == "fail"


# ---- softmax_saturation: a factor of 1 is the declared scale -----------------------------------------------------


class HoldsAFloat(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.gain = value


@pytest.mark.parametrize("off", [5e-7, 5e-6])
def test_a_factor_within_1e6_of_one_is_the_declared_scale_and_one_past_it_a_stated_temperature(off):
    """rel_tol=1e-6: a factor 1 + 5e-7 is the declared scale itself (None: the declared scale judges), even where the
    layer holds that very number; 1 + 5e-6, held by the layer, is its own temperature (the cosine bounds judge)."""
    cosine = _Cosine(1.0, "q and k reach q·k normalised")
    got = _stated_temperature(HoldsAFloat(1.0 + off), 1.0 + off, 0.125, cosine)
    if off < 1e-6:
        assert got is None
    else:
        assert got is not None and "HoldsAFloat.gain" in got.seen and got.bound == cosine.bound, got


# ---- attention_pattern: no key read, and a decoding baseline that raises --------------------------------------------


class ReadsKeys(nn.Module):
    """MultiHeadAttention(16, 2), or (`blind`) a layer whose output is twice its query: it reads no key."""

    def __init__(self, blind: bool):
        super().__init__()
        self.inner, self.blind = MultiHeadAttention(16, 2), blind

    def forward(self, query, key, value, mask=None):
        return 2 * query if self.blind else self.inner(query, key, value, mask=mask)


@pytest.mark.parametrize("blind", [True, False])
def test_a_layer_that_reads_no_key_is_not_measured_by_attention_pattern(blind):
    torch.manual_seed(0)
    report = diagnostics.audit(ReadsKeys(blind), pattern=sliding_window(4), seq_len=12,
                               detectors=["attention_pattern"])
    result = report.result("attention_pattern")
    if blind:
        assert result.verdict == "skip" and "did not respond to any key" in result.message, result.message
    else:
        assert result.verdict == "pass", result.message


class SquareOnly(nn.Module):
    """MultiHeadAttention(16, 2) that (`square`) raises when the queries are fewer than the keys."""

    def __init__(self, square: bool):
        super().__init__()
        self.inner, self.square = MultiHeadAttention(16, 2), square

    def forward(self, query, key, value, mask=None):
        if self.square and query.shape[1] != key.shape[1]:
            raise ValueError("as many queries as keys, please")
        return self.inner(query, key, value, mask=mask)


@pytest.mark.parametrize("square", [True, False])
def test_a_decoding_baseline_that_raises_leaves_the_full_pass_verdict(square):
    """The decoding measurement's baseline call raising is `not_run` there: the full pass's verdict stands, without
    the words "and while decoding" that its twin, measured both ways, earns."""
    torch.manual_seed(0)
    report = diagnostics.audit(SquareOnly(square), causal=True, pattern=sliding_window(4), seq_len=12,
                               detectors=["attention_pattern"])
    result = report.result("attention_pattern")
    assert result.verdict == "pass", result.message
    assert ("while decoding" in result.message) == (not square), result.message


# ---- relative_positions: an output without a row per query -------------------------------------------------------


class DropsNewest(PositionalAttention):
    """The rotary layer of tests/test_relative_positions.py, its newest row dropped (`drop`)."""

    def __init__(self, drop: bool):
        super().__init__(kind="rotary")
        self.drop = drop

    def forward(self, x, mask=None):
        out = super().forward(x, mask)
        return out[:, :-1] if self.drop else out


@pytest.mark.parametrize("drop", [True, False])
def test_relative_positions_skips_an_output_without_a_row_per_query(drop):
    seed_rng(0)
    result = diagnostics.audit(DropsNewest(drop), positions="relative",
                               detectors=["relative_positions"]).result("relative_positions")
    if drop:
        assert result.verdict == "skip" and "has no row per query" in result.message, result.message
    else:
        assert result.verdict == "pass", result.message


# ---- output_variance: learned slots whose weighted sum no matmul shows ------------------------------------------


class MemorySlot(nn.Module):
    """Self-attention on (B, T, D) with one learned key/value slot; `product`: "matmul" (w @ v) or "sum" (the same
    weighted sum as a broadcast product summed over the keys, which no matmul shows)."""

    def __init__(self, product: str, d_model=16, num_heads=2):
        super().__init__()
        self.h, self.product = num_heads, product
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mem_k, self.mem_v = nn.Parameter(torch.randn(1, d_model)), nn.Parameter(torch.randn(1, d_model))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        k = torch.cat([k, self.mem_k.expand(B, 1, D)], 1)
        v = torch.cat([v, self.mem_v.expand(B, 1, D)], 1)
        q, k, v = (t.reshape(B, -1, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        w = (q @ k.transpose(-2, -1) / math.sqrt(D // self.h)).softmax(-1)
        y = w @ v if self.product == "matmul" else (w.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("product", ["sum", "matmul"])
def test_learned_slots_without_a_product_seen_are_a_skip_and_with_one_judged(product):
    torch.manual_seed(0)
    result = diagnostics.audit(MemorySlot(product), detectors=["output_variance"]).result("output_variance")
    if product == "sum":
        assert result.verdict == "skip" and "no product of their weights with the values" in result.message, \
            result.message
    else:
        assert result.verdict == "pass" and "learned key/value slot" in result.message, result.message


# ---- parameters_used: a vector gate drawn at N(0, 1), not N(0, 1) / sqrt(its length) ------------------------------


class DeadZoneGate(nn.Module):
    """MultiHeadAttention(64, 4) plus `gate * x` and (`reads_side`) a side projection of x through the same
    zero-initialised per-feature gate, which opens only past 0.5 (softshrink): at initialisation the side path is shut,
    so the side projection's gradient is exactly 0 until the gate is drawn."""

    def __init__(self, reads_side: bool, d_model=64):
        super().__init__()
        self.attn, self.side = MultiHeadAttention(d_model, 4), nn.Linear(d_model, d_model, bias=False)
        self.gate, self.reads_side = nn.Parameter(torch.zeros(d_model)), reads_side

    def forward(self, x, mask=None):
        out = self.attn(x, x, x, mask=mask)
        out = (out[0] if isinstance(out, tuple) else out) + self.gate * x
        return out + self.side(x * F.softshrink(self.gate, 0.5)) if self.reads_side else out


@pytest.mark.parametrize("reads_side", [True, False])
def test_a_zero_vector_gate_is_drawn_at_unit_scale_so_a_dead_zone_opens(reads_side):
    torch.manual_seed(0)
    result = diagnostics.audit(DeadZoneGate(reads_side), detectors=["parameters_used"]).result("parameters_used")
    if reads_side:
        assert result.verdict == "pass", result.message
    else:
        assert result.verdict == "fail" and "side.weight" in result.message, result.message
