"""The terminal report's one-line rows: an exception the layer raised on several detectors' probes is quoted once,
and the later rows name the row that quoted it (issue 18: "long skip reasons and repeated exceptions folded")."""

from __future__ import annotations

import torch

import diagnostics
from diagnostics._report import result_rows
from diagnostics._result import DetectorResult

VIEW = ("(RuntimeError: view size is not compatible with input tensor's size and stride (at least one dimension "
        "spans across two contiguous subspaces). Use .reshape(...) instead.)")


def skip(detector: str, quoted: str) -> DetectorResult:
    return DetectorResult(detector, "skip", f"not measured: the layer raised on this detector's probe {quoted}")


def test_an_exception_quoted_again_is_named_not_repeated():
    rows = result_rows([skip("gradients", VIEW), skip("parameters_used", VIEW), skip("relative_positions", VIEW)])
    assert sum(VIEW in row for row in rows) == 1 and VIEW in rows[0], rows
    assert all("(RuntimeError, the one quoted at gradients)" in row for row in rows[1:]), rows


def test_different_exceptions_are_each_quoted_in_full():
    other = "(ValueError: the mask has shape (2, 16) (expected (B, 1, Tq, Tk)))"
    rows = result_rows([skip("gradients", VIEW), skip("parameters_used", other)])
    assert VIEW in rows[0] and other in rows[1], rows


class ViewAfterTranspose(torch.nn.Module):
    """Raises on the permuted-keys probe and in float64 copies: several detectors quote one exception."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, d_model
        return self.proj(x).transpose(1, 2).view(B, T, D)  # the bug: view of a transposed tensor


def test_a_layer_raising_on_several_probes_quotes_its_exception_once_in_the_rows():
    text = str(diagnostics.audit(ViewAfterTranspose()))
    rows = text.split("\n\n")[1]  # the one-line rows, before the findings' blocks
    assert rows.count("view size is not compatible") == 1, rows
    assert "the one quoted at" in rows, rows
    assert "view size is not compatible" in text.split("\n\n", 2)[2], "the finding's evidence keeps the full text"
