"""`parameters_used`: the three misses of "the world's attention layers" class 10, written in this project's own
code, each caught with the parameter named and the line pointed at, and its correct twin (the same class and
weights, the step done right) passing, at every dtype and initialisation of the kill matrix.

The verdict is exact: an unused weight gets a gradient of exactly 0 and changing it moves the output by exactly 0
(measured below: the margin is not a ratio but zero against non-zero); a used one gets a non-zero gradient.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import gpt2_init_
from diagnostics._guard import seed_rng
from diagnostics.detectors import parameters


class SeparateProjections(nn.Module):
    """q, k, v and output projections of their own, SDPA in between. `bug`: "values from keys" (W_v unused),
    "diagonal output" (an einsum that reads only W_O's diagonal)."""

    def __init__(self, d_model=16, num_heads=2, bug=None):
        super().__init__()
        self.d_model, self.num_heads, self.bug = d_model, num_heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        split = lambda t: t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2)
        q, k = split(self.q_proj(x)), split(self.k_proj(x))
        v = split(self.k_proj(x)) if self.bug == "values from keys" else split(self.v_proj(x))  # BUG line 1
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, D)
        if self.bug == "diagonal output":
            return torch.einsum("btd,dd->btd", y, self.o_proj.weight) + self.o_proj.bias  # BUG line 2
        return self.o_proj(y)


class FusedQKV(nn.Module):
    """One fused qkv projection, self-attention. `bug` "keys from queries": k taken from the query third, so the
    key rows of the fused weight reach nothing."""

    def __init__(self, d_model=16, num_heads=2, bug=None):
        super().__init__()
        self.d_model, self.num_heads, self.bug = d_model, num_heads, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        if self.bug == "keys from queries":
            k = q  # BUG line 3
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


MISSES = {  # bug: (class, the parameter the finding names, where its gradient is zero)
    "values from keys": (SeparateProjections, "v_proj.weight", "everywhere"),
    "diagonal output": (SeparateProjections, "o_proj.weight", "off its diagonal"),
    "keys from queries": (FusedQKV, "qkv.weight", "on rows 16-31"),
}
SETTINGS = [(dtype, init) for dtype in (torch.float32, torch.bfloat16, torch.float16) for init in ("default", "gpt2")]


def build(cls, bug, dtype, init, seed=0):
    seed_rng(seed)
    layer = cls(bug=bug)
    if init == "gpt2":
        gpt2_init_(layer, seed=seed)
    return layer.to(dtype)


def bug_line(bug: str) -> int:
    marker = {"values from keys": "# BUG line 1", "diagonal output": "# BUG line 2", "keys from queries": "# BUG line 3"}
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if marker[bug] in line)


@pytest.mark.parametrize("dtype, init", SETTINGS, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("bug", sorted(MISSES))
def test_an_unused_weight_is_caught_named_and_located(bug, dtype, init):
    cls, name, where = MISSES[bug]
    report = diagnostics.audit(build(cls, bug, dtype, init))
    result = report.result("parameters_used")
    assert result.verdict == "fail" and name in result.message, str(report)
    assert where in result.evidence and result.value == 0.0, result.evidence  # exactly zero: the margin is exact
    # the bug's line, or (where the bug is a Python rebinding, `k = q`, which runs no op) the product just after it
    lines = [site.line for site in result.where if site.file == __file__]
    assert lines and min(abs(n - bug_line(bug) - 0.5) for n in lines) <= 0.5, [s.describe() for s in result.where]


@pytest.mark.parametrize("dtype, init", SETTINGS, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("bug", sorted(MISSES))
def test_the_correct_twin_uses_every_weight(bug, dtype, init):
    """The same class, seed and setting, the step done right: every parameter moves the output."""
    cls, _, _ = MISSES[bug]
    report = diagnostics.audit(build(cls, None, dtype, init))
    assert report.result("parameters_used").verdict == "pass", str(report)
    assert report.passed, str(report)


def test_a_detached_weight_is_used_by_the_forward_and_left_to_the_gradient_check():
    """A zero gradient is confirmed by the forward pass: behind a .detach() the output still depends on the
    weight, so this detector does not call it unused; it names the cut, and `gradients` fails."""

    class Detached(FusedQKV):
        def forward(self, x, mask=None):
            B, T, D = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
            w = (q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads)).softmax(-1).detach()
            return self.out((w @ v).transpose(1, 2).reshape(B, T, D))

    torch.manual_seed(0)
    report = diagnostics.audit(Detached())
    result = report.result("parameters_used")
    assert result.verdict == "pass" and "cut on its way (see gradients)" in result.evidence, result.evidence
    assert report.result("gradients").verdict == "fail", str(report)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "with keys apart (a padding mask)"])
