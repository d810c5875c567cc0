"""Pins for the survivors of the full mutation run over the causal detectors, the mask hints, and the model wing's
window and packing checks (issue 37: `benchmarks/mutations.py --all --only detectors/causal.py --only
detectors/_mask_hints.py --only model/window.py --only model/packing.py`, pinned to one commit). As in
tests/test_pins.py, each pin has its twin on the same inputs (a case on each side of the comparison, guard or constant
it pins), the numbers quoted as literals; each test says which mutant it pins (its line number the run's, at
ecc3b1b). Small layers written here, one detector or one helper at small sizes: the file runs in about a second.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import diagnostics
from diagnostics._masks import MEANINGS, SHAPES
from diagnostics._probe import Probe
from diagnostics._subject import make_subject
from diagnostics.detectors._mask_hints import adds_bool_mask, candidates, honoured_conventions
from diagnostics.detectors._stacked import DECODING, _made
from diagnostics.detectors.causal import causal_room
from diagnostics.detectors.causal import top_k as top_k_in


def top_k(weights, allowed):
    """`top_k` over the keys `causal_room` gives each query under `allowed`."""
    return top_k_in(weights, causal_room(weights, allowed))
from diagnostics.model.window import declared_pattern


def verdict(layer, detector: str, **kw):
    """The one detector's result on `layer` (the audit's defaults otherwise: seq_len 16, seed 0)."""
    return diagnostics.audit(layer, detectors=[detector], **kw).result(detector)


def probe_of(layer, seq_len: int = 16, **declared) -> Probe:
    """A probe of `layer` audited as not causal (the audit's defaults otherwise: seed 0)."""
    return Probe(make_subject(layer, **declared), causal=False, scale=None, seq_len=seq_len, seed=0)


def scores_of(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B,H,Tq,d) x (B,H,d,Tk) -> (B,H,Tq,Tk)


def attention(q, k, v, mask=None):
    """Scaled dot-product attention on (B, H, T, d), True = may attend; returns (out, weights)."""
    scores = scores_of(q, k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # -inf before softmax: masked keys get weight 0
    weights = scores.softmax(-1)
    return weights @ v, weights  # (B, H, Tq, d)


def inverted(q, k, v, mask=None):
    """The reference with its mask's polarity inverted: it blocks where the mask says True."""
    return attention(q, k, v, None if mask is None else ~mask)


def adds(q, k, v, mask=None):
    """The reference adding its mask to the scores (a bool mask then shifts the allowed logits by 1)."""
    scores = scores_of(q, k) + (0.0 if mask is None else mask)
    weights = scores.softmax(-1)
    return weights @ v, weights


def src_masked(q, k, v, src_mask=None):
    """The reference, its mask named as torch's True = blocked mask is (a suggestion, not a declaration)."""
    return attention(q, k, v, src_mask)


# ---- _mask_hints: which conventions are tried, on which outputs ---------------------------------------------------


def test_the_conventions_tried_are_every_other_one_once_the_suggested_first():
    """candidates' `c != s.mask_convention and c not in out` (L38): a mask named `src_mask` suggests blocked (True =
    blocked), tried first; then the 18 meanings x shapes less the layer's own (allowed, (B, 1, Tq, Tk)) and less the
    suggestion already listed: 17, each once (with `or`, its own convention is tried too and the suggestion twice).
    Its twin, the same layer declared blocked: allowed is tried, blocked is not."""
    every = len(MEANINGS) * len(SHAPES) - 1  # less its own: 3 x 6 - 1 (the sequence-first shape Tq,Tk,B among them)
    tried = [str(c) for c in candidates(probe_of(src_masked))]
    assert tried[0] == "blocked" and len(tried) == len(set(tried)) == every == 17 and "allowed" not in tried, tried
    declared = [str(c) for c in candidates(probe_of(src_masked, mask="blocked"))]
    assert "allowed" in declared and "blocked" not in declared and len(declared) == every, declared


def test_a_function_whose_outputs_are_four_dimensional_is_hinted_its_convention():
    """honoured_conventions' shape guard `out.dim() < 3` (L82): a function's output is (B, H, T, d), four axes; the
    inverted function honours its mask given as True = blocked (with `> 3` every four-axis output is passed over and
    nothing is hinted). Its twin, the same function declared blocked: nothing to hint."""
    found = honoured_conventions(probe_of(inverted))
    assert [str(c) for c, _ in found] == ["blocked"], found
    assert "moved 32 of 32 rows that see it" in found[0][1], found
    assert honoured_conventions(probe_of(inverted, mask="blocked")) == []


def test_a_layer_adds_its_bool_mask_only_where_its_convention_is_not_additive():
    """adds_bool_mask's guard `meaning == "additive" or not s.takes_mask` (L105): the function that adds its mask
    gives the same output for the bool mask as for 0./1. floats: True where its convention is the default (bool),
    False where it is declared additive (with `and`, the guard never fires and an additive mask, already float, reads
    as added). The other side, a layer that takes no mask: False either way."""
    assert adds_bool_mask(probe_of(adds)) is True
    assert adds_bool_mask(probe_of(adds, mask="additive")) is False
    assert adds_bool_mask(probe_of(lambda q, k, v: attention(q, k, v))) is False


# ---- detectors/causal.py: future_leakage's cuts ---------------------------------------------------------------------


def causal_attention(q, k, v, mask=None):
    """The reference with its own bottom-right causal mask (and the mask given, if any)."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    allowed = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)  # (Tq, Tk)
    return attention(q, k, v, allowed if mask is None else allowed & mask)


@pytest.mark.parametrize("T, cuts", [(2, [0]), (3, [0, 1]), (4, [0, 2]), (16, [0, 8, 14])])
def test_future_leakage_cuts_only_where_a_token_follows(T, cuts):
    """future_cuts' `c < T - 1` (L84): at T = 2, T // 2 = 1 is the last position, with no token after it to perturb,
    so the cut at 0 stands alone (with `<=`, [0, 1]); at T = 3 the cut at 1 has token 2 after it and is kept."""
    found = verdict(causal_attention, "future_leakage", causal=True, seq_len=T)
    assert found.verdict == "pass" and f"(cuts at t={cuts}; no mask and a padding mask)" in found.message, found


@pytest.mark.parametrize("T, shown, past", [(4, "t>=1 of sequence 0 and t>=3 of sequence 1 were", 8),
                                             (5, "t>=3 of sequence 0 and t>=4 of sequence 1 were", 14)])
def test_future_leakage_leaves_the_cut_at_0_to_the_padding_mask_only_where_that_saves_a_copy(T, shown, past):
    """unmasked_copies' `ceil(len(unmasked) / B) < ceil(len(cuts) / B)` (L96), for a layer that takes a mask (its cut
    at 0 is measured under a padding mask too): at T = 5 the cuts 0, 2, 3 need two copies of the batch of 2 and 2, 3
    one, so the cut at 0 is left to the padding mask; at T = 4 the cuts 0, 2 fill one copy either way, so both are
    measured without a mask (with `<=`, the cut at 0 is dropped there too: sequences 0 and 1 both cut at 2). The
    words of cut_cases' `len(set(at)) == 1` (L112): a copy whose sequences are cut at different t names each, the
    padding mask's copy, cut at 0 in both, one t."""
    found = verdict(causal_attention, "future_leakage", causal=True, seq_len=T)
    assert found.verdict == "pass", found
    assert found.evidence.startswith(f"no mask: 0 / {past} past outputs changed (0.0%)"), found.evidence
    assert f"when only {shown} perturbed (x1000, no mask)" in found.evidence, found.evidence
    assert "when only t>=1 was perturbed (x1000, a padding mask)" in found.evidence, found.evidence


# ---- detectors/causal.py: causal_alignment ------------------------------------------------------------------------


class OldestKeys(nn.Module):
    """Causal self-attention forward(x, mask=None) of 2 heads over d_model 16 that keeps only the `keep` oldest keys
    of each query (keys 0..keep-1): every row keeps min(keep, its allowed keys), the form of top-k attention, and the
    queries from position `keep` on give their own position weight 0."""

    def __init__(self, keep: int):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out, self.keep = nn.Linear(16, 48), nn.Linear(16, 16), keep

    def forward(self, x, mask=None):
        B, T, D = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d)
        allowed = torch.ones(T, T, dtype=torch.bool).tril() & (torch.arange(T) < self.keep)  # (T, T)
        if mask is not None:
            allowed = allowed & mask
        weights = scores_of(q, k).masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, H, T, T)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


