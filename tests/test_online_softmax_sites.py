"""Issue 34's cause 9, localisation: an online (blockwise, flash-style) softmax that forgets to rescale a running
value when a new block of keys raises the running max. Its weights are never a (Tq, Tk) tensor, so no softmax is
there to point at; the finding points at the line that adds the block to the running value unscaled.

The layers are written as a tutorial of FlashAttention-2 in plain PyTorch writes them (Dao 2023, Algorithm 1): query
blocks of `Br` rows, key blocks of `Bc` columns, `O_i`, `l_i`, `m_i` per query block, normalised once at the end;
unlike this project's layers and unlike tests/test_never_seen.py's chunked kernel (which forgets the running sum,
`l`): here the weighted values `O_i` are not rescaled. Each buggy layer has its correct twin, audited the same way.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from torch import nn

from diagnostics import audit


def flash_attention_forward(q, k, v, mask=None, Br=4, Bc=4, rescale_output=True):
    """FlashAttention-2's forward pass, tiled in plain PyTorch. q, k, v: (B, H, N, d); mask: True = may attend."""
    N, d = q.shape[-2], q.shape[-1]
    softmax_scale = 1.0 / math.sqrt(d)
    O = q.new_zeros(q.shape[:-1] + (v.shape[-1],))  # (B, H, N, d_v)
    for i in range(0, N, Br):
        Q_i = q[..., i:i + Br, :] * softmax_scale
        O_i = Q_i.new_zeros(Q_i.shape[:-1] + (v.shape[-1],))
        l_i = torch.zeros(Q_i.shape[:-1] + (1,), dtype=q.dtype)
        m_i = torch.full(Q_i.shape[:-1] + (1,), -math.inf, dtype=q.dtype)
        for j in range(0, k.shape[-2], Bc):
            K_j, V_j = k[..., j:j + Bc, :], v[..., j:j + Bc, :]
            S_ij = Q_i @ K_j.transpose(-1, -2)
            if mask is not None:
                S_ij = S_ij.masked_fill(~mask[..., i:i + Br, j:j + Bc], -math.inf)
            m_new = torch.maximum(m_i, S_ij.max(dim=-1, keepdim=True).values)
            m_safe = m_new.clamp_min(torch.finfo(q.dtype).min)  # a row with every key masked so far: no NaN
            P_ij = torch.exp(S_ij - m_safe)
            alpha = torch.exp(m_i - m_safe)
            l_i = alpha * l_i + P_ij.sum(dim=-1, keepdim=True)
            if rescale_output:
                O_i = alpha * O_i + P_ij @ V_j
            else:
                O_i = O_i + P_ij @ V_j  # BUG: O_i stays relative to the old max
            m_i = m_new
        O[..., i:i + Br, :] = O_i / l_i.clamp_min(1e-30)  # a fully masked row gives 0, as SDPA
    return O


def flash_without_output_rescale(q, k, v, mask=None):
    return flash_attention_forward(q, k, v, mask, rescale_output=False)


def online_sum_both_forgotten(q, k, v, mask=None, block=5):
    """One query block, keys in blocks of 5, `torch.max` of a concatenation for the running max, and neither the
    running sum nor the weighted values rescaled: both lines are the bug."""
    scores_scale = q.shape[-1] ** -0.5
    running_max = q.new_full(q.shape[:-1] + (1,), -1e30)
    denominator = q.new_zeros(q.shape[:-1] + (1,))
    numerator = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    for start in range(0, k.shape[-2], block):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k[..., start:start + block, :]) * scores_scale
        if mask is not None:
            scores = scores.masked_fill(~mask[..., start:start + block], -1e30)
        running_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        e = torch.exp(scores - running_max)
        denominator = denominator + e.sum(-1, keepdim=True)  # BUG
        numerator = numerator + torch.einsum("bhqk,bhkd->bhqd", e, v[..., start:start + block, :])  # BUG
    return numerator / denominator.clamp_min(1e-30)


def online_sum_both_rescaled(q, k, v, mask=None, block=5):
    scores_scale = q.shape[-1] ** -0.5
    running_max = q.new_full(q.shape[:-1] + (1,), -1e30)
    denominator = q.new_zeros(q.shape[:-1] + (1,))
    numerator = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    for start in range(0, k.shape[-2], block):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k[..., start:start + block, :]) * scores_scale
        if mask is not None:
            scores = scores.masked_fill(~mask[..., start:start + block], -1e30)
        previous, running_max = running_max, torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        e = torch.exp(scores - running_max)
        shrink = torch.exp(previous - running_max)
        denominator = denominator * shrink + e.sum(-1, keepdim=True)
        numerator = numerator * shrink + torch.einsum("bhqk,bhkd->bhqd", e, v[..., start:start + block, :])
    return numerator / denominator.clamp_min(1e-30)


