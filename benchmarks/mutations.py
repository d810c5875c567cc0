"""Mutation score of `diagnostics`: weaken one comparison, threshold or guard at a time, see whether the tests notice.

    python benchmarks/mutations.py                    # the stratified sample (the README's figure), one job
    python benchmarks/mutations.py --list             # every mutant, with the line it changes, and exit
    python benchmarks/mutations.py --all --jobs 2     # every mutant, not a sample
    python benchmarks/mutations.py --all --journal ~/all.jsonl  # the same in pieces: rerun to go on where it stopped
    python benchmarks/mutations.py --only keys.py --json /tmp/mutations.json
    python benchmarks/mutations.py --survivors-of /tmp/mutations.json   # after adding tests: rerun survivors
    python benchmarks/mutations.py --changed-since main   # the sample's mutants of the modules a branch changed

Why our own mutator: mutmut 3.8.1 (tried here, installed into the venv) rewrites every function of the whole
package into trampolines (its `paths_to_mutate` is deprecated, `source_paths` takes the package) and generated
639 mutants for `_core.py` alone (268 lines: every string and number), more than two minutes of CPU before the
first test on 2 shared cores; at ~10 s a test run the package's ~10^4 mutants would take more than a day. It
also mutates function bodies only: the thresholds of `_thresholds.py` and the detectors' module constants, the
very numbers issue 20 is about, are never mutated. cosmic-ray enumerates the same kind of set.

Mutants (stdlib `ast`, applied as edits of the source text, so that line numbers and comments stay put):
- `compare`: every `>`/`>=`/`<`/`<=`/`==`/`!=`: `>`<->`>=`, `<`<->`<=`, `>`<->`<` (`>=`<->`<=`), `==`<->`!=`;
- `boolop`: `and`<->`or`; `not`: `not x` -> `x` and `~x` -> `x` (the tensor `not`); `any`<->`all`;
- `constant`: every number of a module-level UPPER_CASE constant (a threshold, a gain, a tolerance table, the
  model wing's FUDGE) x10 and x0.1 (ints: x10 and //10), and every float literal in a check's code (the
  perturbation gains, the decode gain's 10.0, the 30x noise factor) likewise; the `MEASURED_*` tables are only
  quoted in margin text and are left alone, and so is a knob: a constant whose assignment carries the comment
  `# knob: <why>` on its first line (a seed's salt, a budget of copies that bounds cost and changes no verdict at
  x10 or x0.1: checked by a run of its mutants before the comment is added). The rule is the comment, read from the
  source, not a list kept here: `--list` prints each knob with its reason, and `--knobs` mutates them anyway;
- `guard`: `if <test>:` whose body returns a skip (`skip(...)`, `not_run(...)`, `DetectorResult(..., "skip",
  ...)`) -> `if (False):` (the guard never fires);
- `verdict`: the string "fail" -> "pass" where a check builds a result.
Mutated code: every function (and method) of every detector module (`diagnostics/detectors/*.py`), `_core.py` and
`_change.py` (its measure of a change, moved out of it),
`_thresholds.py`, `_projections.py` (the recompute from a layer's own weights that own_weights compares its output
with: a mutant there moves that detector's verdicts) and the model wing's detectors and judgements (every public
module of `diagnostics/model/`, and every private one that judges a measurement against a tolerance: it imports
`tolerance` from `_thresholds`, as `_tolerance.py` and `_causal.py` do; see `judges`), the module lists read from
the committed tree, so that a module added later is in the next run and in its sample. Left out, by design: the
localisers (functions named `*_sites`, `*locat*`, and the replay helpers listed in NOT_VERDICT), which choose where
a finding points and are measured by `benchmarks/localisation.py`, and functions that only word evidence or choose
among fixes (`*_text`, `*_fix`); a mutant there changes no verdict.

Sampling (the default; `--all` runs every mutant): every `constant` mutant of a module-level constant (the
thresholds: the point of issue 20), plus per module a sample of SAMPLE_PER_MODULE of its other mutants, drawn
with random.Random(f"{SEED}:{module}") after sorting by id, so the sample is stratified per module and the same
on every run of the same code. The run prints the sample's size per module.

Each mutant is written into a private copy of the committed tree (`git archive` of MUTATION_REVISION, default HEAD,
so that other engineers' uncommitted edits in the checkout are neither mutated nor tested) under the system temp dir
(one copy per job, no bytecode written, so a same-size edit is never hidden by a stale .pyc; the repository's files
are never touched), and the tests that can see it run there in one process (`-n 0`, `-x`, CI=1,
HYPOTHESIS_PROFILE=default, OMP_NUM_THREADS=1): every test of the default suite (README's `pytest`) that enters the
function the mutant changes, or, for a module constant, a function that reads it (or reads a constant made of it).
Which tests enter which functions is mapped once per commit by one run of the default suite with the plugin
benchmarks/_mutation_calls.py (a `call`-event trace, no line tracing; a wider fixture's calls count for every test
that uses it; only passing tests are kept; the map is kept in the temp dir by commit). A test that never enters the
changed code runs exactly as it does unmutated, so leaving it out loses no kill; a test that sees the package only
through a subprocess (the command-line tests) is not mapped, and a kill only it would make is lost: the figure is a
lower bound. A mutant no mapped test reaches survives without running ("no test enters the code it changes").
`--tests` names the tests instead (while writing a pin). Before any mutant, a canary checks that pytest in the copy
imports `diagnostics` from the copy, and the default suite (or `--tests`) must pass unmutated; the map's node ids
must collect. A mutant is *killed* when the tests fail, *error* when they cannot be
collected (counted as killed, listed apart), *timeout* past --timeout, *survived* when they pass. A timeout is
undecided, not a kill: on shared cores a mutant that makes no test fail can still run past the limit (a slower path,
a loaded machine), so timeouts leave the score's denominator, are listed apart with the score they would give
counted as kills, and `--survivors-of` reruns them with the survivors (with a longer --timeout on a quieter
machine). The score is killed / (total - equivalent - timeout); a survivor leaves the denominator only when
EQUIVALENT names it with the reason, after it was checked by hand to change no verdict.

Cost (2 cores shared with other work, 2026-12-04): the map, one traced run of the default suite, 242-258 s; then a
mutant 4-20 s when killed and 15-115 s when it survives (a survivor runs every test that enters its function:
a median of 840 for detectors/variance.py, whose check runs in every audit); every mutant of that module (133) in
34 min. `--all` (about 1,750 mutants) is hours of such work. After adding tests, `--survivors-of` reruns only the
earlier survivors (and timeouts), matched by their line's code, so that moved lines still match (a rewritten line's
new mutants are not among them: run them with `--only`); `--changed-since REV` keeps a change's own modules.
Keeping the figure: a change to a detector comes with its pins (tests/test_pins*.py, tests/test_thresholds.py: a
case just inside and one just outside each constant, per dtype), and its author runs
`python benchmarks/mutations.py --changed-since main --json /tmp/m.json`, then, after adding tests for the survivors,
`--survivors-of /tmp/m.json` until none is left but the marked equivalents and knobs, before asking for a merge. The
hook that runs before a session stops does not run mutants (minutes a module on shared cores, and a survivor needs a
pin or a reason checked by hand); tests/test_pins_mutator.py checks this file's rules in the default suite
(docs/testing.md, "Keeping the figure, and the hook").
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "diagnostics"
JUDGES = re.compile(r"^from \.\._thresholds import [^\n]*\btolerance\b", re.M)
"""A private module of the model wing holds verdict logic when it judges a measurement against a tolerance: it
imports `tolerance` from `_thresholds` (`_tolerance.py`: the parity judgement; `_causal.py`: whether a layer masks
the future, and the majority rule that makes a model causal). The other private modules find the layers, call the
model and word the report: a mutant there changes what is audited, measured by the model audit's own tests."""


