"""Pins for the survivors of the full mutation run over mask_honoured / fully_masked_rows, gradients and runs (issue
37: `benchmarks/mutations.py --all --only detectors/masking.py --only detectors/gradients.py --only
detectors/runs.py`, at 824d172). As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each
side of the comparison, guard or constant it pins), the numbers quoted as literals; each test says which mutant it
pins (its line number the run's, at 824d172). Small layers written here, one detector at small sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from correct import MultiHeadAttention


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


# ---- gradients: non-finite outputs and gradients ------------------------------------------------------------------


class _NanGradient(torch.autograd.Function):
    """The identity, whose backward writes NaN into the first entry of the gradient: the output stays finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad


class Poisoned(MultiHeadAttention):
    """The reference (16 wide, 2 heads, seed 0) with one non-finite value: `where` = "output" multiplies the output's
    first entry by NaN (its gradient NaN too, through the product), "written" overwrites that entry with NaN (the
    gradient of an overwritten entry is 0: every gradient finite), "gradient" leaves the output finite and makes the
    backward write NaN; None: the reference."""

    def __init__(self, where: str | None):
        torch.manual_seed(0)
        super().__init__(16, 2)
        self.where = where

    def forward(self, x, mask=None):
        out, weights = super().forward(x, mask)  # (B, T, D), (B, H, T, T)
        if self.where == "output":
            first = torch.zeros_like(out, dtype=torch.bool)
            first.view(-1)[0] = True
            out = out * torch.where(first, float("nan"), 1.0)
        elif self.where == "written":
            out = out.clone()
            out.view(-1)[0] = float("nan")
        elif self.where == "gradient":
            out = _NanGradient.apply(out)
        return out, weights


def test_gradients_says_the_output_is_nan_where_one_output_value_is_and_its_twin_passes():
    """check_gradients' `if not bool(torch.isfinite(out).all())` (L172, all->any): one NaN output value (its gradients
    NaN through the product) is an output that is NaN on an ordinary input (with `any`, only an output NaN
    everywhere would be, and this one would read as NaN gradients alone). Its twin, the reference, passes."""
    found = verdict(Poisoned("output"), "gradients")
    assert found.verdict == "fail" and found.message.startswith("the output is NaN or inf on an ordinary input"), found
    assert ": 1 non-finite output values" in found.evidence, found.evidence
    assert verdict(Poisoned(None), "gradients").verdict == "pass"


def test_gradients_says_the_gradients_are_nan_where_the_output_is_finite():
    """The same line, drop-not: a finite output whose backward writes NaN fails on its gradients, not on its output
    (with the `not` dropped, a finite output would be called NaN). Its twin, above: a NaN output is named."""
    found = verdict(Poisoned("gradient"), "gradients")
    assert found.verdict == "fail" and found.message == "gradients are NaN or inf on an ordinary input", found


def test_gradients_fails_a_nan_written_over_an_output_value_whose_gradients_stay_finite():
    """A defect the run's L172 pins led to (fixed): a NaN written over one output value has gradient 0, so every
    gradient was finite, the finite differences read NaN, and `rel > limit` (False for NaN) passed the layer with
    "disagreement nan". The output is now checked as the gradients are. Its twins: the NaN that reaches the gradients
    says so too, and the reference passes (above)."""
    written = verdict(Poisoned("written"), "gradients")
    assert written.verdict == "fail" and written.message == "the output is NaN or inf on an ordinary input", written
    assert ": 1 non-finite output values" in written.evidence, written.evidence
    spread = verdict(Poisoned("output"), "gradients")
    assert spread.message == "the output is NaN or inf on an ordinary input, and so are its gradients", spread


# ---- gradients: gradient that reaches the future or masked keys --------------------------------------------------


def unmasked(q, k, v):
    """Scaled dot-product attention over every key (no mask taken): bidirectional."""
    return F.scaled_dot_product_attention(q, k, v)