def test_the_gradient_checks_backward_is_read_here_and_one_of_its_own_taken_only_without_its_padding(causal):
    """One float64 forward and backward for gradients and parameters_used: this check adds no call of its own,
    except where the gradient check's probe carries a padding mask (keys an input apart from the queries), which a
    mask bug could use to starve a projection (test_kill_matrix's mask_polarity_inverted): there it takes its own
    forward and backward (3 passes) without that mask."""
    from correct import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2, causal=causal).eval()
    alone = diagnostics.audit(layer, causal=causal, detectors=["gradients"])
    both = diagnostics.audit(layer, causal=causal, detectors=["gradients", "parameters_used"])
    assert both.result("parameters_used").verdict == "pass", both
    assert both.forward_passes - alone.forward_passes == (0 if causal else 3)
    backward = [p for p in both.result("parameters_used").probes if p.backward]
    assert backward[-1].label.endswith("T=6)") and ("padding" in backward[0].label) != causal, backward
    assert causal or backward[-1].allowed is None, backward[-1]  # its own: nothing blocked


def test_the_key_bias_is_inert_by_shift_and_a_key_weight_is_not():
    """The explanation the detector gives a zero-gradient key bias, measured directly: changing b_k shifts every
    row of the scores by a constant (q_i . b_k), changing W_k does not."""
    torch.manual_seed(0)
    probe_layer = SeparateProjections().double()
    subject = diagnostics._subject.make_subject(probe_layer, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    assert parameters._shift_inert(subject, "k_proj.bias", (x, x, x), None, gen)
    assert not parameters._shift_inert(subject, "k_proj.weight", (x, x, x), None, gen)
    assert not parameters._shift_inert(subject, "q_proj.bias", (x, x, x), None, gen)


def test_structural_zeros_are_read_from_the_gradient_alone():
    eye = torch.eye(3)
    assert parameters.structural_zeros(None) == "everywhere"
    assert parameters.structural_zeros(torch.zeros(3, 3)) == "everywhere"
    assert parameters.structural_zeros(eye) == "everywhere off its diagonal"
    rows = torch.ones(6, 3)
    rows[2:4] = 0
    assert parameters.structural_zeros(rows).startswith("on rows 2-3 of 6")
    assert parameters.structural_zeros(torch.ones(3, 3)) == ""
    assert parameters.structural_zeros(torch.tensor([0.0, 1.0])) == ""  # one zero entry of a bias is no finding
    assert parameters.structural_zeros(rows, table=True) == ""  # a lookup table's rows are entries, not features
    assert parameters.structural_zeros(torch.zeros(6, 3), table=True) == "everywhere"


def test_a_lookup_table_the_probe_reaches_in_part_is_no_finding():
    """T5's relative position buckets: an nn.Embedding of which a short probe reads some rows only."""

    class Buckets(SeparateProjections):
        def __init__(self):
            super().__init__()
            self.bias = nn.Embedding(32, self.num_heads)  # rows: buckets of (key - query), most unused at T = 8

        def forward(self, x, mask=None):
            B, T, D = x.shape
            split = lambda t: t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2)
            q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
            rel = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).clamp(-15, 15) + 16  # (T, T) buckets
            scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads) + self.bias(rel).permute(2, 0, 1)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))

    torch.manual_seed(0)
    report = diagnostics.audit(Buckets())
    assert report.result("parameters_used").verdict == "pass", str(report)


