"""The audit's cost in forward passes of the audited layer, measured in one run.

    python benchmarks/audit_cost.py [--lengths 16 128 1024] [--repeats 5] [--causal] [--threads N] [--per-detector]
                                    [--pattern sliding_window:128 | chunked:C | prefix_lm:P | causal] [--cpu]
                                    [--cold N]   (--cold N --lengths: the cold figures alone)
                                    [--vs OTHER_TREE [--rounds 4]] [--json]

For the reference MultiHeadAttention(512, 8) at each probe length, times forward passes (batch 2, the
audit's probe batch, under torch.no_grad()) and whole audits, interleaved so that both see the same load,
and prints the fastest and the median of each, their ratios, the number of layer calls the audit made, and
the work of those calls in forward-pass equivalents: each call's multiply-adds (projections of Tq queries and
Tk keys and values, Tq x Tk scores and weighted values) over those of one batch-2 forward at seq_len, a call
whose inputs require gradients counted three times (forward and backward, the backward as two).
On a shared machine the fastest runs are the closest to the work itself; the medians show the spread. *Paired*:
the median over the audits of each audit's time over the median of the twenty forwards around it (ten before, ten
after), the figure a burst of others' load moves least: a burst that slows the audits' neighbours slows them too,
where the fastest forward (one quiet moment) and the median forward (slowed by bursts the audits may have missed)
need not match the audits' own conditions (in one run at 128 the forward took 6.0 ms fastest and 19.9 ms median:
33.1 forward passes fastest, 21.7 median).
`--cpu`: one thread, and CPU time of this process (time.process_time) instead of wall clock, for forwards and
audits alike: on a machine others load, the ratio of CPU times moves far less than that of wall clocks (the
audit's threads cannot wait for cores). `--per-detector` splits each detector's time into what its layer calls
took (the layer's forward, from a pre-hook to a hook, the float64 copy's calls included: it inherits the hooks)
and the rest, the audit's own time outside the layer (drawing, comparing, backward passes; observing is inside: it
runs in the call). A call several detectors read (the standard probe, a stacked probe of diagnostics/detectors/
_stacked.py, decode_consistency's calls, which output_shape reads too, batch_independence's call, the float64 gradient
probe) counts to the detector that made it, the first of its readers to run: weight_row_sums makes the padding stack
(mask_honoured's and future_leakage's cases), query_locality the one with separate streams (keys_matter's too),
output_shape decode_consistency's calls (the full pass holds future_leakage's cuts without a mask), eval_determinism
batch_independence's call, gradients the float64 probe parameters_used reads; output_variance's call on identical
tokens is runs' non-contiguous probe.
`--cold N`: first the cold start, in fresh processes (one untimed first, then N timed): `import torch`, then
`import diagnostics` and building the reference MultiHeadAttention(512, 8, causal=True), its first causal audit at
seq_len 16 and a second one (warm), with the modules the first audit imported and whether torch._dynamo was among
them. Two rows: this package's bytecode cached (what an installed package, or any second run, pays) and compiled
from source in every process (where Python writes no bytecode: PYTHONDONTWRITEBYTECODE, which this project's
sandbox sets, or a read-only checkout); each reads a bytecode directory of its own (`sys.pycache_prefix`).
Target (issue 21): the first audit under 0.5 s after `import torch` (stretch 0.3 s).
Target (issues 3, 8 and 9): <= 40 forward passes at every length, the 1024 audit under 10 s on 2 cores; issue 21:
a warm causal audit within 30 forward passes at seq_len 128 (stretch 20), within 20 at 1024 (stretch 12) and
under 6 s there.
`--vs OTHER_TREE`: a change's effect on the warm figures, this checkout against another (a `git archive` of the
commit before, say), each measured by this script in `--rounds` fresh processes, alternating A B, B A, ...: per
length, each process's paired ratio, calls and work, and the median of the rounds' ratios (the other tree's code is
imported through AUDIT_COST_TREE, which also names the tree a plain run measures). Two processes of one tree differ by
up to 5-6%: four rounds of the same code against itself gave 0.991x (0.967-1.060) at 128, causal, 15 audits a process.
`--json`: the table's rows as JSON lines (what `--vs` reads).
`--one-stream`: the reference inside a module given one stream, `forward(x, mask)` (`OneStream`), where keys_matter
reads the values through the value projection (see docs/performance.md for its figures).
`--pattern`: audit with a declared pattern (diagnostics.patterns; the layer is given its mask), which adds
attention_pattern (issue 19): at most 9 copies of the probe batch (its MAX_COPIES) and, for a causal layer, 2 copies
of the decoding inputs (DECODE_COPIES), whatever the pattern's width; the last two columns are the audit's work and
its fastest time over those of the same audit without the pattern (the causal audit, with --causal), timed
interleaved with it. Issue 19: the cost of a declared-pattern audit, bounded whatever W. Measured at d2f6d27 with
--cpu --repeats 3 (2 cores shared with other work), work in forward passes at T = 128 / 1024: the causal audit
26.6 / 24.6; with sliding_window(16) 38.5 / 36.1 (1.45x / 1.47x; fastest CPU time 1.5-1.6x at 128, 1.3-1.9x at
1024 between runs), with sliding_window(128) the same 38.5 / 36.1; not causal, with sliding_window(16) 29.4 / 28.6
(1.52x / 1.54x the plain audit). Before (one copy per residue class, at most 32): 57.5 / 53.1 with
sliding_window(16) (2.16x), 80.3 / 74.1 with sliding_window(128) (3.0x), 38.4 / 37.6 not causal (2.0x).
"""

