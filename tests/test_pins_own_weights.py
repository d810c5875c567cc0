"""Pins for own_weights' numbers (issue 37): the float64-golden rule as it applies it (FUDGE, FUDGE_BY_DTYPE and
GOLDEN_FLOOR of diagnostics/_thresholds.py, its own float64 floor), the 10x rule that names a step of the reference,
and the scales it tries. For each, a case just inside and one just outside, per dtype where the number is per dtype;
the constants quoted as literals (a test that read them from the module would follow a mutated constant). Tiny
layers: the file runs in a few seconds, before tests/test_own_weights.py in the mutants' selection.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import correct

from diagnostics._core import baseline_scale
from diagnostics._projections import NotApplicable, Projections, recognise
from diagnostics.detectors.own_weights import _close


def _sibling(name: str):
    """A test module beside this one, loaded by its path (importable under --import-mode=importlib too)."""
    spec = importlib.util.spec_from_file_location(f"{__name__}_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_own = _sibling("test_own_weights")
GroupedQueryAttention, built, own_weights = _own.GroupedQueryAttention, _own.built, _own.own_weights

GOLDEN_FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FLOOR = {**GOLDEN_FLOOR, torch.float64: 1e-5}  # own_weights' float64 floor is float32's, not the golden rule's 1e-9
FUDGE = {torch.float32: 10.0, torch.float16: 10.0, torch.bfloat16: 2.0}  # FUDGE, and bfloat16's FUDGE_BY_DTYPE
INSIDE, OUTSIDE = 0.25, 4.0


def off_by(error: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a float64 'golden' output on a grid every dtype holds exactly, the same in `dtype` with one entry, 0 in the
    golden output, moved by `error` times the golden output's RMS)."""
    golden = torch.randint(-8, 9, (2, 6, 8), generator=torch.Generator().manual_seed(0)).double() / 8
    golden[0, 2, 3] = 0.0
    out = golden.clone()
    out[0, 2, 3] = error * baseline_scale(golden)
    return golden, out.to(dtype)


@pytest.mark.parametrize("dtype", list(FLOOR), ids=str)
def test_own_weights_allows_its_floor_where_the_same_dtype_recompute_is_exact(dtype):
    """The floor alone (the same-dtype recompute exact, or a float64 layer, which has none): a quarter of it passes,
    four times fails; float64's is float32's 1e-5 (Hugging Face's eager softmax runs in float32), so 2.5e-6 passes
    there, which the golden rule's 1e-9 would fail."""
    for factor, passes in ((INSIDE, True), (OUTSIDE, False)):
        golden, out = off_by(factor * FLOOR[dtype], dtype)
        same = None if dtype == torch.float64 else golden.to(dtype)
        err, allowed, _ = _close(out, golden, same)
        assert allowed == pytest.approx(FLOOR[dtype], rel=1e-6)
        assert (err <= allowed) is passes, (factor, err, allowed)


@pytest.mark.parametrize("dtype", list(FUDGE), ids=str)
def test_own_weights_allows_fudge_times_the_same_dtype_recomputes_error(dtype):
    """The same-dtype recompute off by 10x the floor: the allowed error is FUDGE (bfloat16: 2) x that, plus the
    floor; half the fudge passes, twice fails, so FUDGE or FUDGE_BY_DTYPE tenfold either way crosses one."""
    own = 10 * FLOOR[dtype]
    allowed_here = FUDGE[dtype] * own + FLOOR[dtype]
    for factor, passes in ((0.5, True), (2.0, False)):
        golden, out = off_by(factor * FUDGE[dtype] * own, dtype)
        _, same = off_by(own, dtype)
        err, allowed, _ = _close(out, golden, same)
        assert allowed == pytest.approx(allowed_here, rel=1e-2)
        assert (err <= allowed) is passes, (factor, err, allowed)


