"""`keys_matter` for a module given one stream: its keys cannot change without its queries, but its values can, through
the output of its value projection (the last third of a fused `to_qkv`, the last half of a `to_kv`, or an nn.Linear of
its own). Token 0's values moved alone must move the other tokens' outputs that may attend it.

perceiver-pytorch 0.11.0's experimental LinearAttention computes its context as q^T k and its output as v times that:
each output row is its own token's value through one matrix, and no token reads another's value. Every detector
passed or could not measure it (its mask takes a form no convention expresses); it now fails `keys_matter`. Its
correct twin (context k^T v, output q times it) and a softmax attention pass on the same inputs. The package's own
class is swept by `python benchmarks/sweep.py perceiver_pytorch` (KNOWN there).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import diagnostics

D, H = 32, 4  # width, heads


def _line_of(function, text: str) -> int:
    """The line of `function`'s source that holds `text`: where a finding's site must point."""
    source, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(source) if text in line)


class FusedLinearAttention(nn.Module):
    """Efficient attention (Shen et al.) with one fused projection: q normalised over its features, k over the tokens,
    out = q @ (k^T v). `swapped`: the bug, context q^T k and out = v @ context (each row its own value only)."""

    def __init__(self, swapped: bool = False):
        super().__init__()
        self.swapped = swapped
        self.to_qkv, self.to_out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))  # (B, H, T, d)
        q, k = (q * (D // H) ** -0.5).softmax(-1), k.softmax(-2)
        if self.swapped:
            out = v @ (q.transpose(-2, -1) @ k)  # (B, H, T, d) @ (d, d)
        else:
            out = q @ (k.transpose(-2, -1) @ v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


class FusedSoftmaxAttention(nn.Module):
    """timm's layout: one `qkv` projection, softmax attention (`causal`: the future blocked), `proj` after."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.causal = causal
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        scores = q @ k.transpose(-2, -1) * (D // H) ** -0.5
        if self.causal:
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        weights = scores.softmax(-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, T, D))


