"""The reference is right: it agrees with torch's SDPA and nn.MultiheadAttention, judged against float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

import correct
from correct import AttentionUsageError, MultiHeadAttention, causal_mask, scaled_dot_product_attention
from diagnostics.strategies import AttentionCase, attention_cases

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _torch_sdpa(case: AttentionCase, q, k, v):
    """torch's own SDPA on the same case: is_causal for top-left, the mask tensor for every other kind."""
    if case.mask_kind == "causal_top_left":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = case.mask(device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _ours(case: AttentionCase, q, k, v):
    if case.mask_kind == "causal_top_left":
        return scaled_dot_product_attention(q, k, v, is_causal=True)
    return scaled_dot_product_attention(q, k, v, case.mask(device=q.device))


@given(case=attention_cases())
@example(case=AttentionCase(1, 1, 1, 1, 1, 1, "none", 0))  # d_k = 1, one token
@example(case=AttentionCase(2, 3, 5, 7, 4, 9, "causal_bottom_right", 1))  # odd widths, cached decoding
@example(case=AttentionCase(2, 2, 3, 3, 5, 5, "fully_masked_row", 2))
def test_sdpa_matches_torch_in_float64(case):
    q, k, v = case.qkv(dtype=torch.float64)  # (B, H, Tq, d), (B, H, Tk, d), (B, H, Tk, d_v)
    out, weights = _ours(case, q, k, v)
    torch.testing.assert_close(out, _torch_sdpa(case, q, k, v), atol=1e-12, rtol=1e-12)
    # weights are the ones the output was made from, rows sum to 1 (0 where every key is blocked)
    torch.testing.assert_close(weights @ v, out, atol=1e-12, rtol=1e-12)
    row_sums = weights.sum(-1)
    assert ((row_sums - 1).abs() < 1e-12).logical_or(row_sums == 0).all()


@given(case=attention_cases())
def test_sdpa_float32_is_as_close_to_the_float64_golden_as_torch(case, device):
    golden = _torch_sdpa(case, *case.qkv(dtype=torch.float64, device=device))
    q, k, v = case.qkv(dtype=torch.float32, device=device)
    ours, _ = _ours(case, q, k, v)
    # torch's test_transformers default tolerances for float32
    torch.testing.assert_close(ours.double(), golden, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@given(case=attention_cases())
def test_sdpa_low_precision_error_at_most_twice_torchs(case, device, dtype):
    """flash-attention's criterion: max|ours - golden| <= 2 * max|torch_sdpa_lowprec - golden|."""
    golden = _torch_sdpa(case, *case.qkv(dtype=torch.float64, device=device))
    qkv = case.qkv(dtype=dtype, device=device)
    ours_err = (_ours(case, *qkv)[0].double() - golden).abs().max()
    torch_err = (_torch_sdpa(case, *qkv).double() - golden).abs().max()
    assert ours_err <= 2 * torch_err + torch.finfo(dtype).eps, f"ours {ours_err:.3g} vs torch {torch_err:.3g}"


def _torch_mha_like(layer: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    """nn.MultiheadAttention holding the very same weights (its in_proj is our fused qkv)."""
    bias = layer.qkv.bias is not None
    mha = torch.nn.MultiheadAttention(layer.d_model, layer.num_heads, bias=bias, batch_first=True)
    mha = mha.to(dtype=layer.qkv.weight.dtype, device=layer.qkv.weight.device)
    with torch.no_grad():
        mha.in_proj_weight.copy_(layer.qkv.weight)
        mha.out_proj.weight.copy_(layer.out.weight)
        if bias:
            mha.in_proj_bias.copy_(layer.qkv.bias)
            mha.out_proj.bias.copy_(layer.out.bias)
    return mha.eval()


@given(case=attention_cases(max_head_dim=8), bias=st.booleans(), self_attention=st.booleans())
def test_multi_head_attention_matches_torch(case, bias, self_attention, device):
    if self_attention:
        case = AttentionCase(**{**case.__dict__, "t_k": case.t_q})
    torch.manual_seed(case.seed)
    ours = MultiHeadAttention(case.d_model, case.heads, bias=bias).to(device=device, dtype=torch.float64).eval()
    theirs = _torch_mha_like(ours)
    query, memory = case.inputs(dtype=torch.float64, device=device)  # (B, Tq, D), (B, Tk, D)
    memory = query if self_attention else memory
    mask = case.mask(device=device)  # (B, 1, Tq, Tk), True = may attend
    blocked = None if mask is None else (~mask).expand(-1, case.heads, -1, -1).reshape(-1, case.t_q, case.t_k)

    out, weights = ours(query, memory, memory, mask=mask)
    with torch.no_grad():
        their_out, _ = theirs(query, memory, memory, attn_mask=blocked, need_weights=False)  # SDPA path
        _, their_weights = theirs(query, memory, memory, attn_mask=blocked, average_attn_weights=False)
    # nn.MultiheadAttention gives NaN where a query may attend no key; we give zero weights (and so the
    # output projection's bias), as F.scaled_dot_product_attention does. Elsewhere the two agree.
    empty = torch.zeros(case.batch, case.heads, case.t_q, 1, dtype=torch.bool, device=device) if mask is None \
        else ~mask.any(-1, keepdim=True).expand(-1, case.heads, -1, -1)  # (B, H, Tq, 1)
    assert torch.equal(torch.isnan(their_weights).any(-1, keepdim=True), empty)
    assert (weights.masked_select(empty) == 0).all()
    torch.testing.assert_close(weights.masked_fill(empty, 0), their_weights.masked_fill(empty, 0), atol=1e-12, rtol=1e-12)
    empty_rows = empty[:, 0]  # (B, Tq, 1)
    torch.testing.assert_close(out.masked_fill(empty_rows, 0), their_out.masked_fill(empty_rows, 0), atol=1e-12, rtol=1e-12)


def _complex_rotary(x, positions):
    """RoPE written another way: each half-split pair (x_i, x_{i + d/2}) as one complex number, times e^{i t theta_i}."""
    half = x.shape[-1] // 2
    theta = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)  # (d/2,)
    z = torch.complex(x[..., :half], x[..., half:2 * half]) * torch.polar(torch.ones(1, dtype=torch.float64),
                                                                          positions.double().unsqueeze(-1) * theta)
    return torch.cat([z.real, z.imag, x[..., 2 * half:]], dim=-1)


@given(case=attention_cases(max_head_dim=8, mask_kinds=("none",)), causal=st.booleans())
def test_rotary_multi_head_attention_is_rope_then_torchs_sdpa(case, causal):
    """In float64: the same projections, q and k rotated by complex multiplication, queries at the last Tq of
    Tk positions, torch's SDPA (bottom-right causal mask); and decoding the last rows over all keys gives the
    full pass's last rows."""
    torch.manual_seed(case.seed)
    ours = MultiHeadAttention(case.d_model, case.heads, causal=causal, rotary=True).double().eval()
    query, memory = case.inputs(dtype=torch.float64)  # (B, Tq, D), (B, Tk, D)
    out, _ = ours(query, memory, memory)
    split = lambda x: x.view(x.shape[0], x.shape[1], case.heads, -1).transpose(1, 2)  # noqa: E731  (B, H, T, d_k)
    q, k, v = (split(t) for t in ours.project(query, memory, memory))
    t_q, t_k = case.t_q, case.t_k
    q = _complex_rotary(q, torch.arange(t_k - t_q, t_k))
    k = _complex_rotary(k, torch.arange(t_k))
    mask = causal_mask(t_q, t_k, align="bottom_right") if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, Tq, d_k)
    empty = None if mask is None else ~mask.any(-1)  # (Tq,): rows torch gives NaN, we give zeros
    expected = ours.out(expected.nan_to_num(0.0).transpose(1, 2).reshape(query.shape))
    if empty is not None:
        expected[:, empty] = ours.out.bias
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
    tail = max(1, t_q // 2)
    part, _ = ours(query[:, -tail:], memory, memory)  # the last queries, as a decoding step sees them
    torch.testing.assert_close(part, out[:, -tail:], atol=1e-12, rtol=1e-12)


def test_causal_mask_alignments():
    torch.testing.assert_close(causal_mask(4, 4), torch.ones(4, 4).tril().bool())
    torch.testing.assert_close(causal_mask(4, 4, align="bottom_right"), causal_mask(4, 4))
    # one new token decoding against a cache of 5: top-left lets it see key 0 only, bottom-right all 6
    assert causal_mask(1, 6).tolist() == [[True] + [False] * 5]
    assert causal_mask(1, 6, align="bottom_right").all()
    # Tq > Tk with bottom-right: the first Tq - Tk queries see nothing
    assert causal_mask(3, 1, align="bottom_right").squeeze(-1).tolist() == [False, False, True]


@pytest.mark.parametrize("d_model", [1, 2, 7, 8, 15])
def test_sinusoidal_positional_encoding(d_model):
    pe = correct.sinusoidal_positional_encoding(11, d_model)
    assert pe.shape == (11, d_model)
    t, col = 9, d_model - 1
    freq = 10000 ** (-(col - col % 2) / d_model)
    expected = math.sin(t * freq) if col % 2 == 0 else math.cos(t * freq)
    assert pe[t, col].item() == pytest.approx(expected, abs=1e-6)
    assert pe[0, 0::2].eq(0).all() and pe[0, 1::2].eq(1).all()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: MultiHeadAttention(10, 3), "choose num_heads in {1, 2, 5, 10}"),
        (lambda: MultiHeadAttention(8, 2)(torch.randn(5, 8)), "add the batch dimension"),
        (lambda: MultiHeadAttention(8, 2)(torch.randn(2, 5, 6)), "build the layer with d_model=6"),
        (lambda: MultiHeadAttention(8, 2)(torch.randn(2, 5, 8), torch.randn(3, 4, 8)), "one batch size"),
        (lambda: MultiHeadAttention(8, 2)(torch.randn(2, 5, 8), mask=torch.ones(2, 1, 4, 5).bool()),
         "(B, 1, 1, Tk)"),
        (lambda: scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 3)),
         "same last dimension"),
        (lambda: scaled_dot_product_attention(*[torch.randn(1, 2, 2)] * 3, torch.ones(1, 2, 2, dtype=torch.long)),
         "mask.bool()"),
        (lambda: causal_mask(2, 2, align="bottom-right"), "align='bottom_right'"),
    ],
)
def test_misuse_says_what_was_expected_seen_and_the_fix(make, words):
    with pytest.raises(AttentionUsageError) as info:
        make()
    message = str(info.value)
    assert words in message and message.startswith("expected ") and "; got " in message and "Fix: " in message
    assert isinstance(info.value, ValueError)


