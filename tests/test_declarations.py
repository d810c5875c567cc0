"""What a layer declares, or states itself, and the audit cannot know: its mask's convention, its weights, whether it
is self-attention only, how it is called (issue 17, classes 1, 3, 6 and 7).

Each layer below is written in the style of real code that the audit once got wrong. Each correct one passes with
no argument or with the one declaration its report names (both are tested: the report names it, and with it the
layer passes); each broken twin, with the same declaration, still fails. A convention is never chosen from what a
layer does with its mask: what it does is a hint in the finding, and an inverted mask still fails.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from diagnostics import AuditUsageError, MaskConvention, audit
from diagnostics._declarations import declarations_table
from diagnostics._masks import SHORTCUTS, convert_mask, mask_convention, stated_in_text
from diagnostics._subject import make_subject

D, H = 32, 4  # d_model, heads
CORE = ("runs", "output_shape", "finite_output", "softmax_saturation", "output_variance", "eval_determinism")


def assert_clean(report, *, measured=(), warns=("fully_masked_rows",)):
    __tracebackhide__ = True
    assert report.passed, str(report)
    assert set(report.fired()) <= set(warns), str(report)
    not_passed = {d: report.result(d).verdict for d in measured if report.result(d).verdict != "pass"}
    assert not not_passed, f"expected these detectors to measure and pass: {not_passed}\n{report}"


class Heads(nn.Module):
    """Projections, head split and merge; `scores(x, memory)` gives (B, H, Tq, Tk) scaled scores."""

    def __init__(self, d_model=D, num_heads=H):
        super().__init__()
        self.d_model, self.num_heads = d_model, num_heads
        self.q, self.kv, self.out = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model), nn.Linear(d_model, d_model)

    def split(self, t: Tensor) -> Tensor:
        B, T, _ = t.shape  # batch, length, width
        return t.view(B, T, self.num_heads, -1).transpose(1, 2)  # (B, H, T, d)

    def project(self, x: Tensor, memory: Tensor | None = None):
        memory = x if memory is None else memory
        k, v = self.kv(memory).chunk(2, dim=-1)
        return self.split(self.q(x)), self.split(k), self.split(v)  # (B, H, T, d) each

    def merge(self, weights: Tensor, v: Tensor) -> Tensor:
        B, _, T, _ = weights.shape
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, self.d_model))  # (B, T, D)

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)


# ---- class 1: mask conventions the audit can be told -------------------------------------------------------------


def test_the_spelling_parses_shortcuts_and_meaning_shape_pairs_and_refuses_the_rest():
    assert mask_convention("additive:B,Tq,Tk") == MaskConvention("additive", "B,Tq,Tk")
    assert mask_convention("additive:(B, Tq, Tk)") == MaskConvention("additive", "B,Tq,Tk")
    assert mask_convention("key_keep") == MaskConvention("allowed", "B,Tk") and str(SHORTCUTS["key_keep"]) == "key_keep"
    assert str(MaskConvention("blocked", "B*H,Tq,Tk")) == "mha_blocked"
    assert str(MaskConvention("additive", "Tq,Tk")) == "additive:Tq,Tk"
    with pytest.raises(AuditUsageError, match=r"got mask='additive:B,T'\. Fix: e\.g\. \"additive:B,Tq,Tk\""):
        audit(lambda q, k, v, mask=None: q, mask="additive:B,T")
    with pytest.raises(AuditUsageError, match=r"expected a mask convention from the shortcuts allowed, blocked"):
        mask_convention("inverted")
    with pytest.raises(AuditUsageError, match=r"expected a MaskConvention with meaning in allowed, blocked, additive"):
        MaskConvention("inverted")


def test_one_conversion_gives_every_shape_and_meaning():
    allowed = torch.tensor([[[True, False], [True, True]], [[True, False], [True, True]]])  # (B=2, Tq, Tk)
    assert convert_mask(allowed, "additive:B,Tq,Tk").shape == (2, 2, 2)
    assert torch.equal(convert_mask(allowed, "blocked:Tq,Tk"), ~allowed[0])
    assert convert_mask(allowed, "mha_blocked", num_heads=3).shape == (6, 2, 2)
    padding = allowed[:, :1].expand(2, 2, 2)  # the same row for every query
    assert torch.equal(convert_mask(padding, "key_keep"), allowed[:, 0])
    with pytest.raises(AuditUsageError, match="differs between queries"):
        convert_mask(allowed, "key_padding")


class KeyKeep(Heads):
    def forward(self, x, mask=None):  # einops-style: (B, Tk), True = keep; a comment, which nothing reads
        q, k, v = self.project(x)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))  # (B, 1, 1, Tk)
        return self.merge(scores.softmax(-1), v)


class KeyKeepIgnored(KeyKeep):
    def forward(self, x, mask=None):
        return super().forward(x)  # BUG: the mask never reaches the scores


class AddsPerQueryMask(Heads):
    """A `baddbmm`-based processor: an additive (B, Tq, Tk) mask, repeated per head and added by baddbmm."""

    def forward(self, x, attention_mask=None):
        q, k, v = self.project(x)
        B, Hh, T, d = q.shape
        q, k = q.reshape(B * Hh, T, d), k.reshape(B * Hh, -1, d)  # (B*H, T, d)
        bias = (torch.zeros(B * Hh, T, k.shape[1], dtype=q.dtype) if attention_mask is None
                else attention_mask.repeat_interleave(Hh, dim=0))  # (B*H, Tq, Tk)
        scores = torch.baddbmm(bias, q, k.transpose(-2, -1), beta=1.0, alpha=1 / math.sqrt(d))
        return self.merge(scores.softmax(-1).view(B, Hh, T, -1), v)


class SubtractsPerQueryMask(AddsPerQueryMask):
    def forward(self, x, attention_mask=None):
        return super().forward(x, None if attention_mask is None else -attention_mask)  # BUG: the sign


class BlockedBool(Heads):
    def forward(self, x, mask=None):
        q, k, v = self.project(x)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))  # True = blocked, though nothing says so
        return self.merge(scores.softmax(-1), v)


class BlockedBoolAfterSoftmax(BlockedBool):
    def forward(self, x, mask=None):
        q, k, v = self.project(x)
        weights = self.scores(q, k).softmax(-1)
        if mask is not None:
            weights = weights.masked_fill(mask, 0.0)  # BUG: after the softmax
        return self.merge(weights, v)


class TqTkMask(Heads):
    """One additive (Tq, Tk) mask for the whole batch, viewed to (1, 1, Tq, Tk)."""

    def forward(self, x, mask=None):
        q, k, v = self.project(x)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores + mask.view(1, 1, *mask.shape[-2:])
        return self.merge(scores.softmax(-1), v)


class TqTkMaskIgnored(TqTkMask):
    def forward(self, x, mask=None):
        return super().forward(x, None if mask is None else torch.zeros_like(mask))  # BUG: the mask is dropped


CONVENTIONS = [  # (correct layer, its broken twin, the declaration its report names)
    (KeyKeep, KeyKeepIgnored, "key_keep"),
    (AddsPerQueryMask, SubtractsPerQueryMask, "additive:B,Tq,Tk"),
    (BlockedBool, BlockedBoolAfterSoftmax, "blocked"),
    (TqTkMask, TqTkMaskIgnored, "additive:Tq,Tk"),
]


@pytest.mark.parametrize("correct, broken, declared", CONVENTIONS, ids=[c[2] for c in CONVENTIONS])
def test_undeclared_the_report_names_the_convention_and_with_it_the_layer_passes(correct, broken, declared):
    torch.manual_seed(0)
    report = audit(correct())
    assert not report.passed, str(report)
    # a layer that raises on the audit's mask and honours it as declared needs that declaration (inconclusive, never
    # FAILED); one that runs with the audit's mask and misapplies it fails, with the convention as a hint
    named = " ".join(r.fix for r in report.results if r.fired)
    assert report.declaration == f"mask={declared!r}" or f"audit with mask={declared!r}" in named, str(report)
    assert (report.status == "inconclusive") == bool(report.declaration), str(report)
    torch.manual_seed(0)
    assert_clean(audit(correct(), mask=declared), measured=CORE + ("mask_honoured",))
    torch.manual_seed(0)
    assert "mask_honoured" in audit(broken(), mask=declared).fired()


def test_declaring_the_opposite_meaning_inverts_the_mask_and_fails():
    """Never chosen from behaviour: a key-keep mask declared as key padding is inverted, and fails."""
    torch.manual_seed(0)
    assert "mask_honoured" in audit(KeyKeep(), mask="key_padding").fired()


class BlocksWhereAllowed(Heads):
    def forward(self, x, mask=None):
        """`mask`: bool (B, 1, Tq, Tk), True = may attend."""
        q, k, v = self.project(x)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))  # BUG: the polarity inverted
        return self.merge(scores.softmax(-1), v)


def test_an_inverted_mask_still_fails_and_the_hint_says_so_where_the_layer_states_its_convention():
    """The same code as BlockedBool, but its docstring states True = may attend: the audit gives it that, the
    finding stands, and the hint says that the layer's statement and its behaviour disagree."""
    torch.manual_seed(0)
    result = audit(BlocksWhereAllowed()).result("mask_honoured")
    assert result.verdict == "fail"
    assert "yet the layer states allowed" in result.fix and "misreads its own mask" in result.fix
    torch.manual_seed(0)
    assert "polarity is inverted" in audit(BlockedBool()).result("mask_honoured").fix  # unstated: both readings