class Between(GroupedQueryAttention):
    """A float64 layer whose output lies on the line from the attention its weights define (t = 0) to the same
    attention with the scale 1.0 (t = 1), one of the steps own_weights tries: ref + t (step - ref). Its query
    projection shrunk by 2e-5, so that the step moves the output by about 4e-5 of its RMS, four times the float64
    floor: the floor does not decide, the 10x rule does."""

    def __init__(self, t: float):
        super().__init__(d_model=16, num_heads=2, num_key_value_heads=2)
        self.t = t
        with torch.no_grad():
            self.q_proj.weight.mul_(2e-5)
            self.q_proj.bias.mul_(2e-5)

    def forward(self, hidden_states, attention_mask=None):
        self.applied_scale = self.scaling
        ref = super().forward(hidden_states, attention_mask)
        self.applied_scale = 1.0
        step = super().forward(hidden_states, attention_mask)
        return ref + self.t * (step - ref)


def test_a_step_is_named_only_where_it_is_10x_closer_than_the_reference():
    """_judge: a step explains the output where it reproduces it (within the allowed error) AND is at most a tenth
    as far from it as the reference: at t = 0.95 the step is 0.05 / 0.95 = 1/19 as far (named: a fail with the
    fix), at t = 0.85 0.15 / 0.85 = 1/5.7 (not named: this class is not a known library's, so the difference is
    not applicable, as for a step of its own). Both within the allowed error of the step; a factor of 1 or 100 in
    place of 10 flips one."""
    full = own_weights(built(lambda: Between(1.0), torch.float64))
    assert full.verdict == "fail" and 2e-5 < full.value < 8e-5 and full.threshold == pytest.approx(1e-5), full
    named = own_weights(built(lambda: Between(0.95), torch.float64))
    assert named.verdict == "fail" and "the layer applies 1, its weights' 0.3536 expected" in named.evidence, named
    unnamed = own_weights(built(lambda: Between(0.85), torch.float64))
    assert unnamed.verdict == "skip" and "no one step of the reference explains it" in unnamed.message, unnamed


@pytest.mark.parametrize("scale, shown", [(1.0, "1"), (1 / 8, "0.125"), (32 ** -0.5, "0.1768"), (8 ** 0.5, "2.828")],
                         ids=["1", "1/d", "1/sqrt(H d)", "sqrt(d)"])
def test_each_scale_own_weights_tries_is_named(scale, shown):
    """The scales tried (d = 8, H = 4): 1.0, 1/d (= its own scale squared), 1/sqrt(H d) (the model width's), sqrt(d);
    each, applied by the layer, is named; its twin applies its own and passes."""
    wrong = own_weights(built(lambda: GroupedQueryAttention(scale=scale), torch.float32))
    assert wrong.verdict == "fail" and f"the layer applies {shown}, its weights' 0.3536 expected" in wrong.evidence
    right = own_weights(built(lambda: GroupedQueryAttention(scale=8 ** -0.5), torch.float32))
    assert right.verdict == "pass", right.evidence


# ---- _projections: the masks as each family takes them, dropout, QK-norm --------------------------------------


@pytest.mark.parametrize("make", [GroupedQueryAttention, lambda: nn.MultiheadAttention(32, 4, batch_first=True).eval(),
                                  lambda: correct.MultiHeadAttention(32, 4)],
                         ids=["hugging face", "torch", "reference"])
def test_a_causal_audits_mask_is_read_as_each_family_passes_it(make):
    """A causal audit passes the causal mask to each (Hugging Face's True = may attend; torch's attn_mask True =
    blocked; the reference's True = may attend): recomputed with the call's mask, the correct layer passes; read the
    other way round (or broadcast wrong) the recompute would differ by far more than rounding."""
    result = own_weights(built(make, torch.float32), causal=True)
    assert result.verdict == "pass" and "recomputed with no causal mask, the call's mask" in result.evidence, result


def test_a_causal_audit_of_the_wrong_order_fails_with_the_mask_read():
    wrong = own_weights(built(lambda: GroupedQueryAttention(wrong_order=True), torch.float32), causal=True)
    assert wrong.verdict == "fail" and "repeated in the wrong order" in wrong.evidence, wrong


class Dropped(GroupedQueryAttention):
    """GroupedQueryAttention with an nn.Dropout of probability `p` on its output."""

    def __init__(self, p: float):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, hidden_states, attention_mask=None):
        return self.drop(super().forward(hidden_states, attention_mask))


