"""The fix follows the cause: for every catalog variant and every never-seen broken layer of the suite, the fix a
finding shows names the actual cause (the words below), found from what the op at the site did; where the audit
cannot pin a cause down, the detector's general fix is shown and marked as general. No fix names this project's
own helpers (users do not have `causal_mask`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import diagnostics
from buggy_variants import VARIANTS


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"fixes_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


never_seen = _sibling("test_never_seen")

# variant: {detector: words the fix must contain}
CATALOG = {
    "missing_scale": {"softmax_saturation": "reach it unscaled"},
    "scaled_by_d_model": {"softmax_saturation": "not by sqrt(d_model)"},
    "no_softmax": {"weight_row_sums": "softmax(dim=-1)", "output_variance": "softmax(dim=-1)"},
    "mask_after_softmax": {"weight_row_sums": "before the softmax, not the weights after it",
                           "mask_honoured": "before the softmax, not the weights after it"},
    "missing_causal_mask": {"future_leakage": "mask the future before the softmax"},
    "swapped_self_cross": {"output_shape": "from the query input", "query_locality": "from the query input",
                           "keys_matter": "from the query input"},
    "non_contiguous_view": {"runs": ".contiguous() before .view()"},
    "softmax_wrong_dim": {"weight_row_sums": "softmax(dim=-1)"},
    "heads_merged_without_transpose": {"output_variance": "transpose(1, 2).reshape",
                                       "query_locality": "transpose(1, 2).reshape",
                                       "mask_honoured": "transpose(1, 2).reshape"},
    "mask_polarity_inverted": {"mask_honoured": "inverted"},
    "causal_mask_misaligned": {"causal_alignment": "bottom-right", "decode_consistency": "bottom-right"},
    "causal_diagonal_masked": {"weight_row_sums": "its own position", "output_variance": "its own position",
                               "causal_alignment": "its own position"},
    "dropout_in_eval": {"weight_row_sums": "training=self.training"},
    "keys_from_query_stream": {"keys_matter": "keys from the key input"},
    "padding_mask_replaces_causal": {"future_leakage": "causal & padding"},
    "double_softmax": {"softmax_saturation": "second softmax"},
    "detached_softmax": {"gradients": "remove the .detach()"},
    "rotary_not_offset": {"decode_consistency": "true positions"},
    # chapter 3: attention_pattern's fix quotes the declared pattern's rule (diagnostics.patterns, `Pattern.rule`)
    "window_one_too_long": {"attention_pattern": "(q_idx - kv_idx < 4)"},
    "window_one_too_short": {"attention_pattern": "(q_idx - kv_idx < 4)"},
    "window_on_both_sides": {"attention_pattern": "(kv_idx <= q_idx) & (q_idx - kv_idx < 4)"},
    "chunk_boundary_one_late": {"attention_pattern": "(q_idx // 5 == kv_idx // 5)"},
    "documents_not_masked": {"attention_pattern": "document_id[b, q_idx] == document_id[b, kv_idx]"},
    "causal_prefix": {"attention_pattern": "(kv_idx <= q_idx) | (kv_idx < 5)"},
    "window_dropped_with_cache": {"attention_pattern": "(kv_idx <= q_idx) & (q_idx - kv_idx < 4)"},
}
# variants whose cause the audit does not pin down: the detector's general fix, marked as such
GENERAL = {
    "fully_masked_row_nan": "fully_masked_rows",  # a plain softmax over an all -inf row is no op to point at
    "heads_merged_sequence_first": "batch_independence",  # a permute over dim 0 is read as a general merge
}

NEVER_SEEN = {  # broken layer of tests/test_never_seen.py: words the fix of its failing detector must contain
    "einsum without scale": "reach it unscaled",
    "padding mask read transposed": "read transposed",
    "naive exp in float16": "maximum before the exponential",
    "heads split without transpose": "view(B, T, H, d).transpose(1, 2)",
    "causal mask one token too wide": "1 future key",
    "negative weights summing to 1": "use the softmax's output as the weights",
    "causal mask blocking the diagonal, first row kept": "its own position",
    "scores from the values": "keys from the key input",
    "softmax applied twice": "second softmax",
    "online softmax without rescale": "rescale the running value before adding the block",
    "hand-written softmax with an identity backward": "gradcheck",
    "rotary decoder, queries not offset by the cache": "true positions",
    "padding mask ORed with the causal mask": "AND, not OR",
    "own cache, rotary positions restart at 0": "true positions",
    "own cache, causal mask dropped with a cache": "mask the future",
    "own cache, first key never cached": "keep every key and value in the cache",
}
NEVER_SEEN_GENERAL = {"leak behind clean weights",
                      "output pushed out of the values' range", "keys centred over the batch"}


def test_the_tables_cover_the_catalog_and_the_never_seen_layers():
    assert set(CATALOG) | set(GENERAL) == set(VARIANTS)
    assert set(NEVER_SEEN) | NEVER_SEEN_GENERAL == set(never_seen.BROKEN) | set(never_seen.SECOND_CHAPTER)


@pytest.mark.parametrize("vid", sorted(CATALOG))
def test_the_fix_of_each_catalog_variant_names_its_cause(vid, catalog_audits):
    report = catalog_audits[vid]  # built with torch.manual_seed(0) at d_model 32, 4 heads, audited as it promises
    for det, words in CATALOG[vid].items():
        result = report.result(det)
        fix, general = result.remedy
        assert result.fired and not general and words in fix, f"{vid} / {det}: {fix!r}\n{report}"
        assert "causal_mask(" not in fix
        assert words in str(report)  # the text report shows it


@pytest.mark.parametrize("vid", sorted(GENERAL))
def test_a_cause_not_pinned_down_shows_the_general_fix_marked_as_such(vid, catalog_audits):
    report = catalog_audits[vid]
    result = report.result(GENERAL[vid])
    fix, general = result.remedy
    assert result.fired and general and fix == diagnostics.DETECTORS[GENERAL[vid]].fix, fix
    assert "the detector's general fix" in str(report)
    assert report.to_dict()["results"][list(diagnostics.DETECTORS).index(GENERAL[vid])]["fix_is_general"] is True


def _never_seen_report(name):
    make, must, _ = {**never_seen.BROKEN, **never_seen.SECOND_CHAPTER}[name]
    torch.manual_seed(0)
    layer, kw = make()
    report = diagnostics.audit(layer, **kw)
    return report, [must] if isinstance(must, str) else sorted(must)


@pytest.mark.parametrize("name", sorted(NEVER_SEEN))
def test_the_fix_of_each_never_seen_broken_layer_names_its_cause(name):
    report, detectors = _never_seen_report(name)
    for det in detectors:
        fix, general = report.result(det).remedy
        assert not general and NEVER_SEEN[name] in fix, f"{name} / {det}: {fix!r}"


@pytest.mark.parametrize("name", sorted(NEVER_SEEN_GENERAL))
def test_never_seen_layers_whose_cause_is_not_pinned_down_get_the_marked_general_fix(name):
    report, detectors = _never_seen_report(name)
    for det in detectors:
        fix, general = report.result(det).remedy
        assert general and fix == diagnostics.DETECTORS[det].fix, fix


def test_no_registered_fix_names_this_projects_helpers():
    for det in diagnostics.DETECTORS.values():
        assert "causal_mask(" not in det.fix and "correct." not in det.fix, det.id


def test_passing_detectors_carry_no_fix_in_json():
    torch.manual_seed(0)
    report = diagnostics.audit(VARIANTS["missing_scale"].build(32, 4))
    rows = report.to_dict()["results"]
    assert all(r["fix"] == "" for r in rows if r["verdict"] in ("pass", "skip")), rows
    assert any(r["fix"] for r in rows if r["verdict"] == "fail")


def test_runs_fix_follows_the_exception_not_the_detector(catalog_audits):
    """A view error gets .contiguous(); an arbitrary exception gets no view advice, only the general fix (marked),
    which sends the user to the exception."""
    from torch import nn

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.d_model, self.num_heads, self.proj = 8, 2, nn.Linear(8, 8)

        def forward(self, x, mask=None):
            raise RuntimeError("boom")

    result = diagnostics.audit(Boom()).result("runs")
    fix, general = result.remedy
    assert result.verdict == "fail" and general and ".contiguous()" not in fix and "exception" in fix, fix
    view = catalog_audits["non_contiguous_view"].result("runs")
    assert not view.remedy[1] and ".contiguous() before .view()" in view.remedy[0]


def test_runs_quotes_an_exception_raised_on_many_probes_once(catalog_audits):
    runs = catalog_audits["non_contiguous_view"].result("runs")
    error = "view size is not compatible"
    assert runs.evidence.count(error) == 1 and f"raised on {int(runs.value)} probes: RuntimeError: {error}" in \
        runs.evidence, runs.evidence
