"""torch's fused attention kernels read as the layer called them, on every device (the first CUDA run, on an H200).

`F.scaled_dot_product_attention` reaches the observer as one of several kernels, and each orders its arguments its
own way: CUDA's memory-efficient and cuDNN kernels take `attn_bias` and then `compute_log_sumexp` (True whenever an
input requires grad) before `is_causal`. Reading "the first bool after q, k, v" as the causal flag made every masked
call on CUDA look causal ("every weight above the diagonal is exactly 0 though no mask was passed": a warning on
correct layers). And torch pads a head width its CUDA kernels cannot take to a multiple of 8 with zero columns while
passing the scale of the width the layer wrote: heads of width 1 in bfloat16 were judged against 1/sqrt(8), "2.83x
too sharp". Both are read from the op's schema and the padding's shape here, each with the twin that must stay as it
was; the CUDA-parametrized tests (tests/test_detectors_catch.py, test_observed_conventions.py, test_never_seen.py)
exercise them end to end where a GPU is present.
"""

from __future__ import annotations

import torch

from diagnostics._observe import fused_arguments, unpadded

EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
CUDNN = "aten._scaled_dot_product_cudnn_attention.default"
FLASH = "aten._scaled_dot_product_flash_attention.default"
FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
MATH = "aten._scaled_dot_product_attention_math.default"


def _qkv(width: int = 4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 5, width, generator=g) for _ in range(3)]


def test_a_masked_call_to_the_memory_efficient_kernel_is_not_causal_because_it_computes_its_log_sum_exp():
    q, k, v = _qkv()
    bias = torch.zeros(2, 3, 5, 5)
    mask, causal, scale = fused_arguments(EFFICIENT, (q, k, v, bias, True, 0.0, False), {})
    assert mask is bias and causal is False and scale is None
    # the twin: the same kernel told is_causal=True, without a bias
    mask, causal, scale = fused_arguments(EFFICIENT, (q, k, v, None, True, 0.0, True), {"scale": 0.5})
    assert mask is None and causal is True and scale == 0.5


def test_each_kernel_is_read_by_its_own_argument_names():
    q, k, v = _qkv()
    m = torch.ones(5, 5, dtype=torch.bool)
    assert fused_arguments(CUDNN, (q, k, v, m, True, 0.0, False, False), {})[:2] == (m, False)
    assert fused_arguments(CUDNN, (q, k, v, None, False, 0.0, True, False), {})[:2] == (None, True)
    assert fused_arguments(FLASH, (q, k, v, 0.0, True, False), {"scale": 0.25}) == (None, True, 0.25)
    assert fused_arguments(FLASH_CPU, (q, k, v, 0.0, False), {"attn_mask": m})[:2] == (m, False)
    assert fused_arguments(MATH, (q, k, v, m, 0.0, True), {})[:2] == (m, True)


def test_an_op_whose_schema_is_unknown_is_read_by_position():
    q, k, v = _qkv()
    m = torch.ones(5, 5, dtype=torch.bool)
    assert fused_arguments("aten.no_such_attention.default", (q, k, v, m, True), {})[:2] == (m, True)
    assert fused_arguments("aten.no_such_attention.default", (q, k, v), {}) == (None, False, None)


def test_heads_padded_by_torch_to_eight_columns_are_read_at_the_width_the_layer_wrote():
    q, k, v = _qkv(width=1)
    pad = [torch.nn.functional.pad(t, (0, 7)) for t in (q, k, v)]
    out = torch.nn.functional.pad(torch.randn(2, 3, 5, 1), (0, 7))
    got = unpadded(*pad, out, pads=True)
    assert [t.shape[-1] for t in got] == [1, 1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(got[:3], (q, k, v)))
    # the twins: where torch does not pad (the CPU), and a width of 3 padded to 16 (no kernel pads past the next 8)
    assert [t.shape[-1] for t in unpadded(*pad, out, pads=False)] == [8, 8, 8, 8]
    wide = [torch.nn.functional.pad(t, (0, 13)) for t in _qkv(width=3)]
    assert [t.shape[-1] for t in unpadded(*wide, None, pads=True)[:3]] == [16, 16, 16]


def test_a_width_in_use_to_its_last_column_or_a_multiple_of_eight_is_never_cut():
    q, k, v = _qkv(width=8)
    assert [t.shape[-1] for t in unpadded(q, k, v, v.clone(), pads=True)] == [8, 8, 8, 8]
    # 8 columns in use of 16, zeros after: 8 is a width the kernels take, so nothing was padded
    wide = [torch.nn.functional.pad(t, (0, 8)) for t in (q, k, v)]
    assert [t.shape[-1] for t in unpadded(*wide, None, pads=True)[:3]] == [16, 16, 16]
    # q's columns past 5 are zero but k's are not: the product uses them, nothing is cut
    q6 = torch.nn.functional.pad(_qkv(width=5)[0], (0, 3))
    assert unpadded(q6, k, v, None, pads=True)[0].shape[-1] == 8