class SlicedTable(SeparateProjections):
    """Transformer-XL's per-distance bias as labml-nn writes it: an nn.Parameter of 2P rows sliced to the lengths,
    `table[P - Tk:P + Tq]`, then read per (query, key) distance: a short probe reads a few rows around P, a longer
    one more. `clip`: the distances clipped to +-clip first, so rows past P +- clip are read at no length; `sliced_out`:
    no table, the output projection's weight sliced to the length instead, `F.linear(h, W_O[:T])` zero-padded back to
    the width (output features past T dropped)."""

    P = 64

    def __init__(self, clip: int | None = None, sliced_out: bool = False):
        super().__init__()
        self.clip, self.sliced_out = clip, sliced_out
        self.table = nn.Parameter(torch.randn(2 * self.P, self.num_heads) * 0.1)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        split = lambda t: t.view(B, T, self.num_heads, D // self.num_heads).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        apart = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T): i - j, from -(T - 1) to T - 1
        if self.clip is not None:  # (T, T, H): 2 clip + 1 rows at any length past the clip
            bias = self.table[self.P - self.clip:self.P + self.clip + 1][apart.clamp(-self.clip, self.clip) + self.clip]
        else:
            bias = self.table[self.P - T:self.P + T][apart + T]  # (T, T, H): the rows the lengths reach
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.num_heads) + bias.permute(2, 0, 1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
        if self.sliced_out:  # the output features past T dropped: rows of W_O read as the tokens grow
            return F.pad(F.linear(h, self.o_proj.weight[:T], self.o_proj.bias[:T]), (0, D - T))
        return self.o_proj(h)


def test_a_position_table_sliced_to_the_length_is_used_and_one_read_at_fixed_rows_is_not():
    """The rows a table read by distance reaches grow with the tokens (11 of 128 at the short probe, 31 at 16 tokens):
    used, as an nn.Embedding's buckets are (labml-nn's Transformer-XL attention failed here, its `key_pos_bias` of
    8192 rows read on 11). Its twin, the distances clipped to +-3, reads the same 7 rows at every length: the other
    121 are unused at any length, and the finding stands."""
    torch.manual_seed(0)
    sliced = diagnostics.audit(SlicedTable()).result("parameters_used")
    assert sliced.verdict == "pass" and "the rows it reads grow with the tokens" in sliced.evidence, sliced
    torch.manual_seed(0)
    clipped = diagnostics.audit(SlicedTable(clip=3)).result("parameters_used")
    assert clipped.verdict == "fail" and "table (on rows 0-60, 68-127 of 128)" in clipped.message, clipped
    # clipped at +-8, between the short probe's reach (+-5) and the audit's (+-15): it grows, 11 rows then 17, but not
    # as the tokens do (by 10 or 20): the clip, not the length, bounds it
    torch.manual_seed(0)
    clipped = diagnostics.audit(SlicedTable(clip=8)).result("parameters_used")
    assert clipped.verdict == "fail" and "table (on rows 0-58, 70-127 of 128)" in clipped.message, clipped
    # the output projection sliced to the length: its rows grow with the tokens, but they are output features (at
    # 12 tokens, fewer than the layer's 16 features: at 16 every row would be read)
    torch.manual_seed(0)
    dropped = diagnostics.audit(SlicedTable(sliced_out=True), seq_len=12).result("parameters_used")
    assert dropped.verdict == "fail" and "o_proj.weight (on rows" in dropped.message, dropped
    assert parameters._rows_grow(torch.ones(4, 2), torch.ones(4, 2), 6, 16) == ""  # no growth: nothing to excuse


def test_the_sliced_table_reads_the_same_in_bfloat16_at_std_002(std_002):
    """The verdict is read on the float64 copy's gradients, so the layer's own dtype and initialisation do not move
    it: the sliced table is used, the one clipped at +-8 is not."""
    for clip, verdict in ((None, "pass"), (8, "fail")):
        torch.manual_seed(0)
        layer = std_002(SlicedTable(clip=clip)).to(torch.bfloat16)
        result = diagnostics.audit(layer).result("parameters_used")
        assert result.verdict == verdict, result


class WithEmptyParameter(SeparateProjections):
    """A correct layer that owns a parameter with no element (a slot table sized by a config that asks for none,
    as `num_mem_kv=0` would give): nothing in it can be unused."""

    def __init__(self, bug=None):
        super().__init__(bug=bug)
        self.memory = nn.Parameter(torch.empty(0, self.d_model))  # (slots=0, D)


@pytest.mark.parametrize("bug", [None, "values from keys"])
def test_an_empty_parameter_is_no_finding_and_an_unused_one_beside_it_is(bug):
    """The same class and seed: with every step right it passes (the empty parameter is not called unused); with
    W_v unused it fails, naming v_proj.weight and not the empty one."""
    torch.manual_seed(0)
    result = diagnostics.audit(WithEmptyParameter(bug=bug)).result("parameters_used")
    if bug is None:
        assert result.verdict == "pass", result
    else:
        assert result.verdict == "fail" and "v_proj.weight" in result.message, result
        assert "memory" not in result.message, result


# ---- real layers in half precision (the `real` extra): no weight read as unused --------------------------------

HALF_PRECISION = {  # class: (module, config class, config, constructor keywords, causal, scale)
    "LlamaAttention": ("llama", "LlamaConfig", {"num_key_value_heads": 2}, {"layer_idx": 0}, True, None),
    "GPT2Attention": ("gpt2", "GPT2Config", {}, {"layer_idx": 0}, True, None),
    "BertSelfAttention": ("bert", "BertConfig", {}, {}, False, None),
    "FalconAttention": ("falcon", "FalconConfig", {}, {"layer_idx": 0}, True, None),
    "T5Attention": ("t5", "T5Config", {"d_kv": 8, "d_ff": 64, "num_layers": 1},
                    {"has_relative_attention_bias": True, "layer_idx": 0}, False, 1.0),
}
TINY = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 64,
        "max_position_embeddings": 64, "n_embd": 32, "n_head": 4, "n_layer": 1, "n_positions": 64, "d_model": 32,
        "num_heads": 4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(HALF_PRECISION))