def causal(q, k, v):
    """The same, causal."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_gradients_checks_the_future_from_two_tokens_on():
    """check_gradients' `if probe.causal and T >= 2` (L182, GtE->Gt): at seq_len 2 the cut is t=0 and the second
    backward finds the gradient a bidirectional function, audited as causal, sends to key 1 (with `T > 2` nothing is
    checked at two tokens and it passes). The gradient reaches the keys, not the queries: _future_gradient names the
    three streams of a function (L381, Eq->NotEq: with one name, "input", only the query is read). The failure's value
    is 1.0 (L328's constant). Its twin, the causal function at two tokens, passes."""
    found = verdict(unmasked, "gradients", causal=True, seq_len=2)
    assert found.verdict == "fail" and found.message.startswith("the gradient lets the future in"), found
    assert "w.r.t. key positions after t=0 (must be exactly 0)" in found.evidence and found.value == 1.0, found
    assert verdict(causal, "gradients", causal=True, seq_len=2).verdict == "pass"


class _LastPlus(torch.autograd.Function):
    """The identity, whose backward adds `ratio` x the gradient's greatest magnitude at the last position (dim -2):
    a gradient of exactly that size, relative, where a correct layer's is exactly 0 (a blocked or a future key)."""

    @staticmethod
    def forward(ctx, x, ratio):
        ctx.ratio = ratio
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[..., -1, :] += ctx.ratio * grad.abs().max()
        return grad, None


def last_key_gradient(ratio: float, is_causal: bool = False):
    """SDPA (the mask taken), the last key's gradient `ratio` x the keys' greatest: too small to move the finite
    differences' agreement (1e-13 of |grad| |u| measured)."""
    def attend(q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, _LastPlus.apply(k, ratio), v, attn_mask=mask,
                                              is_causal=is_causal and mask is None)
    return attend


@pytest.mark.parametrize("ratio, expected", [(3e-12, "fail"), (3e-13, "pass")])
def test_a_masked_key_receives_gradient_past_1e_12_of_the_greatest(ratio, expected):
    """_masked_key_gradient's `worst > 1e-12 * max(|g|)` (L358, x10 and x0.1): the padding mask blocks the last key
    for every query; its gradient at 3e-12 of the keys' greatest fails (at 1e-11 it would pass), at 3e-13 passes (at
    1e-13 it would fail). The failure's value is 1.0 (L335's constant)."""
    found = verdict(last_key_gradient(ratio), "gradients")
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message.startswith("masked keys receive gradient") and found.value == 1.0, found
        assert "w.r.t. key positions a padding mask blocks" in found.evidence, found.evidence
    else:
        assert "2 keys a padding mask blocks get exactly zero gradient" in found.evidence, found.evidence


@pytest.mark.parametrize("ratio, expected", [(3e-12, "fail"), (3e-13, "pass")])
def test_a_future_key_receives_gradient_past_1e_12_of_the_greatest(ratio, expected):
    """_future_gradient's `later > 1e-12 * max(|g|)` (L385, x10 and x0.1): the causal function, the last key's
    gradient from the outputs up to the middle at 3e-12 of the keys' greatest fails, at 3e-13 passes."""
    found = verdict(last_key_gradient(ratio, is_causal=True), "gradients", causal=True)
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message.startswith("the gradient lets the future in"), found


def value_leak(q, k, v, mask=None):
    """SDPA plus 1e-3 x the mean of every value, the blocked ones too: gradient reaches the values the mask blocks,
    never the keys."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + 1e-3 * v.mean(-2, keepdim=True)


def test_a_function_whose_blocked_values_receive_gradient_fails_and_plain_sdpa_passes():
    """_masked_key_gradient's `("key", "value") if len(inputs) == 3` (L354, Eq->NotEq): a function's key and value
    gradients are read apart; here only the values' reach the blocked positions (with one name the zip reads the
    keys' alone and passes it). Its twin, SDPA alone, passes."""
    found = verdict(value_leak, "gradients")
    assert found.verdict == "fail" and "w.r.t. value positions a padding mask blocks" in found.evidence, found
    plain = verdict(lambda q, k, v, mask=None: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), "gradients")
    assert plain.verdict == "pass", plain


# ---- gradients: the entries of a parameter the finite differences move --------------------------------------------


class _ZeroRows(torch.autograd.Function):
    """The identity, whose backward drops the gradient of the rows from `start` on (a backward wrong there only)."""

    @staticmethod
    def forward(ctx, x, start):
        ctx.start = start
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[ctx.start:] = 0
        return grad, None


class Tabled(MultiHeadAttention):
    """The reference (16 wide, 2 heads, seed 0) plus the row mean of a (64, 16) table added to every output: a
    parameter of 1,024 entries, more than the 512 the finite differences move. `start`: its backward drops the
    gradient of rows `start`.. (entries 512.. at 32); `transposed`: the table is held transposed (not contiguous)."""

    def __init__(self, start: int | None = None, transposed: bool = False):
        torch.manual_seed(0)
        super().__init__(16, 2)
        self.start = start
        self.table = nn.Parameter(torch.randn(16, 64).t() * 0.1 if transposed else torch.randn(64, 16) * 0.1)

    def forward(self, x, mask=None):
        out, weights = super().forward(x, mask)  # (B, T, D), (B, H, T, T)
        table = self.table if self.start is None else _ZeroRows.apply(self.table, self.start)
        return out + table.mean(0), weights


