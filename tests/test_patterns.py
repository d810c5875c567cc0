"""Declared attention patterns (issue 19): every named pattern in correct form passes `attention_pattern` through
the reference given the pattern's mask, an SDPA function given it, and a FlexAttention program, at float32 and
bfloat16 and both inits; each broken twin (written here as layers that build their own mask: the catalog has no
pattern variants yet) fails with the leakage or over-masking finding, localised at the line that builds its mask;
a FlexAttention mask_mod off by one against sliding_window(W) is caught at its own line, one equal to it passes.
Wide windows (W = 40 and 100 at T = 128, wider than the old cap of 32 copies allowed) one key too long or too short
fail at the window's end, each beside its correct twin: the reference, a function, a FlexAttention score_mod.

FlexAttention's first call on the CPU is slow (~2-4 s, block-mask creation and the eager path's first run), so
its programs share one module-scoped warm-up."""

from __future__ import annotations

import math
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import diagnostics
import correct
from correct import MultiHeadAttention, gpt2_init_, mask_from_mod
from diagnostics.patterns import Pattern, as_pattern, causal, chunked, document, prefix_lm, sliding_window

T, D, H = 16, 16, 2
DOCS = [0] * 5 + [1] * 6 + [2] * 5
NAMED = {
    "causal": causal(),
    "sliding_window": sliding_window(4),
    "chunked": chunked(4),
    "prefix_lm": prefix_lm(5),
    "document": document(DOCS),
    "document & causal": document(DOCS) & causal(),
    "window | prefix": sliding_window(3) | prefix_lm(2),
}
DOC_IDS = torch.tensor(DOCS)
DTYPES = [torch.float32, torch.bfloat16]
INITS = ["default", "gpt2"]


def verdict(report, det="attention_pattern"):
    return next(r for r in report.results if r.detector == det)


def reference(init: str, dtype) -> MultiHeadAttention:
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H)
    if init == "gpt2":
        gpt2_init_(layer)
    return layer.to(dtype)


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ---- the pattern itself ------------------------------------------------------------------------------------


def test_sliding_window_counts_w_keys_including_its_own():
    allowed = sliding_window(4).allowed(1, 8, 8)[0]  # (Tq, Tk)
    assert allowed.sum(-1).tolist() == [1, 2, 3, 4, 4, 4, 4, 4]
    assert allowed[7].nonzero().flatten().tolist() == [4, 5, 6, 7]  # q - W < kv <= q


def test_allowed_is_bottom_right_like_the_audits_causal_mask():
    assert torch.equal(causal().allowed(2, 3, 5), torch.ones(5, 5, dtype=torch.bool).tril()[2:].expand(2, 3, 5))


def test_combinators_and_a_bare_mask_mod():
    w, p = sliding_window(2), prefix_lm(3)
    assert torch.equal((w | p).allowed(1, 6, 6), w.allowed(1, 6, 6) | p.allowed(1, 6, 6))
    assert torch.equal((w & (lambda b, h, q, kv: kv > 0)).allowed(1, 6, 6), w.allowed(1, 6, 6) & (torch.arange(6) > 0))
    assert as_pattern(lambda b, h, q, kv: kv <= q).allowed(1, 4, 4).sum() == 10


def test_per_sequence_data():
    mask = document(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])).allowed(4, 4, 4)
    assert torch.equal(mask[0], mask[2]) and not torch.equal(mask[0], mask[1])  # row b % 2
    assert prefix_lm(torch.tensor([1, 3])).allowed(2, 4, 4)[:, 0].sum(-1).tolist() == [1, 3]


def test_reference_mask_builder_agrees_with_the_pattern():
    for pattern in NAMED.values():
        assert torch.equal(mask_from_mod(pattern.mask_mod, 6, 9, batch=2)[:, 0], pattern.allowed(2, 6, 9))


def test_misuse_is_refused():
    with pytest.raises(diagnostics.AuditUsageError):
        sliding_window(0)
    with pytest.raises(diagnostics.AuditUsageError):
        diagnostics.audit(sdpa, d_model=D, num_heads=H, pattern="sliding")
    with pytest.raises(diagnostics.AuditUsageError):
        Pattern(lambda b, h, q, kv: 1, "int").allowed(1, 2, 2)


def test_without_a_pattern_the_detector_does_not_apply():
    r = verdict(diagnostics.audit(sdpa, d_model=D, num_heads=H, detectors=["attention_pattern"]))
    assert r.verdict == "skip" and "pattern=" in r.message