def test_hugging_face_layers_use_every_weight_in_half_precision(name, implementation, dtype):
    """test_real_layers' zoo audits these in float32; here in bfloat16 and float16 at GPT-2's std-0.02 init (the
    check runs on a float64 copy, so the verdict is exact at every dtype: measured on every class of that zoo, both
    implementations, float32/bfloat16/float16 x the zoo's std-0.2 and GPT-2's init, 372 audits, no finding)."""
    import importlib

    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e \".[real]\"")
    family, config_class, extra, build_kw, causal, scale = HALF_PRECISION[name]
    config_cls = getattr(transformers, config_class)
    accepted = set(config_cls().to_dict())
    config = config_cls(**{k: v for k, v in {**TINY, **extra}.items() if k in accepted or k in extra},
                        attn_implementation=implementation)
    layer = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)(config, **build_kw)
    torch.manual_seed(0)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    layer = layer.eval().to(dtype)
    result = diagnostics.audit(layer, causal=causal, scale=scale, detectors=["parameters_used"]).result("parameters_used")
    assert result.verdict == "pass", str(result)
    if name == "LlamaAttention":  # its broken twin, the same weights: values from the key projection (W_v unused)
        layer.v_proj.forward = layer.k_proj.forward
        broken = diagnostics.audit(layer, causal=causal, detectors=["parameters_used"]).result("parameters_used")
        assert broken.verdict == "fail" and "v_proj.weight" in broken.message, str(broken)


class ZeroGated(SeparateProjections):
    """A residual attention block started as the identity, as real ones are: `how="projection"` zero-initialises
    the output projection (DiT's adaLN-Zero, ControlNet's zero convolutions, modded-nanogpt's c_proj), `how="gate"`
    adds the attention through tanh(alpha) with alpha = 0 (Flamingo's gated cross-attention, LLaMA-Adapter).
    `how="residual"`: the zero projection's output added to the input (its block's residual) `unread`: one more
    projection that the code never reads (the bug)."""

    def __init__(self, how, unread=False, d_model=16, num_heads=2):
        super().__init__(d_model, num_heads)
        self.how = how
        if how == "gate":
            self.alpha = nn.Parameter(torch.zeros(1))
        else:
            nn.init.zeros_(self.o_proj.weight)
            nn.init.zeros_(self.o_proj.bias)
        if unread:
            self.extra_proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        y = super().forward(x, mask)
        if self.how == "projection":
            return y
        return x + y if self.how == "residual" else x + torch.tanh(self.alpha) * y


