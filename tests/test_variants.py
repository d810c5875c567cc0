"""The catalog is honest: each variant is the reference with one step changed, and it differs from the
reference exactly where its `detectable_when` says the bug is observable."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import buggy_variants
from buggy_variants import VARIANTS, Setting, promised_pattern
from correct import MultiHeadAttention
from diagnostics._guard import seed_rng
from diagnostics.strategies import MASK_KINDS, AttentionCase, attention_cases

REQUIRED = {
    "missing_scale", "no_softmax", "mask_after_softmax", "missing_causal_mask", "swapped_self_cross",
    "non_contiguous_view", "softmax_wrong_dim", "heads_merged_without_transpose", "mask_polarity_inverted",
    "causal_mask_misaligned", "dropout_in_eval", "fully_masked_row_nan",
}
STEPS = {name for name, f in vars(MultiHeadAttention).items() if inspect.isfunction(f) and not name.startswith("_")}
IDS = sorted(VARIANTS)


def test_catalog_has_the_required_variants_with_every_field_filled():
    assert REQUIRED <= set(VARIANTS)
    for vid, variant in VARIANTS.items():
        assert variant.id == vid
        for text in (variant.title, variant.explanation, variant.symptom, variant.fix, str(variant.detectable_when)):
            assert isinstance(text, str) and text.strip(), f"{vid}: empty field"
        assert variant.expected_severity in ("fail", "warn")


@pytest.mark.parametrize("vid", IDS)
def test_each_variant_overrides_exactly_one_step(vid):
    variant = VARIANTS[vid]
    overridden = {name for name, f in vars(variant.cls).items() if inspect.isfunction(f)}
    assert overridden == {variant.step}, f"{vid} overrides {overridden}, declared step {variant.step!r}"
    assert variant.step in STEPS and variant.step != "forward"
    assert variant.cls.__mro__[1] is MultiHeadAttention


@st.composite
def settings_and_cases(draw):
    """An AttentionCase plus how the layer is used: self- or cross-attention, train or eval."""
    case = draw(attention_cases(max_len=8, max_head_dim=6,
                                mask_kinds=tuple(k for k in MASK_KINDS if k != "causal_top_left")))
    self_attention = draw(st.booleans())
    if self_attention and case.t_k != case.t_q:
        case = AttentionCase(**{**case.__dict__, "t_k": case.t_q})
    return case, self_attention, draw(st.booleans())


def _run(layer, case, self_attention, query, memory, mask):
    seed_rng(case.seed)  # the same dropout draws for both layers
    try:
        with torch.no_grad():
            if self_attention:
                return layer(query, mask=mask)
            return layer(query, memory, memory, mask=mask)
    except RuntimeError as error:
        return error


@pytest.mark.parametrize("vid", IDS)
@given(drawn=settings_and_cases())
@example(drawn=(AttentionCase(2, 1, 4, 4, 5, 5, "none", 0), True, False))  # H = 1: view happens to work
@example(drawn=(AttentionCase(2, 3, 4, 4, 1, 6, "none", 0), False, False))  # Tq = 1: one decoding step
@example(drawn=(AttentionCase(1, 2, 1, 1, 4, 4, "none", 0), True, False))  # d_k = 1: no scale to miss, view works
@example(drawn=(AttentionCase(1, 1, 1, 1, 1, 2, "padding", 0), False, False))  # Tq = 1: one score broadcast over keys
def test_variant_differs_from_reference_exactly_when_detectable(vid, drawn):
    case, self_attention, training = drawn
    variant = VARIANTS[vid]
    seed_rng(case.seed)
    broken = variant.build(case.d_model, case.heads).double().train(training)
    reference = variant.reference(case.d_model, case.heads).double().train(training)
    reference.load_state_dict(broken.state_dict())
    query, memory = case.inputs(dtype=torch.float64)
    mask = case.mask()  # (B, 1, Tq, Tk) bool or None
    setting = Setting(case.d_model, case.heads, case.t_q, case.t_k, mask=mask, self_attention=self_attention,
                      causal=reference.causal, dropout=reference.dropout_p, training=training, batch=case.batch,
                      pattern=promised_pattern(reference))

    expected_out = _run(reference, case, self_attention, query, memory, mask)
    got = _run(broken, case, self_attention, query, memory, mask)
    assert not isinstance(expected_out, Exception), expected_out
    same = not isinstance(got, Exception) and all(
        g.shape == e.shape and torch.allclose(g, e, atol=1e-9, rtol=1e-9, equal_nan=True)
        for g, e in zip(got, expected_out))
    observable = variant.detectable_when(setting)
    assert same != observable, (
        f"{vid}: detectable_when ({variant.detectable_when}) says {observable}, but the variant "
        f"{'agrees with' if same else 'differs from'} the reference on {case} "
        f"({'self' if self_attention else 'cross'}-attention, {'train' if training else 'eval'})")


def test_non_contiguous_view_raises_the_error_users_see():
    layer = VARIANTS["non_contiguous_view"].build(8, 2)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        layer(torch.randn(2, 5, 8))


def test_public_surface_is_alphabetised():
    assert buggy_variants.__all__ == sorted(buggy_variants.__all__)
