"""`output_shape`: the output is (B, Tq, D), also when the memory length differs from the query length."""

from __future__ import annotations

from .._core import not_run, skip
from .._probe import Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._tracing import stream_sites, trace_call
from .._subject import spell
from ._common import own_queries_seen, result
from ._heads_out import heads_out_seen, merged_call
from ._mask_hints import undeclared_convention
from ._stacked import decoding_calls


def output_shape_sites(probe, result: DetectorResult) -> list[Site]:
    """On the call whose output had the wrong shape: an operand of q·k or weights·v from the wrong stream."""
    for call in result.replay or ():
        if call.query is not call.key:
            return stream_sites(trace_call(probe.subject, call.query, call.key, call.value, call.allowed,
                                           seed=probe.seed), probe.subject)
    return []


@detector("output_shape", "output is (B, Tq, D), also when the memory length Tk differs from Tq",
          targets=("self/cross-attention inputs swapped",),
          fix="queries come from the decoder stream (query), keys and values from the memory",
          locate=output_shape_sites)
def check_output_shape(probe: Probe) -> DetectorResult:
    det, s, B, T = "output_shape", probe.subject, probe.BATCH, probe.t
    base = probe.base()
    if not base.ok:
        return not_run(det, base)
    checks = [("the standard probe", base, s.expected_out_shape(B, T))]
    unmeasured = ""
    if s.separate_kv:
        # Tq != Tk: a cross-attention (or cached-decoding) call. For a causal layer that decode_consistency probes
        # (seq_len >= 3) its last call, the newest queries over every key; otherwise a memory 3 tokens longer
        decoded = decoding_calls(probe) if probe.causal and T >= 3 else []
        if len(decoded) > 1:
            t_q, call = decoded[-1]
            t_k = T
        else:
            t_q, t_k = T, T + 3
            q, k, v = probe.streams(B, T, t_k, cross=True)
            call = probe.call(q, k, v, probe.allowed(B, T, t_k), label=f"query length {T}, memory length {t_k}")
        if call.ok:
            checks.append((f"query length {t_q}, memory length {t_k}", call, s.expected_out_shape(B, t_q)))
        elif call.self_only:  # raised only because Tq != Tk, on a layer not declared cross-attention
            unmeasured = probe.self_only_text()
        else:
            unmeasured = f"query length {t_q}, memory length {t_k}: the layer raised ({call.describe_error()}); see `runs`"
    def fits(got: tuple, want: tuple) -> bool:  # queries of its own: (B, Q, any width), a pooling head may project
        return got == want or bool(s.own_queries) and len(got) == 3 and got[:2] == want[:2]

    wrong = [(label, tuple(c.output.out.shape), want) for label, c, want in checks
             if not fits(tuple(c.output.out.shape), want)]
    seen = own_queries_seen(probe) if wrong else None
    if seen is not None:  # a correct layer of another convention: the declaration it needs, never a failure
        declare = spell("queries", seen, probe.options)
        got = tuple(base.output.out.shape)
        rows = "(B, D), one vector" if len(got) == 2 else f"{seen} row{'s' if seen > 1 else ''}"
        return result(det, "skip", f"needs a declaration, {declare}: the output is {rows} per sequence at every probe "
                                   f"length, not one row per token: the layer attends with queries of its own",
                      evidence=f"the standard probe: output {got} for {T} tokens, expected "
                               f"{s.expected_out_shape(B, T)} for one row per token; {rows} again at another length",
                      fix=f"audit with {declare} if the layer attends with {seen} learned quer"
                          f"{'y' if seen == 1 else 'ies'} of its own (an attention-pooling head, Set Transformer's "
                          f"PMA, Perceiver's latents); a layer meant to return a row per token returns the wrong shape",
                      declaration=declare)
    heads = heads_out_seen(probe) if wrong and seen is None else None
    if heads is not None:  # a correct layer of another convention, as above: its caller merges the heads
        return _heads_apart(probe, heads)
    if wrong:
        text = "; ".join(f"{label}: output {got}, expected {want}" for label, got, want in wrong)
        replay = tuple(c for label, c, want in checks if not fits(tuple(c.output.out.shape), want))
        heads = s.num_heads or 1
        if not s.own_queries and heads > 1 and all(len(got) == len(want) and got[:-1] == want[:-1]
                                                   and got[-1] == heads * want[-1] for _, got, want in wrong):
            # each head projected to the whole width, then the heads concatenated (mmdit's AdaptiveAttention)
            return result(det, "fail", f"the output has the wrong shape: {heads} x the width, one full-width output "
                                       f"per head side by side", evidence=text, replay=replay,
                          fix=f"sum the heads' outputs after each head's projection to the width ({heads} heads of "
                              f"width {wrong[0][2][-1]} concatenated now), or merge the heads first, (B, T, H * d), and "
                              f"project that once to the width")
        declared = {} if not s.own_queries else {"fix": (
            f"return one row per query of the layer's own, (B, {s.own_queries}, width) (or (B, width) for one), as "
            f"{spell('queries', s.own_queries, probe.options)} declares; if the layer returns one row per token, "
            f"leave the declaration out")}
        return result(det, "fail", "the output has the wrong shape", evidence=text, replay=replay, **declared)
    if unmeasured:
        return skip(det, unmeasured)
    rows = f"(B, Q, ...), Q = {s.own_queries} queries of its own," if s.own_queries else "(B, Tq, ...)"
    return result(det, "pass", f"output shape is {rows} " + ", ".join(
        f"{tuple(c.output.out.shape)}" for _, c, _ in checks))


