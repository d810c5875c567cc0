"""A softmax over the queries of q·k is GroupViT's assignment only where something renormalises it over the keys
(review of fed6095). The finder left out of the layer audit, as "renormalised over the keys by design", any module
whose softmax ran over the queries and whose output's storage no later product used as it came; it never looked for
the renormalisation. Hugging Face's layers write `softmax(s, dim=..., dtype=torch.float32).to(q.dtype)`: in bfloat16
the cast makes a new storage, so the wrong axis (the bug `softmax_wrong_dim`) was taken for an assignment, and a model
with a correct layer beside it passed (before that rule: failed weight_row_sums). Now a module is an assignment only
where a row sum of its softmax's output and a division by it are observed (`Renormalisation`, GroupViT's
`attn / (attn.sum(dim=-1, keepdim=True) + eps)`), and the output is followed through the ops that keep its values (a
cast, a copy) to the values' product, where it is counted as attention over the wrong axis.

Twins on one small model in bfloat16 (a correct layer, then the layer under test), its class a Hugging Face one (the
form the rule was for) and a user's: the correct softmax passes; an assignment renormalised over the keys is left out
with its note and the model passes; the wrong axis, cast back from float32, fails weight_row_sums at that layer.
GroupViT's own assignment: tests/test_model_towers.py (the real extra).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics

D, H, V = 32, 4, 64  # width, heads, vocabulary


class FooAttention(nn.Module):
    """Self-attention with Hugging Face's softmax, in float32 and cast back to the queries' dtype. `form`: "correct"
    (over the keys), "assignment" (over the queries, renormalised over the keys before the values' product, as
    GroupViT's) or "wrong_axis" (over the queries, weighed with the values as it came: the bug)."""

    def __init__(self, form: str = "correct"):
        super().__init__()
        self.form = form
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length, width
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        s = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B, H, Tq, Tk)
        w = torch.softmax(s, dim=-1 if self.form == "correct" else -2, dtype=torch.float32).to(q.dtype)
        if self.form == "assignment":
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)  # each query's row over the keys sums to 1 again
        return self.o((w @ v).transpose(1, 2).reshape(B, T, D))


class HFFooAttention(FooAttention):
    pass


HFFooAttention.__module__ = "transformers.models.foo.modeling_foo"  # found by its class, as the library's are


class LM(nn.Module):
    causal = False

    def __init__(self, cls: type, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.attn0, self.attn, self.head = nn.Embedding(V, D), cls(), cls(form), nn.Linear(D, V)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        x = x + self.attn0(x)
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("cls", [HFFooAttention, FooAttention], ids=["hugging_face_class", "users_class"])
@pytest.mark.parametrize("form", ["correct", "assignment", "wrong_axis"])
def test_a_softmax_over_the_queries_cast_back_from_float32_is_an_assignment_only_where_renormalised_over_the_keys(
        cls, form):
    report = diagnostics.audit_model(LM(cls, form).to(torch.bfloat16).eval())
    if form == "correct":
        assert report.status == "passed", report
        assert list(report.layers) == ["attn0", "attn"], list(report.layers)
        return
    if form == "assignment":  # left out (a library's class with its note); the correct layer beside it decides
        assert report.status == "passed", report
        assert list(report.layers) == ["attn0"], list(report.layers)
        noted = any(n.startswith("attn not audited as attention: its softmax runs over the queries")
                    for n in report.notes)
        assert noted == (cls is HFFooAttention), report.notes
        return
    # before: passed, attn left out as "renormalised over the keys by design" (the Hugging Face class), or not found
    assert report.status == "failed", report
    assert {p for p, r in report.layers.items() if r.status == "failed"} == {"attn"}, report
    assert report.layers["attn"].result("weight_row_sums").verdict == "fail", report.layers["attn"]
