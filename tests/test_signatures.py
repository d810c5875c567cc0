"""`audit(layer)` reads a layer's forward by parameter names, never by their count, and takes its mask in the
convention declared (`mask=`) and a function's tensors in the layout declared (`layout=`).

Each signature below once got a confident wrong verdict (`runs FAIL`, "use .contiguous()") because its third
positional parameter was taken for the value. Each correct layer here audits clean; each broken twin, with
the same signature and the same declaration, still fails on the detector that its bug breaks.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from diagnostics import AuditUsageError, audit
from diagnostics._subject import make_subject, mask_convention_hint

pytest_plugins = ["pytester"]
D, H = 32, 4  # d_model, heads
CORE = ("runs", "output_shape", "finite_output", "softmax_saturation", "output_variance", "eval_determinism")


def assert_clean(report, *, measured=(), warns=()):
    __tracebackhide__ = True
    assert report.passed, str(report)
    assert set(report.fired()) <= set(warns), str(report)
    not_passed = {d: report.result(d).verdict for d in measured if report.result(d).verdict != "pass"}
    assert not not_passed, f"expected these detectors to measure and pass: {not_passed}\n{report}"


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) v on (B, H, T, d); `bias` additive, broadcast to (B, H, Tq, Tk)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if bias is not None:
        scores = scores + bias
    return scores.softmax(-1) @ v


def allowed_bias(allowed: Tensor | None) -> Tensor | None:
    """bool, True = may attend -> additive (0 / -inf)."""
    return None if allowed is None else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)


class Heads(nn.Module):
    """Projections and head split/merge shared by the layers below; `bias_of(kwargs)` reads the mask."""

    def __init__(self, d_model=D, num_heads=H):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def attend(self, x: Tensor, bias: Tensor | None, memory: Tensor | None = None) -> Tensor:
        B, T, D_ = x.shape  # batch, sequence length, d_model
        split = lambda t: t.view(B, t.shape[1], self.num_heads, D_ // self.num_heads).transpose(1, 2)  # noqa: E731
        w = self.qkv.weight.split(D_)
        b = self.qkv.bias.split(D_)
        memory = x if memory is None else memory
        q, k, v = (split(nn.functional.linear(t, wi, bi)) for t, wi, bi in zip((x, memory, memory), w, b))
        return self.out(attend(q, k, v, bias).transpose(1, 2).reshape(B, T, D_))  # (B, T, D)


# ---- signatures that were misread ------------------------------------------------------------------------


class HFStyle(Heads):
    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        assert head_mask is None and output_attentions is False  # left at their defaults
        return self.attend(hidden_states, allowed_bias(attention_mask))  # attention_mask: bool, True = may attend


class KVCache(Heads):
    def forward(self, x, mask=None, kv_cache=None, use_cache=False):
        assert kv_cache is None and use_cache is False
        return self.attend(x, allowed_bias(mask))


class WhisperLike(Heads):
    """A Whisper encoder attention: its second parameter is the optional cross-attention memory, its third
    a cache; the mask comes fourth."""

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None,
                output_attentions=False):
        assert past_key_value is None
        return self.attend(hidden_states, allowed_bias(attention_mask), memory=key_value_states), None


class NoMaskInDecoder(Heads):
    def forward(self, x, mask=None, kv_cache=None, use_cache=False):
        return self.attend(x, None)  # ignores its mask: the broken twin of KVCache


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("cls", [HFStyle, KVCache, WhisperLike])
def test_signatures_read_by_name_audit_clean(cls, causal):
    torch.manual_seed(0)
    report = audit(cls(), causal=causal)
    assert report.settings["form"] == "self_module" and report.settings["takes_mask"]
    assert_clean(report, measured=CORE + ("mask_honoured",) + (("future_leakage",) if causal else ()),
                 warns=("fully_masked_rows",))


def test_the_twin_that_ignores_its_mask_still_fails():
    torch.manual_seed(0)
    report = audit(NoMaskInDecoder(), causal=True)
    assert {"mask_honoured", "future_leakage"} <= set(report.fired()), str(report)
    assert report.result("runs").verdict == "pass"


def test_nn_transformer_decoder_layer_audits_as_a_whole():
    """tgt is the query stream, its mask tgt_mask in torch's convention (True = blocked, per head); memory is a
    fixed encoder output, unmasked, as in a real decoder."""
    torch.manual_seed(0)
    decoder = nn.TransformerDecoderLayer(D, H, dim_feedforward=64, batch_first=True)
    report = audit(decoder, causal=True)
    assert report.settings["form"] == "self_module" and report.result("runs").verdict == "pass"
    assert "memory: a fixed encoder output" in report.layer
    assert_clean(report, measured=CORE + ("mask_honoured", "future_leakage"), warns=("fully_masked_rows",))


class CrossAttendsTheTarget(nn.TransformerDecoderLayer):
    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal=False):
        return super()._mha_block(x, x, attn_mask, key_padding_mask, is_causal)  # BUG: the target, not the memory


def test_a_decoder_layer_whose_cross_attention_reads_the_target_leaks_the_future():
    """Its cross-attention, unmasked as a memory's is, attends the target instead: later tokens leak. (With the
    memory the same stream as the target and masked causally like it, as audits did before, it passed.)"""
    torch.manual_seed(0)
    broken = CrossAttendsTheTarget(D, H, dim_feedforward=64, batch_first=True)
    assert audit(broken, causal=True).result("future_leakage").verdict == "fail"
    correct = nn.TransformerDecoderLayer(D, H, dim_feedforward=64, batch_first=True)
    correct.load_state_dict(broken.state_dict())  # the twin: the same weights
    assert audit(correct, causal=True).result("future_leakage").verdict == "pass"


def test_nn_transformer_encoder_layer_audits_as_a_whole():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(D, H, dim_feedforward=64, batch_first=True)
    report = audit(encoder, causal=True)  # the causal mask goes to src_mask
    assert_clean(report, measured=CORE + ("mask_honoured", "future_leakage"), warns=("fully_masked_rows",))
    assert "d_model=32 from its self_attn's `embed_dim`, num_heads=4 from its self_attn's `num_heads`" in report.layer


def test_decoder_layer_without_its_mask_leaks():
    """The twin: the same decoder layer, called without masks (wrapped so it takes none), leaks."""

    class Unmasked(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder, self.d_model, self.num_heads = nn.TransformerDecoderLayer(D, H, 64, batch_first=True), D, H

        def forward(self, x):
            return self.decoder(x, x)

    torch.manual_seed(0)
    assert audit(Unmasked(), causal=True).result("future_leakage").verdict == "fail"


class NeedsPositions(Heads):
    def forward(self, x, rel_pos, mask=None):
        return self.attend(x, allowed_bias(mask))


def test_an_unknown_required_parameter_the_layer_never_reads_names_no_call():
    # `rel_pos` is required and of a name the audit does not know: given a memory there the layer runs, and its
    # output does not depend on it. The same stream again would pass this layer, and a cross-attention whose keys and
    # values come from x too, so no call is named: both are in the fix. A function's unknown parameter stays misuse.
    report = audit(NeedsPositions())
    runs = report.result("runs")
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    assert "its output does not depend on `rel_pos`" in runs.message, runs.message
    assert "call=lambda layer, x, mask: layer(x, rel_pos=x, mask=mask) if `rel_pos` is the same stream" in runs.fix
    assert "call=lambda layer, x, memory, mask: layer(x, rel_pos=memory, mask=mask) with cross=True" in runs.fix

    def fn(q, k, v, bias, mask=None):
        return attend(q, k, v, None)

    with pytest.raises(AuditUsageError, match=r"got `bias` with no default\. Fix: wrap it"):
        audit(fn)


# ---- declared mask conventions ---------------------------------------------------------------------------


class AdditiveMask(Heads):
    def forward(self, x, attention_mask=None):  # 0 keep, -inf (or finfo.min) block, added to the scores
        return self.attend(x, None if attention_mask is None else attention_mask.float())


class AdditiveInverted(Heads):
    def forward(self, x, attention_mask=None):  # reads 0 as "block": the inverted twin
        return self.attend(x, None if attention_mask is None else
                           torch.zeros(attention_mask.shape).masked_fill(attention_mask == 0, -math.inf))


class KeyPadding(Heads):
    def forward(self, x, key_padding_mask=None):  # (B, Tk) bool, True = padding
        bias = None if key_padding_mask is None else allowed_bias(~key_padding_mask[:, None, None, :])
        return self.attend(x, bias)


class KeyPaddingInverted(Heads):
    def forward(self, x, key_padding_mask=None):  # reads True as "keep": the inverted twin
        bias = None if key_padding_mask is None else allowed_bias(key_padding_mask[:, None, None, :])
        return self.attend(x, bias)


@pytest.mark.parametrize("correct, broken, convention", [
    (AdditiveMask, AdditiveInverted, "additive"),
    (KeyPadding, KeyPaddingInverted, "key_padding"),
], ids=["additive", "key_padding"])
def test_a_declared_convention_passes_the_correct_layer_and_not_its_inverted_twin(correct, broken, convention):
    torch.manual_seed(0)
    report = audit(correct(), mask=convention)
    assert_clean(report, measured=CORE + ("mask_honoured",), warns=("fully_masked_rows",))  # -inf: NaN on an empty row
    assert f": {convention}" in report.layer
    torch.manual_seed(0)
    assert "mask_honoured" in audit(broken(), mask=convention).fired()


class AddsMaskUnderAGenericName(Heads):
    def forward(self, x, mask=None):  # additive, though nothing in its signature says so
        return self.attend(x, None if mask is None else mask.float())


class BlocksWhereAllowed(Heads):
    def forward(self, x, mask=None):  # True blocks: nn.MultiheadAttention's convention, or an inverted polarity
        return self.attend(x, None if mask is None else allowed_bias(~mask))


def test_a_layer_that_adds_its_bool_mask_or_blocks_where_true_needs_a_declaration_that_says_both_readings():
    """Nothing in `mask`'s signature says a convention; the behaviour suggests one. A layer that adds its mask (the bool
    mask and the same mask as 0./1. floats give the same output) is right for additive masks and wrong for bool ones;
    one that blocks where the mask is True is right for nn.MultiheadAttention's convention and inverted for SDPA's. The
    audit cannot tell which is meant, so neither FAILs: each needs a declaration (inconclusive), its message saying
    both readings. The twins, on the same layers: declared as its behaviour reads, each passes; declared as the audit's
    default, True = may attend, each fails (the bug, once the author has said what is meant)."""
    for layer, honoured, said in ((AddsMaskUnderAGenericName, "additive", "adding them is the bug"),
                                  (BlocksWhereAllowed, "blocked", "its mask's polarity is inverted")):
        torch.manual_seed(0)
        report = audit(layer())
        found = report.result("mask_honoured")
        assert (report.status, report.declaration) == ("inconclusive", f"mask={honoured!r}"), str(report)
        assert found.verdict == "skip" and found.message.startswith(f"needs a declaration, mask={honoured!r}: "), found
        assert f"audit with mask={honoured!r}" in found.message and said in found.message, found.message
        assert found.extras["mask_convention"] == honoured  # as data: the audit's other mask findings read it
        torch.manual_seed(0)
        assert "mask_honoured" not in audit(layer(), mask=honoured).fired()
        torch.manual_seed(0)
        assert audit(layer(), mask="allowed").result("mask_honoured").verdict == "fail"
    torch.manual_seed(0)
    adds = audit(AddsMaskUnderAGenericName()).result("mask_honoured")
    assert "the layer adds its mask to the scores" in adds.message, adds  # the behaviour named, as the reason
    torch.manual_seed(0)
    assert "adds its mask" not in audit(BlocksWhereAllowed()).result("mask_honoured").message


class TakesFloatMasksOnly(Heads):
    def forward(self, x, attention_mask=None):  # additive, and says so by raising on any other dtype
        if attention_mask is not None and not attention_mask.is_floating_point():
            raise TypeError(f"attention_mask must be a float additive mask, got {attention_mask.dtype}")
        return self.attend(x, attention_mask)


class RaisesOnAnyMask(Heads):
    def forward(self, x, attention_mask=None):  # a mask parameter it cannot take in any convention
        if attention_mask is not None:
            raise ValueError("this layer takes no mask")
        return self.attend(x, None)


def test_at_one_token_a_layer_that_runs_only_in_another_convention_needs_its_declaration():
    """runs' convention mismatch at seq_len 1, where no key can be blocked and honouring cannot be read: a layer that
    raises on the audit's bool mask and runs given it as additive floats is no defect there either (it FAILed `runs`
    before), but a skip that names mask='additive' and says that seq_len >= 2 measures it; with that declaration the
    audit passes. Its twin, a layer that raises given its mask in every convention, still fails `runs`."""
    torch.manual_seed(0)
    report = audit(TakesFloatMasksOnly(), seq_len=1)
    found = report.result("runs")
    assert (report.status, report.declaration) == ("inconclusive", "mask='additive'"), str(report)
    assert found.verdict == "skip" and found.message.startswith("needs a declaration, mask='additive': "), found
    assert "At one token no key can be blocked" in found.message and "seq_len >= 2" in found.message, found.message
    assert found.extras["mask_convention"] == "additive"
    torch.manual_seed(0)
    assert audit(TakesFloatMasksOnly(), seq_len=1, mask="additive").status == "passed"
    torch.manual_seed(0)
    assert audit(RaisesOnAnyMask(), seq_len=1).result("runs").verdict == "fail"


def test_undeclared_the_mask_finding_comes_with_the_convention_to_declare():
    """Undeclared, the correct additive layer is given bool (B, 1, Tq, Tk) masks: the audit reports it
    (mask_honoured), and the hint, read from the parameter's name (not from what the layer did), names the
    convention to declare. A parameter named `key_padding_mask` states its convention, torch's (B, Tk), True =
    padding: the audit gives it that, and the layer passes with no declaration; the hint then says what was read,
    and what to declare if the layer reads it otherwise."""
    torch.manual_seed(0)
    report = audit(AdditiveMask())
    assert (report.status, report.declaration) == ("inconclusive", "mask='additive'"), str(report)
    hint = mask_convention_hint(make_subject(AdditiveMask()))
    assert 'audit with mask=\'additive\'' in hint and "attention_mask" in hint
    torch.manual_seed(0)
    assert_clean(audit(KeyPadding()), measured=CORE + ("mask_honoured",), warns=("fully_masked_rows",))
    hint = mask_convention_hint(make_subject(KeyPadding()), options={"mask": "--mask"})
    assert "the audit gave `key_padding_mask` as key_padding" in hint and "--mask key_keep" in hint
    torch.manual_seed(0)
    assert "mask_honoured" in audit(KeyPaddingInverted()).fired()  # recognised, never chosen: the inverted fails
    assert mask_convention_hint(make_subject(KeyPadding(), mask="key_padding")) is None  # declared
    assert mask_convention_hint(make_subject(KVCache())) is None  # `mask`: nothing suggests another


def test_key_padding_masks_that_differ_between_queries_reach_the_layer_one_query_at_a_time():
    """A causal audit of a key-padding layer: each query's row comes from a call whose padding mask is that
    query's row of the causal mask, so a correct layer is causal and its weights are per query."""
    torch.manual_seed(0)
    seen = []

    class Spy(KeyPadding):
        def forward(self, x, key_padding_mask=None):
            seen.append(None if key_padding_mask is None else tuple(key_padding_mask.shape))
            return super().forward(x, key_padding_mask)

    report = audit(Spy(), mask="key_padding", causal=True)
    assert_clean(report, measured=CORE + ("future_leakage", "causal_alignment", "mask_honoured", "weight_row_sums"),
                 warns=("fully_masked_rows",))
    assert (2 * 16, 16) in seen  # batch 2, 16 queries: one copy per query