def chunked_in_place(q, k, v, mask=None, chunk=6, rescale_sum=True):
    """Accumulators updated in place, one tensor each for the whole loop, as a memory-minded port writes them."""
    m = q.new_full(q.shape[:-1] + (1,), float("-inf"))  # (B, H, Tq, 1)
    denom = torch.zeros_like(m)
    acc = q.new_zeros(q.shape[:-1] + (v.shape[-1],))  # (B, H, Tq, d_v)
    for s0 in range(0, k.shape[-2], chunk):
        logits = q @ k[..., s0:s0 + chunk, :].mT / math.sqrt(q.shape[-1])  # (B, H, Tq, c)
        if mask is not None:
            logits = logits.masked_fill(~mask[..., s0:s0 + chunk], float("-inf"))
        m_next = torch.maximum(m, logits.amax(-1, keepdim=True)).clamp_min(-1e30)
        w = (logits - m_next).exp()
        shrink = (m - m_next).exp()
        acc.mul_(shrink).add_(w @ v[..., s0:s0 + chunk, :])
        if rescale_sum:
            denom.mul_(shrink).add_(w.sum(-1, keepdim=True))
        else:
            denom.add_(w.sum(-1, keepdim=True))  # BUG
        m = m_next
    return acc / denom.clamp_min(1e-30)


def chunked_in_place_without_sum_rescale(q, k, v, mask=None):
    return chunked_in_place(q, k, v, mask, rescale_sum=False)


class BlockwiseAttention(nn.Module):
    """A module in the same tutorial's style: fused qkv, keys in blocks of `Bc`, a key-padding mask (True = keep)."""

    def __init__(self, dim, n_heads, Bc=4, rescale=True):
        super().__init__()
        self.n_heads, self.head_dim, self.Bc, self.rescale = n_heads, dim // n_heads, Bc, rescale
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
                   for t in self.to_qkv(x).chunk(3, dim=-1))  # (b, h, n, d) each
        q = q * self.head_dim ** -0.5
        O = torch.zeros_like(q)
        row_max = torch.full((b, self.n_heads, n, 1), -float("inf"))
        row_sum = torch.zeros((b, self.n_heads, n, 1))
        for j in range(0, n, self.Bc):
            S = q @ k[:, :, j:j + self.Bc].transpose(-1, -2)  # (b, h, n, Bc)
            if mask is not None:
                S = S.masked_fill(~mask[:, None, None, j:j + self.Bc], -1e9)
            new_max = torch.maximum(row_max, S.max(dim=-1, keepdim=True).values)
            P = torch.exp(S - new_max)
            alpha = torch.exp(row_max - new_max)
            row_sum = alpha * row_sum + P.sum(dim=-1, keepdim=True)
            O = (alpha * O if self.rescale else O) + P @ v[:, :, j:j + self.Bc]  # BUG (when not self.rescale)
            row_max = new_max
        return self.to_out((O / row_sum).permute(0, 2, 1, 3).reshape(b, n, -1))


def bug_lines(function) -> list[int]:
    lines, start = inspect.getsourcelines(function)
    return [start + n for n, line in enumerate(lines) if "# BUG" in line]


def run(function):
    torch.manual_seed(0)
    return audit(function)


def test_flash_tutorial_without_output_rescale_points_at_the_output_update():
    report = run(flash_without_output_rescale)
    result = report.result("output_variance")
    assert result.verdict == "fail", str(report)
    assert result.where, "no site: the online softmax's missing rescale was not found"
    assert (result.where[0].file, result.where[0].line) == (__file__, bug_lines(flash_attention_forward)[0])
    assert "rescale" in result.where[0].fix
    # the other finding on the same weights points at the same line
    rows = report.result("weight_row_sums")
    assert rows.verdict == "fail" and rows.where[0].line == bug_lines(flash_attention_forward)[0]


def test_flash_tutorial_with_its_rescale_passes():
    report = run(flash_attention_forward)
    assert report.status == "passed", str(report)
    assert all(not r.where for r in report.results)


def test_both_running_values_unscaled_point_at_both_lines():
    result = run(online_sum_both_forgotten).result("relative_positions")
    assert result.verdict == "fail"
    assert [s.line for s in result.where[:2]] == bug_lines(online_sum_both_forgotten)


def test_a_running_sum_updated_in_place_points_at_its_update():
    result = run(chunked_in_place_without_sum_rescale).result("output_variance")
    assert result.verdict == "fail"
    assert result.where and result.where[0].line == bug_lines(chunked_in_place)[0]


@pytest.mark.parametrize("function", [online_sum_both_rescaled, flash_attention_forward, chunked_in_place])
def test_rescaled_twins_pass_under_a_mask_too(function):
    torch.manual_seed(0)
    report = audit(function, mask="allowed")
    assert report.status == "passed", str(report)


def test_module_without_output_rescale_points_at_the_update_of_its_output():
    """Identical tokens never raise the running max, so only the shifted positions show this one."""
    torch.manual_seed(0)
    report = audit(BlockwiseAttention(32, 4, rescale=False), mask="key_keep")
    result = report.result("relative_positions")
    assert result.verdict == "fail", str(report)
    assert (result.where[0].file, result.where[0].line) == (__file__, bug_lines(BlockwiseAttention)[0])


def test_module_with_its_rescale_has_no_finding():
    torch.manual_seed(0)
    report = audit(BlockwiseAttention(32, 4), mask="key_keep")
    assert not [r.detector for r in report.results if r.verdict in ("fail", "warn")], str(report)