@pytest.mark.parametrize("how", ["projection", "residual", "gate"])
@pytest.mark.parametrize("unread", [False, True])
def test_parameters_behind_a_zero_initialised_gate_are_used_and_one_never_read_is_not(how, unread):
    """A parameter that is all zeros cuts every path through it: at initialisation everything before a zero gate or
    a zero output projection gets a gradient of exactly 0, by design. Asked again with the zero parameters drawn,
    those are used; a projection the code never reads stays unused whatever the others hold, and fails, named alone.
    Where the output itself is all zeros (the bare projection), the whole audit measures a copy with the zeros drawn
    (tests/test_zero_gates.py); behind a residual or a gate the output is the input, and parameters_used draws them."""
    report = diagnostics.audit(ZeroGated(how, unread), detectors=["parameters_used"])
    found = report.result("parameters_used")
    # drawn where the output is all zeros and nothing failed: a failure on the layer as given stands as it is
    assert report.settings.get("drawn") == (("o_proj.weight", "o_proj.bias") if how == "projection" and not unread
                                            else None)
    if unread:
        assert (found.verdict, found.message) == ("fail", "the output does not depend on extra_proj.weight, "
                                                          "extra_proj.bias"), found
    elif how == "projection":
        assert found.verdict == "pass", found
    else:
        assert found.verdict == "pass", found
        zeros = "o_proj.weight, o_proj.bias are" if how == "residual" else "alpha is"
        assert f"zero gradient only while {zeros} all zeros (zero-initialised" in found.evidence, found.evidence


