"""The audit's cost in forward passes of the audited layer, measured in one run.

    python benchmarks/audit_cost.py [--lengths 16 128 1024] [--repeats 5] [--causal] [--threads N]

For the reference MultiHeadAttention(512, 8) at each probe length, times forward passes (batch 2, the
audit's probe batch, under torch.no_grad()) and whole audits, interleaved so that both see the same load,
and prints the fastest and the median of each, their ratios, and the number of layer calls the audit made.
On a shared machine the fastest runs are the closest to the work itself; the medians show the spread.
Target (issues 3, 8 and 9): ratio <= 40 at every length, the 1024 audit under 10 s on 2 cores.
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


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="audits per length (10 forward passes each)")
    parser.add_argument("--causal", action="store_true", help="audit a causal layer (adds future_leakage, "
                                                              "causal_alignment and decode_consistency)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = MultiHeadAttention(512, 8, causal=args.causal).eval()
    diagnostics.audit(MultiHeadAttention(16, 2))  # warm-up: first use of the observer imports torch internals
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"threads={torch.get_num_threads()}, {'causal' if args.causal else 'not causal'}")
    print(f"{'seq_len':>7}  {'forward (ms)':>15}  {'audit (s)':>13}  {'audit / forward':>15}  {'calls':>5}")
    print(f"{'':>7}  {'fastest median':>15}  {'fastest median':>13}  {'fastest median':>15}")
    for t in args.lengths:
        x = torch.randn(2, t, 512)
        forwards, audits, reports = [], [], []
        with torch.no_grad():
            layer(x)  # warm-up
        for _ in range(args.repeats):
            with torch.no_grad():
                forwards += [seconds(lambda: layer(x)) for _ in range(10)]
            audits.append(seconds(lambda: reports.append(diagnostics.audit(layer, seq_len=t, causal=args.causal))))
        assert reports[-1].passed, str(reports[-1])
        fast_f, mid_f = min(forwards), statistics.median(forwards)
        fast_a, mid_a = min(audits), statistics.median(audits)
        print(f"{t:>7}  {1e3 * fast_f:>7.2f} {1e3 * mid_f:>7.2f}  {fast_a:>6.3f} {mid_a:>6.3f}  "
              f"{fast_a / fast_f:>7.1f} {mid_a / mid_f:>7.1f}  {reports[-1].forward_passes:>5}")


if __name__ == "__main__":
    main()
