"""What a model audit cannot ask of a layer in place, and what it does not blame on it (issue 33, causes 7 and 8).

- A layer of a fixed-length model (an image model: one capture, so which dimensions of its arguments follow the length
  is not known) holds the arguments its model passed at that length (Eva's rotary table over the patches, Swin's
  window mask). A probe at another length or batch that it raises on is one it cannot take as held: skipped with that
  reason (`ProbeNotTaken`), never a `runs` failure; at the captured length and batch a raise is still a failure.
- `gradient_flow` does not judge the parameters of an attention module whose output the model multiplies by 0 at this
  initialisation (SwinV2's post-norms start at weight 0; a zero-initialised gate): no attention computed with autograd
  could give them a gradient there. An attention output the model detaches (no gradient path at all) is still judged.
  Its gradient is that of every tensor the model returns: a pooling head feeds only the pooled output beside the
  tokens, and returns one vector per sequence, so it is not audited per token in place (a note says why).
- A parameter unused at the audit's length by design, used past it (a compressor) or behind a factor that starts at
  0 (a dynamic mask's projection), is not a failure of gradient_flow or of its layer's parameters_used (a warning
  naming the length, or "not judged"); one unused at every length tried still fails both.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._guard import seed_rng


class TiedAttention(nn.Module):
    """Self-attention over a class token and patches whose patch positions (P, D) its model passes: the table is
    as long as the patches, one less than the tokens (Eva's rotary table), so the layer runs only at the model's
    length. `picky`: raises on a valid input, tokens all alike (a real bug, at any length: a division by their
    spread)."""

    def __init__(self, d_model: int = 16, num_heads: int = 2, picky: bool = False):
        super().__init__()
        self.num_heads, self.picky = num_heads, picky
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, pos):
        B, T, D = x.shape  # batch, tokens (class token + patches), width
        if self.picky and bool((x == x[:, :1]).all()):
            raise ValueError("the tokens do not vary")
        x = torch.cat([x[:, :1], x[:, 1:] + pos], 1)  # (B, T, D): raises unless T - 1 == len(pos)
        q, k, v = self.qkv(x).reshape(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2) / (D // self.num_heads) ** 0.5).softmax(-1)  # (B, H, T, T)
        return self.proj((w @ v).transpose(1, 2).reshape(B, T, D))


class TinyViT(nn.Module):
    """(B, 3, 8, 8) pixels -> 2x2 patches -> a class token and 16 patch tokens -> one attention block -> logits."""

    def __init__(self, picky: bool = False):
        super().__init__()
        seed_rng(0)
        self.patch = nn.Conv2d(3, 16, 2, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.1)
        self.pos = nn.Parameter(torch.randn(16, 16) * 0.1)
        self.attn = TiedAttention(picky=picky)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 16, D)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], 1)  # (B, 17, D)
        x = x + self.attn(x, self.pos)
        return self.head(x[:, 0])


PIXELS = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_probes_a_fixed_length_layer_cannot_take_in_place_are_skipped_with_the_reason():
    report = diagnostics.audit_model(TinyViT(), example=PIXELS)
    layer = report.layers["attn"]
    runs = layer.result("runs")
    assert runs.verdict == "pass", runs
    assert "skipped" in runs.message and "T=1" in runs.message and "at length 17" in runs.message, runs.message
    assert "never gives it" in runs.message and "RuntimeError" in runs.message, runs.message
    assert report.status == "passed", report


def test_its_twin_a_raise_at_the_captured_length_and_batch_still_fails_runs():
    report = diagnostics.audit_model(TinyViT(picky=True), example=PIXELS)
    runs = report.layers["attn"].result("runs")
    assert runs.verdict == "fail" and "identical tokens" in runs.evidence and "B=2, T=17" not in runs.evidence, runs
    assert "skipped" in runs.evidence and "T=1" in runs.evidence, runs.evidence  # the other lengths: still skips
    assert report.status == "failed"


class Gated(nn.Module):
    """Token ids -> x + gate * attention(x) -> logits, the gate a parameter (0: a zero-initialised gate, as SwinV2's
    post-norm weights); `detach`: the attention branch detached in the model (a real bug: no gradient path)."""

    def __init__(self, gate: float, detach: bool = False):
        super().__init__()
        seed_rng(0)
        self.emb = nn.Embedding(32, 16)
        self.attn = TiedAttention()
        self.gate = nn.Parameter(torch.tensor(gate))
        self.head = nn.Linear(16, 32)
        self.detach = detach

    def forward(self, input_ids):
        x = self.emb(input_ids)  # (B, T, D)
        a = self.attn(torch.cat([torch.zeros_like(x[:, :1]), x], 1), torch.zeros_like(x))[:, 1:]
        return self.head(x + self.gate * (a.detach() if self.detach else a))


@pytest.mark.parametrize("gate, detach, verdict", [(0.0, False, "skip"), (1.0, False, "pass"), (0.0, True, "fail"),
                                                   (1.0, True, "fail")])
def test_gradient_flow_leaves_out_a_module_its_model_multiplies_by_zero_and_judges_a_detached_one(gate, detach, verdict):
    result = diagnostics.audit_model(Gated(gate, detach), detectors=["gradient_flow"]).result("gradient_flow")
    assert result.verdict == verdict, result
    if verdict == "skip":
        assert "not judged" not in result.message and "multiplies it by 0" in result.message and "attn" in result.message
    if verdict == "fail":
        assert "get no gradient" in result.message


class TimmLike(nn.Module):
    """A timm model with no patch embedding of that name (MetaFormer, DaViT, LeViT): its size only in
    `pretrained_cfg`, built for 8 x 8 pixels; `size`: the size its configuration says (16: built at another size than
    its configuration's, as timm keeps the configuration's when given another img_size); `picky`: the attention
    raises on tokens all alike (a real bug, `TiedAttention`)."""

    __module__ = "timm.models.fake"  # what the audit reads to know a timm model

    def __init__(self, fixed: bool, size: int = 8, picky: bool = False):
        super().__init__()
        self.pretrained_cfg = {"input_size": (3, size, size), "fixed_input_size": fixed}
        self.vit = TinyViT(picky=picky)

    def forward(self, x):
        return self.vit(x)


@pytest.mark.parametrize("fixed", [False, True])
def test_a_timm_model_gets_pixels_of_the_size_its_configuration_declares_fixed_or_not(fixed):
    # fixed: timm's builder builds a fixed-size model at its configuration's input_size (a usage error before)
    report = diagnostics.audit_model(TimmLike(fixed), detectors=["gradient_flow"])
    assert report.result("gradient_flow").verdict == "pass" and report.seq_len == 17, report


def test_a_timm_model_built_at_another_size_than_its_configuration_says_is_asked_for_pixels():
    # the configuration's 16 x 16 does not run: the size is unknown, and the message asks for pixels, not token ids
    with pytest.raises(diagnostics.AuditUsageError, match=r"did not run at its pretrained_cfg's input_size, 16 x 16"
                                                          r".*pass example=torch.randn\(2, 3, H, W\) at the size the "
                                                          r"model was built for: it starts with Conv2d\(3 -> 16\) at "
                                                          r"vit.patch"):
        diagnostics.audit_model(TimmLike(True, size=16), detectors=["gradient_flow"])


def test_its_twin_a_fixed_size_timm_model_with_a_real_bug_at_its_size_still_fails():
    report = diagnostics.audit_model(TimmLike(True, picky=True))
    assert report.status == "failed" and report.layers["attn" if "attn" in report.layers else "vit.attn"].result(
        "runs").verdict == "fail", report


class FoldedBias(nn.Module):
    """Causal attention given a key-position bias with the batch folded into its first dimension, (B x H, 1, T), as
    BLOOM's ALiBi is passed; `causal=False`: the causal mask forgotten (a real bug, for the twin)."""

    def __init__(self, d_model: int = 16, num_heads: int = 2, causal: bool = True):
        super().__init__()
        self.num_heads, self.causal = num_heads, causal
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, alibi):
        B, T, _ = x.shape  # batch, sequence length
        return self.attend(x, alibi.view(B, self.num_heads, 1, T))  # raises unless B x H rows

    def attend(self, x, bias):
        """The attention with `bias` added to its (B, H, T, T) scores."""
        B, T, D = x.shape  # batch, sequence length, width
        H = self.num_heads
        q, k, v = self.qkv(x).reshape(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each (B, H, T, d)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias
        if self.causal:
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class FoldedBiasLM(nn.Module):
    def __init__(self, causal: bool = True):
        super().__init__()
        seed_rng(0)
        self.emb, self.attn, self.head = nn.Embedding(32, 16), FoldedBias(causal=causal), nn.Linear(16, 32)

    def forward(self, input_ids):
        B, T = input_ids.shape
        slopes = torch.tensor([0.5, 0.25])  # (H,)
        alibi = (slopes.view(2, 1, 1) * torch.arange(T).view(1, 1, T)).repeat(B, 1, 1)  # (B x H, 1, T)
        x = self.emb(input_ids)
        return self.head(x + self.attn(x, alibi))


class SharedRelative(FoldedBias):
    """Causal attention given relative positions (1, 1, T, T) shared by the whole batch, which it squeezes and
    expands to B x H rows itself, as SEW-D's (DeBERTa-v2's) disentangled attention does; `causal=False`: the causal
    mask forgotten (a real bug, for the twin)."""

    def __init__(self, causal: bool = True):
        super().__init__(causal=causal)
        self.bias = nn.Parameter(torch.randn(64) * 0.1)  # one bias per clamped relative distance

    def forward(self, x, relative_pos):
        B, T, _ = x.shape  # batch, sequence length
        H = self.num_heads
        index = (relative_pos.squeeze(0) + 32).clamp(0, 63).expand(B * H, T, T)  # raises unless one row: (1, T, T)
        return self.attend(x, self.bias[index].view(B, H, T, T))


class SharedRelativeLM(FoldedBiasLM):
    def __init__(self, causal: bool = True):
        super().__init__()
        seed_rng(0)
        self.attn = SharedRelative(causal=causal)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        relative_pos = (torch.arange(T)[None, :] - torch.arange(T)[:, None])[None, None]  # (1, 1, T, T), any batch
        x = self.emb(input_ids)
        return self.head(x + self.attn(x, relative_pos))


class ClassQuery(TiedAttention):
    """The class token's query over every token (CrossViT's fusion attention): (B, 1, D) for (B, T, D);
    `every`: every token's query, (B, T, D), the twin."""

    def __init__(self, every: bool):
        super().__init__()
        self.every = every

    def forward(self, x, pos):
        out = super().forward(x, pos)
        return out if self.every else out[:, :1]


class ClassQueryViT(TinyViT):
    def __init__(self, every: bool):
        super().__init__()
        self.attn = ClassQuery(every)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 16, D)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], 1)  # (B, 17, D)
        return self.head(x[:, 0] + self.attn(x, self.pos)[:, 0])


