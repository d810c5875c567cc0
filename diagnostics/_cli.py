"""`attention-audit pkg.module:obj` (and `python -m diagnostics`): audit a layer or a whole model from the command line.

    attention-audit mymodule:layer [--causal] [--seq-len N] [--require DET]... [--strict] [--json] [--html PATH]
                    [--mask CONVENTION] [--layout bhtd|bthd] [--pattern PATTERN] [--call MODULE:FUNCTION] [--cross]
                    [--positions relative|absolute]
    attention-audit --model mymodule:make_model [--example mymodule:ids] [--causal] [--seq-len N] [--json]
                    [--html PATH]

`obj` is a layer (a module or a function f(q, k, v, mask=None)), a class built with no arguments, or a
factory called with none; with `--model`, a model (an nn.Module), a class or a factory. The current directory
is importable, so `mymodule:layer` works from a scratch directory. A model's causality is inferred unless
`--causal` is given (the report says how); `--example` names its inputs (token ids (B, T), embeddings, a dict
of its inputs, or a zero-argument factory of one) where they cannot be built from the model. Exit status, for layers and models alike:

    0  passed: no detector failed and the core attention properties were measured (warnings allowed)
    1  failed: a detector failed (with --require / --strict, also a skip they turn into a failure)
    2  usage: the audit could not be set up (module not importable, object not found, not an attention
       layer, a signature it cannot call, an option that does not fit the layer, an --html path whose
       directory does not exist); one line on stderr says what was expected
    3  inconclusive: nothing failed, but the audit could not measure the attention itself (no softmax or
       fused attention observed and no weights returned), or a detector crashed; the report says why

Output piped into a reader that stops early (`attention-audit m:layer | head -2`) ends quietly: the rest
of the report goes to /dev/null, as the Python docs advise for SIGPIPE, and the exit status is the audit's.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from ._errors import AuditUsageError
from ._load import (importable_from, load_call, load_example, load_layer, load_model, load_pattern, quiet_numpy_warning,
                    resolve)

EXIT_PASSED, EXIT_FINDINGS, EXIT_USAGE, EXIT_INCONCLUSIVE = 0, 1, 2, 3
EXIT_STATUS = {"passed": EXIT_PASSED, "failed": EXIT_FINDINGS, "inconclusive": EXIT_INCONCLUSIVE}
"""A report's status (a layer's or a model's) as the exit status; 2, a usage error, has no report."""

# audit() parameters as this command spells them, for messages that name an option
OPTIONS = {"causal": "--causal", "seq_len": "--seq-len", "d_model": "--d-model", "num_heads": "--num-heads",
           "scale": "--scale", "require": "--require", "strict": "--strict", "mask": "--mask", "layout": "--layout",
           "example": "--example MODULE:OBJECT naming ", "pattern": "--pattern", "call": "--call", "cross": "--cross",
           "positions": "--positions"}
LAYER_ONLY = ("d_model", "num_heads", "scale", "mask", "layout", "pattern", "call", "positions")  # a layer audit's, not a model's
LONG_SEQ_LEN = 512  # from here on an audit takes long enough to show progress even when stderr is a file