from __future__ import annotations

import argparse
import os
import platform
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(os.environ.get("AUDIT_COST_TREE") or Path(__file__).resolve().parents[1])
"""The checkout whose diagnostics and reference layer are measured: this one, or `--vs`'s in a child process."""
sys.path.insert(0, str(ROOT))
import diagnostics
from correct import MultiHeadAttention
from diagnostics import patterns


COLD_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
sys.path.insert(0, {root!r})
if {threads!r}:
    torch.set_num_threads({threads!r})
# this package's bytecode only: torch's was read as installed
sys.pycache_prefix, sys.dont_write_bytecode = {prefix!r}, {dont_write!r}
import diagnostics
from correct import MultiHeadAttention
torch.manual_seed(0)
layer = MultiHeadAttention(512, 8, causal=True)
t2 = time.perf_counter()
before = set(sys.modules)
assert diagnostics.audit(layer, causal=True, seq_len=16).passed
t3 = time.perf_counter()
imported = sorted(set(sys.modules) - before)
diagnostics.audit(layer, causal=True, seq_len=16)
t4 = time.perf_counter()
print(json.dumps(dict(torch=t1 - t0, setup=t2 - t1, first=t3 - t2, warm=t4 - t3, imported=len(imported),
                      dynamo=any(m.startswith("torch._dynamo") for m in imported))))