class PooledQueries(TiedAttention):
    """Every other token's output, twice as wide (Hiera's query stride, its stage widening): (B, 9, 2D) for (B, T, D);
    `every`: every token's, as wide, the twin."""

    def __init__(self, every: bool):
        super().__init__()
        self.every = every

    def forward(self, x, pos):
        out = super().forward(x, pos)
        return out if self.every else torch.cat([out[:, ::2], out[:, ::2]], -1)


class StridedViT(ClassQueryViT):
    def __init__(self, every: bool):
        super().__init__(every)
        self.attn = PooledQueries(every)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 16, D)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], 1)  # (B, 17, D)
        return self.head(x[:, 0] + self.attn(x, self.pos)[:, 0, :16])


@pytest.mark.parametrize("every", [False, True])
def test_a_module_that_pools_its_queries_and_widens_is_audited_on_its_own_queries(every):
    report = diagnostics.audit_model(StridedViT(every), example=PIXELS, detectors=["output_shape"])
    assert "attn" in report.layers and report.status == "passed", report
    # was: output_shape failed, (2, 9, 32) for (2, 17, 16); then "not audited in place" (returned 9 for 17)
    assert ("9 queries of its own" in report.layers["attn"].layer) != every, report.layers["attn"].layer


@pytest.mark.parametrize("every", [False, True])
def test_a_module_with_a_query_of_its_own_is_audited_on_it(every):
    """Was "not audited in place" (returned 1 for 17), its model inconclusive; now its one row is expected, its (1,
    17) weights read (tests/test_own_queries.py has the twins that fail)."""
    report = diagnostics.audit_model(ClassQueryViT(every), example=PIXELS)
    assert "attn" in report.layers and report.status == "passed", report
    layer = report.layers["attn"]
    assert ("1 query of its own" in layer.layer) != every and layer.result("weight_row_sums").measured, layer


