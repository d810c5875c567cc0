"""A learned factor at 0 before the softmax (issue 33's Zaya): transformers' ZayaQKNorm scales q and k to norm
sqrt(d_k) and multiplies the keys by a learned per-head temperature that its init sets to 0, so at the weights a model
is built with q·k is 0 for every query and key, the weights are uniform, and no factor of q·k can be read.
`softmax_saturation` fitted the softmax to an older product of the same size (x @ W_q, with T = d_k) instead, excluded
it as a projection's, and found nothing: "not measured", and the audit of the correct layer was inconclusive. Now a
q·k that is 0 everywhere leaves the temperature not applicable, said as such, and the rest of the audit judges the
layer. Twins on the same inputs: the same layer with its temperature at 1 is judged (the correct one passes, the one
without 1/sqrt(d_k) fails); at 0 the bug is the same function as the correct layer, bit for bit, which is why nothing
can fail it there."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from correct import gpt2_init_
from diagnostics import audit

D, H = 32, 4  # d_model, heads: d_k = 8, the audit's length equal to it at T = 8


class LearnedTemperature(nn.Module):
    """Causal self-attention with q and k normalised to norm sqrt(d_k) and the keys times a learned temperature per
    head (Zaya's CCA attention, without its convolutions), scaled by 1/sqrt(d_k) unless `scaled` is False (the bug)."""

    def __init__(self, temperature: float = 0.0, scaled: bool = True):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))  # bias-free: plain x @ W products
        self.out = nn.Linear(D, D)
        self.temp = nn.Parameter(torch.full((H,), temperature))
        self.scaled = scaled

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (p(x).view(B, T, H, D // H).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, d)
        d = q.shape[-1]
        q = q * (math.sqrt(d) / q.norm(dim=-1, keepdim=True).clamp_min(1e-6))
        k = k * (math.sqrt(d) / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)) * self.temp[None, :, None, None]
        scores = q @ k.transpose(-2, -1)  # (B, H, T, T): 0 everywhere while temp is 0
        if self.scaled:
            scores = scores / math.sqrt(d)
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


def layer(dtype, **kw):
    torch.manual_seed(0)
    return gpt2_init_(LearnedTemperature(**kw)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_temperature_at_zero_leaves_softmax_saturation_not_applicable_and_the_layer_judged(dtype):
    report = audit(layer(dtype), causal=True, progress=False)
    temperature = report.result("softmax_saturation")
    assert temperature.verdict == "skip" and "q·k is 0 for every query and key" in temperature.message, temperature
    assert report.status == "passed", report.status_reason
    assert report.result("weight_row_sums").verdict == "pass"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_zero_the_unscaled_layer_is_the_correct_one_bit_for_bit_and_at_one_it_fails(dtype):
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(layer(dtype)(x), layer(dtype, scaled=False)(x)), "the same function: nothing to catch"
    right = audit(layer(dtype, temperature=1.0), causal=True, progress=False, detectors=["softmax_saturation"])
    wrong = audit(layer(dtype, temperature=1.0, scaled=False), causal=True, progress=False,
                  detectors=["softmax_saturation"])
    assert right.result("softmax_saturation").verdict == "pass", right.result("softmax_saturation")
    assert wrong.result("softmax_saturation").verdict == "fail", wrong.result("softmax_saturation")


class IntegerScale(LearnedTemperature):
    """The bug written with a constant: `1 // math.sqrt(d_k)`, integer division, is 0, so q·k is 0 everywhere and no
    parameter of the layer is."""

    def __init__(self):
        super().__init__(temperature=1.0, scaled=False)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (p(x).view(B, T, H, D // H).transpose(1, 2) for p in (self.q, self.k, self.v))  # (B, H, T, d)
        scores = (q * (1 // math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)  # 0.0 everywhere
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_q_k_with_no_parameter_at_zero_is_a_factor_of_zero_in_the_code_and_fails(dtype):
    torch.manual_seed(0)
    report = audit(gpt2_init_(IntegerScale()).to(dtype), causal=True, progress=False,
                   detectors=["softmax_saturation"])
    found = report.result("softmax_saturation")
    assert found.verdict == "fail" and "flat, every weight equal" in found.message, found


class ManyZeros(LearnedTemperature):
    """The learned temperature at 0 beside four zero-initialised gates that multiply the output by 1 + gate."""

    def __init__(self):
        super().__init__()
        self.gates = nn.ParameterList([nn.Parameter(torch.zeros(D)) for _ in range(4)])

    def forward(self, x):
        out = super().forward(x)
        for gate in self.gates:
            out = out * (1 + gate)
        return out


def test_the_skip_names_the_zero_parameters_and_only_those():
    torch.manual_seed(0)
    found = audit(gpt2_init_(LearnedTemperature()), causal=True, progress=False,
                  detectors=["softmax_saturation"]).result("softmax_saturation")
    assert "drawn at random (temp, out.bias) it is not" in found.message, found.message  # not every parameter
    torch.manual_seed(0)
    many = audit(gpt2_init_(ManyZeros()), causal=True, progress=False,
                 detectors=["softmax_saturation"]).result("softmax_saturation")
    assert many.verdict == "skip" and "gates.1, ...) it is not" in many.message, many.message  # six, four named