class Documented(Heads):
    def forward(self, x, mask=None):
        """Attention over x.

        Args:
            x: (B, T, D) tokens.
            mask: (batch, seq_len) bool, True for positions to mask.
        """
        q, k, v = self.project(x)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        return self.merge(scores.softmax(-1), v)


class DocumentedInverted(Documented):
    def forward(self, x, mask=None):
        """mask: (batch, seq_len) bool, True for positions to mask."""
        return super().forward(x, None if mask is None else ~mask)  # BUG: reads True as keep


def test_a_convention_the_layer_states_in_its_docstring_is_recognised():
    torch.manual_seed(0)
    report = audit(Documented())
    assert "mask: key_padding (its docstring says 'True for positions to mask')" in report.layer
    assert_clean(report, measured=CORE + ("mask_honoured",))
    torch.manual_seed(0)
    broken = audit(DocumentedInverted()).result("mask_honoured")
    assert broken.verdict == "fail" and "mask='key_keep'" in broken.fix  # what to declare if the statement is wrong


def test_the_docstring_reader_reads_what_true_means_and_the_shape():
    assert stated_in_text("mask: bool (B, 1, T, T), True = may attend", "mask")[0] == SHORTCUTS["allowed"]
    assert stated_in_text("attn_mask: a True value indicates that the position is not allowed to attend.",
                          "attn_mask")[0] == SHORTCUTS["blocked"]
    assert stated_in_text("mask: additive (B, T, T), added to the attention scores", "mask")[0] == \
        MaskConvention("additive", "B,Tq,Tk")
    assert stated_in_text("mask: (b, n) True = keep", "mask")[0] == SHORTCUTS["key_keep"]
    assert stated_in_text("mask: 0 for positions to attend", "mask")[0] == SHORTCUTS["blocked"]  # False/0 read too
    assert stated_in_text("mask: a mask", "mask") is None  # states nothing
    assert stated_in_text("mask: True = keep, True = padding", "mask") is None  # contradicts itself