class PoolingHead(nn.Module):
    """A learned query over every token, (B, T, D) -> (B, D): one vector per sequence (Aimv2's attention pooling
    head). `detach`: its output detached, so no gradient reaches its parameters (a bug)."""

    def __init__(self, d_model: int = 16, detach: bool = False):
        super().__init__()
        self.detach = detach
        self.query = nn.Parameter(torch.randn(1, 1, d_model) * 0.1)
        self.k, self.v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        w = (self.query @ self.k(x).transpose(1, 2) / x.shape[-1] ** 0.5).softmax(-1)  # (B, 1, T)
        out = (w @ self.v(x))[:, 0]  # (B, D)
        return out.detach() if self.detach else out


class PooledViT(TinyViT):
    """TinyViT returning (tokens, pooled) as a Hugging Face vision model does (last_hidden_state, pooler_output):
    the audit reads the tokens; the pooling head feeds only the pooled output."""

    def __init__(self, detach: bool):
        super().__init__()
        self.pool = PoolingHead(detach=detach)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, 16, D)
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], 1)  # (B, 17, D)
        x = x + self.attn(x, self.pos)
        return x, self.pool(x)


@pytest.mark.parametrize("detach", [False, True])
def test_a_pooling_head_feeding_only_the_pooled_output_gets_its_gradient_from_it(detach):
    report = diagnostics.audit_model(PooledViT(detach), example=PIXELS, detectors=["gradient_flow", "output_shape"])
    # its (B, D) read as its one query's row (was: not audited in place, "one vector per sequence")
    assert "1 query of its own" in report.layers["pool"].layer, report.layers["pool"].layer
    flow = report.result("gradient_flow")
    if detach:  # no gradient path at all to its keys and values: still judged
        assert flow.verdict == "fail" and "pool.k.weight" in flow.evidence, flow
        return
    assert flow.verdict == "pass", flow  # was: pool.query, pool.k, pool.v got no gradient of the tokens' output