def _audit(layer, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    layer = layer.to(dtype)
    with torch.no_grad():  # std 0.02, as models are initialised
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return diagnostics.audit(layer, progress=False, dtype=dtype, **kw).result("keys_matter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_context_of_q_t_k_fails_and_k_t_v_passes(dtype):
    correct = _audit(FusedLinearAttention(), dtype)
    assert correct.verdict == "pass" and "to_qkv (its last third, the values)" in correct.evidence, correct
    swapped = _audit(FusedLinearAttention(swapped=True), dtype)
    assert swapped.verdict == "fail" and "no query reads another token's value" in swapped.message, swapped
    # the site: the product the moved values reach first, the line the bug is on (v @ (q^T k))
    line = _line_of(FusedLinearAttention.forward, "out = v @")
    assert [site.line for site in swapped.where][:1] == [line], [site.describe() for site in swapped.where]


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_attention_reads_every_token_value(causal):
    result = _audit(FusedSoftmaxAttention(causal), causal=causal)
    assert result.verdict == "pass", result


class JointStreams(nn.Module):
    """diffusers' joint attention (JoyImage's, Flux's): the image's and the text's tokens attended together, each
    stream with projections of its own, the image's output projected first and the text's after. Audited over the
    image alone, the text given no token: its output projection, the last nn.Linear called, projects nothing, and the
    image's was taken for the value projection (the output itself moved with token 0's row only: a false failure)."""

    def __init__(self):
        super().__init__()
        self.img_qkv, self.txt_qkv = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.img_out, self.txt_out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, context):
        B, T, _ = x.shape
        qkv = torch.cat([self.img_qkv(x), self.txt_qkv(context)], 1)  # (B, T + Tc, 3D)
        q, k, v = (t.view(B, -1, H, D // H).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        out = ((q @ k.transpose(-2, -1)) * (D // H) ** -0.5).softmax(-1) @ v
        out = out.transpose(1, 2).reshape(B, -1, D)
        return self.img_out(out[:, :T]), self.txt_out(out[:, T:])


def test_the_output_projection_is_the_one_that_makes_the_output():
    result = _audit(JointStreams(), call=lambda layer, x: layer(x, x[:, :0])[0])
    assert result.verdict == "pass" and "img_qkv (its last third, the values)" in result.evidence, result


class PerturbedGuidance(nn.Module):
    """Perturbed-attention guidance written into the layer (diffusers' PAG processors): the tokens attended as usual
    and again with the attention replaced by the identity (each token its own value), the output projection called
    on each, and the outputs mixed, out + 2 (out - perturbed). Its output projection doubled doubles the output, and it
    was taken for the value projection: keys_matter failed the layer as reading its own values only."""

    def __init__(self):
        super().__init__()
        self.to_qkv, self.to_out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        attended = ((q @ k.transpose(-2, -1)) * (D // H) ** -0.5).softmax(-1) @ v
        out, perturbed = (self.to_out(t.transpose(1, 2).reshape(B, T, D)) for t in (attended, v))
        return out + 2.0 * (out - perturbed)


def test_an_output_projection_called_on_each_chunk_is_not_the_values():
    """Not measured now (its biased output projection, called twice, leaves no part of to_qkv whose doubling doubles
    the mixed output): a skip that says so, never the false failure."""
    result = _audit(PerturbedGuidance())
    assert result.verdict == "skip" and "no value projection was found" in result.message, result


class OwnTokenOnly(FusedSoftmaxAttention):
    """A window of one token, by design: each query attends its own key alone (its weights the identity)."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (D // H) ** -0.5
        weights = scores.masked_fill(~torch.eye(T, dtype=torch.bool), float("-inf")).softmax(-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, T, D))


class GuardedValues(FusedSoftmaxAttention):
    """Its own check refuses values past a bound (an overflow guard): token 0's values moved 10x raise."""

    def forward(self, x):
        B, T, _ = x.shape
        assert self.qkv(x)[..., 2 * D:].abs().max() < 1.0, "values out of range"
        return super().forward(x)


def test_a_window_of_one_token_is_not_read_as_a_bug():
    """Its own reach (the identity, read from its weights) leaves no other query that may attend token 0: not
    measured, and the report says why; declared as sliding_window(1) the same."""
    result = _audit(OwnTokenOnly())
    assert result.verdict == "skip" and "no other query may attend token 0" in result.message, result
    declared = _audit(OwnTokenOnly(), pattern=diagnostics.patterns.sliding_window(1), causal=True)
    assert declared.verdict == "skip", declared


def test_values_the_layer_refuses_are_not_a_reading():
    result = _audit(GuardedValues())
    assert result.verdict == "skip" and "raised or returned another shape" in result.message, result


class NamedProjections(nn.Module):
    """Hugging Face's layout: q_proj, k_proj, v_proj called in that order, o_proj after. `no_softmax`: the bug, the
    scaled scores used as weights, which makes the output linear in q and k as well as in v."""

    def __init__(self, no_softmax: bool = False, names=("q_proj", "k_proj", "v_proj")):
        super().__init__()
        self.no_softmax, self.names = no_softmax, names
        for name in names:
            setattr(self, name, nn.Linear(D, D, bias=False))
        self.o_proj = nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (getattr(self, n)(x).view(B, T, H, D // H).transpose(1, 2) for n in self.names)
        scores = q @ k.transpose(-2, -1) * (D // H) ** -0.5
        weights = scores if self.no_softmax else scores.softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("names", [("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("wq", "wk", "wv")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_values_are_the_projection_the_layer_names_so_not_the_queries(names, dtype):
    """Without a softmax, doubling q's projection doubles the output too, and q's, called first, was taken for the
    values: moving token 0's "values" (its query) moved its own row only, and keys_matter failed the no-softmax layer
    with "no query reads another token's value", not its bug (BERT's and ViT's no-softmax twins in
    docs/auditing-a-model.md). The projection named for the values is tried first and one named for the queries or keys
    never: keys_matter reads v_proj and leaves the bug to the detectors it belongs to (output_variance fails it), and
    its correct twin passes on the same inputs."""
    buggy = _audit(NamedProjections(no_softmax=True, names=names), dtype)
    assert buggy.verdict == "pass" and f"the output of {names[2]}" in buggy.evidence, buggy
    torch.manual_seed(0)
    report = diagnostics.audit(NamedProjections(no_softmax=True, names=names).to(dtype), progress=False, dtype=dtype)
    assert report.status == "failed" and report.result("output_variance").verdict == "fail", report
    correct = _audit(NamedProjections(names=names), dtype)
    assert correct.verdict == "pass" and f"the output of {names[2]}" in correct.evidence, correct


class ShapeGuardedValues(FusedSoftmaxAttention):
    """Past a bound on its values it drops its last token instead of raising: another shape, not a reading."""

    def forward(self, x):
        out = super().forward(x)
        return out[:, :-1] if self.qkv(x)[..., 2 * D:].abs().max() >= 1.0 else out


def test_values_that_change_the_outputs_shape_are_not_a_reading():
    """The guard's `moved.shape != ...` (its second `or` made `and`): moved values that return another shape are a
    skip that says so, never a comparison of rows that do not match."""
    result = _audit(ShapeGuardedValues())
    assert result.verdict == "skip" and "raised or returned another shape" in result.message, result


def test_values_are_read_past_the_one_key_at_a_time_limit():
    """The value projection was sought only up to ONE_HOT_KEYS_MAX tokens (the limit of the weights read one key at a
    time through it): at seq_len 128, a context length people audit at, keys_matter was "not applicable" for every
    one-stream layer, and the q^T k bug passed. Its search and move take one call each at any length."""
    swapped = _audit(FusedLinearAttention(swapped=True), seq_len=128)
    assert swapped.verdict == "fail" and "no query reads another token's value" in swapped.message, swapped
    correct = _audit(FusedLinearAttention(), seq_len=128)
    assert correct.verdict == "pass" and "to_qkv (its last third, the values)" in correct.evidence, correct


class LinearGated(nn.Module):
    """timm's fused qkv, softmax attention, and a linear gate on its output, `proj(attn * w(x))`, the gate called
    first and named unlike one (`mix`): doubling it doubles the output as the values' does."""

    def __init__(self, gate_name: str = "mix"):
        super().__init__()
        self.gate_name = gate_name
        setattr(self, gate_name, nn.Linear(D, D))
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        g = getattr(self, self.gate_name)(x)
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-2, -1) * (D // H) ** -0.5).softmax(-1)
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D) * g)


class WrappedReluLinear(nn.Module):
    """A linear attention without a softmax or a denominator, relu(q) @ (relu(k)^T v) / T (linear in q), its
    projections wrapped as LoRA or quantisation wrappers nest them (`q_proj.0`)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Sequential(nn.Linear(D, D)) for _ in range(3))
        self.o_proj = nn.Linear(D, D)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, H, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.relu(q) @ (torch.relu(k).transpose(-2, -1) @ v) / T
        return self.o_proj(out.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("seq_len", [16, 128])
@pytest.mark.parametrize("make", [lambda: LinearGated("mix"), lambda: LinearGated("gate"), WrappedReluLinear],
                         ids=["gate named mix", "gate named gate", "wrapped q_proj.0"])
def test_a_gate_or_a_wrapped_query_projection_is_not_taken_for_the_values(make, seq_len):
    """A linear gate called before the values' projection, or q's projection in a layer linear in q, doubles the
    output too; its move reaches only its own row, and keys_matter failed these correct layers ("reads its own value
    only"), at 16 tokens and, once the search ran at any length, at 128. A name of a gate's or, in any part of the
    name, a query's is never taken, and a projection whose move reaches no other row gives way to the next."""
    result = _audit(make(), seq_len=seq_len)
    assert result.verdict == "pass", result


class PremixSwapped(FusedLinearAttention):
    """The q^T k context of FusedLinearAttention(swapped=True), after a legitimate per-token mix of each head's value
    features by a weight of the layer's, `v @ v_mix`."""

    def __init__(self):
        super().__init__(swapped=True)
        self.v_mix = nn.Parameter(torch.eye(D // H) + 0.1 * torch.randn(D // H, D // H))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        v = v @ self.v_mix  # each token's own value features mixed: no weighting of tokens
        q, k = (q * (D // H) ** -0.5).softmax(-1), k.softmax(-2)
        out = v @ (q.transpose(-2, -1) @ k)  # the bug: context q^T k
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


def test_the_site_is_the_product_with_something_of_the_tokens_not_a_weight():
    """The values reach `v @ v_mix` first, a projection by a weight of the layer's; the site is the product after it,
    whose other operand is made of the tokens: the bug's line."""
    result = _audit(PremixSwapped())
    line = _line_of(PremixSwapped.forward, "out = v @")
    assert result.verdict == "fail" and [site.line for site in result.where][:1] == [line], \
        [site.describe() for site in result.where]