def test_causal_alignment_counts_the_queries_that_drop_their_own_position_in_its_top_k_skip():
    """check_causal_alignment's count `(diag <= 0).sum()` in the top-k skip (L167): keeping the 4 oldest keys, the
    queries at t = 4..15 of 2 sequences x 2 heads give their own position weight 0 (48), those at t = 0..3 do not
    (16): "48 / 64" (with `<`, 0; with `>=`, 64). Its twin, the same layer keeping all 16 keys: every query attends
    its own position."""
    found = verdict(OldestKeys(4), "causal_alignment", causal=True)
    assert found.verdict == "skip" and "keeps only the 4 largest weights" in found.message, found
    assert "(48 / 64 queries here, observed softmax output (dim=-1))" in found.message, found.message
    dense = verdict(OldestKeys(16), "causal_alignment", causal=True)
    assert dense.verdict == "pass" and dense.message.startswith("every query attends its own position"), dense


def test_top_k_reads_a_layer_that_keeps_one_key_as_top_k_and_one_that_keeps_none_as_not():
    """top_k's `k < 1` (L191): weights that keep the oldest key alone, in every row of 6 causal queries, are top-1 (with
    `<= 1`, None: the layer fails as dropping its own position); weights that keep no key are no top-k."""
    T = 6
    one = torch.zeros(2, 2, T, T)
    one[..., 0] = 1.0  # (B, H, Tq, Tk): every query's weight on key 0
    assert top_k(one, None) == 1
    assert top_k(torch.zeros(2, 2, T, T), None) is None
    assert verdict(OldestKeys(1), "causal_alignment", causal=True).verdict == "skip"