class ScaledInPlaceLM(nn.Module):
    """Token embeddings scaled in place (CTRL's `inputs_embeds *= sqrt(d_model)`), one torch attention layer.
    `detach`: the attention's output detached, so its parameters get no gradient (a bug)."""

    def __init__(self, detach: bool):
        super().__init__()
        seed_rng(0)
        self.detach = detach
        self.wte, self.attn, self.head = nn.Embedding(32, 16), nn.MultiheadAttention(16, 2, batch_first=True), \
            nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        x *= 4.0
        a = self.attn(x, x, x, need_weights=False)[0]
        return self.head(x + (a.detach() if self.detach else a))


@pytest.mark.parametrize("detach", [False, True])
def test_gradient_flow_takes_a_model_that_scales_its_embeddings_in_place(detach):
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))
    flow = diagnostics.audit_model(ScaledInPlaceLM(detach), example=ids, detectors=["gradient_flow"]).result(
        "gradient_flow")
    if detach:
        assert flow.verdict == "fail" and "get no gradient" in flow.message, flow
        return
    assert flow.verdict == "pass", flow  # was: raised, a leaf that requires grad used in an in-place operation


class Compressing(nn.Module):
    """Self-attention with a second path through `comp` (a compressor, a dynamic mask's projection), used as `mode`
    says: "long", only past 32 tokens (DeepSeek-V4's compressor, from its compress rate); "gated", times a factor
    A that starts at 0 (Doge's dynamic mask); "zeros", on an input of zeros (DETR's first decoder layer, from zero
    queries); "topk", past 32 tokens choosing the 32 keys attended by its scores (a sparse-attention indexer: no
    gradient, yet a choice); "never", only past a million tokens; "dropped", computed and not used."""

    def __init__(self, mode: str, d_model: int = 16):
        super().__init__()
        self.mode = mode
        self.qkv, self.proj, self.comp = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model), \
            nn.Linear(d_model, d_model)
        self.A = nn.Parameter(torch.zeros(1)) if mode == "gated" else None

    def forward(self, x):
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).chunk(3, -1)  # 3 x (B, T, D)
        scores = q @ k.transpose(1, 2) / D ** 0.5  # (B, T, T)
        if self.mode == "topk" and T > 32:  # the 32 keys the indexer scores highest, for every query
            chosen = (self.comp(x) * x).sum(-1).topk(32, dim=-1).indices  # (B, 32): indices carry no gradient
            keep = torch.zeros(B, T, dtype=torch.bool).scatter(1, chosen, True)  # (B, T)
            scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        out = scores.softmax(-1) @ v  # (B, T, D)
        c = self.comp(torch.zeros_like(x) if self.mode == "zeros" else x)
        if self.mode == "topk":
            pass
        elif self.mode == "zeros":
            out = out + c
        elif self.mode == "long" and T > 32 or self.mode == "never" and T > 10 ** 6:
            out = out + c
        elif self.mode == "gated":
            out = out + self.A * c
        return self.proj(out)