REVISION = subprocess.run(["git", "rev-parse", "--verify", os.environ.get("MUTATION_REVISION", "HEAD") + "^{commit}"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
"""The commit whose tree is mutated and tested (others' uncommitted edits in the checkout are not measured), resolved
once at start: a commit made while the run lists its mutants cannot slip into its copies."""


def _committed(path: str) -> bytes:
    return subprocess.run(["git", "show", f"{REVISION}:{path}"], cwd=ROOT, capture_output=True, check=True).stdout


def _listed(folder: str) -> list[str]:
    """The .py files of a package folder in the committed tree (REVISION), by name, without __init__.py."""
    where = f"{PACKAGE}/{folder}/" if folder else f"{PACKAGE}/"
    listed = subprocess.run(["git", "ls-tree", "--name-only", REVISION, where], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return sorted(Path(p).name for p in listed if p.endswith(".py") and not p.endswith("__init__.py"))


def judges(module: str) -> bool:
    """Whether a module (relative to the package) imports `tolerance` from `_thresholds` (JUDGES), in the committed
    tree."""
    return bool(JUDGES.search(_committed(f"{PACKAGE}/{module}").decode()))


def _files() -> tuple[str, ...]:
    """Every detector module (detectors/*.py, the shared probes among them), the model wing's public modules (its
    detectors) and its private ones that judge (JUDGES): read from the committed tree, so that a module added later
    is mutated and sampled without being listed here."""
    model = [n for n in _listed("model") if not n.startswith("_") or judges(f"model/{n}")]
    top = set(_listed(""))  # _projections.py is younger than some revisions a run may be asked to measure
    return (tuple(n for n in ("_core.py", "_change.py", "_thresholds.py", "_projections.py") if n in top)
            + tuple(f"detectors/{n}" for n in _listed("detectors"))
            + tuple(f"model/{n}" for n in model))


FILES = _files()
NOT_VERDICT = re.compile(r"sites|locat|_text$|_fix$|^_root$|^_self_products$|^_cache_short$|^_cache_of$"
                         r"|^held_positions$|^base_trace$|^unique$|^_runs$|^describe|^float64_twin$|^graph_call$"
                         r"|^KeepFloat64|^_score_like$|_site$|^_guard_of$")
"""Functions whose mutants change where a finding points or how it is worded, never a verdict (see the docstring):
`*_site` returns a Site as `*_sites` do; the helpers named here are called by localisers only (positions.py's
`_score_like` by `shift_sites`, runs.py's `_guard_of` by `unset_attribute_site`)."""
MEASURED = re.compile(r"^MEASURED_")
SIZES = ("ENTROPY_ROWS", "PACKED_KEYS")
"""Module constants that are sample sizes, not thresholds: their mutants are sampled like code's."""
SAMPLE_PER_MODULE = 4
SEED = 20
TESTS: list[str] = []
"""`--tests`: these test files or node ids run against every mutant, instead of the tests that enter its code."""
COVERED = "the default suite's tests that enter the mutated code"
"""The selection's name in a journal: a line measured with another selection is not reused."""
CALLS_PLUGIN = "benchmarks/_mutation_calls.py"
"""The pytest plugin that maps each test of the default suite to the package's functions it enters."""


def tests_for(file: str) -> list[str]:
    """The name of the tests run against a mutant of `file`, as a journal keeps it: `--tests`' list, or COVERED."""
    return list(TESTS) if TESTS else [COVERED]


# Mutants checked by hand to change no verdict: id -> (text its line must contain, or a tuple of such texts: any, why
# it is equivalent). A mark names a mutant without its line number, so `#2` counts on one line only: the same
# mutation on two lines of a function is one mark with two texts. A mark whose line no longer contains its text is
# ignored (with a warning), and so is one that names no mutant at all (`unmatched_marks`, printed by --list and
# every run), so a stale mark cannot hide a new mutant.
# Keep this short and honest: a mutant that only changes what a finding says is not marked; it is a gap.
_TOLERANCE_EDGE = ("`>` and `>=` differ only where a measured float equals a positive float tolerance exactly; "
                   "float32/16 readings never equal 1e-4 etc. (not representable), float64 ones would need an exact "
                   "hit")
_DRAW_EDGE = "differs only where two independent continuous random draws are exactly equal"
_ZERO_BASE = (
    "equivalent in practice: honoured_conventions' two changes are measured against the baseline copy's scale, so "
    "both are None or neither; they part (`and None` made it always None, `any` made `all`) only where the baseline "
    "copy under a convention tried has no finite non-zero value at all (then each change is read against its own "
    "copy's scale, None where that copy is zero too). A layer whose output is zero or non-finite in every row of the "
    "probe's call, on standard-normal tokens and a padding mask that leaves every query at least half its keys, and "
    "not in the copy where one key changed, was not found: checked by hand on _change.relative_change and "
    "baseline_scale; a layer built to do it would zero its output until a key passes a size")
_VALUES_ARE_KEYS = (
    "a one-stream base is Inputs(x, x, x), so `and` gives the same there; where only the base's value is its key, "
    "every stacked copy keeps it so (`perturbed` redraws the value with the key: vs = ks), so the values concatenated "
    "are the "
    "keys element for element and only the tensor's identity differs. A layer may read that identity (torch's "
    "MultiheadAttention packs its key and value projections when key is value), but baseline and copies are in the "
    "one call either way: every comparison is within one computation (checked in _core.perturbed and every Inputs "
    "built in the detectors: keys_matter's mixed case is on SEPARATE_STREAMS, whose value is its own)")
_RATIO_FLOOR = (
    "the floor stands in for log(0) where the ratio is exactly 0 (q·k multiplied by 0), read 690 out in log, and "
    "breaks ties between readings equally far outside; moved to 1e-299 or 1e-301 it reorders a zero ratio only "
    "against a reading 687 to 692 out: a ratio under 1e-298 or a cosine logit under 1e-298 (too flat as well) or "
    "above 1e300, so the reading judged fails as too flat either way (checked by hand)")
_SCALE_EDGE = (
    " (applied / square against 1 / SCALE_RATIO and SCALE_RATIO: the same edge as the mark on `ratio > SCALE_RATIO` "
    "above; the split reading's ratio there is the edge itself)")
_FLOOR_OF_ZERO = (
    "the floor keeps the bar positive when every gradient is 0 (then `later` is 0 as well and passes any bar); x10 "
    "or x0.1 moves the bar only where the largest gradient lies below 1e-299: under float32's smallest subnormal "
    "(1.4e-45), and in float64 no model with finite non-zero weights gets there (checked by hand)")
_SCALE_FLOOR = (
    "`scale = max(|grad| |u|, 1e-300)`: the floor keeps the division finite where the gradient is 0 (u is a Gaussian "
    "draw, never 0). It acts only where |grad| |u| < 1e-299, a gradient under float64's normal range; there autograd's "
    "directional derivative is 0 and the finite differences are 0 (a pass at any floor: rel 0, pinned by "
    "test_gradients_words_an_exact_agreement_of_zero) or rounding noise of 1e-20 or more (rel > 1e270 against a bar of "
    "1e-9: a fail at any floor); the noise bar 30 |fd_fine - fd| / scale scales with rel (checked by hand)")
_ZERO_OUTPUT = (
    "`or 1.0` is the scale only where the float64 output is exactly 0 everywhere (its RMS is 0), so the move is read "
    "in absolute terms: x10 or x0.1 changes the verdict only for a part whose N(0, 1) change moves an all-zero output "
    "by between 1e-10 and 1e-8 absolute. On the probe's O(1) tokens an O(1) change of weights either leaves such an "
    "output exactly 0 (the part does not reach it) or moves it by far more; equivalent in practice (checked by hand: "
    "there every gradient of (out ** 2).sum() is 0, so every parameter is perturbed and read this way)")
_SAME_SCALE = (
    "equivalent in practice: the bar only skips a candidate scale equal to the layer's own. A candidate within 1e-8 "
    "(x10) or 1e-10 (x0.1) of it, relative, recomputes the reference to within about 1e-8 x the logits' spread of "
    "the output's RMS, so it is never 10x closer than the reference to an output the reference misses by more than "
    "the allowed error (>= 1e-5, the float32 and float64 floor): tried or skipped, it names nothing (checked by hand: "
    "the candidates are 1, 1/d, 1/sqrt(H d), the own scale squared and sqrt(d))")
_RMS_FLOOR = (
    "the floor keeps the division finite where a head's values are all exactly 0: their range is then 0, and an "
    "output off it by e gives an excess of e / 1e-30, e / 1e-29 or e / 1e-31, past any tolerance for every e above "
    "1e-25 (and 0 for an output of exact zeros); elsewhere it moves the unit only for values whose RMS lies below "
    "1e-29, which a probe's values (RMS of order 1, or 0.02 at std-0.02 weights) never reach (checked by hand)")
_SAME_CODE = (
    "the float64 reading is made only after the layer's own outputs passed the shape guards before it (a function's "
    "output has the query's shape, a module's is (B, T, D) beside its one token's (B, 1, D)), and the float64 copy is "
    "the same code on the same inputs upcast: its outputs have those shapes, so the guard is false whichever operator "
    "joins its parts (checked by hand; a layer whose output shape changed with the dtype would be needed)")
_BELOW_EVERY = (
    "the fill marks the cells outside the rows read before an argmax over the rest; those rows hold |x - 1| or "
    "|new - old| / scale, never negative and never NaN (inf where non-finite: nan_to_num), so a fill of -1, -10 or "
    "-0.1 lies below every one of them and the argmax names the same cell (checked by hand)")
_LARGER_PUSH = (
    "keys_matter asks only whether changing the keys moved the output at all, and a larger push moves the scores "
    "further. Measured (2026-12-04; a correct layer at d_model 1, two tokens, W_Q scaled from 1e-15 to 0.56 in quarter "
    "decades, the other projections the identity): in float32 and bfloat16 every layer a push of 1e6 moved a push of "
    "1e7 moved, in float16 every layer 100 moved 1000 moved. Past float16's range (keys x1000 at d_k 64 and 512) the "
    "scores overflow and the output goes NaN where the baseline was finite, which relative_change reads as an "
    "infinite change, a move (a layer that zeroes NaN weights moved as much as at x100); the control's perturbation "
    "stays finite (|draw - old| < 10, x1000 < 65504). The x0.1 side of 1e6 changes verdicts and is "
    "pinned (tests/test_pins_seed21.py); float16's 100 x0.1 is marked apart (below)")
_KINK_RULE_EDGES = (
    "on any of these lines. `rel > limit` (all three, the one before the smaller steps too): " + _TOLERANCE_EDGE +
    ". `min(reads) >= 0` (m37i, checked by hand): "
    "the reads are abs() values, never negative, so `>= 0` always holds; where min is 0 the next test, max <= 2 x 0, "
    "holds only if every read is 0, and then reads[0], returned, is the 0 of the else: the same value in every case. "
    "The two jumps against GRADIENT_AGREEMENT x scale (or x size): " + _TOLERANCE_EDGE + " (a jump, the "
    "extrapolated second difference of float64 losses, equal to 1e-9 times |grad| |u|; where it is 0, as `steady` "
    "returns for no kink, `0 >= 1e-9 x size` is false, size being at least the floor 1e-300)")
_KINK_EDGE = (
    "`<=` and `<` differ only where the greatest of three float readings of the jump is exactly twice the least; a "
    "kink at the point reads within 1.2x, a smooth part shrinks 8x a halving, and |g| ** 1.5 at 0 (exactly 2x in exact "
    "arithmetic) reads just under 2x in float64 (its h ** 2 term): the same verdict under both operators (checked on "
    "tests/test_pins_seed21.py's gate at p = 1.4, 1.45, 1.5, 1.55)")
_DISTANCE_FLOOR = (
    "on the slope's line, `.clamp(min=1e-300)`: the floor keeps a head's slope finite where its centred distances are "
    "all 0. They are integers less each row's mean over the n keys it sees, multiples of 1/n: their squares sum to 0 (every row sees one key, or keys at one "
    "distance) or to at least 1/2 (two keys at distances one apart, the least spread), never between 1e-301 and "
    "1e-299; at 0 the products with the centred scores sum to exactly 0 too, so the slope is 0 / floor = 0 at "
    "any floor (checked by hand)")
_OTHER_DTYPE = (
    ". On the line of the residual's bar, DISTANCE_LINEAR.get(dtype, 1e-3): the default is read only for a floating "
    "dtype outside the table's four; the audit takes any floating dtype, but float8 (the others torch has) stops "
    "before any reading: the probe's `mul` is not implemented for it (m37k checked audit(..., dtype="
    "torch.float8_e4m3fn) on CPU: the detector's error). Equivalent in practice; not checked on a GPU")
_PER_HEAD_PRECHECK = (
    "a cost guard only: with any of its `or`s made `and`, an output it would have turned away goes on to one traced "
    "call and to heads_layout, which reads no per-head form in it either (no form of T rows splits the width into "
    "heads where the output is not 4-D, of another batch, without a T-long axis, or of another size per sequence: "
    "`_form(seen, ...)` must equal its shape), so heads_seen returns None as the guard did, one call later (checked "
    "by hand in detectors/_heads_out.heads_layout and _form)")
_HONOURED_GUARD = (
    "made `and`, the second `or` lets through a layer that takes no mask (its convention not declared) or one whose "
    "convention the user or its library declared (it takes a mask), where no failed call went without a mask; "
    "either goes on to honoured_conventions (after `unmasked_ran`, which reads and writes nothing), whose first "
    "guard is the same `s.convention_by in (\"user\", \"library\") or not s.takes_mask`: it returns [] (and caches [], which it "
    "would return anyway), so `if not found: return None` returns what the original guard did (checked by hand in "
    "_mask_hints.honoured_conventions)")
EQUIVALENT: dict[str, tuple[str | tuple[str, ...], str]] = {
    "_core.py:held:L*:x10": ("torch.full_like(change, -1.0)", _BELOW_EVERY),
    "_core.py:held:L*:x0.1": ("torch.full_like(change, -1.0)", _BELOW_EVERY),
    "detectors/weights.py:check_weight_row_sums:L*:x10": ("torch.where(rows, dev, -1.0)", _BELOW_EVERY),
    "detectors/weights.py:check_weight_row_sums:L*:x0.1": ("torch.where(rows, dev, -1.0)", _BELOW_EVERY),
    "_core.py:perturbed:L*:Lt->LtE": (".amax(-1, keepdim=True) < 1.0", _DRAW_EDGE),
    "_core.py:perturbed:L*:GtE->Gt": ("delta >= 0", _DRAW_EDGE),
    "detectors/weights.py:check_weight_row_sums:L*:Gt->GtE": ("(dev[rows] > tol)", _TOLERANCE_EDGE),
    "detectors/weights.py:check_weight_row_sums:L*:Lt->LtE": ("w < -tol", _TOLERANCE_EDGE),
    "detectors/temperature.py:check_softmax_saturation:L*:Gt->GtE": ("ratio > SCALE_RATIO", _TOLERANCE_EDGE),
    "detectors/temperature.py:check_softmax_saturation:L*:Lt->LtE": ("ratio < 1 / SCALE_RATIO", _TOLERANCE_EDGE),
    "detectors/variance.py:check_output_variance:L*:Gt->GtE": ("(change > tol)", _TOLERANCE_EDGE),
    "detectors/variance.py:_judged_inside:L*:Gt->GtE": ("(change > tol).sum()", _TOLERANCE_EDGE),
    "detectors/variance.py:_judged_with_learned_keys:L*:Gt->GtE": (("if gap > tol:", "(excess > tol).sum()"),
                                                                   _TOLERANCE_EDGE),
    "detectors/variance.py:_judged_with_learned_keys:L*:x10": (".sqrt().clamp_min(1e-30)", _RMS_FLOOR),
    "detectors/variance.py:_judged_with_learned_keys:L*:x0.1": (".sqrt().clamp_min(1e-30)", _RMS_FLOOR),
    "detectors/variance.py:_bound_check:L*:x0.1": (
        "(hi - lo).clamp_min(1e-12)", "equivalent in practice: the floor matters only where the values' spread over "
        "the keys is below 1e-12; the probe's values are standard normal draws of 16 keys"),
    "detectors/variance.py:_float64_reading:L*:or->and": ("if got.dim() != alone.dim() or any(", _SAME_CODE),
    "detectors/variance.py:_float64_reading:L*:any->all": ("if got.dim() != alone.dim() or any(", _SAME_CODE),
    "detectors/variance.py:check_output_variance:L*:LtE->Lt": ("exact <= tolerance(CONVEX", _TOLERANCE_EDGE + " (a "
                                                               "float64 copy's reading against float32's 1e-4)"),
    "detectors/variance.py:_bound_check:L*:Gt->GtE": (("(excess > tol).any()", "(excess > tol).sum()"),
                                                      _TOLERANCE_EDGE),
    "detectors/determinism.py:check_eval_determinism:L*:Gt->GtE": (
        ("== B > 1:", "change)] > tol).any()):"), "on either line. `B > 1`: B is the standard probe's batch, "
        "Probe.BATCH = 2 (_probe.py): `B > 1` and `B >= 1` are both true (checked by hand). `change > tol`: "
        + _TOLERANCE_EDGE),
    "detectors/causal.py:_newest_key_seen:L*:LtE->Lt": ("(last <= tol)", _TOLERANCE_EDGE),
    "detectors/masking.py:allowed_key_reading:L*:Gt->GtE": (("(rows > tol).sum()", "(rows > tol).any()"),
                                                            _TOLERANCE_EDGE + " (on either line: the reading, and a "
                                                            "count in the evidence; the reading in practice, as "
                                                            "crosses' below)"),
    "detectors/batch.py:check_batch_independence:L*:Gt->GtE": ("change)] > tol", _TOLERANCE_EDGE),
    "detectors/decoding.py:check_decode_consistency:L*:Gt->GtE": ("(change > tol)", _TOLERANCE_EDGE),
    "detectors/runs.py:_needed_declaration:L*:or->and": (
        "if not calls or not s.takes_mask or", "a layer that takes no mask is given none in any call, a causal audit's "
        "included (checked by hand: every failed call of such a layer has allowed None), so `any(c.allowed is None "
        "for c in calls)` returns None whenever `not s.takes_mask` would: the first `or` made `and` changes no verdict "
        "(tests/test_pins_all_masking_gradients_runs.py: a maskless layer at one token still fails)"),
    "detectors/decoding.py:check_cache_decoding:L*:Gt->GtE": ("int((part > tol).sum())", _TOLERANCE_EDGE + " (tol "
                                                              "is at least ROW_SUM's, positive, per dtype)"),
    "detectors/decoding.py:check_decode_consistency:L*:LtE->Lt": (
        "exact <= tolerance(ROW_SUM, torch.float64)", _TOLERANCE_EDGE + " (a float64 copy's reading against float64's "
        "1e-9)"),
    "detectors/gradients.py:check_gradients:L*:Gt->GtE": (  # extended by m37i (its block below says why)
        ("if rel > limit", "if min(reads) > 0 and max(reads)", "steady=False)) > GRADIENT_AGREEMENT * scale",
         "frozenset({j}))) > GRADIENT_AGREEMENT * size"), _KINK_RULE_EDGES),
    "detectors/gradients.py:check_gradients:L*:LtE->Lt": (  # extended by m37i: the smaller steps' bar
        ("max(reads) <= KINK_STEADY * min(reads)", "if rel_small <= limit_small:"),
        "on either line. The kink rule: " + _KINK_EDGE + ". `rel_small <= limit_small`: " + _TOLERANCE_EDGE),
    "detectors/keys.py:check_keys_matter:L*:Gt->GtE": (
        "if all(m > ROUNDING_BOUND * comparison.tol", _TOLERANCE_EDGE + " (a reading against 10 x UNCHANGED's "
        "tolerance; it decides only whether the null twin call is made, and a reading exactly at the edge is far above "
        "the 0 that `moved` is judged against)"),
    "detectors/keys.py:check_keys_matter:L*:or->and": (
        "scale = baseline_scale(comparison.baseline_output(), centred=True) or None", "the unit of the null-twin "
        "reading only: with `and` the scale is always None and relative_change measures against the twin's own copy, "
        "the baseline's inputs in another place of the batch (the same RMS up to rounding). Either way a change of "
        "exactly 0 reads 0 and any other a positive number, and `moved` is judged against 0 (`m > tol`, tol = 0.0): "
        "the verdict cannot move; the reported least move differs by that rounding (checked by hand)"),
    "detectors/keys.py:check_keys_matter:L*:guard-never": (
        "if any(c is None for c in changes):", "the guard never fires: relative_change returns None only for a scale "
        "that is not > 0. Given the baseline's scale it is > 0; where that is 0 (`or None`), it is the twin copy's or, "
        "that being 0 too, the case output's, whose scale is the very one compared() found > 0 for that case against "
        "the zero baseline (else it returned its skip before): never None (checked by hand, _change.relative_change, "
        "baseline_scale and compared)"),
    "detectors/keys.py:check_keys_matter:L*:any->all": (
        "if any(c is None for c in changes):", "the guard never fires (see guard-never on this line): no change is "
        "None, so `any` and `all` are both false"),
    "detectors/keys.py:_plan:L*:x10": ("(100.0,) if s.dtype == torch.float16 else (1e6,)", _LARGER_PUSH),
    "detectors/keys.py:_plan:L*:x0.1": (
        "(100.0,) if s.dtype == torch.float16 else (1e6,)", "float16's push of 100 at 10: equivalent in practice, "
        "measured (2026-12-04, the whole run at 1cf8d3b; a correct layer at d_model 1, two tokens, float16, W_Q from "
        "1e-8 to 0.056 and, apart, W_K from 1e-7 to 0.056 in quarter decades, the other projections the identity): "
        "every verdict the same at 10 as at 100. Below W_Q = 3e-8 the query rounds to 0 in float16 and the keys act "
        "on nothing at any push; above it a push of 10 already moves the output by a float16 rounding of it, which "
        "keys_matter reads as a move (judged against 0), so the bound that float32's and bfloat16's 1e6 has "
        "(tests/test_pins_seed21.py) does not exist in float16 at 10x less"),
    "detectors/keys.py:_plan:L*:LtE->GtE": (
        "packed = T >= PACKED_KEYS and 1 < len(streams) <= B", "len(streams) is 1 or 2 and B is Probe.BATCH = 2: "
        "`len(streams) <= B` and `>= B` differ only at one stream, which `1 < len(streams)` has refused before (checked "
        "by hand; the clause keeps a probe of one sequence from packing two streams into it)"),
    "detectors/keys.py:_plan:L*:x10#2": ("(100.0,) if s.dtype == torch.float16 else (1e6,)", _LARGER_PUSH),
    "detectors/parameters.py:check_parameters_used:L*:Gt->GtE": ("> FORWARD_MOVES", _TOLERANCE_EDGE),
    "detectors/parameters.py:_shift_inert:L*:Gt->GtE": (
        "float(spread.max()) > SHIFT_INERT * size", _TOLERANCE_EDGE + " (size == 0 is skipped just above, so the bar "
        "is positive: a key bias's spread of exactly 0 is inert either way)"),
    "detectors/causal.py:unmasked_copies:L*:GtE->Gt": (
        "if s.takes_mask and T >= 4 else cuts", "`>= 4` and `> 4` differ at T = 4 only, where the cuts are [0, 2] and "
        "the masked layer's [2]: at B = Probe.BATCH = 2 both fill one copy of the batch, so the next line keeps `cuts` "
        "under either operator (checked by hand; only a batch of 1 would save a copy there)"),
    "detectors/positions.py:check_relative_positions:L*:guard-never": (
        "if change is None:", "relative_change is given `scale`, the baseline's, and returns None only where that is "
        "not > 0, which returned a skip above (`if not scale > 0:`; scale is not assigned again): the guard never "
        "fires, so a guard that never fires is the same code (checked by hand)"),
    "model/_tolerance.py:judge:L*:LtE->Lt": ("err <= allowed", _TOLERANCE_EDGE + " (allowed > 0: the floor)"),
    "model/_tolerance.py:rechecks:L*:LtE->Lt": ("<= COPY_AGREES", _TOLERANCE_EDGE + " (a measured relative change "
                                                                  "against 0.25)"),
    "model/_tolerance.py:judge64:L*:LtE->Lt": ("return err <= float64_allowed()", _TOLERANCE_EDGE + " (against the "
                                                                                   "float32 floor, 1e-5)"),
    "model/window.py:check_sliding_window:L*:Gt->GtE": (
        "if s > 0 and s + w >= T:", "s is 0 or w - 1; at s = 0 the second test is w >= T, false for every layer "
        "measured (`T < w + 1` skipped it above), so `s >= 0` and `s > 0` skip the same columns (checked by hand)"),
    "model/window.py:_positive_int:L*:Gt->GtE": (
        "and value > 0 else None", "with `>=` a width of 0 is returned as 0 instead of None; every caller reads the "
        "result by its truth (`and _positive_int(...)`, `if w:`, `if c:`, `w and ...` in _declared), where 0 and None "
        "are alike: no pattern is declared either way (checked by hand; pinned: sliding_window = 0 declares nothing)"),
    "model/window.py:_column:L*:Gt->GtE": (("(change > tol)).nonzero()", "if not float(change[edge]) > tol:"),
                                           _TOLERANCE_EDGE + " (on either line: a key leaked, the farthest row moved)"),
    "model/causality.py:check_prefix_causality:L*:Gt->GtE": (
        ("(past > tol).sum()", "(change[c + 1:] > tol).any()", "(ch[:c + 1] > tol).sum()", "[:cj + 1] > tol).any()"),
        _TOLERANCE_EDGE + " (a relative change against UNCHANGED's tolerance: the past's count, the later outputs' "
        "change, the reach per layer, the first layer reached)"),
    "model/packing.py:check_packed_documents:L*:Gt->GtE": (
        ("(change[s:e] > tol).any()", "(outside > tol)", "(ch > tol).any()"),
        _TOLERANCE_EDGE + " (a relative change against UNCHANGED's tolerance: a document's own outputs, the others', "
        "the first layer where they cross)"),
    "model/packing.py:_crosses:L*:Gt->GtE": ("return bool((change > tol).any())", _TOLERANCE_EDGE + " (a relative "
                                             "change against UNCHANGED's tolerance: where a leak starts)"),
    "detectors/temperature.py:check_softmax_saturation:L*:LtE->Lt": (
        "math.inf if r <= 0 else _off(r)", "only a ratio of exactly 0 moves: its key becomes _off(0) = |log 1e-300| = "
        "690.8 (the floor of `abs(ratio) or 1e-300`) instead of inf, still past every ratio but one under 1e-300 or "
        "over 1e300, and whichever is picked the skip follows (a ratio <= 0, or one that far off), whose message "
        "shows every ratio, not the worst; tests/test_temperature_left_unjudged.py pins the other mutants of the line"),
    "detectors/temperature.py:_log_weight_scale:L*:Gt->GtE": (
        "& (weights > 0)", "a weight of 0 has log -inf and a negative one log NaN, both already dropped by "
        "torch.isfinite(logw): `weights > 0` and `weights >= 0` keep the same entries"),
    "model/gradients.py:check_gradient_flow:L*:Gt->GtE": (
        "if later > 1e-12 * max(", _TOLERANCE_EDGE + " (the bar is positive: 1e-312 at the least, so a later gradient "
        "of exactly 0 passes either way)"),
    "model/gradients.py:check_gradient_flow:L*:x10#2": ("1e-300)", _FLOOR_OF_ZERO),
    "model/gradients.py:check_gradient_flow:L*:x0.1#2": ("1e-300)", _FLOOR_OF_ZERO),
    "model/_tolerance.py:worst_change:L*:and->or": (
        "if change is not None and change.numel()", "relative_change returns None only for a scale <= 0, and scale_of "
        "is never 0 (1 for all-zero outputs); new.numel() > 0 was checked above, so change.numel() > 0: both "
        "operands are always true"),
    "detectors/variance.py:_bound_check:L*:x10": (
        "(hi - lo).clamp_min(1e-12)", "equivalent in practice: the floor matters only where the values' spread over "
        "the keys is below 1e-11; the probe's values are standard normal draws of 16 keys"),
    "_core.py:stacked_batch:L*:or->and": ("base.one_stream or base.value is base.key", _VALUES_ARE_KEYS),
    "detectors/_mask_hints.py:honoured_conventions:L*:or->and": (
        ("base.one_stream or base.value is base.key", "baseline_scale(chunks[0], centred=True) or None"),
        "on either line. `base.one_stream or base.value is base.key`: " + _VALUES_ARE_KEYS + ". `or None` made `and "
        "None`: " + _ZERO_BASE),
    "detectors/_mask_hints.py:honoured_conventions:L*:any->all": ("if any(c is None for c in changes):", _ZERO_BASE),
    "detectors/_mask_hints.py:honoured_conventions:L*:Gt->GtE": ("moved = moved_change[sees_first] > tol",
                                                                 _TOLERANCE_EDGE),
    "detectors/_mask_hints.py:honoured_conventions:L*:LtE->Lt": ("if worst <= tol and", _TOLERANCE_EDGE),
    "detectors/_mask_hints.py:adds_bool_mask:L*:LtE->Lt": ("float(change.max()) <= tolerance(UNCHANGED",
                                                           _TOLERANCE_EDGE + " (a change of exactly 0, the layer that "
                                                           "adds its mask, is under it either way)"),
    "detectors/positions.py:check_relative_positions:L*:Lt->LtE": (
        "if P < 1:", "P = max(0, limit - T) just above: at P == 1 the branch sets T = limit - 1, which is T, and "
        "P = 1, which it is: `<` and `<=` give the same sizes"),
    "detectors/own_weights.py:_explained:L*:x10": ("<= 1e-9 * p.scale:", _SAME_SCALE),
    "detectors/own_weights.py:_explained:L*:x0.1": ("<= 1e-9 * p.scale:", _SAME_SCALE),
    "_projections.py:_four_d:L*:Gt->GtE": (
        "bias.shape[0] == B * H and H > 1", "at H = 1 the two branches agree: a (B, Tq, Tk) mask viewed as "
        "(B, 1, Tq, Tk) is the same tensor as unsqueeze(1) (checked by hand)"),
    "detectors/own_weights.py:_close:L*:and->or": (
        ("if change is not None and change.numel() else", "if ref is not None and ref.numel() else"),
        "both operands are always true: the scale is baseline_scale(golden) or 1.0, an RMS of the finite values (never "
        "NaN) or 1.0, so relative_change never returns None, and the probe's outputs are never empty (B = 2, T >= 1)"),
    "detectors/own_weights.py:_find:L*:or->and": (
        'path.startswith(p + ".") or p == "" and path', "equivalent in practice: only skips children of an identified "
        "module, which are its projections and norms (nn.Linear, LayerNorm, RMSNorm, out_proj); no recogniser "
        "identifies one of those (each needs q/k/v projections of its own, a qkv and an output projection, or is "
        "nn.MultiheadAttention, whose modules a recognised module uses all of), so not skipping them finds nothing"),
    "detectors/own_weights.py:_judge:L*:LtE->Lt": ("if err <= allowed:", _TOLERANCE_EDGE),
    "detectors/own_weights.py:_judge:L*:Gt->GtE": ("if err > allowed:", _TOLERANCE_EDGE),
    "detectors/own_weights.py:_explained:L*:LtE->Lt": (("<= 1e-9 * p.scale:", "if e <= allowed and e <= err / 10:"),
                                                       _TOLERANCE_EDGE),
    "detectors/own_weights.py:_explained:L*:LtE->Lt#2": ("if e <= allowed and e <= err / 10:", _TOLERANCE_EDGE),
    "detectors/own_weights.py:check_own_weights:L*:Gt->GtE": (
        "err / allowed > worst[0] / (worst[1] or 1.0)", "differs only where two modules' error / allowed are exactly "
        "equal (then which of them the value reports, not the verdict); with one module the first reading is > 0 and "
        ">= 0 alike unless it is exactly 0"),
    "detectors/own_weights.py:check_own_weights:L*:x10": (
        "(worst[1] or 1.0)", "worst[1] is 0 only at the start, (0.0, 0.0), where worst[0] is 0 too: 0 / 1, 0 / 10 and "
        "0 / 0.1 are all 0 (every allowed error is > 0: the floor)"),
    "detectors/own_weights.py:check_own_weights:L*:x0.1": (
        "(worst[1] or 1.0)", "worst[1] is 0 only at the start, (0.0, 0.0), where worst[0] is 0 too: 0 / 1, 0 / 10 and "
        "0 / 0.1 are all 0 (every allowed error is > 0: the floor)"),
    "detectors/own_weights.py:_explained:L*:or->and": (
        "p.heads == p.kv_heads or step == STEPS[3]", "the two skips save a recompute only: with as many key/value "
        "heads as query heads the wrong-order step repeats nothing, and without an output projection the skipped-"
        "projection step returns the reference's output, and without a stated value scale the step that leaves it out "
        "does too, so each such recompute IS the reference: e equals err, never at most err / 10, and nothing is named "
        "(checked in _projections.attend)"),
    "detectors/own_weights.py:_explained:L*:or->and#2": (
        "p.heads == p.kv_heads or step == STEPS[3]", "the second `or` joined makes the skip of the output-projection "
        "step (no output projection) and of the value-scale step (none stated) never fire; each such recompute IS the "
        "reference, as for the first `or` (above): e equals err, never at most err / 10, and nothing is named (checked "
        "in _projections.attend)"),
    "detectors/gradients.py:check_gradients:L*:x0.1": (
        ("mul_(0.6180339887498949)", "for d in u))), 1e-300)"),
        "equivalent in practice, on either line. `mul_(0.618...)`: the golden-ratio step only spreads the sampled "
        "entries of a parameter with more than PARAMETER_ENTRIES entries; at 0.0618 they are still spread over the "
        "tensor, and a wrong backward is wrong at almost every entry (at most 512 entries: every entry, the step "
        "unused). " + _SCALE_FLOOR),
    "detectors/gradients.py:check_gradients:L*:x10": ("for d in u))), 1e-300)", _SCALE_FLOOR),
    "detectors/parameters.py:_moved_by:L*:x10": ("or 1.0", _ZERO_OUTPUT),
    "detectors/parameters.py:_moved_by:L*:x0.1": ("or 1.0", _ZERO_OUTPUT),
    "detectors/parameters.py:size_removed:L*:LtE->Lt": (("<= SIZE_MOVES]", "<= FORWARD_MOVES"), _TOLERANCE_EDGE),
    "detectors/parameters.py:size_removed:L*:Gt->GtE": ("> FORWARD_MOVES]", _TOLERANCE_EDGE),
    "detectors/gradients.py:_masked_key_gradient:L*:x10#2": ("1e-300)", _FLOOR_OF_ZERO),
    "detectors/gradients.py:_masked_key_gradient:L*:x0.1#2": ("1e-300)", _FLOOR_OF_ZERO),
    "detectors/gradients.py:_future_gradient:L*:x10#2": ("1e-300)", _FLOOR_OF_ZERO),
    "detectors/gradients.py:_future_gradient:L*:x0.1#2": ("1e-300)", _FLOOR_OF_ZERO),
    # the full run of detectors/parameters.py at fbdaa93 (issue 37), checked by hand:
    "detectors/parameters.py:structural_zeros:L*:Gt->GtE": (
        ("grad.shape[0] == grad.shape[1] > 1:", "grad.dim() == 2 and grad.shape[0] > 1:"),
        "the two tests are reached only by a gradient with both zero and non-zero entries (the lines above returned "
        "for one with no zero and for one with no non-zero); a 1 x 1 gradient is never such, and one row holding a "
        "non-zero entry is no dead row, so `>= 1` reads nothing `> 1` does not and returns '' as well (shape[0] of 0: "
        "no entry, returned '' on the first line)"),
    "detectors/parameters.py:kept_copy:L*:or->and": (
        "or tensor.shape[0] < kept.shape[0] or", "the tests before it skipped other numbers of dimensions, so both "
        "have a first one; the joined test lets through a tensor of other trailing dimensions, which torch.equal finds "
        "equal to no block of its rows, or one of fewer rows, which `tensor.shape[0] % kept.shape[0]` (its row count, "
        "non-zero) still skips (0 rows: one empty block, equal to no copy, a non-empty one): no copy is found that the "
        "skip would have left out (checked by hand, torch 2.13)"),
    # the full run of detectors/temperature.py at 7ee48c8 (issue 37), checked by hand:
    "detectors/temperature.py:_readings:L*:x10": (
        "rel_tol=1e-6) else value * value",
        "`times`: _stated_factor matched the value to the factor or to its square root within 1e-6; "
        "at 1e-5 the value is taken once instead of squared only where it also lies within 1e-5 of the factor, so "
        "the factor is within 2.2e-5 of 1, where value and value^2 differ by under 2.2e-5 and the ratio stays within "
        "1 +- 3e-5 of 1 either way (SCALE_RATIO is 1.25)"),
    # (moved from check_softmax_saturation with the readings, unchanged, by fixb)
    "detectors/temperature.py:_off:L*:x10": ("return abs(math.log(abs(ratio) or 1e-300))", _RATIO_FLOOR),
    "detectors/temperature.py:_off:L*:x0.1": ("return abs(math.log(abs(ratio) or 1e-300))", _RATIO_FLOOR),
    "detectors/temperature.py:_readings:L*:Gt->GtE": (
        "parts > 1 and _off(applied / wide) < _off(applied / expected)", "at parts = 1, `wide` is `expected` "
        "(expected / sqrt(1)), so the comparison beside it, `<` between two equal numbers, is false and the branch is "
        "not taken either way (checked by hand)"),
    "detectors/temperature.py:_readings:L*:Lt->LtE": (
        ("and _off(applied / wide) < _off(applied / expected)", "_off(math.sqrt(parts * d_k / d_model)) < math.log(",
         "if _off(applied / wide) < math.log(SCALE_RATIO) <="),
        _TOLERANCE_EDGE + " (on any of these lines: two logs of computed ratios equal only where the applied factor "
        "is exactly the geometric mean of the two readings, or a computed log exactly log(SCALE_RATIO))"),
    "detectors/temperature.py:_readings:L*:LtE->Lt": (
        "math.log(SCALE_RATIO) <= _off(applied / expected)", _TOLERANCE_EDGE + " (a computed log exactly "
        "log(SCALE_RATIO))"),
    "detectors/temperature.py:_worst:L*:x10": ("abs(r.ratio) or 1e-300))))", _RATIO_FLOOR),
    "detectors/temperature.py:_worst:L*:x0.1": ("abs(r.ratio) or 1e-300))))", _RATIO_FLOOR),
    "detectors/temperature.py:outside:L*:x10": ("abs(self.ratio) or 1e-300)", _RATIO_FLOOR),
    "detectors/temperature.py:outside:L*:x0.1": ("abs(self.ratio) or 1e-300)", _RATIO_FLOOR),
    "detectors/temperature.py:_cosine_bound:L*:Gt->GtE": (
        ("and float(n.min()) > 0 and", "- 1) > RMS_NORMED"),
        "on either line. `n.min() >= 0` lets a row norm of 0 through to `n.max() / n.min()`, a tensor division: inf "
        "(NaN where every norm is 0), and `< 1 + apart` is False for both, so the `all` is False as with `> 0`. `> "
        "RMS_NORMED`: a scale the layer passes with |scale sqrt(d_k) - 1| exactly the float 0.02 (no (1 +- 0.02) / "
        "sqrt(d_k) hits it for d_k 1 to 4,096: checked), and even there both readings pass: 1/sqrt(d_k)'s ratio "
        "1.02, the cosine rule's logit 1.02 sqrt(d_k), inside 0.5 to 100 up to d_k = 9,600"),
    "detectors/temperature.py:_cosine_bound:L*:Lt->LtE": (
        ("< 1 + apart for n in norms", "- 1) < RMS_NORMED for n in"),
        _TOLERANCE_EDGE + " (rows' norms measured in float64 from the observed operands: their spread against "
        "1 + NORMS_APART or ROW_SUM, their mean's distance from sqrt(d_k) against RMS_NORMED)"),
    "detectors/temperature.py:_split_over_q_and_k:L*:LtE->Lt": ("1 / SCALE_RATIO <= applied / square",
                                                               _TOLERANCE_EDGE + _SCALE_EDGE),
    "detectors/temperature.py:_split_over_q_and_k:L*:LtE->Lt#2": ("<= applied / square <= SCALE_RATIO",
                                                                 _TOLERANCE_EDGE + _SCALE_EDGE),
    "detectors/temperature.py:_judged_cosine:L*:Lt->LtE": (
        "if b < COSINE_FLAT:", _TOLERANCE_EDGE + " (b: the scale times the mean measured norms of q's and k's rows)"),
    "detectors/temperature.py:_judged_cosine:L*:Gt->GtE": (
        "if b > COSINE_SHARP:", _TOLERANCE_EDGE + " (b: the scale times the mean measured norms of q's and k's rows)"),
    # m37e: positions.py, pattern.py (the full run at 824d172, issue 37), checked by hand:
    "detectors/pattern.py:_run:L*:Gt->GtE": ("moved.append(_fold(change).cpu() > tol)", _TOLERANCE_EDGE + " (a "
                                             "relative change against tolerance(UNCHANGED, dtype))"),
    "detectors/positions.py:_stack:L*:all->any": (
        ("k = q if all(c[1] is c[0] for c in calls)", "v = k if all(c[2] is c[1] for c in calls)"),
        "on either line. _stack is called once, on the shifted call and the identical tokens, both built from the same "
        "(q, k, v): the shifted call's key is its query where q is k (else a new tensor) and its value its key where v "
        "is k, and _identical keeps the same identities (one tensor where q is k, the value the key where v is k). "
        "So the calls agree on each `is`, and `any` of two equal booleans is their `all` (checked by hand)"),
    "detectors/positions.py:check_relative_positions:L*:Gt->GtE": (
        ("if limit is not None and T + P > limit[0]:", "if noise is not None and float(noise.max()) > tol:",
         "if drift is not None and float(drift.max()) > tol:", "if period > 1:"),
        "on any of these lines (the third, the second shifted call's drift, added by m37k; the fourth, `period > 1`, "
        "words the evidence only, the shift being chosen above). `T + P >= limit[0]` enters the branch also at T + P == limit, where it sets P = max(0, limit "
        "- T), which is P (5, so `P < 1` below is false): the same sizes (checked by hand; pinned at a context of 17, "
        "T + P exactly, in tests/test_pins_all_positions_pattern.py). `noise.max() >= tol`: " + _TOLERANCE_EDGE +
        " (a relative change against SHIFT_MOVES' tolerance, on the second line and the third: a Python float "
        "made of a float32 reading below float64, against the doubles 2e-5, 4e-2 and 0.3, none of which a float32 "
        "number equals (m37k checked float(torch.tensor(v, dtype=torch.float32)) == v: False for each), or 1e-9)"),
    "detectors/positions.py:check_relative_positions:L*:or->and": (
        "pv = pk if (one or v is k) else", "pv is read only through V two lines below, which is K wherever `one or v "
        "is k` holds (pv unused); elsewhere `one and v is k` is false too, and both give v.index_select(t, perm) "
        "(checked by hand)"),
    # m37h: _thresholds, model/_causal (issue 37), checked by hand: none needed. Every survivor of the full run at
    # 1910d14 is pinned (tests/test_pins_all_thresholds_causal.py), masks_future's `> tol` exactly at the tolerance
    # too: its mark went (torch compares a float32 change with the tolerance rounded to float32, a float32 number a
    # layer can hit exactly).
    # m37i: runs, gradients, pattern (issue 37), checked by hand: (the kink rule's and the smaller steps' edges in
    # gradients extend the `Gt->GtE` and `LtE->Lt` marks of check_gradients above: one key per kind of mutant)
    "detectors/gradients.py:_masked_key_gradient:L*:Gt->GtE": (
        "if g.dim() > t_dim + 1 else g.abs()", "the gradients read are those of the probe's own key and value inputs, "
        "(B, H, T, d) for a function (time_dim 2) and (B, T, D) for a module (time_dim 1) (_subject.py): always "
        "time_dim + 2 dimensions (the feature axis after time), so `>` and `>=` are both true and the same branch "
        "is taken (checked by hand)"),
    # m37j: model/gradients (issue 37), checked by hand:
    "model/gradients.py:squared:L*:Gt->GtE": (
        "& (scale > 0), scale,", "the two differ only at scale == 0, an output of exactly 0 everywhere: `>= 0` keeps "
        "0, which clamp_min raises to sqrt(tiny) (positive, 1/scale finite in float32 and float64), `> 0` takes 1; "
        "either way (t / scale) ** 2 is 0 and its gradient 2 t / scale ** 2 is exactly 0 at t = 0 (checked by hand)"),
    "model/gradients.py:_moves_output:L*:Gt->GtE": ("> MOVES * scale", _TOLERANCE_EDGE + " (MOVES * scale > 0: "
                                                    "the scale is an RMS or 1, so an unchanged output is not moved "
                                                    "either way)"),
    "model/gradients.py:_moves_only:L*:Gt->GtE": ("> MOVES * scale", _TOLERANCE_EDGE + " (MOVES * scale > 0: the "
                                                  "scale is an RMS or 1, so an unchanged output is not moved either "
                                                  "way)"),
    "model/gradients.py:_in_float64:L*:and->or": (
        "if t.requires_grad and t is not out)", "with `or` the sum also takes the returned tensors that carry no "
        "gradient (constants: no parameter's gradient changes, and autograd.grad asks only for the parameters and "
        "outputs) and `out` a second time (its term doubled: every gradient through it x2, so the same ones are "
        "exactly 0 and the same finite); the float64 copy's answer is only which gradients are non-zero (checked "
        "by hand)"),
    "model/gradients.py:_underflow_in_place:L*:and->or": (
        "if t.requires_grad and t is not out)", "the same as _in_float64's: a constant term or `out`'s doubled changes "
        "which module outputs get a non-zero gradient not at all (the float64 replay is given 2g for g: the same "
        "parameters get a non-zero total; checked by hand)"),
    "model/gradients.py:_underflow_in_place:L*:Gt->GtE": (
        "or not bool(g.abs().sum() > 0):", "`>= 0` is true of every finite sum, so a call whose output got a "
        "gradient of exactly 0 is replayed too: a vector-Jacobian product with 0 adds exactly 0 to every total, the "
        "same parameters are found (checked by hand)"),
    "model/gradients.py:prev_length:L*:Lt->LtE": (
        "shorter = [x for x in LONGER if T < x < L]", "`T <= x` adds x == T (an audit at 64 or 256) to the lengths "
        "below L; the answer is the last of them, which is T itself only where T is the only one, and T is the "
        "fallback: the same length (checked by hand)"),
    "model/gradients.py:check_gradient_flow:L*:and->or": (
        "if t.requires_grad and t is not out)", "the same as _in_float64's: the loss gains constants (no gradient "
        "changes) and `out`'s term twice (every gradient through it x2: the same ones exactly 0, the same finite, "
        "the normalised squares' gradients far from float32's largest number); checked by hand"),
    "model/gradients.py:_zeroed_inside:L*:and->or": (
        "if paths and torch.is_tensor(loss) else ()", "`paths or is_tensor(loss)` differs where one is false: no "
        "paths (then nothing can be zeroed, and autograd.grad of no inputs raises into the except: {}), or a loss "
        "that is no tensor (autograd.grad raises: {}; with `and`, no grads: nothing zeroed, {}): the same {} "
        "(checked by hand)"),
    # m37k: positions.py, runs.py, _core.py (the full runs at ff5444f, issue 37), checked by hand:
    "detectors/positions.py:check_relative_positions:L*:LtE->Lt": (
        ("if uses <= bar and getattr(probe, \"positions\", None) == \"relative\":", "if uses <= bar:"),
        "on either line. `uses` is the permutation's largest relative change, a Python float made of a float32 "
        "reading below float64 (relative_change computes in float32 there) or of a float64 one, or 0.0; `bar` is "
        "tolerance(UNCHANGED, dtype), the doubles 1e-5, 2e-3 and 1.6e-2, none of which a float32 number equals (checked "
        "with float(torch.tensor(v, dtype=torch.float32)) == v: False for each), or 1e-10 for a float64 reading, which "
        "an exact hit alone would equal: `<` and `<=` take the same branch (checked by hand)"),
    "detectors/positions.py:distance_reward:L*:x10": (
        (".clamp(min=1e-300)", "DISTANCE_LINEAR.get(dtype, 1e-3)"), _DISTANCE_FLOOR + _OTHER_DTYPE),
    "detectors/positions.py:distance_reward:L*:x0.1": (
        (".clamp(min=1e-300)", "DISTANCE_LINEAR.get(dtype, 1e-3)"), _DISTANCE_FLOOR + _OTHER_DTYPE),
    "detectors/positions.py:distance_reward:L*:Gt->GtE": (
        "if not spread > 0 or", "`spread >= 0` differs only at a spread of exactly 0, where every centred score is 0: "
        "the slope is then 0 (a sum of zeros over the floor), the residual 0 is not above 0, and `slope > 0` holds for "
        "no head, so None is returned either way; NaN fails both (checked by hand)"),
    "detectors/positions.py:distance_reward:L*:Gt->GtE#2": (
        "if not spread > 0 or", _TOLERANCE_EDGE + " (float64 residual against DISTANCE_LINEAR x the float64 spread, "
        "which is positive there: a residual of 0, an exact line, is under it either way)"),
    "detectors/positions.py:_blocked:L*:Lt->LtE": (
        "x - x.amax(-1, keepdim=True) < UNDERFLOW", _TOLERANCE_EDGE + " (float64 scores, less their row's largest, "
        "against UNDERFLOW = log(float32's smallest normal), -87.34: a score exactly that far below, whose weight is "
        "the smallest normal itself, is blocked with `<=` and not with `<`; the probe's scores are draws)"),
    "detectors/positions.py:_per_copy:L*:Gt->GtE": (
        "if folded > 1:", "at folded = 1 (no heads folded into the batch) the second order is x.reshape(1, nB, -1, N, "
        "N).transpose(0, 1).reshape(nB, -1, N, N), a transpose over an axis of size 1: the first order again, whose "
        "distance reading is the same (checked by hand)"),
    "detectors/positions.py:_mask_is_a_flag:L*:Gt->GtE": (
        "if change is None or float(change.max()) > tol:", _TOLERANCE_EDGE + " (a Python float made of a float32 "
        "reading below float64, against SHIFT_MOVES' doubles 2e-5, 4e-2 and 0.3, none of which a float32 number "
        "equals: checked as for check_relative_positions' marks; or a float64 reading against 1e-9)"),
    "detectors/runs.py:_needed_declaration:L*:or->and#2": (
        "if not calls or not s.takes_mask or s.convention_by in (\"user\", \"library\") or", _HONOURED_GUARD),
    "detectors/runs.py:_stream_taken:L*:Gt->GtE": (
        "if moved > JOINT:", _TOLERANCE_EDGE + " (`moved`, from _rows_moved, is a float32 quotient made a Python "
        "float; JOINT is the double 1e-3, which no float32 number equals: checked with float(torch.tensor(1e-3, "
        "dtype=torch.float32)) == 1e-3, False)"),
    "detectors/runs.py:_stream_read:L*:Gt->GtE": (
        "return _moved(a, b) > HONOURED", _TOLERANCE_EDGE + " (`_moved`: a float32 quotient made a Python float, "
        "against the double 1e-6)"),
    "detectors/runs.py:_key_convention:L*:LtE->Lt": (
        "<= HONOURED", _TOLERANCE_EDGE + " (float32 quotients against the double 1e-6, on each "
        "line of `blocked`, `kept` and the biased reading)"),
    "detectors/runs.py:_key_convention:L*:Lt->LtE": (
        "HONOURED < kept:", _TOLERANCE_EDGE + " (as `LtE->Lt` there)"),
    "detectors/temperature.py:_unfitted:L*:Lt->LtE": (
        "if rms < RESOLVED * step", _TOLERANCE_EDGE + " (two float readings of different tensors, equal only by an "
        "exact hit; and only a message's clause turns on it)"),
    "detectors/runs.py:_stream_and_mask:L*:Gt->GtE": (
        "elif moved > JOINT:", _TOLERANCE_EDGE + " (as _stream_taken's: a float32 quotient against the double 1e-3)"),
    "detectors/runs.py:_required_input:L*:or->and": (
        "if sig is None or s.call is not None or s.form != \"self_module\"", "`sig is None` holds only for subjects "
        "that are not a ModuleSubject (a function's, nn.MultiheadAttention's), whose form is never \"self_module\", so "
        "the third clause returns for them whatever the first two are joined by (every ModuleSubject is built with a "
        "Signature: _subject.subject_for, both branches)"),
    "detectors/runs.py:_required_input:L*:and->or": (
        "if sig.memory is not None and sig.memory not in sig.fixed", "a memory in sig.fixed is a required one, which "
        "makes the layer a cross_module (_subject), returned on by the guard above; made `or`, a memory of None joins "
        "`left` and `_given` calls the layer with None as a keyword, a TypeError it catches: that stream is skipped, "
        "the same result (two more calls counted in probe.passes); tests/test_pins_all_runs_inputs.py shows the "
        "required memory's verdict"),
    # m37l: masking (the full run at ff5444f, issue 37), checked by hand:
    "detectors/masking.py:_own_query_rows:L*:any->all#2": (
        "~(row & keys).any(-1)), sees=", "`row & keys` is empty in every call: `keys` are the keys the scenario's mask "
        "blocks for every query (padding: ~extra[:, 0]; past-key: `past`, the mask ~past; a layer with queries of its "
        "own has no causal scenario), and `row` is the mask as the layer is given it, that mask and the audit's own; "
        "`any` and `all` of a row of False are both False (checked by hand: a plugin asserting it over the tests of "
        "tests/test_own_queries.py and tests/test_layer_pooling_queries.py, 56 calls, none non-empty)"),
    "detectors/masking.py:_own_query_rows:L*:any->all#3": (
        "sees=per_query((row & keys).any(-1))", "the same as #2 on this line: `row & keys` is empty in every call "
        "(checked by hand, the same run)"),
    "detectors/masking.py:blocked_key_cases:L*:and->or": (
        'also = f" and key {T - 1}, which it blocks,"', "the words name the control case (`when`), which is never "
        "shown: held() quotes the `when` of a case with held rows (the control's hold is empty) or with rows that must "
        "move (it has none), and nothing else reads Case.when (checked by hand: grep of `.when` in diagnostics/)"),
    "detectors/masking.py:blocked_key_cases:L*:drop-not": (
        'also = f" and key {T - 1}, which it blocks,"', "the same as and->or on this line: the control case's words are "
        "never shown (checked by hand)"),
    "detectors/masking.py:crosses:L*:Gt->GtE": ("(change > comparison.tol)", _TOLERANCE_EDGE + " (a relative change "
                                                "against tolerance(UNCHANGED, dtype); in practice: torch compares a "
                                                "float32 change with the tolerance rounded to float32, which a layer "
                                                "built for it could hit, as m37h's masks_future pin does)"),
    "detectors/masking.py:read_as_flag:L*:Gt->GtE": (
        "if float(same.max()) > tol or not float(switched.max()) > tol:", _TOLERANCE_EDGE + " (`same`, a relative "
        "change, float32 below float64, against tolerance(UNCHANGED, dtype))"),
    "detectors/masking.py:read_as_flag:L*:Gt->GtE#2": (
        "if float(same.max()) > tol or not float(switched.max()) > tol:", _TOLERANCE_EDGE + " (`switched`, the same "
        "kind of reading)"),
    # the twelfth session's blocked_keys_absent (2026-12-06), checked by hand: its readings are relative changes
    # (float32, float64 for float64 layers) against ROW_SUM's and UNCHANGED's tolerances
    "detectors/masking.py:check_blocked_keys_absent:L*:Gt->GtE": (
        ("int((change > tol).sum())", "failed = worst > tol", "float(reach.max()) > tol"), _TOLERANCE_EDGE),
    "detectors/masking.py:check_blocked_keys_absent:L*:LtE->Lt": (
        "exact <= tolerance(ROW_SUM, torch.float64)", _TOLERANCE_EDGE + " (the float64 copy's reading)"),
    # m37m: _common.py and _core.py (the full runs at ff5444f, issue 37), checked by hand:
    "detectors/_common.py:not_token_attention:L*:or->and": (
        "if not base.ok or base.record is None:", "equivalent in practice: Probe.call sets a call's record only after "
        "the observed call returned (a layer that raised leaves it None), so a failed standard probe has no record and "
        "the two clauses part only where the probe ran and its record is None: after Probe.release, which the audit "
        "calls once every detector (the only callers: output_variance, own_weights) has run (checked by hand in "
        "_probe.Probe.call and _audit.audit)"),
    "detectors/_common.py:_gradient_probe:L*:and->or": (
        "retain_graph=probe.causal and T >= 2)", "`or` keeps the graph where no second backward reads it (an audit "
        "that is not causal, or T = 1: `_future_gradient` runs only where probe.causal and T >= 2): retain_graph only "
        "decides whether autograd frees the saved tensors after the backward, so the same gradients, verdicts and "
        "passes, more memory held (checked by hand in detectors/gradients.check_gradients, the one reader of "
        "GradientProbe.out's graph). The `>=` on the line is pinned: tests/test_pins_all_common_core.py"),
    "detectors/parameters.py:_called_given_tokens:L*:Gt->GtE": (
        "t.shape[1] == 0 and t.shape[0] > 0", "`t.shape[0] >= 0`: a tensor of batch 0 is never handed to the layer (the "
        "audit's probes have B >= 1), so no empty stream is filled that the guard left alone"),
    "detectors/runs.py:_tuple_only:L*:Gt->GtE": (
        "if moved is None or moved > JOINT:", "an edge: a memory's rows move by exactly 0 with another query and joint "
        "attention's by 0.5 of the RMS or more (JOINT's measurements), never by JOINT itself"),
    "detectors/shape.py:check_output_shape:L*:Gt->GtE": (
        "if not s.own_queries and heads > 1 and all(len(got) == len(want) and got[:-1] == want[:-1]",
        "`heads >= 1`: with one head, an output 1 x the width and of the expected rows is the expected shape, which is "
        "never among the wrong ones this reads"),
    "detectors/runs.py:_rows_moved:L*:or->and": (
        "if a is None or b is None:", "a and b are the same layer's outputs on the same memory, one query token "
        "changed: `_rows` reads both as rows or neither (their shapes are the same)"),
    "detectors/shape.py:_heads_apart:L*:and->or": (
        'undeclared = undeclared_convention(probe) if s.mask_names and s.convention_by == "default" else None',
        "undeclared_convention itself returns None for a layer that takes no mask or whose convention is not the "
        "audit's default, the cases the guard leaves out"),
    "detectors/_heads_out.py:heads_seen:L*:or->and": ("out[0].numel() != T * width:", _PER_HEAD_PRECHECK),
    "detectors/_heads_out.py:heads_seen:L*:or->and#2": ("out[0].numel() != T * width:", _PER_HEAD_PRECHECK),
    "detectors/_heads_out.py:heads_seen:L*:or->and#3": ("out[0].numel() != T * width:", _PER_HEAD_PRECHECK),
    "_core.py:compared:L*:or->and": (
        "scale = baseline_scale(chunks[0], centred=True) or None", "`and None` makes the scale always None, and "
        "relative_change then measures it itself, per case, with the same function on the same baseline: "
        "baseline_scale(old, new, centred=True), which is baseline_scale(chunks[0], centred=True) wherever that is "
        "non-zero, and the case output's own scale where it is zero, as `or None` gave (None) there too; the same "
        "numbers, one measurement per case instead of one (checked by hand in _core.relative_change)"),
    # keys_matter for one stream (2026-12-06, fifteenth session)
    "detectors/keys.py:_read_through:L*:or->and": (
        "rms = float(found.values.float().pow(2).mean().sqrt()) or 1.0", "how far token 0's values move (the values' "
        "RMS, or 1 where it is 0): a row that reads another value moves by any size, one that reads none by exactly 0 "
        "at every size (VALUE_GAIN x10 and x0.1 move no verdict)"),
    "detectors/keys.py:_read_through:L*:x10": (
        "rms = float(found.values.float().pow(2).mean().sqrt()) or 1.0", "the move's size where the values' RMS is 0: "
        "a value projection is found only where doubling its output doubles a non-zero one, so it is never 0"),
    "detectors/keys.py:_read_through:L*:x0.1": (
        "rms = float(found.values.float().pow(2).mean().sqrt()) or 1.0", "as x10: never reached"),
    "detectors/keys.py:_judge_values:L*:guard-never": (
        "if change is None:", "relative_change is None only where both outputs are zero or non-finite everywhere, "
        "and a value projection is found only where doubling its output doubles a finite, non-zero one"),
    "detectors/keys.py:_judge_values:L*:LtE->Lt": (
        "if worst <= tol:", "a row that reads no other value moves by exactly 0, one that reads them by orders above "
        "the tolerance: worst == tol is met by neither"),
    "detectors/keys.py:_judge_values:L*:Gt->GtE": (
        'f"alone moved {int((rows > tol).sum())} of the {others}", value=worst,', "the count the message gives "
        "(words only)"),
    "detectors/keys.py:_judge_values:L*:Gt->Lt": (
        'f"alone moved {int((rows > tol).sum())} of the {others}", value=worst,', "the count the message gives "
        "(words only)"),
    "detectors/positions.py:check_relative_positions:L*:Gt->Lt": (
        "if period > 1:", "words the evidence only (the shift itself is chosen above)"),
    "detectors/variance.py:_judged_at_branches:L*:x10": (
        "unit = v.square().mean((-2, -1), keepdim=True).sqrt().clamp_min(1e-30)", "evidence only: the branches' "
        "excess is said, not judged (even weights on identical tokens: convex by construction)"),
    "detectors/variance.py:_judged_at_branches:L*:x0.1": (
        "unit = v.square().mean((-2, -1), keepdim=True).sqrt().clamp_min(1e-30)", "evidence only, as x10"),
    "detectors/variance.py:check_output_variance:L*:Lt->LtE": (
        "if ref.dim() == 3 and 1 < ref.shape[1] < got.shape[1]:", "`1 <= ref.shape[1]`: a one-token reference "
        "sliced to its first row is itself"),
}

SWAPS = {  # ast operator -> the mutants made of it
    ast.Gt: (ast.GtE, ast.Lt), ast.GtE: (ast.Gt, ast.LtE), ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE),
    ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
}
SYMBOL = {ast.Gt: ">", ast.GtE: ">=", ast.Lt: "<", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!="}
OPERATOR = re.compile(rb">=|<=|==|!=|>|<")
SKIP_MAKERS = ("skip", "not_run")


@dataclass
class Mutant:
    id: str
    file: str
    function: str
    line: int
    kind: str  # compare | boolop | not | anyall | constant | guard | verdict
    mutation: str
    code: str  # the line it changes, as written
    threshold: bool = False  # a module-level constant (always in the sample)
    start: int = field(default=0, repr=False)  # byte offsets of the replaced span in the file
    end: int = field(default=0, repr=False)
    replacement: str = field(default="", repr=False)


KILLED = ("killed", "error")
"""The outcomes that count as kills: the tests failed, or could not be collected. A timeout is undecided."""


@dataclass
class Outcome:
    id: str
    status: str  # killed | survived | error | timeout
    seconds: float
    detail: str = ""  # the first failing test, or the error


# ---- enumerating mutants ---------------------------------------------------------------------------


class _Source:
    """A file's text with (line, col) -> byte offset; ast's col_offset counts UTF-8 bytes."""

    def __init__(self, data: bytes):
        self.data = data
        self.lines = self.data.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def line(self, n: int) -> str:
        return self.lines[n - 1].decode().rstrip("\n")


def _constants(node: ast.AST):
    """The numbers of a constant's value (a number, or a dict / tuple of them), not its keys."""
    if isinstance(node, ast.Dict):
        for v in node.values:
            yield from _constants(v)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for v in node.elts:
            yield from _constants(v)
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        yield node


KNOB = re.compile(r"#\s*knob:\s*(.+)$")
"""The comment that marks a module constant as a knob, not a threshold (see the docstring): `# knob: <why>`."""


def knob(src: _Source, top: ast.stmt) -> str | None:
    """The reason a module constant's assignment gives for being a knob (its first line's `# knob:` comment), or
    None."""
    found = KNOB.search(src.line(top.lineno))
    return found.group(1).strip() if found else None


def _targets(tree: ast.Module, src: _Source, knobs: bool = False):
    """(enclosing function or constant name, node, is a module constant) for every node the mutators look at;
    `knobs`: the constants marked `# knob:` too."""
    for top in tree.body:
        if isinstance(top, (ast.Assign, ast.AnnAssign)):
            names = [t.id for t in (top.targets if isinstance(top, ast.Assign) else [top.target])
                     if isinstance(t, ast.Name)]
            if not knobs and knob(src, top) is not None:
                continue
            if names and names[0].isupper() and not MEASURED.match(names[0]) and top.value is not None:
                for node in _constants(top.value):
                    yield names[0], node, names[0] not in SIZES
            continue
        functions = []
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions = [top]
        elif isinstance(top, ast.ClassDef):
            functions = [f for f in top.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn in functions:
            if NOT_VERDICT.search(fn.name) or (isinstance(top, ast.ClassDef) and NOT_VERDICT.search(top.name)):
                continue
            for node in ast.walk(fn):
                yield fn.name, node, False


def _scaled(value, factor: int):
    if isinstance(value, int):
        return value * 10 if factor > 0 else value // 10
    return value * 10 if factor > 0 else value * 0.1


def _returns_skip(body: list[ast.stmt]) -> bool:
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return False
    call = body[0].value
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    if name in SKIP_MAKERS:
        return True
    return name == "DetectorResult" and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant) \
        and call.args[1].value == "skip"


def knobs_of(filename: str) -> list[tuple[str, str]]:
    """[(constant, why)] for the module constants of `filename` marked `# knob:`."""
    src = _Source(_committed(f"{PACKAGE}/{filename}"))
    found = []
    for top in ast.parse(src.data, filename=filename).body:
        if isinstance(top, (ast.Assign, ast.AnnAssign)) and (why := knob(src, top)) is not None:
            target = top.targets[0] if isinstance(top, ast.Assign) else top.target
            found.append((getattr(target, "id", "?"), why))
    return found


def mutants_of(filename: str, knobs: bool = False) -> list[Mutant]:
    src = _Source(_committed(f"{PACKAGE}/{filename}"))
    tree = ast.parse(src.data, filename=filename)
    found = []  # (start, order, function, kind, mutation, end, replacement, threshold)

    def add(function, order, kind, mutation, start, end, replacement, threshold=False):
        found.append((start, order, function, kind, mutation, end, replacement, threshold))

    for function, node, module_constant in _targets(tree, src, knobs):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float) and not isinstance(node.value, bool):
            if not module_constant and function not in SIZES and (type(node.value) is not float or node.value == 0.0):
                continue  # in code: float literals only (ints are indices, sizes and dims)
            start, end = src.span(node)
            for order, (factor, word) in enumerate(((1, "x10"), (-1, "x0.1"))):
                new = _scaled(node.value, factor)
                if new != node.value:
                    add(function, order, "constant", word, start, end, f"{new:.6g}" if isinstance(new, float)
                        else str(new), module_constant)
        elif isinstance(node, ast.Compare):
            left = node.left
            for i, (op, right) in enumerate(zip(node.ops, node.comparators)):
                if type(op) in SWAPS:
                    lo = src.offset(left.end_lineno, left.end_col_offset)
                    hi = src.offset(right.lineno, right.col_offset)
                    m = OPERATOR.search(src.data, lo, hi)
                    if m is None or m.group().decode() != SYMBOL[type(op)]:
                        raise RuntimeError(f"{filename}:{node.lineno}: operator {SYMBOL[type(op)]} not found")
                    for order, new in enumerate(SWAPS[type(op)]):
                        add(function, 10 * i + order, "compare", f"{type(op).__name__}->{new.__name__}", m.start(),
                            m.end(), SYMBOL[new])
                left = right
        elif isinstance(node, ast.BoolOp):
            word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            for a, b in zip(node.values, node.values[1:]):
                lo = src.offset(a.end_lineno, a.end_col_offset)
                hi = src.offset(b.lineno, b.col_offset)
                m = re.compile(rb"\b" + word.encode() + rb"\b").search(src.data, lo, hi)
                if m is not None:
                    add(function, 0, "boolop", f"{word}->{other}", m.start(), m.end(), other)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert)):
            start = src.offset(node.lineno, node.col_offset)
            end = src.offset(node.operand.lineno, node.operand.col_offset)
            word = "not" if isinstance(node.op, ast.Not) else "~"
            kept = src.data[start + len(word):end].decode()  # a parenthesis before the operand stays
            add(function, 0, "not", f"drop-{word}", start, end, kept)
        elif isinstance(node, ast.If) and _returns_skip(node.body):
            start, end = src.span(node.test)
            lines = src.data.count(b"\n", start, end)
            add(function, 0, "guard", "guard-never", start, end, "(False" + "\n" * lines + ")")
        elif isinstance(node, ast.Constant) and node.value == "fail":
            start, end = src.span(node)
            add(function, 0, "verdict", "fail->pass", start, end, '"pass"')
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("any", "all"):
                end = src.offset(func.end_lineno, func.end_col_offset)
                start = end - len(func.attr)
            elif isinstance(func, ast.Name) and func.id in ("any", "all"):
                start, end = src.span(func)
            else:
                continue
            name = src.data[start:end].decode()
            add(function, 0, "anyall", f"{name}->{'all' if name == 'any' else 'any'}", start, end,
                "all" if name == "any" else "any")

    found.sort(key=lambda f: (f[0], f[1]))  # by position in the file, then by mutator
    out, seen = [], defaultdict(int)
    for start, _, function, kind, mutation, end, replacement, threshold in found:
        line = src.data.count(b"\n", 0, start) + 1
        base = f"{filename}:{function}:L{line}:{mutation}"
        seen[base] += 1
        mid = base if seen[base] == 1 else f"{base}#{seen[base]}"
        out.append(Mutant(mid, filename, function, line, kind, mutation, src.line(line).strip(), threshold, start, end,
                          replacement))
    return out