def one_head_top_left(q, k, v, mask=None):
    """Head 0 under a top-left causal mask (query i sees keys j <= i: its newest query misses the newest keys once
    Tq < Tk), head 1 bottom-right."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    left = torch.ones(t_q, t_k, dtype=torch.bool).tril()  # (Tq, Tk)
    right = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)
    return attention(q, k, v, torch.stack([left, right]))  # (H = 2, Tq, Tk)


def both_heads_bottom_right(q, k, v, mask=None):
    t_q, t_k = q.shape[-2], k.shape[-2]
    return attention(q, k, v, torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q))


def test_causal_alignment_fails_where_one_head_of_the_newest_query_misses_the_newest_key():
    """_newest_key_seen's `(last <= tol).any()` (L227): one head of two misaligned top-left fails (with `all`, every
    head and sequence would have to miss the key); its twin, both heads bottom-right, passes."""
    found = verdict(one_head_top_left, "causal_alignment", causal=True, num_heads=2)
    assert (found.verdict, found.value) == ("fail", 0.0), found
    assert verdict(both_heads_bottom_right, "causal_alignment", causal=True, num_heads=2).verdict == "pass"


# ---- detectors/causal.py: undeclared_causality --------------------------------------------------------------------


def test_undeclared_causality_reports_a_whole_side_of_zeros_as_1_and_none_as_0():
    """check_undeclared_causality's reported `value=1.0` (L302, the warn's value: the whole side is zero; x10 and x0.1
    survived, as no test read it): 1.0 for the function that masks the future itself, against its threshold 0.0; its
    twin, the same attention without the mask, passes with 0.0. The words for that side (L304, L307: `side ==
    "future"`): the pairs with the key after the query, and the fix that audits it as causal."""
    found = verdict(causal_attention, "undeclared_causality")
    assert (found.verdict, found.value, found.threshold) == ("warn", 1.0, 0.0), found
    assert "all 120 (query, key) pairs with the key after the query get weight 0" in found.evidence, found.evidence
    assert found.fix.startswith("audit it as causal") and "then measure its mask" in found.fix, found.fix
    dense = verdict(attention, "undeclared_causality")
    assert (dense.verdict, dense.value, dense.threshold) == ("pass", 0.0, 0.0), dense


def anti_causal_attention(q, k, v, mask=None):
    """The reference blocking the past (a triu where tril belongs): query i sees keys j >= i."""
    return attention(q, k, v, torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu())


def test_undeclared_causality_words_a_layer_that_masks_the_past():
    """The other side of `side == "future"` (L298, L300, L304, L307): a layer that blocks the past is told so, the
    pairs with the key before the query named, and the fix blocks the future instead."""
    found = verdict(anti_causal_attention, "undeclared_causality")
    assert (found.verdict, found.value) == ("warn", 1.0) and "masks the past" in found.message, found
    assert found.message.startswith("every weight below the diagonal is exactly 0"), found.message
    assert "all 120 (query, key) pairs with the key before the query get weight 0" in found.evidence, found.evidence
    assert found.fix.startswith("block the future, not the past"), found.fix


def test_top_k_reads_three_axis_weights_under_a_three_axis_mask():
    """top_k's `weights.dim() == 4 and mask.dim() == 3` (L187): a (B, Tq, Tk) mask is given a head axis only for
    (B, H, Tq, Tk) weights; weights of one head, (B, Tq, Tk), keeping each query's 3 newest keys, are top-3 under the
    causal mask as without one (with `or`, the mask's head axis made room (B, 1, Tq) that cannot take the weights'
    shape, and the check raised)."""
    T = 6
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (Tq, Tk)
    newest = (torch.arange(T)[None, :] > torch.arange(T)[:, None] - 3) & causal  # each query's 3 newest keys
    weights = (newest.double() / newest.sum(-1, keepdim=True)).expand(2, T, T)  # (B, Tq, Tk)
    assert top_k(weights, None) == 3
    assert top_k(weights, causal.expand(2, T, T)) == 3


@pytest.mark.parametrize("causal, copies", [(False, 1), (True, 2)])
def test_future_leakage_adds_its_cuts_to_the_decoding_stack_only_in_a_causal_audit(causal, copies):
    """unmasked_cut_cases' guard `not probe.causal or probe.t < 2` (L138): audited as not causal, the DECODING stack
    holds its baseline alone (with `and`, future_leakage's cuts, which nothing reads there, add a copy of the batch
    to the call); audited as causal, one copy more: the cuts at 8 and 14 of 16 tokens."""
    probe = Probe(make_subject(attention), causal=causal, scale=None, seq_len=16, seed=0)
    assert _made(probe, DECODING).copies == copies


# ---- model/packing.py: packed_documents ----------------------------------------------------------------------------

D, H = 32, 4


def docs_of(position_ids):
    """(B, T) document ids: a new document wherever the position ids restart at 0."""
    return (position_ids == 0).cumsum(-1)


class Gate(nn.Module):
    """A sigmoid of the running mean over the whole sequence (it does not restart at a document's start): (B, T),
    one value per position, or (B, T, 1) with `keepdim`."""

    def __init__(self, keepdim: bool):
        super().__init__()
        self.keepdim = keepdim

    def forward(self, x):
        t = torch.arange(1, x.shape[1] + 1, device=x.device)  # (T,): how many tokens each running mean holds
        gate = torch.sigmoid(x.mean(-1).cumsum(-1) / t)  # (B, T)
        return gate.unsqueeze(-1) if self.keepdim else gate


class DocAttention(nn.Module):
    """Causal self-attention over (B, T, D) kept inside each packed document (`apart`), or over the whole sequence;
    `strict`: a query sees the keys before it only (the first of each document none: output 0); `gate`: its output
    scaled by a Gate of its input."""

    def __init__(self, apart: bool = True, strict: bool = False, gate: Gate | None = None):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.apart, self.strict, self.gate = apart, strict, gate

    def forward(self, x, docs):
        B, T, _ = x.shape  # batch, sequence length
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d)
        i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
        allowed = ((j < i) if self.strict else (j <= i)).expand(B, T, T)  # (B, T, T)
        if self.apart:
            allowed = allowed & (docs.unsqueeze(-1) == docs.unsqueeze(-2))  # block-diagonal
        scores = scores_of(q, k).masked_fill(~allowed.unsqueeze(1), float("-inf"))  # (B, H, T, T)
        weights = scores.softmax(-1).nan_to_num(0.0)  # a query with no key to see: weight 0 everywhere
        y = self.out((weights @ v).transpose(1, 2).reshape(B, T, D))
        if self.gate is not None:
            gate = self.gate(x)
            y = y * (gate if gate.dim() == 3 else gate.unsqueeze(-1))
        return y


class RunningMean(nn.Module):
    """Each position plus the mean of every position up to it: a mixer that does not restart at a document."""

    def forward(self, x):
        return x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)


class PackedLM(nn.Module):
    """A decoder-only LM of 16 positions, forward(input_ids, position_ids=None), its attention layers `layers`
    (DocAttention) given the documents where the position ids restart. `pooled`: one output per sequence (the
    positions' mean); `blind`: the tokens are not read (positions only); `residual`: the attention's output added to
    its input (else it replaces it); `mix`: a running mean over the sequence before the attention, in a submodule
    ("module") or in forward itself ("inline"); `one_by_one`: the attention called on one sequence at a time."""

    causal = True

    def __init__(self, *layers, pooled=False, blind=False, residual=True, mix=None, one_by_one=False):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe, self.head = nn.Embedding(64, D), nn.Embedding(16, D), nn.Linear(D, 64)
        self.attn = nn.ModuleList(layers or [DocAttention()])
        self.mix = RunningMean() if mix == "module" else None
        self.pooled, self.blind, self.residual, self.inline = pooled, blind, residual, mix == "inline"
        self.one_by_one = one_by_one

    def attend(self, attn, x, docs):
        if self.one_by_one:
            return torch.cat([attn(x[b:b + 1], docs[b:b + 1]) for b in range(x.shape[0])])  # (B, T, D)
        return attn(x, docs)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        x = self.wpe(position_ids) + (0.0 if self.blind else self.wte(input_ids))  # (B, T, D)
        if self.mix is not None:
            x = self.mix(x)
        if self.inline:
            x = x + x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
        docs = docs_of(position_ids)
        for attn in self.attn:
            x = x + self.attend(attn, x, docs) if self.residual else self.attend(attn, x, docs)
        out = self.head(x)  # (B, T, vocab)
        return out.mean(1) if self.pooled else out


def packed(model):
    return diagnostics.audit_model(model, packed=True, detectors=["packed_documents"]).result("packed_documents")


def test_packed_documents_skips_a_model_with_one_output_per_sequence():
    """check_packed_documents' `not per_position(out, T)` (L151): the outputs' mean over the positions, (4, 64), has no
    position to compare (never firing, the check indexes a position axis that is not there); its twin, the same
    model's (4, 16, 64), passes."""
    found = packed(PackedLM(pooled=True))
    assert (found.verdict, found.message) == ("skip", "not applicable: the model's output (4, 64) has no sequence "
                                                      "dimension (one output per position is what this check "
                                                      "compares)"), found
    assert packed(PackedLM()).verdict == "pass"


def test_packed_documents_is_not_measured_where_a_documents_tokens_move_none_of_its_outputs():
    """`own_moved = own_moved and (change[s:e] > tol).any()` (L165): a model that reads the positions and not the
    tokens moves no output of a changed document: not measured (with `or`, own_moved stays True and it passes)."""
    found = packed(PackedLM(blind=True))
    assert (found.verdict, found.message) == ("skip", "not measured: changing a document's tokens did not move its "
                                                      "own outputs"), found


def test_packed_documents_measures_a_document_that_moves_some_of_its_own_outputs():
    """The same line's `any` (L165): a model whose output at t reads only the tokens before t in its document (no
    residual) leaves each document's first output still when that document changes, and moves the rest: measured,
    a pass (with `all`, not measured). Its twin, each output reading its own token too, passes alike."""
    assert packed(PackedLM(DocAttention(strict=True), residual=False)).verdict == "pass"
    assert packed(PackedLM(DocAttention(), residual=False)).verdict == "pass"


def test_packed_documents_counts_the_outputs_a_change_moved_in_other_documents():
    """The count `(outside > tol).sum()` (L171): causal attention over the whole sequence, documents 0..4, 5..9 and
    10..15: changing document 0 moves the 11 later outputs, document 1 the 6 of document 2, document 2 none outside
    itself (with `<`, the outputs that did not move were counted)."""
    found = packed(PackedLM(DocAttention(apart=False)))
    assert found.verdict == "fail" and found.layer == "attn.0", found
    assert "changing document 0 (t=0..4) moved 11 outputs of other documents, first t=5" in found.evidence, found
    assert found.evidence.endswith("document 0: 11 outside outputs moved; document 1: 6 outside outputs moved"), found


def test_packed_documents_names_the_first_layer_whose_outputs_cross():
    """The first layer `(ch > tol).any()` (L181): the first layer keeps the documents apart and the second does not:
    attn.1 is named (with `<`, any layer with a still output, the first); its twin, the other way round, attn.0."""
    assert packed(PackedLM(DocAttention(), DocAttention(apart=False))).layer == "attn.1"
    assert packed(PackedLM(DocAttention(apart=False), DocAttention())).layer == "attn.0"


@pytest.mark.parametrize("keepdim", [False, True])
def test_packed_documents_names_a_gate_of_one_value_per_position_where_the_leak_starts(keepdim):
    """`_crosses`' `t.dim() < 2` (L78): a gate that returns one value per position, (B, T), and mixes the whole
    sequence is where the leak starts, a module without softmax attention: a warning naming it, as for its (B, T, 1)
    twin (with `<= 2` it is not read, and the attention is failed; before, flatten(2) raised on it, the replay found
    nothing, and the attention was failed too)."""
    found = packed(PackedLM(DocAttention(gate=Gate(keepdim))))
    assert (found.verdict, found.layer) == ("warn", "attn.0.gate"), found
    assert "the leak starts in attn.0.gate (Gate), which runs no softmax attention" in found.message, found


def test_packed_documents_never_names_the_model_itself_where_the_leak_starts():
    """leak_source's `found or not path` (L97): a running mean in the model's own forward is no submodule, and the
    model (path "") is never named: the attention its change first crosses at is failed (with `and`, the model was
    named as where the leak starts). Its twin, the running mean in a submodule, is named: a warning."""
    inline = packed(PackedLM(mix="inline"))
    assert (inline.verdict, inline.layer) == ("fail", "attn.0"), inline
    assert inline.message.endswith("; the change first crosses at attn.0"), inline.message
    module = packed(PackedLM(mix="module"))
    assert (module.verdict, module.layer) == ("warn", "mix"), module


class Summary(nn.Module):
    """Funnel-Transformer-style pooling attention: queries at every other position, 8 of 16, over every key of the
    sequence: (B, 8, D), a summary of the whole sequence, not one row per position."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(D, D), nn.Linear(D, 2 * D)

    def forward(self, x):
        q = self.q(x[:, ::2])  # (B, T', D): every other position, T' = ceil(T / 2)
        k, v = self.kv(x).chunk(2, -1)  # (B, T, D) each
        weights = (q @ k.transpose(1, 2) / math.sqrt(D)).softmax(-1)  # (B, T', D) x (B, D, T) -> (B, T', T)
        return weights @ v  # (B, T', D)


class SummarisedLM(PackedLM):
    """PackedLM whose forward also returns a Summary of its embeddings, made before its attention (an auxiliary
    output: the logits come first)."""

    def __init__(self, *layers):
        super().__init__(*layers)
        self.summary = Summary()

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        summary = self.summary(self.wte(input_ids))  # (B, 8, D)
        return super().forward(input_ids, position_ids), summary


@pytest.mark.parametrize("apart", [False, True])
def test_packed_documents_does_not_read_an_attention_output_of_another_length_as_positions(apart):
    """check_packed_documents' `layer_out.shape[0] != rows or layer_out.shape[1] != T` (L177, its second `or`): the
    pooling attention's 8 rows are not positions, so they are passed over, and the leak is found at attn.0 (with `and`,
    its rows 5..7, past document 0's five, moved, and it was named first); its twin, the documents kept apart,
    passes."""
    found = packed(SummarisedLM(DocAttention(apart=apart)))
    assert (found.verdict, found.layer) == (("pass", None) if apart else ("fail", "attn.0")), found


@pytest.mark.parametrize("one_by_one", [True, False])
def test_packed_documents_does_not_compare_rows_of_a_layer_called_on_one_sequence_at_a_time(one_by_one):
    """The same line's batch test (L177, its first `or`): a layer called on each sequence alone returns (1, 16, D) per
    call, one row that cannot be compared with another: passed over, so no layer is named, though the leak fails (with
    `and`, its missing second row was indexed and the check raised); its twin, called on the batch, is named."""
    found = packed(PackedLM(DocAttention(apart=False), one_by_one=one_by_one))
    assert (found.verdict, found.layer) == ("fail", None if one_by_one else "attn.0"), found


# ---- model/window.py: where a layer declares its pattern --------------------------------------------------------


def module_with(**attributes) -> nn.Module:
    m = nn.Module()
    for name, value in attributes.items():
        setattr(m, name, value)
    return m


def declared(**attributes):
    """(pattern name, band) a module with these attributes declares, or None."""
    found = declared_pattern(module_with(**attributes))
    return None if found is None else (found.pattern.name, found.band)


def test_a_window_of_0_or_a_bool_declares_nothing_and_a_window_of_1_declares_one_key():
    """_positive_int's `value > 0` (L72): `sliding_window = 0` declares no window (with `>=`, a window of 0 keys, which
    blocks every key); 1 declares a window of one key, the query's own. True is no width."""
    assert declared(sliding_window=0) is None
    assert declared(sliding_window=1) == ("sliding_window(1)", 1)
    assert declared(sliding_window=True) is None


def test_a_layer_that_is_not_causal_declares_its_window_on_both_sides_and_its_chunk_as_it_is():
    """declared_pattern's `declared.kind != "window"` (L84): a window of a layer with `is_causal = False` is two-sided,
    |i - j| <= 2, spanning 3 rows (with `==`, left one-sided, and a chunk was made two-sided instead); its twin, a
    chunk of such a layer, stays chunked(4)."""
    assert declared(sliding_window=2, is_causal=False) == ("two_sided_window(2)", 3)
    assert declared(attention_chunk_size=4, is_causal=False) == ("chunked(4)", 4)
    assert declared(sliding_window=2) == ("sliding_window(2)", 2)


def test_an_attention_pattern_attribute_that_is_not_callable_is_no_declaration():
    """_declared's `own is not None and callable(own)` (L93): a layer whose `attention_pattern` is a name ("local"),
    not a Pattern or a mask_mod, declares its window by its `sliding_window` (with `or`, the name was read as a
    pattern, which raised); its twin, a callable mask_mod, is read as the layer's own pattern."""
    assert declared(attention_pattern="local", sliding_window=3) == ("sliding_window(3)", 3)
    assert declared(attention_pattern=lambda b, h, q, kv: (kv <= q) & (q - kv < 3), sliding_window=5)[1] == 3


def test_a_pattern_of_the_layers_own_declares_its_span_only_where_it_is_causal_and_narrower_than_64():
    """_span, read on 64 positions: `allowed.triu(1).any()` (L134): a two-sided band |q - kv| <= 2 allows some later
    keys, so no window is read from it (with `all`, only a pattern allowing every later key was refused, and this one
    declared a span of 3); its twin, the causal band, spans 3. `span < T` (L138): the plain causal mask spans all 64
    rows, no window (with `<=`, a window of 64); a band of 63 keys is one."""
    assert declared(attention_pattern=lambda b, h, q, kv: (q - kv).abs() <= 2) is None
    assert declared(attention_pattern=lambda b, h, q, kv: (kv <= q) & (q - kv <= 2))[1] == 3
    assert declared(attention_pattern=lambda b, h, q, kv: kv <= q) is None
    assert declared(attention_pattern=lambda b, h, q, kv: (kv <= q) & (q - kv < 63))[1] == 63


# ---- model/window.py: sliding_window in a model --------------------------------------------------------------------


class WindowAttention(nn.Module):
    """Causal self-attention over (B, T, D) that keeps the last `w` keys of each query and declares it
    (`sliding_window = w`); `refuses`: it raises on an input larger than 100 (a range check)."""

    def __init__(self, w: int, refuses: bool = False):
        super().__init__()
        self.qkv, self.out, self.sliding_window, self.refuses = nn.Linear(D, 3 * D), nn.Linear(D, D), w, refuses

    def forward(self, x):
        B, T, _ = x.shape  # batch, sequence length
        if self.refuses and float(x.detach().abs().amax()) > 100:
            raise ValueError("activations out of range")
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, d)
        i, j = torch.arange(T).view(T, 1), torch.arange(T).view(1, T)
        allowed = (j <= i) & (i - j < self.sliding_window)  # (T, T): the window's keys
        weights = scores_of(q, k).masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, H, T, T)
        return self.out((weights @ v).transpose(1, 2).reshape(B, T, D))