"""


def cold(runs: int, threads: int | None) -> None:
    """The cold-start table (`--cold`): fresh processes, one untimed, then `runs` timed, with this package's bytecode
    cached and compiled from source (each in a bytecode directory of its own, `sys.pycache_prefix`, so that whatever
    the checkout's __pycache__ holds, and PYTHONDONTWRITEBYTECODE, change neither row; torch's own bytecode is read
    as installed)."""
    root = str(ROOT)
    with tempfile.TemporaryDirectory() as cached, tempfile.TemporaryDirectory() as empty:
        settings = [("this package's bytecode cached (an installed package; any run after the first)", cached, False),
                    ("compiled from source in every process (no bytecode cache: PYTHONDONTWRITEBYTECODE, as this "
                     "project's sandbox sets it)", empty, True)]
        print(f"cold start: fresh processes, {runs} timed after one untimed; seconds, fastest / median; load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"  {'import torch':>13}  {'import + build':>15}  {'first audit':>13}  {'warm audit':>13}  "
              f"{'first / warm':>12}  {'imported':>8}  dynamo  setting")
        for label, prefix, dont_write in settings:
            script = COLD_SCRIPT.format(root=root, threads=threads, prefix=prefix, dont_write=dont_write)
            rows = []
            for i in range(runs + 1):
                done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True,
                                      timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"the cold-start process failed:\n{done.stderr[-2000:]}")
                if i:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))

            def pair(key, rows=rows):
                xs = [r[key] for r in rows]
                return f"{min(xs):.3f} / {statistics.median(xs):.3f}"

            ratio = statistics.median(r["first"] / r["warm"] for r in rows)
            print(f"  {pair('torch'):>13}  {pair('setup'):>15}  {pair('first'):>13}  {pair('warm'):>13}  "
                  f"{ratio:>11.1f}x  {rows[0]['imported']:>8}  {'yes' if any(r['dynamo'] for r in rows) else 'no':>6}"
                  f"  {label}")


def versus(args) -> None:
    """`--vs OTHER_TREE`: this tree's warm figures against another checkout's, each in `--rounds` fresh processes of
    this script (`--json`, with the other's diagnostics and reference layer imported through AUDIT_COST_TREE, run
    from its own directory), alternating A B, B A, ...: per length, each process's paired ratio, its calls and work,
    and the median of the rounds' ratios of this tree's paired figure over the other's. Each figure is already a
    ratio to its own process's forwards, so the pairing cancels what the machine's speed does between rounds."""
    here, other = ROOT.resolve(), args.vs.resolve()
    if not (other / "diagnostics").is_dir():
        raise SystemExit(f"--vs {args.vs}: expected a checkout of this project (a diagnostics/ folder there), found none")
    flags = ["--json", "--repeats", str(args.repeats), "--lengths", *map(str, args.lengths)]
    flags += ["--causal"] * args.causal + ["--cpu"] * args.cpu
    flags += ["--threads", str(args.threads)] if args.threads else []
    flags += ["--pattern", args.pattern] if args.pattern else []
    rows: dict[Path, list[dict]] = {here: [], other: []}  # per tree, per round: {seq_len: the row}
    for r in range(args.rounds):
        for tree in (here, other) if r % 2 == 0 else (other, here):
            done = subprocess.run([sys.executable, "-W", "ignore", str(Path(__file__).resolve()), *flags], cwd=tree,
                                  env=dict(os.environ, AUDIT_COST_TREE=str(tree)), capture_output=True, text=True,
                                  timeout=3600)
            if done.returncode != 0:
                raise SystemExit(f"the process measuring {tree} failed:\n{done.stderr[-2000:]}")
            lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            rows[tree].append({row["seq_len"]: row for row in lines})
    print(f"this tree {here} against --vs {other}: {args.rounds} processes each, alternating; "
          f"{'causal' if args.causal else 'not causal'}, {'CPU time' if args.cpu else 'wall clock'}, "
          f"{args.repeats} audits a process; paired ratios in forward passes")
    for t in args.lengths:
        mine, theirs = ([round_[t] for round_ in rows[tree]] for tree in (here, other))
        ratios = [a["paired"] / b["paired"] for a, b in zip(mine, theirs)]
        for name, runs in (("this tree", mine), ("--vs", theirs)):
            paired = " ".join(f"{r['paired']:5.1f}" for r in runs)
            print(f"{t:>7}  {name:<9}  paired {paired}  calls {runs[0]['calls']}  work {runs[0]['work']:.1f}")
        print(f"{t:>7}  this tree / --vs: {statistics.median(ratios):.3f}x, median of {len(ratios)} rounds "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


def multiply_adds(batch: int, t_q: int, t_k: int, d: int) -> int:
    """One MultiHeadAttention(d) call: W_Q and W_O on Tq tokens, W_K and W_V on Tk, q.k and weights @ v."""
    return batch * (2 * t_q * d * d + 2 * t_k * d * d + 2 * t_q * t_k * d)


def work_of_calls(layer, audit) -> tuple[list, int]:
    """Run `audit()` with a hook on `layer` (the gradient check's float64 copy inherits it): its calls, (batch, Tq,
    Tk, 3 with gradients else 1) each, and the layer's d_model."""
    calls = []

    def hook(module, args, kwargs):
        query = args[0] if args else kwargs["query" if "query" in kwargs else "x"]  # x: `OneStream`'s
        key = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("key", query)
        key = query if key is None else key
        grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (query, key))
        calls.append((query.shape[0], query.shape[1], key.shape[1], 3 if grad else 1))

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        audit()
    finally:
        handle.remove()
    d = layer.d_model
    return calls, d


def forward_passes(calls, d: int, t: int) -> float:
    """The work of `calls` ((batch, Tq, Tk, weight) each) in batch-2 forward passes at seq_len t."""
    return sum(k * multiply_adds(b, t_q, t_k, d) for b, t_q, t_k, k in calls) / multiply_adds(2, t, t, d)


