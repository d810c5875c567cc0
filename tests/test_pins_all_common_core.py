"""Pins for the survivors of the full mutation runs over the shared endings and probes of the detectors and the
perturb-and-compare pipeline (issue 37: `benchmarks/mutations.py --all --only detectors/_common.py`, then `--only
_core.py`, at ff5444f). As in tests/test_pins.py, each pin has its twin on the same inputs (a case on each side of
the comparison, guard or constant it pins), the numbers quoted as literals; each test says which mutant it pins (its
line number the run's, at ff5444f). Small layers written here, one detector at small sizes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._core import Case, Comparison, held
from diagnostics._errors import ProbeNotTaken
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics._thresholds import UNCHANGED, tolerance
from diagnostics.detectors._common import logit_gain


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], progress=False, **kw).result(detector)


class Attention(nn.Module):
    """Self-attention (16 wide, 2 heads, seed 0), mask bool (B, 1, T, T), True = may attend. `latents`: that many
    learned queries of its own over the tokens, (B, latents, width) out; `width`: the output projection's; `out`:
    "rows" (B, T, width), "scalars" (B, T) (each row's features summed), "column" (B, T, 1), "sums" (B,) (one number
    per sequence); `heads_by_index`: the heads reordered through an integer parameter (an index table, as a
    relative-position index is kept); `detach`: the weights detached from autograd (a gradient bug)."""

    def __init__(self, *, latents: int = 0, width: int = 16, out: str = "rows", heads_by_index: bool = False,
                 detach: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.num_heads, self.out, self.detach = 2, out, detach
        self.latent = nn.Parameter(torch.randn(1, latents, 16)) if latents else None
        self.q, self.kv, self.proj = nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(16, width)
        # an integer parameter: no gradient, and no float64 in the float64 copy (an index stays an index)
        self.order = nn.Parameter(torch.tensor([1, 0]), requires_grad=False) if heads_by_index else None

    def forward(self, x, mask=None):
        B, T, C = x.shape  # batch, sequence length, d_model
        H, d = self.num_heads, C // self.num_heads
        src = x if self.latent is None else self.latent.expand(B, -1, -1)  # (B, Q, C)
        Q = src.shape[1]
        q = self.q(src).view(B, Q, H, d).transpose(1, 2)  # (B, H, Q, d)
        k, v = self.kv(x).view(B, T, 2, H, d).permute(2, 0, 3, 1, 4)  # (B, H, T, d) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B,H,Q,d) x (B,H,d,T) -> (B,H,Q,T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: blocked keys get weight 0
        weights = scores.softmax(-1)
        weights = weights.detach() if self.detach else weights
        heads = weights @ v  # (B,H,Q,T) x (B,H,T,d) -> (B,H,Q,d)
        if self.order is not None:
            heads = heads[:, self.order]
        y = self.proj(heads.transpose(1, 2).reshape(B, Q, C))  # (B, Q, width)
        return {"rows": y, "scalars": y.sum(-1), "column": y.sum(-1, keepdim=True), "sums": y.sum((1, 2))}[self.out]


# ---- _common.own_queries_seen: a row per token at the standard length, and an output with no rows ----------------


@pytest.mark.parametrize(("seq_len", "expected"), [(16, "fail"), (12, "skip")])
def test_learned_queries_as_many_as_the_tokens_are_read_as_a_row_per_token(seq_len, expected):
    """`_own_queries_seen`'s `seen is None or seen == T` (L71, `or` made `and`): 16 learned queries projected to
    8 wide give (B, 16, 8). Audited at 16 tokens the output has a row per token, so its width is judged as a row
    per token's: the wrong shape (with `and`, 16 rows again at 8 tokens made it a layer with 16 queries of its own).
    Its twin, the same layer at 12 tokens: 16 rows at two lengths, a declaration of queries=16 (a skip)."""
    found = verdict(Attention(latents=16, width=8), "output_shape", seq_len=seq_len)
    assert found.verdict == expected, found
    if expected == "skip":
        assert found.message.startswith("needs a declaration, queries=16"), found
    else:
        assert found.message == "the output has the wrong shape" and not found.declaration, found


@pytest.mark.parametrize(("out", "latents", "expected"), [("sums", 0, "fail"), ("rows", 1, "skip")])
def test_an_output_of_one_number_per_sequence_has_no_rows_and_one_vector_is_one_query(out, latents, expected):
    """`_rows_of`'s `out.dim() < 2 or out.shape[0] != batch` (L84, `or` made `and`): an output (B,), one number per
    sequence, has no rows to count: the wrong shape (with `and` it read a second axis it lacks, and output_shape
    raised). Its twin, one learned query's row, (B, 1, 16): one row at every length, a declaration of queries=1."""
    found = verdict(Attention(out=out, latents=latents), "output_shape")
    assert found.verdict == expected, found
    if expected == "fail":
        assert found.message == "the output has the wrong shape", found
    else:
        assert found.message.startswith("needs a declaration, queries=1"), found


