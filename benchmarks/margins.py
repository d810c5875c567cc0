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

    python benchmarks/margins.py --sizes [--seeds 20]

`parameters_used`'s SIZE_MOVES instead: for each layer holding a scale it multiplies its activations by (QK-norm
gains, learned temperatures; the hand-written ones of tests/test_layer_causes.py and tests/test_parameters.py, and
diffusers' QK-norm attention where diffusers is installed), on float64 copies at default and GPT-2 initialisation,
the size statistic <grad, P> / loss of every such scale: the smallest over the correct layers and the largest over
the layers whose norm removes a scale (nViT's bug, written in tests/test_parameters.py), beside the threshold.
"""

from __future__ import annotations

import argparse
import math
import sys
from types import SimpleNamespace
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
TOLERANCE_DETECTORS = ("weight_row_sums", "output_variance", "query_locality", "mask_honoured", "blocked_keys_absent",
                       "future_leakage", "eval_determinism", "softmax_saturation", "batch_independence",
                       "decode_consistency", "gradients", "cache_decoding")
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


def scaled_layers():
    """(name, make, removes): correct layers holding elementwise scales, and the bug whose norm removes them."""
    from test_layer_causes import CosineAttention, Restormer, RMSQKNorm
    from test_parameters import NormalisedScaled
    yield "cosine attention, learned temperature", CosineAttention, False
    yield "Restormer (channel attention)", Restormer, False
    yield "RMS QK-norm with gains", RMSQKNorm, False
    yield "nViT-style scales after the l2 norm", lambda: NormalisedScaled(where="after"), False
    yield "nViT-style scales before the l2 norm (bug)", lambda: NormalisedScaled(where="before"), True
    try:
        from diffusers.models.attention_processor import Attention
    except ImportError:
        return
    for norm in ("rms_norm", "layer_norm"):
        yield f"diffusers Attention(qk_norm={norm!r})", (lambda n=norm: Attention(32, heads=4, dim_head=8,
                                                                                  qk_norm=n)), False


def sizes(seeds: int) -> None:
    """The size statistic of every elementwise scale, per layer: the margin of SIZE_MOVES on both sides."""
    from diagnostics._tracing import trace_call
    from diagnostics.detectors.parameters import FORWARD_MOVES, SIZE_MOVES, elementwise_scales, size_moves
    low, high = {}, {}
    for name, make, removes in scaled_layers():
        for seed in range(seeds):
            for init in ("default", "gpt2"):
                torch.manual_seed(seed)
                layer = make().double()
                if init == "gpt2":
                    gpt2_init_(layer, seed=seed)
                x = torch.randn(2, 8, next(p for p in layer.parameters() if p.dim() == 2).shape[-1],
                                dtype=torch.float64)
                sub = SimpleNamespace(layer=layer, device="cpu")  # what trace_call reads of a subject
                params = dict(layer.named_parameters())
                out = layer(x)
                out = out[0] if isinstance(out, tuple) else out
                loss = (out ** 2).sum()
                grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))
                trace = trace_call(sub, x, x, x, None, call=lambda: layer(x))
                for p in sorted(elementwise_scales(trace, params)):
                    with torch.no_grad():
                        params[p].mul_(2)
                        doubled = layer(x)
                        params[p].div_(2)
                    doubled = doubled[0] if isinstance(doubled, tuple) else doubled
                    moved = float((doubled - out).abs().max() / out.detach().square().mean().sqrt())
                    for stat, v in (("<grad, P> / loss", size_moves(params[p], grads[p], float(loss.detach()))),
                                    ("doubled: output moves", moved)):
                        book, key = (high if removes else low), (name, p, stat)
                        book[key] = max(book.get(key, 0.0), v) if removes else min(book.get(key, math.inf), v)
    print(f"over {seeds} seeds x 2 initialisations, float64: SIZE_MOVES = {SIZE_MOVES:.0e} (<grad, P> / loss, which "
          f"only selects the scales to double), FORWARD_MOVES = {FORWARD_MOVES:.0e} (the output's move, which decides)")
    for (name, p, stat), v in sorted(low.items()):
        limit = SIZE_MOVES if stat.startswith("<") else FORWARD_MOVES
        print(f"  correct  {name:<45} {p:<14} {stat:<22} smallest {v:.2e}  margin {v / limit:.2g}x")
    for (name, p, stat), v in sorted(high.items()):
        limit = SIZE_MOVES if stat.startswith("<") else FORWARD_MOVES
        print(f"  removed  {name:<45} {p:<14} {stat:<22} largest  {v:.2e}  margin {limit / max(v, 1e-300):.2g}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--sizes", action="store_true", help="parameters_used's SIZE_MOVES instead (see above)")
    args = parser.parse_args()
    if args.sizes:
        return sizes(min(args.seeds, 20))
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