@pytest.mark.parametrize("make, training, reason", [
    (lambda: Dropped(0.1), True, "dropout drop (p=0.1) is active in training mode"),
    (lambda: nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True), True, "dropout=0.1 is active in training"),
    (lambda: Dropped(0.1), False, None), (lambda: Dropped(0.0), True, None),
    (lambda: nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True), False, None),
    (lambda: nn.MultiheadAttention(32, 4, dropout=0.0, batch_first=True), True, None),
], ids=["module p=0.1 train", "mha 0.1 train", "module eval", "module p=0 train", "mha eval", "mha 0 train"])
def test_a_module_with_dropout_active_is_not_recognised_and_off_or_zero_it_is(make, training, reason):
    """_dropout_active, read by the recognisers directly: random outputs cannot be recomputed; in eval mode, or at
    p = 0, they can (`p > 0`). An audit never meets the first case (it puts the layer in eval mode before any
    detector runs), so this is the recogniser's own contract, for a caller outside an audit."""
    found = recognise(built(make, torch.float32).train(training))
    if reason:
        assert isinstance(found, str) and reason in found, found
    else:
        assert isinstance(found, Projections), found


class QKNorm(nn.Module):
    """timm-like attention with a fused qkv and QK-norm: LayerNorm over each head's width (`per_head`) or over all
    heads at once (OLMo 2's); `skips_k_norm`: the key's norm built but not applied (the recompute applies it)."""

    def __init__(self, d_model=32, num_heads=4, *, per_head=True, skips_k_norm=False):
        super().__init__()
        self.num_heads, self.head_dim, self.per_head, self.skips_k_norm = num_heads, d_model // num_heads, per_head, \
            skips_k_norm
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        width = self.head_dim if per_head else d_model
        self.q_norm, self.k_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        with torch.no_grad():  # not the identity at initialisation: a norm left out shows
            for norm in (self.q_norm, self.k_norm):
                norm.weight.uniform_(0.5, 2.0)
                norm.bias.normal_()

    def forward(self, x, mask=None):
        B, T, D = x.shape
        H, d = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).split(D, -1)  # (B, T, D) each
        if not self.per_head:
            q, k = self.q_norm(q), k if self.skips_k_norm else self.k_norm(k)
        q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        if self.per_head:
            q, k = self.q_norm(q), k if self.skips_k_norm else self.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("per_head", [True, False], ids=["per head", "all heads"])
def test_qk_norms_are_applied_per_head_or_over_all_heads_as_their_width_says(per_head):
    """attend: a q_norm / k_norm whose width is the heads' together is applied before the split, one of a head's width
    after it; the layer that applies them so passes, its twin that skips the key's norm is not reproduced (an
    unknown class: no step explains it, so not applicable, never a pass)."""
    right = own_weights(built(lambda: QKNorm(per_head=per_head), torch.float32))
    assert right.verdict == "pass", right.evidence
    skipped = own_weights(built(lambda: QKNorm(per_head=per_head, skips_k_norm=True), torch.float32))
    assert skipped.verdict == "skip" and "no one step of the reference explains it" in skipped.message, skipped


def declares(scaling: float, applies: float):
    """GroupedQueryAttention (d = 8) that declares `scaling` (read as its own scale) and multiplies by `applies`."""
    layer = GroupedQueryAttention()
    layer.scaling, layer.applied_scale = scaling, applies
    return layer


@pytest.mark.parametrize("applies, shown", [(1 / 8, "0.125"), (0.25 ** 2, "0.0625")], ids=["1/d", "own squared"])
def test_one_over_d_and_the_own_scale_squared_are_tried_apart(applies, shown):
    """With its own scale 0.25 (not 1/sqrt(d)), 1/d = 0.125 and 0.25^2 = 0.0625 are two candidates: each is named
    where the layer applies it; its twin applies 0.25 and passes."""
    wrong = own_weights(built(lambda: declares(0.25, applies), torch.float32))
    assert wrong.verdict == "fail" and f"the layer applies {shown}, its weights' 0.25 expected" in wrong.evidence, wrong
    right = own_weights(built(lambda: declares(0.25, 0.25), torch.float32))
    assert right.verdict == "pass", right.evidence


# ---- _projections.huggingface: what it reads, without transformers (the real layers' tests need the extra) -------


