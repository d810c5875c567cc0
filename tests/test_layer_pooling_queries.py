"""A user's own attention-POOLING layer audited as a layer (issue 33, issue 34's "convention mismatch is not a
defect"): a module with Q learned queries of its own that attends over the input tokens and returns (B, Q, D), or
(B, D) where Q = 1 (CLIP's and SigLIP's attention-pool head, Set Transformer's PMA, Perceiver's latent array).

Before `queries=Q`, every such layer FAILED `output_shape` ("output (2, 32), expected (2, 16, 32)"), the hand-written
one `runs` too (the audit's (B, 1, T, T) masks do not fit Q queries), and `batch_independence` and
`eval_determinism` crashed on a (B, D) output. Declared, the output is expected to have Q rows, the weights are read
over (Q, Tk), masks reach the layer per key (padding), and the probes that compare rows read its Q rows; the bugs
fail on the same inputs (twins). Undeclared, the audit needs a declaration naming `queries=Q` (never FAILED), but
only where the output's row count is the same at two lengths: a layer whose rows move with T is a shape bug, and
no declaration is suggested for it.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import diagnostics
from diagnostics import AuditUsageError, _cli
from diagnostics._guard import seed_rng

pytest_plugins = ["pytester"]

D, HEADS = 32, 4


class AttentionPool(nn.Module):
    """Q learned queries over the tokens, written by hand; the key padding mask is bool (B, T), True = padding.
    `bug`: one step changed (None: correct)."""

    def __init__(self, queries: int = 1, squeeze: bool = True, bug: str | None = None, *, d_model: int = D,
                 num_heads: int = HEADS, seed: int = 0, out_width: int | None = None):
        super().__init__()
        seed_rng(seed)
        self.d_model, self.num_heads, self.squeeze, self.bug = d_model, num_heads, squeeze, bug
        self.latent = nn.Parameter(torch.randn(1, queries, d_model))
        self.q, self.kv = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model)
        self.proj = nn.Linear(d_model, out_width or d_model)  # a pooling head may project to another width

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape  # batch, tokens, width
        Q, d = self.latent.shape[1], C // self.num_heads  # queries of its own, head width
        q = self.q(self.latent.expand(B, -1, -1)).view(B, Q, self.num_heads, d).transpose(1, 2)  # (B, H, Q, d)
        k, v = self.kv(x).view(B, T, 2, self.num_heads, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) * (1.0 if self.bug == "unscaled" else 1 / math.sqrt(d))  # (B, H, Q, T)
        if key_padding_mask is not None and self.bug != "mask ignored":
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        weights = scores.softmax(-2 if self.bug == "softmax over the queries" else -1)
        if self.bug == "dropout in eval":
            weights = F.dropout(weights, 0.5, training=True)
        out = self.proj((weights @ v).transpose(1, 2).reshape(B, Q, C))  # (B, Q, out_width)
        return out[:, 0] if Q == 1 and self.squeeze else out


class MaskedPool(AttentionPool):
    """The same, its mask bool (B, 1, Q, T), True = may attend, one row per query of its own: undeclared, the audit's
    masks of one row per token do not fit it (it raises on them)."""

    def forward(self, x, mask=None):
        B, T, C = x.shape
        Q, d = self.latent.shape[1], C // self.num_heads
        q = self.q(self.latent.expand(B, -1, -1)).view(B, Q, self.num_heads, d).transpose(1, 2)  # (B, H, Q, d)
        k, v = self.kv(x).view(B, T, 2, self.num_heads, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, Q, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, Q, C))  # (B, Q, D)


class MHAPool(nn.Module):
    """The same with torch's nn.MultiheadAttention: its learned queries attend the tokens."""

    def __init__(self, queries: int = 1, squeeze: bool = True, bug: str | None = None):
        super().__init__()
        seed_rng(0)
        self.squeeze, self.bug = squeeze, bug
        self.latent = nn.Parameter(torch.randn(1, queries, D))
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        mask = None if self.bug == "mask ignored" else key_padding_mask
        out, _ = self.attn(self.latent.expand(x.shape[0], -1, -1), x, x, key_padding_mask=mask)  # (B, Q, D)
        return out[:, 0] if out.shape[1] == 1 and self.squeeze else out


