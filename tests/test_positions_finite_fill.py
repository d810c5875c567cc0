"""`relative_positions` behind a causal mask filled with a finite number (issue 34).

Hugging Face's models block a key by adding finfo(dtype).min to its score; older code adds -1e4 or -1e9. The scores
the distance reading fits then held the blocked keys as finite numbers 1e4 to 3e38 below the rest: no straight line in
the distance, so ALiBi with its sign flipped (far keys rewarded) passed behind such a mask, while the same layer
masking with -inf failed. Real code: BLOOM in transformers 5.25, its `_get_alibi_slopes` negated, passed the whole
model audit (both layers); it now fails `relative_positions` at both, and the unpatched model passes (a script
outside the suite, /work/wt/lead/bloom_flip.py, in the closing note of 2026-12-05). A key whose float32 weight
underflows (under the smallest normal number) is now a blocked key, whatever fill blocked it (`positions.UNDERFLOW`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics.detectors.positions import UNDERFLOW, _scores_seen

DET = "relative_positions"
FILLS = {"-inf": float("-inf"), "finfo.min": torch.finfo(torch.float32).min, "-1e4": -1e4, "-1e9": -1e9}


class MaskedAlibi(nn.Module):
    """Causal ALiBi self-attention on (B, T, D) whose future is blocked by adding `fill` to its scores; `flip`: the
    slopes' sign flipped (the bug: far keys rewarded)."""

    def __init__(self, fill: float, flip: bool, d_model: int = 16, num_heads: int = 2):
        super().__init__()
        self.fill, self.flip, self.num_heads = fill, flip, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, d_model
        H, d = self.num_heads, D // self.num_heads
        q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))  # each (B, H, T, d)
        i, j = torch.arange(T, device=x.device).unsqueeze(-1), torch.arange(T, device=x.device)  # (T, 1), (T,)
        slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=x.device) / H)  # (H,)
        sign = -1.0 if self.flip else 1.0  # the bug's one step: the slopes negated
        alibi = sign * slopes.view(H, 1, 1) * (j - i)  # (H, T, T): <= 0 for past keys when correct
        future = torch.zeros(T, T, device=x.device).masked_fill(j > i, self.fill)  # additive, Hugging Face's way
        scores = q @ k.transpose(-2, -1) / math.sqrt(d) + (alibi + future).to(q.dtype)  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))  # (B, H, T, d) -> (B, T, D)


def _relative_positions(fill: str, flip: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    layer = MaskedAlibi(FILLS[fill], flip)
    if dtype != torch.float32:  # the scale people train at: std 0.02, biases 0, in bfloat16
        gpt2_init_(layer, n_layers=1)
    report = diagnostics.audit(layer.to(dtype), causal=True, dtype=dtype)
    return next(r for r in report.results if r.detector == DET)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", FILLS)
def test_a_flipped_alibi_fails_behind_any_fill_of_its_causal_mask(fill, dtype):
    found = _relative_positions(fill, True, dtype)
    assert found.verdict == "fail", found.message  # before: skip behind finfo.min, -1e4 and -1e9
    assert "rewards distance" in found.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fill", FILLS)
def test_its_correct_twin_is_not_blamed_behind_the_same_fill(fill, dtype):
    found = _relative_positions(fill, False, dtype)
    assert found.verdict in ("pass", "skip"), found.message  # the shift is not possible here (no mask argument)
    assert "rewards distance" not in found.message


class _Record:
    """The little of an observed call that `_scores_seen` reads: one softmax's input."""

    def __init__(self, scores):
        self.softmaxes, self.fused = [type("Softmax", (), {"input": scores})()], []


@pytest.mark.parametrize("below, blocked", [(-UNDERFLOW - 7.0, False), (-UNDERFLOW + 7.0, True)])
def test_a_key_is_blocked_where_its_float32_weight_underflows(below, blocked):
    """The bound from both sides: a key 80.3 below its row's best keeps a float32 weight (1.4e-35), one 94.3 below
    gets one under float32's smallest normal number (exp(-87.3) = 1.2e-38): a blocked key's."""
    scores = torch.zeros(1, 1, 3, 3)
    scores[..., -1] = -below  # the last key of every row
    seen = _scores_seen(_Record(scores), 1, 1, 3)[0]
    assert bool(torch.isinf(seen[..., -1]).all()) is blocked
    assert bool(torch.isfinite(seen[..., :2]).all())
    weight = torch.exp(torch.tensor(-below, dtype=torch.float32))  # what the bound stands for
    assert bool(weight < torch.finfo(torch.float32).tiny) is blocked


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("flip", [False, True])
def test_the_distance_reading_sees_the_keys_each_fill_blocks_and_judges_only_the_flipped_slope(fill, flip):
    """The twin at the reading itself (the audit of the correct layer skips for another reason: it has no mask to
    shift through): scores of identical tokens, ALiBi behind the causal fill, as the layer makes them. Every fill
    leaves exactly the future blocked, and the fitted line rewards distance only where the slope is flipped."""
    from diagnostics.detectors.positions import distance_reward

    T, H = 6, 2
    i, j = torch.arange(T).unsqueeze(-1), torch.arange(T)
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    alibi = (-1.0 if flip else 1.0) * slopes.view(H, 1, 1) * (j - i)  # (H, T, T)
    scores = (0.3 + alibi + torch.zeros(T, T).masked_fill(j > i, FILLS[fill])).unsqueeze(0)  # (1, H, T, T)
    seen = _scores_seen(_Record(scores), 1, 1, T)[0]
    assert torch.equal(torch.isinf(seen[0, 0]), j > i)  # the future, and only it, blocked
    rewarded = distance_reward(_Record(scores), 1, 1, T, torch.float32)
    assert (rewarded is not None) is flip, rewarded