# ---- correct forms pass ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("init", INITS)
def test_reference_given_the_patterns_mask_passes(name, dtype, init):
    report = diagnostics.audit(reference(init, dtype), pattern=NAMED[name], seq_len=T)
    r = verdict(report)
    assert r.verdict == "pass", (r.message, r.evidence)
    assert "0 not moving" in r.evidence
    assert report.status == "passed", report.status_reason


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_given_the_patterns_mask_passes(name, dtype):
    r = verdict(diagnostics.audit(sdpa, d_model=D, num_heads=H, dtype=dtype, pattern=NAMED[name], seq_len=T,
                                  detectors=["attention_pattern"]))
    assert r.verdict == "pass", (r.message, r.evidence)


# ---- the reference keeps a pattern of its own ------------------------------------------------------------------

OWN = {  # the reference's configuration: the pattern it promises
    "window": ({"sliding_window": 4}, sliding_window(4)),
    "chunk": ({"attention_chunk_size": 5}, chunked(5)),
    "prefix": ({"prefix": 5}, prefix_lm(5)),
    "documents": ({"documents": DOC_IDS}, document(DOCS)),
    "documents, causal": ({"documents": DOC_IDS, "causal": True}, document(DOCS) & causal()),
    "window, causal": ({"sliding_window": 4, "causal": True}, sliding_window(4)),
}


@pytest.mark.parametrize("name", OWN)
def test_the_reference_builds_its_own_pattern_as_the_declared_one_states_it(name):
    kw, pattern = OWN[name]
    layer = MultiHeadAttention(D, H, **kw)
    for t_q, t_k in ((T, T), (5, T), (1, 7)):  # the full pass, and decoding: the last Tq of the Tk positions
        own = layer.pattern_mask(t_q, t_k, batch=3)[:, 0]  # (B, Tq, Tk)
        if layer.causal:
            own = own & correct.causal_mask(t_q, t_k, align="bottom_right")
        assert torch.equal(own, pattern.allowed(3, t_q, t_k)), (name, t_q, t_k)
    assert MultiHeadAttention(D, H).pattern_mask(T, T) is None


