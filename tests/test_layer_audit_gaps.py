"""Gaps of the layer audit left after issue 34's first pass, each a cause fixed with its twins (the buggy layer caught,
the correct one passing on the same inputs).

(a) A mask finding's convention hint is read from a padding probe (the same keys blocked for every query). A layer
    that mixes query rows (heads merged without their transpose) honours such a mask in every convention it runs in,
    so honouring it in another says nothing: the hint's probe is first run as the audit called the layer (its own
    negative control), and where it is honoured there no convention is named.
(b) `keys_matter` on a layer given one memory stream (keys and values the same input) changes that stream alone, so
    its verdict is about the memory: it no longer says "the keys and the values" where the two were not told apart.
(c) `block_size` names nanoGPT's context and a flash-style kernel's tile. Read as a context, a tile of 4 refused every
    audit at the default 16 tokens ("expected seq_len <= 4"). A `block_size` the layer runs beyond (a call at the
    probe length, or at twice the tile if shorter, returns a finite row per token) bounds nothing, and the report's
    first line says so; one it refuses to run beyond (a position table of that many rows) still bounds the length.
(d) An online (flash-style) softmax in a module given one stream and no mask, its running value not rescaled when the
    running max grows: no weights can be read (values are tied to keys), identical tokens never raise the max
    (output_variance), and no shift of positions is possible (no mask to block left padding), so it was inconclusive.
    `relative_positions` saw the keys' order move the output; where the tracer then finds the unrescaled running value
    (`_tracing.unrescaled_accumulators`), that is the finding, pointed at its line.
(e) FlashAttention-1's layout (Dao et al. 2022, Algorithm 1) as tutorials write it: q, k, v split into blocks along
    the sequence in Python lists, key blocks outside, query blocks inside, each query block's O, l, m replaced in its
    list. Its output is kept normalised, so the running O is multiplied by l_old / l_new at every block whatever the
    max did; forgetting exp(m_old - m_new) beside it was read as rescaled (a mul on the way), and the bug was found
    without a line (function form, module with a mask) or not at all (module with no mask). A rescale now needs a
    factor made of an exponential (`_tracing._exponential`).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import diagnostics
from buggy_variants import VARIANTS
from correct import MultiHeadAttention

D, H = 32, 4  # d_model, heads


# ---- (a) no convention hint where the convention given is honoured --------------------------------------------


def mask_finding(layer, **kw):
    torch.manual_seed(0)
    return diagnostics.audit(layer, detectors=["mask_honoured"], **kw).result("mask_honoured")


@pytest.mark.parametrize("causal", [False, True])
def test_heads_merged_without_transpose_gets_no_convention_hint_and_its_fix_names_the_merge(causal):
    """Not causal, the causal scenario fails and the padding one passes: before, the hint's padding probe was honoured
    as allowed:Tq,Tk and the finding said "mask='allowed:Tq,Tk' declares what it does"; now it says the padding
    mask is honoured as given, and names no declaration. Causal, the hint's probe has the causal mask in it and
    fails as given too. Either way the fix shown is the merge's."""
    torch.manual_seed(0)
    result = mask_finding(VARIANTS["heads_merged_without_transpose"].build(D, H, causal=causal), causal=causal)
    assert result.verdict == "fail", result
    assert "Tq,Tk" not in result.message and "declares what it does" not in result.message, result.message
    if not causal:
        assert "so the mask's convention is not the cause" in result.message, result.message
        assert "mask=" not in result.message and "mask=" not in result.fix, result
    fix, general = result.remedy
    assert not general and "transpose(1, 2).reshape" in fix, fix


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_passes_mask_honoured_on_the_same_inputs(causal):
    torch.manual_seed(0)
    result = mask_finding(MultiHeadAttention(D, H, causal=causal), causal=causal)
    assert result.verdict == "pass", result


# ---- (b) keys_matter's words where keys and values are one input ------------------------------------------------


