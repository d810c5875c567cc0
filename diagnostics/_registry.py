"""The detector registry: each detector registers itself where it is written, with the property it checks,
the mistakes it targets, the fix, and what it needs of the layer and the audit (`needs`).

    @detector("future_leakage", "for a causal layer, changing tokens after t leaves outputs at t unchanged",
              targets=("missing causal mask",), fix="...", needs=(CAUSAL, LONG))
    def check_future_leakage(probe): ...

`audit()` evaluates the `needs` before calling a check; a need that does not hold is a skip that says why
(in the words of the front end in use: `causal=True`, `--causal` or `--attention-causal`). The README's
detector table is `markdown_table()`, and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Need:
    """A requirement of a detector, as a predicate on the `Probe` the audit built.

    `text` names it in the README table; `unmet` says why the detector did not run, with `{option}`
    placeholders (e.g. `{causal}`) that the audit fills with how the user spells that option."""

    text: str
    holds: Callable = field(repr=False)
    unmet: str = ""


TAKES_MASK = Need("a mask argument", lambda p: p.subject.takes_mask,
                  "the layer takes no mask argument (a parameter named mask, attn_mask or attention_mask)")
CAUSAL = Need("{causal}", lambda p: p.causal,
              "the layer is not audited as causal (pass {causal} if it promises causality)")
SEPARATE_QUERY = Need("a separate query input", lambda p: p.subject.separate_kv,
                      "the layer takes one input stream, so a query cannot change without its key")
LONG = Need("seq_len >= 2", lambda p: p.t >= 2, "needs a probe length of 2 or more ({seq_len} 2 or more)")
LONGER = Need("seq_len >= 3", lambda p: p.t >= 3,
              "needs a probe length of 3 or more ({seq_len} 3 or more): with 2 tokens a decoded query sees two keys, "
              "whose weights half precision may round alike at any position")
HAS_CACHE = Need("a cache argument", lambda p: getattr(p.subject, "cache_name", None) is not None,
                 "the layer takes no cache of its own that the audit can drive (a self-attention module's "
                 "past_key_value(s), layer_past, kv_cache, cache or past argument; a Hugging Face layer's needs "
                 "its layer_idx)")


@dataclass(frozen=True)
class Detector:
    """A registry entry: the property it checks, the mistakes it targets, the fix, and the check itself."""

    id: str
    description: str
    targets: tuple[str, ...]
    fix: str
    check: Callable = field(repr=False)
    needs: tuple[Need, ...] = ()

    def unmet(self, probe) -> Need | None:
        """The first requirement that does not hold for this audit, or None."""
        return next((n for n in self.needs if not n.holds(probe)), None)


DETECTORS: dict[str, Detector] = {}
"""{id: Detector}, in the order the detectors run and are reported."""


def detector(id: str, description: str, *, targets: tuple[str, ...], fix: str, needs: tuple[Need, ...] = ()):
    """Register the decorated check `probe -> DetectorResult` under `id`."""

    def register(check: Callable) -> Callable:
        if id in DETECTORS:
            raise ValueError(f"detector {id!r} is registered twice")
        DETECTORS[id] = Detector(id, description, tuple(targets), fix, check, tuple(needs))
        return check

    return register


DEFAULT_OPTIONS = {"causal": "causal=True", "seq_len": "seq_len=", "scale": "scale=", "d_model": "d_model=",
                   "num_heads": "num_heads=", "require": "require=", "strict": "strict=True"}


def phrase(text: str, options: dict | None = None) -> str:
    """Fill `{option}` placeholders with how the user spells that option in this front end."""
    names = {**DEFAULT_OPTIONS, **(options or {})}
    for key, spelled in names.items():
        text = text.replace("{" + key + "}", spelled)
    return text


def markdown_table(caught: dict[str, str] | None = None) -> str:
    """The README's detector table, generated from the registry. `caught`: {detector id: text} for an extra
    column (the README lists the catalog entries each detector catches; diagnostics does not know them)."""
    head = "| detector | property every correct attention has | needs | targets |"
    lines = [head + (" catches (catalog) |" if caught else ""), "|---|---|---|---|" + ("---|" if caught else "")]
    for d in DETECTORS.values():
        needs = ", ".join(phrase(n.text, {"causal": "causal=True"}) for n in d.needs) or "any attention layer"
        row = f"| `{d.id}` | {d.description} | {needs} | {'; '.join(d.targets)} |"
        lines.append(row + (f" {caught.get(d.id, '-')} |" if caught else ""))
    return "\n".join(lines)