# ---- declared layout -------------------------------------------------------------------------------------


def flash_layout(q, k, v, mask=None):  # (B, T, H, d), flash-attn's layout; mask bool (B, 1, Tq, Tk)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
    return attend(q, k, v, allowed_bias(mask)).transpose(1, 2)  # (B, T, H, d)


def flash_layout_no_mask(q, k, v, mask=None):  # the twin that ignores its (causal) mask
    return flash_layout(q, k, v)


def test_a_bthd_function_passes_once_its_layout_is_declared():
    report = audit(flash_layout, causal=True, layout="bthd")
    assert_clean(report, measured=CORE + ("future_leakage", "mask_honoured", "weight_row_sums"),
                 warns=("fully_masked_rows",))
    assert "layout=bthd" in report.layer
    report = audit(flash_layout_no_mask, causal=True, layout="bthd")
    assert {"future_leakage", "mask_honoured"} <= set(report.fired())


def test_layout_and_mask_are_checked():
    with pytest.raises(AuditUsageError, match="expected layout one of bhtd, bthd, btd, tbd; got layout='btdh'"):
        audit(flash_layout, layout="btdh")
    with pytest.raises(AuditUsageError, match="for a module, layout one of btd, tbd"):
        audit(KVCache(), layout="bthd")


# ---- library layers and sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(kdim=16, vdim=24), dict(add_bias_kv=True), dict(kdim=48, vdim=48)],
                         ids=["kdim_vdim", "add_bias_kv", "wider_kdim"])