def per_detector(layer, clock=time.perf_counter, **options) -> list[tuple[str, int, float, float, float]]:
    """One audit, timed and counted per detector (the progress callback marks where each starts): [(detector,
    layer calls, their work in batch-2 forward passes, seconds, of which inside the layer's calls)]; "setup" is
    what precedes the first detector; what follows the last one (settling `runs`, the report) counts to the last; a
    call several detectors read counts to the one that made it."""
    calls: dict[str, list] = {}
    wall: dict[str, float] = {}
    inside: dict[str, float] = {}
    now = {"det": "setup", "since": clock(), "entered": []}

    def progress(det, index, total):
        t = clock()
        wall[now["det"]] = wall.get(now["det"], 0.0) + t - now["since"]
        now.update(det=det, since=t)

    def enter(module, args, kwargs):
        now["entered"].append(clock())

    def leave(module, args, kwargs, output):
        if now["entered"]:  # the outermost call of a layer calling itself (nested) is counted once
            start = now["entered"].pop()
            if not now["entered"]:
                inside[now["det"]] = inside.get(now["det"], 0.0) + clock() - start

    def hook(module, args, kwargs):
        query = args[0] if args else kwargs["query" if "query" in kwargs else "x"]  # x: `OneStream`'s
        key = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("key", query)
        key = query if key is None else key
        grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in (query, key))
        calls.setdefault(now["det"], []).append((query.shape[0], query.shape[1], key.shape[1], 3 if grad else 1))

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True),
               layer.register_forward_pre_hook(enter, with_kwargs=True),
               layer.register_forward_hook(leave, with_kwargs=True, always_call=True)]
    try:
        diagnostics.audit(layer, progress=progress, **options)
    finally:
        for handle in handles:
            handle.remove()
    t = clock()
    wall[now["det"]] = wall.get(now["det"], 0.0) + t - now["since"]
    T, d = options["seq_len"], layer.d_model
    rows = []
    for det, spent in wall.items():
        made = calls.get(det, [])
        rows.append((det, len(made), forward_passes(made, d, T), spent, inside.get(det, 0.0)))
    return rows


CLOCK = time.perf_counter  # --cpu: time.process_time


