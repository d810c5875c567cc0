"""Largest error of the reference against a float64 golden run, per dtype and device, beside torch's own.

    python benchmarks/accuracy.py [--cases 300]

Draws attention cases as the tests do (diagnostics.strategies.AttentionCase over sizes, Tq != Tk and every
mask kind), and prints, per device and dtype, max |ours - golden| and max |torch SDPA - golden| over all
cases, and the worst per-case ratio ours / torch (the tests require <= 2 for float16/bfloat16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from correct import scaled_dot_product_attention  # noqa: E402
from diagnostics.strategies import MASK_KINDS, AttentionCase  # noqa: E402


def cases(n: int):
    g = torch.Generator().manual_seed(0)
    pick = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    for seed in range(n):
        yield AttentionCase(pick(1, 3), pick(1, 3), pick(1, 16), pick(1, 16), pick(1, 16), pick(1, 16),
                            MASK_KINDS[pick(0, len(MASK_KINDS) - 1)], seed)


def run(case, q, k, v, device):
    mask = None if case.mask_kind == "causal_top_left" else case.mask(device=device)
    causal = case.mask_kind == "causal_top_left"
    ours = scaled_dot_product_attention(q, k, v, mask, is_causal=causal)[0]
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"{'device':<6} {'dtype':<9} {'max |ours - golden|':>20} {'max |torch - golden|':>21} {'worst ratio':>12}")
    for device in devices:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ours_max = torch_max = ratio = 0.0
            for case in cases(args.cases):
                golden, _ = run(case, *case.qkv(dtype=torch.float64, device=device), device)
                golden = golden.nan_to_num()
                ours, theirs = run(case, *case.qkv(dtype=dtype, device=device), device)
                e_ours = float((ours.double() - golden).abs().max())
                e_torch = float((theirs.double() - golden).abs().max())
                ours_max, torch_max = max(ours_max, e_ours), max(torch_max, e_torch)
                ratio = max(ratio, e_ours / max(e_torch, torch.finfo(dtype).eps))
            print(f"{device:<6} {str(dtype)[6:]:<9} {ours_max:>20.3e} {torch_max:>21.3e} {ratio:>12.2f}")


if __name__ == "__main__":
    main()
