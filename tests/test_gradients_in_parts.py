"""The gradient checks read the output of a mask given in parts, with its graph.

A causal layer that takes only a (B, Tk) key mask, and has no `causal` / `is_causal` attribute saying it builds its own
triangle, is given the audit's causal masks one query row at a time: each batch row copied once per query, query q's
output row read from copy q (`_subject._per_query`). The float64 copy that `gradients` and `parameters_used` run on
looked for the layer's output in what its forward returned, (B x T, T, D), found no tensor equal to the (B, T, D) the
audit reads, and both checks were "not measured" on a correct layer (a user's causal block with rotary embeddings from
rotary-embedding-torch 0.0.12 and a padding mask, found auditing real releases). Now the subject hands the output it
reads back with its graph (`_subject.graph_kept`).

Layers of our own writing in that shape: the correct one passes both checks; a twin whose values are its keys
(`v_proj` never read) fails `parameters_used`, and one that detaches its keys fails `gradients`, on the same inputs,
in float32 and in bfloat16 at std 0.02.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics


class KeepMaskCausal(nn.Module):
    """Causal self-attention that builds its own lower triangle and takes a (B, T) key mask, True = keep; no attribute
    says it is causal. `bug`: "values are keys" (v = k_proj(x): v_proj unused) or "keys detached" (a stop-gradient on
    the keys: autograd's gradient is no longer the output's)."""

    def __init__(self, d_model=16, num_heads=2, bug=None):
        super().__init__()
        self.h, self.bug = num_heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))
        self.seen_batches = []  # the batch sizes the layer was called with (the parts, B x T, among them)

    def forward(self, x, mask=None):
        self.seen_batches.append(x.shape[0])
        B, T, D = x.shape
        q, k = (p(x).view(B, T, self.h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj))
        v = (self.k_proj if self.bug == "values are keys" else self.v_proj)(x).view(B, T, self.h, -1).transpose(1, 2)
        k = k.detach() if self.bug == "keys detached" else k
        allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
        s = (q @ k.transpose(-1, -2) / math.sqrt(D // self.h)).masked_fill(~allowed, float("-inf"))
        return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


CHECKS = ["gradients", "parameters_used"]
CASES = [(None, {"gradients": "pass", "parameters_used": "pass"}),
         ("values are keys", {"parameters_used": "fail"}),
         ("keys detached", {"gradients": "fail"})]


def _audit(bug, dtype=torch.float32, init=None, seed=0):
    torch.manual_seed(0)
    layer = KeepMaskCausal(bug=bug)
    if init is not None:
        init(layer)
    return diagnostics.audit(layer.to(dtype), progress=False, causal=True, mask="key_keep", dtype=dtype,
                             detectors=CHECKS, seed=seed), layer


@pytest.mark.parametrize("bug, expected", CASES, ids=["correct", "values are keys", "keys detached"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_causal_mask_given_in_parts_is_measured_by_the_gradient_checks(bug, expected, seed):
    found, layer = _audit(bug, seed=seed)
    for det, verdict in expected.items():
        assert found.result(det).verdict == verdict, found.result(det)
    # the route is the one claimed: the audit's causal masks reached the layer in parts, a copy per query (B x T =
    # 2 x 16 rows; the float64 copy's calls are its own, and its parts are read by the subject test below)
    assert 2 * 16 in layer.seen_batches, layer.seen_batches


@pytest.mark.parametrize("bug, expected", CASES, ids=["correct", "values are keys", "keys detached"])
def test_the_same_in_bfloat16_at_std_0_02(bug, expected, std_002):
    found, _ = _audit(bug, dtype=torch.bfloat16, init=std_002)
    for det, verdict in expected.items():
        assert found.result(det).verdict == verdict, found.result(det)


def test_the_output_keeps_its_graph_only_inside_graph_kept():
    """Outside `graph_kept` the subject's outputs are detached as before (no probe holds a graph it does not need)."""
    from diagnostics._subject import graph_kept, make_subject

    sub = make_subject(KeepMaskCausal(), mask="key_keep")
    x = torch.randn(2, 5, 16, requires_grad=True)
    causal = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    assert sub(x, x, x, causal).out.grad_fn is None
    with graph_kept():
        kept = sub(x, x, x, causal).out
    assert kept.shape == (2, 5, 16) and kept.grad_fn is not None
    assert torch.equal(kept.detach(), sub(x, x, x, causal).out)