def test_the_entries_moved_are_spread_over_a_large_parameter_not_its_first_512():
    """check_gradients' `if k < p.numel()` (L196, Lt->Gt): the 512 entries moved of a 1,024-entry table are spread
    over it, so a backward wrong only at entries 512.. fails (with `>`, never true, the first 512 are moved, all of
    them right, and it passes). Its twin, the same table with its true backward, passes."""
    wrong = verdict(Tabled(start=32), "gradients")
    assert wrong.verdict == "fail" and wrong.message.startswith("autograd's gradient disagrees"), wrong
    assert verdict(Tabled(), "gradients").verdict == "pass"


def test_a_parameter_held_transposed_is_made_contiguous_before_its_entries_are_moved():
    """check_gradients' `if not p.is_contiguous()` (L190, drop-not): the float64 copy's transposed table is made
    contiguous, so that its entries are set through a flat view (with the `not` dropped, the view raises and the
    layer fails on "the backward pass (or the float64 copy) raised"). Its twin, the same table held contiguous, passes
    too (above)."""
    layer = Tabled(transposed=True)
    assert not layer.table.is_contiguous()
    assert verdict(layer, "gradients").verdict == "pass"


# ---- mask_honoured: the pass names the scenarios measured -----------------------------------------------------------


@pytest.mark.parametrize("causal, seq_len, named", [
    (False, 16, "(padding, causal and past-key masks)"),
    (False, 2, "(padding and causal masks)"),
    (True, 16, "(padding mask)"),
], ids=["three", "two", "one"])
def test_mask_honoured_names_every_scenario_it_measured(causal, seq_len, named):
    """check_mask_honoured's `mask{'s' if len(results) > 1 else ''}` (L125, Gt->GtE and Gt->Lt) and _listed's
    `len(names) < 3` (L294): the reference, audited as not causal, measures three masks (a comma and "and"), at two
    tokens two (no past-key scenario: the cut is 0), and, causal, the padding mask alone (one mask, no plural)."""
    torch.manual_seed(0)
    found = verdict(MultiHeadAttention(16, 2, causal=causal), "mask_honoured", causal=causal, seq_len=seq_len)
    assert found.verdict == "pass" and found.message == f"keys the mask blocks have no effect {named}", found


# ---- masking.allowed_key_reading: a row not finite in its baseline is not read -----------------------------------


@pytest.mark.parametrize("nan_in_row_0", [True, False])
def test_the_control_reads_only_rows_whose_baseline_is_finite_in_every_feature(nan_in_row_0):
    """`allowed_key_reading`'s `torch.isfinite(baseline).all(-1)` (L303 at 3057bfd, `.all` made `.any`, survived the
    --all run): a row whose baseline has one NaN feature cannot show a move, so it is not read, even where its change
    came out finite; with `.any` it would be, and its 0.5 would read as the control's move. Twin: the same change with
    that row finite in its baseline, read and moved. Two query rows that may both attend key 0, one batch row."""
    from types import SimpleNamespace

    from diagnostics.detectors.masking import allowed_key_reading

    baseline = torch.ones(1, 2, 3)  # (B, Tq, D)
    if nan_in_row_0:
        baseline[0, 0, 0] = float("nan")
    comparison = SimpleNamespace(tol=1e-5, changes=[torch.tensor([[0.5, 0.0]])], baseline_output=lambda: baseline)
    moved, text = allowed_key_reading(comparison, torch.ones(1, 2, dtype=torch.bool), torch.float32)
    assert moved is not nan_in_row_0, text
    assert text.startswith("0 / 1 outputs" if nan_in_row_0 else "1 / 2 outputs"), text


# ---- runs._needed_declaration under a causal audit; _mask_hints.honoured_conventions at one token ------------------


