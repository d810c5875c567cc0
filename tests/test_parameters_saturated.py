"""`parameters_used` at the gradient checks' logit gain: a softmax saturated to one-hot is no unused projection.

Found by a local Hypothesis draw (2026-12-05): the windowed reference of `window_on_both_sides` at one head of width 1,
two tokens, bfloat16, torch's default init and seed 608 failed `parameters_used` ("the output does not depend on
qkv.weight (on rows 0-1 of 3)"). Its standard probe's logits are flat to bfloat16's rounding, so the gradient checks
scale their tokens by a large logit gain (64.9); on the float64 copy the logits then lie thousands apart, each row of
the softmax one-hot to the last bit, and the query and key rows get a gradient of exactly 0 and move nothing. A zero
gradient there is now asked again at the tokens' plain size. Twin on the same weights, inputs and audit: the same
layer with one step changed, its scores replaced by zeros (q and k computed, then dropped), still fails.
"""

from __future__ import annotations

import pytest
import torch

import diagnostics
from buggy_variants import VARIANTS
from diagnostics._guard import seed_rng

DRAW = dict(d_model=1, heads=1, seq_len=2, seed=608, dtype=torch.bfloat16)  # torch's default init


def built(drops_scores: bool):
    """The catalog's windowed reference as the property tests build it at the draw; with `drops_scores`, its `score`
    step returns zeros (uniform weights over the window: q and k reach nothing)."""
    variant = VARIANTS["window_on_both_sides"]
    seed_rng(DRAW["seed"])
    layer = variant.reference(DRAW["d_model"], DRAW["heads"]).to(DRAW["dtype"])
    if drops_scores:
        reference = type(layer)

        class ScoresDropped(reference):
            def score(self, q, k):
                return torch.zeros_like(reference.score(self, q, k))

        layer.__class__ = ScoresDropped
    return layer, variant.audit_kwargs(layer)


def audited(drops_scores: bool):
    layer, declared = built(drops_scores)
    return diagnostics.audit(layer, seq_len=DRAW["seq_len"], seed=DRAW["seed"], detectors=["parameters_used"],
                             **declared).result("parameters_used")


def test_a_softmax_saturated_by_the_logit_gain_leaves_q_and_k_used():
    found = audited(drops_scores=False)
    assert found.verdict == "pass", found
    # the path was taken: a zero gradient at the gain, a gradient at the plain size
    assert "qkv.weight: zero gradient with the tokens scaled by" in found.evidence, found.evidence


def test_q_and_k_computed_and_dropped_fail_at_the_same_draw():
    found = audited(drops_scores=True)
    assert found.verdict == "fail", found
    assert "qkv.weight" in found.message and "rows 0-1" in found.message, found.message


@pytest.mark.parametrize("drops_scores", [False, True])
def test_the_layer_is_left_as_it_was(drops_scores):
    layer, declared = built(drops_scores)
    before = {n: p.detach().clone() for n, p in layer.state_dict().items()}
    diagnostics.audit(layer, seq_len=DRAW["seq_len"], seed=DRAW["seed"], detectors=["parameters_used"], **declared)
    assert all(torch.equal(before[n], p) for n, p in layer.state_dict().items())


def test_a_layer_with_nothing_unused_is_not_asked_again():
    """The reference at the audit's defaults (torch's init, d_model 32: its logit gain is over 1) passes with no pass at
    the plain size listed: that size is asked only about what is still unused."""
    seed_rng(0)
    layer = VARIANTS["window_on_both_sides"].reference(32, 4)
    found = diagnostics.audit(layer, detectors=["parameters_used"]).result("parameters_used")
    assert found.verdict == "pass", found
    labels = [p.label for p in found.probes if p.label.startswith("float64 copy")]
    assert labels and not any("plain size" in label for label in labels), labels