def apply_rotary_pos_emb(q, k, cos, sin):
    """Llama's signature, found by the recogniser in the module that defines the class (this one)."""
    return q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin


class HF(nn.Module):
    """A Hugging Face-style attention of width 32 with projections of the widths given (None: no such projection),
    named q_proj, k_proj, v_proj (or `names`), an o_proj unless `o` is False, or one stacked `qkv_proj` of `fused`
    rows; every other keyword becomes an attribute (num_heads, head_dim, scaling, config, ...)."""

    def __init__(self, q=32, k=16, v=16, *, o=True, names=("q_proj", "k_proj", "v_proj"), fused=None, **attrs):
        super().__init__()
        if fused:
            self.qkv_proj = nn.Linear(32, fused)
        else:
            for name, width in zip(names, (q, k, v)):
                if width:
                    setattr(self, name, nn.Linear(32, width))
        if o:
            self.o_proj = nn.Linear(32, 32)
        for name, value in attrs.items():
            setattr(self, name, value)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_ids=None):
        raise NotImplementedError  # read, never called


def config(**kw):
    return SimpleNamespace(**kw)


@pytest.mark.parametrize("make, expected", [
    (lambda: HF(num_heads=4, num_key_value_heads=2, head_dim=8), (4, 2, 8, "HF.num_heads")),
    (lambda: HF(config=config(num_attention_heads=4, num_key_value_heads=2)), (4, 2, 8, "config.num_attention_heads")),
    (lambda: HF(num_heads=0, config=config(num_attention_heads=4)), (4, 2, 8, "config.num_attention_heads")),
    (lambda: HF(num_heads=True, config=config(num_attention_heads=4)), (4, 2, 8, "config.num_attention_heads")),
    (lambda: HF(head_dim=8), (4, 2, 8, "q_proj's 32 features / head_dim")),
    (lambda: HF(), "no number of heads on the module or its config"),
    (lambda: HF(num_heads=4, head_dim=4), "projection widths q 32, k 16, v 16 are not 4 heads"),
    (lambda: HF(k=12, num_heads=4, num_key_value_heads=2, head_dim=8), "projection widths q 32, k 12, v 16"),
    (lambda: HF(v=8, num_heads=4, num_key_value_heads=2, head_dim=8), "projection widths q 32, k 16, v 8"),
    (lambda: HF(k=24, v=24, num_heads=4, num_key_value_heads=3, head_dim=8), "are not 4 heads (HF.num_heads) and 3"),
    (lambda: HF(num_heads=4, attn_logit_softcapping=50.0), "attn_logit_softcapping is set"),
    (lambda: HF(num_heads=4, config=config(logit_softcapping=30.0)), "logit_softcapping is set"),
    (lambda: HF(fused=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
     (4, 2, 8, "HF.num_attention_heads")),
    (lambda: HF(fused=96, num_attention_heads=4, head_dim=8), (4, 4, 8, "HF.num_attention_heads")),
    (lambda: HF(fused=64, num_attention_heads=4), "a fused qkv_proj, but no num_attention_heads and head_dim"),
    (lambda: HF(fused=60, num_attention_heads=4, num_key_value_heads=2, head_dim=8), "qkv_proj gives 60 features"),
    (lambda: HF(o=False, num_heads=4), None),
    (lambda: HF(v=None, num_heads=4), None),
    (lambda: HF(q=32, k=32, v=32, o=False, names=("query", "key", "value"), num_heads=4), (4, 4, 8, "HF.num_heads")),
], ids=["module", "config", "zero on the module", "bool on the module", "head_dim only", "no heads", "q width",
        "k width", "v width", "H % G", "softcapping", "config softcapping", "fused", "fused, no kv heads",
        "fused, no head_dim", "fused width", "no output projection", "no v_proj", "BERT's query, key, value"])
def test_what_the_hugging_face_recogniser_reads(make, expected):
    """huggingface(): heads, key/value heads and head width from the module, else its config (positive ints only),
    else the projections' widths; every width checked; soft-capping and an incomplete set of projections refused
    (a str: not applicable) or not recognised (None)."""
    found = recognise(make())
    if expected is None or isinstance(expected, str):
        assert found == expected if expected is None else (isinstance(found, str) and expected in found), found
        return
    H, G, d, where = expected
    assert isinstance(found, Projections) and (found.heads, found.kv_heads, found.head_dim) == (H, G, d), found
    assert where in found.read[0], found.read
    assert (found.o is None) is (not hasattr(found.module, "o_proj")), found  # BERT's: its parent projects


@pytest.mark.parametrize("scaling, scale", [(None, 8 ** -0.5), (0.25, 0.25), (0.0, 8 ** -0.5), (True, 8 ** -0.5)],
                         ids=["none", "0.25", "zero", "bool"])
def test_the_scale_is_the_modules_positive_scaling_else_one_over_sqrt_head_dim(scaling, scale):
    found = recognise(HF(num_heads=4, **({} if scaling is None else {"scaling": scaling})))
    assert found.scale == pytest.approx(scale), found.read
    assert ("no `scaling` attribute" in found.read[1]) is (scale != 0.25), found.read


def test_a_q_norm_alone_is_read():
    found = recognise(HF(num_heads=4, q_norm=nn.LayerNorm(8)))
    assert isinstance(found, Projections) and any("q_norm / k_norm applied" in r for r in found.read), found


@pytest.mark.parametrize("args, expected", [
    ({"position_embeddings": (torch.ones(1, 4, 8), torch.zeros(1, 4, 8))}, "rotary tables from the call's"),
    ({"position_embeddings": [torch.ones(1, 4, 8), torch.zeros(1, 4, 8)]}, "no (cos, sin) pair"),
    ({"position_embeddings": (torch.ones(1, 4, 4), torch.zeros(1, 4, 4))}, "rotary tables from the call's"),
    ({"position_embeddings": (torch.ones(1, 4, 16), torch.zeros(1, 4, 16))}, "rotary tables of width 16, not at most"),
    ({"position_ids": torch.arange(4)[None]}, "the call passes positions the module turns into rotary tables"),
    ({"position_ids": None}, ()),
    ({}, ()),
], ids=["tables", "a list", "partial width", "wider than a head", "position ids", "no position ids", "nothing"])
def test_a_calls_rotary_tables_are_read_as_llamas_and_others_refused(args, expected):
    """inputs(): (cos, sin) of at most the head width (a partial rotary is left to the module's own
    apply_rotary_pos_emb, which keeps the rest of each head), applied by that function; another form, tables wider
    than a head, or positions the module makes tables of itself: not applicable."""
    p = recognise(HF(num_heads=4, head_dim=8))
    x = torch.randn(1, 4, 32)
    if isinstance(expected, str) and not expected.startswith("rotary tables from"):
        with pytest.raises(NotApplicable, match=re.escape(expected)):
            p.inputs({"hidden_states": x, **args})
        return
    got = p.inputs({"hidden_states": x, **args})
    if expected == ():
        assert got.rotary is None and got.read == (), got
    else:
        assert got.rotary is not None and any(expected in r for r in got.read), got



@pytest.mark.parametrize("keeps_shape", [True, False], ids=["Llama's", "another shape"])
def test_a_calls_rotary_is_applied_by_the_modules_function_and_another_shape_refused(keeps_shape, monkeypatch):
    """inputs()'s rotary: the module's own apply_rotary_pos_emb turns q and k (here q cos + flip(q) sin); where it
    returns another shape than it is given (a partial rotary applied in its own way), not applicable. Pins the shape
    test `turned[0].shape != q_.shape or ...`: with `==` the right shape would be refused."""
    if not keeps_shape:
        monkeypatch.setattr(sys.modules[__name__], "apply_rotary_pos_emb", lambda q, k, cos, sin: (q[..., :4], k))
    p = recognise(HF(num_heads=4, head_dim=8))
    cos, sin = torch.rand(1, 4, 8), torch.rand(1, 4, 8)  # (1, T, d)
    got = p.inputs({"hidden_states": torch.randn(1, 4, 32), "position_embeddings": (cos, sin)})
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)  # (B, H, T, d), (B, G, T, d)
    if keeps_shape:
        turned = got.rotary(q, k)
        torch.testing.assert_close(turned[0], q * cos + q.flip(-1) * sin)
        torch.testing.assert_close(turned[1], k * cos + k.flip(-1) * sin)
    else:
        with pytest.raises(NotApplicable, match="returns another shape than it is given"):
            got.rotary(q, k)

