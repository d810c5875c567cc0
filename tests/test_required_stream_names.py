"""A required stream of a name the audit does not know (`forward(x, cond)`, Perceiver's `forward(image_embeds,
latents)`) is a calling convention, not misuse: the audit tries it (`runs`' `_required_input`) and its report "needs
a declaration" naming the call under which the layer runs, the queries going where the layer takes them. Under that
call the correct layer passes and its twin with one step broken fails; a required parameter that takes neither a
memory nor the queries' tokens leaves the audit inconclusive (never failed), and one passed by keyword only is still
a usage error.

Written in the style of a Perceiver resampler (queries from learned latents, keys from the image tokens and the
latents together), of PixArt's and Sana's cross-attention (`forward(x, cond, mask=None)`) and of a cross-attention
that takes its memory first; diffusers' own three (ConsisID's two Perceiver attentions, Sana-WM's
MultiHeadCrossAttention) with the zoo extra.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics import AuditUsageError


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    B, T, C = t.shape  # batch, tokens, width
    return t.view(B, T, n, C // n).transpose(1, 2)  # (B, H, T, d)


def merged(t: torch.Tensor) -> torch.Tensor:
    B, H, T, d = t.shape
    return t.transpose(1, 2).reshape(B, T, H * d)


class Attending(nn.Module):
    def __init__(self, dim=32, n_heads=4, scaled=True):
        super().__init__()
        self.n_heads, self.scale = n_heads, (dim // n_heads) ** -0.5 if scaled else 1.0  # unscaled: the BUG
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def attend(self, queries, tokens, mask=None):
        q = heads(self.to_q(queries), self.n_heads)
        k, v = (heads(t, self.n_heads) for t in self.to_kv(tokens).chunk(2, dim=-1))
        scores = q @ k.transpose(-2, -1) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.to_out(merged(scores.softmax(dim=-1) @ v))


class LatentAttention(Attending):
    """Queries from the latents; keys and values from the image tokens and the latents together."""

    def forward(self, image_embeds, latents):
        return self.attend(latents, torch.cat([image_embeds, latents], dim=1))


class ConditionAttention(Attending):
    """The memory under a name the audit does not know; the mask bool (B, 1, Tq, Tk), True = may attend."""

    def forward(self, x, cond, mask=None):
        return self.attend(x, cond, mask)


class MemoryFirst(Attending):
    """The memory first, the queries second, under a name the audit knows."""

    def forward(self, image_embeds, hidden_states):
        return self.attend(hidden_states, image_embeds)


class RelativeTable(Attending):
    """Requires a (H, Tq, Tk) table of relative biases, by a name the audit does not know: neither a memory nor
    the queries' tokens."""

    def forward(self, x, rel_bias):
        q = heads(self.to_q(x), self.n_heads)
        k, v = (heads(t, self.n_heads) for t in self.to_kv(x).chunk(2, dim=-1))
        scores = q @ k.transpose(-2, -1) * self.scale + rel_bias
        return self.to_out(merged(scores.softmax(dim=-1) @ v))


class KeywordTable(RelativeTable):
    def forward(self, x, *, rel_bias):
        return super().forward(x, rel_bias)


def _declared(report) -> dict:
    """The report's declaration as keyword arguments for audit(), as a user would paste it."""
    call = ast.parse(f"f({report.declaration})", mode="eval").body
    return {k.arg: eval(compile(ast.Expression(k.value), "<declaration>", "eval"), {})  # noqa: S307 -- the report's
            if isinstance(k.value, ast.Lambda) else ast.literal_eval(k.value) for k in call.keywords}


def _layer(cls, **kw):
    torch.manual_seed(0)
    return cls(**kw).eval()


CASES = [
    (LatentAttention, "call=lambda layer, x: layer(latents=x, image_embeds=x[:, :0])", "latents", "joint attention"),
    (ConditionAttention, "call=lambda layer, x, mask: layer(x, cond=x, mask=mask)", "cond", "apart from its queries"),
    (MemoryFirst, "call=lambda layer, x: layer(hidden_states=x, image_embeds=x)", "image_embeds",
     "apart from its queries"),
]