class RowDropper(nn.Module):
    """Self-attention, one row per token, that loses its last row (`bug`): a shape bug whose row count moves with T;
    `bug="first"`: keeps only its first token's row (attends with a query per token, returns one: no queries of its
    own were observed, so no `queries=1` is suggested either)."""

    def __init__(self, bug: bool | str = False):
        super().__init__()
        seed_rng(0)
        self.d_model, self.num_heads, self.bug = D, HEADS, bug
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        out = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))  # (B, T, D)
        return out[:, :1] if self.bug == "first" else out[:, :-1] if self.bug else out


LAYERS = {  # name: (build(bug), queries)
    "hand-written, Q=1, (B, D)": (lambda bug=None: AttentionPool(1, bug=bug), 1),
    "hand-written, Q=1, (B, 1, D)": (lambda bug=None: AttentionPool(1, squeeze=False, bug=bug), 1),
    "hand-written, Q=4, (B, 4, D)": (lambda bug=None: AttentionPool(4, bug=bug), 4),
    "hand-written, Q=2, (B, 2, 48) projected": (lambda bug=None: AttentionPool(2, bug=bug, out_width=48), 2),
    "hand-written, Q=1, (B, 48) projected": (lambda bug=None: AttentionPool(1, bug=bug, out_width=48), 1),
    "hand-written, a (B, 1, Q, T) mask, Q=4": (lambda bug=None: MaskedPool(4, bug=bug), 4),
    "hand-written, a (B, 1, Q, T) mask, Q=1": (lambda bug=None: MaskedPool(1, bug=bug), 1),
    "nn.MultiheadAttention, Q=1, (B, D)": (lambda bug=None: MHAPool(1, bug=bug), 1),
    "nn.MultiheadAttention, Q=4, (B, 4, D)": (lambda bug=None: MHAPool(4, bug=bug), 4),
}
HAND_WRITTEN = [name for name in LAYERS if name.startswith("hand") and "mask," not in name]
BUGS = [("unscaled", "softmax_saturation"), ("softmax over the queries", "weight_row_sums"),
        ("dropout in eval", "eval_determinism"), ("mask ignored", "mask_honoured")]


# ---- declared: the correct layers pass, the bugs fail ----------------------------------------------------------

@pytest.mark.parametrize("name", LAYERS)
def test_a_correct_pooling_layer_passes_with_its_queries_declared(name):
    build, queries = LAYERS[name]
    report = diagnostics.audit(build().eval(), queries=queries, progress=False)
    assert report.status == "passed", report
    assert report.result("output_shape").verdict == "pass", report.result("output_shape")
    for det in ("weight_row_sums", "softmax_saturation", "mask_honoured", "batch_independence", "eval_determinism"):
        assert report.result(det).verdict == "pass", report.result(det)  # measured on its Q rows, not skipped


@pytest.mark.parametrize("bug, detector", BUGS)
@pytest.mark.parametrize("name", HAND_WRITTEN)
def test_a_bug_in_a_pooling_layer_fails_with_its_queries_declared(name, bug, detector):
    """The twin of the test above: the same layer, the same inputs (the audit's seed), one step changed."""
    build, queries = LAYERS[name]
    report = diagnostics.audit(build(bug).eval(), queries=queries, progress=False)
    assert report.status == "failed" and detector in report.fired(), report
    assert report.result("output_shape").verdict == "pass", report


@given(queries=st.integers(1, 4), heads=st.sampled_from([1, 2, 4]), width=st.sampled_from([8, 16, 32]),
       seq_len=st.integers(4, 16), seed=st.integers(0, 2**16), squeeze=st.booleans())
def test_drawn_pooling_layers_pass_and_their_unscaled_twins_fail(queries, heads, width, seq_len, seed, squeeze):
    """Over drawn sizes and seeds: the correct layer passes, the same layer and inputs without 1/sqrt(d) fail."""
    kwargs = dict(d_model=width, num_heads=heads, seed=seed)
    correct = diagnostics.audit(AttentionPool(queries, squeeze, **kwargs).eval(), queries=queries, seq_len=seq_len,
                                seed=seed, progress=False)
    assert correct.status == "passed", correct
    buggy = diagnostics.audit(AttentionPool(queries, squeeze, "unscaled", **kwargs).eval(), queries=queries,
                              seq_len=seq_len, seed=seed, progress=False)
    assert buggy.status == "failed" and "softmax_saturation" in buggy.fired(), buggy