def all_mutants(knobs: bool = False) -> list[Mutant]:
    return [m for f in FILES for m in mutants_of(f, knobs)]


def sample(mutants: list[Mutant], per_module: int, seed: int = SEED) -> list[Mutant]:
    """Every module-constant mutant, plus `per_module` of each module's others (seeded per module)."""
    by_file = defaultdict(list)
    for m in mutants:
        by_file[m.file].append(m)
    chosen = []
    for f, ms in by_file.items():
        rest = sorted((m for m in ms if not m.threshold), key=lambda m: m.id)
        picked = set(id(m) for m in random.Random(f"{seed}:{f}").sample(rest, min(per_module, len(rest))))
        chosen += [m for m in ms if m.threshold or id(m) in picked]
    return chosen


def mutated_source(m: Mutant) -> bytes:
    data = _committed(f"{PACKAGE}/{m.file}")
    new = data[:m.start] + m.replacement.encode() + data[m.end:]
    compile(new, m.file, "exec")  # a mutant must be valid Python: the mutators only swap tokens
    if new.count(b"\n") != data.count(b"\n"):
        raise RuntimeError(f"{m.id}: the mutant moved lines")
    return new


# ---- which tests run against a mutant ----------------------------------------------------------------


def _code_spans(tree: ast.Module) -> list[tuple[str, int, int, ast.AST]]:
    """(name, first line, last line, node) of every top-level function and method: the first line is the first
    decorator's, as the code object's co_firstlineno is; the functions nested in one lie within its lines."""
    spans = []
    for top in tree.body:
        for fn in ([top] if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                   [f for f in top.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
                   if isinstance(top, ast.ClassDef) else []):
            first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            spans.append((fn.name, first, fn.end_lineno, fn))
    return spans


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


class Reach:
    """Where a mutant's change can be seen: the functions whose code it changes or that read the constant it
    changes, as (file under the package, first line, last line). Read from the committed tree."""

    def __init__(self):
        self.trees = {f: ast.parse(_committed(f"{PACKAGE}/{f}"), filename=f) for f in _package_files()}
        self.spans = {f: _code_spans(t) for f, t in self.trees.items()}

    def of(self, m: Mutant) -> tuple[tuple[str, int, int], ...]:
        if not m.threshold and not m.function.isupper():
            return tuple((m.file, lo, hi) for _, lo, hi, _ in self.spans[m.file] if lo <= m.line <= hi)
        names = {m.function}  # a module constant: every function that reads it, or a constant made of it
        while True:
            more = {t.id for tree in self.trees.values() for top in tree.body if isinstance(top, (ast.Assign,
                    ast.AnnAssign)) and top.value is not None and _names(top.value) & names
                    for t in (top.targets if isinstance(top, ast.Assign) else [top.target]) if isinstance(t, ast.Name)}
            if more <= names:
                break
            names |= more
        return tuple((f, lo, hi) for f, spans in self.spans.items() for _, lo, hi, fn in spans if _names(fn) & names)


def _package_files() -> list[str]:
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", REVISION, f"{PACKAGE}/"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [p[len(PACKAGE) + 1:] for p in listed if p.endswith(".py")]


@dataclass
class Calls:
    """The default suite's map (one run of it with CALLS_PLUGIN): for each test that passed, its seconds and the
    package's functions it entered, {file: first lines}; a wider fixture's calls counted for every test using it."""
    seconds: dict[str, float]
    entered: dict[str, dict[str, frozenset[int]]]

    @classmethod
    def merged(cls, rows: dict[str, dict]) -> "Calls":
        shared = defaultdict(set)
        for row in rows.values():
            for key in row["shared"]:
                shared[key].update(map(tuple, row["setup"]))
        seconds, entered = {}, {}
        for nodeid, row in rows.items():
            if not row["passed"]:
                continue
            calls = set(map(tuple, row["own"])) | set(map(tuple, row["setup"]))
            for key in row["shared"]:
                calls |= shared[key]
            by_file = defaultdict(set)
            for f, line in calls:
                by_file[f].add(line)
            seconds[nodeid] = row["seconds"]
            entered[nodeid] = {f: frozenset(lines) for f, lines in by_file.items()}
        return cls(seconds, entered)

    def tests(self, reach: tuple[tuple[str, int, int], ...]) -> list[str]:
        """The tests that entered any of `reach`'s functions (or a function nested in one), in the suite's order."""
        return [t for t, files in self.entered.items()
                if any(lo <= line <= hi for f, lo, hi in reach for line in files.get(f, ()))]


def call_map(copy: Path, commit: str, log) -> Calls:
    """The default suite (README's `pytest`, a worker per core) run once in the unmutated copy with CALLS_PLUGIN,
    kept per commit in the temp dir (the same commit gives the same map); every test it names must pass there."""
    cache = Path(tempfile.gettempdir()) / f"mutation-calls-{commit[:12]}.json"
    if cache.exists():
        rows = json.loads(cache.read_text())
        log(f"the default suite's map of calls at this commit: {cache} ({len(rows)} tests)")
        return Calls.merged(rows)
    folder = Path(tempfile.mkdtemp(prefix="mutation-calls-"))
    plugin = copy / "mutation_calls.py"
    plugin.write_bytes(_committed(CALLS_PLUGIN))
    env = dict(PYTEST_PLUGINS="mutation_calls", MUTATION_CALLS=str(folder))
    try:
        log("mapping which package functions each test of the default suite enters (one run of it) ...")
        rc, out, seconds = _run(copy, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], 3600, env)
        if rc != 0:
            sys.exit(f"the unmutated default suite does not pass in {copy} (rc={rc}); fix it first\n{out[-3000:]}")
        rows = {}
        for part in folder.glob("calls-*.json"):  # a pytest run by a test in a subprocess wrote its own: not ours
            rows.update((t, row) for t, row in json.loads(part.read_text()).items() if t.startswith("tests/"))
    finally:
        plugin.unlink()
        shutil.rmtree(folder, ignore_errors=True)
    calls = Calls.merged(rows)
    rc, out, _ = _run(copy, command(list(calls.seconds), collect_only=True), 900)
    if rc != 0:
        sys.exit(f"the map's node ids do not collect in {copy} (rc={rc})\n{out[-3000:]}")
    cache.write_text(json.dumps(rows))
    log(f"mapped in {seconds:.0f} s: {len(calls.seconds)} passing tests (of {len(rows)}), kept in {cache}")
    return calls