@pytest.mark.parametrize("cls, declaration, left, how", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_required_stream_of_an_unknown_name_needs_the_call_that_runs_and_passes_with_it(cls, declaration, left, how):
    report = diagnostics.audit(_layer(cls), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and report.declaration == declaration, report.status_reason
    assert f"each given without `{left}`, which it requires" in runs.message and how in runs.message, runs.message
    again = diagnostics.audit(_layer(cls), progress=False, **_declared(report))
    assert again.status == "passed", again.status_reason


@pytest.mark.parametrize("cls", [c[0] for c in CASES], ids=[c[0].__name__ for c in CASES])
def test_its_unscaled_twin_names_the_same_call_and_fails_under_it(cls):
    """The same inputs, q·k left unscaled: the declaration is the same (it is about the call, not the values), and
    under it the bug is caught."""
    declaration = diagnostics.audit(_layer(cls), progress=False).declaration
    buggy = diagnostics.audit(_layer(cls, scaled=False), progress=False)
    assert buggy.declaration == declaration and buggy.status == "inconclusive", buggy.status_reason
    report = diagnostics.audit(_layer(cls, scaled=False), progress=False, **_declared(buggy))
    assert report.status == "failed" and report.result("softmax_saturation").verdict == "fail", report.status_reason


def test_a_required_parameter_that_takes_no_stream_is_inconclusive_naming_the_call_never_failed():
    report = diagnostics.audit(_layer(RelativeTable), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    assert runs.verdict == "skip" and "the layer requires `rel_bias`, a parameter of a name the audit" in runs.message
    assert "layer(x, rel_bias=memory" in runs.fix and "wrap the layer so that it gets `rel_bias`" in runs.fix
    # the twin given its table through the call the fix describes passes: the layer was right all along
    table = lambda layer, x: layer(x, torch.zeros(4, x.shape[1], x.shape[1]))  # noqa: E731 -- the user's call
    assert diagnostics.audit(_layer(RelativeTable), progress=False, call=table).status == "passed"


class KeysFromQueries(Attending):
    """The bug: a cross-attention that takes its keys and values from x, never reading its memory `cond`."""

    def forward(self, x, cond):
        return self.attend(x, x)


class PooledCondition(Attending):
    """Joint attention gated by its condition's maximum: given no condition tokens it raises."""

    def forward(self, x, cond):
        gate = cond.amax(dim=1, keepdim=True).sigmoid()  # (B, 1, D)
        return self.attend(x, torch.cat([cond, x], dim=1)) * gate


class ExtraBesideKeys(Attending):
    def forward(self, query, key, value, rel_bias):
        return self.attend(query, key)


def test_a_stream_the_layer_never_reads_names_no_call_under_which_it_would_pass():
    """Given `cond` x, KeysFromQueries is self-attention and passes: that call is not named (its output does not
    depend on `cond`), and the audit is inconclusive, both calls in the fix."""
    report = diagnostics.audit(_layer(KeysFromQueries), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    assert "its output does not depend on `cond`" in runs.message and "layer(x, cond=memory)" in runs.fix


def test_a_joint_attention_that_cannot_take_an_empty_stream_names_no_call():
    report = diagnostics.audit(_layer(PooledCondition), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    assert "given `cond` with no tokens it raises (IndexError" in runs.message, runs.message


def test_at_one_token_rows_cannot_move_together_so_no_call_is_named():
    report = diagnostics.audit(_layer(ConditionAttention), progress=False, seq_len=1)
    runs = report.result("runs")
    assert report.status == "inconclusive" and runs.verdict == "skip" and not report.declaration, runs.message
    assert "at one token there is no other row to move" in runs.message and "audit at seq_len >= 2" in runs.fix


def test_a_required_stream_beside_key_and_value_is_a_usage_error():
    with pytest.raises(AuditUsageError, match=r"got `rel_bias` in forward\(query, key, value, rel_bias\)\. Fix"):
        diagnostics.audit(_layer(ExtraBesideKeys), progress=False)


class QueriesFromLatents(Attending):
    """`x` is the audit's name for the queries, but this layer's queries come from `latents`: the name is trusted,
    so x is never moved to another parameter."""

    def forward(self, x, latents):
        return self.attend(latents, torch.cat([x, latents], dim=1))


class RowGated(LatentAttention):
    """Joint attention whose first row is gated by its image tokens' mean: given none, that row alone is NaN."""

    def forward(self, image_embeds, latents):
        out = super().forward(image_embeds, latents)
        gate = torch.ones_like(out)
        gate[:, :1] = image_embeds.mean(dim=1, keepdim=True).sigmoid()  # NaN over no token
        return out * gate


def test_queries_named_x_are_never_moved_to_another_parameter():
    """Pin (`_required_input`: the swap only where the query is forward's first parameter of no known name)."""
    report = diagnostics.audit(_layer(QueriesFromLatents), progress=False)
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    runs = report.result("runs")
    assert "the layer requires `latents`, a parameter of a name the audit does not know" in runs.message, runs.message


def test_an_empty_stream_giving_one_non_finite_row_names_no_call():
    """Pin (`_stream_taken`: every output finite under the empty stream, not some)."""
    report = diagnostics.audit(_layer(RowGated), progress=False)
    assert report.status == "inconclusive" and not report.declaration, report.status_reason
    assert "with no tokens it returns non-finite outputs" in report.status_reason


def test_a_required_keyword_only_parameter_is_still_a_usage_error():
    with pytest.raises(AuditUsageError, match=r"got `rel_bias` in forward\(x, \*, rel_bias\)\. Fix: declare how"):
        diagnostics.audit(_layer(KeywordTable), progress=False)


DIFFUSERS = [
    ("transformers.consisid_transformer_3d:PerceiverAttention",
     "call=lambda layer, x: layer(latents=x, image_embeds=x[:, :0])"),
    ("transformers.consisid_transformer_3d:PerceiverCrossAttention",
     "call=lambda layer, x: layer(hidden_states=x, image_embeds=x)"),
    ("transformers.transformer_sana_wm:MultiHeadCrossAttention",
     "call=lambda layer, x, mask: layer(x, cond=x, mask=mask)"),
]


@pytest.mark.parametrize("name, declaration", DIFFUSERS, ids=[n.split(":")[1] for n, _ in DIFFUSERS])
def test_diffusers_layers_with_a_required_stream_of_their_own_name_pass_with_the_call_their_report_names(name,
                                                                                                     declaration):
    """diffusers' own, built as its sweep builds them: they were usage errors; each now names the call, and passes
    with it (ConsisID's Perceiver attention with its image tokens' LayerNorm not measured: none given)."""
    pytest.importorskip("diffusers", reason="diffusers is not installed (the zoo extra)")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sweep_diffusers as sd

    report = diagnostics.audit(sd.diffusers_build(name), progress=False)
    assert report.status == "inconclusive" and report.declaration == declaration, report.status_reason
    again = diagnostics.audit(sd.diffusers_build(name), progress=False, **_declared(report))
    assert again.status == "passed", again.status_reason


@pytest.mark.parametrize("cls", [c[0] for c in CASES], ids=[c[0].__name__ for c in CASES])
def test_at_std_0_02_in_bfloat16_the_same_call_is_named_the_layer_passes_and_its_unscaled_twin_fails(cls):
    """The scale people train at: GPT-2's initialisation (std 0.02 weights, zero biases), in bfloat16."""
    import correct

    def made(**kw):
        layer = _layer(cls, **kw)
        correct.gpt2_init_(layer)
        return layer.to(torch.bfloat16)

    report = diagnostics.audit(made(), progress=False, dtype=torch.bfloat16)
    assert report.declaration == next(d for c, d, _, _ in CASES if c is cls), report.status_reason
    declared = _declared(report)
    assert diagnostics.audit(made(), progress=False, dtype=torch.bfloat16, **declared).status == "passed"
    buggy = diagnostics.audit(made(scaled=False), progress=False, dtype=torch.bfloat16, **declared)
    assert buggy.status == "failed" and buggy.result("softmax_saturation").verdict == "fail", buggy.status_reason
