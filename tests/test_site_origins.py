"""Issue 34's cause 9, localisation: a finding points at the line that made the wrong value, not only at the op that
consumed it. Each class of cause has a broken layer, written unlike this project's layers (config dicts, einsum,
keras-like names, a functional core), whose site must land on its `# BUG` line, and its correct twin, which passes
the same audit.

- a scale computed by a method and kept in an attribute in `__init__`: the method's return line, then the write;
- a scale a helper takes as a parameter, left at its default by the caller: the caller's line;
- a mask built from numbers a method returns (a window's bounds): that method's return line;
- a fused call given the None a helper returned for its mask: the helper's `return`;
- scores multiplied by a 0/1 mask (score 0 still has weight): the multiplication;
- a bias of the wrong shape, built in a helper, that the op raises on: the line that built it;
- a rotary table turned along the heads axis: the line that counted the positions;
- one module per head (several softmaxes in one call): the scaling line (the localiser crashed on them before).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from diagnostics import audit

CFG = {"hidden": 16, "n_head": 2}


def bug_line(obj) -> int:
    """The file line of the one `# BUG` comment in the source of `obj`."""
    lines, start = inspect.getsourcelines(obj)
    found = [start + n for n, line in enumerate(lines) if "# BUG" in line]
    assert len(found) == 1, found
    return found[0]


def line_with(obj, text: str) -> int:
    """The file line of the one line of `obj`'s source that holds `text`."""
    lines, start = inspect.getsourcelines(obj)
    found = [start + n for n, line in enumerate(lines) if text in line]
    assert len(found) == 1, found
    return found[0]


def failing(report, detector: str):
    result = report.result(detector)
    assert result.verdict == "fail", str(report)
    return result


def lines_of(result) -> list[int]:
    return [site.line for site in result.where]


def run(layer, **declared):
    torch.manual_seed(0)
    return audit(layer.eval(), **declared)


# ---- a scale made by a method in __init__ ---------------------------------------------------------------------


class KerasStyleAttention(nn.Module):
    def __init__(self, config, per_head=True):
        super().__init__()
        self.cfg, self.per_head = config, per_head
        self.to_qkv = nn.Linear(config["hidden"], config["hidden"] * 3, bias=False)
        self.dense = nn.Linear(config["hidden"], config["hidden"])
        self.temperature = self._temperature()

    def _temperature(self):
        if self.per_head:
            return (self.cfg["hidden"] // self.cfg["n_head"]) ** -0.5
        return 1.0 / math.sqrt(self.cfg["hidden"])  # BUG: the width of every head

    def forward(self, inputs):
        q, k, v = [t.unflatten(-1, (self.cfg["n_head"], -1)) for t in self.to_qkv(inputs).chunk(3, dim=-1)]
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k)
        probs = (logits * self.temperature).softmax(-1)
        return self.dense(torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(2))


def test_a_scale_kept_from_init_points_at_the_method_that_computed_it():
    result = failing(run(KerasStyleAttention(CFG, per_head=False)), "softmax_saturation")
    assert result.where[0].line == bug_line(KerasStyleAttention._temperature), result.where
    assert "self.temperature" in result.where[0].note
    assert run(KerasStyleAttention(CFG)).passed


class ScaledTwice(KerasStyleAttention):
    def forward(self, inputs):
        q, k, v = [t.unflatten(-1, (self.cfg["n_head"], -1)) for t in self.to_qkv(inputs).chunk(3, dim=-1)]
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.temperature
        probs = (logits * self.temperature).softmax(-1)  # BUG: the right factor, a second time
        return self.dense(torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(2))


def test_a_right_scale_applied_twice_points_at_the_lines_that_apply_it_not_where_it_was_made():
    result = failing(run(ScaledTwice(CFG)), "softmax_saturation")
    assert result.where[0].function == "ScaledTwice.forward", result.where
    assert bug_line(ScaledTwice.forward) in lines_of(result)
    assert line_with(KerasStyleAttention.__init__, "self.temperature =") not in lines_of(result)


# ---- a scale a helper takes as a parameter ----------------------------------------------------------------------


def attention_core(q, k, v, softmax_temp=1.0):
    return torch.softmax(torch.einsum("bhid,bhjd->bhij", q, k) * softmax_temp, dim=-1) @ v


def heads_attention(q, k, v):
    return attention_core(q, k, v, softmax_temp=1 / math.sqrt(q.size(-1)))


def heads_attention_forgets_the_temperature(q, k, v):
    return attention_core(q, k, v)  # BUG: the default 1.0