# ---- running them ----------------------------------------------------------------------------------


CANARY = '''
import os, sys
import diagnostics, diagnostics._core, diagnostics._thresholds, diagnostics.detectors, diagnostics.model


def test_the_copy_is_what_is_imported():
    root = os.path.realpath(os.environ["MUTATION_COPY"])
    for name, mod in list(sys.modules.items()):
        if name == "diagnostics" or name.startswith("diagnostics."):
            assert os.path.realpath(mod.__file__).startswith(root + os.sep), mod.__file__
'''


def _environment(copy: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH", "PYTEST_PLUGINS")}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", CI="1", HYPOTHESIS_PROFILE="default",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MUTATION_COPY=str(copy), **(extra or {}))
    return env


def make_copy(parent: Path, n: int) -> Path:
    """The committed tree (REVISION), all of it (the default suite reads the README, docs/, examples/, benchmarks/,
    .ci/run), unpacked with `git archive` into a fresh folder."""
    copy = parent / f"job{n}"
    copy.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", REVISION], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
    return copy


def command(tests: list[str], collect_only: bool = False) -> list[str]:
    """pytest on `tests` in one process (`-n 0`: the jobs run mutants side by side), stopping at the first failure."""
    return [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-p", "no:randomly",
            *(["--collect-only"] if collect_only else []), *tests]


