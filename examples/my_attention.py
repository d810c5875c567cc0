"""A multi-head self-attention written by hand, as a user's own layer: the layer the other examples audit."""

import math

from torch import nn


class MyAttention(nn.Module):
    def __init__(self, d_model=32, num_heads=4):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):  # mask: bool (B, 1, T, T), True = may attend
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))