# ---- _common.float64_copy: integer parameters and a forward patched on the instance --------------------------------


@pytest.mark.parametrize(("detach", "expected"), [(False, "pass"), (True, "fail")], ids=["correct", "detached"])
def test_the_float64_copy_keeps_an_integer_parameter_an_integer(detach, expected):
    """`float64_copy`'s `__deepcopy__ is Parameter.__deepcopy__ and p.is_floating_point()` (L247, `and` made `or`):
    an integer parameter (the heads' order, an index) is deep-copied and stays an integer, so the float64 copy
    runs: the correct layer passes the gradient check (with `or` it became float64, indexing raised and gradients
    was not measured); its twin with the weights detached fails it."""
    found = verdict(Attention(heads_by_index=True, detach=detach), "gradients")
    assert found.verdict == expected, found


def patched(layer: nn.Module) -> nn.Module:
    """`layer.forward` replaced on the instance by a closure over the original bound method and over a helper
    function of its own (a function whose closure is empty)."""
    forward = layer.forward

    def halved(x):
        return x / 2

    def wrapper(x, mask=None):
        return 2 * halved(forward(x, mask))

    layer.forward = wrapper
    return layer


@pytest.mark.parametrize(("detach", "expected"), [(False, "pass"), (True, "fail")], ids=["correct", "detached"])
def test_the_float64_copy_of_a_patched_forward_keeps_a_helper_without_a_closure_as_it_is(detach, expected):
    """`_rebound`'s `isinstance(value, FunctionType) and value.__closure__` (L269, `and` made `or`): the patched
    forward's closure holds a helper with no closure of its own, kept as it is (with `or` it was re-made from its
    closure, None, and the copy raised: gradients not measured). The copy's forward reaches the copy's parameters:
    the correct layer passes, its twin with the weights detached fails."""
    found = verdict(patched(Attention(detach=detach)), "gradients")
    assert found.verdict == expected, found


# ---- _common._gradient_probe: the graph kept for the causal second backward --------------------------------------


@pytest.mark.parametrize("seq_len", [2, 3, 16])
def test_a_causal_gradient_check_takes_its_second_backward_through_the_first_ones_graph(seq_len):
    """`retain_graph=probe.causal and T >= 2` (L375, `>=` made `>` or `<=`): `_future_gradient` runs wherever the
    audit is causal and T >= 2, and reads the graph the first backward kept; where it was not kept, its backward
    raises and it makes a forward of its own (one pass more, the same verdict). So 11 passes at T = 2, 3 and 6 (the
    gradient probe's 6 tokens at seq_len 16; one of them the forward that reads its tokens' gain, `gradient_gain`):
    with `T > 2` 12 at T = 2, with `T <= 2` 12 from T = 3 on. (`or` for `and` keeps a graph nobody reads again: the
    same values and passes; marked equivalent.)"""
    report = diagnostics.audit(Attention(), detectors=["gradients"], causal=True, seq_len=seq_len, progress=False)
    assert report.result("gradients").verdict == "pass", report.result("gradients")
    assert report.forward_passes == 11, report.forward_passes


# ---- _common._logit_gain: the gain where no spread can be read ----------------------------------------------------


def constant_scores(score: float, *, keys: int | None = None):
    """A function whose scores are `score` everywhere, whatever q and k; `keys`: each query sees that many keys,
    itself and the next (cyclically), its own score 0.5 above the others', the rest masked with -inf."""

    def layer(q, k, v, mask=None):
        B, H, T, _ = q.shape
        scores = torch.full((B, H, T, k.shape[-2]), score, dtype=q.dtype)
        if keys is not None:
            i, j = torch.arange(T).unsqueeze(-1), torch.arange(k.shape[-2])
            seen = torch.where((j - i) % T < keys, 0.0, float("-inf")) + 0.5 * (j == i)  # (Tq, Tk)
            scores = scores + seen.to(q.dtype)
        weights = scores.softmax(-1)
        return weights @ v, weights

    return layer