def _run(copy: Path, cmd: list[str], timeout: float, extra: dict[str, str] | None = None
         ) -> tuple[int | None, str, float]:
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=_environment(copy, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), time.monotonic() - began
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the pytest this function started, and nothing else
        out, _ = proc.communicate()
        return None, out.decode(errors="replace"), time.monotonic() - began


def check_copy(copy: Path, selections: list[tuple[str, ...]], log) -> dict[tuple[str, ...], float]:
    """The canary (the copy is what pytest imports), then each unmutated test selection must pass; their times."""
    canary = copy / "tests" / "test_mutation_canary.py"
    canary.write_text(CANARY)
    try:
        rc, out, _ = _run(copy, command([str(canary)]), 600)
    finally:
        canary.unlink()
    if rc != 0:
        sys.exit(f"the canary failed: pytest in {copy} does not import the copy of {PACKAGE}\n{out[-3000:]}")
    times = {}
    for tests in selections:
        rc, out, seconds = _run(copy, command(list(tests)), 900)
        if rc != 0:
            sys.exit(f"the unmutated tests {' '.join(tests)} do not pass in {copy} (rc={rc}); fix them first\n"
                     f"{out[-3000:]}")
        times[tests] = seconds
        log(f"unmutated: {' '.join(tests)} pass in {seconds:.1f} s")
    return times


