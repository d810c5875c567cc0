"""The detector registry: each detector registers itself where it is written, with the property it checks,
the mistakes it targets, the fix, what it needs of the audit (`needs`) and where its findings point (`locate`):

    @detector("future_leakage", "for a causal layer, changing tokens after t leaves outputs at t unchanged",
              targets=("missing causal mask",), fix="...", needs=(CAUSAL, LONG), locate=_leak_sites)
    def check_future_leakage(probe): ...

Three scopes share one registry design: `DETECTORS` (a layer, judged on a `Probe`), `MODEL_DETECTORS` (a
whole model, judged on the model audit's context) and `SHARDED_DETECTORS` (a layer split across processes, judged on
the sharded audit's context). `run()` evaluates the `needs` before calling a check; a
need that does not hold is a skip that says why (in the words of the front end in use: `causal=True`,
`--causal` or `--attention-causal`). One crash rule for both scopes: an exception raised in the user's code
is a finding about it (fail), one raised in diagnostics' own code is an `error` that makes the audit
inconclusive. The README's detector table is `markdown_table()`, and a test keeps the two equal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable

from ._errors import BlindProbe
from ._frames import exception_text, raised_by_user
from ._result import DetectorResult


@dataclass(frozen=True)
class Need:
    """A requirement of a detector, as a predicate on the `Probe` the audit built.

    `text` names it in the README table; `unmet` says why the detector did not run, with `{option}`
    placeholders (e.g. `{causal}`) that the audit fills with how the user spells that option."""

    text: str
    holds: Callable = field(repr=False)
    unmet: str = ""


TAKES_MASK = Need("a mask argument", lambda p: p.subject.takes_mask,
                  "the layer takes no mask argument (a parameter named mask, attn_mask, attention_mask, input_mask, "
                  "context_mask or the like)")
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
    locate: Callable | None = field(default=None, repr=False)  # (probe, result) -> [Site]: replays the failure
    unlocated: str = ""  # why a detector without `locate` cannot point at a line
    scope: str = "layer"  # "layer" or "model"

    def unmet(self, probe) -> Need | None:
        """The first requirement that does not hold for this audit, or None."""
        return next((n for n in self.needs if not n.holds(probe)), None)


DETECTORS: dict[str, Detector] = {}
"""{id: Detector} of the layer audit, in the order the detectors run and are reported (filled when
`diagnostics.detectors` is imported)."""
MODEL_DETECTORS: dict[str, Detector] = {}
"""{id: Detector} of the model audit (filled when `diagnostics.model` is imported)."""
SHARDED_DETECTORS: dict[str, Detector] = {}
"""{id: Detector} of the sharded audit (filled when `diagnostics.distributed` is imported)."""
REGISTRIES = {"layer": DETECTORS, "model": MODEL_DETECTORS, "sharded": SHARDED_DETECTORS}


def detector(id: str, description: str, *, targets: tuple[str, ...] = (), fix: str, needs: tuple[Need, ...] = (),
             locate: Callable | None = None, unlocated: str = "", scope: str = "layer"):
    """Register the decorated check `context -> DetectorResult` under `id`, with its localiser `locate`
    `(context, result) -> [Site]` (or, where it has none, `unlocated`: why)."""
    if scope not in REGISTRIES:
        raise ValueError(f"scope must be one of {sorted(REGISTRIES)}, not {scope!r}")
    if locate is None and not unlocated:
        raise ValueError(f"detector {id!r}: give locate= (where its findings point) or unlocated= (why none)")

    def register(check: Callable) -> Callable:
        registry = REGISTRIES[scope]
        if id in registry:
            raise ValueError(f"detector {id!r} is registered twice")
        registry[id] = Detector(id, description, tuple(targets), fix, check, tuple(needs), locate, unlocated, scope)
        return check

    return register


STRICT_PROBES = os.environ.get("ATTENTION_AUDIT_STRICT_PROBES") == "1"
"""Set by this project's tests: a probe whose own control failed raises instead of skipping."""
NOT_APPLICABLE = "not applicable: "


def run(det: Detector, context, options: dict | None = None, *, subject: str = "layer") -> DetectorResult:
    """One detector's result on `context` (a layer's `Probe` or the model audit's context). Its needs first;
    a blind probe is a skip that says so (and raises under ATTENTION_AUDIT_STRICT_PROBES=1); an exception is
    a finding when the user's code raised it (`subject`: "layer" or "model", as the message names it), an
    `error` of diagnostics otherwise, never an ordinary skip."""
    need = det.unmet(context)
    if need is not None:
        return DetectorResult(det.id, "skip", NOT_APPLICABLE + phrase(need.unmet, options))
    try:
        result = det.check(context)
    except BlindProbe as blind:
        if STRICT_PROBES:
            raise
        result = DetectorResult(det.id, "skip", f"not measured: the probe's own control failed ({blind}): a bug "
                                                f"in diagnostics, please report it")
    except Exception as error:  # a detector that cannot cope must not crash the audit, nor pass it
        result = crashed(det, error, subject=subject)
    return replace(result, message=phrase(result.message, options), fix=phrase(result.fix, options))


def crashed(det: Detector, error: BaseException, *, subject: str = "layer") -> DetectorResult:
    """The crash rule: the user's exception is a finding about their code, ours is an error of the audit."""
    text = exception_text(error, 200)
    if raised_by_user(error):
        return DetectorResult(det.id, "fail", f"the {subject} raised on this detector's probe ({text})",
                              evidence=f"raised inside the {subject}'s own code (the innermost frame outside torch)",
                              fix=f"make the {subject} accept the inputs this detector passes (see the exception)")
    return DetectorResult(det.id, "error", f"the detector crashed: {text}",
                          evidence="an internal error of diagnostics, not a finding about the " + subject +
                                   "; please report it with the " + subject + " that triggers it")


DEFAULT_OPTIONS = {"causal": "causal=True", "seq_len": "seq_len=", "scale": "scale=", "d_model": "d_model=",
                   "example": "example=", "num_heads": "num_heads=", "pattern": "pattern=", "require": "require=",
                   "strict": "strict=True", "pattern_example": "pattern=diagnostics.patterns.sliding_window(4)"}
"""`pattern_example`: a declared pattern written out whole, as this front end takes it (the CLI quotes its grammar)."""


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
    for d in DETECTORS.values():  # the layer detectors; the model's have their own table
        needs = ", ".join(phrase(n.text, {"causal": "causal=True"}) for n in d.needs) or "any attention layer"
        row = f"| `{d.id}` | {d.description} | {needs} | {'; '.join(d.targets)} |"
        lines.append(row + (f" {caught.get(d.id, '-')} |" if caught else ""))
    return "\n".join(lines)