class NormalisedScaled(nn.Module):
    """Cosine attention with a learned per-head temperature split over q and k (nViT's s_qk, d_k ** 0.25 each, the
    softmax scale 1), in this file's own words. `where`: "after" the l2 norm (right), "before" it (the norm divides
    the scales back out: the logits stay cosines, within [-1, 1])."""

    def __init__(self, d_model=16, num_heads=2, where="after"):
        super().__init__()
        self.h, self.d, self.where = num_heads, d_model // num_heads, where
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model, bias=False), nn.Linear(d_model, d_model)
        self.s_q = nn.Parameter(torch.full((num_heads, 1, self.d), self.d ** 0.25))
        self.s_k = nn.Parameter(torch.full((num_heads, 1, self.d), self.d ** 0.25))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        if self.where == "before":
            q, k = q * self.s_q, k * self.s_k  # SCALED BEFORE THE NORM
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if self.where != "before":
            q, k = q * self.s_q, k * self.s_k
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("init", ["default", "std 0.02"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["after", "before"])
def test_a_learned_scale_before_the_norm_that_removes_it_is_caught_and_after_it_passes(where, dtype, init, std_002):
    """vit-pytorch 1.8.4's nViT bug, written here: q and k multiplied by their learned scales before the l2 norm.
    The scales still get a gradient (a direction), so nothing is unused in the old sense, but the output is the same
    at any multiple of them: <grad, s> is rounding (< 1e-16 of the loss) against 1e-3 and more for a scale that acts.
    softmax_saturation cannot tell it (a cosine times 1 is a temperature a correct layer may have); the twin, the same
    weights with the scales after the norm, passes the whole audit."""
    torch.manual_seed(0)
    layer = NormalisedScaled(where=where)
    layer = (std_002(layer) if init == "std 0.02" else layer).to(dtype)
    report = diagnostics.audit(layer)
    found = report.result("parameters_used")
    if where == "after":
        assert found.verdict == "pass" and report.passed, str(report)
        return
    assert found.verdict == "fail", str(report)
    assert found.message.startswith("the output does not depend on the size of s_q, s_k"), found.message
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# SCALED BEFORE THE NORM" in text)
    assert any(s.file == __file__ and s.line == line for s in found.where), [s.describe() for s in found.where]
    assert report.result("softmax_saturation").verdict == "pass", report.result("softmax_saturation")


def test_a_scale_with_a_zero_entry_before_the_norm_is_still_caught():
    """One entry of each scale at 0 (a head dimension switched off, or a pruned gain): not all-zero, so its size is
    still asked, and the norm after it still removes it (said beside the rows of qkv that entry leaves unused)."""
    torch.manual_seed(0)
    layer = NormalisedScaled(where="before")
    with torch.no_grad():
        layer.s_q[0, 0, 0] = layer.s_k[0, 0, 0] = 0.0
    found = diagnostics.audit(layer, detectors=["parameters_used"]).result("parameters_used")
    assert found.verdict == "fail" and "qkv.weight (on rows 0, 16 of 48)" in found.message, found
    assert "the output does not depend on the size of s_q, s_k" in found.evidence, found.evidence


def test_the_size_statistic_lies_far_from_its_threshold_on_both_sides():
    """The statistic itself, from both sides: <grad, s> / loss of a scale that acts (after the norm) is far above
    SIZE_MOVES, and of one a norm removes (before it) far below."""
    def statistic(where):
        torch.manual_seed(0)
        layer = NormalisedScaled(where=where).double()
        x = torch.randn(2, 6, 16, dtype=torch.float64)
        loss = (layer(x) ** 2).sum()
        g = torch.autograd.grad(loss, layer.s_q)[0]
        return abs(float((g * layer.s_q.detach()).sum())) / float(loss.detach())

    assert statistic("before") < parameters.SIZE_MOVES / 1e4 < parameters.SIZE_MOVES * 1e4 < statistic("after")


def test_the_size_statistic_of_a_scale_without_a_gradient_or_of_a_zero_output_is_no_reading():
    """`size_moves` reads nothing (inf: never 'removed') where there is no gradient or the loss is zero (an output of
    zeros, which parameters_used draws again or explains apart); otherwise <grad, P> / loss."""
    p, g = torch.full((3,), 2.0), torch.tensor([1.0, -1.0, 0.5])
    assert parameters.size_moves(p, None, 1.0) == math.inf
    assert parameters.size_moves(p, g, 0.0) == math.inf
    assert parameters.size_moves(p, g, 4.0) == pytest.approx(0.25)  # |2 - 2 + 1| / 4


class IdenticalKeys(nn.Module):
    """Memory attention whose learned keys are all the same at initialisation (ones): every query weighs the memory
    uniformly whatever it is, so the query's gain is not exercised by any input, its size nor its direction (BLT's
    cross-attention audited in place, each query over keys the probe holds the same, read 'size removed')."""

    def __init__(self, d_model=16):
        super().__init__()
        self.gain = nn.Parameter(torch.full((d_model,), 2.0))
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.mem_k = nn.Parameter(torch.ones(4, d_model))
        self.mem_v = nn.Parameter(torch.randn(4, d_model))

    def forward(self, x, mask=None):
        q = self.q_proj(x * self.gain)
        w = (q @ self.mem_k.T / math.sqrt(q.shape[-1])).softmax(-1)
        return w @ self.mem_v


def test_a_scale_the_probe_does_not_exercise_at_all_is_not_read_as_one_a_norm_removes():
    """Its size moves nothing, but neither does any change of it: not a normalisation after it (the rule is for a
    scale whose direction acts and whose size does not). The nViT-style bug above, whose direction acts, still fails."""
    torch.manual_seed(0)
    found = diagnostics.audit(IdenticalKeys(), detectors=["parameters_used"]).result("parameters_used")
    assert "size of gain" not in found.message, found
    torch.manual_seed(0)
    bug = diagnostics.audit(NormalisedScaled(where="before"), detectors=["parameters_used"]).result("parameters_used")
    assert bug.verdict == "fail" and "size of s_q, s_k" in bug.message, bug


class SeparateQKNorm(nn.Module):
    """QK-norm with q and k projected apart (diffusers' Attention(qk_norm=...), Qwen3): each projection's weight is
    scale-free by design, its size divided out by the norm after it, and it is no scale the layer multiplies its
    activations by (a matmul reads it), so its size is not asked."""

    def __init__(self, d_model=16, heads=2):
        super().__init__()
        self.h, self.d = heads, d_model // heads
        self.to_q, self.to_k, self.to_v, self.out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.q_gain, self.k_gain = nn.Parameter(torch.ones(self.d)), nn.Parameter(torch.ones(self.d))

    def forward(self, x, mask=None):
        B, T, D = x.shape
        split = lambda t: t.view(B, T, self.h, self.d).transpose(1, 2)  # noqa: E731
        q = F.normalize(split(self.to_q(x)), dim=-1) * self.q_gain
        k = F.normalize(split(self.to_k(x)), dim=-1) * self.k_gain
        y = F.scaled_dot_product_attention(q, k, split(self.to_v(x)), attn_mask=mask, scale=float(self.d))
        return self.out(y.transpose(1, 2).reshape(B, T, D))


def test_a_projection_a_norm_follows_is_scale_free_by_design_and_not_asked():
    torch.manual_seed(0)
    found = diagnostics.audit(SeparateQKNorm(), detectors=["parameters_used"]).result("parameters_used")
    assert found.verdict == "pass" and "size of" not in found.evidence, found