class FloatMaskOnly(nn.Module):
    """Hugging Face-style self-attention whose `attention_mask` must be additive floats: a bool mask raises."""

    def __init__(self, d_model: int = 16, num_heads: int = 2):
        super().__init__()
        self.h = num_heads
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, attention_mask=None):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            raise TypeError("attention_mask must be a float mask")
        B, T, D = x.shape  # batch, tokens, width
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # (B, H, T, d)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("seq_len", [1, 2, 16])
def test_a_causal_audit_of_a_layer_that_takes_another_mask_convention_needs_a_declaration_where_it_can_be_told(seq_len):
    """A causal audit passes its mask to every call, so no call runs without one: the layer raising on every bool mask
    and honouring additive floats is a convention mismatch, "needs a declaration: mask='additive'" (inconclusive), from
    two tokens on (before 2026-12-05 `runs` failed it: the declaration was sought only where a call without a mask had
    run). At one token no padding can tell conventions apart (`honoured_conventions`' `probe.t < 2`, whose second `or`
    made `and` would read one anyway): the declaration rests on the layer running in that convention alone, and says
    so (`conventions_run`; `runs` failed it there until 2026-12-05, later). Declared additive, the layer passes."""
    torch.manual_seed(0)
    report = diagnostics.audit(FloatMaskOnly(), seq_len=seq_len, causal=True)
    assert (report.status, report.declaration) == ("inconclusive", "mask='additive'"), str(report)
    message = report.result("runs").message
    assert ("At one token no key can be blocked" in message) is (seq_len == 1), message
    assert ("it runs and honours it" in message) is (seq_len > 1), message
    torch.manual_seed(0)
    assert diagnostics.audit(FloatMaskOnly(), seq_len=seq_len, causal=True, mask="additive").passed