def seconds(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[16, 128, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="audits per length (10 forward passes each)")
    parser.add_argument("--causal", action="store_true", help="audit a causal layer (adds future_leakage, "
                                                              "causal_alignment and decode_consistency)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--per-detector", action="store_true", help="after each length, one audit timed and counted "
                                                                    "per detector")
    parser.add_argument("--pattern", default=None, help="a declared pattern, NAME[:N] of diagnostics.patterns, "
                                                        "e.g. sliding_window:128")
    parser.add_argument("--cpu", action="store_true", help="one thread, and this process's CPU time instead of wall "
                                                           "clock (ratios that others' load moves less)")
    parser.add_argument("--detector-repeats", type=int, default=3, help="--per-detector: audits per length, the "
                                                                        "fastest of each figure shown")
    parser.add_argument("--cold", type=int, default=0, metavar="N", help="first, the cold start in N fresh processes "
                                                                         "(see the module docstring)")
    parser.add_argument("--vs", type=Path, default=None, metavar="OTHER_TREE",
                        help="this tree's warm figures against another checkout's, in alternating fresh processes")
    parser.add_argument("--rounds", type=int, default=4, help="--vs: processes per tree (A B, B A, ...)")
    parser.add_argument("--json", action="store_true", help="one JSON line per length instead of the table")
    parser.add_argument("--one-stream", action="store_true", help="the reference inside a module given one stream, "
                                                                  "forward(x, mask): keys_matter reads its values "
                                                                  "through its value projection")
    args = parser.parse_args()
    if args.vs is not None:
        versus(args)
        return
    if args.cold:
        cold(args.cold, args.threads)
        if not args.lengths:
            return
    global CLOCK
    if args.cpu:
        CLOCK = time.process_time
        args.threads = 1
    pattern = None
    if args.pattern:
        name, _, n = args.pattern.partition(":")
        pattern = getattr(patterns, name)(*([int(n)] if n else []))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = MultiHeadAttention(512, 8, causal=args.causal).eval()
    if args.one_stream:
        layer = OneStream(layer).eval()
    diagnostics.audit(MultiHeadAttention(16, 2))  # warm-up: first use of the observer imports torch internals
    if not args.json:
        header(args, pattern)
    for t in args.lengths:
        measure(args, layer, t, pattern)


class OneStream(torch.nn.Module):
    """`--one-stream`: the reference given one stream, self-attention as most models call it. Its keys cannot change
    without its queries, so keys_matter moves its values alone through the output of its value projection, found by
    doubling each candidate nn.Linear's output (`Probe.value_projection`): the cost that layer form adds."""

    def __init__(self, inner: MultiHeadAttention):
        super().__init__()
        self.inner, self.d_model = inner, inner.d_model

    def forward(self, x, mask=None):
        return self.inner(x, mask=mask)


def header(args, pattern) -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
          f"threads={torch.get_num_threads()}, {'causal' if args.causal else 'not causal'}, "
          f"{'CPU time' if args.cpu else 'wall clock'}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          f"{f', pattern={pattern}' if pattern is not None else ''}")
    plain = "causal" if args.causal else "plain"  # the same audit without the pattern
    print(f"{'seq_len':>7}  {'forward (ms)':>15}  {'audit (s)':>13}  {'audit / forward':>22}  {'calls':>5}  "
          f"{'work (forward passes)':>21}" + (f"  {f'/ {plain} audit':>17}" if pattern is not None else ""))
    print(f"{'':>7}  {'fastest median':>15}  {'fastest median':>13}  {'fastest median paired':>22}" +
          (f"  {'':>5}  {'':>21}  {'work  fastest':>17}" if pattern is not None else ""))


def measure(args, layer, t: int, pattern) -> None:
    """One length's row of the table (one JSON line with `--json`), and with `--per-detector` its detectors'."""
    x = torch.randn(2, t, 512)
    forwards, audits, plains, reports = [], [], [], []
    with torch.no_grad():
        layer(x)  # warm-up
    def one_audit(t=t, reports=reports, pattern=pattern):
        reports.append(diagnostics.audit(layer, seq_len=t, causal=args.causal, pattern=pattern))

    blocks = []  # ten forwards before each audit, and ten after the last
    for _ in range(args.repeats):
        with torch.no_grad():
            blocks.append([seconds(lambda x=x: layer(x)) for _ in range(10)])
        audits.append(seconds(one_audit))
        if pattern is not None:  # interleaved, so that both see the same load
            plains.append(seconds(lambda t=t: one_audit(t, pattern=None)))
    with torch.no_grad():
        blocks.append([seconds(lambda x=x: layer(x)) for _ in range(10)])
    assert all(r.passed for r in reports), str(next(r for r in reports if not r.passed))
    forwards = [f for block in blocks for f in block]
    fast_f, mid_f = min(forwards), statistics.median(forwards)
    fast_a, mid_a = min(audits), statistics.median(audits)
    # each audit over the median of the twenty forwards around it (the block before and the block after): the
    # machine's drift and bursts move both alike, where the fastest of one and the median of the other need not
    paired = statistics.median(a / statistics.median(blocks[i] + blocks[i + 1]) for i, a in enumerate(audits))
    calls, d = work_of_calls(layer, lambda t=t: diagnostics.audit(layer, seq_len=t, causal=args.causal,
                                                                  pattern=pattern))
    work = forward_passes(calls, d, t)
    if args.json:  # for --vs: what the table's row says, as numbers
        print(json.dumps(dict(seq_len=t, forward_fastest=fast_f, forward_median=mid_f, audit_fastest=fast_a,
                              audit_median=mid_a, paired=paired, calls=reports[0].forward_passes, work=work)))
        return
    ratio = ""
    if pattern is not None:
        plain_calls, _ = work_of_calls(layer, lambda t=t: diagnostics.audit(layer, seq_len=t, causal=args.causal))
        ratio = f"  {work / forward_passes(plain_calls, d, t):>5.2f}x {fast_a / min(plains):>9.2f}x"
    print(f"{t:>7}  {1e3 * fast_f:>7.2f} {1e3 * mid_f:>7.2f}  {fast_a:>6.3f} {mid_a:>6.3f}  "
          f"{fast_a / fast_f:>7.1f} {mid_a / mid_f:>7.1f} {paired:>6.1f}  {reports[0].forward_passes:>5}  "
          f"{work:>21.1f}{ratio}")
    if args.per_detector:
        runs = [per_detector(layer, clock=CLOCK, seq_len=t, causal=args.causal, pattern=pattern)
                for _ in range(args.detector_repeats)]
        # per detector, the fastest of the audits (calls and work are the same in each)
        rows = [(det, n, w, min(r[i][3] for r in runs), min(r[i][4] for r in runs))
                for i, (det, n, w, _, _) in enumerate(runs[0])]
        total = sum(r[3] for r in rows) or 1.0
        inside = sum(r[4] for r in rows)
        print(f"{'':>9}{'detector':<22}{'calls':>6}{'work (fp)':>11}{'time (s)':>10}{'share':>7}"
              f"{'time (fp)':>10}{'outside (fp)':>13}  (fastest of {args.detector_repeats} audits)")
        for det, n, w, sec, ins in rows:
            print(f"{'':>9}{det:<22}{n:>6}{w:>11.1f}{sec:>10.3f}{100 * sec / total:>6.1f}%"
                  f"{sec / fast_f:>10.1f}{(sec - ins) / fast_f:>13.1f}")
        print(f"{'':>9}{'sum':<22}{sum(r[1] for r in rows):>6}{sum(r[2] for r in rows):>11.1f}{total:>10.3f}"
              f"{'':>7}{total / fast_f:>10.1f}{(total - inside) / fast_f:>13.1f}  (outside the layer: "
              f"{100 * (total - inside) / total:.0f}%)")


if __name__ == "__main__":
    main()