def gain(layer, dtype=torch.float32) -> float:
    probe = Probe(make_subject(layer, d_model=16, num_heads=2, dtype=dtype), causal=False, scale=None, seq_len=16,
                  seed=0)
    return logit_gain(probe)


@pytest.mark.parametrize(("keys", "expected"), [(1, 10.0), (2, math.sqrt(2.0 / (0.5 / math.sqrt(2.0))))])
def test_the_logit_gain_is_10_where_no_row_weighs_two_keys(keys, expected):
    """`_logit_gain`'s `return 10.0` where no row has two keys of weight > 0 (L488, x10 and x0.1): rows that see
    one key each have no spread to read, and the gain is the one used where no weights are exposed. Its twin, each
    row seeing two keys 0.5 apart (a spread of 0.5 / sqrt(2)): sqrt(2 / that) = 2.378."""
    assert gain(constant_scores(0.0, keys=keys)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(("score", "expected"), [(1.5e308, 10.0), (1e307, 100.0)])
def test_the_logit_gain_is_10_where_the_spread_is_not_finite(score, expected):
    """`_logit_gain`'s `return 10.0` where the spread is not finite (L491, x10 and x0.1): float64 scores of 1.5e308
    at every key give uniform weights, but their sum over 16 keys overflows (2.4e308) and the spread reads inf:
    the gain is the one used where no weights are exposed. Its twin, scores of 1e307 (their sum 1.6e308, finite):
    a spread of 0, uniform to the rounding, and the cap, 100."""
    assert gain(constant_scores(score), torch.float64) == expected


def kernel_attention(q, k, v, mask=None):
    """Linear attention (elu + 1 feature maps): no softmax and no weights returned, so no logit spread to read."""
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1  # (B, H, T, d)
    return (fq @ (fk.transpose(-2, -1) @ v)) / (fq @ fk.sum(-2, keepdim=True).transpose(-2, -1)), None


@pytest.mark.parametrize("layer", ["kernel", "softmax"])
def test_the_gradient_checks_gain_falls_back_to_the_standard_probes_where_their_tokens_show_no_weights(layer):
    """`gradient_gain` reads the gain on the gradient checks' own tokens (their float64 forward at their plain size);
    where that forward shows no weights (a kernel's attention: no softmax), the standard probe's gain, 10 where none
    were exposed there either. Its twin, softmax attention, gets the gain its own tokens' rows read (scores the same
    for any tokens here, so the standard probe's too; tests/test_parameters_saturated.py shows the two apart)."""
    from diagnostics.detectors._common import LOGIT_SPREAD, float64_copy_or_skip, gradient_probe

    fn = kernel_attention if layer == "kernel" else constant_scores(0.0, keys=2)
    probe = Probe(make_subject(fn, d_model=16, num_heads=2), causal=False, scale=None, seq_len=16, seed=0)
    probe.detector = "gradients"
    made = gradient_probe(probe, float64_copy_or_skip(probe, "gradients"))
    if layer == "kernel":
        assert made.gain == logit_gain(probe) == 10.0
    else:  # scores of 0.5 on the own key and 0 on the next, whatever the tokens: spread 0.5 / sqrt(2), at any gain
        assert made.gain == pytest.approx(math.sqrt(LOGIT_SPREAD / (0.5 / math.sqrt(2.0))), rel=1e-6)


# ---- _core.compared: an output with no row axis --------------------------------------------------------------------


@pytest.mark.parametrize(("out", "expected"), [("scalars", "skip"), ("column", "pass")])
def test_an_output_of_one_number_per_position_is_not_compared_row_by_row(out, expected):
    """`compared`'s `out.dim() >= 3 and out.shape[0] == n * B and out.shape[1] == rows` (L237, its second `and` made
    `or`): (B, T), one number per position, has no row per query and batch element, whatever its second axis: a
    skip that says so (with `or` its positions were read as features, and mask_honoured raised). Its twin, the same
    numbers as (B, T, 1), is judged: the layer honours the mask."""
    found = verdict(Attention(out=out), "mask_honoured")
    assert found.verdict == expected, found
    if expected == "skip":
        assert "has no row per query and batch element" in found.message, found


# ---- _core.held: a change of exactly the tolerance is no change --------------------------------------------------


def exactly(tol: float, dtype) -> float:
    """The tolerance as a change of `dtype` reads it (torch compares a float32 tensor with a Python float rounded to
    float32): float32's 1e-5 is 9.999999747378752e-06, float64's 1e-10 the tolerance itself."""
    return float(torch.tensor(tol, dtype=dtype))


def step_above(x: float, dtype) -> float:
    return float(torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(1.0, dtype=dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("above", [False, True], ids=["at", "one step above"])
def test_a_held_row_that_moves_by_exactly_the_tolerance_has_not_moved(dtype, above):
    """`held`'s `bad += int((checked > tol).sum())` (L299, `>` made `>=`): a change is measured in float32 (float64
    for float64 layers) and compared with the tolerance, so a layer can move a held row by exactly the tolerance
    (m37k's relative_positions pin builds one): that is rounding, not a move; one step of the change's dtype more is
    a held row that moved. Per dtype: float32's 1e-5 and float64's 1e-10 (tolerance(UNCHANGED, dtype))."""
    tol = tolerance(UNCHANGED, dtype)
    change = exactly(tol, dtype)
    change = step_above(change, dtype) if above else change
    hold = torch.tensor([[False, True, True]])
    comparison = Comparison([Case(None, hold, "when one key changed")],
                            [torch.tensor([[1.0, change, 0.0]], dtype=dtype)], tol, None)
    bad, worst, text, _ = held(comparison, SimpleNamespace(subject=SimpleNamespace(dtype=dtype)), what="held rows")
    assert (bad, worst) == (int(above), change), text
    assert text.startswith(f"{int(above)} / 2 held rows changed"), text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("above", [False, True], ids=["at", "one step above"])
def test_a_row_that_must_move_and_moves_by_exactly_the_tolerance_did_not_respond(dtype, above):
    """`held`'s `if not bool((moved > tol).any())` (L306, `>` made `>=`): a row a correct layer moves that moved by
    exactly the tolerance did not move (the layer is unresponsive there, and its held rows prove nothing); one step
    more, it responded."""
    tol = tolerance(UNCHANGED, dtype)
    change = exactly(tol, dtype)
    change = step_above(change, dtype) if above else change
    hold, move = torch.tensor([[True, False]]), torch.tensor([[False, True]])
    comparison = Comparison([Case(None, hold, "when its own query changed", move)],
                            [torch.tensor([[0.0, change]], dtype=dtype)], tol, None)
    _, _, _, unresponsive = held(comparison, SimpleNamespace(subject=SimpleNamespace(dtype=dtype)), what="rows")
    assert unresponsive == ("" if above else "when its own query changed: no output moved, not even the rows a "
                                            "correct layer moves"), unresponsive


# ---- _core.not_run: a probe the layer as held cannot be given ------------------------------------------------------


def refusing_stacks(error: type[Exception]):
    """Scaled dot-product attention on (B, H, T, d) that raises `error` on a batch of more than 2 (compare()'s
    stacked call: the baseline and its perturbations) and on a batch of one (else the stack is made in parts of 2,
    Probe._in_batches, a row alone coming out as in a part)."""

    def layer(q, k, v, mask=None):
        if q.shape[0] != 2:
            raise error("a stacked batch")
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v  # (B, H, Tq, d)

    return layer


@pytest.mark.parametrize(("error", "message"), [
    (ProbeNotTaken, "not measured: not applicable: a stacked batch; see `runs`"),
    (RuntimeError, "not measured: the layer raised on this detector's probe (RuntimeError: a stacked batch); see "
                   "`runs`")], ids=["not taken", "raised"])
def test_a_probe_the_layer_as_held_cannot_be_given_is_not_applicable_not_a_raise(error, message):
    """`not_run`'s `if call.not_taken:` (L323, made never to fire): a probe refused with ProbeNotTaken (as a layer
    held in place refuses a length its captured arguments cannot take, diagnostics.model._inplace) is not applicable,
    with its reason; its twin, the same call raising RuntimeError, is the layer's raise."""
    found = verdict(refusing_stacks(error), "mask_honoured", d_model=16, num_heads=2)
    assert (found.verdict, found.message) == ("skip", message), found