@pytest.mark.parametrize("bug, code", [("unscaled", "scores = q @ k.transpose"),
                                       ("softmax over the queries", "softmax("), ("dropout in eval", "F.dropout("),
                                       ("mask ignored", "softmax(")])
def test_a_pooling_layers_finding_points_at_its_line(bug, code):
    """The line of the layer's own forward where each bug's detector saw it (the ignored mask: the softmax, the first
    op the blocked keys reach)."""
    build, queries = LAYERS["hand-written, Q=4, (B, 4, D)"]
    report = diagnostics.audit(build(bug).eval(), queries=queries, progress=False)
    sites = list(report.result(dict(BUGS)[bug]).where or ())
    assert sites and sites[0].function == "AttentionPool.forward" and code in sites[0].code, sites


@pytest.mark.parametrize("name", [name for name in LAYERS if name.startswith("nn.")])
def test_an_ignored_key_padding_mask_fails_in_torchs_pooling_layer(name):
    build, queries = LAYERS[name]
    correct = diagnostics.audit(build().eval(), queries=queries, progress=False)
    buggy = diagnostics.audit(build("mask ignored").eval(), queries=queries, progress=False)
    assert correct.result("mask_honoured").verdict == "pass", correct
    assert buggy.status == "failed" and "mask_honoured" in buggy.fired(), buggy


@pytest.mark.parametrize("name, bug", [("hand-written, Q=1, (B, D)", bug) for bug in (None, "unscaled",
                                                                                       "softmax over the queries")]
                         + [("hand-written, Q=4, (B, 4, D)", bug) for bug in [None] + [bug for bug, _ in BUGS]]
                         + [("nn.MultiheadAttention, Q=4, (B, 4, D)", None)])
def test_pooling_layers_are_read_in_bfloat16_at_gpt2_initialisation(name, bug, std_002):
    """At the scales people train at: projections drawn with std 0.02, the layer in bfloat16; twins on the same
    inputs."""
    build, queries = LAYERS[name]
    layer = std_002(build(bug)).to(torch.bfloat16).eval()
    report = diagnostics.audit(layer, queries=queries, progress=False)
    if bug is None:
        assert report.status == "passed", report
    else:
        assert report.status == "failed" and dict(BUGS)[bug] in report.fired(), report


def test_a_pooling_layer_given_no_key_at_all_warns_as_a_query_with_no_key_does():
    report = diagnostics.audit(AttentionPool(4).eval(), queries=4, progress=False)
    found = report.result("fully_masked_rows")
    assert found.verdict == "warn" and "sequence 0's every query" in found.evidence, found


# ---- undeclared: needs a declaration, never FAILED; a shape bug still fails ------------------------------------

@pytest.mark.parametrize("name", LAYERS)
def test_an_undeclared_pooling_layer_needs_the_declaration_naming_its_queries(name):
    build, queries = LAYERS[name]
    report = diagnostics.audit(build().eval(), progress=False)
    assert report.status == "inconclusive" and not report.fired(), report
    assert report.declaration == f"queries={queries}", report
    assert report.headline.startswith(f"INCONCLUSIVE (needs a declaration: queries={queries})"), report.headline
    shape = report.result("output_shape")
    assert shape.declaration == f"queries={queries}", shape
    one_vector = "(B, D)" in name or "(B, 48)" in name
    rows = "(B, D), one vector" if one_vector else f"{queries} row{'s' if queries > 1 else ''}"
    assert f"the output is {rows} per sequence" in shape.message, shape
    if name.startswith("hand-written, a (B, 1, Q, T) mask"):  # raised on the audit's masks: a declaration, no FAIL
        runs = report.result("runs")
        assert runs.declaration == f"queries={queries}" and f"has {rows} per sequence" in runs.message, runs


