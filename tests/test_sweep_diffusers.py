"""benchmarks/sweep_diffusers.py: the diffusers sweep's bug injection, and the plain scripts behind its `KNOWN`.

Default run: the replacement of torch's SDPA that injects the bugs computes SDPA itself with nothing broken (bool,
additive and causal masks, one head a row, grouped heads) and each bug changes it. With diffusers (the zoo extra):
each `KNOWN` failure confirmed by a plain script on the layer, no diagnostics, beside its twin where the same
script finds nothing; and a fixed slice of the sweep itself (slow).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]
import sweep_diffusers as sd  # noqa: E402

ZOO = 'pip install torch==2.14.1 torchvision==0.29.1, then pip install -e ".[test,real,zoo]"'
BUGS = ("missing_scale", "mask_ignored", "softmax_wrong_dim", "mask_after_softmax")


def _qkv(gen, *shape, kv_heads=None):
    q = torch.randn(*shape, generator=gen, dtype=torch.float64)
    kv_shape = shape if kv_heads is None else (shape[0], kv_heads, *shape[2:])
    return q, torch.randn(*kv_shape, generator=gen, dtype=torch.float64), \
        torch.randn(*kv_shape, generator=gen, dtype=torch.float64)


def _masks(gen, B, T):
    allowed = torch.rand(B, 1, T, T, generator=gen) > 0.3
    allowed[..., 0] = True  # no row fully blocked
    return {"bool": dict(attn_mask=allowed),
            "additive": dict(attn_mask=torch.zeros(B, 1, T, T, dtype=torch.float64).masked_fill(~allowed, -10000.0)),
            "causal": dict(is_causal=True), "none": {}}


@pytest.mark.parametrize("mask", ["bool", "additive", "causal", "none"])
@pytest.mark.parametrize("layout", ["heads", "flat", "grouped", "blocks"])
def test_the_injection_with_nothing_broken_is_sdpa_and_each_bug_changes_it(mask, layout):
    gen = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 4, 6, 8
    q, k, v = _qkv(gen, B, H, T, d, kv_heads=2 if layout == "grouped" else None)
    kw = _masks(gen, B, T)[mask]
    if layout == "grouped":
        kw["enable_gqa"] = True
    if layout == "blocks":  # (B, H, blocks, T, d): NesT's blocks of tokens, each attended apart
        q, k, v = (torch.stack([x, x.flip(-2)], dim=2) for x in (q, k, v))
        kw = {n: (x[:, :, None] if n == "attn_mask" else x) for n, x in kw.items()}
    expected = F.scaled_dot_product_attention(q, k, v, **kw)
    if layout == "flat":  # (B*H, T, d): what a processor that folds the heads into the batch passes
        q, k, v = (x.reshape(B * H, T, d) for x in (q, k, v))
        kw = {n: (x.repeat_interleave(H, 0)[:, 0] if n == "attn_mask" else x) for n, x in kw.items()}
        expected = expected.reshape(B * H, T, d)
    routed = sd._Routed("reference")
    assert torch.allclose(routed(q, k, v, **kw), expected, atol=1e-12), "the reference is not SDPA"
    assert routed.calls == 1 and routed.masked == (mask != "none")
    for bug in BUGS:
        if bug in ("mask_ignored", "mask_after_softmax") and mask == "none":
            continue  # nothing to break: the sweep counts these as not applicable
        broken = sd._Routed(bug)(q, k, v, **kw)
        assert not torch.allclose(broken, expected, atol=1e-6), f"{bug} changed nothing"


def test_the_replacement_is_undone_after_use():
    before = F.scaled_dot_product_attention
    with sd._Routed("missing_scale") as routed:
        assert F.scaled_dot_product_attention is routed
    assert F.scaled_dot_product_attention is before


class OwnCausal(torch.nn.Module):
    """A layer that takes no mask and passes `is_causal` to SDPA itself, as MiniMax-H3's audio attention and MiniMax
    Music 3's depth decoder do (`causal=False`: the same layer attending both ways); `scales_q`: it scales q itself and
    hands SDPA a scale of 1, as vit-pytorch's nViT does."""

    def __init__(self, causal: bool, scales_q: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads, self.causal, self.scales_q = 32, 4, causal, scales_q
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        if self.scales_q:  # nViT's way: the scale applied to q itself, SDPA handed a scale of 1
            y = F.scaled_dot_product_attention(q * 8 ** -0.5, k, v, is_causal=self.causal, scale=1.0)
        else:  # looked up at the call: the sweep's
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(B, T, 32))