# ---- own_weights: a zero output, several modules, a module called twice, a causal mask of the layer's own --------


@pytest.mark.parametrize("factor, passes", [(INSIDE, True), (OUTSIDE, False)])
def test_an_error_against_a_zero_recompute_is_measured_against_1(factor, passes):
    """_close: a recompute that is zero everywhere has no RMS; the error is then measured against 1.0 (`or 1.0`):
    a quarter of the float64 floor passes, four times fails (against 0.1 or 10 one of them would cross)."""
    golden = torch.zeros(2, 6, 8, dtype=torch.float64)
    out = golden.clone()
    out[0, 2, 3] = factor * 1e-5
    err, allowed, _ = _close(out, golden, None)
    assert err == pytest.approx(factor * 1e-5) and (err <= allowed) is passes, (err, allowed)


class Pair(nn.Module):
    """Two attention modules side by side, `first` and `second`, each over the input; `wrong`: the second repeats
    its key/value heads in the wrong order."""

    def __init__(self, wrong=False):
        super().__init__()
        self.first, self.second = GroupedQueryAttention(), GroupedQueryAttention(wrong_order=wrong)

    def forward(self, hidden_states):
        return self.first(hidden_states) + self.second(hidden_states)


@pytest.mark.parametrize("wrong", [False, True])
def test_each_of_several_attention_modules_is_judged_under_its_own_name(wrong):
    """_find and _name: every identified module is judged (a sibling found later is not taken for a child of the
    first), named by its path; the second in the wrong order fails by its name."""
    result = own_weights(built(lambda: Pair(wrong), torch.float32), d_model=32)
    assert "GroupedQueryAttention (first): " in result.evidence and "GroupedQueryAttention (second): " in \
        result.evidence, result.evidence
    if wrong:
        assert result.verdict == "fail" and result.message.startswith("the output of GroupedQueryAttention (second) "
                                                                      "is not the attention"), result
    else:
        assert result.verdict == "pass", result.evidence