class WindowLM(nn.Module):
    """A one-layer decoder-only LM over 16 tokens, its attention `attn`."""

    causal = True

    def __init__(self, attn: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.attn, self.head = nn.Embedding(64, D), attn, nn.Linear(D, 64)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        return self.head(x + self.attn(x))


def windowed(attn: nn.Module):
    return diagnostics.audit_model(WindowLM(attn), detectors=["sliding_window"]).result("sliding_window")


def test_sliding_window_measures_a_window_one_shorter_than_the_sequence_and_counts_the_outputs_it_blocks():
    """check_sliding_window's `T < w + 1` (L226): a window of 15 keys at 16 tokens is measured (with `<=`, not
    measured); its twin, a window of 16, is not: no row lies past it. The reading's count `(~allows).sum()` (L212):
    window 4, changing position 0 moves t = 0..3 and not the 12 others (with `allows`, 4)."""
    found = windowed(WindowAttention(15))
    assert found.verdict == "pass", found
    assert found.evidence == ("attn: window 15 exact (WindowAttention.sliding_window = 15; s=0: t=0..14 moved, the 1 "
                              "others not)"), found.evidence
    whole = windowed(WindowAttention(16))
    assert (whole.verdict, whole.message) == ("skip", "not measured: attn: window 16 >= seq_len 16, not measured"), \
        whole
    four = windowed(WindowAttention(4))
    assert "s=0: t=0..3 moved, the 12 others not; s=3: t=3..6 moved, the 12 others not" in four.evidence, four


def test_sliding_window_does_not_count_a_layer_that_raised_on_its_probe_as_exact():
    """`readings and not readings[-1].startswith("raised")` (L248): a layer that raises on the probe's position pushed
    1000x is not measured (with `or`, counted exact: a pass); its twin without the range check passes."""
    found = windowed(WindowAttention(4, refuses=True))
    assert (found.verdict, found.message) == ("skip", "not measured: attn: raised ValueError"), found
    assert windowed(WindowAttention(4)).verdict == "pass"