def _jsonable(value):
    """JSON has no inf or NaN: write them as the strings "inf", "-inf" and "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _progress(stream, *, seq_len: int):
    """A progress callback for audit(): a self-updating line on a terminal, plain lines for long audits
    written to a file, nothing otherwise."""
    tty = stream.isatty()
    if not tty and seq_len < LONG_SEQ_LEN:
        return None, lambda: None

    def report(detector: str, index: int, total: int) -> None:
        if tty:
            stream.write(f"\r\x1b[Kauditing [{index + 1}/{total}] {detector}")
        else:
            stream.write(f"attention-audit: [{index + 1}/{total}] {detector}\n")
        stream.flush()

    def done() -> None:
        if tty:
            stream.write("\r\x1b[K")
            stream.flush()

    return report, done


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Audit an attention layer for silent mistakes (missing scale, leaking causal "
                               "mask, mask ignored, ...). Exit status: 0 passed, 1 failed, 2 usage error, "
                               "3 inconclusive (the attention itself could not be measured).")
    p.add_argument("target", metavar="MODULE:OBJECT", nargs="?",
                   help="the layer: pkg.module:obj, where obj is a layer, a class built with no arguments, or a "
                        "zero-argument factory (the current directory is importable)")
    p.add_argument("--model", metavar="MODULE:OBJECT",
                   help="audit a whole model instead: every attention layer in place, and the model-level checks "
                        "(causality, cache, padding, batch, backend, gradients); with --example, --causal, --seq-len, "
                        "--json, --html")
    p.add_argument("--example", metavar="MODULE:OBJECT",
                   help="with --model: the model's inputs (token ids (B, T), embeddings (B, T, D) or a dict of its "
                        "inputs, or a zero-argument factory of one), where they cannot be built from the model")
    p.add_argument("--causal", action="store_true", help="the layer promises causality: audit for future leakage")
    p.add_argument("--seq-len", type=int, metavar="N", help="probe length (default 16; use your context length)")
    p.add_argument("--d-model", type=int, metavar="D", help="model width, where the layer has no d_model attribute")
    p.add_argument("--num-heads", type=int, metavar="H", help="number of heads, where the layer does not say")
    p.add_argument("--scale", type=float, help="the softmax scale the layer declares, if not 1/sqrt(d_k)")
    p.add_argument("--require", action="append", default=[], metavar="DET",
                   help="a detector that must measure the layer: its skip fails the audit (repeat for several)")
    p.add_argument("--strict", action="store_true",
                   help="every detector that applies to the layer must measure it: a 'not measured' skip fails")
    p.add_argument("--mask", metavar="CONVENTION",
                   help="how the layer takes its mask: allowed (bool (B, 1, Tq, Tk), True = may attend; the default), "
                        "blocked (True = blocked), additive (0 keep, large negative block), key_padding ((B, Tk), "
                        "True = pad), key_keep ((B, Tk), True = keep), mha_blocked, or MEANING:SHAPE, e.g. "
                        "additive:B,Tq,Tk (shapes B,1,Tq,Tk B,Tq,Tk B*H,Tq,Tk Tq,Tk B,Tk)")
    p.add_argument("--pattern", metavar="PATTERN",
                   help="the attention pattern the layer promises: causal, sliding_window(W), chunked(C), "
                        "prefix_lm(P), document([ids]), combined with & and |, e.g. \"sliding_window(4)\"")
    p.add_argument("--call", metavar="MODULE:FUNCTION",
                   help="how to call the layer, where its inputs have names the audit cannot know: a function "
                        "call(layer, x, mask), call(layer, query, memory, mask) or call(layer, query, key, value, mask)")
    p.add_argument("--cross", action="store_true",
                   help="the layer is cross-attention: a raise when the memory's length differs from the query's "
                        "fails (otherwise such a layer is audited as self-attention only)")
    p.add_argument("--positions", choices=("relative", "absolute"),
                   help="absolute: the layer adds absolute position embeddings itself (relative_positions then does "
                        "not apply); relative: its positions are meant to be relative")
    p.add_argument("--layout", choices=("bhtd", "bthd"),
                   help="a function's tensors: bhtd (B, H, T, d; the default) or bthd (B, T, H, d, flash-attn's)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON instead of a table (with \"status\" and \"status_reason\")")
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report to PATH")
    return p


def _html_path_problem(path: str) -> str | None:
    """Why a report could not be written to `path`, checked before the audit runs; None if it can."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        return (f"expected --html {path} in an existing directory; got no directory {str(folder)!r}. "
                f"Fix: create it first (mkdir -p {folder}) or write the report elsewhere")
    if target.is_dir():
        return (f"expected --html to name a file; got the directory {path!r}. "
                f"Fix: add a file name, e.g. {target / 'audit.html'}")
    if target.exists() and not os.access(target, os.W_OK):
        return (f"expected --html {path} to be writable; got a read-only file. Fix: write the report elsewhere")
    if not os.access(folder, os.W_OK):
        return (f"expected --html {path} in a writable directory; got {str(folder)!r}, read-only. "
                "Fix: write the report elsewhere")
    return None