def test_the_audited_layer_itself_is_named_without_a_path():
    result = own_weights(built(GroupedQueryAttention, torch.float32))
    assert result.evidence.startswith("GroupedQueryAttention: q_proj, k_proj"), result.evidence


class Twice(nn.Module):
    """One attention module applied twice (weights shared): its first call is the one recomputed, with its output."""

    def __init__(self):
        super().__init__()
        self.attn = GroupedQueryAttention()

    def forward(self, hidden_states):
        return self.attn(self.attn(hidden_states))


def test_a_module_called_twice_is_judged_on_its_first_calls_inputs_and_output():
    result = own_weights(built(Twice, torch.float32), d_model=32)
    assert result.verdict == "pass", result.evidence


class CausalInside(GroupedQueryAttention):
    """A decoder that builds its own causal mask and takes none (no `causal` attribute declares it)."""

    def forward(self, hidden_states):
        B, T, _ = hidden_states.shape
        keep = torch.ones(T, T, dtype=torch.bool).tril()
        return super().forward(hidden_states, keep)


@pytest.mark.parametrize("seq_len", [2, 3, 16])
def test_a_layers_own_causal_mask_is_tried_from_2_queries(seq_len):
    """_judge: with two queries or more the recompute is tried with and without the causal mask (`Tq < 2`: one
    query sees every key either way), and the closer kept; the layer's own causal mask is then reproduced."""
    result = own_weights(built(CausalInside, torch.float32), causal=True, seq_len=seq_len)
    assert result.verdict == "pass" and "recomputed with the causal mask" in result.evidence, result.evidence


def test_the_same_dtype_recomputes_rounding_counts_below_float64():
    """_judge: in bfloat16 the recompute in the layer's dtype is made (`dtype != float64`), and its rounding, times
    2, is allowed on top of the floor 1.6e-2; a float64 layer is allowed its floor alone."""
    low = own_weights(built(GroupedQueryAttention, torch.bfloat16))
    assert low.verdict == "pass" and low.threshold > 1.6e-2 * 1.2, low
    high = own_weights(built(GroupedQueryAttention, torch.float64))
    assert high.verdict == "pass" and high.threshold == pytest.approx(1e-5), high