def classify(rc: int | None, out: str) -> tuple[str, str]:
    if rc is None:
        return "timeout", ""
    if rc == 0:
        return "survived", ""
    if rc != 1 or "errors during collection" in out or "ImportError while" in out:
        lines = [ln for ln in out.splitlines() if "Error" in ln]
        return "error", (lines[-1].strip() if lines else f"pytest exit code {rc}")[:300]
    failed = re.search(r"^FAILED (\S+)", out, re.M)
    return "killed", failed.group(1) if failed else "tests failed"


def read_journal(path: Path | None, commit: str) -> dict[str, Outcome]:
    """The outcomes a journal holds for this commit and each mutant's test selection as it is now: a run of thousands
    of mutants (`--all`) taken up where it stopped, in another process or another day, still one commit's figure. A
    line of another commit or selection is not reused (the code or the tests it measured are not these)."""
    if path is None or not path.exists():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["commit"] == commit and tuple(row["tests"]) == tuple(tests_for(row["file"])):
            found[row["id"]] = Outcome(row["id"], row["status"], row["seconds"], row["detail"])
    return found


def run_mutants(mutants: list[Mutant], jobs: int, timeout: float | None, log, journal: Path | None = None,
                commit: str = "") -> list[Outcome]:
    """Each mutant's tests in one of `jobs` copies of the tree; with a `journal` (JSON lines), the outcomes it holds
    for this commit are taken as they are and each new one is appended as soon as it is decided."""
    done = read_journal(journal, commit)
    if done:
        log(f"{sum(m.id in done for m in mutants)} of the {len(mutants)} mutants decided at this commit already "
            f"(journal {journal}): not run again")
    results: dict[str, Outcome] = {m.id: done[m.id] for m in mutants if m.id in done}
    mutants_left = [m for m in mutants if m.id not in done]
    if not mutants_left:
        return [results[m.id] for m in mutants]
    ran = _run_mutants(mutants_left, jobs, timeout, log, results, journal, commit, len(mutants))
    return [ran[m.id] for m in mutants]