class CompressingLM(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        seed_rng(0)
        self.wte, self.attn, self.head = nn.Embedding(32, 16), Compressing(mode), nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.wte(input_ids)  # (B, T, D)
        return self.head(x + self.attn(x))


@pytest.mark.parametrize("mode", ["long", "gated", "zeros", "topk", "never", "dropped"])
def test_parameters_used_only_past_this_length_or_behind_a_factor_at_0_are_not_failed_and_the_unused_ones_are(mode):
    ids = torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(0))
    report = diagnostics.audit_model(CompressingLM(mode), example=ids,
                                     detectors=["gradient_flow", "parameters_used", "output_shape"])
    flow, layer = report.result("gradient_flow"), report.layers["attn"]
    if mode in ("never", "dropped"):  # unused at every length tried: both checks still fail
        assert flow.verdict == "fail" and "attn.comp.weight" in flow.evidence, flow
        assert layer.result("parameters_used").verdict == "fail", layer
        return
    # was: both failed, "attn.comp.weight, attn.comp.bias get no gradient"
    assert "parameters_used" not in layer.fired() and report.status == "passed", report
    if mode == "gated":  # the layer's own check draws the all-zero factor and sees the path used
        used = layer.result("parameters_used")
        assert used.verdict == "pass" and "inner.comp.weight, inner.comp.bias: zero gradient only while inner.A is " \
            "all zeros" in used.evidence, used
    else:
        assert any("attn: parameters_used not run in place: attn.comp.weight" in n for n in report.notes), report.notes
    if mode in ("long", "topk"):
        assert flow.verdict == "warn" and "but do at 64" in flow.message and "(from 64; not at 16)" in flow.evidence
        assert "seq_len=64" in flow.fix, flow
    else:
        assert flow.verdict == "pass" and "attn.comp" in flow.message and "multiplies it by 0" in flow.message, flow
        if mode == "zeros":
            assert "is exactly 0 here" in " ".join(report.notes), report.notes


