"""Cost of `diagnostics.distributed.audit_sharded` at 2 and 4 ranks, as ratios to the unsharded `diagnostics.audit()` of
the same layer.

    python benchmarks/sharded_cost.py [--world-sizes 2 4] [--repeats 5] [--form ring|ulysses|head_parallel]
                                      [--seq-len 16] [--d-model 32] [--heads 8] [--margins]

The layer is the reference's MultiHeadAttention (causal), its sharded form one of correct/sharded.py's. Each audit
runs at one world size. Printed per world size, medians over `--repeats` audits (after one untimed warm-up of
each): the whole sharded audit; the start-up of a group (fork to every rank in the gloo group, the file store
read); the rest of a group's life over its checks ("per check in a reused group": the four or five checks every rank
runs one after the other in one group); and "per check in fresh processes" (a group started for each check: start-up +
per check); each as a ratio to the unsharded audit's median. `--margins` audits every correct form in float32 at each
world size over five seeds, causal and not, with and without three packed documents, and prints each check's largest
reading against what was allowed (the margin of the float64-golden rule; the gradients' reading is the input's or a
parameter's, whichever is nearer its threshold). The load average is printed before and after: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import correct.sharded as cs
import diagnostics
from correct import MultiHeadAttention
from diagnostics.distributed import audit_sharded
from diagnostics.distributed._context import DOCUMENTS, JOBS, REPLICAS

FORMS = {
    "ring": (lambda layer, rank, world_size, group: cs.RingAttention(layer, group), {}),
    "ulysses": (lambda layer, rank, world_size, group: cs.UlyssesAttention(layer, group), {}),
    "head_parallel": (lambda layer, rank, world_size, group: cs.HeadParallelAttention(layer, group), {"takes": "full"}),
}

def checks(options: dict) -> int:
    """The jobs every rank runs: forward (with causality's copies), backward, train mode (whole-output layers only),
    large logits, uneven length (not the documents and replicas probes: nothing declared here)."""
    return len([j for j in JOBS if j not in (DOCUMENTS, REPLICAS)]) - (0 if options.get("takes") == "full" else 1)


def layer_of(args, seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(args.d_model, args.heads, causal=True)


def cost(args) -> None:
    layer = layer_of(args)
    factory, options = FORMS[args.form]
    diagnostics.audit(layer, causal=True, seq_len=args.seq_len)  # warm-up: imports, kernels
    plain = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        diagnostics.audit(layer, causal=True, seq_len=args.seq_len)
        plain.append(time.perf_counter() - started)
    base = statistics.median(plain)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"unsharded audit(): {base * 1000:.0f} ms (median of {args.repeats}; fastest {min(plain) * 1000:.0f} ms)")
    print(f"{'ranks':>5}  {'sharded audit':>16}  {'group start-up':>16}  {'per check, reused':>18}  "
          f"{'per check, fresh':>17}")
    for W in args.world_sizes:
        audit_sharded(layer, factory, causal=True, world_sizes=(W,), seq_len=args.seq_len, **options)  # warm-up
        whole, startup, per_check = [], [], []
        for _ in range(args.repeats):
            report = audit_sharded(layer, factory, causal=True, world_sizes=(W,), seq_len=args.seq_len, **options)
            assert report.passed, str(report)
            (up, life), = report.groups[W]
            whole.append(report.seconds)
            startup.append(up)
            per_check.append((life - up) / checks(options))
        w, s, c = (statistics.median(x) for x in (whole, startup, per_check))
        print(f"{W:>5}  {w * 1000:>7.0f} ms {w / base:>5.1f}x  {s * 1000:>7.0f} ms {s / base:>5.2f}x  "
              f"{c * 1000:>8.0f} ms {c / base:>5.2f}x  {(s + c) * 1000:>7.0f} ms {(s + c) / base:>5.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def margins(args) -> None:
    worst: dict = {}
    third = args.seq_len // 3
    lengths = [third, args.seq_len - 2 * third, third]  # three packed documents, boundaries inside shards
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    for name, (factory, options) in FORMS.items():
        for causal, documents in ((False, None), (True, None), (False, lengths), (True, lengths)):
            for seed in range(5):
                torch.manual_seed(seed)
                layer = MultiHeadAttention(args.d_model, args.heads, causal=causal,
                                           documents=None if documents is None else ids)
                report = audit_sharded(layer, factory, causal=causal, world_sizes=tuple(args.world_sizes),
                                       dtype=torch.float32, seq_len=args.seq_len, seed=seed, documents=documents,
                                       **options)
                for r in report.results:
                    if r.value is not None and r.threshold and r.detector != "sharded_heads_per_rank":
                        ratio = r.value / r.threshold
                        if ratio >= worst.get(r.detector, (0.0, ""))[0]:
                            worst[r.detector] = (ratio, f"{name} causal={causal} documents={bool(documents)} "
                                                        f"seed={seed}: {r.value:.3g} against {r.threshold:.3g}")
    for det, (ratio, where) in worst.items():
        print(f"{det:<22} largest value / allowed {ratio:.3f} (margin {1 / ratio if ratio else float('inf'):.1f}x): "
              f"{where}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--form", choices=sorted(FORMS), default="ring")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--margins", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)  # as the suite runs: tiny tensors, a shared machine
    (margins if args.margins else cost)(args)


if __name__ == "__main__":
    main()