@pytest.mark.parametrize("causal", [True, False], ids=["masks the future itself", "attends both ways"])
def test_a_layer_that_masks_the_future_itself_is_audited_as_causal_as_its_report_says(causal):
    """Its zero-config report passes with `undeclared_causality`'s hint to audit it as causal (causal=True); the sweep
    follows it as a user would, so the causal mask dropped (`mask_ignored`: is_causal never applied) is measured
    against that promise and caught; before, both MiniMax rows counted it missed. The layer attending both ways gets
    no hint, no declaration, and no mask bug (nothing reached SDPA to break)."""
    import sweep

    row = sd.run(sweep.Row("own causal"), bugs=True, injected=BUGS, mask_bugs=("mask_ignored", "mask_after_softmax"),
                 build=lambda name: OwnCausal(causal))
    assert row.verdict == "passed", row
    assert row.declared == ("causal=True: passed" if causal else ""), row
    assert row.bugs["missing_scale"] == "caught", row
    if causal:
        assert row.bugs["mask_ignored"] == "caught" and row.bugs["mask_after_softmax"] == "caught", row
    else:
        assert row.bugs["mask_ignored"].startswith("not applicable"), row


# ---- the plain scripts behind KNOWN (diffusers, no diagnostics) ---------------------------------------------------


def _diffusers():
    return pytest.importorskip("diffusers", reason=f"diffusers is not installed (the zoo extra): {ZOO}")


def _hidden(seed=0, T=16):
    return torch.randn(1, T, sd.D, generator=torch.Generator().manual_seed(seed))