class QueriesOverPatches(nn.Module):
    """Cross-attention of learned queries over the patches, the patches' own positions added to the keys as an
    argument of the memory's length along its second dimension (DETR's encoder_position_embeddings, (B, S, D)).
    `broken`: divides by the keys' spread over the heads' width, 0 in a width of one (a bug that raises at the
    model's own call too)."""

    def __init__(self, d_model: int = 16, broken: bool = False):
        super().__init__()
        self.broken = broken
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))

    def forward(self, hidden_states, key_value_states, encoder_position_embeddings):
        if self.broken:
            raise ValueError("the layer is broken")
        k = self.k(key_value_states + encoder_position_embeddings)  # (B, S, D): raises unless S == len(positions)
        w = (self.q(hidden_states) @ k.transpose(1, 2) / k.shape[-1] ** 0.5).softmax(-1)  # (B, Q, S)
        return w @ self.v(key_value_states)


class TinyDetector(TinyViT):
    """TinyViT's patches as the memory of 5 learned queries (DETR's decoder): (B, 5, 4) box logits."""

    def __init__(self, broken: bool = False):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(1, 5, 16) * 0.1)
        self.cross = QueriesOverPatches(broken=broken)

    def forward(self, x):
        memory = self.patch(x).flatten(2).transpose(1, 2)  # (B, 16, D)
        B = memory.shape[0]
        q = self.queries.expand(B, -1, -1)
        return self.head(q + self.cross(q, key_value_states=memory,
                                        encoder_position_embeddings=self.pos.expand(B, -1, -1)))


@pytest.mark.parametrize("broken", [False, True])
def test_a_memory_of_another_length_than_its_models_is_a_probe_not_taken_and_a_raise_at_its_own_still_fails(broken):
    report = diagnostics.audit_model(TinyDetector(broken), example=PIXELS, detectors=["runs"])
    if broken:  # raises at the model's own call: the model's failure, at that layer
        assert report.status == "failed" and report.result("model_runs").layer == "cross", report
        return
    runs = report.layers["cross"].result("runs")  # every probe gives a memory of its own length (5), not 16
    assert runs.verdict == "skip" and "memory 16" in runs.message and "memory 5" in runs.message, runs
    assert report.status == "inconclusive", report  # was: failed, runs raised on 6 probes


class RelativeTable(FoldedBias):
    """Causal attention given one entry per relative distance, (1, 2T - 1, H), distances T - 1 down to -(T - 1), as
    Conformer's and Transformer-XL's relative positions are passed: a bias per head read at j - i; `causal=False`:
    the causal mask forgotten (a real bug, for the twin)."""

    def forward(self, x, pos):
        T = x.shape[1]  # sequence length
        index = (T - 1) - (torch.arange(T)[None, :] - torch.arange(T)[:, None])  # (T, T): raises unless 2T - 1 rows
        return self.attend(x, pos[0, index].permute(2, 0, 1))  # a bias (H, T, T)


class RelativeTableLM(FoldedBiasLM):
    def __init__(self, causal: bool = True):
        super().__init__()
        seed_rng(0)
        self.attn = RelativeTable(causal=causal)
        self.table = nn.Parameter(torch.randn(1, 127, 2) * 0.5)  # distances 63 .. -63

    def forward(self, input_ids):
        T = input_ids.shape[1]
        x = self.emb(input_ids)
        return self.head(x + self.attn(x, self.table[:, 63 - (T - 1):63 + T]))  # (1, 2T - 1, H)


@pytest.mark.parametrize("lm", ["folded", "shared", "relative"])
@pytest.mark.parametrize("causal", [True, False])
def test_an_argument_the_model_passes_is_given_to_each_probe_as_the_model_would_give_it(lm, causal):
    """Each probe gets the model's other arguments as the model would pass them at its length and batch (before,
    `runs` failed on every probe of another batch or length; then 3 of the 6 cases):
    - `folded`: a key-position bias with the batch folded into its first dimension, (B x H, 1, T) as BLOOM's ALiBi:
      captured at batch 1 and 2 (2 rows, then 4), so a probe of batch B gets B x 2 rows;
    - `shared`: relative positions (1, 1, T, T) the model passes as one row at batch 1 and 2 (SEW-D's), passed so;
    - `relative`: one entry per distance, (1, 2T - 1, H) (Conformer's, FastSpeech 2's): 23 at T = 12, 21 at T = 11,
      so a probe of length t gets the 2t - 1 around the centre.
    Twin: the same layer without its causal mask fails future_leakage there."""
    model = {"folded": FoldedBiasLM, "shared": SharedRelativeLM, "relative": RelativeTableLM}[lm](causal)
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    report = diagnostics.audit_model(model, example=ids, causal=True)
    layer = report.layers["attn"]
    assert layer.result("runs").verdict == "pass", layer.result("runs")
    if causal:
        assert report.status == "passed", report
    else:
        assert layer.result("future_leakage").verdict == "fail" and report.status == "failed", report