class ShortRefused(MaskedPool):
    """The same, refusing a single token (a raise without a mask): `runs` fails, as a raise without a mask is no
    convention mismatch, and names no declaration for it."""

    def forward(self, x, mask=None):
        if x.shape[1] == 1:
            raise ValueError("expected at least 2 tokens")
        return super().forward(x, mask)


@pytest.mark.parametrize("layer, verdict", [(MaskedPool(4), "skip"), (ShortRefused(4), "fail")],
                         ids=["raises on token masks only", "raises at T=1 too"])
def test_runs_names_queries_only_where_the_layer_raised_on_masks_alone(layer, verdict):
    runs = diagnostics.audit(layer.eval(), progress=False).result("runs")
    assert runs.verdict == verdict and bool(runs.declaration) == (verdict == "skip"), runs


class MaskRaises(nn.Module):
    """Self-attention, one row per token, whose mask handling raises (`bug`): a real failure, no queries of its own."""

    def __init__(self, bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.d_model, self.num_heads, self.bug = D, HEADS, bug
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mask=None):  # mask: bool (B, 1, T, T), True = may attend
        B, T, C = x.shape
        if mask is not None and self.bug:
            mask = mask[..., :-1]  # the last key's column lost: raises in SDPA's broadcast
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("bug, status", [(False, "passed"), (True, "failed")])
def test_a_layer_that_raises_on_its_masks_is_not_told_to_declare_queries(bug, status):
    report = diagnostics.audit(MaskRaises(bug).eval(), progress=False)
    assert report.status == status and "queries" not in report.declaration, report
    assert report.result("runs").verdict == ("fail" if bug else "pass"), report.result("runs")


@pytest.mark.parametrize("bug, detector", BUGS)
def test_the_declaration_suggested_for_a_buggy_pooling_layer_never_makes_it_pass(bug, detector):
    """The buggy layer, undeclared, is suggested the same declaration as the correct one; under it the bug fails."""
    build, queries = LAYERS["hand-written, Q=4, (B, 4, D)"]
    suggested = diagnostics.audit(build(bug).eval(), progress=False).declaration
    assert suggested == f"queries={queries}"
    report = diagnostics.audit(build(bug).eval(), queries=queries, progress=False)
    assert report.status == "failed" and detector in report.fired(), report


@pytest.mark.parametrize("bug, status", [(False, "passed"), (True, "failed"), ("first", "failed")])
def test_a_layer_whose_rows_move_with_the_length_fails_output_shape_with_no_declaration_suggested(bug, status):
    """Twins: a self-attention that drops its last row returns T - 1 rows at every T: a shape bug, not queries of its
    own, so no `queries=` is suggested (under which it would pass output_shape)."""
    report = diagnostics.audit(RowDropper(bug).eval(), progress=False)
    assert report.status == status, report
    assert report.result("output_shape").verdict == ("fail" if bug else "pass"), report.result("output_shape")
    assert report.declaration == "", report


def test_undeclared_a_pooling_head_returning_one_vector_is_skipped_not_crashed():
    """(B, D) has no row axis: the detectors that compare rows say so (they crashed on it before)."""
    report = diagnostics.audit(MHAPool(1).eval(), progress=False)
    for det in ("batch_independence", "eval_determinism"):
        found = report.result(det)
        assert found.verdict == "skip" and "declare queries=1" in found.message, found


# ---- bad input: a clear error --------------------------------------------------------------------------------

@pytest.mark.parametrize("layer, kwargs, words", [
    (AttentionPool(), {"queries": 0}, "expected queries an int >= 1"),
    (AttentionPool(), {"queries": "4"}, "expected queries an int >= 1"),
    (AttentionPool(), {"queries": True}, "expected queries an int >= 1"),
    (AttentionPool(), {"queries": 1, "causal": True}, "expected queries or causal, not both"),
    (AttentionPool(), {"queries": 1, "cross": True}, "expected queries or cross, not both"),
    (lambda q, k, v, mask=None: F.scaled_dot_product_attention(q, k, v), {"queries": 1},
     "expected queries=Q for a module given one stream"),
    (nn.MultiheadAttention(D, HEADS, batch_first=True), {"queries": 1},
     "expected queries=Q for a module given one stream"),
])
def test_a_misused_queries_declaration_is_a_clear_usage_error(layer, kwargs, words):
    with pytest.raises(AuditUsageError, match="Fix: ") as error:
        diagnostics.audit(layer, progress=False, **kwargs)
    assert str(error.value).startswith(words), error.value


