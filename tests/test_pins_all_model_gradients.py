"""Pins for the survivors of the full mutation run over the model audit's gradient_flow (issue 37:
`benchmarks/mutations.py --all --only model/gradients.py`, at 54d657d). As in tests/test_pins_all_model_small.py,
each pin has its twin on the same inputs (a case on each side of the comparison, guard or constant it pins), the
numbers quoted as literals; each test says which mutant it pins (its line number the run's, at 54d657d). Small
models (two blocks, 16 wide), gradient_flow alone, so the file runs in a few seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng
from diagnostics.model.gradients import _same_at_every_key


def _sibling(name: str):
    """A test module beside this one, loaded from its file: `from test_x import ...` fails under pytest's importlib
    import mode (tests/test_setup.py runs the suite so), where test modules are not on sys.path."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"_pins_sibling_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_causes, _discarded = _sibling("test_model_gradient_flow_causes"), _sibling("test_model_discarded_outputs")
_late, _timm = _sibling("test_pins_gradients"), _sibling("test_timm_causes")
IDS, TinyInitAttention, TinyInitModel = _causes.IDS, _causes.TinyInitAttention, _causes.TinyInitModel
PIXELS, ClassHead = _discarded.PIXELS, _discarded.ClassHead
LateAttention, LateModel = _late.LateAttention, _late.LateModel
ZeroScaledBiasAttention, ZeroScaledDetached = _timm.ZeroScaledBiasAttention, _timm.ZeroScaledDetached


def flow(model, **kw):
    """gradient_flow's result on `model` (the audit's defaults otherwise)."""
    return diagnostics.audit_model(model, example=IDS, detectors=["gradient_flow"], **kw).result("gradient_flow")


# ---- squared ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bug", [False, True])
def test_a_float64_model_with_outputs_below_float32s_range_is_measured_in_float64(bug):
    """squared's `t if t.dtype == torch.float64 else t.float()` (L100, Eq->NotEq): a float64 model's outputs are kept
    in float64. TinyInitModel at std 1e-25 in float64 returns ~1.6e-49, below float32's smallest denormal (1.4e-45):
    cast to float32 they are all 0, every module's output would get a gradient of exactly 0 and the audit would skip
    the model as not measured ("2 modules whose output the model sends no gradient"). Kept in float64, the correct
    model passes and its twin with blocks.1's scores detached fails there."""
    result = flow(TinyInitModel(bug, init=1e-25).double())
    if bug:
        assert result.verdict == "fail" and result.layer == "blocks.1", result
        assert "blocks.1.q.weight" in result.evidence and "blocks.0." not in result.evidence, result
    else:
        assert result.verdict == "pass" and result.message.startswith("all 16 attention parameters"), result