class SelfOnly(nn.Module):
    """BERT's self-attention shape: query, key and value, no output projection (its parent projects); `merge_bug`:
    heads merged without moving them next to their width."""

    def __init__(self, merge_bug=False):
        super().__init__()
        self.num_attention_heads, self.attention_head_size, self.merge_bug = 4, 8, merge_bug
        self.query, self.key, self.value = (nn.Linear(32, 32) for _ in range(3))

    def forward(self, hidden_states, attention_mask=None):
        B, T, D = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, T, 4, 8).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # (B, H, T, d)
        return out.reshape(B, T, D) if self.merge_bug else out.transpose(1, 2).reshape(B, T, D)


class NoOutputProjection(GroupedQueryAttention):
    """GroupedQueryAttention (4 heads of 8 = its width 32) returning the merged heads without o_proj: a bug."""

    def forward(self, hidden_states, attention_mask=None):
        o_proj, self.o_proj = self.o_proj, nn.Identity()
        try:
            return super().forward(hidden_states, attention_mask)
        finally:
            self.o_proj = o_proj


@pytest.mark.parametrize("make, step", [
    (lambda: SelfOnly(merge_bug=True), "heads merged without moving them next to their width"),
    (SelfOnly, None),
    (NoOutputProjection, "output projection skipped"),
    (GroupedQueryAttention, None),
], ids=["no projection, merge bug", "no projection", "projection skipped", "with projection"])
def test_the_output_projection_step_is_tried_only_where_there_is_one(make, step):
    """_judge skips the step 'output projection skipped' where the module has none (BERT's self-attention), and
    only it: the other steps are still tried there; where there is one, skipping it is named."""
    result = own_weights(built(make, torch.float32), d_model=32)
    if step:
        assert result.verdict == "fail" and step in result.evidence, result.evidence
    else:
        assert result.verdict == "pass", result.evidence


class Raises(GroupedQueryAttention):
    def forward(self, hidden_states, attention_mask=None):
        raise RuntimeError("this layer always raises")


def test_a_layer_that_raises_is_not_run_and_its_twin_is_judged():
    """check_own_weights' guard on its replay of the standard probe (`not call.ok`)."""
    raised = own_weights(built(Raises, torch.float32))
    assert (raised.verdict, raised.message) == ("skip", "not measured: the layer raised on this detector's probe "
                                                        "(RuntimeError: this layer always raises); see `runs`"), raised
    assert own_weights(built(GroupedQueryAttention, torch.float32)).verdict == "pass"


class FirstOnly(Pair):
    """Pair whose forward calls `first` only: `second` is identified but never called."""

    def forward(self, hidden_states):
        return self.first(hidden_states)


def test_a_module_the_probe_never_calls_is_noted_and_the_others_judged():
    result = own_weights(built(FirstOnly, torch.float32), d_model=32)
    assert result.verdict == "pass" and "GroupedQueryAttention (second): not called by the standard probe" in \
        result.evidence, result.evidence


class BothWrong(Pair):
    def __init__(self):
        super().__init__(wrong=True)
        self.first = GroupedQueryAttention(wrong_order=True)


@pytest.mark.parametrize("make", [lambda: Pair(True), BothWrong], ids=["second wrong", "both wrong"])
def test_a_fail_reports_the_worst_failing_module_and_its_fix_once(make):
    """check_own_weights: the value and threshold are the worst module's (a failing one over any pass), and each
    step's fix is given once, none for a module that passed."""
    result = own_weights(built(make, torch.float32), d_model=32)
    assert result.verdict == "fail" and result.value > 10 * result.threshold, result
    assert result.fix.count("repeat_interleave") == 1 and not result.fix.startswith(";"), result.fix


def test_a_pass_reports_the_module_nearest_its_bound():
    """Every module passing: the value is the greatest error / allowed of them, above 0 (the reading, not a default)."""
    result = own_weights(built(Pair, torch.float32), d_model=32)
    assert result.verdict == "pass" and 0 < result.value <= result.threshold, result


class ThreeAxisMask(GroupedQueryAttention):
    """GroupedQueryAttention taking its mask as bool (B, Tq, Tk), True = may attend, broadcast over its heads."""

    def forward(self, hidden_states, attention_mask=None):
        return super().forward(hidden_states, None if attention_mask is None else attention_mask[:, None])