@pytest.mark.parametrize("text, meaning", [
    ("mask: True = keep (the decoder block's memory)", "allowed"),  # "block" a noun, after the word that says
    ("mask: True for keys that are not allowed", "blocked"),
    ("mask: True where attention is masked out", "blocked"),  # "attention" is not "attend"
    ("mask: True for positions that should not attend", "blocked"),
    ("mask: True means the token is valid and not padding", "allowed"),
    ("mask: True for padding tokens, which are ignored", "blocked"),
])
def test_the_first_word_that_says_what_true_means_decides(text, meaning):
    """Pins (`_meaning_of`): the earliest word of either kind decides, so a noun later in the clause (a transformer
    "block", "attention") does not turn a keep-mask into a blocking one; "not allowed" blocks. A keep-mask read as
    blocking made the audit name no convention for a layer that honours its mask as documented."""
    assert stated_in_text(text, "mask")[0].meaning == meaning


class WrapsMultiheadAttention(nn.Module):
    """A block around nn.MultiheadAttention: its heads and its mask convention are the inner module's."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)

    def forward(self, x, attn_mask=None):
        return self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0]


class WrapsMultiheadAttentionUnmasked(WrapsMultiheadAttention):
    def forward(self, x, attn_mask=None):
        return super().forward(x)  # BUG: the mask is not passed on


def test_a_block_around_nn_multihead_attention_takes_its_heads_and_is_told_its_mask():
    torch.manual_seed(0)
    report = audit(WrapsMultiheadAttention())
    assert "num_heads=4 read from its nn.MultiheadAttention `attn`" in report.layer
    assert "num_heads=1 assumed" not in report.layer
    runs = report.result("runs")  # it raises on the audit's (B, 1, Tq, Tk) mask: a convention to declare, no defect
    assert runs.verdict == "skip" and report.declaration == "mask='mha_blocked'" and report.status == "inconclusive"
    torch.manual_seed(0)
    assert_clean(audit(WrapsMultiheadAttention(), mask="mha_blocked"), measured=CORE + ("mask_honoured",))
    torch.manual_seed(0)
    assert_clean(audit(WrapsMultiheadAttention(), mask="additive:B*H,Tq,Tk"), measured=CORE + ("mask_honoured",))
    torch.manual_seed(0)
    assert "mask_honoured" in audit(WrapsMultiheadAttentionUnmasked(), mask="mha_blocked").fired()


# ---- class 3: weights are a distribution before they are read as weights ----------------------------------------


class ReturnsLogits(Heads):
    """Returns (out, qk): the scores, not the weights, as some libraries do."""

    def forward(self, x, mask=None):
        q, k, v = self.project(x)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.merge(scores.softmax(-1), v), scores


class ReturnsWeightsMaskedAfterSoftmax(Heads):
    def forward(self, x, mask=None):
        q, k, v = self.project(x)
        weights = self.scores(q, k).softmax(-1)
        if mask is not None:
            weights = weights.masked_fill(~mask, 0.0)  # BUG: masked after the softmax
        return self.merge(weights, v), weights


class NoSoftmaxReturnsScores(Heads):
    def forward(self, x, mask=None):
        q, k, v = self.project(x)
        scores = self.scores(q, k)  # BUG: no softmax; the scores are used as weights
        return self.merge(scores, v), scores


def test_a_returned_tensor_that_is_not_a_distribution_is_not_read_as_the_weights():
    """The rule: a returned (..., Tq, Tk) tensor with negative entries, beside an observed softmax over (Tq, Tk), is
    the scores; the weights are read from the softmax, and the report says which it read and why."""
    torch.manual_seed(0)
    report = audit(ReturnsLogits(), causal=True)
    assert_clean(report, measured=CORE + ("weight_row_sums", "causal_alignment", "future_leakage"))
    assert report.weights_source.startswith("observed softmax output")
    assert "second output has negative entries" in report.weights_source
    assert "observed softmax output" in report.result("weight_row_sums").message


@pytest.mark.parametrize("broken", [ReturnsWeightsMaskedAfterSoftmax, NoSoftmaxReturnsScores])
def test_returned_weights_that_are_wrong_still_fail_weight_row_sums(broken):
    """Non-negative weights that do not sum to 1 are weights, and wrong; scores with no softmax beside them are the
    only weights there are, and wrong."""
    torch.manual_seed(0)
    result = audit(broken()).result("weight_row_sums")
    assert result.verdict == "fail" and "returned weights" in result.message, result


# ---- class 6: self-attention only ---------------------------------------------------------------------------------


class RelativeBiasSelfAttention(Heads):
    """Takes query, key and value separately, but its learned relative bias is (Tq, Tq): it needs Tq = Tk."""

    def __init__(self, scaled=True, **kw):
        super().__init__(**kw)
        self.bias = nn.Parameter(torch.zeros(2 * 64 - 1))
        self.scaled = scaled

    def forward(self, query, key, value, mask=None):
        q, _, _ = self.project(query)
        _, k, _ = self.project(key)
        _, _, v = self.project(value)
        T = query.shape[1]
        i = torch.arange(T)
        scores = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if self.scaled else 1.0)
        scores = scores + self.bias[i[:, None] - i[None, :] + 63]  # (Tq, Tq): raises when Tk != Tq
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.merge(scores.softmax(-1), v)


def test_a_layer_that_needs_equal_lengths_is_audited_as_self_attention_with_the_cross_probes_skipped():
    torch.manual_seed(0)
    report = audit(RelativeBiasSelfAttention())
    assert_clean(report, measured=("runs", "finite_output", "softmax_saturation", "output_variance",
                                   "query_locality", "keys_matter", "mask_honoured"))
    runs, shape = report.result("runs"), report.result("output_shape")
    assert "self-attention only" in runs.message and "declare cross=True" in runs.message
    assert shape.verdict == "skip" and "self-attention only" in shape.message
    torch.manual_seed(0)
    declared = audit(RelativeBiasSelfAttention(), cross=True)  # told it is cross-attention: the raise fails
    assert declared.result("runs").verdict == "fail"
    torch.manual_seed(0)
    assert "softmax_saturation" in audit(RelativeBiasSelfAttention(scaled=False)).fired()  # its broken twin


# ---- class 7: declared inputs -------------------------------------------------------------------------------------


class NamedMemory(Heads):
    """Whisper's style: the memory is `xa`, a name the audit cannot know."""

    def forward(self, x, xa, mask=None):
        q, k, v = self.project(x, xa)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.merge(scores.softmax(-1), v)