def test_nn_multihead_attention_with_kdim_vdim_and_bias_kv(kw):
    torch.manual_seed(0)
    report = audit(nn.MultiheadAttention(D, H, batch_first=True, **kw), causal=True)
    # with add_bias_kv, output_variance cannot measure: the learned key makes outputs depend on the token count
    measured = tuple(d for d in CORE if d != "output_variance" or "add_bias_kv" not in kw)
    assert_clean(report, measured=measured + ("future_leakage", "mask_honoured"), warns=("fully_masked_rows",))


class TimmLike(nn.Module):
    """timm's Attention: num_heads and head_dim stored, the width only on its projections."""

    def __init__(self, dim=D, num_heads=H):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        B, T, C = x.shape  # batch, sequence length, width
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.proj(attend(q, k, v, allowed_bias(attn_mask)).transpose(1, 2).reshape(B, T, C))


def test_sizes_are_inferred_where_no_attribute_names_the_width():
    assert make_subject(TimmLike()).d_model == D  # num_heads * head_dim

    class Bare(TimmLike):  # no size attribute at all: the first projection's width, the heads from a trial call
        def __init__(self):
            super().__init__()
            self.heads_ = self.num_heads
            del self.num_heads

        def forward(self, x, attn_mask=None):
            self.num_heads = self.heads_
            return super().forward(x, attn_mask)

    subject = make_subject(Bare())
    assert subject.d_model == D and subject.num_heads == 4
    assert "num_heads=4 read from a trial call" in subject.describe()
    assert not hasattr(Bare(), "num_heads"), "the trial call's state is undone"

    class Flattened(nn.Module):  # bare weights, one softmax over (B, H*T, T) scores: no head axis to read
        def __init__(self):
            super().__init__()
            self.w_qkv, self.w_o = nn.Parameter(torch.randn(D, 3 * D) / 6), nn.Parameter(torch.randn(D, D) / 6)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, 4, -1).transpose(1, 2) for t in (x @ self.w_qkv).split(D, -1))
            w = (q @ k.transpose(-2, -1) / (D // 4) ** 0.5).reshape(B, 4 * T, T).softmax(-1).view(B, 4, T, T)
            return (w @ v).transpose(1, 2).reshape(B, T, D) @ self.w_o

    subject = make_subject(Flattened())
    assert subject.d_model == D and "d_model=32 found by a trial call" in subject.describe()
    assert subject.num_heads == 1 and "num_heads=1 assumed" in subject.describe() and "num_heads=4" in subject.describe()
    assert_clean(audit(TimmLike(), causal=True), measured=CORE + ("future_leakage",), warns=("fully_masked_rows",))


# ---- the same declarations from the command line and the pytest plugin ------------------------------------

FLASH_MODULE = '''
import math
import torch


def flash(q, k, v, mask=None):  # (B, T, H, d); mask additive, (B, 1, Tq, Tk)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)
'''


def test_cli_takes_mask_and_layout(tmp_path, monkeypatch, capsys):
    from diagnostics import _cli

    (tmp_path / "flashmod.py").write_text(FLASH_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cli.main(["flashmod:flash", "--causal", "--layout", "bthd", "--mask", "additive"]) == 0
    assert "layout=bthd" in capsys.readouterr().out
    assert _cli.main(["flashmod:flash", "--causal", "--mask", "additive"]) == 1  # (B, H, T, d) assumed: wrong
    capsys.readouterr()
    # a bool mask added, undeclared: right for additive masks, wrong for bool ones: a declaration is needed (exit 3)
    assert _cli.main(["flashmod:flash", "--causal", "--layout", "bthd"]) == 3
    assert "INCONCLUSIVE (needs a declaration: --mask additive)" in capsys.readouterr().out


def test_plugin_takes_mask_and_layout(pytester):
    pytester.makepyfile(flashmod=FLASH_MODULE)
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    pytester.syspathinsert()
    args = ["-p", "diagnostics.pytest_plugin", "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:randomly",
            "--attention-audit=flashmod:flash", "--attention-causal"]
    result = pytester.runpytest(*args, "--attention-layout=bthd", "--attention-mask-convention=additive")
    assert result.ret == 0, result.stdout.str()
    assert pytester.runpytest(*args).ret == 1  # undeclared: findings


class _SizedBy(nn.Module):
    """A correct self-attention whose sizes are stated in one of the ways the audit reads (issue 18, item 9)."""

    def __init__(self, how: str, d_model: int = 32, num_heads: int = 4):
        super().__init__()
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.h = num_heads
        if how == "attributes":
            self.embed_dim, self.num_heads = d_model, num_heads
        elif how == "heads and head width":
            self.n_head, self.head_dim = num_heads, d_model // num_heads
        elif how == "config":
            self.config = type("Config", (), {"hidden_size": d_model, "num_attention_heads": num_heads})()

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("how, first_line", [
    ("attributes", "d_model=32 from its `embed_dim`, num_heads=4 from its `num_heads`"),
    ("heads and head width", "d_model=32 from num_heads x `head_dim`, num_heads=4 from its `n_head`"),
    ("config", "d_model=32 from its config's `hidden_size`, num_heads=4 from its config's `num_attention_heads`"),
    ("nothing", "d_model=32 from its first projection's in_features, num_heads=4 read from a trial call"),
])
def test_the_reports_first_line_says_how_each_size_was_read(how, first_line):
    report = audit(_SizedBy(how), detectors=["runs", "output_shape"])
    assert first_line in str(report).splitlines()[0], str(report).splitlines()[0]
    # declared sizes are said plainly, with no source: the user knows where they came from
    declared = audit(_SizedBy(how), d_model=32, num_heads=4, detectors=["runs", "output_shape"])
    assert "(a module given one stream, d_model=32, num_heads=4)" in str(declared).splitlines()[0], str(declared).splitlines()[0]


class PrefixedStreams(nn.Module):
    """q, k and v each from a stream of its own, named xq, xk, xv (vit-pytorch's dense cross-layer attention, Llama's
    reference code): `scaled=False` the twin with q·k unscaled."""

    def __init__(self, scaled: bool = True):
        super().__init__()
        self.scale = (32 // 4) ** -0.5 if scaled else 1.0
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, xq, xk, xv):
        B, T, _ = xq.shape
        q, k, v = (f(x).view(B, x.shape[1], 4, 8).transpose(1, 2) for f, x in
                   ((self.to_q, xq), (self.to_k, xk), (self.to_v, xv)))
        out = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1) @ v
        return self.to_out(out.transpose(1, 2).reshape(B, T, 32))


def test_streams_named_xq_xk_xv_are_query_key_and_value():
    """Before: xk was a stream of no known name, and every probe raised (inconclusive: nothing measured)."""
    torch.manual_seed(0)
    correct = audit(PrefixedStreams(), progress=False)
    assert "a module given query, key and value" in str(correct) and correct.passed, correct
    torch.manual_seed(0)
    assert audit(PrefixedStreams(scaled=False), progress=False).result("softmax_saturation").verdict == "fail"