class MemoryAttention(nn.Module):
    """Cross-attention given its queries and one memory (`context`): keys and values both projected from it.
    `ignores_memory`: the keys and values projected from the query stream instead (the memory never read)."""

    def __init__(self, d_model=D, num_heads=H, *, ignores_memory=False):
        super().__init__()
        self.d_model, self.num_heads, self.ignores_memory = d_model, num_heads, ignores_memory
        self.q, self.kv, self.out = nn.Linear(d_model, d_model), nn.Linear(d_model, 2 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x, context, mask=None):
        B, T, D_ = x.shape  # batch, query length, d_model
        memory = x if self.ignores_memory else context
        S, h = memory.shape[1], self.num_heads  # memory length, heads
        q = self.q(x).view(B, T, h, D_ // h).transpose(1, 2)  # (B, h, T, d)
        k, v = self.kv(memory).view(B, S, 2, h, D_ // h).permute(2, 0, 3, 1, 4)  # (B, h, S, d) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(D_ // h)  # (B, h, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D_))


def keys_result(layer, **kw):
    torch.manual_seed(0)
    return diagnostics.audit(layer, detectors=["keys_matter"], **kw).result("keys_matter")


def test_one_memory_stream_passes_keys_matter_saying_what_was_measured():
    """Before: "the output depends on the keys and on the values", from the memory changed as a whole."""
    torch.manual_seed(0)
    found = keys_result(MemoryAttention(), cross=True)
    assert found.verdict == "pass", found
    assert found.message.startswith("the output depends on its memory (keys and values are one input here"), found
    assert "the keys and on the values" not in found.message, found
    assert "(the memory: its keys and values, one input)" in found.evidence, found.evidence


def test_one_memory_stream_never_read_fails_keys_matter_naming_the_memory():
    torch.manual_seed(0)
    found = keys_result(MemoryAttention(ignores_memory=True), cross=True)
    assert (found.verdict, found.message) == ("fail", "the output does not depend on its memory (its keys and values, "
                                                      "one input)"), found


def test_keys_and_values_given_apart_still_say_both():
    from correct import scaled_dot_product_attention as attention

    found = keys_result(attention)
    assert (found.verdict, found.message) == ("pass", "the output depends on the keys and on the values"), found


# ---- (d) an online softmax without its rescale, in a module with one stream and no mask -------------------------


class TiledSelfAttention(nn.Module):
    """FlashAttention-2's loop over key blocks of `Bc` in a module: fused qkv, one stream, no mask argument.
    `rescale`: which running values are rescaled when the running max grows ("both", "sum only", "values only")."""

    def __init__(self, dim=D, n_heads=H, Bc=4, rescale="both"):
        super().__init__()
        self.n_heads, self.head_dim, self.Bc, self.rescale = n_heads, dim // n_heads, Bc, rescale
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape  # batch, sequence length, d_model
        q, k, v = (t.reshape(b, n, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
                   for t in self.to_qkv(x).chunk(3, dim=-1))  # (b, h, n, d) each
        q = q * self.head_dim ** -0.5
        out = torch.zeros_like(q)  # (b, h, n, d): the running weighted values
        row_max = torch.full((b, self.n_heads, n, 1), -float("inf"))
        row_sum = torch.zeros((b, self.n_heads, n, 1))
        for j in range(0, n, self.Bc):
            s = q @ k[:, :, j:j + self.Bc].transpose(-1, -2)  # (b, h, n, Bc)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - new_max)
            alpha = torch.exp(row_max - new_max)
            if self.rescale == "values only":
                row_sum = row_sum + p.sum(dim=-1, keepdim=True)  # BUG: the sum stays relative to the old max
            else:
                row_sum = alpha * row_sum + p.sum(dim=-1, keepdim=True)
            if self.rescale == "sum only":
                out = out + p @ v[:, :, j:j + self.Bc]  # BUG: the values stay relative to the old max
            else:
                out = alpha * out + p @ v[:, :, j:j + self.Bc]
            row_max = new_max
        return self.to_out((out / row_sum).permute(0, 2, 1, 3).reshape(b, n, -1))


def bug_line(cls, words):
    lines, start = inspect.getsourcelines(cls)
    return next(start + i for i, line in enumerate(lines) if "# BUG" in line and words in line)


@pytest.mark.parametrize("rescale, words", [("sum only", "the values stay"), ("values only", "the sum stays")])
def test_an_unrescaled_online_softmax_module_without_a_mask_is_caught_at_its_line(rescale, words):
    """Before: inconclusive, relative_positions skipped ("no shift of its positions is possible")."""
    torch.manual_seed(0)
    report = diagnostics.audit(TiledSelfAttention(rescale=rescale))
    found = report.result("relative_positions")
    assert report.status == "failed" and found.verdict == "fail", str(report)
    assert found.message.startswith("the outputs depend on the order of the keys, through a running value of the "
                                    "layer's online softmax that is not rescaled"), found
    site = found.where[0]
    assert (site.file, site.line) == (__file__, bug_line(TiledSelfAttention, words)), site.describe()
    fix, general = found.remedy
    assert not general and "torch.exp(m_old - m_new)" in fix, fix


def test_the_rescaled_online_softmax_module_has_no_finding_on_the_same_inputs():
    """Its twin: keys' order moves nothing, relative_positions is not applicable. The audit stays inconclusive, as
    before: one stream hides the weights (weight_row_sums and softmax_saturation cannot measure it)."""
    torch.manual_seed(0)
    report = diagnostics.audit(TiledSelfAttention())
    assert not [r.detector for r in report.results if r.fired], str(report)
    assert report.result("relative_positions").message.startswith("not applicable: the layer has no positional")


# ---- (c) a tile named block_size is no context ------------------------------------------------------------------


class FlashTiles(TiledSelfAttention):
    """The tiled layer above with its tile named as FlashAttention ports name it: `block_size`."""

    def __init__(self, block_size=4, rescale="both"):
        super().__init__(Bc=block_size, rescale=rescale)
        self.block_size = block_size


class PositionTable(nn.Module):
    """A context of `block_size` tokens: a learned position table of that many rows, added to the tokens (a longer
    sequence cannot be added to it), then torch's attention."""

    def __init__(self, d_model=D, num_heads=H, block_size=4):
        super().__init__()
        self.d_model, self.num_heads, self.block_size = d_model, num_heads, block_size
        self.pos = nn.Parameter(torch.randn(block_size, d_model) * 0.02)
        self.attn = nn.MultiheadAttention(d_model, num_heads, batch_first=True)

    def forward(self, x):
        x = x + self.pos[:x.shape[1]]  # (B, T, D) + (T, D): T <= block_size
        return self.attn(x, x, x, need_weights=False)[0]


def test_a_tile_named_block_size_does_not_bound_the_probe_length():
    """Before: AuditUsageError "expected seq_len <= 4, the longest sequence the layer takes (block_size=4)"."""
    torch.manual_seed(0)
    report = diagnostics.audit(FlashTiles(block_size=4))
    header = str(report).splitlines()[0]
    assert "block_size=4 bounds nothing: the layer ran at 8 tokens" in header and "seq_len=16" in header, header
    assert not [r.detector for r in report.results if r.fired], str(report)
    torch.manual_seed(0)
    buggy = diagnostics.audit(FlashTiles(block_size=4, rescale="sum only"))
    # its weights, read through the last third of its fused qkv one key at a time, are no distribution either
    assert buggy.fired() == {"relative_positions": "fail", "weight_row_sums": "fail"}, str(buggy)


def test_a_block_size_the_layer_cannot_run_beyond_still_bounds_it():
    torch.manual_seed(0)
    with pytest.raises(diagnostics.AuditUsageError, match=r"expected seq_len <= 4, the longest sequence the layer "
                                                          r"takes \(block_size=4\)"):
        diagnostics.audit(PositionTable(block_size=4))
    report = diagnostics.audit(PositionTable(block_size=4), seq_len=4)
    assert "bounds nothing" not in str(report).splitlines()[0]


# ---- (e) FlashAttention-1's slice layout ----------------------------------------------------------------------


def flash1(Q, K, V, mask=None, Br=4, Bc=4, bug=None):
    """FlashAttention-1's forward (Algorithm 1) on (B, H, N, d) tensors, blocks in Python lists; mask: True = may
    attend. `bug`: "O" forgets exp(m_old - m_new) on the running output, "l" on the running sum."""
    scale = 1.0 / math.sqrt(Q.shape[-1])
    O = Q.new_zeros(Q.shape[:-1] + (V.shape[-1],))  # (B, H, N, d_v), kept normalised
    l = Q.new_zeros(Q.shape[:-1] + (1,))  # (B, H, N, 1): running sums  # noqa: E741
    m = Q.new_full(Q.shape[:-1] + (1,), -1e30)  # (B, H, N, 1): running maxima
    Q_BLOCKS, K_BLOCKS, V_BLOCKS = Q.split(Br, dim=2), K.split(Bc, dim=2), V.split(Bc, dim=2)
    O_BLOCKS, l_BLOCKS, m_BLOCKS = list(O.split(Br, dim=2)), list(l.split(Br, dim=2)), list(m.split(Br, dim=2))
    for j, (Kj, Vj) in enumerate(zip(K_BLOCKS, V_BLOCKS)):
        for i, Qi in enumerate(Q_BLOCKS):
            Oi, li, mi = O_BLOCKS[i], l_BLOCKS[i], m_BLOCKS[i]
            S_ij = Qi @ Kj.transpose(-1, -2) * scale  # (B, H, Br, Bc)
            if mask is not None:
                S_ij = S_ij.masked_fill(~mask[..., i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc], -1e30)
            m_ij = S_ij.amax(-1, keepdim=True)
            P_ij = torch.exp(S_ij - m_ij)
            l_ij = P_ij.sum(-1, keepdim=True)
            mi_new = torch.maximum(m_ij, mi)
            if bug == "l":
                li_new = li + torch.exp(m_ij - mi_new) * l_ij  # BUG: l
            else:
                li_new = torch.exp(mi - mi_new) * li + torch.exp(m_ij - mi_new) * l_ij
            if bug == "O":
                O_BLOCKS[i] = (li / li_new) * Oi + (torch.exp(m_ij - mi_new) / li_new) * (P_ij @ Vj)  # BUG: O
            else:
                O_BLOCKS[i] = (li / li_new) * torch.exp(mi - mi_new) * Oi + (torch.exp(m_ij - mi_new) / li_new) * (P_ij @ Vj)
            l_BLOCKS[i], m_BLOCKS[i] = li_new, mi_new
    return torch.cat(O_BLOCKS, dim=2)


def flash1_forgets_output_rescale(q, k, v, mask=None):
    return flash1(q, k, v, mask, bug="O")


def flash1_forgets_sum_rescale(q, k, v, mask=None):
    return flash1(q, k, v, mask, bug="l")


class Flash1SelfAttention(nn.Module):
    """flash1 in a module: fused qkv, one stream, no mask argument."""

    def __init__(self, d_model=D, num_heads=H, bug=None):
        super().__init__()
        self.num_heads, self.bug = num_heads, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape  # batch, sequence length, d_model
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))  # (B, H, T, d) each
        return self.out(flash1(q, k, v, bug=self.bug).transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("function, bug", [(flash1_forgets_output_rescale, "O"), (flash1_forgets_sum_rescale, "l")])
def test_flash1_without_a_rescale_is_caught_at_its_line(function, bug):
    """Before, the "O" bug failed the same detectors with no site."""
    torch.manual_seed(0)
    report = diagnostics.audit(function)
    assert report.fired() == {"weight_row_sums": "fail", "output_variance": "fail", "relative_positions": "fail"}, \
        str(report)
    line = bug_line(flash1, f"BUG: {bug}")
    for result in report.findings:
        assert (result.where[0].file, result.where[0].line) == (__file__, line), (result.detector, result.where)


def test_flash1_with_its_rescales_passes():
    torch.manual_seed(0)
    report = diagnostics.audit(flash1)
    assert report.status == "passed", str(report)


@pytest.mark.parametrize("bug", [None, "O"])
def test_flash1_in_a_module_without_a_mask(bug):
    """The "O" bug was inconclusive (the rescale by l_old / l_new read as the max's); its twin has no finding."""
    torch.manual_seed(0)
    report = diagnostics.audit(Flash1SelfAttention(bug=bug))
    if bug is None:
        assert not [r.detector for r in report.results if r.fired], str(report)
    else:
        found = report.result("relative_positions")
        # and its weights, read through the last third of its fused qkv, are no distribution (once not measured)
        assert report.fired() == {"relative_positions": "fail", "weight_row_sums": "fail"}, str(report)
        assert found.where[0].line == bug_line(flash1, "BUG: O"), found.where
