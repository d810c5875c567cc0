"""What a detector returns: one honest verdict, with what was measured and on which probes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


VERDICTS = ("pass", "warn", "fail", "skip", "error")
"""`skip`: the detector measured nothing (its message says why; with a `declaration`, the one that would let it
measure); `error`: the detector itself crashed, a bug in diagnostics, which makes the audit inconclusive rather
than passed."""


@dataclass(frozen=True)
class ProbeShape:
    """One call the detector made, as far as whether a bug can show on it depends: the sizes, the mask
    passed (bool (B, Tq, Tk), True = may attend, or None), and whether query, key and value were one tensor."""

    label: str
    batch: int
    t_q: int
    t_k: int
    allowed: object = field(default=None, compare=False, repr=False)  # Tensor | None, on the CPU
    self_attention: bool = True
    raised: str = ""  # the layer's exception on this call, if it raised
    backward: bool = False  # gradients were taken through this call
    # a call several detectors read (a stacked probe): (detector, first copy, stop copy) of the batch copies each
    # compares with copy 0, the shared baseline
    parts: tuple[tuple[str, int, int], ...] = field(default=(), compare=False)
    not_taken: bool = False  # a probe the layer as held could not be given (`ProbeNotTaken`): skipped, not a raise


def _shown(file: str) -> str:
    from os.path import relpath

    try:
        shown = relpath(file)
    except ValueError:  # another drive on Windows
        return file
    return file if shown.startswith("..") else shown


@dataclass(frozen=True)
class Site:
    """Where in the user's code a finding points: the first frame outside torch and diagnostics when the
    operation `op` ran (an aten op such as "aten.softmax", or "returned its input unchanged" for a function
    that should have done a step and did none). `note` says why this site; `callers` are the user frames
    that called it, innermost first, as (file, line, function): a helper's line is read with its caller."""

    file: str
    line: int
    function: str
    code: str
    op: str
    note: str = field(default="", compare=False)
    callers: tuple[tuple[str, int, str], ...] = field(default=(), compare=False, repr=False)
    fix: str = field(default="", compare=False)  # the fix of the cause seen here, in the user's terms ("" if none)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def path(self) -> str:
        """The file relative to the working directory when it lies below it (as editors and CI resolve it)."""
        return _shown(self.file)

    def describe(self, *, short: bool = False) -> str:
        """`file:line in function: code  [op; note] (called from file:line in function)`."""
        text = f"{self.path}:{self.line} in {self.function}: {self.code}"
        why = "; ".join(x for x in (self.op, self.note) if x)
        if why and not short:
            text += f"  [{why}]"
        if self.callers and not short:
            f, n, fn = self.callers[0]
            text += f" (called from {_shown(f)}:{n} in {fn})"
        return text

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "function": self.function, "code": self.code, "op": self.op,
                "note": self.note, "callers": [list(c) for c in self.callers], "fix": self.fix}


class Sites(Sequence):
    """The sites of a finding, most likely first: a read-only sequence (index it, iterate it, compare it with a
    tuple), found the first time it is read. Pointing at the line re-runs the finding's probe under a tracer;
    a report nobody reads the sites of (a test that only checks verdicts) never pays for it."""

    def __init__(self, sites=(), resolve=None):
        self._sites, self._resolve = (None, resolve) if resolve is not None else (tuple(sites), None)

    def _get(self) -> tuple:
        if self._sites is None:
            resolve, self._resolve = self._resolve, None
            try:
                self._sites = tuple(resolve())
            except Exception:  # pointing at the line must never break reading a report
                self._sites = ()
        return self._sites

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other) -> bool:
        return self._get() == (tuple(other) if isinstance(other, (Sites, tuple, list)) else other)

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        return repr(self._get()) if self._sites is not None else "Sites(<not read yet>)"

    def __reduce__(self):  # pickled as the sites themselves (the layer does not travel)
        return Sites, (self._get(),)


CELL_KINDS = ("seen", "blocked", "leak", "over", "unmeasured")
"""What a cell of a `DependencyMap` is: allowed and seen (the row moved when the key alone changed), blocked and
unseen, seen although blocked (leakage), allowed but unseen (over-masking), or not measurable."""