class NamedMemoryKeysFromQueries(NamedMemory):
    def forward(self, x, xa, mask=None):
        q, _, v = self.project(x, xa)
        _, k, _ = self.project(x)  # BUG: keys from the query stream
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.merge(scores.softmax(-1), v)


def via_xa(layer, x, memory, mask=None):
    return layer(x, xa=memory, mask=mask)


def test_a_memory_under_another_name_is_declared_with_call_as_the_report_suggests():
    # `xa` is required and of a name the audit does not know: it tries it, and the report needs a declaration, the
    # self-attention call first (given xa=x it runs, each row moving only with its own query); the memory's call next
    first = audit(NamedMemory(), progress=False)
    runs = first.result("runs")
    assert first.status == "inconclusive" and first.declaration == "call=lambda layer, x, mask: layer(x, xa=x, mask=mask)"
    assert "call=lambda layer, x, memory, mask: layer(x, xa=memory, mask=mask) with cross=True" in runs.fix
    torch.manual_seed(0)
    assert_clean(audit(NamedMemory(), call=lambda layer, x, mask: layer(x, xa=x, mask=mask)), measured=CORE)
    torch.manual_seed(0)
    report = audit(NamedMemory(), call=via_xa)
    assert report.settings["form"] == "cross_module" and "called through the declared call" in report.layer
    assert_clean(report, measured=CORE + ("mask_honoured", "keys_matter", "query_locality"))
    torch.manual_seed(0)
    # declared cross-attention through its call: the raise at Tq != Tk is a failure, not "self-attention only"
    assert {"runs", "query_locality"} <= set(audit(NamedMemoryKeysFromQueries(), call=via_xa).fired())


