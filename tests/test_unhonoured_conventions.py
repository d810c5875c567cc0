"""A layer that takes its mask in another convention and honours it in none: a convention mismatch, never a FAIL.

Sinkhorn's `SinkhornSelfAttention` (sinkhorn-transformer 0.11.4) takes `input_mask` as (B, T), True = keep, and
raises on the audit's default (B, 1, Tq, Tk) mask. Given its mask as (B, T) it runs, but its sort net routes buckets by
the padded tokens too, so in no convention do the blocked keys leave the kept rows alone (its own bug, confirmed by a
plain script in tests/test_sweep_packages.py). Before, `_needed_declaration` named a declaration only for a convention
the layer honours: such a layer failed `runs` for the mismatch (the audit's reading, not its bug), or, where a length
rule of its own came first, was inconclusive with "return the weights" as the remedy. Now the report names the
convention it runs in first, and with that declaration `mask_honoured` fails on the real bug.

The layers here are of our own writing, in that shape: attention over a (B, T) keep mask plus a summary of the sequence
added to every token, pooled over every token (the bug: padding included) or over the kept ones (correct), with and
without a length rule of their own. Each bug test has its twin on the same inputs.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import diagnostics


def _line_of(function, text: str) -> int:
    """The line of `function`'s source that holds `text`: where a finding's site must point."""
    source, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(source) if text in line)


class PooledSummary(nn.Module):
    """Self-attention over `input_mask`, plus a linear summary of the unmasked tokens' mean added to every token's
    output. `bucket`: the layer's own check that T is a multiple of it (Sinkhorn's, local attention's). (No docstring
    here states the mask's convention: a stated one is read, and the twins would not be audited alike.)"""

    def __init__(self, d_model: int = 32, heads: int = 4, bucket: int | None = None, std: float | None = None):
        super().__init__()
        self.heads, self.bucket = heads, bucket
        self.to_qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.to_out = nn.Linear(d_model, d_model)
        self.summary = nn.Linear(d_model, d_model)
        if std is not None:  # the scale people train at
            for p in self.parameters():
                nn.init.normal_(p, std=std)

    def pooled(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        w = keep.unsqueeze(-1).to(x.dtype)
        return (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1)

    def forward(self, x: torch.Tensor, input_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        if self.bucket:
            assert T % self.bucket == 0, f"sequence {T} needs to be divisible by bucket size {self.bucket}"
        keep = torch.ones(B, T, dtype=torch.bool, device=x.device) if input_mask is None else input_mask
        q, k, v = self.to_qkv(x).chunk(3, -1)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~keep.view(B, 1, 1, T), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
        return self.to_out(out) + self.summary(self.pooled(x, keep))


class PooledOverPadding(PooledSummary):
    """The bug: the summary averages every token, padding included, so padded keys move every kept row."""

    def pooled(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return x.mean(1, keepdim=True)


CASES = [pytest.param(bucket, dtype, std, id=f"bucket={bucket}-{str(dtype)[6:]}-std={std}")
         for bucket, dtype, std in ((None, torch.float32, None), (4, torch.float32, None),
                                    (None, torch.bfloat16, 0.02), (4, torch.bfloat16, 0.02))]


def built(cls, bucket, dtype, std):
    torch.manual_seed(0)
    return cls(bucket=bucket, std=std).to(dtype)


@pytest.mark.parametrize("bucket, dtype, std", CASES)
def test_a_mask_honoured_in_no_convention_needs_the_declaration_it_runs_in(bucket, dtype, std):
    """Zero-config, the buggy layer is no FAIL for the mismatch: runs is a skip naming mask='key_keep' (the first
    convention it runs in; key_padding, the other meaning, listed beside it), saying that it honours none; with that
    declaration mask_honoured fails and points at no `runs` failure."""
    report = diagnostics.audit(built(PooledOverPadding, bucket, dtype, std), progress=False)
    runs = report.result("runs")
    assert report.status == "inconclusive" and report.declaration == "mask='key_keep'", report
    assert runs.verdict == "skip" and "in none of the conventions it runs in" in runs.message.lower(), runs
    assert "key_padding" in runs.message, runs.message  # the other meaning, for the layer's own words to decide
    if bucket:  # its length rule is said beside the declaration, not instead of it
        assert "no multiple of the 4" in runs.message, runs.message
    declared = diagnostics.audit(built(PooledOverPadding, bucket, dtype, std), progress=False, mask="key_keep")
    assert declared.status == "failed" and declared.result("mask_honoured").verdict == "fail", declared
    assert declared.result("runs").verdict in ("pass", "skip"), declared.result("runs")


@pytest.mark.parametrize("bucket, dtype, std", CASES)
def test_its_twin_that_honours_the_mask_needs_the_same_declaration_and_passes_with_it(bucket, dtype, std):
    """The twin pooling over the kept tokens: the same declaration, read from what it does ("honours it"), and a
    pass once declared, on the same inputs."""
    report = diagnostics.audit(built(PooledSummary, bucket, dtype, std), progress=False)
    assert report.status == "inconclusive" and report.declaration == "mask='key_keep'", report
    assert "honours it" in report.result("runs").message, report.result("runs")
    declared = diagnostics.audit(built(PooledSummary, bucket, dtype, std), progress=False, mask="key_keep")
    assert declared.status == "passed", declared


class RaisesOnEveryMask(PooledSummary):
    """A layer that raises whatever mask it is given: no convention it runs in, so nothing to declare."""

    def forward(self, x, input_mask=None):
        if input_mask is not None:
            raise RuntimeError("masks are not supported yet")
        return super().forward(x)


def test_a_layer_that_runs_in_no_convention_still_fails_runs():
    """The declaration is named only for a convention the layer runs in: one that raises on every mask fails `runs`
    (its mask parameter is broken), as before."""
    torch.manual_seed(0)
    report = diagnostics.audit(RaisesOnEveryMask(), progress=False)
    assert report.result("runs").verdict == "fail" and not report.declaration, report


def test_behind_its_length_rule_a_mask_it_refuses_in_every_convention_still_fails_runs():
    """A length rule of its own (T = 1 refused) no longer hides the mask probes that raised at the probe's own
    length: runs, settled once every detector has run, fails and quotes them (it was the length skip, and the mask
    detectors said "see runs"). Its twin that runs given its mask as key_keep needs that declaration (above)."""
    torch.manual_seed(0)
    report = diagnostics.audit(RaisesOnEveryMask(bucket=4), progress=False)
    runs = report.result("runs")
    assert runs.verdict == "fail" and "masks are not supported yet" in runs.evidence, runs
    assert not report.declaration, report


class KeyOrPairMask(PooledOverPadding):
    """Takes `input_mask` one per key or one per (query, key) pair (some layers accept either), and raises on any
    other form; its summary pools over padding (the bug), so it honours neither. (Its docstring states no convention:
    a stated one is read.)"""

    def forward(self, x, input_mask=None):
        B, T, D = x.shape
        if input_mask is None:
            return super().forward(x)
        if input_mask.dim() != 2:
            raise ValueError("unsupported input_mask")
        if tuple(input_mask.shape) == (T, T) and B != T:  # one per pair: a key is kept where some query keeps it
            input_mask = input_mask.any(0, keepdim=True).expand(B, T)
        return super().forward(x, input_mask)


def test_a_mask_named_by_its_stream_is_first_offered_one_entry_per_token():
    """Routing Transformer's `input_mask` runs given (Tq, Tk) too, and (Tq, Tk) comes first in the audit's order of
    conventions: it was the one named, though a mask named by its stream is one entry per token. The name now suggests
    mask='key_keep', offered first; the pair form is listed only where its meaning differs. Declared, the leak fails."""
    torch.manual_seed(0)
    report = diagnostics.audit(KeyOrPairMask(), progress=False)
    assert report.declaration == "mask='key_keep'", report
    torch.manual_seed(0)
    declared = diagnostics.audit(KeyOrPairMask(), progress=False, mask="key_keep")
    assert declared.result("mask_honoured").verdict == "fail", declared


class ViewedTokens(nn.Module):
    """Takes the audit's own mask (B, 1, Tq, Tk), and (B, Tk) too; its one defect is `x.view(B * T, D)`, which raises
    on non-contiguous inputs (`flat_view=False`: its twin, `reshape`). `bucket`: a length rule of its own."""

    def __init__(self, flat_view: bool = True, bucket: int | None = None):
        super().__init__()
        self.flat_view, self.bucket = flat_view, bucket
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        if self.bucket:
            assert T % self.bucket == 0, f"sequence {T} needs to be divisible by bucket size {self.bucket}"
        flat = x.view(B * T, D) if self.flat_view else x.reshape(B * T, D)
        q, k, v = (t.view(B, T, 4, -1).transpose(1, 2) for t in self.qkv(flat).view(B, T, -1).chunk(3, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~(mask[:, None, None, :] if mask.dim() == 2 else mask), float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("causal", [False, True])
def test_a_raise_the_mask_does_not_cause_names_no_declaration(causal):
    """Under a causal audit every call carries a mask, and the non-contiguous call's raise ran again given its mask one
    batch row at a time (contiguous there): a declaration was named, under which the `view` bug passed. The refused
    calls must run with no mask at all first; and a layer that honours the audit's own mask has no convention to
    declare. runs fails at the `view`; its twin passes on the same inputs."""
    torch.manual_seed(0)
    report = diagnostics.audit(ViewedTokens(), progress=False, causal=causal)
    runs = report.result("runs")
    assert runs.verdict == "fail" and not report.declaration, report
    line = _line_of(ViewedTokens.forward, "flat = x.view")
    assert [site.line for site in runs.where][:1] == [line], [site.describe() for site in runs.where]
    torch.manual_seed(0)
    assert diagnostics.audit(ViewedTokens(flat_view=False), progress=False, causal=causal).passed


def test_behind_a_length_rule_the_failure_counts_and_points_at_the_layers_own_raise():
    """Settled past its length rule, runs counted the lengths the rule refused among the failures ("raised on 4 of the
    audit's probes") and pointed at the rule's `assert`; those are skipped, not failed: one failure, at the `view`."""
    torch.manual_seed(0)
    runs = diagnostics.audit(ViewedTokens(bucket=4), progress=False).result("runs")
    assert runs.verdict == "fail" and runs.message == "the layer raised on 1 of the audit's probes", runs
    assert "no multiple of the 4 its own check asks for, and those probes are skipped" in runs.evidence, runs
    line = _line_of(ViewedTokens.forward, "flat = x.view")
    assert [site.line for site in runs.where][:1] == [line], [site.describe() for site in runs.where]


class PadMaskOverPadding(PooledOverPadding):
    """PooledOverPadding whose mask is named `pad_mask` and marks padding: True = a padded token."""

    def forward(self, x, pad_mask=None):
        return super().forward(x, None if pad_mask is None else ~pad_mask)


def test_a_pad_mask_suggests_key_padding_not_key_keep():
    """`pad_mask` matched the stream names' `pad_` and suggested key_keep, the opposite meaning; `pad`, as
    `padding`, now suggests key_padding first (the other meaning listed). Declared, the leak fails."""
    torch.manual_seed(0)
    report = diagnostics.audit(PadMaskOverPadding(), progress=False)
    assert report.declaration == "mask='key_padding'", report
    torch.manual_seed(0)
    declared = diagnostics.audit(PadMaskOverPadding(), progress=False, mask="key_padding")
    assert declared.result("mask_honoured").verdict == "fail", declared


class BucketedMemory(nn.Module):
    """Cross-attention whose memory must come in buckets of 4 tokens (its own check, on the keys only): correct, and
    it takes no mask. The audit's one-token probe is refused by that rule."""

    def __init__(self, d_model: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(d_model, d_model, bias=False)
        self.to_kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.to_out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        (B, T, D), S = x.shape, context.shape[1]
        assert S % 4 == 0, f"memory length {S} needs to be divisible by bucket size 4"
        q = self.to_q(x).view(B, T, self.heads, -1).transpose(1, 2)
        k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in self.to_kv(context).chunk(2, -1))
        out = ((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
        return self.to_out(out)


def test_a_length_rule_on_the_keys_alone_refuses_the_cross_length_probe_and_fails_nothing():
    """A correct cross-attention whose rule is on its memory alone: the lengths it refuses (T = 1) are skipped, the
    rule named, and the layer passes; no raise at the probe's own length settles `runs` as a FAIL."""
    torch.manual_seed(0)
    report = diagnostics.audit(BucketedMemory(), progress=False)
    runs = report.result("runs")
    assert runs.verdict == "skip" and "length_rule" in runs.extras, runs
    assert report.status != "failed", report