class LibraryCrossAttention(QueriesOverPatches):
    """QueriesOverPatches as a library's attention class (a Hugging Face module's name and place)."""


LibraryCrossAttention.__module__ = "transformers.models.toy_detr.modeling_toy_detr"


class QueriesOverFewerPatches(TinyDetector):
    """TinyDetector with 4x4 patches, 4 of them (a memory narrower than the width, so that no argument's last
    dimension follows it), and more learned queries (20) than patches, as DETR's 100 queries over a small image's
    memory of 4: probed at the memory's own length, the only one the layer as held surely takes. `bug`: the
    cross-attention with its scale dropped or its softmax over the queries (real bugs, the twins)."""

    def __init__(self, bug: str = "", patch: int = 4, library: bool = False):
        super().__init__()
        self.patch = nn.Conv2d(3, 16, patch, patch)
        self.pos = nn.Parameter(torch.randn((8 // patch) ** 2, 16) * 0.1)
        self.queries = nn.Parameter(torch.randn(1, 20, 16) * 0.1)
        if library:  # found by its class, whatever its softmax shows
            self.cross = LibraryCrossAttention()
        self.cross.bug = bug
        self.cross.forward = self._cross

    def _cross(self, hidden_states, key_value_states, encoder_position_embeddings):
        c = self.cross
        k = c.k(key_value_states + encoder_position_embeddings)  # (B, S, D)
        scale = 1.0 if c.bug == "missing_scale" else k.shape[-1] ** -0.5
        w = (c.q(hidden_states) @ k.transpose(1, 2) * scale).softmax(1 if c.bug == "softmax_wrong_dim" else -1)
        return w @ c.v(key_value_states)  # (B, Q, D)


@pytest.mark.parametrize("bug", ["", "missing_scale", "softmax_wrong_dim"])
def test_a_cross_attention_with_more_queries_than_its_memory_is_probed_at_the_memory_it_holds(bug):
    report = diagnostics.audit_model(QueriesOverFewerPatches(bug), example=PIXELS)
    cross = report.layers["cross"]
    assert cross.result("runs").verdict == "pass", cross.result("runs")  # was: not one probe taken (20 vs memory 4)
    if not bug:
        assert report.status == "passed" and cross.status == "passed", report
        return
    failed = {f.detector for f in report.findings if f.verdict == "fail" and f.layer == "cross"}
    expected = {"missing_scale": "softmax_saturation", "softmax_wrong_dim": "weight_row_sums"}[bug]
    assert report.status == "failed" and expected in failed, (failed, report)


@pytest.mark.parametrize("bug", ["", "softmax_wrong_dim"])
def test_a_memory_of_one_patch_is_no_held_length_and_the_wrong_axis_still_fails(bug):
    """One 8 x 8 patch: a memory of 1, which every size-1 dimension matches by chance (a (B, 1, D) position table), the
    cross-attention a library class (found by its name: a softmax over one key is no attention to observe). Probed at
    one key, the layer would show nothing (its softmax over the queries included): the probes keep the
    queries' length, and the bug fails as it did before the memory's length was read."""
    report = diagnostics.audit_model(QueriesOverFewerPatches(bug, patch=8, library=True), example=PIXELS)
    if not bug:
        assert report.status != "failed", report
        return
    failed = {f.detector for f in report.findings if f.verdict == "fail" and f.layer == "cross"}
    assert report.status == "failed" and "weight_row_sums" in failed, (failed, report)