def test_public_surface_is_alphabetised_and_complete():
    assert correct.__all__ == sorted(correct.__all__)
    assert all(hasattr(correct, name) for name in correct.__all__)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@given(case=attention_cases(max_head_dim=8, mask_kinds=("none", "causal_bottom_right", "padding", "random")))
def test_multi_head_attention_low_precision_error_at_most_twice_torchs(case, device, dtype):
    torch.manual_seed(case.seed)
    golden_layer = MultiHeadAttention(case.d_model, case.heads).to(device=device, dtype=torch.float64).eval()
    ours = MultiHeadAttention(case.d_model, case.heads).to(device=device, dtype=dtype).eval()
    ours.load_state_dict(golden_layer.state_dict())
    theirs = _torch_mha_like(ours)
    query, memory = case.inputs(dtype=torch.float64, device=device)
    mask = case.mask(device=device)
    golden, _ = golden_layer(query, memory, memory, mask=mask)
    blocked = None if mask is None else (~mask).expand(-1, case.heads, -1, -1).reshape(-1, case.t_q, case.t_k)
    q_lp, m_lp = query.to(dtype), memory.to(dtype)
    ours_err = (ours(q_lp, m_lp, m_lp, mask=mask)[0].double() - golden).abs().max()
    with torch.no_grad():
        their_out, _ = theirs(q_lp, m_lp, m_lp, attn_mask=blocked, need_weights=False)
    torch_err = (their_out.double() - golden).abs().max()
    assert ours_err <= 2 * torch_err + torch.finfo(dtype).eps, f"ours {ours_err:.3g} vs torch {torch_err:.3g}"