def _run_mutants(mutants: list[Mutant], jobs: int, timeout: float | None, log, results: dict[str, Outcome],
                 journal: Path | None, commit: str, total: int) -> dict[str, Outcome]:
    sources = {m.id: mutated_source(m) for m in mutants}  # all of them valid before anything runs
    parent = Path(tempfile.mkdtemp(prefix="mutations-"))
    try:
        copies = [make_copy(parent, n) for n in range(jobs)]
        if TESTS:
            times = check_copy(copies[0], [tuple(TESTS)], log)
            selected = {m.id: list(TESTS) for m in mutants}
            limits = {m.id: timeout or max(60.0, 3 * times[tuple(TESTS)]) for m in mutants}
        else:
            check_copy(copies[0], [], log)
            calls, reach = call_map(copies[0], commit, log), Reach()
            selected = {m.id: calls.tests(reach.of(m)) for m in mutants}
            limits = {m.id: timeout or max(60.0, 3 * sum(calls.seconds[t] for t in selected[m.id]) + 30)
                      for m in mutants}
            log(f"tests per mutant: median {sorted(map(len, selected.values()))[len(selected) // 2]}, "
                f"none for {sum(not t for t in selected.values())} (of {len(selected)})")
        log(f"{len(mutants)} mutants, {jobs} job(s)")
        killers = Counter(o.detail for o in results.values() if o.status == "killed")
        cost = calls.seconds if not TESTS else {}

        def first_the_killers(tests: list[str]) -> list[str]:
            """The files whose tests killed most mutants so far first, then the quickest files: `-x` stops at the
            first failure, so a mutant that will be killed is killed sooner (a survivor runs them all whatever the
            order). A file's tests stay together and in their order, so its module fixtures are made once and no
            test runs before one it followed in the suite."""
            files = defaultdict(list)
            for t in tests:
                files[t.split("::")[0]].append(t)
            ranked = sorted(files.values(), key=lambda ts: (-sum(killers[t] for t in ts), sum(cost.get(t, 0.0)
                                                                                               for t in ts)))
            return [t for ts in ranked for t in ts]

        todo: queue.Queue = queue.Queue()
        for m in mutants:
            todo.put(m)
        lock = threading.Lock()

        def worker(copy: Path):
            while True:
                try:
                    m = todo.get_nowait()
                except queue.Empty:
                    return
                if selected[m.id]:
                    target = copy / PACKAGE / m.file
                    original = target.read_bytes()
                    target.write_bytes(sources[m.id])
                    try:
                        rc, out, seconds = _run(copy, command(first_the_killers(selected[m.id])), limits[m.id])
                        if rc == 4 and "not found:" in out:
                            # a test parametrized by what the mutant changed has other ids now: no failure, so run
                            # the files of the tests that enter its code, whose ids are made afresh
                            files = list(dict.fromkeys(t.split("::")[0] for t in selected[m.id]))
                            rc, out, more = _run(copy, command(files), 3 * limits[m.id])
                            seconds += more
                    finally:
                        target.write_bytes(original)
                    status, detail = classify(rc, out)
                else:  # nothing the default suite runs enters the code it changes: no test can notice it
                    status, detail, seconds = "survived", "no test enters the code it changes", 0.0
                with lock:
                    results[m.id] = Outcome(m.id, status, round(seconds, 1), detail)
                    killers[detail] += status == "killed"
                    if journal is not None:
                        with journal.open("a") as f:
                            f.write(json.dumps(dict(commit=commit, file=m.file, tests=tests_for(m.file),
                                                    **asdict(results[m.id]))) + "\n")
                    log(f"[{len(results)}/{total}] {status:8s} {seconds:5.1f}s {m.id}  {detail}")

        threads = [threading.Thread(target=worker, args=(c,)) for c in copies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results
    finally:
        shutil.rmtree(parent, ignore_errors=True)


# ---- the report ------------------------------------------------------------------------------------


def _unlined(mutant_id: str) -> str:
    return re.sub(r":L\d+:", ":L*:", mutant_id)


def equivalents(mutants: list[Mutant]) -> dict[str, str]:
    """{mutant id: reason} for the mutants EQUIVALENT marks whose line holds the mark's text. A mark names a mutant
    without its line number, so the same mutation on several lines of a function shares it: the text picks the line.
    A stale mark is found among every mutant (`unmatched_marks`, warned at the start of every run), not among those
    run: a sample may hold the same mutation on another line of the function only (seed 777 held
    `honoured_conventions`' `or` of its first guard, not the marked one of its `V = K if ...`), which is no sign
    that the mark went stale."""
    marked = {}
    for m in mutants:
        mark = EQUIVALENT.get(_unlined(m.id))
        if mark is not None and any(text in m.code for text in _texts(_unlined(m.id))):
            marked[m.id] = mark[1]
    return marked


def _texts(key: str) -> tuple[str, ...]:
    text = EQUIVALENT[key][0]
    return (text,) if isinstance(text, str) else text


def unmatched_marks(mutants: list[Mutant]) -> list[str]:
    """The EQUIVALENT marks that name no mutant of `mutants` (every mutant: a misnamed mark, e.g. a `#2` for a
    mutation on another line, would otherwise never match and never warn), or match none by their texts."""
    return sorted(key for key in EQUIVALENT
                  if not any(_unlined(m.id) == key and any(t in m.code for t in _texts(key)) for m in mutants))


def report(mutants: list[Mutant], outcomes: list[Outcome], marked: dict[str, str]) -> tuple[str, dict]:
    status = {o.id: o.status for o in outcomes}
    rows = defaultdict(lambda: [0, 0, 0, 0])
    for m in mutants:
        row = rows[m.file]
        row[1] += 1
        row[0] += status[m.id] in KILLED
        row[2] += status[m.id] == "survived" and m.id in marked
        row[3] += status[m.id] == "timeout"
    lines = [f"{'module':28s} killed / non-equivalent decided (equivalent, timed out)"]
    for f, (k, t, e, o) in rows.items():
        lines.append(f"{f:28s} {k:3d} / {t - e - o:3d}" + (f"  ({e} equivalent)" if e else "")
                     + (f"  ({o} timed out)" if o else ""))
    by_id = {m.id: m for m in mutants}
    survivors = [o for o in outcomes if o.status == "survived"]
    lines.append("")
    lines.append(f"survivors ({len(survivors)}):")
    for o in survivors:
        m = by_id[o.id]
        note = f"  [equivalent: {marked[o.id]}]" if o.id in marked else ""
        lines.append(f"  {o.id}{note}\n      {m.code}")
    errors = [o for o in outcomes if o.status == "error"]
    if errors:
        lines.append("error (counted as killed: the tests could not run): " + ", ".join(o.id for o in errors))
    timeouts = [o for o in outcomes if o.status == "timeout"]
    if timeouts:
        lines.append(f"timeout ({len(timeouts)}, undecided: not in the score; rerun with --survivors-of and a longer "
                     "--timeout):" + "".join(f"\n  {o.id}\n      {by_id[o.id].code}" for o in timeouts))
    killed = sum(o.status in KILLED for o in outcomes)
    total = len(outcomes)
    equivalent = sum(1 for o in survivors if o.id in marked)
    counted = total - equivalent - len(timeouts)
    score = killed / counted if counted else float("nan")
    kinds = Counter(by_id[o.id].kind for o in outcomes)
    lines.append("")
    lines.append("by kind: " + ", ".join(
        f"{k} {sum(1 for o in outcomes if by_id[o.id].kind == k and o.status in KILLED)}/{n}"
        for k, n in sorted(kinds.items())))
    lines.append(f"mutation score: {killed} / {counted} non-equivalent decided mutants killed = {100 * score:.1f}%"
                 + (f" ({equivalent} survivors marked equivalent and excluded)" if equivalent else "")
                 + (f"; {len(timeouts)} timed out, not counted (as kills: {killed + len(timeouts)} / "
                    f"{counted + len(timeouts)} = {100 * (killed + len(timeouts)) / (counted + len(timeouts)):.1f}%)"
                    if timeouts else ""))
    summary = dict(killed=killed, total=total, equivalent=sorted(o.id for o in survivors if o.id in marked),
                   timeout=sorted(o.id for o in timeouts),
                   score=score, counts={s: sum(o.status == s for o in outcomes)
                                        for s in ("killed", "error", "timeout", "survived")})
    return "\n".join(lines), summary


def _key(mutant_id: str, code: str) -> str:
    """A mutant named without its line number, with its line's code (without a trailing comment)."""
    return _unlined(mutant_id) + " | " + re.sub(r"\s+#.*$", "", code)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--all", action="store_true", help="every mutant, not the stratified sample")
    parser.add_argument("--per-module", type=int, default=SAMPLE_PER_MODULE,
                        help=f"sampled mutants per module besides its constants (default {SAMPLE_PER_MODULE})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the sample's seed (default {SEED})")
    parser.add_argument("--only", action="append", help="only mutants whose id contains this text (repeatable: any)")
    parser.add_argument("--changed-since", metavar="REV",
                        help="only mutants of the modules whose committed source differs from REV's (git diff REV "
                             "REVISION): a change's own modules, e.g. --changed-since main")
    parser.add_argument("--survivors-of", type=Path, metavar="JSON",
                        help="only the mutants that survived or timed out in this earlier --json output (after "
                             "tests were added)")
    parser.add_argument("--knobs", action="store_true",
                        help="mutate the constants marked `# knob:` too (to check that they change no verdict)")
    parser.add_argument("--tests", nargs="+", metavar="FILE",
                        help="run these test files (or node ids) against every mutant instead of the tests that enter "
                             "its code (while writing a pin: does it kill the mutant?)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x the unmutated run, >= 60)")
    parser.add_argument("--json", type=Path, help="write every outcome and the score to this file")
    parser.add_argument("--journal", type=Path, metavar="JSONL",
                        help="append each outcome to this file as it is decided, and take those it holds for this "
                             "commit instead of running them again: a long run (--all) in pieces, one commit's figure")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")

    if args.tests:
        TESTS[:] = args.tests
    everything = all_mutants(args.knobs)
    for key in unmatched_marks(everything):
        print(f"warning: the EQUIVALENT mark {key} names no mutant whose line holds "
              f"{' or '.join(map(repr, _texts(key)))}: correct it or remove it", flush=True)
    chosen = args.all or args.list or args.survivors_of
    mutants = everything if chosen else sample(everything, args.per_module, args.seed)
    if args.survivors_of:
        earlier = json.loads(args.survivors_of.read_text())
        alive = {_key(m["id"], m["code"]) for m in earlier["mutants"] if m["status"] in ("survived", "timeout")}
        mutants = [m for m in mutants if _key(m.id, m.code) in alive]  # matched by code: lines may have moved
    if args.only:
        mutants = [m for m in mutants if any(text in m.id for text in args.only)]
    if args.changed_since:
        changed = set(_git("diff", "--name-only", args.changed_since, REVISION, "--", PACKAGE).split())
        mutants = [m for m in mutants if f"{PACKAGE}/{m.file}" in changed]
    per_file = Counter(m.file for m in mutants)
    of_file = Counter(m.file for m in everything)
    how = ("every mutant" if (args.all or args.list) else
           f"earlier survivors" if args.survivors_of else
           f"stratified sample: every module-constant mutant plus {args.per_module} others per module, "
           f"random.Random('{args.seed}:<module>')")
    sampled = f"{len(mutants)} of {len(everything)} mutants ({how}): " + ", ".join(
        f"{f} {n}/{of_file[f]}" for f, n in per_file.items())
    if args.list:
        for m in mutants:
            print(f"{m.id}  [{m.kind}{', constant' if m.threshold else ''}]\n    {m.code}")
        print(sampled)
        knobs = [(f, name, why) for f in FILES for name, why in knobs_of(f)]
        print(f"knobs ({len(knobs)}, {'mutated' if args.knobs else 'not mutated: --knobs mutates them'}):"
              + "".join(f"\n  {f}:{name}: {why}" for f, name, why in knobs))
        return 0
    if not mutants:
        parser.error("no mutant matches")

    def log(text: str) -> None:
        print(text, flush=True)

    commit = _git("rev-parse", REVISION)
    log(f"commit {commit} (the committed tree is mutated and tested, not the checkout)")
    log(sampled)
    began = time.monotonic()
    outcomes = run_mutants(mutants, args.jobs, args.timeout, log, args.journal, commit)
    elapsed = time.monotonic() - began
    marked = equivalents(mutants)
    table, summary = report(mutants, outcomes, marked)
    print("\n" + table)
    print(sampled)
    print(f"ran in {elapsed / 60:.1f} min with {args.jobs} job(s); command: python benchmarks/mutations.py"
          + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    if args.json:
        by_id = {m.id: m for m in mutants}
        args.json.write_text(json.dumps(dict(
            commit=commit, tests=tests_for(""), jobs=args.jobs,
            seconds=round(elapsed, 1), sampled=sampled, **summary,
            equivalent_reasons={i: r for i, r in marked.items()},
            mutants=[{**{k: v for k, v in asdict(by_id[o.id]).items() if k not in ("start", "end", "replacement")},
                      **asdict(o)} for o in outcomes]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
