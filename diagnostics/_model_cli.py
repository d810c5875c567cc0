"""`attention-audit --model pkg.module:factory`: audit a whole model from the command line (see `_cli.py`).

The target is a model (an nn.Module), a class built with no arguments, or a zero-argument factory. Options that
apply: `--causal` (else inferred, and the report says how), `--seq-len`, `--json`, `--html`. Exit status as for
layers: 0 passed, 1 failed, 2 usage error, 3 inconclusive.
"""

from __future__ import annotations

import sys

from ._errors import AuditUsageError, expect

LAYER_ONLY = ("d_model", "num_heads", "scale", "mask", "layout")  # options of a layer audit, not of a model's


def load_model(spec: str):
    """The model a target names: the module itself, an instance of a class built with no arguments, or what a
    zero-argument factory returns. Raises `AuditUsageError` with a one-line message."""
    from torch import nn

    from ._cli import resolve

    obj = resolve(spec)
    if isinstance(obj, nn.Module):
        return obj
    expect(callable(obj), "a model (nn.Module), a class or a zero-argument factory", f"{spec} = {type(obj).__name__}",
           "point at the model, its class or a factory")
    try:
        model = obj()
    except Exception as error:
        raise AuditUsageError(f"expected {spec}() to build the model with no arguments; it raised "
                              f"{type(error).__name__}: {error}. Fix: add a factory, e.g. def make_model(): return "
                              f"MyModel(config), and audit module:make_model") from error
    expect(isinstance(model, nn.Module), "the factory to return an nn.Module", f"{spec}() returned "
           f"{type(model).__name__}", "return the model instance")
    return model


def run(args, prog: str, usage) -> int:
    """The `--model` branch of `attention-audit`'s main()."""
    from ._cli import emit
    from ._model import audit_model

    given = [f"--{name.replace('_', '-')}" for name in LAYER_ONLY if getattr(args, name, None) is not None]
    given += ["--require"] if args.require else []
    given += ["--strict"] if args.strict else []
    if args.target is not None:
        return usage(f"expected either MODULE:OBJECT (a layer) or --model MODULE:OBJECT; got both "
                     f"({args.target} and --model {args.model}). Fix: drop one")
    if given:
        return usage(f"expected only --causal, --seq-len, --json and --html with --model; got {', '.join(given)}. "
                     f"Fix: drop them (the model's own call sets them for each layer)")
    try:
        model = load_model(args.model)
        progress = None
        if sys.stderr.isatty():
            def progress(stage, index, total):
                sys.stderr.write(f"\r\x1b[Kauditing {stage}")
                sys.stderr.flush()
        report = audit_model(model, causal=True if args.causal else None, seq_len=args.seq_len, progress=progress)
        if progress is not None:
            sys.stderr.write("\r\x1b[K")
    except AuditUsageError as error:
        return usage(str(error))
    return emit(report, args, prog, usage)


__all__ = ["load_model", "run"]
