"""`attention-audit pkg.module:obj` (and `python -m diagnostics`): audit a layer or a whole model from the command line.

    attention-audit mymodule:layer [other:layer ...] [--causal] [--seq-len N] [--require DET]... [--strict] [--json]
                    [--html PATH] [--junit-xml PATH] [--mask CONVENTION] [--layout bhtd|bthd|btd|tbd] [--pattern PATTERN]
                    [--call MODULE:FUNCTION] [--cross] [--positions relative|absolute] [--queries Q] [--dtype DTYPE]
                    [--device DEVICE] [--seed N]
                    [--detectors DET[,DET...]]
    attention-audit --model mymodule:make_model [--example mymodule:ids] [--causal] [--seq-len N] [--seed N]
                    [--detectors DET[,DET...]] [--json] [--html PATH] [--junit-xml PATH]
    attention-audit sharded mymodule:make_layer mymodule:make_sharded [--world-sizes 2 4] [--causal] ...
                    (a layer split across processes: diagnostics/distributed/_command.py)
    attention-audit --version

`obj` is a layer (a module or a function f(q, k, v, mask=None)), a class built with no arguments, or a
factory called with none; with `--model`, a model (an nn.Module), a class or a factory. The current directory
is importable, so `mymodule:layer` works from a scratch directory. A model's causality is inferred unless
`--causal` is given (the report says how); `--example` names its inputs (token ids (B, T), embeddings, a dict
of its inputs, or a zero-argument factory of one) where they cannot be built from the model. Several layers in one
command are audited one after another with the same options: each report, then a summary table (target, verdict,
failing detectors); `--json` prints one object holding them all, `--junit-xml` a testsuite per target. Exit status,
for layers and models alike (for several targets, the worst: 2, then 1, then 3, then 0):

    0  passed: no detector failed and the core attention properties were measured (warnings allowed)
    1  failed: a detector failed (with --require / --strict, also a skip they turn into a failure)
    2  usage: the audit could not be set up (module not importable, object not found, not an attention
       layer, a signature it cannot call, an option that does not fit the layer, an --html path whose
       directory does not exist); one line on stderr says what was expected
    3  inconclusive: nothing failed, but the audit could not measure the attention itself (no softmax or
       fused attention observed and no weights returned), or a detector crashed; the report says why

Ctrl-C ends the command with one line on stderr and exit status 130 (128 + SIGINT), as shells do.
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
           "positions": "--positions", "queries": "--queries", "dtype": "--dtype", "device": "--device",
           "seed": "--seed", "detectors": "--detectors", "pattern_example": '--pattern "sliding_window(4)"'}
LAYER_ONLY = ("d_model", "num_heads", "scale", "mask", "layout", "pattern", "call", "positions", "queries", "dtype",
              "device")  # a layer audit's, not a model's
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
DTYPES = ("float32", "float64", "float16", "bfloat16")  # --dtype's choices, torch's names  # a layer audit's, not a model's


def _jsonable(value):
    """JSON has no inf or NaN: write them as the strings "inf", "-inf" and "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Audit an attention layer for silent mistakes (missing scale, leaking causal "
                               "mask, mask ignored, ...). Exit status: 0 passed, 1 failed, 2 usage error, "
                               "3 inconclusive (the attention itself could not be measured).")
    p.add_argument("target", metavar="MODULE:OBJECT", nargs="*",
                   help="the layer: pkg.module:obj, where obj is a layer, a class built with no arguments, or a "
                        "zero-argument factory (the current directory is importable); several: each is audited "
                        "with the same options, then a summary table, and the exit status is the worst")
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
    p.add_argument("--queries", type=int, metavar="Q",
                   help="the layer attends with Q queries of its own (an attention-pooling head's learned query, "
                        "Perceiver's latents), not one per token: its output is (B, Q, D), or (B, D) where Q = 1")
    p.add_argument("--layout", choices=("bhtd", "bthd", "btd", "tbd"),
                   help="a function's tensors: bhtd (B, H, T, d; the default) or bthd (B, T, H, d, flash-attn's); a "
                        "module's tokens: btd (B, T, D; the default) or tbd (T, B, D, sequence first)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON instead of a table (with \"status\" and \"status_reason\")")
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report to PATH (one target)")
    p.add_argument("--junit-xml", metavar="PATH",
                   help="also write the audits as JUnit XML to PATH, as CI systems read it: a testsuite per target, "
                        "a testcase per detector (failure, error or skipped with the finding's message)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="audit in this dtype (a module is converted to it first; default: the layer's own, else float32)")
    p.add_argument("--device", metavar="DEVICE",
                   help="audit on this device, e.g. cuda (a module is moved there first; default: the layer's own)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="the seed of the audit's own random draws (default 0)")
    p.add_argument("--detectors", action="append", metavar="DET[,DET...]",
                   help="run only these detectors (repeatable, or comma-separated); default: all that apply")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return p


# what a target may declare of itself (the pytest plugin's targets)
DECLARATIONS = ("causal", "seq_len", "d_model", "num_heads", "scale", "require", "strict", "mask", "pattern", "call",
                "cross", "positions", "queries", "layout")


def target_declarations(words: list[str], *, target: str) -> dict:
    """A target's own declarations, spelled as this command spells them (`--causal --mask additive`), by audit()'s
    names: only those given. An `AuditUsageError` for anything that is not a declaration of the layer (an output,
    a dtype, a second target) or that this command would refuse."""
    parser = _parser(f"declarations of {target}")

    def refuse(message: str):
        raise AuditUsageError(f"expected declarations after the target, as attention-audit spells them (e.g. "
                              f"{target} --causal --mask additive); got {' '.join(words)!r}: {message}. Fix: "
                              f"check `attention-audit --help`")

    parser.error = refuse  # raise, not exit: the caller reports it where the target was given
    defaults, given = vars(parser.parse_args([])), vars(parser.parse_args(words))
    changed = {name: value for name, value in given.items() if value != defaults[name]}
    other = [OPTIONS.get(name, f"--{name.replace('_', '-')}") if name != "target" else "a second target"
             for name in changed if name not in DECLARATIONS]
    if other:
        refuse(f"{', '.join(other)} {'is' if len(other) == 1 else 'are'} not a declaration of the layer "
               f"(those are {', '.join(OPTIONS[name] for name in DECLARATIONS)})")
    return changed


def _version() -> str:
    from . import __version__  # the package's, read from the installed metadata
    return __version__


def _detectors(given: list[str] | None) -> list[str] | None:
    """--detectors a,b --detectors c -> ["a", "b", "c"]; None when not given (every detector)."""
    return None if given is None else [name.strip() for item in given for name in item.split(",") if name.strip()]


def _shadowed_note(prog: str, directory: str) -> str | None:
    """One line when `directory` holds a module or package named like this one (a user's diagnostics.py): the
    command uses its own package, and a module of the user's that imports `diagnostics` gets this one."""
    ours = Path(__file__).resolve().parent
    for candidate in (Path(directory) / "diagnostics.py", Path(directory) / "diagnostics"):
        if candidate.exists() and candidate.resolve() != ours:
            return (f"{prog}: note: {candidate} is shadowed by this tool's package ({ours}) while the command runs: "
                    "`import diagnostics` in your modules gets the tool's; rename yours to use both")
    return None


def _path_problem(path: str, flag: str = "--html") -> str | None:
    """Why the report that `flag` asks for could not be written to `path`, checked before the audit runs; None if
    it can. The folder's permission bits are not enough (root passes `os.access` on /sys, where no file can be
    made): a file that does not exist yet is created and removed again."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        return (f"expected {flag} {path} in an existing directory; got no directory {str(folder)!r}. "
                f"Fix: create it first (mkdir -p {folder}) or write the report elsewhere")
    if target.is_dir():
        return (f"expected {flag} to name a file; got the directory {path!r}. "
                f"Fix: add a file name, e.g. {target / 'audit.html'}")
    if target.exists():
        if not os.access(target, os.W_OK):
            return f"expected {flag} {path} to be writable; got a read-only file. Fix: write the report elsewhere"
        return None
    try:
        with open(target, "x", encoding="utf-8"):
            pass
        target.unlink()
    except OSError as error:
        return (f"expected {flag} {path} in a directory where files can be written; got {str(folder)!r}, where "
                f"creating one fails ({type(error).__name__}: {error.strerror or error}). "
                f"Fix: write the report elsewhere, e.g. {flag} {Path(path).name or 'audit'}")
    return None


def main(argv: list[str] | None = None, *, prog: str = "attention-audit") -> int:
    try:
        return _main(argv, prog=prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)  # one line, not the traceback of wherever the audit was
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None, *, prog: str) -> int:
    quiet_numpy_warning()  # before the first import of torch, which the layer's module may do too
    if argv is None:  # the command itself (attention-audit, python -m diagnostics): the process exits after this
        # at exit the interpreter would walk every object torch and the audit made, looking for cycles (0.3 s of
        # a 3 s command: `farm-bench --vs`, 0.85x wall); frozen, they are skipped. Callers that pass argv are
        # left as they are.
        atexit.register(gc.freeze)
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["sharded"]:  # a layer split across processes: the distributed wing's command and options
        from .distributed._command import sharded_main

        return sharded_main(given[1:], prog=f"{prog} sharded", statuses=EXIT_STATUS, usage=EXIT_USAGE)
    args = _parser(prog).parse_args(argv)
    importable_from(os.getcwd())  # `mymodule:layer` from a scratch directory
    note = _shadowed_note(prog, os.getcwd())
    if note:
        print(note, file=sys.stderr)

    def usage(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE

    if args.seq_len is not None and args.seq_len < 1:
        return usage(f"expected --seq-len >= 1; got {args.seq_len}. Fix: pass your context length, e.g. 128")
    if args.html:
        if importlib.util.find_spec("diagnostics._html") is None:
            return usage("expected HTML reports (diagnostics._html) in this version of diagnostics; it is not "
                         "there. Fix: drop --html, or use --json")
    for flag, path in (("--html", args.html), ("--junit-xml", args.junit_xml)):
        problem = path and _path_problem(path, flag)
        if problem:
            return usage(problem)  # now, not after an audit whose report could not be saved
    if args.model is not None:
        return audit_model_command(args, prog, usage)
    if not args.target:
        return usage("expected a target MODULE:OBJECT (a layer), or --model MODULE:OBJECT (a model). "
                     "Fix: e.g. attention-audit mymodule:layer")
    if args.example is not None:
        return usage(f"expected --example with --model (a model's inputs); got it with the layer {args.target[0]}. "
                     "Fix: drop --example (a layer audit draws its own inputs)")
    if args.html and len(args.target) > 1:
        return usage(f"expected one target with --html (one page, one layer); got {len(args.target)}. Fix: one "
                     "command per page, or --junit-xml PATH, which holds every target")
    if len(args.target) == 1:
        try:
            report = _audit_layer(args, args.target[0])
        except AuditUsageError as error:
            return usage(str(error))
        return emit(report, args, prog, usage)
    outcomes = {}  # target -> its report, or why it could not be audited
    for target in args.target:
        try:
            outcomes[target] = _audit_layer(args, target)
        except AuditUsageError as error:
            print(f"{prog}: error: {target}: {error}", file=sys.stderr)
            outcomes[target] = str(error)
    return emit_several(outcomes, args, prog)


def _audit_layer(args, target: str):
    """One layer target audited with the command's options; an `AuditUsageError` when that cannot be set up."""
    # imported here, not at the top: they import torch, which must come after quiet_numpy_warning()
    from ._audit import audit
    from ._subject import check_seq_len, make_subject

    layer = _converted(load_layer(target), device=args.device, dtype=args.dtype)
    pattern = load_pattern(args.pattern) if args.pattern is not None else None
    call = load_call(args.call) if args.call is not None else None
    # options that do not fit the layer (--num-heads 5 on d_model 32, --seq-len past its block_size) are
    # usage errors, worded with this command's flags
    check_seq_len(make_subject(layer, d_model=args.d_model, num_heads=args.num_heads, mask=args.mask,
                               layout=args.layout, call=call, queries=args.queries, options=OPTIONS),
                  args.seq_len, options=OPTIONS)
    # progress: the audit's default, a bar on stderr where it is a terminal and the audit is estimated long
    return audit(layer, causal=args.causal, seq_len=args.seq_len, d_model=args.d_model, num_heads=args.num_heads,
                 scale=args.scale, require=args.require, strict=args.strict, mask=args.mask, layout=args.layout,
                 pattern=pattern, call=call, cross=args.cross, positions=args.positions, queries=args.queries,
                 dtype=_dtype(args.dtype),
                 device=args.device, seed=args.seed, detectors=_detectors(args.detectors), _options=OPTIONS)


def _dtype(name: str | None):
    import torch  # after quiet_numpy_warning(), as every import of torch here
    return None if name is None else getattr(torch, name)


def _converted(layer, *, device: str | None, dtype: str | None):
    """A module loaded for this command, moved to --device and converted to --dtype, as `audit()` asks of a module
    whose parameters are elsewhere (the command built it, so nobody else holds it); a function is left as it is."""
    import torch
    if isinstance(layer, torch.nn.Module) and (device is not None or dtype is not None):
        try:
            return layer.to(device=device, dtype=_dtype(dtype))
        except (RuntimeError, TypeError) as error:  # an unknown or absent device
            raise AuditUsageError(f"expected --device {device} to be a device this torch can use; got "
                                  f"{type(error).__name__}: {str(error).splitlines()[0]}. Fix: --device cpu, or "
                                  "leave it out") from None
    return layer


def audit_model_command(args, prog: str, usage) -> int:
    """The `--model` branch of main(): options that belong to a layer audit are usage errors."""
    given = [f"--{name.replace('_', '-')}" for name in LAYER_ONLY if getattr(args, name, None) is not None]
    given += ["--require"] if args.require else []
    given += ["--strict"] if args.strict else []
    given += ["--cross"] if args.cross else []
    if args.target:
        return usage(f"expected either MODULE:OBJECT (a layer) or --model MODULE:OBJECT; got both "
                     f"({' '.join(args.target)} and --model {args.model}). Fix: drop one")
    if given:
        return usage(f"expected only --example, --causal, --seq-len, --seed, --detectors, --json and --html with "
                     f"--model (--junit-xml too); got "
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
                             seed=args.seed, detectors=_detectors(args.detectors), progress=progress,
                             _options=OPTIONS)
        if progress is not None:
            sys.stderr.write("\r\x1b[K")
    except AuditUsageError as error:
        return usage(str(error))
    return emit(report, args, prog, usage)


def _printed(text: str) -> None:
    """Print to stdout; a reader that stopped early (`| head`) ends it quietly."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped early: send the rest to /dev/null so that the flush at exit does not raise again
        # (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _text(report) -> str:
    """A report as the command prints it: the report, then any `file:line:` annotations, for editors and CI."""
    annotations = report.annotations()
    return str(report) + ("\n\n" + "\n".join(annotations) if annotations else "")


def _written(prog: str, kind: str, path: str, write) -> bool:
    """Write the `kind` report (HTML, JUnit XML) asked for; on failure say so on stderr (the audit's status stands:
    its report was printed) and return False. Checked before the audit (_path_problem), so this is rare."""
    try:
        write(path)
    except (ImportError, OSError, AuditUsageError) as error:
        print(f"{prog}: the audit ran (status above), but its {kind} report was not written: {error}", file=sys.stderr)
        return False
    print(f"{prog}: wrote {path}", file=sys.stderr)
    return True


def _write_junit(outcomes: dict, path: str) -> None:
    """`--junit-xml`: a <testsuites> of one <testsuite> per target (`junit_suite`); a target that could not be
    audited is a suite of one testcase, `setup`, in error with the usage message."""
    import xml.etree.ElementTree as ET

    from ._report import junit_suite  # after quiet_numpy_warning(): it imports torch
    root = ET.Element("testsuites", name="attention-audit")
    for target, outcome in outcomes.items():
        if isinstance(outcome, str):
            suite = ET.SubElement(root, "testsuite", name=target, tests="1", failures="0", errors="1", skipped="0")
            ET.SubElement(ET.SubElement(suite, "testcase", classname=target, name="setup"), "error",
                          message=outcome, type="usage")
        else:
            root.append(junit_suite(target, outcome))
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(suite.get(key)) for suite in root)))
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def emit(report, args, prog: str, usage) -> int:
    """Print a layer's or a model's report (`--json`, else the text and any `file:line:` annotations), write
    `--html` and `--junit-xml`, and return the exit status: what both branches of `main()` end with."""
    status = EXIT_STATUS[report.status]
    _printed(json.dumps(_jsonable(report.to_dict()), indent=2, allow_nan=False) if args.json else _text(report))
    written = True
    if args.html:
        written = _written(prog, "HTML", args.html, report.to_html)
    if args.junit_xml:
        name = args.model if args.model is not None else args.target[0]
        junit = _written(prog, "JUnit XML", args.junit_xml, lambda path: _write_junit({name: report}, path))
        written = junit and written
    return status if written else status or EXIT_USAGE  # a passed audit whose asked-for report is missing: not 0


SEVERITY = (EXIT_PASSED, EXIT_INCONCLUSIVE, EXIT_FINDINGS, EXIT_USAGE)
"""Exit statuses from the best to the worst, for several targets: a target that could not be audited at all is
worse than a failed one (a CI job must not read a misspelt target as fixed), a failed one than one not measured."""


def summary_lines(outcomes: dict) -> list[str]:
    """The table after several audits: target, verdict, and the detectors that failed (or why it could not be
    audited, or why it is inconclusive)."""
    rows = []
    for target, outcome in outcomes.items():
        if isinstance(outcome, str):
            rows.append((target, "USAGE ERROR", outcome.split(". Fix:")[0]))
        else:
            failing = [r.detector for r in outcome.results if r.verdict in ("fail", "error")]
            rows.append((target, outcome.headline, ", ".join(failing) or (outcome.status_reason
                                                                         if outcome.status != "passed" else "-")))
    counts = {}
    for _, verdict, _ in rows:
        word = verdict.split(" (")[0].lower()
        counts[word] = counts.get(word, 0) + 1
    width = max(len("target"), *(len(t) for t, _, _ in rows))
    verdict_width = max(len("verdict"), *(len(v) for _, v, _ in rows))
    return ([f"summary of {len(rows)} audits: " + ", ".join(f"{n} {word}" for word, n in counts.items()),
             f"  {'target':<{width}}  {'verdict':<{verdict_width}}  failing detectors"]
            + [f"  {t:<{width}}  {v:<{verdict_width}}  {why}" for t, v, why in rows])


def emit_several(outcomes: dict, args, prog: str) -> int:
    """Several targets: each report (or, with --json, one object holding them all), the summary table, any
    --junit-xml, and the worst exit status."""
    statuses = [EXIT_USAGE if isinstance(o, str) else EXIT_STATUS[o.status] for o in outcomes.values()]
    worst = max(statuses, key=SEVERITY.index)
    if args.json:
        targets = [{"target": t, "status": "usage error", "error": o} if isinstance(o, str)
                   else {"target": t, "status": o.status, "report": o.to_dict()} for t, o in outcomes.items()]
        _printed(json.dumps(_jsonable({"status": {v: k for k, v in EXIT_STATUS.items()}.get(worst, "usage error"),
                                       "exit_status": worst, "targets": targets}), indent=2, allow_nan=False))
    else:
        _printed("\n\n".join(_text(o) for o in outcomes.values() if not isinstance(o, str))
                 + "\n\n" + "\n".join(summary_lines(outcomes)))
    if args.junit_xml and not _written(prog, "JUnit XML", args.junit_xml, lambda path: _write_junit(outcomes, path)):
        return worst or EXIT_USAGE
    return worst


__all__ = ["DTYPES", "EXIT_FINDINGS", "EXIT_INCONCLUSIVE", "EXIT_INTERRUPTED", "EXIT_PASSED", "EXIT_STATUS",
           "EXIT_USAGE", "LAYER_ONLY", "OPTIONS", "SEVERITY", "audit_model_command", "emit", "emit_several",
           "load_example", "load_layer", "load_model", "main", "quiet_numpy_warning", "resolve", "summary_lines"]