class ReluInputModel(nn.Module):
    """An embedding through a ReLU (about half its entries exactly 0, none of its rows all 0), one attention block
    (TinyInitAttention: separate q, k, v; `bug`: its scores detached) and a head, at PyTorch's default init."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.attn, self.head = nn.Embedding(32, 16), TinyInitAttention(bug=bug), nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.emb(input_ids).relu()
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("bug", [False, True])
def test_a_weight_is_excused_for_an_input_that_is_all_zero_not_one_with_some_zeros(bug):
    """_loss_and_outputs' `not bool(x.ne(0).any())` (L121, any->all): a weight with no gradient is by design only
    where its module's input is exactly 0 everywhere (DETR's zero queries). The ReLU'd embedding has zeros in about
    half its entries: with `all`, some zero would excuse the detached scores' q and k weights, and the evidence
    would name only their biases. The twin, the same model with its scores kept, passes."""
    result = flow(ReluInputModel(bug))
    if bug:
        assert result.verdict == "fail" and result.message.startswith("4 of 8 attention parameters"), result
        assert "attn.q.weight" in result.evidence and "attn.k.weight" in result.evidence, result
    else:
        assert result.verdict == "pass", result


# ---- _moves_output: the draw that changes a parameter ----------------------------------------------------------


def zero_nudge(eps: float) -> LateModel:
    """test_pins_gradients' LateModel whose `nudge` (no gradient; moves the output by eps x its RMS from length 64 on,
    times how far it was changed, at most 1) starts at 0: its draw is standard normal, not scaled by its mean
    magnitude."""
    model = LateModel(start=64, eps=eps)
    with torch.no_grad():
        model.attn.nudge.zero_()
        model.attn.nudge0.zero_()
    return model


@pytest.mark.parametrize("eps, expected", [(2e-6, "warn"), (2e-7, "fail")])
def test_a_choice_at_zero_is_changed_by_a_standard_normal_draw(eps, expected):
    """_moves_output's `float(old.float().abs().mean()) or 1.0` (L152, or->and and x0.1): a parameter at 0 is changed
    by a draw of standard deviation 1. The nudge then changes by more than 1 somewhere (16 draws) and moves the
    output by 2e-6 of its RMS: a choice used from 64 (warn). With `and` the draw would be 0 (nothing changes: a
    fail); at x0.1 it would change by under 0.5 (16 draws of sd 0.1), moving the output by under 1e-6 of its RMS (a
    fail). Its twin, a tenth of the move, is not shown to be used either way."""
    result = diagnostics.audit_model(zero_nudge(eps), detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == expected, result
    if expected == "warn":
        assert "attn.nudge (from 64" in result.evidence, result
    else:
        assert "attn.nudge" in result.evidence, result


class ZeroFirstOutput(nn.Module):
    """test_pins_gradients' embeddings and attention (`LateAttention`, with a `nudge` of its own it does not use),
    returning (a first output of exactly 0, the attention's output): from length 64 on, changing the nudge moves the
    first output by `eps` times how far it changed (at most 1). The attention's output carries every gradient."""

    def __init__(self, eps: float):
        super().__init__()
        seed_rng(0)
        self.eps = eps
        self.wte, self.wpe = nn.Embedding(32, 16), nn.Embedding(1024, 16)
        self.attn = LateAttention(eps=eps)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        h = self.attn(self.wte(input_ids) + self.wpe(torch.arange(T)))  # (B, T, D)
        moved = torch.zeros_like(h.detach())
        if T >= 64:  # no gradient: a choice's move, on an output of exactly 0
            moved = moved + self.eps * (self.attn.nudge.detach() - self.attn.nudge0).abs().max().clamp(max=1.0)
        return moved, h


@pytest.mark.parametrize("eps, expected", [(3e-6, "warn"), (3e-7, "fail")])
def test_a_choice_moving_an_output_of_zeros_moves_it_by_more_than_1e_6(eps, expected):
    """_moves_output's `float(before.float().square().mean().sqrt()) or 1.0` (L160, x10 and x0.1): an output of
    exactly 0 (RMS 0) is moved when an element changes by more than 1e-6 itself. Changing the nudge moves it by 3e-6
    from length 64 on: a choice used there (warn; at x10, 1e-5, not shown to be used: a fail); by 3e-7, not shown to
    be used (a fail; at x0.1, 1e-7, a choice)."""
    result = diagnostics.audit_model(ZeroFirstOutput(eps), detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == expected, result
    if expected == "warn":
        assert "attn.nudge (from 64" in result.evidence, result
    else:
        assert "attn.nudge" in result.evidence, result


# ---- _moves_only: a parameter that moves only outputs the model discards ---------------------------------------


@pytest.mark.parametrize("detach", [False, True])
def test_a_bias_at_zero_that_moves_only_discarded_outputs_is_changed_by_a_standard_normal_draw(detach):
    """_moves_only's `float(old.float().abs().mean()) or 1.0` (L181, or->and): test_model_discarded_outputs' ClassHead
    with the last block's per-key bias at 0, which moves only the patch tokens' outputs the head discards. Changed
    by a draw of standard deviation 1, it moves them and no other: not judged, the model passes. With `and` the draw
    would be 0, nothing would move, and the bias would fail as getting no gradient. Its twin, the bias detached and
    added to every row (the class token's too), still fails."""
    model = ClassHead(detach)
    with torch.no_grad():
        model.last.bias.zero_()
    result = diagnostics.audit_model(model, example=PIXELS, detectors=["gradient_flow"]).result("gradient_flow")
    if detach:
        assert result.verdict == "fail" and "last.bias" in result.evidence, result
    else:
        assert result.verdict == "pass" and "not judged" in result.message and "last" in result.message, result


# ---- _in_float64: a module's output whose gradient underflows is asked again in float64 ------------------------


class TwiceScaledBranch(nn.Module):
    """An embedding and one attention block (TinyInitAttention; `bug`: its scores detached) on a residual branch
    scaled twice by 1e-25 (two layer scales in a row), and a head: in float32 the branch's gradient, about 1e-50, is
    exactly 0; in float64 it is not."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.attn, self.head = nn.Embedding(32, 16), TinyInitAttention(bug=bug), nn.Linear(16, 32)
        self.gamma1, self.gamma2 = nn.Parameter(torch.full((16,), 1e-25)), nn.Parameter(torch.full((16,), 1e-25))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        return self.head(x + self.gamma2 * (self.gamma1 * self.attn(x)))


@pytest.mark.parametrize("bug", [False, True])
def test_a_module_whose_output_gradient_underflows_is_judged_from_the_float64_copy(bug):
    """_in_float64's `if twin is None or not (names or paths)` (L215, drop-not): the attention's output gets a gradient
    of exactly 0 in float32 (1e-25 x 1e-25 of the head's), as if what follows cut it, and the model's float64 copy
    is asked again: there it gets one, so the attention is judged. Its parameters pass, "only in a float64 copy";
    without the `not` the copy would never be asked and the attention would be left unjudged (a skip). Its twin,
    the scores detached, fails on q and k."""
    result = flow(TwiceScaledBranch(bug))
    if bug:
        assert result.verdict == "fail" and "attn.q.weight" in result.evidence, result
    else:
        assert result.verdict == "pass" and "only in a float64 copy" in result.message, result


# ---- _underflow_in_place: each module alone in float64 ---------------------------------------------------------


class GainLinear(nn.Linear):
    """A linear projection taking a Python number as a keyword (`gain`), as a projection with a scale option does."""

    def forward(self, x, gain=1.0):
        return super().forward(x) * gain


class GainAttention(TinyInitAttention):
    """TinyInitAttention whose q projection takes `gain=1.0` and, with `peek`, is called once more first, its output
    dropped (a look at the queries, as a logging hook would take): "no_grad", without autograd; "dropped", with it
    (that output gets no gradient at all: None)."""

    def __init__(self, peek: str | None = None, bug: bool = False):
        super().__init__(bug=bug)
        self.peek, self.q = peek, GainLinear(16, 16)

    def forward(self, x):
        if self.peek:
            with torch.set_grad_enabled(self.peek == "dropped"):
                self.q(x, gain=1.0)
        B, T, D = x.shape  # batch, sequence length, width
        H = self.num_heads
        q = self.q(x, gain=1.0).reshape(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(x).reshape(B, T, H, D // H).transpose(1, 2) for f in (self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B, H, T, T)
        w = (scores.detach() if self.bug else scores).softmax(-1)  # BUG: the scores cut from the backward
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D))


def gain_model(peek: str | None = None, bug: bool = False) -> TinyInitModel:
    """TinyInitModel (std 1e-10, its blocks computed in float32 whatever the model's dtype: its float64 copy does not
    run, so each module is run alone in float64) with GainAttention blocks."""
    model = TinyInitModel(cast=True)
    seed_rng(0)
    model.blocks = nn.ModuleList([GainAttention(peek, bug=bug and i == 1) for i in range(2)])
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.normal_(0, 1e-10) if p.dim() > 1 else p.zero_()
    return model


@pytest.mark.parametrize("peek", [None, "no_grad", "dropped"])
def test_a_module_alone_in_float64_takes_its_python_arguments_and_skips_calls_without_autograd(peek):
    """_underflow_in_place's `wide`: `v.detach().double() if isinstance(v, Tensor) and v.is_floating_point() else v`
    (L268, and->or): a Python number among a module's arguments (q's `gain=1.0`) is passed as it is; with `or` it
    would be asked for is_floating_point() and raise, and nothing would be shown. Its hook's `isinstance(o, Tensor)
    and o.requires_grad` (L254, and->or): a call without autograd ("no_grad") is not replayed; with `or` its output
    would be asked for a gradient and the backward would raise. And `if p != path or g is None or not bool(...)`
    (L276, or->and#2): a call whose output got no gradient ("dropped": None) is not replayed; with `g is None and not
    bool(g.abs()...)` None would be asked for abs() and raise. Each way the correct model's q, k, v and proj
    weights, whose float32 gradients underflow, would fail as getting none; kept, they pass "only in a float64
    copy", with either peek and without."""
    result = flow(gain_model(peek))
    assert result.verdict == "pass" and "only in a float64 copy" in result.message, result


@pytest.mark.parametrize("peek", [None, "no_grad", "dropped"])
def test_a_module_alone_in_float64_still_fails_detached_scores(peek):
    """The twin of the test above: the same models with blocks.1's scores detached fail on its q and k."""
    result = flow(gain_model(peek, bug=True))
    assert result.verdict == "fail" and result.layer == "blocks.1" and "blocks.1.q.weight" in result.evidence, result


# ---- _in_float64: asked whenever a parameter got no gradient, with or without a module cut ----------------------


class HandedAttention(TinyInitAttention):
    """TinyInitAttention whose query projection is a matrix of its own (`wq`, not a submodule's) and which takes a
    mixing matrix its parent hands it before each call (`self.mix`, a plain attribute in the model's dtype, as a
    rotary table set by the model is): the module alone, copied to float64, still holds the last float32 one, and
    its product raises."""

    def __init__(self, bug: bool = False):
        super().__init__(bug=bug)
        del self.q
        self.wq = nn.Parameter(torch.randn(16, 16))
        self.mix = None

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, width
        H = self.num_heads
        x = x @ self.mix  # (B, T, D): the parent's matrix
        q = (x @ self.wq).reshape(B, T, H, D // H).transpose(1, 2)  # (B, H, T, d)
        k, v = (f(x).reshape(B, T, H, D // H).transpose(1, 2) for f in (self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5  # (B, H, T, T)
        w = (scores.detach() if self.bug else scores).softmax(-1)  # BUG: the scores cut from the backward
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D))


class HandedModel(nn.Module):
    """An embedding, one HandedAttention and a head, every weight drawn at std 1e-10 and every bias 0, as
    TinyInitModel: the attention's parameters' float32 gradients are exactly 0; no module's output gradient is."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.attn, self.head = nn.Embedding(32, 16), HandedAttention(bug=bug), nn.Linear(16, 32)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 1e-10) if p.dim() > 1 else p.zero_()

    def forward(self, input_ids):
        x = self.emb(input_ids)
        self.attn.mix = torch.eye(16, dtype=x.dtype)  # handed over on every call
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("bug", [False, True])
def test_the_float64_copy_is_asked_when_parameters_get_no_gradient_and_no_module_is_cut(bug):
    """_in_float64's `if twin is None or not (names or paths)` (L215, or->and#2): the model's float64 copy is asked
    whenever a parameter got exactly 0, with or without a module whose output got 0 (none here). The query matrix's
    and k's float32 gradients underflow; the float64 copy, whose forward hands the attention a float64 matrix, shows
    them: the correct model passes "only in a float64 copy". With `and` the copy would be asked only beside a cut
    module; each module alone would be asked instead, and the attention alone, with its float32 matrix, does not
    run: `attn.wq` would fail as getting no gradient. Its twin, the scores detached, fails."""
    result = flow(HandedModel(bug))
    if bug:
        assert result.verdict == "fail" and "attn.wq" in result.evidence, result
    else:
        assert result.verdict == "pass" and "only in a float64 copy" in result.message, result


# ---- unused_by_design: the longer lengths ---------------------------------------------------------------------


class ManyLate(LateAttention):
    """LateAttention with `count` biases of its own added to its output times `gain` from length 64 on."""

    def __init__(self, count: int, gain: float):
        super().__init__()
        self.gain = gain
        self.lates = nn.ParameterList(nn.Parameter(torch.randn(16) * 0.1) for _ in range(count))

    def forward(self, x):
        out = super().forward(x)  # (B, T, D)
        if x.shape[1] >= 64:
            for bias in self.lates:
                out = out + self.gain * bias
        return out


def many_late(count: int, gain: float) -> LateModel:
    model = LateModel()
    seed_rng(0)
    model.attn = ManyLate(count, gain)
    return model


@pytest.mark.parametrize("gain, expected", [(1.0, "warn"), (0.0, "fail")])
def test_17_parameters_with_a_gradient_from_64_are_all_found_there_and_a_zero_gradient_is_none(gain, expected):
    """unused_by_design's `if g is not None and bool(g.abs().sum() > 0)` at each longer length (L398): 17 biases added
    from length 64 on get a gradient there, all 17 found at 64 by it (Gt->Lt: none would be, and the top-k fallback,
    16 a length, would find the 17th only at 256). Their twin, the same biases times 0.0 from 64 on, get a gradient
    of exactly 0 there (a tensor, not None): not shown to be used, a fail (Gt->GtE: found at 64, a warn)."""
    result = diagnostics.audit_model(many_late(17, gain), detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == expected, result
    if expected == "warn":
        assert result.message.startswith("17 of ") and "but do at 64: used only" in result.message, result
    else:
        assert "attn.lates.0" in result.evidence, result


@pytest.mark.parametrize("start, expected", [(256, "warn"), (257, "fail")])
def test_a_declared_context_of_256_is_tried_and_nothing_past_it(start, expected):
    """unused_by_design's `if context is not None and L > context: break` (L377): LateModel declaring a context of 256
    (`max_position_embeddings`; it runs up to 1,024). A bias used from 256 is found at 256, the context itself
    (Gt->GtE would stop there, Gt->Lt at 64: a fail); one used from 257 would be found only at 1,024, past the
    context, which is not tried: a fail."""
    model = LateModel(start=start)
    model.max_position_embeddings = 256
    result = diagnostics.audit_model(model, detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == expected, result
    if expected == "warn":
        assert "attn.late (from 256; not at 64)" in result.evidence, result
    else:
        assert "attn.late" in result.evidence, result


# ---- SAME_VALUES = 16: values the same at every key, within 16 eps of their largest magnitude -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("apart, same", [(8, True), (32, False)])
def test_values_8_eps_apart_are_the_same_at_every_key_and_32_eps_apart_are_not(dtype, apart, same):
    """`SAME_VALUES = 16` (L472, x10 and x0.1), in units of the values' own dtype's eps: 8 keys' values of 1.0 but one
    key's, `apart` eps above (exact in float32 and bfloat16). 8 eps apart they are the same at every key (the
    attention weights do not matter there: at x0.1, 1.6 eps, they would not be); 32 eps apart they differ (at x10,
    160 eps, they would be the same, and what makes the scores would be excused)."""
    eps = torch.finfo(dtype).eps
    values = torch.ones(2, 8, 4, dtype=dtype)  # (heads, keys, width): the keys along -2, as `weights @ v`
    values[:, 3] = 1.0 + apart * eps
    assert _same_at_every_key(values, -2) is same


# ---- _weights_moot / _how_moot: attention whose weights do not matter on the example ----------------------------


class FusedAttention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention over every key, its q and k projections matrices of its
    own (`wq`, `wk`: the module is their owner); `bug`: q and k detached (they get no gradient)."""

    def __init__(self, bug: bool = False):
        super().__init__()
        self.bug = bug
        self.wq, self.wk = nn.Parameter(torch.randn(16, 16) * 0.25), nn.Parameter(torch.randn(16, 16) * 0.25)
        self.v, self.proj = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, width
        q, k, v = (y.reshape(B, T, 2, D // 2).transpose(1, 2) for y in (x @ self.wq, x @ self.wk, self.v(x)))
        if self.bug:  # BUG: the scores cut from the backward
            q, k = q.detach(), k.detach()
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


class FusedModel(nn.Module):
    def __init__(self, bug: bool = False, pooled: bool = False):
        super().__init__()
        seed_rng(0)
        self.pooled = pooled
        self.emb, self.attn, self.head = nn.Embedding(32, 16), FusedAttention(bug), nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.attn(x)
        if self.pooled:  # the same attention once more over one token, the mean
            x = x + self.attn(x.mean(1, keepdim=True))
        return self.head(x)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("bug", [False, True])
def test_fused_attention_over_many_keys_is_judged_and_a_call_over_one_key_excuses_nothing(bug, pooled):
    """_how_moot's `"one key" if sm.k.shape[-2] == 1` for a fused attention (L534, Eq->NotEq): a fused call over 12
    keys is not over one key, so detached q and k fail (with `!=` they would be excused as attending one key). And
    _weights_moot's `if kinds and all(kinds)` (L516, all->any): a module is excused only where every call's weights
    do not matter; the second call over the mean token alone (`pooled`) excuses nothing (with `any` it would excuse
    the detached q and k). The twins, q and k kept, pass either way."""
    result = flow(FusedModel(bug, pooled))
    if bug:
        assert result.verdict == "fail" and "attn.wq, attn.wk" in result.evidence, result
    else:
        assert result.verdict == "pass", result


def test_the_warning_for_a_declared_context_says_nothing_of_lengths_past_it():
    """A defect the run's `past_context` survivors showed (fixed): the warning appended " (past the model's declared
    context of N: unused within it)" where the last length found was past the context, but since e3a80f8 no length
    past it is tried (`break`), so the text could never appear and `L > context` could not be told from `>=` or
    `<`; the dead helper is gone. The bias used from 256 with a context of 256 is found at the context itself, and
    the warning names the length alone."""
    model = LateModel(start=256)
    model.max_position_embeddings = 256
    result = diagnostics.audit_model(model, detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == "warn" and result.message.endswith("but do at 256: used only on longer sequences"), result


@pytest.mark.parametrize("values, same", [(torch.zeros(2, 8, 4), True), (torch.ones(2, 8, 4, dtype=torch.long), False),
                                          (torch.ones(2, 0, 4), False)])
def test_values_all_zero_are_the_same_at_every_key_and_integers_or_no_keys_are_not_measured(values, same):
    """_same_at_every_key's `spread <= SAME_VALUES * eps * max|v|` (L561, LtE->Lt): values all 0 are the same at
    every key, spread 0 against a bound of 0 (with `<` they would not be). Its `if not values.is_floating_point() or
    values.numel() == 0: return False` (L557, or->and): integer values (no eps) and values over no keys are not
    measured; with `and` each would go on, and finfo of an integer dtype or the first key of none raises."""
    assert _same_at_every_key(values, -2) is same


# ---- check_gradient_flow: attention modules cut off by what follows them --------------------------------------


class GatedSecond(nn.Module):
    """An embedding, two attention blocks (TinyInitAttention, PyTorch's default init), the second behind a gate
    that starts at 0 (a ReZero branch: its output gets a gradient of exactly 0), and a head."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.attn0, self.attn1 = TinyInitAttention(bug=bug), TinyInitAttention()
        self.alpha = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        x = x + self.attn0(x)
        return self.head(x + self.alpha * self.attn1(x))


@pytest.mark.parametrize("bug", [False, True])
def test_an_attention_behind_a_gate_at_0_is_one_module_not_judged_and_the_other_is(bug):
    """check_gradient_flow's `cut`: `g is not None and not bool(g.abs().sum() > 0)` (L653, Gt->GtE): the gated
    attention's output gets a gradient of exactly 0, so it is one module not judged, named as itself (with `>=` no
    module would be cut: its q, k, v and proj would each be excused as a module of their own, "4 modules", by the
    later zeroed check). The first attention is judged: it passes, and its twin with detached scores fails."""
    result = flow(GatedSecond(bug))
    if bug:
        assert result.verdict == "fail" and "attn0.q.weight" in result.evidence, result
        assert "attn1" not in result.evidence, result
    else:
        assert result.verdict == "pass" and "not judged: the parameters of 1 modules whose output" in result.message
        assert result.message.endswith("values that are the same at every key), attn1"), result


# ---- _zeroed_inside: a parameter that reaches the output through a submodule whose output gets 0 ----------------


class TwoZeroScaled(nn.Module):
    """test_timm_causes' bias-table attention whose projection ends in a gain at 0 (EfficientViT's), twice in a row;
    `detach`: each table read through .detach() (a bug: it feeds nothing)."""

    def __init__(self, detach: bool = False):
        super().__init__()
        torch.manual_seed(0)
        make = ZeroScaledDetached if detach else ZeroScaledBiasAttention
        self.wte, self.attn0, self.attn1, self.head = nn.Embedding(50, 32), make(), make(), nn.Linear(32, 50)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        x = x + self.attn0(x)
        return self.head(x + self.attn1(x))


@pytest.mark.parametrize("detach", [False, True])
def test_two_bias_tables_behind_gains_at_0_are_each_excused_and_detached_ones_fail(detach):
    """_zeroed_inside's `any(p.startswith(o + ".") for o in owners)` (L448, any->all): the submodules looked at are
    those inside any of the tables' owners; with two owners (attn0, attn1) `all` would find none, and both tables
    would fail as getting no gradient. Not judged, they pass; their detached twins, which feed nothing, fail."""
    result = diagnostics.audit_model(TwoZeroScaled(detach), detectors=["gradient_flow"]).result("gradient_flow")
    if detach:
        assert result.verdict == "fail" and "attn0.attention_biases" in result.evidence, result
        assert "attn1.attention_biases" in result.evidence, result
    else:
        assert result.verdict == "pass" and "not judged" in result.message, result