def test_a_three_axis_mask_of_b_rows_is_broadcast_over_the_heads():
    """_four_d: a (B, Tq, Tk) mask is one per sequence (unsqueezed at the heads' axis) unless its first axis is B x H
    with more than one head (then heads are folded into the batch, torch's convention)."""
    result = own_weights(built(ThreeAxisMask, torch.float32), causal=True, mask="allowed:B,Tq,Tk")
    assert result.verdict == "pass" and "the call's mask" in result.evidence, result.evidence


class NormNamedOut(nn.Module):
    """A fused qkv and a LayerNorm named `out` (no output projection that recogniser knows), projected by `o`."""

    def __init__(self):
        super().__init__()
        self.num_heads = 4
        self.qkv, self.out, self.o = nn.Linear(32, 96), nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        return self.o(self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D)))


def test_a_module_with_a_weight_that_is_no_linear_is_not_taken_for_a_projection():
    """_linear: only an nn.Linear is a projection (a LayerNorm has a weight too): no output projection, nothing
    identified."""
    result = own_weights(built(NormNamedOut, torch.float32), d_model=32, num_heads=4)
    assert result.verdict == "skip" and result.message.startswith("not applicable: no attention projections "
                                                                  "identified"), result


# ---- _projections.fused_qkv, _first, bind -----------------------------------------------------------------------


class Fused(nn.Module):
    """A fused qkv of `width` rows and an output projection (unless `proj` is False); other keywords become
    attributes (num_heads, head_dim, scale)."""

    def __init__(self, width=96, *, proj=True, **attrs):
        super().__init__()
        self.qkv = nn.Linear(32, width)
        if proj:
            self.proj = nn.Linear(32, 32)
        for name, value in attrs.items():
            setattr(self, name, value)

    def forward(self, x, mask=None):
        raise NotImplementedError  # read, never called


@pytest.mark.parametrize("make, expected", [
    (lambda: Fused(num_heads=4), (8, 8 ** -0.5)),
    (lambda: Fused(num_heads=4, head_dim=8, scale=0.25), (8, 0.25)),
    (lambda: Fused(num_heads=4, scale=0.0), (8, 8 ** -0.5)),
    (lambda: Fused(num_heads=4, proj=False), None),
    (lambda: Fused(num_heads=4, width=90), "qkv gives 90 features, not 3 x 4 heads x 7"),
    (lambda: Fused(), "a fused qkv projection but no number of heads"),
], ids=["head width from the rows", "own scale", "zero scale", "no output projection", "rows", "no heads"])
def test_what_the_fused_qkv_recogniser_reads(make, expected):
    """fused_qkv(): the head width from head_dim, else the rows / (3 x heads); the scale a positive float `scale`,
    else 1/sqrt(d); no output projection: not recognised."""
    found = recognise(make())
    if expected is None or isinstance(expected, str):
        assert found == expected if expected is None else (isinstance(found, str) and expected in found), found
    else:
        assert isinstance(found, Projections) and (found.head_dim, found.scale) == pytest.approx(expected), found


def test_the_output_of_a_call_is_the_tensor_or_a_tuples_first_tensor():
    from diagnostics._projections import _first

    t = torch.ones(2)
    assert _first(t) is t and _first((t, None)) is t and _first([t]) is t
    for other in ((), ("a", t), 3):
        with pytest.raises(NotApplicable, match="not a tensor or a tuple starting with one"):
            _first(other)


def test_a_calls_keyword_arguments_are_bound_by_name_through_kwargs():
    from diagnostics._projections import bind

    class TakesKwargs(nn.Module):
        def forward(self, hidden_states, config=None, **kwargs):
            return hidden_states

    x, m = torch.ones(1), torch.zeros(1)
    assert bind(TakesKwargs(), (x,), {"attention_mask": m}) == {"hidden_states": x, "attention_mask": m}
    assert bind(TakesKwargs(), (x,), {}) == {"hidden_states": x}
    assert bind(TakesKwargs(), (x, {"a": 1}), {}) == {"hidden_states": x, "config": {"a": 1}}
