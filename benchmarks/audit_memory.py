"""The audit's peak memory against diagnostics._memory's estimate: for each layer and length, one audit in a fresh
process (one thread, causal, float32, CPU), its peak RSS (ru_maxrss) over the RSS before it, in (B, H, T, T) attention
maps of the probe batch, and the estimate's margin over it.

    python benchmarks/audit_memory.py [--lengths 512 1024] [--layers hand sdpa reference]

`WEIGHT_MAPS` in diagnostics/_memory.py must stay above every `maps` figure this prints."""

from __future__ import annotations

import argparse
import subprocess
import sys

ONE = r'''
import math, resource, sys
import diagnostics
import torch
import torch.nn.functional as F
from diagnostics._memory import BASE, WEIGHT_MAPS, estimate
torch.set_num_threads(1)


def hand(q, k, v, mask=None):  # (B, H, T, d): the weights as a tensor of their own
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


kind, T = sys.argv[1], int(sys.argv[2])
if kind == "reference":
    from correct import MultiHeadAttention
    layer = MultiHeadAttention(64, 4, causal=True)
else:
    layer = {"hand": hand, "sdpa": sdpa}[kind]
diagnostics.audit(layer, seq_len=8, causal=True)  # imports and lazy state first
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
report = diagnostics.audit(layer, seq_len=T, causal=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
heads = 4 if kind == "reference" else 2  # what the report's first line says
one_map = (estimate(seq_len=T, num_heads=heads, dtype=torch.float32) - BASE) / WEIGHT_MAPS
print(f"{kind:9} T={T:5}  peak {peak / 2**20:7.1f} MiB  maps {peak / one_map:5.1f}  "
      f"estimate/peak {estimate(seq_len=T, num_heads=heads, dtype=torch.float32) / peak:4.2f}  {report.status}")
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--layers", nargs="+", default=["hand", "sdpa", "reference"])
    args = parser.parse_args()
    for kind in args.layers:
        for length in args.lengths:
            done = subprocess.run([sys.executable, "-W", "ignore", "-c", ONE, kind, str(length)], capture_output=True,
                                  text=True)
            print(done.stdout.strip() or done.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