class NeedsSecondStream(Heads):
    """Must be called attn(x, x) even for self-attention."""

    def forward(self, x, y=None, mask=None):
        if y is None:
            raise ValueError("Must provide y input")
        q, k, v = self.project(x, y)
        scores = self.scores(q, k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.merge(scores.softmax(-1), v)


class NeedsSecondStreamUnscaled(NeedsSecondStream):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1)  # BUG: no 1/sqrt(d)


def test_a_layer_that_needs_its_second_stream_is_told_to_declare_the_call():
    torch.manual_seed(0)
    runs = audit(NeedsSecondStream()).result("runs")  # a convention the audit cannot choose: no failure (issue 34)
    assert runs.verdict == "skip" and runs.declaration == "call=lambda layer, x, mask: layer(x, y=x, mask=mask)"
    assert "call=lambda layer, x, memory, mask" in runs.remedy[0], runs.remedy  # the memory's call named too
    self_call = lambda layer, x, mask: layer(x, x, mask=mask)  # noqa: E731
    torch.manual_seed(0)
    assert_clean(audit(NeedsSecondStream(), call=self_call, causal=True),
                 measured=CORE + ("mask_honoured", "future_leakage"))
    torch.manual_seed(0)
    assert "softmax_saturation" in audit(NeedsSecondStreamUnscaled(), call=self_call).fired()


def test_a_call_of_another_form_is_a_usage_error():
    with pytest.raises(AuditUsageError, match=r"expected call\(layer, x\[, mask\]\)"):
        make_subject(NamedMemory(), call=lambda layer: layer)
    with pytest.raises(AuditUsageError, match=r"for a function, call\(layer, q, k, v\[, mask\]\)"):
        make_subject(lambda q, k, v: q, call=lambda f, x, mask: f(x, x, x))


def test_readme_declarations_table_is_the_code():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert declarations_table() in readme, ("regenerate the README's declarations table: python -c 'from "
                                            "diagnostics._declarations import declarations_table as t; print(t())'")
