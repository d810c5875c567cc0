"""Loading what a front end names: `pkg.module:obj` targets for the command line and both pytest plugins.

`resolve()` finds the object, `load_layer()`, `load_model()` and `load_example()` turn it into what an audit
takes (the object itself, an instance of a class built with no arguments, or what a zero-argument factory
returns). `load_pattern()` reads a declared attention pattern written in a front end's option
(`--pattern "sliding_window(4) & causal"`) by a small grammar, never `eval`. Every failure is an
`AuditUsageError` with a one-line message. A ground-floor module: it imports no other part of diagnostics but
its error type and, when a pattern is read, diagnostics.patterns; torch only when a target or a pattern is loaded
(the pytest plugin imports this module in every run, where torch must not be imported).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import warnings

from ._errors import AuditUsageError, expect


def quiet_numpy_warning() -> None:
    """Torch built without NumPy beside it (the README's CPU set-up: `pip install torch==2.13.0`, no numpy)
    warns "Failed to initialize NumPy" when it is imported; diagnostics never uses NumPy, so in the
    command's own process that one warning is noise. Must run before torch is imported."""
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


def importable_from(directory: str | os.PathLike) -> None:
    """Make modules in `directory` importable (`mymodule:layer` from a scratch directory)."""
    directory = str(directory)
    if directory not in sys.path:
        sys.path.insert(0, directory)


def import_target_module(module_name: str):
    """The module a target names; an `AuditUsageError` that says why it would not import."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise AuditUsageError(f"expected an importable module {module_name!r}; got ModuleNotFoundError: {error}. "
                                  "Fix: run from the directory that holds it, or install its package") from None
        raise AuditUsageError(f"expected module {module_name!r} to import; it raised ModuleNotFoundError: "
                              f"{error}. Fix: install what it imports") from error
    except Exception as error:  # the user's module failed at import: a usage error, not a finding
        raise AuditUsageError(f"expected module {module_name!r} to import; it raised {type(error).__name__}: "
                              f"{error}. Fix: make `python -c 'import {module_name}'` work first") from error


def resolve(spec: str):
    """'pkg.module:obj' (obj may be dotted, e.g. 'Model.attention') -> the object it names, unchanged."""
    module_name, sep, attr = spec.partition(":")
    expect(bool(sep and module_name and attr), "a target of the form pkg.module:object", repr(spec),
           "name the object after a colon, e.g. mymodule:layer")
    obj = import_target_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))[:12]
            raise AuditUsageError(f"expected {module_name} to define {attr!r}; got no attribute {part!r} "
                                  f"(it has: {', '.join(names) or 'nothing public'}). Fix: check the name")
        obj = getattr(obj, part)
    return obj


def _required_positional(fn) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin: no signature to read
    return sum(1 for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def load_layer(spec: str):
    """The layer a target names: the object itself if it is a layer (an nn.Module, or a function of
    q, k, v); an instance if it is a class (built with no arguments); the result if it is a factory
    (a function called with no arguments). Raises `AuditUsageError` with a one-line message."""
    from torch import nn  # here, not at the top: importing this module must not import torch

    obj = resolve(spec)
    expect(callable(obj), "an attention layer, a class or a zero-argument factory",
           f"{spec} = {type(obj).__name__} {obj!r:.60}", "point at the layer object, its class or a factory")
    if isinstance(obj, type):
        try:
            return obj()
        except Exception as error:
            raise AuditUsageError(f"expected class {spec} to build with no arguments; got {type(error).__name__}: "
                                  f"{error}. Fix: add a factory, e.g. def make_layer(): return "
                                  f"{obj.__name__}(d_model=64, num_heads=4), and audit module:make_layer") from error
    if isinstance(obj, nn.Module):
        return obj
    if _required_positional(obj) == 0:  # a factory
        try:
            layer = obj()
        except Exception as error:
            raise AuditUsageError(f"expected factory {spec}() to return a layer; it raised {type(error).__name__}: "
                                  f"{error}. Fix: make it callable with no arguments") from error
        expect(callable(layer) and not isinstance(layer, type),
               "the factory to return a layer (a module or a function)", f"{spec}() returned {type(layer).__name__}",
               "return the layer instance")
        return layer
    return obj  # an attention function f(q, k, v, mask=None)


def load_model(spec: str):
    """The model a target names: the module itself, an instance of a class built with no arguments, or what a
    zero-argument factory returns. Raises `AuditUsageError` with a one-line message."""
    from torch import nn  # here, not at the top: importing this module must not import torch

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


def load_example(spec: str):
    """A model audit's example a target names: the object itself (token ids, embeddings or a dict of the model's
    inputs), or what a zero-argument factory returns; `audit_model` checks what it is."""
    obj = resolve(spec)
    if not callable(obj) or isinstance(obj, dict):
        return obj
    try:
        return obj()
    except Exception as error:
        raise AuditUsageError(f"expected {spec}() to return the model's example with no arguments; it raised "
                              f"{type(error).__name__}: {error}. Fix: e.g. def ids(): return torch.randint(vocab, "
                              f"(2, 16)), and pass --example module:ids") from error


def load_call(spec: str, *, spelled: str = "--call"):
    """The function a front end's `--call MODULE:FUNCTION` names: how to call a layer (see audit's `call=`)."""
    call = resolve(spec)
    expect(callable(call) and not isinstance(call, type), f"{spelled} to name a function call(layer, x, mask)",
           f"{spec} = {type(call).__name__}", "define def call(layer, x, memory, mask): return layer(x, xa=memory, "
           f"mask=mask) in a module and pass {spelled} module:call")
    return call


PATTERN_NAMES = ("causal", "sliding_window", "chunked", "prefix_lm", "document")
"""The named patterns of diagnostics.patterns a front end may write (`--pattern "sliding_window(4) & causal"`)."""
_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_]\w*)|(?P<int>-?\d+)|(?P<op>[()\[\],&|]))")


def load_pattern(text: str, *, spelled: str = "--pattern"):
    """The `diagnostics.patterns` pattern a front end's option writes: named patterns (PATTERN_NAMES) with integer
    arguments or lists of them (`document([0, 0, 1, 1])`, `prefix_lm([3, 5])`), combined with `&` and `|` and
    grouped with parentheses, `&` binding tighter. Parsed by a small grammar, never evaluated: anything else is
    an `AuditUsageError` saying where. Imports torch (the patterns build tensors)."""
    tokens, at = [], 0
    while at < len(text):
        if text[at:].strip() == "":
            break
        found = _TOKEN.match(text, at)
        if found is None:
            _pattern_error(text, at, "a character the grammar does not take", spelled)
        tokens.append((found.lastgroup, found.group(found.lastgroup), found.start(found.lastgroup)))
        at = found.end()
    tokens.append(("end", "", len(text)))
    position = [0]

    def peek():
        return tokens[position[0]]

    def take(kind=None, value=None):
        token = tokens[position[0]]
        if (kind and token[0] != kind) or (value and token[1] != value):
            wanted = value or {"name": "a pattern name", "int": "a number"}.get(kind, kind)
            _pattern_error(text, token[2], f"expected {wanted!r}, found {token[1] or 'the end'!r}", spelled)
        position[0] += 1
        return token

    def either():  # a | b | ...
        left = both()
        while peek()[1] == "|":
            take()
            left = left | both()
        return left

    def both():  # a & b & ...
        left = single()
        while peek()[1] == "&":
            take()
            left = left & single()
        return left

    def single():
        if peek()[1] == "(":
            take()
            inner = either()
            take("op", ")")
            return inner
        kind, name, where = take("name")
        if name not in PATTERN_NAMES:
            _pattern_error(text, where, f"unknown pattern {name!r}", spelled)
        args = []
        if peek()[1] == "(":
            take()
            while peek()[1] != ")":
                args.append(argument())
                if peek()[1] != ")":
                    take("op", ",")
            take("op", ")")
        return build(name, args, where)

    def argument():
        if peek()[1] == "[":
            take()
            items = []
            while peek()[1] != "]":
                items.append(argument())
                if peek()[1] != "]":
                    take("op", ",")
            take("op", "]")
            return items
        return int(take("int")[1])

    def build(name, args, where):
        import torch

        from . import patterns

        arity = {"causal": 0}.get(name, 1)
        if len(args) != arity:
            _pattern_error(text, where, f"{name} takes {arity} argument{'s' if arity != 1 else ''}, got {len(args)}",
                           spelled)
        made = [torch.tensor(a) if isinstance(a, list) else a for a in args]
        try:
            return getattr(patterns, name)(*made)
        except (AuditUsageError, ValueError, TypeError, RuntimeError) as error:
            _pattern_error(text, where, f"{name}: {str(error).split('. Fix:')[0]}", spelled)

    pattern = either()
    take("end")
    return pattern


def _pattern_error(text: str, at: int, problem: str, spelled: str):
    raise AuditUsageError(f"expected {spelled} to name patterns ({', '.join(PATTERN_NAMES)}) with integer arguments, "
                          f"combined with & and |; got {text!r}, where at character {at}: {problem}. Fix: e.g. "
                          f"{spelled} \"sliding_window(4)\" or \"chunked(8) | prefix_lm(3)\" or \"document([0, 0, 1, 1]) & "
                          f"causal\"")


__all__ = ["PATTERN_NAMES", "import_target_module", "importable_from", "load_call", "load_example", "load_layer",
           "load_model", "load_pattern", "quiet_numpy_warning", "resolve"]