@dataclass(frozen=True)
class DependencyMap:
    """The measured dependency pattern of one sequence beside the declared one, for the reports' picture: for each
    query row i (from `q0`) and key column j (from `k0`) of a `T`-position probe, whether the pattern allows the key
    (`declared`), whether the row moved when that key alone changed (`moved`), and whether that could be measured
    at all (`measurable`: a one-stream layer's own position changes its query too). Bool tensors (rows, keys)."""

    pattern: str
    sequence: int
    t: int
    q0: int
    k0: int
    declared: object  # Tensor, bool (rows, keys)
    moved: object  # Tensor, bool (rows, keys)
    measurable: object  # Tensor, bool (rows, keys)
    how: str = ""

    def kinds(self) -> list[list[str]]:
        """Each cell's kind (one of CELL_KINDS), row by row: the one reading both reports draw."""
        def kind(allowed: bool, moved: bool, measurable: bool) -> str:
            if not measurable:
                return "unmeasured"
            if allowed:
                return "seen" if moved else "over"
            return "leak" if moved else "blocked"

        return [[kind(*cell) for cell in zip(*row)]
                for row in zip(self.declared.tolist(), self.moved.tolist(), self.measurable.tolist())]

    def counts(self) -> dict[str, int]:
        """{kind: cells of that kind}, every kind of CELL_KINDS present (0 where none)."""
        flat = [k for row in self.kinds() for k in row]
        return {kind: flat.count(kind) for kind in CELL_KINDS}


@dataclass(frozen=True)
class DetectorResult:
    """One detector's honest verdict on one layer.

    `value` is the measured quantity, `threshold` the most a correct layer may show, `margin` how far
    correct layers measured stay from it at this dtype, `evidence` the assert_close-style details
    (count, fraction, worst case and where, what was allowed), `fix` what to change when it fires, and
    `probes` the calls it made (sizes and masks), so that tests can tell which bugs it could have seen, and
    `where` the lines of the user's code the finding points at, most likely first (empty when it cannot tell).
    """

    detector: str
    verdict: str
    message: str
    value: float | None = None
    threshold: float | None = None
    margin: str = ""
    evidence: str = ""
    fix: str = ""
    extras: dict = field(default_factory=dict, compare=False, repr=False)  # e.g. weights for reports
    probes: tuple[ProbeShape, ...] = field(default=(), compare=False, repr=False)
    where: Sequence[Site] = field(default=(), compare=False)  # the user's code lines, most likely first (Sites)
    layer: str | None = None  # in a model audit: the module path of the layer it is about; None: the model
    # what failed, as data, for the localiser to replay: the inputs and calls the verdict was computed on
    replay: object = field(default=None, compare=False, repr=False)
    # what to declare for this detector to measure the layer (an audit option: "mask='key_padding'"), on a skip whose
    # probes the layer ran under another convention than the audit's: the audit then "needs a declaration", never FAILED
    declaration: str = ""

    def __getstate__(self) -> dict:  # a pickled result keeps its verdict and sites, not the replayed inputs
        return {**self.__dict__, "replay": None}

    @property
    def severity(self) -> str:
        return self.verdict

    @property
    def remedy(self) -> tuple[str, bool]:
        """(the fix to show, whether it is the detector's general one): the fix of the cause localisation found
        at the finding's sites (the op there and what it did), else the fix of a cause the detector named from its
        evidence (`extras["cause"]`: a sharded layer's bias added on every rank), else the detector's general fix."""
        cause = next((site.fix for site in self.where if site.fix), "")
        return (cause, False) if cause else (self.fix, not self.extras.get("cause"))

    @property
    def fired(self) -> bool:
        return self.verdict in ("warn", "fail")

    @property
    def measured(self) -> bool:
        """True when the detector reached a verdict on the layer (pass, warn or fail)."""
        return self.verdict in ("pass", "warn", "fail")


Finding = DetectorResult  # a result whose verdict is warn or fail

__all__ = ["CELL_KINDS", "VERDICTS", "DependencyMap", "DetectorResult", "Finding", "ProbeShape", "Site", "Sites"]