class FloatMaskBroken(FloatMaskOnly):
    """FloatMaskOnly whose output, given a float mask, is not a (B, T, D) of finite values: `how` says what breaks."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x, attention_mask=None):
        out = super().forward(x, attention_mask)
        if attention_mask is None:
            return out
        if self.how == "nan":
            return out.index_put((torch.tensor([0]), torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan")))
        if self.how == "batch":
            return out[:1]  # the first sequence only
        if self.how == "tokens":
            return torch.cat([out, out[:, :1]], dim=1)  # one token more
        return out.mean(-1)  # "flat": (B, T), no width axis: at one token its second axis is as long as T


@pytest.mark.parametrize("how", ["nan", "batch", "tokens", "flat"])
def test_at_one_token_a_convention_counts_only_where_its_output_is_whole_and_finite(how):
    """_mask_hints.conventions_run's reading (`_whole`: three axes or more, B sequences, T tokens; and every value
    finite: each part pinned): at seq_len 1, a layer that raises on the audit's bool mask and, given its mask as
    additive floats, returns one NaN, drops a sequence, adds a token or drops the width axis does not run in that
    convention: `runs` fails, no declaration named. Its twin on the same inputs, the layer
    whose float-mask output is whole, needs mask='additive'."""
    torch.manual_seed(0)
    broken = diagnostics.audit(FloatMaskBroken(how), seq_len=1).result("runs")
    assert broken.verdict == "fail" and not broken.declaration, broken
    torch.manual_seed(0)
    assert diagnostics.audit(FloatMaskOnly(), seq_len=1).declaration == "mask='additive'"


def test_at_one_token_a_declared_convention_the_layer_raises_on_still_fails_runs():
    """runs._needed_declaration's guard (`s.convention_by in ("user", "library")`, its `or`s): declared mask='allowed'
    (bool, the user's word), the float-only layer raises on every masked call at seq_len 1, and a convention it runs in
    is no excuse: `runs` fails (the guard made `and` sought one). Undeclared, its twin needs mask='additive'."""
    torch.manual_seed(0)
    declared = diagnostics.audit(FloatMaskOnly(), seq_len=1, mask="allowed").result("runs")
    assert declared.verdict == "fail" and not declared.declaration, declared
    torch.manual_seed(0)
    assert diagnostics.audit(FloatMaskOnly(), seq_len=1).declaration == "mask='additive'"


class FloatMaskUnread(FloatMaskOnly):
    """FloatMaskOnly that takes a float mask and never adds it: it runs in the additive convention and honours nothing."""

    def forward(self, x, attention_mask=None):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            raise TypeError("attention_mask must be a float mask")
        return super().forward(x, None)  # the float mask taken, never added


def test_from_two_tokens_running_in_a_convention_is_no_declaration_without_honouring_it():
    """runs' `probe.t < 2` (Lt->LtE): at seq_len 2 padding can tell conventions apart, and the layer that raises on bool
    masks and ignores the float ones honours none: the mismatch is no FAIL (tests/test_unhonoured_conventions.py), the
    declaration it runs in is named with the words that it honours none, and declared, mask_honoured fails the mask it
    ignores. At seq_len 1, where nothing can be told, the same layer needs that declaration with the words that
    seq_len >= 2 measures it."""
    torch.manual_seed(0)
    two = diagnostics.audit(FloatMaskUnread(), seq_len=2).result("runs")
    assert two.verdict == "skip" and two.declaration == "mask='additive'", two
    assert "In none of the conventions it runs in" in two.message and "seq_len >= 2" not in two.message, two
    torch.manual_seed(0)
    declared = diagnostics.audit(FloatMaskUnread(), seq_len=2, mask="additive")
    assert declared.result("mask_honoured").verdict == "fail", declared
    torch.manual_seed(0)
    one = diagnostics.audit(FloatMaskUnread(), seq_len=1).result("runs")
    assert one.verdict == "skip" and "seq_len >= 2" in one.message, one


class KeyMaskOnly(FloatMaskOnly):
    """Self-attention whose `mask` must be bool and 2-D: it raises on the audit's (B, 1, Tq, Tk) mask and, at one token,
    runs given (Tq, Tk) or (B, Tk) masks of either polarity: conventions of two meanings, several shapes each."""

    def forward(self, x, mask=None):
        if mask is not None and (mask.dim() != 2 or mask.dtype != torch.bool):
            raise ValueError("mask must be bool, 2-D")
        return super().forward(x, None)


def test_at_one_token_the_declaration_names_each_other_meaning_it_runs_in_once():
    """_needed_at_one_token's list of the other conventions (`all(c.meaning != o.meaning ...)`: any->all, !=->==): one
    convention per other meaning, none of the first one's meaning in another shape."""
    torch.manual_seed(0)
    found = diagnostics.audit(KeyMaskOnly(), seq_len=1).result("runs")
    assert found.verdict == "skip" and found.declaration == "mask='allowed:Tq,Tk'", found
    assert "it runs (it runs in blocked:Tq,Tk too). At one token" in found.message, found.message


class StackRefused(FloatMaskOnly):
    """FloatMaskOnly that also raises without a mask: a failure of its own beside the convention mismatch."""

    def forward(self, x, attention_mask=None):
        if attention_mask is None:
            raise RuntimeError("a mask is required")
        return super().forward(x, attention_mask)


def test_at_one_token_a_failure_of_the_layers_own_is_no_convention_mismatch():
    """runs._needed_declaration's guard beside the convention (`any(c.allowed is None for c in calls)`, any->all): at
    seq_len 1 a layer that also raised on a call without a mask fails `runs` (`all` let it through to a declaration).
    Its twin, the float-only layer, needs mask='additive' on the same inputs."""
    torch.manual_seed(0)
    found = diagnostics.audit(StackRefused(), seq_len=1).result("runs")
    assert found.verdict == "fail" and not found.declaration, found
    torch.manual_seed(0)
    assert diagnostics.audit(FloatMaskOnly(), seq_len=1).declaration == "mask='additive'"


class MasklessTwoSequences(nn.Module):
    """Self-attention with no mask parameter that runs on batches of exactly 2 sequences (the standard probe's) and
    raises on any other: a failure of its own, whatever the mask."""

    def __init__(self):
        super().__init__()
        self.inner = FloatMaskOnly()

    def forward(self, x):
        if x.shape[0] != 2:
            raise RuntimeError("two sequences only")
        return self.inner(x, None)


def test_at_one_token_a_layer_that_takes_no_mask_is_never_told_to_declare_one():
    """Audited causal at seq_len 1, the layer with no mask parameter that raised on a batch of 3 fails `runs`: it takes
    no mask, so no convention can excuse it. (Its calls carry no mask, causal or not, so `any(c.allowed is None ...)`
    returns before `not s.takes_mask` is read: that clause made `and` is marked equivalent in benchmarks/mutations.py.)
    Its twin, the float-only layer, needs mask='additive'."""
    torch.manual_seed(0)
    found = diagnostics.audit(MasklessTwoSequences(), seq_len=1, causal=True).result("runs")
    assert found.verdict == "fail" and not found.declaration, found
    torch.manual_seed(0)
    assert diagnostics.audit(FloatMaskOnly(), seq_len=1).declaration == "mask='additive'"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("std", [None, 0.02], ids=["default", "std 0.02"])
def test_the_one_token_declaration_holds_at_training_dtypes_and_scales(dtype, std):
    """The one-token convention mismatch in bfloat16 and at std-0.02 projections as in float32: the float-only layer
    needs mask='additive' and passes with it; its twin that also raises without a mask fails `runs`."""
    torch.manual_seed(0)
    layer = FloatMaskOnly()
    if std is not None:
        for p in layer.parameters():
            nn.init.normal_(p, std=std)
    layer = layer.to(dtype)
    assert diagnostics.audit(layer, seq_len=1, dtype=dtype).declaration == "mask='additive'"
    assert diagnostics.audit(layer, seq_len=1, dtype=dtype, mask="additive").status == "passed"
    torch.manual_seed(0)
    assert diagnostics.audit(StackRefused().to(dtype), seq_len=1, dtype=dtype).result("runs").verdict == "fail"
