"""The README's "what your layer does -> what to declare" table, generated from the declarations themselves.

Every row comes from the registry it describes: the mask conventions (`_masks.SHORTCUTS`, their meanings and
shapes), the layouts (`_subject.LAYOUTS`), the named patterns (`_load.PATTERN_NAMES`) and the command line's
spelling of each audit() option (`_cli.OPTIONS`), so that a convention added in code appears in the table, and a
test keeps the README's copy equal to `declarations_table()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._cli import OPTIONS
from ._load import PATTERN_NAMES
from ._masks import SHAPES, SHORTCUTS
from ._subject import LAYOUTS, MODULE_LAYOUTS


@dataclass(frozen=True)
class Declaration:
    """One row: what a layer does, the audit() argument that says so, and its value as the command line writes it
    (None: the option is a flag, or takes no value worth showing)."""

    does: str
    option: str
    python: str
    command: str | None


def declarations() -> list[Declaration]:
    rows = [Declaration(f"takes its mask as {SHORTCUTS['allowed'].describe()}", "mask", "nothing: the default", None)]
    for name, convention in SHORTCUTS.items():
        if name != "allowed":
            rows.append(Declaration(f"takes its mask as {convention.describe()}", "mask", f'mask="{name}"', name))
    shapes = ", ".join(f"`{s}`" for s in SHAPES)
    rows += [
        Declaration(f"takes its mask in another shape: MEANING (allowed, blocked, additive) and SHAPE ({shapes})",
                    "mask", 'mask="additive:B,Tq,Tk"', '"additive:B,Tq,Tk"'),
        Declaration("is a function on (B, T, H, d) tensors (flash-attn's layout)", "layout",
                    f'layout="{LAYOUTS[1]}"', LAYOUTS[1]),
        Declaration("is a module on sequence-first (T, B, D) tokens (and says so nowhere: a docstring's (T, B, D) "
                    "or `batch_first = False` is read)", "layout", f'layout="{MODULE_LAYOUTS[1]}"', MODULE_LAYOUTS[1]),
        Declaration("names its inputs otherwise (a memory `xa`), or needs its second stream even for self-attention",
                    "call", "call=lambda layer, x, memory, mask: layer(x, xa=memory, mask=mask)", "mymodule:call"),
        Declaration("is cross-attention (its memory may be longer or shorter than the query)", "cross",
                    "cross=True", None),
        Declaration("attends with Q learned queries of its own, not one per token (an attention-pooling head: returns "
                    "(B, Q, D), or (B, D) where Q = 1)", "queries", "queries=1", "1"),
        Declaration("returns each head's output apart, (B, T, H, d), for its caller to merge and project (the report "
                    "writes the call)", "call", "call=lambda layer, x: layer.to_out(layer(x).flatten(2))",
                    "mymodule:call"),
        Declaration("promises causality (a decoder)", "causal", "causal=True", None),
        Declaration(f"promises an attention pattern ({', '.join(PATTERN_NAMES)}, combined with & and \\|)", "pattern",
                    "pattern=patterns.sliding_window(4)", '"sliding_window(4)"'),
        Declaration("promises relative positions (rotary, ALiBi, a relative bias): a layer left with none fails",
                    "positions", 'positions="relative"', "relative"),
        Declaration("adds absolute position embeddings itself (not rotary, ALiBi or a relative bias)", "positions",
                    'positions="absolute"', "absolute"),
        Declaration("multiplies q·k by another scale than 1/sqrt(d_k)", "scale", "scale=1.0", "1.0"),
        Declaration("names neither its width nor its heads", "d_model", "d_model=64, num_heads=4", None),
    ]
    return rows


def declarations_table() -> str:
    """The README's table (markdown), one row per `declarations()` entry."""
    lines = ["| what your layer does | `audit()` | `attention-audit` |", "|---|---|---|"]
    for row in declarations():
        flag = OPTIONS.get(row.option, f"--{row.option.replace('_', '-')}")
        if row.option == "d_model":
            command = f"`{OPTIONS['d_model']} 64 {OPTIONS['num_heads']} 4`"
        elif row.command is None:
            command = "-" if row.python.startswith("nothing") else f"`{flag}`"
        else:
            command = f"`{flag} {row.command}`"
        python = row.python if row.python.startswith("nothing") else f"`{row.python}`"
        lines.append(f"| {row.does} | {python} | {command} |")
    return "\n".join(lines)


__all__ = ["Declaration", "declarations", "declarations_table"]
