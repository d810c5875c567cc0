"""Cost of `diagnostics.audit_model` against depth: model forwards, layer calls and seconds.

    python benchmarks/model_audit_cost.py [--depths 1 2 4 8 12] [--width 256] [--seq-len 128] [--repeats 3]
                                          [--threads N] [--stages]
    python benchmarks/model_audit_cost.py --margins [--seeds 3] [--dtype bfloat16]
    python benchmarks/model_audit_cost.py --families [--repeats 3]

Builds a GPT-2 config (transformers, sdpa) of each depth at the given width, 4 heads per 64 features, and audits
it; without transformers, the plain `ProtocolGPT` of `buggy_variants.teaching_model` of the same sizes. The token
ids are (2, seq_len): the audit runs at seq_len. Before any timing, a 1-layer model of the same width is audited at
the same seq_len (imports, kernels and allocator warmed for these shapes, not timed). Each depth's first audit is
timed on its own ("first": what a user running one audit waits, with the model's copies made for the first time),
then `--repeats` more, of which the fastest and the median wall seconds and the median CPU seconds of this process (`time.process_time`, all threads summed) are printed, with the load average
before and after. `--threads N` sets torch's intra-op threads first; on 2 cores shared with other jobs, 2 threads
wait for each other (OpenMP) and 1 thread is the steadier figure. `--stages` prints where the deepest model's last
audit spent its time (discovery, each layer's in-place audit, each model-level detector), read from the audit's
`progress` callback. Prints, per model-level detector, its measured value against its threshold (the parity
detectors' margins). Timing lives here, never in tests. `--margins` audits correct models instead (TinyGPT, ProtocolGPT learned and
rotary with a window, torch's TransformerEncoder; with transformers, tiny GPT-2, Llama, Mistral, Qwen2, Gemma,
Phi-3, BERT, T5, BART, ViT in eager and sdpa mode) over several seeds and prints, per parity detector, the largest
value / threshold a correct model reached (the inverse of the margin), and for the float64-golden parity checks
the largest error of the tested path divided by the same-dtype full pass's own error (what FUDGE must exceed);
`--dtype` converts each model first (bfloat16, float16). `--families` audits the tiny Hugging Face models whose
attention has a pattern or a memory (Mistral's sliding window, Gemma 2's alternating layers, Llama's packed
documents, BART's and T5's cross-attention; the tests' configs, seq_len 16) and prints the same columns, with the
verdicts of the checks they exercise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import diagnostics  # noqa: E402


_ops = None


def _transformers():
    """transformers, or None. PyPI's CUDA torchvision cannot load beside a CPU torch ("torchvision::nms does not
    exist"): declare its operators and import again, as tests/test_real_layers.py does."""
    global _ops
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        pass
    except RuntimeError:
        _ops = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            _ops.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    try:
        import transformers

        return transformers
    except Exception:
        return None