# ---- every front end takes it --------------------------------------------------------------------------------

POOL_SOURCE = '''
import math
import torch
from torch import nn


class Pool(nn.Module):
    def __init__(self, queries=4):
        super().__init__()
        self.latent = nn.Parameter(torch.randn(1, queries, 32))
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.attn(self.latent.expand(x.shape[0], -1, -1), x, x)[0]  # (B, Q, D)


pool = Pool()
'''


@pytest.fixture
def pool_module(tmp_path, monkeypatch):
    (tmp_path / "poolmod.py").write_text(POOL_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "poolmod", raising=False)
    yield
    sys.modules.pop("poolmod", None)


def test_the_command_line_takes_queries(pool_module, capsys):
    assert _cli.main(["poolmod:pool"]) == _cli.EXIT_INCONCLUSIVE
    assert "needs a declaration: --queries 4" in capsys.readouterr().out
    assert _cli.main(["poolmod:pool", "--queries", "4"]) == _cli.EXIT_PASSED
    assert _cli.main(["poolmod:pool --queries 4"]) == _cli.EXIT_USAGE  # one shell word: not a target


def test_the_plugin_takes_queries_as_an_option_and_on_a_marker(pytester):
    pytester.makepyfile(poolmod=POOL_SOURCE, test_pool='''
        import pytest
        import poolmod

        @pytest.mark.attention_audit(queries=4)
        def test_declared(attention_audit):
            assert attention_audit(poolmod.Pool()).status == "passed"

        def test_undeclared(attention_audit):  # the twin: inconclusive, naming the declaration
            attention_audit(poolmod.Pool())
    ''')
    plugin = ("-p", "diagnostics.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:xdist")
    result = pytester.runpytest(*plugin, "test_pool.py")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 1 and outcomes.get("failed", 0) + outcomes.get("skipped", 0) == 1, result.stdout
    result.stdout.fnmatch_lines(["*needs a declaration*queries=4*"])
    declared = pytester.runpytest(*plugin, "--ignore=test_pool.py", "--attention-audit=poolmod:pool",
                                  "--attention-queries=4")
    assert declared.ret == pytest.ExitCode.OK, declared.stdout
    own = pytester.runpytest(*plugin, "--ignore=test_pool.py", "--attention-audit=poolmod:pool --queries 4")
    assert own.ret == pytest.ExitCode.OK, own.stdout


# ---- own_weights reads a head count named `heads` (issue 34) -------------------------------------------------

class HeadsAttention(nn.Module):
    """lucidrains' way of keeping its sizes: `self.heads`, no `num_heads`; a fused qkv and an output projection.
    `merge_bug`: the heads merged without moving them next to their width (a bug every black-box property keeps)."""

    def __init__(self, merge_bug: bool = False):
        super().__init__()
        seed_rng(0)
        self.heads, self.merge_bug = HEADS, merge_bug
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, d)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, d)
        merged = out.reshape(B, T, C) if self.merge_bug else out.transpose(1, 2).reshape(B, T, C)  # (B, T, D)
        return self.proj(merged)


@pytest.mark.parametrize("merge_bug, verdict", [(False, "pass"), (True, "fail")])
def test_own_weights_reads_the_head_count_a_layer_keeps_as_heads(merge_bug, verdict):
    report = diagnostics.audit(HeadsAttention(merge_bug).eval(), progress=False)
    found = report.result("own_weights")
    assert found.verdict == verdict, found
    if merge_bug:
        assert "merged" in found.message + found.evidence, found


class FirstToken(nn.Module):
    """Not attention: the first token's row, (B, 1, D) at every length. No attention of one query was observed, so
    no `queries=1` is suggested: its output_shape fails as before."""

    d_model = D

    def forward(self, x):
        return x[:, :1]


def test_a_layer_that_attends_nothing_is_not_told_to_declare_queries():
    report = diagnostics.audit(FirstToken(), progress=False)
    assert report.result("output_shape").verdict == "fail" and report.declaration == "", report