def main(argv: list[str] | None = None, *, prog: str = "attention-audit") -> int:
    quiet_numpy_warning()  # before the first import of torch, which the layer's module may do too
    if argv is None:  # the command itself (attention-audit, python -m diagnostics): the process exits after this
        # at exit the interpreter would walk every object torch and the audit made, looking for cycles (0.3 s of
        # a 3 s command: `farm-bench --vs`, 0.85x wall); frozen, they are skipped. Callers that pass argv are
        # left as they are.
        atexit.register(gc.freeze)
    args = _parser(prog).parse_args(argv)
    importable_from(os.getcwd())  # `mymodule:layer` from a scratch directory

    def usage(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE

    if args.seq_len is not None and args.seq_len < 1:
        return usage(f"expected --seq-len >= 1; got {args.seq_len}. Fix: pass your context length, e.g. 128")
    if args.html:
        if importlib.util.find_spec("diagnostics._html") is None:
            return usage("expected HTML reports (diagnostics._html) in this version of diagnostics; it is not "
                         "there. Fix: drop --html, or use --json")
        problem = _html_path_problem(args.html)
        if problem:
            return usage(problem)  # now, not after an audit whose report could not be saved
    if args.model is not None:
        return audit_model_command(args, prog, usage)
    if args.target is None:
        return usage("expected a target MODULE:OBJECT (a layer), or --model MODULE:OBJECT (a model). "
                     "Fix: e.g. attention-audit mymodule:layer")
    if args.example is not None:
        return usage(f"expected --example with --model (a model's inputs); got it with the layer {args.target}. "
                     "Fix: drop --example (a layer audit draws its own inputs)")
    # imported here, not at the top: they import torch, which must come after quiet_numpy_warning()
    from ._audit import audit
    from ._subject import check_seq_len, make_subject

    try:
        layer = load_layer(args.target)
        pattern = load_pattern(args.pattern) if args.pattern is not None else None
        call = load_call(args.call) if args.call is not None else None
        # options that do not fit the layer (--num-heads 5 on d_model 32, --seq-len past its block_size) are
        # usage errors, worded with this command's flags
        check_seq_len(make_subject(layer, d_model=args.d_model, num_heads=args.num_heads, mask=args.mask,
                                   layout=args.layout, call=call, options=OPTIONS), args.seq_len, options=OPTIONS)
        report_progress, done = _progress(sys.stderr, seq_len=args.seq_len or 16)
        try:
            report = audit(layer, causal=args.causal, seq_len=args.seq_len, d_model=args.d_model,
                           num_heads=args.num_heads, scale=args.scale, require=args.require, strict=args.strict,
                           mask=args.mask, layout=args.layout, pattern=pattern, call=call, cross=args.cross,
                           positions=args.positions, progress=report_progress, _options=OPTIONS)
        finally:
            done()
    except AuditUsageError as error:
        return usage(str(error))
    return emit(report, args, prog, usage)


def audit_model_command(args, prog: str, usage) -> int:
    """The `--model` branch of main(): options that belong to a layer audit are usage errors."""
    given = [f"--{name.replace('_', '-')}" for name in LAYER_ONLY if getattr(args, name, None) is not None]
    given += ["--require"] if args.require else []
    given += ["--strict"] if args.strict else []
    given += ["--cross"] if args.cross else []
    if args.target is not None:
        return usage(f"expected either MODULE:OBJECT (a layer) or --model MODULE:OBJECT; got both "
                     f"({args.target} and --model {args.model}). Fix: drop one")
    if given:
        return usage(f"expected only --example, --causal, --seq-len, --json and --html with --model; got "
                     f"{', '.join(given)}. "
                     f"Fix: drop them (the model's own call sets them for each layer)")
    from .model import audit_model  # here, not at the top: it imports torch, after quiet_numpy_warning()

    try:
        model = load_model(args.model)
        example = load_example(args.example) if args.example is not None else None
        progress = None
        if sys.stderr.isatty():
            def progress(stage, index, total):
                sys.stderr.write(f"\r\x1b[Kauditing {stage}")
                sys.stderr.flush()
        report = audit_model(model, example, causal=True if args.causal else None, seq_len=args.seq_len,
                             progress=progress, _options=OPTIONS)
        if progress is not None:
            sys.stderr.write("\r\x1b[K")
    except AuditUsageError as error:
        return usage(str(error))
    return emit(report, args, prog, usage)


def emit(report, args, prog: str, usage) -> int:
    """Print a layer's or a model's report (`--json`, else the text and any `file:line:` annotations), write
    `--html`, and return the exit status: what both branches of `main()` end with."""
    status = EXIT_STATUS[report.status]
    try:
        if args.json:
            print(json.dumps(_jsonable(report.to_dict()), indent=2, allow_nan=False))
        else:
            print(report)
            annotations = report.annotations()
            if annotations:  # file:line: lines, for editors and CI annotations
                print("\n" + "\n".join(annotations))
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early (`| head`): send the rest to /dev/null so that the flush at exit does not
        # raise again (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    if args.html:
        # checked before the audit (_html_path_problem); should writing still fail, the audit's own status stands
        # (the report was printed) and the failure is said on stderr
        try:
            report.to_html(args.html)
        except (ImportError, OSError, AuditUsageError) as error:
            print(f"{prog}: the audit ran (status above), but its HTML report was not written: {error}", file=sys.stderr)
            return status
        print(f"{prog}: wrote {args.html}", file=sys.stderr)
    return status


__all__ = ["EXIT_FINDINGS", "EXIT_INCONCLUSIVE", "EXIT_PASSED", "EXIT_STATUS", "EXIT_USAGE", "LAYER_ONLY", "OPTIONS",
           "audit_model_command", "emit", "load_example", "load_layer", "load_model", "main", "quiet_numpy_warning", "resolve"]
