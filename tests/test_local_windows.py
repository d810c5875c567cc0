"""Local attention over buckets with a look-around (local-attention's LocalAttention: each query attends its own
bucket of W tokens and the buckets on either side), given a key mask: a module that owns no parameters and takes q,
k and v is audited at a width of its own choosing (no d_model needed), and the window of the layer's own making is
read from its weights (`Probe.own_reach`):

- a query whose whole window the audit's padding blocks has no key to attend, for the layer, though the audit's mask
  allows keys outside that window: `mask_honoured` judged it as held and failed the correct layer;
- the window's bounds sit at multiples of W by design: a shift of 5 tokens moved them, and `relative_positions`
  failed the correct layer; it now shifts by a multiple of W (8 for W = 4).

The correct layer passes with the one declaration its report names, and its twins (the mask ignored, the mask
applied after the softmax, q·k unscaled) fail under it on the same inputs. The package's own class is swept by
`python benchmarks/sweep.py local_attention`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import diagnostics
from diagnostics._probe import Probe
from diagnostics._subject import make_subject


class LookAroundAttention(nn.Module):
    """forward(q, k, v, mask=None) on (B, T, d): buckets of `window` tokens, each query attending its own bucket and
    its two neighbours (zeros beyond the ends, blocked); `mask`: one entry per token, the tokens that may be attended
    (its convention is the audit's to read, as local-attention's states none). `bug`: None, "ignored" (the mask never
    applied), "after" (applied after the softmax), "unscaled" (q·k not divided by sqrt(d))."""

    def __init__(self, window: int = 4, bug: str | None = None):
        super().__init__()
        self.window, self.bug = window, bug

    def around(self, t: torch.Tensor, pad: float) -> torch.Tensor:
        """(B, n, W, ...) buckets -> (B, n, 3W, ...): the bucket before, this one, the one after."""
        padded = F.pad(t, (0, 0) * (t.dim() - 2) + (1, 1), value=pad)  # (B, n + 2, W, ...)
        return torch.cat([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], dim=2)

    def forward(self, q, k, v, mask=None):
        B, T, d = q.shape  # batch, tokens, width
        W = self.window
        assert T % W == 0, f"sequence length {T} must be divisible by the window size {W}"
        n = T // W  # buckets
        bq, bk, bv = (t.reshape(B, n, W, d) for t in (q, k, v))
        bk, bv = self.around(bk, 0.0), self.around(bv, 0.0)  # (B, n, 3W, d)
        scale = 1.0 if self.bug == "unscaled" else d ** -0.5
        dots = torch.einsum("bnid,bnjd->bnij", bq * scale, bk)  # (B, n, W, 3W)
        position = torch.arange(T, dtype=q.dtype).reshape(1, n, W, 1)
        beyond = self.around(position, -1.0).squeeze(-1) < 0  # (1, n, 3W): past either end
        blocked = beyond[:, :, None, :]  # (1, n, 1, 3W)
        if mask is not None and self.bug != "ignored":
            keep = self.around(mask.reshape(B, n, W, 1).to(q.dtype), 0.0).squeeze(-1) > 0  # (B, n, 3W)
            blocked = blocked | ~keep[:, :, None, :]
        fill = -torch.finfo(dots.dtype).max
        if self.bug == "after":
            weights = dots.masked_fill(beyond[:, :, None, :], fill).softmax(-1).masked_fill(blocked, 0.0)
        else:
            weights = dots.masked_fill(blocked, fill).softmax(-1)
        return torch.einsum("bnij,bnjd->bnid", weights, bv).reshape(B, T, d)


def _audit(bug=None, dtype=torch.float32, **kw):
    return diagnostics.audit(LookAroundAttention(bug=bug), progress=False, dtype=dtype, **kw)


def _failed(report) -> set[str]:
    return {r.detector for r in report.results if r.verdict == "fail"}


class RotaryTable(LookAroundAttention):
    """The same, with a table of one width kept as a buffer (local-attention's rotary `inv_freq`, built for its
    `dim`): it takes that width only."""

    def __init__(self, width: int = 32, **kw):
        super().__init__(**kw)
        self.register_buffer("table", torch.ones(width))

    def forward(self, q, k, v, mask=None):
        return super().forward(q * self.table, k, v, mask)


def test_a_core_without_parameters_is_audited_at_the_narrowest_width_it_runs_at():
    report = _audit()
    assert "d_model=8 chosen: the narrowest of 8, 16, 32, 64, 128" in str(report), report
    assert report.declaration == "mask='key_keep'", report  # its mask's convention: named, not failed
    fixed = diagnostics.audit(RotaryTable(), progress=False, mask="key_keep")
    assert "d_model=32 chosen" in str(fixed) and fixed.passed, fixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_passes_with_its_declaration_and_its_twins_fail(dtype):
    correct = _audit(mask="key_keep", dtype=dtype)
    assert correct.passed, correct
    for detector in ("mask_honoured", "relative_positions", "weight_row_sums", "softmax_saturation"):
        assert correct.result(detector).verdict == "pass", (detector, correct)
    assert "shifting every position by 8" in correct.result("relative_positions").message
    for bug, detector in (("ignored", "mask_honoured"), ("after", "mask_honoured"),
                          ("unscaled", "softmax_saturation")):
        twin = _audit(bug, mask="key_keep", dtype=dtype)
        assert detector in _failed(twin), (bug, twin)


def test_own_reach_is_the_window():
    """The keys each query reaches, read from the weights through the values: its bucket and the two beside it."""
    probe = Probe(make_subject(LookAroundAttention(), mask="key_keep"), causal=False, scale=None, seq_len=16, seed=0)
    reach = probe.own_reach()
    bucket = torch.arange(probe.t) // 4
    assert torch.equal(reach, (bucket[:, None] - bucket[None, :]).abs() <= 1)


def test_declared_window_passes_and_the_unscaled_twin_fails():
    """Declared, the window blocks every key of a query whose neighbourhood the padding covers: the layer fills that
    row with -finfo.max, one number throughout, and softmax_saturation read q·k multiplied by 0 there (a false
    "flat"). Such rows are left out of the fit; the unscaled twin still fails on the same inputs."""
    window = diagnostics.patterns.Pattern(lambda b, h, q, kv: (q // 4 - kv // 4).abs() <= 1,
                                          "buckets of 4, look-around 1")
    correct = _audit(mask="key_keep", pattern=window)
    assert correct.passed, correct
    unscaled = _audit("unscaled", mask="key_keep", pattern=window)
    assert "softmax_saturation" in _failed(unscaled), unscaled