def test_a_scale_left_at_a_helpers_default_points_at_the_call():
    kw = {"d_model": 16, "num_heads": 2}
    result = failing(run_function(heads_attention_forgets_the_temperature, kw), "softmax_saturation")
    assert result.where[0].line == bug_line(heads_attention_forgets_the_temperature), result.where
    assert "leaves it at its default" in result.where[0].note
    assert run_function(heads_attention, kw).passed


def run_function(fn, kw):
    torch.manual_seed(0)
    return audit(fn, **kw)


# ---- a mask built from numbers a method returns ---------------------------------------------------------------


class BandedSelfAttention(nn.Module):
    """Causal attention over the last `span` tokens; the band is given as (keys back, keys ahead)."""

    causal = True

    def __init__(self, hidden=16, heads=2, span=3, wide=False):
        super().__init__()
        self.heads, self.span, self.wide = heads, span, wide
        self.w_qkv, self.w_out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def band(self):
        if self.wide:
            return self.span, 0  # BUG: span + 1 keys
        return self.span - 1, 0

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.w_qkv(x).chunk(3, -1))
        back, ahead = self.band()
        rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = (cols - rows <= ahead) & (rows - cols <= back)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.w_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


def test_a_mask_built_from_a_methods_numbers_points_at_its_return():
    from diagnostics.patterns import sliding_window

    declared = {"causal": True, "pattern": sliding_window(3)}
    result = failing(run(BandedSelfAttention(wide=True), **declared), "attention_pattern")
    assert bug_line(BandedSelfAttention.band) in lines_of(result), result.where
    assert run(BandedSelfAttention(), **declared).passed


# ---- a fused call given the None a helper returned -----------------------------------------------------------


class PaddedDecoder(nn.Module):
    """A decoder block's attention: causal, and a key padding mask (True = a real token) merged into it."""

    causal = True

    def __init__(self, hidden=16, heads=2, drop_causal_without_padding=False):
        super().__init__()
        self.heads, self.drop = heads, drop_causal_without_padding
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def merged_mask(self, n, padding):
        if padding is None:
            if self.drop:
                return None  # BUG: no padding, so no causal mask either
            return torch.ones(n, n, dtype=torch.bool).tril()
        return torch.ones(n, n, dtype=torch.bool).tril() & padding[:, None, None, :]

    def forward(self, x, padding=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.merged_mask(n, padding))
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


def test_a_mask_a_helper_returned_as_none_points_at_the_return():
    report = run(PaddedDecoder(drop_causal_without_padding=True), causal=True)
    assert bug_line(PaddedDecoder.merged_mask) in lines_of(failing(report, "future_leakage")), report
    assert run(PaddedDecoder(), causal=True).passed


# ---- scores multiplied by a 0/1 mask --------------------------------------------------------------------------


class GatedEncoder(nn.Module):
    """An encoder taking a key padding mask (B, T), True = padding."""

    def __init__(self, hidden=16, heads=2, multiply=False):
        super().__init__()
        self.heads, self.multiply = heads, multiply
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x, key_padding_mask=None):
        b, n, c = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        energy = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        if key_padding_mask is not None:
            m = key_padding_mask[:, None, None, :]
            if self.multiply:
                energy = energy * ~m  # BUG: a score of 0 is still weighed
            else:
                energy = energy.masked_fill(m, -1e9)
        return (energy.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)


def test_scores_multiplied_by_a_zero_one_mask_point_at_the_product():
    declared = {"mask": "key_padding"}
    result = failing(run(GatedEncoder(multiply=True), **declared), "mask_honoured")
    assert result.where[0].line == bug_line(GatedEncoder.forward), result.where
    assert "-inf" in result.where[0].fix
    assert run(GatedEncoder(), **declared).passed


# ---- a bias of the wrong shape, made in a helper --------------------------------------------------------------


class CachedBlock(nn.Module):
    """Decoder attention over (cache + new) keys: queries are the last Tq of Tk; an additive causal bias."""

    causal = True

    def __init__(self, hidden=16, heads=2, square=False):
        super().__init__()
        self.heads, self.square = heads, square
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))

    def bias(self, tq, tk):
        new = torch.full((tq, tq), float("-inf")).triu(1)
        if self.square:
            return new  # BUG: (Tq, Tq), not (Tq, Tk)
        return torch.cat([torch.zeros(tq, tk - tq), new], dim=1)

    def forward(self, query, key=None, value=None):
        key = query if key is None else key
        value = key if value is None else value
        b = query.shape[0]
        q, k, v = (w(t).view(b, t.shape[1], self.heads, -1).transpose(1, 2)
                   for w, t in ((self.wq, query), (self.wk, key), (self.wv, value)))
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + self.bias(q.shape[2], k.shape[2])
        return (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)