@pytest.mark.parametrize("name", OWN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("init", INITS)
def test_a_reference_that_keeps_its_pattern_passes_audited_with_it(name, dtype, init):
    kw, pattern = OWN[name]
    torch.manual_seed(0)
    layer = MultiHeadAttention(D, H, **kw)
    if init == "gpt2":
        gpt2_init_(layer)
    report = diagnostics.audit(layer.to(dtype), pattern=pattern, causal=layer.causal, seq_len=T)
    r = verdict(report)
    assert r.verdict == "pass" and "0 not moving" in r.evidence, (r.message, r.evidence)
    assert ("while decoding" in r.message) == layer.causal  # a decoder is measured decoding too
    assert report.status == "passed" and not report.findings, report


class Recorder(MultiHeadAttention):
    """The reference, keeping the masks the audit gives it."""

    def forward(self, query, key=None, value=None, mask=None):
        self.given.append(mask)
        return super().forward(query, key, value, mask)


@pytest.mark.parametrize("own", [False, True])
def test_a_layer_that_keeps_its_pattern_itself_is_not_given_the_declared_mask(own):
    """As a truthy `causal` keeps the audit's causal mask away, a `sliding_window` (`attention_chunk_size`, `prefix`,
    `documents`) keeps the pattern's: else a layer that builds its pattern wrong would be rescued by the audit's own mask."""
    layer = Recorder(D, H, sliding_window=4 if own else None)
    layer.given = []
    diagnostics.audit(layer, pattern=sliding_window(4), seq_len=T, detectors=["attention_pattern"])
    assert layer.given and all((m is None) == own for m in layer.given)


def test_a_window_dropped_once_a_cache_holds_keys_leaks_while_decoding_and_only_then():
    """Measured decoding (the last Tq queries over all Tk keys) under causal=True; the full pass alone passes it."""
    class DroppedWithCache(MultiHeadAttention):
        def pattern_mask(self, t_q, t_k, *, batch=1, device=None):
            return super().pattern_mask(t_q, t_k, batch=batch, device=device) if t_q == t_k else None

    layer = DroppedWithCache(D, H, sliding_window=4, causal=True)
    r = verdict(diagnostics.audit(layer, pattern=sliding_window(4), causal=True, seq_len=T,
                                  detectors=["attention_pattern"]))
    assert r.verdict == "fail" and "(leakage)" in r.message and "decoding with a cache of 11" in r.message, r.message
    # a decoded row (positions 11..15), whichever of them the decoding copies read first
    assert re.search(r"query 1[1-5] of sequence [01] moved when only key", r.evidence), r.evidence
    picture = r.extras["dependency_map"]
    assert picture.q0 == 11 and picture.declared.shape == (5, T)  # the decoded rows: positions 11..15
    full = verdict(diagnostics.audit(layer, pattern=sliding_window(4), seq_len=T, detectors=["attention_pattern"]))
    assert full.verdict == "pass" and "while decoding" not in full.message, full.message  # not a decoder: not asked


def test_an_ignored_key_is_confirmed_both_ways_before_it_is_over_masking():
    """A tiny layer in bfloat16 whose output bias swamps a key that only lost its weight: the key pushed the other
    way takes the weight, and the row moves. The correct layer passes; it once failed with over-masking."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(1, 1, prefix=5).to(torch.bfloat16)
    r = verdict(diagnostics.audit(layer, pattern=prefix_lm(5), seq_len=4, seed=0, detectors=["attention_pattern"]))
    assert r.verdict == "pass", (r.message, r.evidence)


# ---- broken twins fail, localised ------------------------------------------------------------------------------

WINDOW = 4
TWINS = {  # name: (the layer's own mask_mod, the finding)
    "window one too long (q - kv <= W)": (lambda b, h, q, kv: (kv <= q) & (q - kv <= WINDOW), "leakage"),
    "window one too short (q - kv < W - 1)": (lambda b, h, q, kv: (kv <= q) & (q - kv < WINDOW - 1), "over-masking"),
    "window on both sides (|q - kv| < W)": (lambda b, h, q, kv: (q - kv).abs() < WINDOW, "leakage"),
}
PATTERN_TWINS = {  # name: (declared, the layer's own mask_mod, the finding)
    "chunk boundary one late": (chunked(4), lambda b, h, q, kv: (kv <= q) & ((q - 1) // 4 == (kv - 1) // 4), "leakage"),
    "documents leaking (causal only)": (document(DOCS) & causal(), lambda b, h, q, kv: kv <= q, "leakage"),
    # each document's first key compared under the previous position's id: blocked from its own document
    "document blocked from itself": (document(DOCS), lambda b, h, q, kv: DOC_IDS[q] == DOC_IDS[(kv - 1).clamp(min=0)],
                                     "over-masking"),
    "causal prefix": (prefix_lm(5), lambda b, h, q, kv: kv <= q, "over-masking"),
}


class OwnMask(MultiHeadAttention):
    """A self-attention layer that builds its pattern itself (the audit's declaration is its promise)."""

    def __init__(self, mask_mod):
        super().__init__(D, H)
        self.mask_mod = mask_mod

    def mask(self, scores, mask, *, fill=-math.inf):
        own = mask_from_mod(self.mask_mod, *scores.shape[-2:], device=scores.device)[0, 0]  # (Tq, Tk)
        return super().mask(scores, own, fill=fill)

    def forward(self, x):
        return super().forward(x)


def own_function(mask_mod):
    def attend(q, k, v):
        allowed = mask_from_mod(mask_mod, q.shape[-2], k.shape[-2])  # (1, 1, Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    return attend


def all_twins():
    for name, (mod, finding) in TWINS.items():
        yield name, sliding_window(WINDOW), mod, finding
    for name, (pattern, mod, finding) in PATTERN_TWINS.items():
        yield name, pattern, mod, finding


@pytest.mark.parametrize("name,pattern,mod,finding", list(all_twins()), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("form", ["self module", "function"])
def test_broken_twin_fails_with_its_finding_localised(name, pattern, mod, finding, form):
    layer = OwnMask(mod) if form == "self module" else own_function(mod)
    kw = {} if form == "self module" else {"d_model": D, "num_heads": H}
    r = verdict(diagnostics.audit(layer, pattern=pattern, seq_len=T, detectors=["attention_pattern"], **kw))
    assert r.verdict == "fail" and f"({finding})" in r.message, (r.message, r.evidence)
    assert any(s.file == __file__ and "lambda" in s.code for s in r.where), [str(s) for s in r.where]
    twin = OwnMask(pattern.mask_mod) if form == "self module" else own_function(pattern.mask_mod)
    ok = verdict(diagnostics.audit(twin, pattern=pattern, seq_len=T, detectors=["attention_pattern"], **kw))
    assert ok.verdict == "pass", (ok.message, ok.evidence)


def test_a_blocked_diagonal_is_over_masking_where_it_can_be_measured():
    """A function's keys change without its queries, so its diagonal is measured (a one-stream layer's is not:
    its token is its query, and the evidence counts those pairs as not measurable)."""
    r = verdict(diagnostics.audit(own_function(lambda b, h, q, kv: (kv != q) & (kv <= q) | (q == 0) & (kv == 0)),
                                  d_model=D, num_heads=H, pattern=causal(), seq_len=T, detectors=["attention_pattern"]))
    assert r.verdict == "fail" and "(over-masking)" in r.message and "query 1 -> key 1" in r.evidence, r.evidence


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("init", INITS)
def test_off_by_one_twins_at_every_dtype_and_init(dtype, init):
    for mod, finding in TWINS.values():
        layer = OwnMask(mod)
        if init == "gpt2":
            gpt2_init_(layer)
        r = verdict(diagnostics.audit(layer.to(dtype), pattern=sliding_window(WINDOW), seq_len=T,
                                      detectors=["attention_pattern"]))
        assert r.verdict == "fail" and f"({finding})" in r.message, (r.message, r.evidence)


# ---- wide windows: off by one at either end, where a window of W ends --------------------------------------------
# One copy per residue class mod p, p capped at 32, met several allowed keys per row wherever a row was wider than
# 30 keys: W = 40 and W = 100 at T = 128 passed one key too many or too few. The copies are now chosen for the pairs
# at each end of the window (key q - W outside it, q - W + 1 inside), whatever W is.

WIDE_T = 128


class WindowOf(MultiHeadAttention):
    """The reference with its window's comparison `by` keys off: W + by keys, the query's own included."""

    def __init__(self, W: int, by: int = 0):
        super().__init__(D, H, sliding_window=W)
        self.by = by

    def within_window(self, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.sliding_window + self.by)


def window_of(n: int):
    """A mask_mod of n keys, the query's own included."""
    return lambda b, h, q, kv: (kv <= q) & (q - kv < n)


def assert_window_finding(r, W: int, by: int):
    """The finding of a window of W + by keys declared as W: leakage at key q - W (the first key past the window),
    over-masking at key q - W + 1 (its last)."""
    __tracebackhide__ = True
    if by > 0:
        assert r.verdict == "fail" and "(leakage)" in r.message, (r.message, r.evidence)
        found = re.search(r"query (\d+) of sequence \d moved when only key (\d+) changed", r.evidence)
        q, kv = map(int, found.groups())
        assert q - kv == W, r.evidence
    else:
        assert r.verdict == "fail" and "(over-masking)" in r.message, (r.message, r.evidence)
        cells = re.findall(r"query (\d+) -> key (\d+) in sequence", r.evidence)
        assert cells and all(int(q) - int(kv) == W - 1 for q, kv in cells), r.evidence


@pytest.mark.parametrize("W", [40, 100])
@pytest.mark.parametrize("by", [1, -1], ids=["W + 1 keys", "W - 1 keys"])
@pytest.mark.parametrize("form", ["reference", "function"])
def test_a_wide_window_off_by_one_fails_at_its_end_and_its_twin_passes(W, by, form):
    """The reference with its window moved by one key, and a function that builds its mask with mask_from_mod from
    a mask_mod of W +- 1 keys; each beside its correct twin on the same weights and probe."""
    def build(n_more):
        torch.manual_seed(0)
        return WindowOf(W, n_more) if form == "reference" else own_function(window_of(W + n_more))

    kw = {} if form == "reference" else {"d_model": D, "num_heads": H}
    audit = lambda layer: verdict(diagnostics.audit(layer, pattern=sliding_window(W), seq_len=WIDE_T,
                                                    detectors=["attention_pattern"], **kw))
    r = audit(build(by))
    assert_window_finding(r, W, by)
    line = "q_idx - kv_idx < self.sliding_window + self.by" if form == "reference" else "(q - kv < n)"
    assert any(s.file == __file__ and line in s.code for s in r.where), [f"{s}: {s.code}" for s in r.where]
    ok = audit(build(0))
    assert ok.verdict == "pass" and "0 not moving" in ok.evidence, (ok.message, ok.evidence)


# ---- FlexAttention programs ----------------------------------------------------------------------------------

flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")


def flex_program(mask_mod):
    def program(q, k, v, mask=None):
        mod = mask_mod
        if mask is not None:  # the audit's mask, (B, 1, Tq, Tk): honoured with the program's own
            mod = flex_attention.and_masks(mask_mod, lambda b, h, q_idx, kv_idx: mask[b, 0, q_idx, kv_idx])
        block = flex_attention.create_block_mask(mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return flex_attention.flex_attention(q, k, v, block_mask=block)

    return program


def window_off_by_one(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)  # W + 1 keys: the off-by-one


def window_right(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


@pytest.fixture(scope="module")
def warm_flex():
    """FlexAttention's first eager call (the slow one), once for the module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.randn(2, H, T, D // H)
        flex_program(window_right)(q, q, q)
        yield


@pytest.fixture
def uncompiled(monkeypatch):
    """flex_attention's calls outside the observer skip their dynamo compilation (torch's own switch, which the
    observer sets for its calls anyway), whose first run at each new shape costs seconds. The whole audit of a
    function keeps torch's default path."""
    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


def no_mask(mask_mod):
    program = flex_program(mask_mod)
    return lambda q, k, v: program(q, k, v)


@pytest.mark.slow  # FlexAttention's default path compiles at each new shape: 2.5 s, the default run's dearest test
def test_flex_program_equal_to_the_pattern_passes_the_whole_audit(warm_flex):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = diagnostics.audit(no_mask(window_right), d_model=D, num_heads=H, seq_len=T,
                                   pattern=sliding_window(WINDOW))
    assert verdict(report).verdict == "pass", (verdict(report).message, verdict(report).evidence)
    assert report.status == "passed", report


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flex_program_of_each_pattern_passes(warm_flex, uncompiled, name, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = verdict(diagnostics.audit(flex_program(NAMED[name]), d_model=D, num_heads=H, seq_len=T, dtype=dtype,
                                      pattern=NAMED[name], detectors=["attention_pattern"]))
    assert r.verdict == "pass", (r.message, r.evidence)


def test_flex_mask_mod_off_by_one_is_caught_at_its_line(warm_flex, uncompiled):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = verdict(diagnostics.audit(no_mask(window_off_by_one), d_model=D, num_heads=H, seq_len=T,
                                      pattern=sliding_window(WINDOW), detectors=["attention_pattern"]))
    assert r.verdict == "fail" and "mask_mod" in r.message
    assert "(b=0, h=0, q_idx=4, kv_idx=0)" in r.evidence and "allows it" in r.evidence, r.evidence
    line = window_off_by_one.__code__.co_firstlineno + 1
    assert (r.where[0].file, r.where[0].line) == (__file__, line), [str(s) for s in r.where]
    assert "q_idx - kv_idx <= WINDOW" in r.where[0].code


class MixesRows(OwnMask):
    """A correct window, then each row mixed with the previous one: a leak no mask shows."""

    def forward(self, x):
        out, weights = super().forward(x)
        return out + out.roll(1, dims=1), weights  # row i takes row i - 1's window: one key more


def test_a_leak_past_a_correct_mask_points_at_the_op_where_it_enters():
    r = verdict(diagnostics.audit(MixesRows(window_right), pattern=sliding_window(WINDOW), seq_len=T,
                                  detectors=["attention_pattern"]))
    assert r.verdict == "fail" and "(leakage)" in r.message, r.evidence
    assert r.where and "roll" in r.where[0].code, [f"{s}: {s.code}" for s in r.where]


def alibi(score, b, h, q_idx, kv_idx):
    return score - 0.5 * (h + 1) * (q_idx - kv_idx)  # a per-head distance bias (ALiBi): no effect on the pattern


def test_flex_program_with_a_score_mod_is_measured_like_any(warm_flex, uncompiled):
    def program(q, k, v):
        block = flex_attention.create_block_mask(window_right, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return flex_attention.flex_attention(q, k, v, block_mask=block, score_mod=alibi)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = diagnostics.audit(program, d_model=D, num_heads=H, seq_len=T, pattern=sliding_window(WINDOW),
                                   detectors=["weight_row_sums", "softmax_saturation", "attention_pattern"])
    assert verdict(report).verdict == "pass", verdict(report).evidence
    # the observer sees the operator's own scores and softmax: the temperature is measured, the bias cancels
    assert verdict(report, "softmax_saturation").verdict == "pass", verdict(report, "softmax_saturation")
    assert report.status == "passed", report


class FlexModule(torch.nn.Module):
    """A self-attention module that calls flex_attention with trainable projections (inputs that require grad,
    which FlexAttention refuses on the CPU outside the observer)."""

    def __init__(self, mask_mod):
        super().__init__()
        self.qkv, self.out, self.mask_mod = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D), mask_mod

    def forward(self, x):
        B, t, _ = x.shape
        q, k, v = self.qkv(x).view(B, t, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d)
        block = flex_attention.create_block_mask(self.mask_mod, None, None, t, t, device=x.device)
        out = flex_attention.flex_attention(q, k, v, block_mask=block)  # (B, H, T, d)
        return self.out(out.transpose(1, 2).reshape(B, t, D))


def test_a_module_that_calls_flex_is_audited(warm_flex, uncompiled):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = diagnostics.audit(FlexModule(window_right), pattern=sliding_window(WINDOW), seq_len=T)
        broken = verdict(diagnostics.audit(FlexModule(window_off_by_one), pattern=sliding_window(WINDOW), seq_len=T,
                                           detectors=["attention_pattern"]))
    assert report.status == "passed", report
    assert verdict(report, "softmax_saturation").verdict == "pass"  # the operator's q·k and softmax observed
    assert "backward on CPU" in verdict(report, "gradients").message  # FlexAttention has none there: not measured
    assert broken.verdict == "fail" and "mask_mod" in broken.message
    assert broken.where[0].line == window_off_by_one.__code__.co_firstlineno + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("init", INITS)
def test_a_flex_module_at_every_dtype_and_init(warm_flex, uncompiled, dtype, init):
    torch.manual_seed(0)
    layer = FlexModule(window_right)
    if init == "gpt2":
        gpt2_init_(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = verdict(diagnostics.audit(layer.to(dtype), pattern=sliding_window(WINDOW), seq_len=T,
                                      detectors=["attention_pattern"]))
    assert r.verdict == "pass" and "0 not moving" in r.evidence, (r.message, r.evidence)


def score_window(n: int):
    """A FlexAttention program whose window of n keys is a score_mod (no mask_mod to compare with the pattern: only
    the measured dependency shows it)."""
    def window(score, b, h, q_idx, kv_idx):
        return torch.where((kv_idx <= q_idx) & (q_idx - kv_idx < n), score, -math.inf)

    return lambda q, k, v: flex_attention.flex_attention(q, k, v, score_mod=window)


def test_a_wide_window_in_a_flex_score_mod_off_by_one_fails_and_its_twin_passes(warm_flex, uncompiled):
    """Also: localising a FlexAttention program's finding (its ops traced) leaves the process's profile function as it
    was (FlexAttention enters the tracing mode again inside its call; it once left the tracer installed)."""
    W, profile = 100, sys.getprofile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        audit = lambda n: verdict(diagnostics.audit(score_window(n), d_model=D, num_heads=H, seq_len=WIDE_T,
                                                    pattern=sliding_window(W), detectors=["attention_pattern"]))
        ok, results = audit(W), {by: audit(W + by) for by in (1, -1)}
    assert ok.verdict == "pass" and "0 not moving" in ok.evidence, (ok.message, ok.evidence)
    for by, r in results.items():
        assert_window_finding(r, W, by)
        assert any(s.file == __file__ and "q_idx - kv_idx < n" in s.code for s in r.where), [str(s) for s in r.where]
    assert sys.getprofile() is profile


# ---- a Hugging Face sliding-window layer (the real extra) ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_hugging_face_mistral_sliding_layer_passes_audited_with_its_window(dtype):
    """Mistral's attention as a layer, audited with the window its config declares: its mask comes from the model
    (Hugging Face builds the sliding-window mask there, `sliding_window` W keys including the query's own), so the
    audit passes it the declared pattern's mask and measures the layer under it. A window patched off by one lives
    in the model's mask, not in the layer: the model audit's sliding-window check is where that fails."""
    mistral = pytest.importorskip("transformers.models.mistral.modeling_mistral",
                                  reason="transformers is not installed (the real extra: pip install -e '.[real]')")
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=1, intermediate_size=2 * D,
                           num_hidden_layers=1, sliding_window=4, vocab_size=32)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = mistral.MistralAttention(config, 0).to(dtype)
    report = diagnostics.audit(layer, pattern=sliding_window(config.sliding_window), causal=True, seq_len=T)
    r = verdict(report)
    assert r.verdict == "pass" and "0 not moving" in r.evidence, (r.message, r.evidence)
    assert report.status == "passed", report