def _heads_apart(probe: Probe, heads) -> DetectorResult:
    """`output_shape` for a module that returns each head's output apart (`_heads_out.heads_out_seen`): it needs a
    declaration, the call that merges the heads as its caller does (and applies the projection it leaves to it).
    Where no such call can be named (a call of the user's that returns the heads apart, arguments the audit builds,
    several projections left unread) it fails as before, saying why: no declaration would make it pass."""
    s, B, T = probe.subject, probe.BATCH, probe.t
    got, width = tuple(probe.base().output.out.shape), s.expected_out_shape(B, T)[-1]
    # the convention mask_honoured would name once the heads are merged (it reads no rows of a per-head output):
    # honoured in another convention than the audit's default, which the layer is first seen not to honour
    # (`honoured_conventions`' negative control)
    undeclared = undeclared_convention(probe) if s.mask_names and s.convention_by == "default" else None
    declare = merged_call(probe, heads, None if undeclared is None else undeclared[0])
    merge = ("out.reshape(B, T, H * d)" if heads.layout == "bthd" else "out.transpose(1, 2).reshape(B, T, H * d)")
    bug = (f"a layer meant to return one row per token of width {width} merges its heads "
           f"itself, {merge}" + (f", and applies `{heads.projection}` to them" if heads.projection else ""))
    linear = f"the layer's nn.Linear modules from width {width} to {width} not named for queries, keys or values"
    evidence = (f"the standard probe: output {got}, expected {s.expected_out_shape(B, T)}, and attention over its {T} "
                f"tokens observed; " + (f"of {linear}, the call never reads {', '.join(p for p, _ in heads.left)}"
                                        if heads.left else f"the call reads each of {linear}, if any"))
    if declare is None:
        # several projections left unread: `describe` says which one the caller applies cannot be told
        why = ("the declared call returns them so: merge them in it" if s.call is not None else
               "no declared call that merges them can be named for the audit's call of the layer")
        return result("output_shape", "fail", f"the output has the wrong shape: {heads.describe(got)}; {why}",
                      evidence=evidence,
                      fix=f"{bug}; if its caller merges them, wrap the layer in a module that does the same and audit "
                          f"the wrapper")
    mask = "" if undeclared is None else f"; its mask: {undeclared[1]}"  # the convention in `declare`, both readings
    # with a convention in it, a failure whose every probe gave the mask needs the same declaration
    # (`_audit.under_a_mask_undeclared`), as the merged twin's mask_honoured skip makes it
    return result("output_shape", "skip", f"needs a declaration, {declare}: the output is {heads.describe(got)}{mask}",
                  evidence=evidence, fix=f"audit with {declare} if the layer's caller merges its heads so; {bug}",
                  declaration=declare, extras={} if undeclared is None else {"mask_convention": undeclared[2]})