def _half_blocked(T=16):
    """An additive (1, 1, T, T) mask, as diffusers takes it, blocking the second half of the keys for every query."""
    allowed = torch.ones(1, 1, T, T, dtype=torch.bool)
    allowed[..., T // 2:] = False
    return torch.zeros(1, 1, T, T).masked_fill(~allowed, float("-inf"))


# ---- building a layer as diffusers' own models build it (diffusers, no diagnostics) ---------------------------------


def test_a_required_argument_is_read_from_the_call_of_diffusers_that_passes_it():
    """LTX-2's VAE neighbourhood attention requires kernel_size: its block passes its own parameter, whose callers
    default it to (11, 11, 11); the widths stay the sweep's."""
    _diffusers()
    from diffusers.models.autoencoders import ltx2_diffusion_decoder as ltx2

    kw = sd._filled(ltx2.LTX2VideoVaeNeighborhoodAttention, sd.TINY, sd.REQUIRED)
    assert kw == {"dim": sd.D, "kernel_size": (11, 11, 11), "head_dim": sd.WIDTH}, kw


def test_a_processor_is_set_on_the_layer_its_model_sets_it_on():
    """FluxAttnProcessor2_0 (a deprecated name whose constructor returns FluxAttnProcessor) on FluxAttention as
    Flux's single-stream block builds it (pre_only=True: no output projection of its own, no second stream's)."""
    _diffusers()
    layer = sd.diffusers_build("Attention+FluxAttnProcessor2_0")
    assert type(layer).__name__ == "FluxAttention" and layer.pre_only and layer.added_kv_proj_dim is None
    assert type(layer.processor).__name__ == "FluxAttnProcessor"


@pytest.mark.parametrize("name, copies", [("Attention+PAGIdentitySelfAttnProcessor2_0", 2),
                                          ("Attention+PAGCFGIdentitySelfAttnProcessor2_0", 3)])
def test_a_pag_processor_read_at_its_first_guidance_part_is_the_plain_attention(name, copies):
    """Given its guidance parts (the input repeated), PAG's first part is the layer's attention: the same output
    as AttnProcessor2_0 on the same weights; its last, perturbed part is not (its values, projected)."""
    _diffusers()
    from diffusers.models.attention_processor import AttnProcessor2_0

    guided, x = sd.diffusers_build(name), _hidden()
    assert isinstance(guided, sd._Guided) and guided.copies == copies
    with torch.no_grad():
        first, whole = guided(x), guided.layer(x.repeat(copies, 1, 1))
        guided.layer.set_processor(AttnProcessor2_0())
        plain = guided.layer(x)
    assert torch.allclose(first, plain, atol=1e-6), float((first - plain).abs().max())
    assert not torch.allclose(whole[-1:], plain, atol=1e-3)


def test_rotary_tables_a_forward_requires_are_its_models_for_the_length():
    """Stable Audio 3's self-attention requires `rope`: its DiT computes it with StableAudio3RotaryEmbedding(
    dim_heads // 2) for the sequence's length; the wrapper does the same at the sweep's head width."""
    _diffusers()
    from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3RotaryEmbedding

    positioned, x = sd.diffusers_build("transformers.transformer_stable_audio3:StableAudio3SelfAttention"), _hidden()
    assert isinstance(positioned.rope, StableAudio3RotaryEmbedding) and positioned.name == "rope"
    rope = StableAudio3RotaryEmbedding(sd.WIDTH // 2)
    with torch.no_grad():
        assert torch.equal(positioned(x), positioned.layer(x, rope=rope(16, x.device)))


@pytest.mark.parametrize("name, ignored", [
    ("Attention+JointAttnProcessor2_0", True), ("Attention+AuraFlowAttnProcessor2_0", True),
    ("Attention+FusedAuraFlowAttnProcessor2_0", True), ("Attention+SanaLinearAttnProcessor2_0", True),
    ("Attention+PAGCFGSanaLinearAttnProcessor2_0", True), ("Attention+PAGIdentitySanaLinearAttnProcessor2_0", True),
    ("Attention+AttnProcessor2_0", False), ("Attention+FusedAttnProcessor2_0", False),
    ("Attention+PAGIdentitySelfAttnProcessor2_0", False), ("Attention+PAGCFGIdentitySelfAttnProcessor2_0", False)])
def test_a_mask_blocking_half_the_keys_changes_nothing_where_known_says_it_is_ignored(name, ignored):
    _diffusers()
    assert (name in sd.KNOWN) is ignored
    layer, x = sd.diffusers_build(name), _hidden()
    mask = _half_blocked()
    with torch.no_grad():
        plain, masked = layer(x), layer(x, attention_mask=mask)
    assert torch.equal(plain, masked) is ignored, float((plain - masked).abs().max())


@pytest.mark.parametrize("name, ignored", [
    ("Attention+FusedJointAttnProcessor2_0", True), ("Attention+PAGJointAttnProcessor2_0", True),
    ("Attention+PAGCFGJointAttnProcessor2_0", True),
    ("Attention+CogVideoXAttnProcessor2_0", False)])
def test_a_joint_processor_given_a_mask_blocking_half_the_keys_changes_nothing_where_known_says_it_is_ignored(
        name, ignored):
    """The joint processors (text and image tokens attended together), given no text tokens, as the declaration their
    report names calls them: the mask blocking half the image keys leaves the output exactly as it is, where KNOWN
    says the processor never applies it; CogVideoX's joint processor, the twin, applies it."""
    _diffusers()
    assert (name in sd.KNOWN) is ignored
    layer, x = sd.diffusers_build(name), _hidden()
    mask = _half_blocked()
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731  (image, text) or the image's
    with torch.no_grad():
        plain = first(layer(x, encoder_hidden_states=x[:, :0]))
        masked = first(layer(x, encoder_hidden_states=x[:, :0], attention_mask=mask))
    assert torch.equal(plain, masked) is ignored, float((plain - masked).abs().max())


@pytest.mark.parametrize("name, linear", [("Attention+SanaLinearAttnProcessor2_0", True),
                                          ("Attention+AttnProcessor2_0", False)])
def test_a_query_with_no_positive_relu_feature_gets_no_weight_where_known_says_so(name, linear):
    """Every query of the first head made negative before the ReLU (its to_q rows zero, their bias -1) and to_out the
    identity: Sana's linear attention returns zeros for that head (no weight on any key); the twin, softmax
    attention on the same weights, returns a weighted mean of the values."""
    _diffusers()
    assert ("ReLU" in sd.KNOWN.get(name, "")) is linear
    layer, x = sd.diffusers_build(name), _hidden()
    with torch.no_grad():
        layer.to_q.weight[: sd.WIDTH] = 0.0
        if layer.to_q.bias is None:
            layer.to_q.bias = torch.nn.Parameter(torch.zeros(sd.HEADS * sd.WIDTH))
        layer.to_q.bias[: sd.WIDTH] = -1.0
        layer.to_out[0].weight.copy_(torch.eye(sd.D))
        layer.to_out[0].bias.zero_()
        first_head = layer(x)[..., : sd.WIDTH]
    assert torch.equal(first_head, torch.zeros_like(first_head)) is linear, float(first_head.abs().max())


@pytest.mark.parametrize("name, causal_l2", [("Attention+MochiVaeAttnProcessor2_0", True),
                                             ("Attention+AttnProcessor2_0", False)])
def test_mochis_vae_attention_raises_on_any_mask_and_bounds_its_logits_where_known_says_so(name, causal_l2):
    """Built as Mochi's VAE builds it (is_causal=True, q and k L2-normalised): any mask raises, and every logit
    q·k / sqrt(d) lies within +-1/sqrt(d); the twin, AttnProcessor2_0's plain Attention, takes the mask and its
    logits go past that bound on the same input."""
    _diffusers()
    assert (name in sd.KNOWN) is causal_l2
    layer, x = sd.diffusers_build(name), _hidden()
    mask = torch.zeros(1, 1, 16, 16).masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    raised = False
    try:
        with torch.no_grad():
            layer(x, attention_mask=mask)
    except RuntimeError as exc:
        raised = "is_causal" in str(exc)
    assert raised is causal_l2
    seen = {}  # q and k as they reach SDPA
    sdpa = F.scaled_dot_product_attention

    def capture(q, k, v, *args, **kw):
        seen["q"], seen["k"] = q, k
        return sdpa(q, k, v, *args, **kw)

    F.scaled_dot_product_attention = capture
    try:
        with torch.no_grad():
            layer(x)
    finally:
        F.scaled_dot_product_attention = sdpa
    q, k = seen["q"], seen["k"]  # (B, H, T, d)
    bound = q.shape[-1] ** -0.5
    logits = q @ k.transpose(-1, -2) * bound  # (B,H,T,d) x (B,H,d,T) -> (B,H,T,T)
    assert (float(logits.abs().max()) <= bound + 1e-6) is causal_l2, float(logits.abs().max())


@pytest.mark.parametrize("name", [n for n in sd.KNOWN if "pre_only" in sd.KNOWN[n]])
def test_the_output_projection_is_dead_in_the_default_build_and_used_in_a_joint_one(name):
    """Changing to_out leaves the default build's output unchanged (KNOWN); the twin, the class built with the
    context projections and given encoder_hidden_states, is moved by it."""
    _diffusers()
    import importlib

    module, cls_name = name.split(":")
    cls = getattr(importlib.import_module(f"diffusers.models.{module}"), cls_name)
    for joint in (False, True):
        torch.manual_seed(0)
        layer = sd.diffusers_build(name) if not joint else \
            cls(query_dim=sd.D, heads=sd.HEADS, dim_head=sd.WIDTH, added_kv_proj_dim=sd.D).eval()
        kw = {"encoder_hidden_states": _hidden(1, 8)} if joint else {}
        with torch.no_grad():
            before = layer(_hidden(), **kw)
            before = before[0] if isinstance(before, tuple) else before
            layer.to_out[0].weight.add_(1.0)
            after = layer(_hidden(), **kw)
            after = after[0] if isinstance(after, tuple) else after
        assert torch.equal(before, after) is (not joint), (joint, float((before - after).abs().max()))


@pytest.mark.parametrize("name, attends_padding", [
    ("transformers.transformer_anyflow_far:AnyFlowAttention", True),
    ("transformers.transformer_anyflow:AnyFlowAttention", False)])
def test_identical_values_come_out_changed_only_where_the_zero_padding_is_attended(name, attends_padding):
    """Every token the same: a correct attention returns that token's value row, projected, at every position.
    AnyFlow FAR's causal processor pads the keys and values with zeros to 128 tokens and, with no mask, attends
    them; AnyFlow's own processor is the twin."""
    _diffusers()
    layer = sd.diffusers_build(name)
    x = _hidden()[:, :1].expand(1, 16, sd.D)  # one token repeated: every value row the same
    one = _hidden()[:, :1]
    with torch.no_grad():
        out, alone = layer(x), layer(one)  # a single token attends only itself (and any padding)
    if attends_padding:
        # 1 token beside 127 zero keys, 16 beside 112: the share of the zeros differs, so do the outputs
        assert not torch.allclose(out, alone.expand_as(out), atol=1e-5), "the padding changed nothing"
    else:
        assert torch.allclose(out, alone.expand_as(out), atol=1e-5), float((out - alone).abs().max())


@pytest.mark.parametrize("name, raises", [("Attention+CustomDiffusionAttnProcessor2_0", True),
                                          ("Attention+AttnProcessor2_0", False)])
def test_a_padding_mask_at_batch_2_runs_except_where_known_says_it_is_not_viewed_per_head(name, raises):
    """Custom Diffusion's SDPA processor hands SDPA the (B x heads, 1, Tk) mask diffusers prepares without the view to
    (B, heads, 1, Tk) that AttnProcessor2_0 makes: at batch 2 any mask raises, at batch 1 it runs; the twin runs
    both."""
    _diffusers()
    assert (name in sd.KNOWN) is raises
    layer = sd.diffusers_build(name)
    x = torch.randn(2, 12, sd.D, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 1, 12)
    mask[..., 8:] = float("-inf")  # the last four keys blocked: additive, (B, 1, Tk), as diffusers takes it
    with torch.no_grad():
        assert layer(x[:1], attention_mask=mask[:1]).shape == (1, 12, sd.D)
        try:
            layer(x, attention_mask=mask)
        except RuntimeError as exc:
            assert raises and "must match the size of tensor b" in str(exc), exc
        else:
            assert not raises


@pytest.mark.parametrize("name", ["Attention+CustomDiffusionAttnProcessor",
                                  "Attention+CustomDiffusionAttnProcessor2_0"])
@pytest.mark.parametrize("loaded", [True, False])
def test_custom_diffusion_loaded_from_its_layer_computes_the_layers_own_attention(name, loaded):
    """Built as diffusers' training script starts it (its copies of to_q, to_k, to_v and to_out loaded from the
    Attention's), the processor's output is the Attention's own under AttnProcessor2_0, so those it replaces are kept
    copies (parameters_used's warning); the twin with the processor's random copies computes another function."""
    _diffusers()
    from diffusers.models.attention_processor import AttnProcessor2_0

    layer = sd.diffusers_build(name)
    if not loaded:
        with torch.no_grad():
            for p in layer.processor.parameters():
                p.normal_(0, 0.2)
    x = _hidden()
    with torch.no_grad():
        custom = layer(x)
        layer.set_processor(AttnProcessor2_0())
        plain = layer(x)
    assert torch.allclose(custom, plain, atol=1e-6) is loaded, float((custom - plain).abs().max())


@pytest.mark.slow
def test_a_fixed_slice_of_the_sweep_passes_fails_as_known_and_catches_the_bugs():
    _diffusers()
    sys.path[:0] = [str(ROOT / "tests")]
    from sweep import BUGS as SWEEP_BUGS, in_child, run_diffusers

    # each in a forked child, as the sweep runs them: the audits' backward passes stay out of this process, whose
    # later forks (the transformers sweep's test) would otherwise inherit autograd's threads
    rows = {name: in_child(run_diffusers, name, 240.0, bugs=True) for name in (
        "Attention+AttnProcessor2_0", "Attention+AttnProcessor", "Attention+JointAttnProcessor2_0",
        "transformers.transformer_wan:WanAttention", "Attention+CogVideoXAttnProcessor2_0",
        "Attention+CustomDiffusionAttnProcessor")}
    assert rows["Attention+AttnProcessor2_0"].verdict == "passed"
    assert rows["Attention+AttnProcessor"].declared == "mask='additive:B,Tq,Tk': passed"
    assert rows["Attention+JointAttnProcessor2_0"].verdict == "failed"
    # the mask never read: blocked keys move the kept rows, and the padded sequences differ from the cut ones
    assert rows["Attention+JointAttnProcessor2_0"].findings == ["blocked_keys_absent", "mask_honoured"]
    # joint attention that raises without its text stream: needs the declaration that gives it none, then passes
    cog = rows["Attention+CogVideoXAttnProcessor2_0"]
    assert cog.verdict == "inconclusive" and cog.declared == (
        "call=lambda layer, x, mask: layer(x, encoder_hidden_states=x[:, :0], attention_mask=mask): passed"), cog
    # the Attention's projections kept beside the processor's copies of them: a warning, and its mask declared
    custom = rows["Attention+CustomDiffusionAttnProcessor"]
    assert custom.findings == ["parameters_used (warn)"] and custom.declared.endswith(": passed"), custom
    wan = rows["transformers.transformer_wan:WanAttention"]
    assert wan.verdict == "passed" and wan.bugs == dict.fromkeys(SWEEP_BUGS, "caught"), wan
    sdpa = rows["Attention+AttnProcessor2_0"].bugs
    assert all(sdpa[b] == "caught" for b in SWEEP_BUGS), sdpa


@pytest.mark.parametrize("scales_q", [True, False], ids=["hands SDPA a scale of 1", "leaves SDPA its own"])
def test_a_missing_scale_is_injected_only_where_sdpa_is_handed_one_to_drop(scales_q):
    """A layer that scales q itself and calls SDPA with scale=1 computes the same attention with the sweep's missing
    scale (scale 1) as without: nothing to drop, so not applicable (vit-pytorch's nViT counted it missed); the same
    layer leaving SDPA its own 1/sqrt(d) has it caught."""
    import sweep

    row = sd.run(sweep.Row("own scale"), bugs=True, injected=("missing_scale",), mask_bugs=(),
                 build=lambda name: OwnCausal(False, scales_q=scales_q))
    assert row.verdict == "passed", row
    assert row.bugs["missing_scale"] == ("not applicable: the layer scales q and k itself and hands SDPA a scale of 1, "
                                         "nothing to drop" if scales_q else "caught"), row


class RmsNormed(torch.nn.Module):
    """q and k RMS-normalised with a learned gain, and the attention computed by SDPA, its scale stated at that call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.d_model, self.num_heads = 32, 4
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
        self.q_gamma, self.k_gamma = (torch.nn.Parameter(torch.ones(4, 1, 8)) for _ in range(2))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        # NaViT's RMSNorm, "already includes sqrt(dim)": rows of norm sqrt(d) times a learned gain per head
        q, k = (F.normalize(t, dim=-1) * 8 ** 0.5 * g for t, g in ((q, self.q_gamma), (k, self.k_gamma)))
        y = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out(y.transpose(1, 2).reshape(B, T, 32))


def test_the_scale_a_layer_states_to_sdpa_is_declared_for_its_written_out_reference():
    """NaViT's: q and k RMS-normalised and SDPA told `scale=1`, the layer's own words, which the sweep's written-out
    reference cannot state (its audit read q·k unscaled and failed, so no bug was judged). The reference and the bugs
    are now audited with that scale declared, as the user who wrote the attention out would declare it: the softmax over
    the wrong axis is caught under it, and the missing scale has nothing to drop."""
    import sweep

    routed = []  # every written-out SDPA the sweep made, and how many calls each audit sent through it
    real = sd._Routed

    class Counted(real):
        def __exit__(self, *exc):
            routed.append((self.kind, self.calls))
            return super().__exit__(*exc)

    sd._Routed = Counted
    try:
        row = sd.run(sweep.Row("own normalised"), bugs=True, injected=("missing_scale", "softmax_wrong_dim"),
                     mask_bugs=(), build=lambda name: RmsNormed())
    finally:
        sd._Routed = real
    assert row.verdict == "passed" and "reference" not in row.bugs, row
    # the reference twice, the second with the scale declared, both through the written-out SDPA; then the bug
    assert [kind for kind, _ in routed] == ["reference", "reference", "softmax_wrong_dim"], routed
    assert all(calls > 0 for _, calls in routed), routed
    assert row.why.endswith("the explicit reference audited with scale=1, the scale the layer states to SDPA"), row
    assert row.bugs["softmax_wrong_dim"] == "caught", row
    assert row.bugs["missing_scale"].startswith("not applicable"), row


class CosineStated(torch.nn.Module):
    """titans-pytorch's MemoryAttention: q and k l2-normalised, SDPA told `scale=8`. Its scale dropped (the sweep's
    missing_scale) reads as a cosine times 1, a temperature a correct layer may have (Restormer's at init): only the
    scale the layer states, declared, tells the bug (it passed, "missed", before)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, scale=8.0)
        return self.out(y.transpose(1, 2).reshape(B, T, 32))


def test_a_stated_scale_is_declared_even_where_the_reference_passes_without_it():
    import sweep

    row = sd.run(sweep.Row("cosine stated"), bugs=True, injected=("missing_scale",), mask_bugs=(),
                 build=lambda name: CosineStated())
    assert row.verdict == "passed" and "reference" not in row.bugs, row
    assert row.why.endswith("the explicit reference audited with scale=8, the scale the layer states to SDPA"), row
    assert row.bugs["missing_scale"] == "caught", row