def build(depth: int, width: int, seq_len: int):
    tf = _transformers()
    torch.manual_seed(0)
    if tf is not None:
        config = tf.GPT2Config(vocab_size=1024, n_embd=width, n_layer=depth, n_head=max(1, width // 64),
                               n_positions=max(seq_len, 128), bos_token_id=0, eos_token_id=0,
                               attn_implementation="sdpa")
        return tf.GPT2LMHeadModel(config), "GPT-2 (transformers, sdpa)"
    from buggy_variants.teaching_model import ProtocolGPT

    return ProtocolGPT(vocab_size=1024, n_layer=depth, d_model=width, num_heads=max(1, width // 64),
                       block_size=max(seq_len, 128)), "ProtocolGPT (no transformers)"


def margins(seeds: int, dtype: torch.dtype = torch.float32) -> None:
    from buggy_variants.teaching_model import ProtocolGPT, TinyGPT
    from diagnostics.model import FUDGE, FUDGE_BY_DTYPE, GOLDEN_FLOOR

    zoo = {"TinyGPT": lambda: TinyGPT(), "ProtocolGPT": lambda: ProtocolGPT(),
           "ProtocolGPT rotary window 5": lambda: ProtocolGPT(rotary=True, sliding_window=5),
           "TransformerEncoder": lambda: torch.nn.TransformerEncoder(
               torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2, enable_nested_tensor=False)}
    tf = _transformers()
    if tf is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_model_audit import HF, hf_model

        for name in HF:
            for impl in ("eager", "sdpa"):
                zoo[f"{name} {impl}"] = (lambda n=name, i=impl: hf_model(tf, n, i))
    worst: dict = {}
    own: dict = {}  # parity detector: largest error / the same-dtype full pass's own error against float64
    failed = []
    in64: dict = {}  # parity detector: the largest error of its tested path in the float64 copy (low precision)
    floor = GOLDEN_FLOOR[dtype]
    for seed in range(seeds):
        for name, make in zoo.items():
            torch.manual_seed(seed)
            report = diagnostics.audit_model(make().to(dtype), seed=seed)
            if report.status != "passed":
                failed.append(f"{name} seed {seed}: {report.status_reason}")
            for det, err in report.readings.get("float64 copy", {}).items():
                if err >= in64.get(det, (-1.0,))[0]:
                    in64[det] = (err, f"{name} seed {seed}")
            for r in report.results:
                if r.value is not None and r.threshold:
                    ratio = r.value / r.threshold
                    if ratio >= worst.get(r.detector, (-1.0,))[0]:
                        worst[r.detector] = (ratio, r.value, r.threshold, f"{name} seed {seed}")
                    if r.detector in PARITY and r.threshold > floor:  # threshold = FUDGE x own error + floor
                        err_ref = (r.threshold - floor) / FUDGE_BY_DTYPE.get(dtype, FUDGE)
                        if r.value / err_ref >= own.get(r.detector, (-1.0,))[0]:
                            own[r.detector] = (r.value / err_ref, r.value, err_ref, f"{name} seed {seed}")
    print(f"{len(zoo)} correct models x {seeds} seeds, {dtype}")
    for det, (ratio, value, threshold, where) in sorted(worst.items()):
        print(f"  {det}: largest value / threshold {ratio:.3g} ({value:.3g} against {threshold:.3g}, {where})")
    for det, (ratio, value, err_ref, where) in sorted(own.items()):
        print(f"  {det}: largest error / the full pass's own error {ratio:.3g} ({value:.3g} against "
              f"{err_ref:.3g}, {where})")
    from diagnostics.model._tolerance import float64_allowed

    for det, (err, where) in sorted(in64.items()):
        print(f"  {det} in the float64 copy: largest error {err:.3g} of the outputs' RMS against "
              f"{float64_allowed():.0e} allowed ({float64_allowed() / max(err, 1e-300):.3g}x margin, {where})")
    print(f"  audits not passed: {len(failed)}")
    for line in failed:
        print(f"    {line}")


PARITY = ("cache_parity", "padding_invariance", "batch_invariance", "backend_parity")


def families(repeats: int) -> None:
    tf = _transformers()
    if tf is None:
        print("--families needs transformers: pip install -e \".[real]\"")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_model_audit import COMMON, hf_model

    def gemma2():
        torch.manual_seed(0)
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(hidden_size=32, num_key_value_heads=2, head_dim=8, sliding_window=5,
                                                    attn_logit_softcapping=None, final_logit_softcapping=None,
                                                    attn_implementation="eager", **COMMON))

    zoo = {"Mistral (window 5, sdpa)": lambda: hf_model(tf, "mistral", "sdpa"), "Gemma 2 (alternating, eager)": gemma2,
           "Llama (sdpa)": lambda: hf_model(tf, "llama", "sdpa"), "BART (sdpa)": lambda: hf_model(tf, "bart", "sdpa"),
           "T5 (sdpa)": lambda: hf_model(tf, "t5", "sdpa")}
    diagnostics.audit_model(zoo["Llama (sdpa)"]())  # imports and warm-up, not timed
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; audit (s): median of {repeats}")
    print("| model | model forwards | layer calls | audit (s) | status | sliding_window | packed_documents | "
          "cross-attention in place |")
    print("|---|---|---|---|---|---|---|---|")
    for name, make in zoo.items():
        model, times = make(), []
        for _ in range(repeats):
            start = time.perf_counter()
            report = diagnostics.audit_model(model)
            times.append(time.perf_counter() - start)
        verdict = {r.detector: r.verdict for r in report.results}
        # InPlaceCross names its memory in the layer's name ("..., in place, memory key_value_states)")
        cross = [p for p, rep in report.layers.items() if "in place, memory " in rep.layer]
        print(f"| {name} | {report.model_forwards} | {report.layer_calls} | {sorted(times)[len(times) // 2]:.2f} | "
              f"{report.status} | {verdict.get('sliding_window', '-')} | {verdict.get('packed_documents', '-')} | "
              f"{len(cross)} layers |")


def _ids(seq_len: int):
    return torch.randint(1024, (2, seq_len), generator=torch.Generator().manual_seed(0))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _median(xs: list) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _timed(model, ids, stages: dict | None = None):
    """((wall s, CPU s), report) of one audit; with `stages`, the wall seconds from each progress tick to the next
    (or the audit's end) are stored under the tick's stage, the last audit's overwriting the earlier ones'."""
    ticks = []
    progress = (lambda stage, i, n: ticks.append((stage, time.perf_counter()))) if stages is not None else None
    wall, cpu = time.perf_counter(), time.process_time()
    report = diagnostics.audit_model(model, ids, progress=progress)
    end = time.perf_counter()
    for (stage, t0), (_, t1) in zip(ticks, ticks[1:] + [(None, end)]):
        stages[stage] = t1 - t0
    return (end - wall, time.process_time() - cpu), report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--margins", action="store_true")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (default: torch's own)")
    p.add_argument("--stages", action="store_true", help="where the deepest model's last audit spent its time")
    p.add_argument("--families", action="store_true")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: pass 1 or more (the fastest and the median are of these runs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.margins:
        return margins(args.seeds, getattr(torch, args.dtype))
    if args.families:
        return families(args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {_load()}")
    diagnostics.audit_model(build(1, args.width, args.seq_len)[0], _ids(args.seq_len))  # warm-up, not timed
    print("| depth | model | model forwards | layer calls | one forward (s) | first audit (s) | fastest (s) | "
          "median (s) | CPU median (s) | status |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    last = None
    for depth in args.depths:
        model, kind = build(depth, args.width, args.seq_len)
        ids = _ids(args.seq_len)
        with torch.no_grad():
            start = time.perf_counter()
            model(ids[:1])
            forward = time.perf_counter() - start
        first, _ = _timed(model, ids)
        walls, cpus, stages = [], [], {}
        for _ in range(args.repeats):
            (wall, cpu), report = _timed(model, ids, stages if depth == args.depths[-1] else None)
            walls.append(wall)
            cpus.append(cpu)
        print(f"| {depth} | {kind} | {report.model_forwards} | {report.layer_calls} | {forward:.3f} | {first[0]:.2f} | "
              f"{min(walls):.2f} | {_median(walls):.2f} | {_median(cpus):.2f} | {report.status} |")
        last = report
    print(f"load average after: {_load()}")
    if args.stages:
        print(f"\nwhere the {args.depths[-1]}-layer model's last audit spent its time (wall s):")
        layers = sum(v for k, v in stages.items() if k.startswith("layer "))
        n = sum(1 for k in stages if k.startswith("layer "))
        for name, seconds in stages.items():
            if not name.startswith("layer "):
                print(f"  {name}: {seconds:.3f}")
        print(f"  in-place layer audits: {layers:.3f} ({n} layers, {layers / max(n, 1):.3f} each)")
    print("\nmodel-level detectors of the deepest model (value against threshold):")
    for r in last.results:
        margin = f" (margin {r.threshold / r.value:.3g}x)" if r.value and r.threshold else ""
        print(f"  {r.detector}: {r.verdict} {r.value} / {r.threshold}{margin}")
    for name, reading in last.readings.get("cache_parity", {}).items():
        print(f"  cache_parity {name} {reading['plan']}: error {reading['error']:.3g}, allowed {reading['allowed']:.3g}")


if __name__ == "__main__":
    main()