def test_an_op_that_raised_on_a_tensor_built_in_a_helper_points_at_the_helper():
    result = failing(run(CachedBlock(square=True), causal=True), "runs")
    # the (Tq, Tq) tensor returned by the `# BUG` line is built on the helper's first line
    assert result.where[0].line == line_with(CachedBlock.bias, "new = torch.full"), result.where
    assert abs(result.where[0].line - bug_line(CachedBlock.bias)) <= 2
    assert "constants alone" in result.where[0].note
    assert run(CachedBlock(), causal=True).passed


# ---- a rotary table turned along the heads axis ---------------------------------------------------------------


def rope(t, pos):
    """Half-split rotary embedding of t (..., n, d) at positions pos (n,)."""
    half = t.shape[-1] // 2
    angle = pos[:, None].float() * 100.0 ** (-torch.arange(half).float() / half)
    c, s = angle.cos(), angle.sin()
    return torch.cat([t[..., :half] * c - t[..., half:] * s, t[..., :half] * s + t[..., half:] * c], -1)


class FlashLayoutRotary(nn.Module):
    """q, k, v kept as (B, T, H, d), flash-attn's layout."""

    causal = True

    def __init__(self, hidden=16, heads=4, over_heads=False):
        super().__init__()
        self.heads, self.over_heads = heads, over_heads
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).unbind(2)
        if self.over_heads:
            pos = torch.arange(q.shape[-2])  # BUG: axis -2 of (B, T, H, d) is the heads
            q, k = rope(q, pos), rope(k, pos)
        else:
            pos = torch.arange(n)
            q, k = rope(q.transpose(1, 2), pos).transpose(1, 2), rope(k.transpose(1, 2), pos).transpose(1, 2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, c))


def test_a_rotation_over_the_heads_points_at_the_positions_it_counted():
    declared = {"causal": True, "positions": "relative"}
    result = failing(run(FlashLayoutRotary(over_heads=True), **declared), "relative_positions")
    assert result.where[0].line == bug_line(FlashLayoutRotary.forward), result.where
    assert "heads" in result.where[0].fix or "sequence" in result.where[0].fix
    assert run(FlashLayoutRotary(), **declared).passed


# ---- one module per head: several softmaxes in one call --------------------------------------------------------


class OneHead(nn.Module):
    def __init__(self, hidden, width, wrong=False, values_first=False):
        super().__init__()
        self.wrong, self.values_first = wrong, values_first
        self.qk, self.v = nn.Linear(hidden, 2 * width, bias=False), nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        if self.values_first:
            v = self.v(x)
            return (q @ k.transpose(1, 2) * (x.shape[-1] if self.wrong else q.shape[-1]) ** -0.5).softmax(-1) @ v
        if self.wrong:
            w = torch.bmm(q, k.transpose(1, 2)) / x.shape[-1] ** 0.5  # BUG: the model's width, not the head's
        else:
            w = torch.bmm(q, k.transpose(1, 2)) / q.shape[-1] ** 0.5
        return torch.bmm(w.softmax(-1), self.v(x))


class HeadsInAList(nn.Module):
    def __init__(self, hidden=16, heads=2, wrong=(), values_first=False):
        super().__init__()
        self.d_model, self.num_heads = hidden, heads
        self.heads = nn.ModuleList(OneHead(hidden, hidden // heads, i in wrong, values_first) for i in range(heads))

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], -1)


def test_one_module_per_head_points_at_the_scaling_line():
    """The second head is scaled wrong. Before: the localiser raised looking for its softmax among the events
    (compared with ==, which holds tensors: the first head's softmax event raised), so no site at all."""
    result = failing(run(HeadsInAList(wrong=(1,), values_first=True)), "softmax_saturation")
    assert result.where[0].line == line_with(OneHead.forward, "(x.shape[-1] if self.wrong"), result.where
    assert run(HeadsInAList(values_first=True)).passed


def test_one_module_per_head_with_the_values_projected_after_the_softmax():
    """The values' projection, run after the softmax as the argument beside it, flattens its input to (B*T, D): with
    D = T it has the weights' element count and was read as the weights that multiply the values (a correct layer
    failed as 4.3x too flat). Now only a (.., Tq, Tk) operand is."""
    result = failing(run(HeadsInAList(wrong=(0, 1))), "softmax_saturation")
    assert bug_line(OneHead.forward) in lines_of(result), result.where
    assert "1/sqrt(d_k)" in result.message or "too flat" in result.message
    assert run(HeadsInAList()).passed
