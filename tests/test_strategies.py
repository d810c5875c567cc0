"""`diagnostics.strategies` draws what it says: sizes within bounds, masks of each kind with the pattern
(and the empty rows) docs/auditing-a-layer.md's table gives, and tensors that replay exactly from the seed."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from diagnostics.strategies import MASK_KINDS, AttentionCase, attention_cases, attention_configs

DOC = Path(__file__).resolve().parent.parent / "docs" / "auditing-a-layer.md"  # the page on property tests


def _grid(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(case.t_q).view(-1, 1), torch.arange(case.t_k)  # query i (Tq, 1), key j (Tk,)


def _empty_rows(mask: torch.Tensor) -> torch.Tensor:
    return ~mask.any(-1)  # (B, 1, Tq): queries that may attend no key


@given(case=attention_cases(max_batch=4, max_heads=4, max_len=9, max_head_dim=5))
def test_sizes_stay_within_bounds(case):
    assert 1 <= case.batch <= 4 and 1 <= case.heads <= 4
    assert 1 <= case.t_q <= 9 and 1 <= case.t_k <= 9
    assert 1 <= case.head_dim <= 5 and 1 <= case.value_dim <= 5
    assert case.mask_kind in MASK_KINDS and case.d_model == case.heads * case.head_dim


@given(case=attention_cases(same_length=True, mask_kinds=("padding",)))
def test_same_length_and_mask_kinds_are_honoured(case):
    assert case.t_q == case.t_k and case.mask_kind == "padding"


@given(case=attention_cases())
def test_every_mask_is_bool_B_1_Tq_Tk_true_meaning_may_attend(case):
    mask = case.mask()
    if case.mask_kind == "none":
        assert mask is None
        return
    assert mask.dtype == torch.bool and mask.is_contiguous()
    assert tuple(mask.shape) == (case.batch, 1, case.t_q, case.t_k)


@given(case=attention_cases(mask_kinds=("causal_top_left",)))
def test_causal_top_left_allows_keys_up_to_the_query_index_and_leaves_no_row_empty(case):
    i, j = _grid(case)
    mask = case.mask()
    assert torch.equal(mask, (j <= i).expand_as(mask))
    assert not _empty_rows(mask).any()


@given(case=attention_cases(mask_kinds=("causal_bottom_right",)))
def test_causal_bottom_right_aligns_the_last_query_with_the_last_key(case):
    i, j = _grid(case)
    mask = case.mask()
    assert torch.equal(mask, (j <= i + case.t_k - case.t_q).expand_as(mask))
    assert mask[..., -1, :].all()  # the newest query sees every key
    # empty rows exactly when there are more queries than keys: the first Tq - Tk
    empty = _empty_rows(mask)
    assert torch.equal(empty, (torch.arange(case.t_q) < case.t_q - case.t_k).expand_as(empty))


@given(case=attention_cases(mask_kinds=("padding",)))
def test_padding_keeps_a_prefix_of_at_least_one_key_for_every_query(case):
    mask = case.mask()
    assert torch.equal(mask, mask[:, :, :1].expand_as(mask))  # the same keys for every query
    lengths = mask[:, 0, 0].sum(-1)  # (B,)
    assert (lengths >= 1).all() and (lengths <= case.t_k).all()
    prefix = torch.arange(case.t_k) < lengths.view(-1, 1)  # (B, Tk)
    assert torch.equal(mask[:, 0, 0], prefix)


@given(case=attention_cases(mask_kinds=("random",)))
def test_random_masks_leave_no_row_empty(case):
    mask = case.mask()
    assert not _empty_rows(mask).any()
    assert mask.all(dim=-2).any(dim=-1).all()  # because one key column is kept for every query


@given(case=attention_cases(mask_kinds=("fully_masked_row",)))
def test_fully_masked_row_blocks_exactly_one_query_the_same_in_every_batch_row(case):
    empty = _empty_rows(case.mask())[:, 0]  # (B, Tq)
    assert (empty.sum(-1) == 1).all()
    assert torch.equal(empty, empty[:1].expand_as(empty))


@given(case=attention_cases(), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_tensors_replay_from_the_seed_in_any_dtype(case, dtype):
    q, k, v = case.qkv(dtype=torch.float64)
    assert (q.shape, k.shape, v.shape) == ((case.batch, case.heads, case.t_q, case.head_dim),
                                           (case.batch, case.heads, case.t_k, case.head_dim),
                                           (case.batch, case.heads, case.t_k, case.value_dim))
    for ours, again in zip((q, k, v), case.qkv(dtype=dtype), strict=True):
        assert again.dtype == dtype and torch.equal(ours.to(dtype), again)  # the same numbers, rounded once
    query, memory = case.inputs()
    assert query.shape == (case.batch, case.t_q, case.d_model) and memory.shape == (case.batch, case.t_k, case.d_model)
    mask = case.mask()
    assert mask is None or torch.equal(mask, case.mask())


def test_readme_documents_every_mask_kind_and_its_example_runs():
    section = DOC.read_text().split("## Property tests\n", 1)[1].split("\n## ", 1)[0]
    header, *documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert header == "mask_kind" and documented == list(MASK_KINDS)
    example = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "attention_cases" in b)
    before = DOC.read_text().index(example)
    # at its own lines of the page, so that Hypothesis, reading the test's source there, reads the example itself
    example = "\n" * DOC.read_text()[:before].count("\n") + example
    exec(compile(example, str(DOC), "exec"), {"__name__": "readme_strategies_example"})


@given(cfg=attention_configs(max_heads=3, max_head_dim=5, max_seq_len=7))
def test_attention_configs_stay_within_bounds(cfg):
    assert 1 <= cfg.num_heads <= 3 and cfg.d_model % cfg.num_heads == 0 and 1 <= cfg.head_dim <= 5
    assert 2 <= cfg.seq_len <= 7 and isinstance(cfg.causal, bool)


@given(cfg=attention_configs(max_head_dim=4, max_seq_len=8, causal=True))
def test_attention_configs_drive_an_audit_of_a_layer(cfg):
    """The documented use: a correct causal layer passes at every drawn configuration."""
    import diagnostics
    from correct import MultiHeadAttention

    assert cfg.causal
    torch.manual_seed(cfg.seed)
    report = diagnostics.assert_attention_ok(MultiHeadAttention(cfg.d_model, cfg.num_heads, causal=True),
                                             causal=True, seq_len=cfg.seq_len, seed=cfg.seed)
    assert report.seq_len == cfg.seq_len
