"""`runs`: the layer runs on every input shape the audit uses; its findings point at the user's line in the
exception's traceback."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .._core import NON_CONTIGUOUS, skip, transposed_layout
from .._frames import traceback_frames
from .._masks import SHORTCUTS, convert_mask
from .._probe import Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._subject import (MEMORY_TOKENS, call_declaration, left_streams, spell, stream_call, stream_calls,
                        suggested_conventions)
from .._tracing import (CARRIES, buffer_alone, buffer_behind, init_sources, made_at, op_site, producer, site, text,
                        through_carries, trace_call, user)
from ..adapters import Image
from ._common import length_rule, own_queries_seen, result
from ._heads_out import heads_seen, traced
from ._mask_hints import candidates, convention_hint, conventions_run, honoured_conventions


def runs_sites(probe, result: DetectorResult) -> list[Site]:
    """The user's line in the traceback of the first failed call, replayed on its very inputs: on the layer as the
    report's reader finds it (as it came, after the audit), and where it runs so, as the audit's calls left it (a cache
    made at one length that a call of another refuses: x-transformers 0.28.2's ALiBi bias)."""
    for call in result.replay or ():
        try:
            with torch.no_grad():
                probe.subject(call.query, call.key, call.value, call.allowed)
                if probe.as_left is None:
                    continue
                probe.as_left()
                probe.subject(call.query, call.key, call.value, call.allowed)
        except Exception as error:
            frames = traceback_frames(error.__traceback__)
            if frames:
                fix = exception_fix(error, left_streams(probe.subject), probe.options)
                t = call.query.shape[probe.subject.time_dim]
                short_ran = any(shape.label == "T=1" and not shape.raised for shape in probe.shapes.get("runs", ()))
                # a call as long that ran (the standard probe, without a mask) says the length is not the limit: a
                # mask that broadcasts at T = 1 and not at T is a mask of another shape
                took_t = any(not shape.raised and shape.t_q >= t and shape.t_k >= call.key.shape[probe.subject.time_dim]
                             for shapes in probe.shapes.values() for shape in shapes)
                if short_ran and not took_t and t > 1 and SHAPES.search(str(error)):  # a length it cannot take
                    seq_len = probe.options.get("seq_len", "seq_len=")
                    fix = (f"the layer runs on 1 token but not on {t}: it has a maximum length below {t} (a buffer "
                           f"of fixed size?); audit it at most at its context length ({seq_len}N), or make its "
                           f"buffers follow the input length")
                raised = site(frames, type(error).__name__, str(error).strip().splitlines()[0][:160]
                              if str(error).strip() else "", fix)
                made = (unset_attribute_site(error) if isinstance(error, AttributeError) else
                        state_site(probe, call, error))
                if made is not None and fix.startswith("the layer runs on 1 token"):  # a buffer of fixed length
                    made = replace(made, fix=fix)
                return [made, raised] if made is not None else [raised]
    return []


def state_site(probe, call, error: BaseException) -> Site | None:
    """Where the layer made the parameter or buffer that an op raised on, beside the call's own tensors: the op that
    raised (torch.cat of memory keys and the call's keys) was given a tensor computed from the layer's state alone,
    whose shape was fixed where `__init__` made it (x-transformers 1.27.7 makes `mem_k` with `heads` heads where its
    keys have `kv_heads`), and one computed from the probe's inputs. The line that made it comes first, the op that
    raised second; None where the op was given no such pair (or the line is not found)."""
    layer = getattr(probe.subject, "layer", None)
    if not isinstance(error, RuntimeError) or not isinstance(layer, torch.nn.Module):
        return None
    trace = trace_call(probe.subject, call.query, call.key, call.value, call.allowed, seed=probe.seed)
    if type(trace.error) is not type(error) or str(trace.error) != str(error):  # not the same failure
        return None
    if not any(trace.sources.get(i) or i in trace.inputs for i in trace.failed_ins):
        return None  # nothing the call gave reached that op: the layer's state disagrees with itself
    for i in trace.failed_ins:
        name = buffer_alone(trace, i)
        if not name:
            continue
        attribute = name.rpartition(".")[2]
        computed = through_carries(trace, producer(trace, i))
        if computed is not None and computed.short not in CARRIES and user(computed):
            # computed in the call from the layer's state alone (a bias built from its slopes): where it is computed
            return op_site(computed, f"makes the tensor the op that raised was given, from self.{attribute} alone "
                                     f"(no tensor of the call), beside tensors of the call",
                           fix="make this tensor with the sizes the call's tensors have where it raised (the error "
                               "says which dimension disagrees)")
        made = made_at(layer, name)
        if not made:
            return None
        file, line, function = made[0]  # where its value was computed (a local written into it), else the write
        state = dict(layer.named_parameters())
        shape = tuple((state.get(name) if name in state else layer.get_buffer(name)).shape)
        kind = "parameter" if name in state else "buffer"
        return Site(file, line, function, text(file, line), f"{kind} made",
                    f"self.{attribute}, of shape {shape}: the op that raised was given a tensor computed from it "
                    f"alone, beside tensors of the call",
                    fix=f"make self.{attribute} with the sizes the call's tensors have where it raised (the error "
                        f"says which dimension disagrees)")
    return _constant_site(trace)


def _constant_site(trace) -> Site | None:
    """The op that raised was given, beside tensors of the call, one the call built from sizes and constants alone
    (no input and no parameter or buffer reaches it: a causal bias, a position table) on another line than the one
    that raised (a helper that returns it): the line that built it, whose shape is the likely mistake (a (Tq, Tq)
    bias where the scores are (Tq, Tk)). None where there is no such tensor."""
    raised = traceback_frames(trace.error.__traceback__)[:1] if trace.error is not None else ()
    if not raised:
        return None
    for i in trace.failed_ins:
        if trace.sources.get(i) or i in trace.inputs or buffer_behind(trace, i):
            continue
        made = through_carries(trace, producer(trace, i))
        steps = 0
        while made is not None and made.frames[:1] == raised and made.in_ids and steps < 32:  # torch's own steps
            made = through_carries(trace, producer(trace, made.in_ids[0]))
            steps += 1
        if made is None or not user(made) or made.frames[:1] == raised:
            continue
        shape = tuple(made.outs[0].shape) if made.outs and made.outs[0] is not None else "?"
        return op_site(made, f"makes the tensor of shape {shape} that the op that raised was given, from sizes and "
                             f"constants alone (no tensor of the call reaches it), beside tensors of the call",
                       fix="make this tensor with the sizes the call's tensors have where it raised (the error says "
                           "which dimension disagrees)")
    return None


UNSET = re.compile(r"'(\w+)' object has no attribute '(\w+)'")


def unset_attribute_site(error: AttributeError) -> Site | None:
    """Where an attribute the layer reads is left unset: the condition in the class's `__init__` under which alone
    `self.NAME` is assigned (none of its assignments at the top level of `__init__`), read from the source of the
    object whose attribute was missing (the `self` of the innermost frame that raised). None where no such
    condition is found (an attribute never assigned anywhere, or assigned unconditionally)."""
    found = UNSET.search(str(error))
    tb, obj = error.__traceback__, None
    while tb is not None:  # the innermost frame with a `self` of the class the message names
        candidate = tb.tb_frame.f_locals.get("self")
        if found and type(candidate).__name__ == found.group(1):
            obj = candidate
        tb = tb.tb_next
    if not found or obj is None:
        return None
    name = found.group(2)
    for cls, file, start, tree in init_sources(obj):
        guard = _guard_of(tree.body[0].body, name)
        if guard is None:
            continue
        line = start + guard.lineno - 1
        return Site(file, line, f"{cls.__qualname__}.__init__", text(file, line), "attribute set conditionally",
                    f"self.{name} is assigned only under this condition; the call reads it without it",
                    fix=f"set self.{name} (to None, or its default) before this condition, so that every instance "
                        f"has it")
    return None


def _guard_of(body: list, name: str):
    """The outermost compound statement of `body` (an if, for, while, try or with) inside which `self.<name>` is
    assigned, where no statement at this level assigns it; None otherwise."""
    def assigns(node) -> bool:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        return any(isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                   and t.value.id == "self" for t in targets)

    if any(assigns(node) for node in body):
        return None
    for node in body:
        if isinstance(node, (ast.If, ast.For, ast.While, ast.Try, ast.With)) and \
                any(assigns(inner) for inner in ast.walk(node)):
            return node
    return None


MASKY = re.compile(r"mask|must match the size|cannot be broadcast|shape .* is invalid|expand", re.I)
VIEW = re.compile(r"view size is not compatible|use \.reshape\(\.\.\.\) instead|is not contiguous", re.I)
ARGUMENT = re.compile(r"missing \d+ required (positional|keyword)|unexpected keyword argument|got multiple values "
                      r"for argument|takes \d+ positional arguments? but \d+ (was|were) given", re.I)
REQUIRED = re.compile(r"must (?:provide|pass|give|supply)|(?:input|argument) is required|is required but|"
                      r"missing (?:input|argument)", re.I)
SHAPES = re.compile(r"must match the size|size of tensor a \(\d+\) must match|shape .* is invalid|cannot be "
                    r"broadcast|mat1 and mat2 shapes|expected .* shape|The shape of the .*mask", re.I)


def exception_fix(error: BaseException, left: list[str] = (), options: dict | None = None) -> str:
    """The fix named by what the layer raised: a view of non-contiguous memory, a call whose arguments the layer
    does not take (declare how it is called: where forward has a parameter the audit left at None, `left`, the call
    that passes it, self-attention first), a mask of a shape it does not take (declare its convention), or,
    when none of these, no particular fix."""
    text = str(error)
    if VIEW.search(text):
        return ("call .contiguous() before .view(), or use .reshape(): after a transpose the memory is not laid "
                "out as the view needs")
    if isinstance(error, TypeError) and ARGUMENT.search(text) or REQUIRED.search(text):
        if left:
            return (f"the layer is not called the way the audit calls it: it left `{left[0]}` at its default, None; "
                    f"declare how to call it, {stream_calls(left[0], options)}")
        return ("the layer is not called the way the audit calls it: declare how to call it, e.g. call=lambda layer, "
                "x, memory, mask: layer(x, y=memory, mask=mask) (--call MODULE:FUNCTION on the command line), or wrap "
                "it in a function or module that takes (query, key, value, mask) or (x, mask)")
    if "mask" in text.lower() and SHAPES.search(text) or "attn_mask" in text:
        return ("the layer takes its mask in another shape or meaning: declare its convention (mask='blocked', "
                "'additive' or 'key_padding'; --mask on the command line), or wrap the layer to convert the "
                "(B, 1, Tq, Tk) bool mask, True = may attend")
    if SHAPES.search(text):
        return ("make the layer shape-agnostic: read B, T and D from its input (B, T, D = x.shape), not from "
                "constants, and let the query and memory lengths differ")
    return ""


@detector("runs", "runs on every input shape the audit uses: the standard probe, B=1, T=1, H=1 (functions), "
          "non-contiguous inputs, Tq != Tk (cross-attention forms) and a mask (layers that take one)",
          targets=("view after transpose without .contiguous()", "shape assumptions"),
          fix="make the layer run on every input the audit passes: the exception and the line it points at say what "
              "it could not do", locate=runs_sites)
def check_runs(probe: Probe) -> DetectorResult:
    """Its own probes, one per input shape. `audit()` calls `runs_verdict` again once every detector has
    run, so that any other detector's probe that raised is reported here too: no failed call is dropped."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    probe.base()

    def run(label, batch, t_q, t_k=None, extra=None, **kw):
        q, k, v = probe.streams(batch, t_q, t_k, **kw)
        probe.call(q, k, v, probe.allowed(batch, t_q, t_k or t_q, extra), label=label)

    run("B=1", 1, T)
    run("T=1", B, 1)
    if s.form == "function":
        run("H=1", B, T, heads=1)
    # shapes another chosen detector calls anyway are not called twice: their raises reach runs_verdict
    if s.separate_kv and "output_shape" not in probe.chosen:
        run(f"Tq={T}, Tk={T + 3}", B, T, T + 3, cross=True)
    if s.takes_mask and "weight_row_sums" not in probe.chosen:
        run("a padding mask", B, T, extra=probe.padding(B, T, T))
    if "output_variance" not in probe.chosen:  # whose identical tokens are laid out so (their raise reaches us)
        q, k, v = probe.streams(B, T)  # non-contiguous: the same values laid out transposed in memory
        nc = [transposed_layout(x) for x in (q, k, v)]
        nc = [nc[0]] * 3 if q is k else nc
        probe.call(*nc, probe.allowed(B, T, T), label=NON_CONTIGUOUS)
    return runs_verdict(probe)


def runs_verdict(probe: Probe) -> DetectorResult:
    """`runs` judged on every call of the audit so far: its own, and every other detector's that raised. A call
    that raised only because Tq != Tk, on a layer not declared cross-attention, is no failure (see
    `Probe.self_only`): the verdict says those probes were skipped. Where calls with a mask raised, the fix
    adds which mask convention the layer states, suggests or honours (a hint: see `_mask_hints`)."""
    det = "runs"
    own = probe.shapes[det]
    if probe._base is not None and probe._base.not_taken:  # not even the standard probe: nothing the audit can run
        return skip(det, f"not applicable: {probe.not_taken_text()}")
    self_only = f"; {probe.self_only_text()}, so the probes with Tq != Tk were skipped" if probe.self_only else ""
    if probe.not_taken:  # probes the layer as held could not be given (`ProbeNotTaken`): skipped, with the reason
        skipped = [shape.label for shapes in probe.shapes.values() for shape in shapes if shape.not_taken]
        self_only += f"; skipped {len(set(skipped))} probes ({', '.join(dict.fromkeys(skipped))}): {probe.not_taken_text()}"
    if probe.batch_refused:  # a cache of max_batch_size rows: the stacked probes were made a standard batch at a time
        self_only += f"; {probe.batch_refused_text()}"
    failed = _failed(probe.raised)
    n_calls = sum(len(v) for v in probe.shapes.values())
    if failed:
        evidence = f"{_listed(failed)} ({n_calls} calls in all){self_only}"
        needed = (_own_queries_needed(probe, evidence) or _needed_declaration(probe, evidence)
                  or _length_constraint(probe, evidence) or _required_input(probe, evidence))
        if needed is not None:
            return needed
        calls, refused = probe.failed_calls, _refused_lengths(probe)
        if refused:  # the layer's own length rule refused these: skipped, neither counted nor replayed
            calls = [c for c in calls if not any(c is r for r in refused)]
            failed = _failed([raised for raised, c in zip(probe.raised, probe.failed_calls)
                              if any(c is k for k in calls)])
            evidence = f"{_listed(failed)} ({n_calls} calls in all){self_only}{_refused_said(probe, refused)}"
        failed_result = result(det, "fail", f"the layer raised on {len(failed)} of the audit's probes",
                               value=float(len(failed)), threshold=0.0, evidence=evidence, replay=tuple(calls))
        hint = _mask_hint(probe)
        return replace(failed_result, fix=f"{hint}; {failed_result.fix}") if hint else failed_result
    # a shape of runs' list that another detector's probe has (then runs does not call it): named with that probe
    borrowed = next((f"; {NON_CONTIGUOUS} in {d}'s ({shape.label})" for d, shapes in probe.shapes.items()
                     if d != det for shape in shapes if NON_CONTIGUOUS in shape.label and not shape.raised), "")
    return result(det, "pass", f"ran on its {len(own)} shapes ({', '.join(shape.label for shape in own)}) and on "
                                f"every other detector's probe ({n_calls} calls in all{borrowed}){self_only}",
                  value=0.0, threshold=0.0)


def _failed(raised: list) -> list:
    """(detector, shape) of each call that raised, runs' own first, each shape once."""
    return unique([(d, shape) for d, shape in raised if d == "runs"] + [(d, shape) for d, shape in raised if d != "runs"])


def _listed(failed: list) -> str:
    """The calls that raised, one exception raised on many probes quoted once."""
    by_error: dict[str, list[str]] = {}
    for d, shape in failed:
        by_error.setdefault(shape.raised, []).append(f"{shape.label}{'' if d in ('runs', 'base') else f' ({d})'}")
    return "; ".join(f"{labels[0]}: {error}" if len(labels) == 1 else
                     f"raised on {len(labels)} probes: {error} (the probes: {', '.join(labels)})"
                     for error, labels in by_error.items())


def _needed_declaration(probe: Probe, evidence: str) -> DetectorResult | None:
    """A convention mismatch, which is no defect: every call that raised was given a mask (in the convention nobody
    declared: the default or one the layer seemed to state), and given its mask in another convention the layer runs
    and honours it (`honoured_conventions`, whose probe is its own evidence that the layer runs: a causal audit, which
    passes its mask to every call, makes no call without one). Then `runs` is a skip naming the declaration, and the
    audit "needs a declaration" (inconclusive) instead of failing; None otherwise (a call without a mask that raised is
    the layer's own failure)."""
    s = probe.subject
    refused = _refused_lengths(probe)  # lengths the layer's own check refuses (`_length_constraint`): said, not failed
    calls = [c for c in probe.failed_calls if not any(c is r for r in refused)]
    if not calls or not s.takes_mask or s.convention_by in ("user", "library") or \
            any(c.allowed is None for c in calls):
        return None
    found = honoured_conventions(probe)
    given = f"{s.mask_convention} ({s.mask_convention.describe()})"
    lengths = _refused_said(probe, refused)
    if not found and probe.mask_hints.get("given") is None:  # given: it honours the audit's own convention
        return _needed_where_it_runs(probe, evidence, given, lengths, calls)
    if not found:
        return None
    convention, how = found[0]
    declare = spell("mask", str(convention), probe.options)
    return result("runs", "skip", f"needs a declaration, {declare}: the layer raised only where the audit gave it a "
                                  f"mask, as {given}; given its mask as {convention} ({convention.describe()}) it runs "
                                  f"and honours it{lengths}",
                  evidence=f"{evidence}; as {convention}: {how}",
                  fix=f"audit with {declare} if that is the convention the layer takes (its mask's shape and meaning)",
                  declaration=declare, extras={"mask_convention": str(convention)})


def _needed_where_it_runs(probe: Probe, evidence: str, given: str, lengths: str, calls: list) -> DetectorResult | None:
    """`_needed_declaration` where the layer honours its mask in no convention: every call that raised (`calls`, each
    given a mask) runs again given its mask in another convention (of `conventions_run`'s: the first such named, the
    first of each other meaning listed, for the layer's own words to decide). At one token no key can be blocked, so
    honouring is not measured; at two or more, in no convention it runs in do the keys its padding mask blocks leave
    the rows it keeps alone (Sinkhorn's sort net and a summary pooled over padded tokens route by them). Either way the
    mismatch is no defect and what the layer does with its mask is the mask detectors' to judge once it is declared: a
    skip naming the declaration, under which a mask the layer does not honour fails `mask_honoured`. None where no
    convention runs every failed call (a raise the mask does not cause: a function's rotation at H = 1)."""
    if not _runs_every(probe, None, calls):  # without a mask it raises too: its raise is not the mask's
        return None
    ran = [c for c in conventions_run(probe) if _runs_every(probe, c, calls)]
    if not ran:
        return None
    declare = spell("mask", str(ran[0]), probe.options)
    others: list = []  # the first convention of each other meaning it runs in
    for c in ran[1:]:
        if all(c.meaning != o.meaning for o in (ran[0], *others)):
            others.append(c)
    also = f" (it runs in {', '.join(map(str, others))} too)" if others else ""
    if probe.t < 2:
        how, measured = ("At one token no key can be blocked, so whether it honours that mask is not measured: "
                         "audit at seq_len >= 2 to read its convention from what it does"), \
            "it runs (one token: honouring not measurable)"
        fix = f"audit with {declare} if that is the convention the layer takes, at seq_len >= 2 to measure it"
    else:
        how, measured = ("In none of the conventions it runs in did the keys a padding mask blocks leave the rows it "
                         "keeps alone, so its convention cannot be read from what it does: declared, the mask "
                         "detectors judge what it does with its mask"), \
            "it runs, but the keys the padding mask blocks move the rows it keeps (in every convention it runs in)"
        fix = (f"audit with {declare} if that is the convention the layer takes (its mask's shape and meaning); "
               f"mask_honoured then measures where the blocked keys reach the kept rows")
    return result("runs", "skip", f"needs a declaration, {declare}: the layer raised only where the audit gave it a "
                                  f"mask, as {given}; given its mask as {ran[0]} ({ran[0].describe()}) it runs{also}"
                                  f"{lengths}. {how}",
                  evidence=f"{evidence}; as {ran[0]}: {measured}", fix=fix,
                  declaration=declare, extras={"mask_convention": str(ran[0])})


def _runs_every(probe: Probe, convention, calls: list) -> bool:
    """Whether each of `calls` runs again with its mask given in `convention`, or with no mask at all where
    `convention` is None: the mask, not the call's inputs, was what the layer refused (a `view` of non-contiguous
    inputs raises without a mask too, and a convention given one batch row at a time makes them contiguous: its run
    there says nothing of the mask). One call each, stopping at the first that raises."""
    subject = probe.subject if convention is None else probe.subject.with_convention(convention)
    for c in calls:
        probe.passes += 1
        try:
            with torch.no_grad():
                subject(c.query, c.key, c.value, None if convention is None else c.allowed)
        except Exception:  # noqa: BLE001 - still refused in this convention: not the mask's doing
            return False
    return True


def _own_queries_needed(probe: Probe, evidence: str) -> DetectorResult | None:
    """A layer with queries of its own (`own_queries_seen`), undeclared, that raised only where the audit gave it a
    mask: a mask of one row per token, which its Q queries cannot take. Then `runs` is a skip naming `queries=Q`,
    under which its masks are given per key (`own_query_mask`); None otherwise."""
    seen = own_queries_seen(probe)
    if seen is None or not probe.failed_calls or any(c.allowed is None for c in probe.failed_calls):
        return None
    declare = spell("queries", seen, probe.options)
    return result("runs", "skip", f"needs a declaration, {declare}: the layer raised only where the audit gave it a "
                                  f"mask of one row per token, and its output has {seen} row{'s' if seen > 1 else ''} "
                                  f"per sequence at every length: it attends with queries of its own",
                  evidence=evidence, fix=f"audit with {declare}: its masks are then given per key, to its own queries",
                  declaration=declare)


JOINT = 1e-3
"""How far another output row may move, as a fraction of the outputs' RMS, when one query token changes, for the
queries to count as not attended by each other (`_required_input`): a cross-attention's rows are computed apart
and move by 0 (measured: diffusers' IP-Adapter processors and AttnProcessor2_0 given a memory, exactly 0); joint
attention's move by 0.52-0.75 of the RMS (diffusers' JoyImage, PRX and CogVideoX at 32 wide, a unit-normal change of
one token of 16), x500 above this."""


def _required_input(probe: Probe, evidence: str) -> DetectorResult | None:
    """A calling convention the audit cannot choose, which is no defect: a module raised on every probe, each made
    without a stream its forward takes and the audit left at None (`encoder_hidden_states`, `y=None`), and given that
    stream the standard probe's query runs. Then `runs` is a skip naming the input and the declaration that passes
    it. Where the queries are attended together with the stream (joint attention: diffusers' text and image tokens
    concatenated along the sequence, the outputs split back), the stream with no tokens, under which the layer is
    self-attention over x; where the layer attends it apart (its output rows move only with their own query), a
    memory under a memory's name (`cross=True`), and a stream of another name the same stream again (`forward(x,
    y=None)`, "for self attention, x=y"; the fix names the memory's call too). Where given the stream it still
    raises, and runs only when its mask is given too, over the stream's tokens (diffusers' Lumina and Mochi
    processors index a text mask they require), no declaration of the audit's passes both: `runs` is a skip that
    says so, and the audit is inconclusive. None otherwise: a layer that raises with the stream and a mask given too
    still fails."""
    s = probe.subject
    if probe.base().ok or not all(shape.raised for shape in probe.shapes["runs"]) or not probe.failed_calls:
        return None  # the standard probe and every shape of runs' own raised: the layer ran on nothing given
    sig = getattr(s, "sig", None)
    if sig is None or s.call is not None or s.form != "self_module" or not isinstance(s.layer, torch.nn.Module):
        return None
    left = ([sig.memory] if sig.memory is not None and sig.memory not in sig.fixed else []) + left_streams(s)
    call, mask_name = probe.failed_calls[0], s.mask_names[0] if s.mask_names else None
    for name in left:
        # where the query, too, was only forward's first parameter of no known name (Perceiver's forward(image_embeds,
        # latents)), the stream may be the queries: then the first parameter takes the stream
        for swap in (False, True) if name in sig.streams and not sig.by_name else (False,):
            found = _stream_taken(probe, evidence, call, name, mask_name, swap)
            if found is not None:
                return found
    return _stream_unknown(probe, evidence, call, sig.streams[0], mask_name) if sig.streams else None


def _stream_taken(probe: Probe, evidence: str, call, name: str, mask_name: str | None, swap: bool):
    """`_required_input` for one stream the layer left out: the declaration that gives it, a skip that says why
    none is named, or None where given the stream it does not run. `swap`: x goes to `name`, and the stream to the
    query's parameter. A call is named only where what it tells apart was measured: the rows' moving together or
    apart (not at one token), the stream's being read (a layer that ignores it could be a cross-attention whose keys
    and values come from x, which the same stream again would pass), and, for joint attention, the stream with no
    tokens running to finite outputs."""
    s = probe.subject
    sig = s.sig
    stream, x_to = (sig.query, name) if swap else (name, sig.query)
    to = None if sig.first == x_to else x_to  # the parameter x goes to, unless forward's first
    if _given(probe, call.query, stream, x_to=x_to) is None:
        if mask_name is not None and _given(probe, call.query, stream, mask_name, x_to=x_to) is not None:
            return _stream_and_mask(probe, evidence, call, stream, mask_name, x_to, to)
        return None if swap else _tuple_only(probe, evidence, call, stream, mask_name, to)  # a memory of any name
    given = f"given x as `{name}` (its queries) and `{stream}` tokens of their own" if swap else "given it"
    head = (f"the layer raised on every probe, each given without `{name}`, which it requires "
            f"({call.describe_error()}); {given}, it runs")
    calls = stream_calls(stream, probe.options, query=to, mask_name=mask_name)
    moved = _rows_moved(probe, call.query, stream, x_to=x_to)
    if moved is None:
        return result("runs", "skip", f"not measured: {head}, but whether it attends its queries together with "
                                      f"`{stream}` or apart could not be read ({_unread_rows(call.query)}), so no "
                                      f"call is named", evidence=evidence,
                      fix=f"audit at seq_len >= 2, or declare how to call the layer, {calls}")
    if not _stream_read(probe, call.query, stream, x_to):
        return result("runs", "skip", f"not measured: {head}, and its output does not depend on `{stream}` (a change "
                                      f"of every one of its {MEMORY_TOKENS} tokens moved no output): whether "
                                      f"`{stream}` is the same stream again, or a memory the layer leaves unread (keys "
                                      f"and values taken from x, a gate still at 0), cannot be told, so no call is "
                                      f"named", evidence=evidence,
                      fix=f"declare how to call the layer, {calls}")
    if moved > JOINT:
        # a mask the layer takes over `stream`'s tokens only (PRX's text mask, (B, L_txt)) has nothing to cover when
        # they are none: it runs given a mask over `stream`'s tokens, and raises given the audit's with none of
        # them; then the call passes no mask (a layer that raises on any mask keeps it, and `runs` judges that)
        refused = None if mask_name is None else _refuses_mask_without(probe, call.query, stream, x_to=x_to)
        dropped = refused is not None and _given(probe, call.query, stream, mask_name, x_to=x_to) is not None
        said: list[str] = []
        empty = _given(probe, call.query[:, :0], stream, said=said, x_to=x_to, length=call.query.shape[1],
                       queries=call.query)
        if empty is None or not torch.isfinite(empty).all():
            what = f"raises ({said[0]})" if said else ("returns no row per query" if empty is None else
                                                      "returns non-finite outputs")
            return result("runs", "skip", f"not measured: {head} and attends its queries together with `{stream}` "
                                          f"(another output row moved by {moved:.3g} of the outputs' RMS when one "
                                          f"query token changed): joint attention; but given `{stream}` with no "
                                          f"tokens it {what}, so no call the audit could measure gives it",
                          evidence=evidence,
                          fix=f"wrap the layer so that it gets `{stream}` in the form it attends, and audit the "
                              f"wrapper")
        declare = stream_call(stream, "x[:, :0]", None if dropped else mask_name, probe.options, query=to)
        how = (f"attends its queries together with `{stream}` (another output row moved by {moved:.3g} of the "
               f"outputs' RMS when one query token changed, {MEMORY_TOKENS} `{stream}` tokens given): joint "
               f"attention, both streams concatenated along the sequence; given `{stream}` with no tokens it is "
               f"self-attention over x" + (f"; its `{mask_name}` is over `{stream}`'s tokens (given a mask over "
                                           f"them it runs; given none of them and the audit's mask it raises "
                                           f"{refused}), so none is passed" if dropped else ""))
        fix = (f"audit with {declare}: self-attention over the joint sequence (parameters the layer applies only "
               f"to `{stream}`'s tokens are then not measured)")
    elif stream == sig.memory:
        refused = None if mask_name is None else _raises_given(probe, call.query, stream, mask_name)
        form = None if refused is None else _memory_form(probe, call.query, stream, mask_name)
        if refused is not None and form is None:
            return _mask_does_not_fit(probe, call, stream, mask_name, refused, evidence)
        declare, how, fix = _memory_declared(probe, call.query, stream, mask_name, to, form,
                                             f"given `{mask_name}` over its tokens too it raises ({refused})")
    else:
        declare = stream_call(stream, "x", mask_name, probe.options, query=to)
        how = f"attends `{stream}` apart from its queries (each output row moved only with its own query)"
        fix = f"declare how to call the layer, {calls}"
    return result("runs", "skip", f"needs a declaration, {declare}: {head} and {how}",
                  evidence=evidence, fix=fix, declaration=declare)


def _memory_declared(probe: Probe, query: torch.Tensor, stream: str, mask_name: str | None, to: str | None,
                     form: MemoryForm | None, refused: str = "") -> tuple[str, str, str]:
    """(the declaration, what the layer was seen to do, the fix) for a layer that attends `stream` as a memory:
    `cross=True`; with the mask convention in which it honours a mask over the memory (`_key_convention`, any shape:
    the audit passes its own mask), where that is not the audit's and nobody declared one; and with the call that
    gives the memory in the layer's `form`, where it takes it inside a tuple. One declaration, so that the audit
    under it measures the layer rather than naming another."""
    s = probe.subject
    convention, _ = (None, None) if mask_name is None else _key_convention(
        probe, query, stream, mask_name, per_key=False, form=None if form is None else form.build)
    parts = [spell("cross", True, probe.options)]
    # under a call the audit gives its default convention unless one is declared (the layer's own, read from its
    # parameter's name, is the module's, not the call's): there, any other is named; without one, any other than
    # the one the audit read, unless the user or the layer's library said it
    named = str(convention) != str(SHORTCUTS["allowed"]) and s.convention_by != "user" if form is not None else \
        convention != s.mask_convention and s.convention_by not in ("user", "library")
    if convention is not None and named:
        parts.append(spell("mask", str(convention), probe.options))
    honoured = "" if convention is None else (f" and honours `{mask_name}` over its tokens as {convention} "
                                              f"({convention.describe()}: a memory token it blocks moves no output, "
                                              f"one it keeps does)")
    if form is None:
        declare = ", ".join(parts)
        return (declare, f"attends `{stream}` as a memory (each output row moved only with its own query){honoured}",
                f"audit with {declare}: the audit then gives `{stream}` a memory on every call")
    x = "x" if to is None else f"{to}=x"
    params, mask = ("layer, x, memory, mask", f", {mask_name}=mask") if mask_name else ("layer, x, memory", "")
    parts.append(call_declaration(params, f"layer({x}, {stream}={form.text}{mask})", probe.options))
    declare = ", ".join(parts)
    how = (f"attends `{stream}` as a memory (each output row moved only with its own query); {refused}, and given "
           f"one tensor alone in a tuple it raises ({form.said}): it "
           f"takes `{stream}` as a tuple of {form.parts}; given the memory first and {form.empty} beside it, it runs, "
           f"reads the memory{honoured}")
    rest = ""
    if form.rest is not None:
        again = ", ".join([spell("cross", True, probe.options),
                           call_declaration("layer, x, memory", f"layer({x}, {stream}={form.rest})", probe.options)])
        rest = (f"; to audit what it does with it, audit again with {again} (the memory in its place and none first: "
                f"the layer runs on it and reads it)")
    fix = (f"audit with {declare}: the audit then gives the memory first in the tuple, and the tuple's other "
           f"{'part' if form.parts == 2 else 'parts'} ({form.empty}) nothing, so what the layer does with "
           f"{'it' if form.parts == 2 else 'them'} is not measured{rest}")
    return declare, how, fix


UNPACKED = re.compile(r"^ValueError: not enough values to unpack \(expected (\d+), got 1\)")
"""Python's own words where a tuple of one is unpacked into more names: the layer takes its memory as a tuple of
that many parts (diffusers' IP-Adapter processors: `encoder_hidden_states, ip_hidden_states = encoder_hidden_states`,
text tokens and a list of image prompts)."""

FILLERS = (("[memory[:, :0]]", lambda m: [m[:, :0]], "[memory]", lambda m: [m]),
           ("memory[:, :0]", lambda m: m[:, :0], "memory", lambda m: m),
           ("[]", lambda m: [], "[memory]", lambda m: [m]))
"""What each other part of a tuple memory is given (`_memory_form`), tried in order, and what gives it the memory
instead: a list of one item of no tokens (the modules that read it are called on nothing, which `parameters_used`
says is not measured, where a module never called would read as unused), no tokens, an empty list."""


@dataclass(frozen=True)
class MemoryForm:
    """How a layer takes its memory inside a tuple (`_memory_form`): `parts` parts, the memory first and each other
    part given `empty`; `text` the call's expression of it, `build` the same made from a memory; `said` what the
    layer raised given the memory alone in a tuple; `rest`: the expression that gives the other part (of two) the
    memory and the first none, where the layer runs on it and reads it (the call that audits that part), or None."""
    parts: int
    text: str
    empty: str
    build: Callable
    said: str
    rest: str | None


def _memory_form(probe: Probe, query: torch.Tensor, name: str, mask_name: str | None) -> MemoryForm | None:
    """Where the layer, given `name` a memory whose mask (every token kept) it refuses in every convention, or that it
    refuses as one tensor (`_tuple_only`), takes the memory inside a tuple: given the memory alone in one, it raises
    Python's unpacking error, which says how many parts it takes (`UNPACKED`); given the memory first and each other
    part a filler (`FILLERS`), it runs (with the mask, where it takes one) and its output moves with the memory. None
    otherwise (then `_mask_does_not_fit` names no declaration). A form is only named where it was run: the call it
    makes is the one the layer ran."""
    said: list[str] = []
    if _given(probe, query, name, said=said, form=lambda m: (m,)) is not None or not said:
        return None
    unpacked = UNPACKED.match(said[0])
    if unpacked is None or int(unpacked.group(1)) < 2:
        return None
    n = int(unpacked.group(1))
    for empty, fill, full, give in FILLERS:
        build = _tupled(fill, n)
        runs = (_given(probe, query, name, form=build) is not None if mask_name is None else
                _raises_given(probe, query, name, mask_name, form=build) is None)
        if not runs or not _stream_read(probe, query, name, None, form=build):
            continue
        rest = None
        if n == 2:  # the other part given the memory, and the first none of it: does the layer run on it and read it?
            other = lambda m, give=give: (m[:, :0], give(m))  # noqa: E731
            out = _given(probe, query, name, form=other)
            if out is not None and torch.isfinite(out).all() and _stream_read(probe, query, name, None, form=other):
                rest = f"(memory[:, :0], {full})"
        return MemoryForm(n, f"(memory, {', '.join([empty] * (n - 1))})", empty, build, said[0], rest)
    return None


def _tuple_only(probe: Probe, evidence: str, call, stream: str, mask_name: str | None, to: str | None):
    """`_stream_taken` where the layer raises given its memory as one tensor (it unpacks it: `text, images =
    encoder_hidden_states`, diffusers' IP-Adapter once its deprecated tensor form is gone) and takes it inside a
    tuple (`_memory_form`), attending it apart from its queries: the declaration that gives it so. None where it takes
    no tuple, or attends its queries together with the memory (no form of the audit's for that)."""
    said: list[str] = []
    _given(probe, call.query, stream, said=said)
    form = _memory_form(probe, call.query, stream, mask_name)
    moved = None if form is None else _rows_moved(probe, call.query, stream, form=form.build)
    if moved is None or moved > JOINT:
        return None
    declare, how, fix = _memory_declared(probe, call.query, stream, mask_name, to, form,
                                         f"given it as one tensor it raises ({said[0] if said else 'no row per query'})")
    return result("runs", "skip", f"needs a declaration, {declare}: the layer raised on every probe, each given "
                                  f"without `{stream}`, which it requires ({call.describe_error()}); it {how}",
                  evidence=evidence, fix=fix, declaration=declare)


def _tupled(fill, n: int):
    """The memory first in a tuple of `n`, each other part `fill(memory)`."""
    return lambda m: (m, *(fill(m) for _ in range(n - 1)))


def _unread_rows(query: torch.Tensor) -> str:
    """Why `_rows_moved` read nothing: one token (no other row to move), or a call that raised or gave NaN."""
    return ("at one token there is no other row to move" if query.shape[1] < 2 else
            "a call with one query token changed raised or gave non-finite outputs")


def _stream_read(probe: Probe, query: torch.Tensor, stream: str, x_to: str | None, form=None) -> bool:
    """Whether the layer's output moves (by more than HONOURED of its RMS) when every token of the memory given as
    `stream` (in `form`, where given: see `_given`) changes by a unit-normal vector."""
    memory = _fresh_memory(probe, query)
    changed = memory + torch.randn(memory.shape, generator=probe.generator(), dtype=query.dtype).to(query.device)
    a, b = (_given(probe, query, stream, x_to=x_to, memory=m, form=form) for m in (memory, changed))
    if a is None or b is None:
        return True  # it ran once given the stream: a second raise is no evidence that it ignores it
    return _moved(a, b) > HONOURED


def _stream_and_mask(probe: Probe, evidence: str, call, stream: str, mask_name: str, x_to: str,
                     to: str | None) -> DetectorResult:
    """`_stream_taken` where the layer raises given `stream` alone and runs given `mask_name` over its tokens too
    (diffusers' Lumina and Mochi processors index a text mask they require). Where it attends the queries together
    with the stream (Mochi: the prompt's valid tokens concatenated to the image's), the call that gives the stream
    no tokens and its mask over none of them: self-attention over x. Where it attends a memory apart, the per-key
    convention in which it honours a mask over the memory (`_key_convention`), and the call that gives a mask keeping
    every token wherever the audit gives none (Lumina). Each is named only where it ran; else `runs` is a skip that
    says the layer requires both, naming no declaration (the audit is inconclusive). A memory of any name: one
    the audit does not know (`forward(x, cond, mask)`) gets the same call, by its own name."""
    ones = {mask_name: None}  # `_given`'s default: a (B, Tm) mask of ones
    # the output as the layer returned it, and its rows (a (B, H, T, d) one with its head axis moved behind)
    returned = _given(probe, call.query, stream, x_to=x_to, kept=ones, whole=True)
    raw = None if returned is None else _first_tensor(returned)
    out = None if raw is None else _rows(raw, *call.query.shape[:2])
    moved = None if out is None else _rows_moved(probe, call.query, stream, x_to=x_to, kept=ones)
    how, declare = "", ""
    # Lumina's processor returns each head's output, (B, T, H, d), which its block merges and projects with the
    # layer's own `to_out`: the call named merges them and applies the one projection the layer never reads, as the
    # block does (a call that merged them alone would leave `to_out` unused, a false FAIL)

    def at(t: int):  # the layer traced on the queries repeated to t tokens (`heads_seen` reads it at T + 3)
        query = torch.cat([call.query] * (t // call.query.shape[1] + 1), 1)[:, :t]
        return traced(probe, lambda: _given(probe, query, stream, x_to=x_to, kept=ones, whole=True), query)

    heads = None if out is None or out.shape == call.query.shape else heads_seen(
        probe.subject.layer, raw, tuple(call.query.shape), at)
    apart = "" if heads is None else f"; it returns {heads.describe(tuple(raw.shape))}"
    merge = (lambda body: body) if heads is None else heads.merged
    if out is None:  # it ran given both a moment ago, with another memory: nothing to build a call on
        pass
    elif out.shape != call.query.shape and (heads is None or heads.left and not heads.projection):
        how = apart or f"; it returns {tuple(raw.shape)}, not the queries' form {tuple(call.query.shape)}"
    elif moved is None:
        how = (f"; whether it attends its queries together with `{stream}` could not be read "
               f"({_unread_rows(call.query)})")
    elif moved > JOINT:
        none = {mask_name: call.query.new_ones(call.query.shape[0], 0)}
        if _given(probe, call.query[:, :0], stream, x_to=x_to, kept=none, length=call.query.shape[1],
                  queries=call.query) is not None:
            to_x = "x" if to is None else f"{to}=x"
            declare = call_declaration("layer, x", merge(f"layer({to_x}, {stream}=x[:, :0], {mask_name}=x.new_ones("
                                                         f"x.shape[0], 0))"), probe.options)
            how = (f"attends its queries together with `{stream}` (another output row moved by {moved:.3g} of the "
                   f"outputs' RMS when one query token changed, {MEMORY_TOKENS} `{stream}` tokens given, every one "
                   f"kept): joint attention; given `{stream}` with no tokens and `{mask_name}` over none it is "
                   f"self-attention over x (its `{mask_name}` covers `{stream}`'s tokens only, so the audit's masks "
                   f"are not passed)")
    else:  # attended apart from the queries: a memory, whatever its name
        convention, flipped = _key_convention(probe, call.query, stream, mask_name)
        if flipped is not None:
            declare_flipped = spell("mask", str(flipped), probe.options)
            how = (f"; given `{mask_name}` over `{stream}`'s tokens, it honours it only as {flipped} "
                   f"({flipped.describe()}), which nothing the layer says suggests: a mask whose meaning is inverted "
                   f"is honoured the same way, so the audit names no convention (declare {declare_flipped} with the "
                   f"call if that is the one it takes)")
        if convention is not None:
            kept = {"allowed": "memory.new_ones(memory.shape[:2], dtype=bool)",
                    "blocked": "memory.new_zeros(memory.shape[:2], dtype=bool)",
                    "additive": "memory.new_zeros(memory.shape[:2])"}[convention.meaning]
            x = "x" if to is None else f"{to}=x"
            body = merge(f"layer({x}, {stream}=memory, {mask_name}={kept} if mask is None else mask)")
            declare = ", ".join([spell("cross", True, probe.options), spell("mask", str(convention), probe.options),
                                 call_declaration("layer, x, memory, mask", body, probe.options)])
            how = (f"attends `{stream}` as a memory (each output row moved only with its own query) and honours "
                   f"`{mask_name}` over its tokens as {convention} ({convention.describe()}): a memory token it "
                   f"blocks moves no output, one it keeps does; with no mask the layer raises, so the call gives one "
                   f"that keeps every token wherever the audit gives none")
    if declare:
        return result("runs", "skip", f"needs a declaration, {declare}: the layer raised on every probe, each given "
                                      f"without `{stream}` ({call.describe_error()}), and raises given `{stream}` "
                                      f"alone; given `{mask_name}` over its tokens too, it runs and {how}{apart}",
                      evidence=evidence, fix=f"audit with {declare}", declaration=declare)
    return result("runs", "skip", f"not measured: the layer raised on every probe, each given without "
                                  f"`{stream}` ({call.describe_error()}), and raises given `{stream}` alone; "
                                  f"given `{stream}` and `{mask_name}` a mask of ones over `{stream}`'s "
                                  f"{MEMORY_TOKENS} tokens it runs: it requires both, and no call the audit could "
                                  f"measure gives both{how}",
                  evidence=evidence,
                  fix=f"wrap the layer so that it gets both, e.g. a module whose forward(x, mask=None) "
                      f"calls it with {stream}=<its tokens> and {mask_name}=<a mask over them>, and audit "
                      f"the wrapper")


HONOURED = 1e-6
"""How far the outputs may move, as a fraction of their RMS, when a memory token the mask blocks changes, for the
layer to count as honouring that mask (`_key_convention`): a blocked key's weight is exp(-inf) = 0 or, under a finite
fill, below float32's resolution beside 1, so its change moves nothing (measured: diffusers' Lumina processor, 0); a
kept token's unit-normal change moves them by ~0.1 to 1 of the RMS. Also how far they must move, when every token
of a stream changes, for the layer to count as reading it (`_stream_read`)."""


MOVED = 1.0  # knob: how far `_key_convention` moves a memory token, a unit-normal's size (x10, x0.1: no verdict moves)
BIAS = 1.0  # knob: the additive bias (-BIAS) `_key_convention` tells from blocking (x10, x0.1: no verdict moves)


def _key_convention(probe: Probe, query: torch.Tensor, stream: str, mask_name: str, *, per_key: bool = True,
                    form=None):
    """(the first per-key convention (B, Tk) of the audit's own and `_mask_hints.candidates` in which the layer,
    given `stream` a memory and `mask_name` a mask over it that blocks its first token, runs, moves no output when
    that token changes, and moves them when the last changes; or None, and the first it honours in the other bool
    meaning, or None). The other bool meaning (True = blocked where the audit's is True = may attend) is named only
    where the layer's own words suggest it (`suggested_conventions`: a `*padding*` name): an inverted mask is honoured
    the same way, so what the layer does cannot tell them apart. An additive convention counts only where a bias of -1
    on the blocked token moves the outputs too: a layer that reads its mask as bool (`.bool()`, any nonzero entry
    True) blocks that token as -inf does, and takes an additive mask as an inverted one. `per_key=False`: a convention
    of any shape, for a call that passes the audit's own mask through (`cross=True`), not one made per key where the
    audit gives none; `form`: the memory's form (see `_given`)."""
    s = probe.subject
    allowed = torch.ones(query.shape[0], 1, query.shape[1], MEMORY_TOKENS, dtype=torch.bool, device=query.device)
    allowed[..., 0] = False
    memory = _fresh_memory(probe, query)
    blocked_changed, kept_changed = memory.clone(), memory.clone()
    blocked_changed[:, 0] += MOVED
    kept_changed[:, -1] += MOVED
    said = {c.meaning for c, _ in suggested_conventions(s)} | {s.mask_convention.meaning, "additive"}
    flipped = None
    for convention in [s.mask_convention, *candidates(probe)]:
        if per_key and not convention.per_key or flipped is not None and convention.meaning not in said:
            continue
        mask = {mask_name: convert_mask(allowed, convention, dtype=query.dtype, num_heads=s.num_heads or 1)}
        outs = [_given(probe, query, stream, kept=mask, memory=m, form=form)
                for m in (memory, blocked_changed, kept_changed)]
        if any(o is None or not torch.isfinite(o).all() for o in outs):
            continue
        blocked, kept = (_moved(outs[0], o) for o in outs[1:])
        if convention.meaning == "additive" and blocked <= HONOURED < kept:
            # added to the scores, a bias of -1 on the first token moves the outputs, less than blocking it; read as
            # bool (`.bool()`: any nonzero entry True) it blocks or keeps that token as -inf does
            biased = {mask_name: mask[mask_name].clamp_min(-BIAS)}
            out = _given(probe, query, stream, kept=biased, memory=memory, form=form)
            if out is None or _moved(outs[0], out) <= HONOURED:
                continue
        if blocked <= HONOURED < kept:
            if convention.meaning in said:
                return convention, None
            flipped = convention
    return None, flipped


def _stream_unknown(probe: Probe, evidence: str, call, name: str, mask_name: str | None) -> DetectorResult:
    """`_required_input` where a required parameter of a name the audit does not know (`forward(x, rel_pos)`)
    took neither a memory nor, for the queries, the stream: what it takes is not the audit's to guess, so `runs`
    is a skip saying what was tried and naming the call to declare; the audit is inconclusive."""
    sig = probe.subject.sig
    to = None if sig.first == sig.query else sig.query
    said: list[str] = []
    _given(probe, call.query, name, said=said)
    return result("runs", "skip", f"not measured: the layer requires `{name}`, a parameter of a name the audit does "
                                  f"not know, and raised on every probe, each given without it "
                                  f"({call.describe_error()}); given it a memory of {MEMORY_TOKENS} tokens it did not "
                                  f"return the queries' outputs{f' ({said[0]})' if said else ''}",
                  evidence=evidence,
                  fix=f"declare how to call the layer, "
                      f"{stream_calls(name, probe.options, query=to, mask_name=mask_name)}; or "
                      f"wrap the layer so that it gets `{name}`, e.g. a module whose forward(x, mask=None) calls it "
                      f"with {name}=<what it takes>")


def _refuses_mask_without(probe: Probe, query: torch.Tensor, name: str, x_to: str | None = None) -> str | None:
    """What the layer raises given `name` with no tokens and the audit's mask (every key kept) over the queries
    ("ValueError: ..."), or None where it runs (`x_to`: the parameter the queries go to; see `_given`)."""
    s = probe.subject
    allowed = torch.ones(query.shape[0], 1, query.shape[1], query.shape[1], dtype=torch.bool, device=query.device)
    probe.passes += 1
    try:
        with torch.no_grad():
            s.layer(**_streams(s, s._kwargs(query, query, query, allowed), query, name, query[:, :0], x_to))
    except Exception as exc:  # noqa: BLE001 -- said in the declaration's reason
        return _raised(exc)
    return None


def _raised(exc: Exception) -> str:
    """An exception as a declaration's reason quotes it: its type and its first line, cut at 120 characters."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def _mask_does_not_fit(probe: Probe, call, name: str, mask_name: str, refused: str, evidence: str) -> DetectorResult:
    """The memory branch of `_required_input` where the layer, given `name` alone, attends it as a memory, and
    raises given its mask over that memory's tokens too (every token kept): under `cross=True` every probe with a
    mask would raise, so that declaration does not pass, and no other of the audit's gives the mask the layer takes
    (diffusers' IP-Adapter processors split the memory's last tokens off as image tokens, and their mask covers the
    text tokens left). A skip that says so and names the wrapper; the audit is then inconclusive."""
    return result("runs", "skip", f"not measured: the layer raised on every probe, each given without `{name}` "
                                  f"({call.describe_error()}); given `{name}` it runs and attends it as a memory "
                                  f"(each output row moved only with its own query), but given `{mask_name}` over "
                                  f"`{name}`'s {MEMORY_TOKENS} tokens too (every one kept, in each mask convention of the "
                                  f"audit's) it raises ({refused}): under "
                                  f"{spell('cross', True, probe.options)} every probe with a mask would raise, and no "
                                  f"declaration of the audit's gives it a mask that fits",
                  evidence=evidence,
                  fix=f"declare the call that gives the layer its memory in the form it attends, with a mask over "
                      f"the tokens that mask covers: call=lambda layer, x, memory, mask: layer(x, {name}=<memory in "
                      f"the layer's form>, {mask_name}=mask), with {spell('cross', True, probe.options)}")


def _raises_given(probe: Probe, query: torch.Tensor, name: str, mask_name: str, form=None) -> str | None:
    """What the layer raises ("RuntimeError: ..., given it as <convention>", the first convention that raised) given
    `name` a memory of MEMORY_TOKENS tokens and `mask_name` a mask over them that keeps every token, where it runs
    in no convention (the audit's own, then `_mask_hints.candidates`: each meaning, each shape); None where one runs
    (a mask of another convention is a declaration the audit names later, not a mask that cannot fit)."""
    s = probe.subject
    every = torch.ones(query.shape[0], 1, query.shape[1], MEMORY_TOKENS, dtype=torch.bool, device=query.device)
    first: list[str] = []
    for convention in [s.mask_convention, *candidates(probe)]:
        mask = convert_mask(every, convention, dtype=query.dtype, num_heads=s.num_heads or 1)
        said: list[str] = []
        if _given(probe, query, name, mask_name, said, mask=mask, form=form) is not None:
            return None
        first += [f"{said[0]}, given it as {convention}"] if said and not first else []
    return first[0] if first else None


def _given(probe: Probe, query: torch.Tensor, name: str, mask_name: str | None = None, said: list | None = None,
           mask: torch.Tensor | None = None, *, x_to: str | None = None, kept: dict | None = None,
           memory: torch.Tensor | None = None, length: int | None = None, queries: torch.Tensor | None = None,
           whole: bool = False, form=None):
    """The layer's output on `query` with `name` given a memory of MEMORY_TOKENS tokens (and `mask_name`, where
    named, `mask`, by default a (B, Tm) mask of ones over them: every token kept, read as bool, as kept keys or
    additive alike), or None if it raises (what it raised appended to `said`, where given) or returns no rows of
    the queries'. `x_to`: the parameter `query` goes to, where not the query's (`_streams`). `kept`: the masks to
    pass by name instead (a value None: the default mask); `memory`: the memory instead of a fresh one. `queries`,
    `length`: the queries to give and the rows to expect, where `query` is what `name` is given (its tokens or none
    of them) and not the queries. `whole`: the layer's result as it returned it, whatever its form. `form`: what
    `name` is given, made from the memory (`_memory_form`: the memory inside a tuple), where not the memory itself."""
    s = probe.subject
    queries = query if queries is None else queries
    if memory is None:
        memory = query if length is not None else _fresh_memory(probe, query)
    if kept is None:
        kept = {} if mask_name is None else {mask_name: mask}  # None: a (B, Tm) mask of ones
    kept = _over(kept, memory, query.dtype)
    probe.passes += 1
    try:
        with torch.no_grad():
            given = memory if form is None else form(memory)
            out = s.layer(**{**_streams(s, s._kwargs(queries, queries, queries, None), queries, name, given, x_to),
                             **kept})
    except Exception as exc:  # noqa: BLE001 -- a layer that raises with the stream given too: `runs` fails it
        if said is not None:
            said.append(_raised(exc))
        return None
    if whole:
        return out
    return _rows(_first_tensor(out), queries.shape[0], queries.shape[1] if length is None else length)


def _rows(out, batch: int, length: int) -> torch.Tensor | None:
    """The layer's output as rows (batch, length, ...): as it is, or a module's per-head (batch, H, length, d) with
    its head axis moved behind the rows (each head's output apart, for its caller to merge: `_heads_out`); None where
    it is neither (no tensor, or no row per query)."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != batch:
        return None
    if out.shape[1] == length:
        return out
    return out.transpose(1, 2) if out.dim() == 4 and out.shape[2] == length else None


def _rows_moved(probe: Probe, query: torch.Tensor, name: str, x_to: str | None = None,
               kept: dict | None = None, form=None) -> float | None:
    """How far the other output rows move, as a fraction of the outputs' RMS, when query token T // 2 changes by a
    unit-normal vector, `name` the same memory in both calls: 0 for rows computed apart (`x_to`, `kept`, `form`: see
    `_given`; a mask of `kept` given as None is one of ones over the memory). None where nothing could be read: one
    token (no other row), a call that raised, outputs not finite."""
    s = probe.subject
    memory = _fresh_memory(probe, query)
    given = memory if form is None else form(memory)
    masks = _over(kept, memory, query.dtype)
    changed = query.clone()
    j = query.shape[1] // 2
    changed[:, j] += torch.randn(changed[:, j].shape, generator=probe.generator(), dtype=query.dtype).to(query.device)
    others = [i for i in range(query.shape[1]) if i != j]
    if not others:  # one token: no other row to move
        return None
    probe.passes += 2
    try:
        with torch.no_grad():
            a, b = (_rows(_first_tensor(s.layer(**{**_streams(s, s._kwargs(x, x, x, None), x, name, given, x_to),
                                                   **masks})), *query.shape[:2]) for x in (query, changed))
    except Exception:  # noqa: BLE001 -- it ran a moment ago with another memory: nothing read, said by the caller
        return None
    if a is None or b is None:
        return None
    moved = _moved(a, b, rows=others)
    return moved if math.isfinite(moved) else None


def _fresh_memory(probe: Probe, query: torch.Tensor) -> torch.Tensor:
    """MEMORY_TOKENS standard-normal tokens of the queries' batch, width, dtype and device, from the probe's draws."""
    return torch.randn(query.shape[0], MEMORY_TOKENS, query.shape[-1], generator=probe.generator(),
                       dtype=query.dtype).to(query.device)


def _over(kept: dict | None, memory: torch.Tensor, dtype: torch.dtype) -> dict:
    """The masks `kept` names, each None made a (B, Tm) mask of ones over `memory`'s tokens (every one kept, read
    as bool, as kept keys or additive alike)."""
    return {k: torch.ones(memory.shape[:2], dtype=dtype, device=memory.device) if v is None else v
            for k, v in (kept or {}).items()}


def _moved(a: torch.Tensor, b: torch.Tensor, rows: list | None = None) -> float:
    """The largest change from `a` to `b` (over `rows` of the token axis, where given) as a fraction of `a`'s RMS."""
    diff = (a - b).float() if rows is None else (a - b)[:, rows].float()
    rms = a.float().pow(2).mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    return float(diff.abs().max() / rms)


def _streams(s, kwargs: dict, query: torch.Tensor, name: str, given: torch.Tensor, x_to: str | None) -> dict:
    """The audit's keyword arguments `kwargs` with `name` given `given`, and the queries moved to `x_to` where that
    is not the query's own parameter (a stream that is the queries: Perceiver's `latents`)."""
    return {**kwargs, name: given, **({} if x_to is None or x_to == s.sig.query else {x_to: query})}


def _first_tensor(out):
    """The first tensor of what the layer returned (joint attention returns (image, text) outputs)."""
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out


def _length_rule(call) -> int:
    """The multiple W the error of `call` names (`length_rule`), else 0."""
    return length_rule(call.error)


@dataclass(frozen=True)
class LengthRule:
    """The lengths a layer takes: multiples of `w`, as its own check says (`stated`: the message of its raise names
    the multiple), or as measured (`measured_rule`): the multiples of `w` it `ran` at, the other lengths it `raised`
    at, the first of those raises, and the user's lines the refusals were raised from (`lines`: one for the lengths of
    queries and keys alike, one more for those of the queries alone or the keys alone)."""

    w: int
    stated: bool
    ran: tuple[int, ...] = ()
    raised: tuple[int, ...] = ()
    error: str = ""
    lines: tuple = ()  # ((which lengths were off: "both", "queries" or "keys"), (file, line)), one per kind

    def said(self, call) -> str:
        """How the rule is known, after "multiples of W only, ..."."""
        if self.stated:
            return f"as its own check says ({call.describe_error()})"
        where = " and ".join(sorted({f"line {line} of {file.rsplit('/', 1)[-1]}" for _, (file, line) in self.lines}))
        return (f"as measured: it ran at every multiple of {self.w} tried (T = {', '.join(map(str, self.ran))}) and "
                f"raised at T = {', '.join(map(str, self.raised))}, in {where} ({self.error})")


SPLITS = re.compile(r"is invalid for input of size|can't divide axis|don't multiply up to|not divisible|divisible by|"
                    r"multiple of", re.I)
"""What a length the layer cannot split into its blocks raises: torch's reshape and view ("shape '[1, 2, -1]' is
invalid for input of size 9"), unflatten's, einops' ("can't divide axis of length 9 in chunks of 4"), a check's. A
broadcast mismatch, a padding too large for its input, an index out of range are faults at some lengths, not a rule."""


def _routine(error: BaseException | None) -> bool:
    """A refusal of a length the layer cannot split into its blocks (`SPLITS`, raised as a RuntimeError, ValueError
    or AssertionError), not a fault of its code (NameError, a broadcast mismatch, out of memory, ...)."""
    return (isinstance(error, (RuntimeError, ValueError, AssertionError)) and not isinstance(error, NotImplementedError)
            and bool(SPLITS.search(str(error))))


SPLITTERS = ("/einops/", "/einx/")
"""Helper libraries a layer splits its tokens with: a refusal raised inside one is the layer's line that called it."""


def _raised_at(error: BaseException | None) -> tuple | None:
    """The user's line an exception was raised from: its innermost user frame outside a splitting helper (einops'
    `rearrange` raises in einops.py for every layer: the line that called it is the layer's); None where none is."""
    frames = traceback_frames(error.__traceback__) if error is not None and error.__traceback__ is not None else ()
    frames = [f for f in frames if not any(part in f[0].co_filename for part in SPLITTERS)] or list(frames)
    return (frames[0][0].co_filename, frames[0][1]) if frames else None


def _off_which(probe: Probe, call) -> str:
    """Which lengths of a call are not the standard probe's: "both", or the "queries" or the "keys" alone."""
    t, T = probe.subject.time_dim, probe.t
    if call.query.shape[t] != T and call.key.shape[t] != T:
        return "both"
    return "queries" if call.query.shape[t] != T else "keys"


def _off_length(probe: Probe) -> list:
    """The failed calls at another length than the standard probe's, queries or keys, with a routine raise."""
    t = probe.subject.time_dim
    return [c for c in probe.failed_calls
            if (c.query.shape[t] != probe.t or c.key.shape[t] != probe.t) and _routine(c.error)]


def measured_rule(probe: Probe) -> LengthRule | None:
    """The lengths a layer takes that states no rule, measured (sinkhorn-transformer's LocalAttention splits T into
    buckets of 4 with a reshape and raises at T = 1; its library pads the input first). With T the standard length:
    the layer must refuse T + 1 (no multiple of any W dividing T: one call where there is no rule); W is then the
    smallest d >= 2 dividing T at which T + d runs, and the layer must run at W, 2W, T + W and 2T (and at Tq = T,
    Tk = T + W where it is audited as cross-attention: `Probe.cross`) and refuse T + 1, T + W - 1 and three lengths
    between; every refusal, the audit's failed calls' included, a split (`_routine`) raised from one line (one for
    the lengths of queries and keys alike, one for those of the queries or the keys alone: a layer that splits q and
    k on lines of their own), and each failed call at a length no multiple of W. A layer that raises at T = 1 alone
    (a `squeeze()` that takes the token axis) runs at T + 1: no rule, the raise fails; so do a length hard-coded in a
    reshape, a NameError and a broadcast mismatch. The calls are logged
    under `runs` (readings: their raises count for nothing); None where no W holds, and for an image adapter's
    layer, whose lengths are images of other shapes (a rule there is on their sides, not tokens)."""
    off = _off_length(probe)
    if not off or isinstance(getattr(probe.subject, "layer", None), Image) or not probe.base().ok:
        return None  # an image adapter lays each length out as its own squarest image: a rule there is on sides
    if "measured length rule" in probe.memo:
        return probe.memo["measured length rule"]
    s, T, B, tried = probe.subject, probe.t, probe.BATCH, {}
    (asking, probe.detector), (stream, probe._stream) = (probe.detector, "runs"), (probe._stream, "length rule")

    def ran(n: int, n_k: int | None = None) -> bool:
        if (n, n_k) not in tried:
            q, k, v = probe.streams(B, n, n_k, **({"cross": True} if n_k is not None else {}))
            said = f"T={n}" if n_k is None else f"Tq={n}, Tk={n_k}"
            tried[n, n_k] = probe.call(q, k, v, probe.allowed(B, n, n if n_k is None else n_k),
                                       label=f"{said}, for the lengths the layer takes", reading=True)
        return tried[n, n_k].ok

    rule = None
    try:
        w = next((d for d in range(1, T + 1) if T % d == 0 and ran(T + d)), 0) if not ran(T + 1) else 0
        multiples = sorted({w, 2 * w, T, T + w, 2 * T}) if w >= 2 else []
        others = sorted({n for n in (T + 1, T + w - 1, *(T + w * k // 5 for k in range(1, 5))) if n % w}) \
            if w >= 2 else []
        if multiples and all(ran(n) for n in multiples) and not any(ran(n) for n in others) and \
                (not probe.cross or ran(T, T + w)):
            t = s.time_dim
            refusals = [("both", tried[n, None].error) for n in others] + [(_off_which(probe, c), c.error) for c in off]
            groups: dict[str, set] = {}
            for which, error in refusals:
                groups.setdefault(which, set()).add(_raised_at(error))
            lines = {line for group in groups.values() for line in group}
            if all(_routine(e) for _, e in refusals) and all(len(g) == 1 for g in groups.values()) and \
                    None not in lines and all(c.query.shape[t] % w or c.key.shape[t] % w for c in off):
                raised = sorted(set(others) | set(_lengths(probe, off, w)))
                rule = LengthRule(w, False, tuple(multiples), tuple(raised), tried[others[0], None].describe_error(),
                                  tuple((which, group.pop()) for which, group in sorted(groups.items())))
    finally:
        probe.detector, probe._stream = asking, stream
    probe.memo["measured length rule"] = rule
    return rule


def _rule(probe: Probe) -> LengthRule | None:
    """The layer's length rule: the one multiple its failed calls' checks name, else the one measured."""
    stated = {_length_rule(c) for c in probe.failed_calls} - {0}
    if stated:
        return LengthRule(stated.pop(), True) if len(stated) == 1 else None
    return measured_rule(probe)


def _refused_lengths(probe: Probe) -> list:
    """The failed calls the layer's length rule refused (`_length_constraint`): at a length that is no multiple of
    its W >= 2 while the standard probe, at a multiple of W, ran; a stated rule's by a raise naming it (an
    AssertionError or ValueError), a measured one's by a routine raise (`_routine`)."""
    t, base = probe.subject.time_dim, probe.base()
    rule = _rule(probe)
    if rule is None or not base.ok or rule.w < 2 or base.query.shape[t] % rule.w:
        return []
    w = rule.w
    if rule.stated:
        return [c for c in probe.failed_calls if _length_rule(c) == w and (c.query.shape[t] % w or c.key.shape[t] % w)]
    known, refused = dict(rule.lines), []  # a kind of call the rule has no line for yet takes its first call's
    for c in probe.failed_calls:
        if (c.query.shape[t] % w or c.key.shape[t] % w) and _routine(c.error):
            line = _raised_at(c.error)
            if known.setdefault(_off_which(probe, c), line) == line:
                refused.append(c)
    return refused


def raised_at_probe_length(probe: Probe) -> bool:
    """Whether a call raised at the probe's own length, queries and keys alike: the length the standard probe ran at,
    so the raise is the layer's, not its length rule's (a call the rule refused is at a length no multiple of it,
    never the probe's)."""
    t = probe.subject.time_dim
    return any(c.query.shape[t] == probe.t and c.key.shape[t] == probe.t for c in probe.failed_calls)


def _refused_said(probe: Probe, refused: list) -> str:
    """The lengths the layer's rule refused (`_refused_lengths`), said beside another reading: skipped, not failed;
    "" where there are none."""
    if not refused:
        return ""
    rule = _rule(probe)
    asks = (f"its own check asks for, and those probes are skipped ({refused[0].describe_error()})" if rule.stated
            else f"it takes (measured), and those probes are skipped ({refused[0].describe_error()})")
    lengths = ", ".join(map(str, _lengths(probe, refused, rule.w)))
    return f"; it also refused T = {lengths}, no multiple of the {rule.w} {asks}"


def _lengths(probe: Probe, calls: list, w: int) -> list[int]:
    t = probe.subject.time_dim
    return sorted({n for c in calls for n in (c.query.shape[t], c.key.shape[t]) if n % w})


def _length_constraint(probe: Probe, evidence: str) -> DetectorResult | None:
    """A length the layer refuses by its rule, which is no defect: every call that raised was refused by it
    (`_refused_lengths`: local attention's AssertionError "sequence length 1 must be divisible by window size 4", or
    sinkhorn's bucketing reshape where the layer runs at every multiple of 4: `measured_rule`), while the standard
    probe, at a multiple of W, ran. Then `runs` is a skip saying so, and the audit judges the layer on the lengths it
    takes; None otherwise (a length hard-coded in a reshape, a raise at T = 1 alone, a NameError at other lengths, a
    refused length that is a multiple of W: those still fail)."""
    calls = probe.failed_calls
    refused = _refused_lengths(probe)
    if not calls or len(refused) != len(calls):
        return None
    rule = _rule(probe)
    w = rule.w
    return result("runs", "skip", f"the layer takes lengths that are multiples of {w} only, {rule.said(calls[0])}: "
                                  f"it refused only T = {', '.join(map(str, _lengths(probe, refused, w)))} of the "
                                  f"audit's probes, and those probes are skipped, not failed",
                  evidence=evidence,
                  fix=f"audit at a seq_len that is a multiple of {w}; if the layer should take any length, pad the "
                      f"input to a multiple of {w} inside it (and mask the padding)"
                      + ("" if rule.stated else f", or check the length with an error that names the multiple of {w}"),
                  extras={"length_rule": w, "measured": not rule.stated})


def _mask_hint(probe: Probe) -> str | None:
    """For calls that raised with a mask while the layer runs without one (a (B, 1, Tq, Tk) mask given to a layer
    that takes (B, Tk) or (Tq, Tk)): the convention hint of the mask finding; None otherwise."""
    masked = [c for c in probe.failed_calls if c.allowed is not None]
    if not masked or not probe.subject.takes_mask:
        return None
    unmasked_ran = any(not s.raised and s.allowed is None for shapes in probe.shapes.values() for s in shapes)
    about_mask = any(MASKY.search(str(c.error)) for c in masked)
    if not (unmasked_ran or about_mask):
        return None
    return convention_hint(probe)


def unique(failed):
    seen, out = set(), []
    for d, shape in failed:
        if id(shape) not in seen:
            seen.add(id(shape))
            out.append((d, shape))
    return out
