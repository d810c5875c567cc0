"""A batch of copies (issue 33's diffusers PAG processors with classifier-free guidance): a diffusion pipeline hands
an attention layer the same latents once per guidance part ([unconditioned, conditioned], then PAG's perturbed path),
so the softmax sees a batch whose two halves are equal. `softmax_saturation` reads q·k's factor from the difference
between the batch halves (it cancels any bias that is the same for every sequence), which is 0 there: nothing was
read, and the layer's temperature was "not measured". Where the products' halves are equal, their even and odd rows
are paired instead. Twins on the same inputs: the layer with 1/sqrt(d_k) passes, without it fails, each measured.
Three copies are the control: their halves ([x0, x1, x0] and [x1, x0, x1]) differ, read as before the change."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from correct import gpt2_init_
from diagnostics import audit

D, H = 32, 4  # d_model, heads


class GuidedAttention(nn.Module):
    """Self-attention run on `copies` copies of its batch, as a guidance pipeline runs it, returning the first."""

    def __init__(self, copies: int = 2, scaled: bool = True):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.copies, self.scaled = copies, scaled

    def forward(self, x):
        B = x.shape[0]  # batch
        x = x.repeat(self.copies, 1, 1)  # (copies x B, T, D): one copy per guidance part
        T = x.shape[1]  # sequence length
        q, k, v = self.qkv(x).view(x.shape[0], T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (copies B, H, T, d)
        scores = q @ k.transpose(-2, -1)  # (copies B, H, T, T)
        if self.scaled:
            scores = scores / math.sqrt(q.shape[-1])
        weights = torch.softmax(scores, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(x.shape[0], T, D))[:B]


def temperature(dtype, **kw):
    torch.manual_seed(0)
    layer = gpt2_init_(GuidedAttention(**kw)).to(dtype)
    return audit(layer, progress=False, detectors=["softmax_saturation"]).result("softmax_saturation")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copies", [2, 3])
def test_a_batch_of_copies_has_its_temperature_read_and_a_missing_scale_fails(dtype, copies):
    right, wrong = temperature(dtype, copies=copies), temperature(dtype, copies=copies, scaled=False)
    assert right.verdict == "pass", right
    assert wrong.verdict == "fail" and "too sharp" in wrong.message, wrong
