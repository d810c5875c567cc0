"""The audit's cost in forward passes of the audited layer, measured in one run.

    python benchmarks/audit_cost.py [--lengths 16 128 1024] [--repeats 3]

For the reference MultiHeadAttention(512, 8) at each probe length, prints the median time of one forward
pass (batch 2, the audit's probe batch), the median audit time, their ratio, and the number of forward
calls the audit made. Targets (issue 3): ratio <= 40 at every length, the 1024 audit under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import diagnostics  # noqa: E402
from correct import MultiHeadAttention  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--causal", action="store_true", help="audit a causal layer (adds future_leakage and "
                                                              "causal_alignment, the most expensive probes)")
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = MultiHeadAttention(512, 8, causal=args.causal).eval()
    diagnostics.audit(MultiHeadAttention(16, 2))  # warm-up: first use of the observer imports torch internals
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"threads={torch.get_num_threads()}")
    print(f"{'seq_len':>7}  {'forward (s)':>11}  {'audit (s)':>9}  {'audit / forward':>15}  {'calls':>5}")
    for t in args.lengths:
        x = torch.randn(2, t, 512)
        with torch.no_grad():
            layer(x)  # warm-up
            forward = median_seconds(lambda: layer(x), max(args.repeats, 5))
        reports = []
        audit = median_seconds(lambda: reports.append(diagnostics.audit(layer, seq_len=t,
                                                                                         causal=args.causal)),
                               args.repeats)
        assert reports[-1].passed, str(reports[-1])
        print(f"{t:>7}  {forward:>11.4f}  {audit:>9.3f}  {audit / forward:>15.1f}  {reports[-1].forward_passes:>5}")


if __name__ == "__main__":
    main()
