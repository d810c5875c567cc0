"""How far correct layers stay from each detector's threshold, per dtype (the margins in _thresholds.py).

    python benchmarks/margins.py [--seeds 50] [--seq-len 16]

Audits correct layers (the reference, causal and not; torch's F.scaled_dot_product_attention;
nn.MultiheadAttention; and a causal layer with a KV cache of its own, the never-seen `CachedRotary` of
tests/test_never_seen.py) over many seeds in float64, float32, bfloat16 and float16 on the CPU, at torch's
default initialisation and at GPT-2's (std 0.02, `correct.gpt2_init_`), and prints,
for each detector with a tolerance, the largest value a correct layer produced, the threshold, and the
margin: the smallest threshold / value over the audits (thresholds that depend on the layer, such as
cache_decoding's multiple of a recomputation's noise, are compared audit by audit). For softmax_saturation
the value is |applied / expected scale - 1|.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import diagnostics  # noqa: E402
from correct import MultiHeadAttention, gpt2_init_  # noqa: E402
from diagnostics._thresholds import SCALE_RATIO  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_never_seen import CachedRotary  # noqa: E402  (a correct cached layer the package does not ship)

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
TOLERANCE_DETECTORS = ("weight_row_sums", "output_variance", "query_locality", "mask_honoured", "future_leakage",
                       "eval_determinism", "softmax_saturation", "batch_independence", "decode_consistency",
                       "gradients", "cache_decoding")
# "must move" detectors: correct layers must stay *above* the threshold; the smallest value is their margin
MUST_MOVE = ("keys_matter",)


def layers(dtype, seed):
    for init in ("default", "gpt2"):
        prepare = (lambda m: gpt2_init_(m, seed=seed).to(dtype)) if init == "gpt2" else (lambda m: m.to(dtype))
        yield f"reference ({init})", prepare(MultiHeadAttention(32, 4)), {}
        yield f"reference causal ({init})", prepare(MultiHeadAttention(32, 4, causal=True)), dict(causal=True)
        yield f"nn.MultiheadAttention ({init})", prepare(torch.nn.MultiheadAttention(32, 4, batch_first=True)), {}
        yield f"CachedRotary ({init})", prepare(CachedRotary(24, 3)), dict(causal=True)
    yield "F.scaled_dot_product_attention", F.scaled_dot_product_attention, dict(dtype=dtype, causal=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=16)
    args = parser.parse_args()
    worst = defaultdict(float)  # (detector, dtype) -> largest value seen on a correct layer
    margin = {}  # (detector, dtype) -> smallest threshold / value over the audits
    lowest = {}  # (detector, dtype) -> smallest value of a must-move detector on a correct layer
    threshold = {}
    failures = []
    for dtype in DTYPES:
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            for name, layer, kw in layers(dtype, seed):
                report = diagnostics.audit(layer, seq_len=args.seq_len, seed=seed, **kw)
                if not report.passed:
                    failures.append(f"{name} {dtype} seed {seed}: {[f.detector for f in report.findings]}")
                for r in report.results:
                    if r.detector in MUST_MOVE and r.value is not None and r.verdict != "skip":
                        key = (r.detector, str(dtype).replace("torch.", ""))
                        lowest[key] = min(lowest.get(key, float("inf")), r.value)
                    if r.detector in TOLERANCE_DETECTORS and r.value is not None and r.verdict != "skip":
                        value = abs(r.value - 1) if r.detector == "softmax_saturation" else r.value
                        key = (r.detector, str(dtype).replace("torch.", ""))
                        worst[key] = max(worst[key], value)
                        limit = SCALE_RATIO - 1 if r.detector == "softmax_saturation" else r.threshold
                        threshold[key] = min(threshold.get(key, limit), limit)
                        if value > 0:
                            margin[key] = min(margin.get(key, float("inf")), limit / value)
    print(f"{'detector':<20} {'dtype':<9} {'threshold':>10} {'largest correct':>16} {'margin':>9}")
    for (det, dt), value in sorted(worst.items()):
        shown = "exact" if value == 0 else f"{margin[(det, dt)]:.3g}x"
        print(f"{det:<20} {dt:<9} {threshold[(det, dt)]:>10.1e} {value:>16.2e} {shown:>9}")
    for (det, dt), value in sorted(lowest.items()):
        print(f"{det:<20} {dt:<9} {'> 0':>10} {value:>16.2e} {'(smallest: must move)':>9}")
    print(f"\ncorrect layers failing an audit: {len(failures)}")
    for line in failures[:20]:
        print("  " + line)


if __name__ == "__main__":
    main()