# ---- pooling heads of the libraries (the real extra) -----------------------------------------------------------

def _timm_pool(latent_len: int, out_features: int | None = None):
    layers = pytest.importorskip("timm.layers", reason="timm is not installed (pip install -e '.[real]')")
    seed_rng(0)
    return layers.AttentionPoolLatent(D, out_features=out_features, num_heads=HEADS, latent_len=latent_len,
                                      pool_type="token" if latent_len == 1 else "").eval()


def _timm_pool_projected(latent_len: int):
    return _timm_pool(latent_len, out_features=2 * D)


def _siglip_head(latent_len: int):
    siglip = pytest.importorskip("transformers.models.siglip.modeling_siglip",
                                 reason="transformers is not installed (pip install -e '.[real]')")
    seed_rng(0)
    config = siglip.SiglipVisionConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=2 * D)
    return siglip.SiglipMultiheadAttentionPoolingHead(config).eval()


@pytest.mark.parametrize("build, queries", [(_timm_pool, 1), (_timm_pool, 4), (_timm_pool_projected, 1),
                                            (_siglip_head, 1)],
                         ids=["timm AttentionPoolLatent, (B, D)", "timm AttentionPoolLatent, latent_len=4",
                              "timm AttentionPoolLatent, out_features=2D, (B, 2D)",
                              "transformers SiglipMultiheadAttentionPoolingHead, (B, D)"])
def test_library_pooling_heads_need_their_queries_and_pass_with_them(build, queries):
    """Before queries=Q (824d172) each FAILED output_shape (timm's `runs` too: its (B, 1, T, T) masks do not fit)."""
    undeclared = diagnostics.audit(build(queries), progress=False)
    assert undeclared.status == "inconclusive" and undeclared.declaration == f"queries={queries}", undeclared
    report = diagnostics.audit(build(queries), queries=queries, progress=False)
    assert report.status == "passed", report


@pytest.mark.parametrize("scale, status", [(None, "passed"), (1.0, "failed")])
def test_a_missing_scale_injected_into_timms_pooling_head_fails(scale, status):
    """timm's unfused path (`q * self.scale`), the scale set to 1 (the twin keeps its own). That path adds its mask to
    the scores (additive), where the fused one passes a bool mask to SDPA: declared additive here."""
    layer = _timm_pool(4)
    layer.fused_attn = False
    if scale is not None:
        layer.scale = scale
    report = diagnostics.audit(layer, queries=4, mask="additive", progress=False)
    assert report.status == status, report
    if scale is not None:
        assert set(report.fired()) == {"softmax_saturation"}, report


@pytest.mark.parametrize("queries, verdict", [(4, "pass"), (2, "fail")])
def test_a_wrong_number_of_queries_declared_fails_output_shape_saying_so(queries, verdict):
    report = diagnostics.audit(AttentionPool(4).eval(), queries=queries, progress=False)
    found = report.result("output_shape")
    assert found.verdict == verdict, found
    if verdict == "fail":
        assert "expected (2, 2, 32)" in found.evidence and "as queries=2 declares" in found.fix, found


class StridedQueries(AttentionPool):
    """Queries pooled from the tokens by a stride of 2 (MViT's, Hiera's): ceil(T / 2) rows, a number that moves with
    T, so these are no queries of its own of a fixed number, and `queries=` is not suggested (under a fixed Q its
    other lengths would not fit)."""

    def forward(self, x, key_padding_mask=None):
        B, T, C = x.shape
        d = C // self.num_heads
        q = self.q(x[:, ::2]).view(B, -1, self.num_heads, d).transpose(1, 2)  # (B, H, ceil(T / 2), d)
        k, v = self.kv(x).view(B, T, 2, self.num_heads, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        weights = (q @ k.transpose(-2, -1) / math.sqrt(d)).softmax(-1)  # (B, H, ceil(T / 2), T)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, -1, C))  # (B, ceil(T / 2), D)


def test_queries_whose_number_moves_with_the_length_are_not_told_to_declare_queries():
    report = diagnostics.audit(StridedQueries(4).eval(), progress=False)
    assert "queries" not in report.declaration and not report.result("output_shape").declaration, report
