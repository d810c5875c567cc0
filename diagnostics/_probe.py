"""The probing session: inputs from private generators, masks in one convention, calls that never raise.

Every detector asks the `Probe` for inputs and calls. The probe
- allocates the random streams itself (`generator()`): a fresh seed per request, derived from the audit's
  seed, the detector asking and a counter, so no two probes share a draw by accident;
- counts forward passes (the audit's cost is a constant number of them, independent of the sequence length);
- logs every call under the detector that made it (`shapes`), so that each result can say what its probes
  showed the layer, and every call that raised (`raised`), so that `runs` reports all of them;
- caches the standard run, and finds the attention weights of a call however the layer exposes them.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from ._change import relative_change
from ._errors import ProbeNotTaken
from ._frames import exception_text
from ._guard import seed_rng
from ._layout import CHECKED, MAX_TOKENS, TokenLayout, bits, decode, laid_out, moved_rows, numbers, partition
from ._observe import Observer, Record, fused_weights, weights_in_parts
from ._result import ProbeShape
from ._subject import KEY_NAMES, VALUE_NAMES, Output, Subject, not_weights
from ._thresholds import ROW_SUM, UNCHANGED, tolerance
from .patterns import Pattern


def block_diagonal(weights: Tensor, t_q: int, t_k: int) -> Tensor | None:
    """Weights over blocks of tokens, (..., n_blocks, n, m), laid out whole as the (..., Tq, Tk) they are: block b's
    n queries attend block b's m keys, zero elsewhere (NesT's attention within each block of its grid, (B, H, blocks,
    N, N); Hiera's mask units, whose n queries are pooled from each unit's m tokens: (B, H, units, n, m), n < m, for a
    layer with queries of its own). None unless the blocks tile the queries and the keys, n_blocks x n = Tq and
    n_blocks x m = Tk, n_blocks > 1."""
    if weights.dim() < 4:
        return None
    n_blocks, n, m = weights.shape[-3:]
    if n_blocks < 2 or n_blocks * n != t_q or n_blocks * m != t_k:
        return None
    whole = weights.new_zeros(*weights.shape[:-3], t_q, t_k)
    for b in range(n_blocks):
        whole[..., b * n:(b + 1) * n, b * m:(b + 1) * m] = weights[..., b, :, :]
    return whole


def blocks_said(tensor: Tensor, keys: int | None = None) -> str:
    """How `block_diagonal` read weights over blocks, for the source of the weights (`keys`: each block's, where a
    block's queries are fewer)."""
    n_blocks, n = tensor.shape[-3], tensor.shape[-2]
    tokens = f"{n} tokens" if keys in (None, n) else f"{n} queries over {keys} keys"
    return f"over {n_blocks} blocks of {tokens}, laid out whole as block-diagonal (Tq, Tk) weights"

@dataclass
class Call:
    """One call of the layer and what came of it: an output, or the exception it raised."""

    query: Tensor
    key: Tensor
    value: Tensor
    allowed: Tensor | None  # (B, Tq, Tk) True = may attend, as passed (causal included), or None
    output: Output | None
    error: BaseException | None
    record: Record | None = None
    label: str = ""
    self_only: bool = False  # it raised only because Tq != Tk, on a layer not declared cross-attention (see Probe)
    not_taken: bool = False  # the layer as held cannot be given this probe (`ProbeNotTaken`): skipped, with its reason
    parts: tuple = ()  # a stacked probe's readers and their copies of the batch (see ProbeShape.parts)
    # a reading of the audit's own in a form the layer need not take (values as wide as the keys are many): where it
    # raised, that reading is not taken, and no probe of the layer failed
    reading: bool = False

    @property
    def ok(self) -> bool:
        return self.output is not None

    def describe_error(self) -> str:
        return exception_text(self.error)


def _rows_of(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None, rows: slice) -> tuple:
    """(query, key, value, allowed) cut to the batch rows `rows`, one stream staying one tensor (a self-attention
    module takes one)."""
    cut: dict[int, Tensor] = {}
    q, k, v = (cut.setdefault(id(x), x[rows]) for x in (query, key, value))
    return q, k, v, None if allowed is None else allowed[rows]


class Probe:
    BATCH = 2

    def __init__(self, subject: Subject, *, causal: bool, scale: float | None, seq_len: int, seed: int,
                 options: dict | None = None, pattern: Pattern | None = None, cross: bool = False):
        self.subject, self.causal, self.scale, self.seed = subject, causal, scale, seed
        # declared cross-attention (`cross=True`, or a layer whose signature names a memory): a call that raises at
        # Tq != Tk is a `runs` failure. Otherwise a layer that runs at Tq = Tk and raises only at Tq != Tk is taken
        # for what it is, self-attention only: its cross-length probes are skips that say so (`self_only`)
        self.cross = cross or subject.cross_declared
        self.self_only: Call | None = None  # the first cross-length call that raised on such a layer
        self.not_taken: Call | None = None  # the first call the layer as held could not be given (`ProbeNotTaken`)
        # (batch, exception) where the layer refused a batch the audit stacked its copies in and ran it BATCH rows at
        # a time (`_in_batches`: a cache of max_batch_size rows), for `runs` to say
        self.batch_refused: tuple[int, str] | None = None
        self._rows_agree: bool | None = None  # a row alone comes out as in a batch (`_rows_alone_agree`), once asked
        self._parts_raised: set[tuple] = set()  # the exceptions whose stacks' parts raised too (`_in_batches`)
        # puts the layer's state back as it came to the audit (`_guard.untouched`'s), for a locator that replays the
        # layer's first call; None outside an audit
        self.as_given = None
        # puts back what the audit's calls left in the layer (a cache made at one length, what records it), for a
        # locator replaying a failure that depended on it once the layer is back as it came (`_guard.registries`)
        self.as_left = None
        # the declared attention pattern (diagnostics.patterns): passed as a mask to a layer that takes one and
        # does not declare that it builds its own (a `window`, `chunk`, ... attribute), else the layer's own promise
        self.pattern = pattern
        self.pass_pattern_mask = pattern is not None and subject.takes_mask and not subject.builtin_pattern
        self.t = seq_len
        self.options = options or {}  # how the user spells audit options in this front end
        self.passes = 0
        # A layer that takes a mask and does not declare its own causality is made causal by the mask.
        self.pass_causal_mask = causal and subject.takes_mask and not subject.builtin_causal
        # One whose flag is torch's `is_causal` takes a mask that carries the causality (Subject.mask_carries_causality):
        # every mask the audit passes it is causal too, where its convention can hold that (a (B, Tk) mask cannot);
        # its unmasked calls still test the flag itself
        self.causal_in_masks = (causal and subject.mask_carries_causality and not subject.mask_convention.per_key)
        self.detector = "audit"  # the detector now probing; audit() sets it
        self.chosen: tuple[str, ...] = ()  # the detectors this audit runs
        self.shapes: dict[str, list[ProbeShape]] = defaultdict(list)  # detector -> the calls it made
        self.raised: list[tuple[str, ProbeShape]] = []  # (detector, call) for every call that raised
        self.failed_calls: list[Call] = []  # those calls themselves, for `runs` to replay where it points
        self._draws: dict[str, int] = defaultdict(int)
        self._base: Call | None = None
        self._recovered: tuple[Tensor | None, str] | None = None
        self.mask_hints: dict = {}  # what diagnostics._mask_hints found, kept for the audit's second reading
        self.memo: dict = {}  # values read from the standard probe that several detectors ask for (logit_gain)
        self._shared: dict[str, tuple] = {}  # name -> (what `shared` made or the exception it raised, its calls)
        self._stream: str | None = None  # the name draws are seeded from while `shared` makes a probe

    # ---- inputs ----------------------------------------------------------------------------------------
    def generator(self) -> torch.Generator:
        """A generator no other request of this audit shares: seeded from (seed, detector, n-th request)."""
        asking = self._stream or self.detector
        n = self._draws[asking]
        self._draws[asking] += 1
        digest = hashlib.blake2b(f"{self.seed}/{asking}/{n}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)

    def seed_layer_rng(self, seed: int | None = None) -> None:
        """Seed the global generators the layer's own randomness (dropout) draws from, so that calls meant to be
        alike draw alike (audit() restores them afterwards): the CPU's and the layer's device's (`seed_rng`)."""
        seed_rng(self.seed if seed is None else seed, self.subject.device)

    def make(self, batch: int, t: int, **kw) -> Tensor:
        return self.subject.make(self.generator(), batch, t, **kw)

    def streams(self, batch: int, t_q: int, t_k: int | None = None, *, cross: bool | None = None,
                **kw) -> tuple[Tensor, Tensor, Tensor]:
        """(query, key, value). Self forms and causal audits get one stream (x, x, x); otherwise the query
        is a separate tensor from the memory, which is both key and value (a function gets three)."""
        t_k = t_q if t_k is None else t_k
        cross = (self.subject.separate_kv and not self.causal) if cross is None else cross
        if not cross:
            x = self.make(batch, t_q, **kw)
            return x, x, x
        q = self.make(batch, t_q, **kw)
        k = self.make(batch, t_k, **kw)
        v = self.make(batch, t_k, **kw) if self.subject.form == "function" else k
        return q, k, v

    def allowed(self, batch: int, t_q: int, t_k: int, extra: Tensor | None = None) -> Tensor | None:
        """The mask to pass, (B, Tq, Tk) True = may attend: `extra` and, when the audit makes the layer
        causal through its mask, the bottom-right causal mask; the declared pattern's mask, bottom-right too,
        for a layer that takes a mask."""
        mask = extra
        if self.pass_pattern_mask:
            declared = self.pattern.allowed(batch, t_q, t_k)  # (B, Tq, Tk)
            mask = declared if mask is None else mask.cpu() & declared
        if self.pass_causal_mask or (self.causal_in_masks and mask is not None):
            i = torch.arange(t_q).unsqueeze(-1)  # (Tq, 1)
            j = torch.arange(t_k)  # (Tk,)
            causal = (j <= i + t_k - t_q).expand(batch, t_q, t_k)  # (B, Tq, Tk)
            mask = causal if mask is None else mask & causal
        return None if mask is None else mask.to(self.subject.device)

    def padding(self, batch: int, t_q: int, t_k: int) -> Tensor:
        """(B, Tq, Tk): batch row b keeps its first `lengths[b]` keys, at least one, at most Tk - 1, from Tk // 2 on;
        the rows' lengths differ wherever that span holds a length for each (from Tk = 4 at B = 2), so that a layer
        reading another row's mask (row 0's for every row) is given a mask it does not honour."""
        low, high = max(1, t_k // 2), max(t_k - 1, 1)
        span = high - low + 1
        if span >= batch:
            lengths = low + torch.randperm(span, generator=self.generator())[:batch]
        else:
            lengths = torch.randint(low, high + 1, (batch,), generator=self.generator())
        return (torch.arange(t_k) < lengths.view(batch, 1, 1)).expand(batch, t_q, t_k).clone()

    # ---- calls -----------------------------------------------------------------------------------------
    def call(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None = None, *,
             label: str = "", observe: bool = False, parts: tuple = (), reading: bool = False) -> Call:
        """Call the layer; exceptions become part of the `Call`, and every call is logged under the
        detector that made it. With `observe`, record its internals (under grad mode, so that torch's
        fused inference fast paths, which hide them, are not taken). `reading`: see `Call.reading`."""
        self.passes += 1
        record = None
        try:
            if observe:
                try:
                    observer = Observer()
                    with torch.enable_grad(), observer:
                        output = self.subject(query, key, value, allowed)
                except NotImplementedError:
                    # an op whose backward this device lacks (FlexAttention on the CPU, for a layer whose parameters
                    # require grad) refuses to run while autograd records: this probe needs no gradient, so it is
                    # observed without (the gradient checks say what the missing backward means for them)
                    self.passes += 1
                    observer = Observer()
                    with torch.no_grad(), observer:
                        output = self.subject(query, key, value, allowed)
                record = observer.record
            else:
                with torch.no_grad():
                    output = self.subject(query, key, value, allowed)
            call = Call(query, key, value, allowed, output, None, record, label, parts=parts)
        except Exception as error:  # noqa: BLE001 -- a broken layer is a finding, never a crash of the audit
            # a layer that refuses the batch the audit stacked its copies in: the call made as the layer takes it,
            # unobserved (an observer's record of several calls is no record of one)
            output = self._in_batches(self.subject, error, query, key, value, allowed)
            if output is not None:
                call = Call(query, key, value, allowed, output, None, None, label, parts=parts)
            else:
                call = Call(query, key, value, allowed, None, error, record, label, parts=parts)
                if isinstance(error, ProbeNotTaken):  # not the layer's failure: a probe its holder cannot give it
                    call.not_taken = True
                    self.not_taken = self.not_taken or call
                else:
                    call.self_only = self._only_self_attention(call)
        call.reading = reading
        self._log(call)
        return call

    def output_of(self, subject: Subject, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None) -> Output:
        """`subject`'s output for the inputs, given `BATCH` rows at a time where the whole batch raised (see
        `_in_batches`); the whole batch's exception where the rows raise too."""
        try:
            return subject(query, key, value, allowed)
        except ProbeNotTaken:
            raise
        except Exception as error:  # noqa: BLE001 -- re-raised below unless the rows run
            output = self._in_batches(subject, error, query, key, value, allowed)
            if output is None:
                raise
            return output

    def _in_batches(self, subject: Subject, error: BaseException, query: Tensor, key: Tensor, value: Tensor,
                    allowed: Tensor | None) -> Output | None:
        """The output of a call that raised at a batch of several copies of the standard probe's (`BATCH` rows, how
        the audit stacks its perturbations), made `BATCH` rows at a time: a layer that holds a cache of
        `max_batch_size` rows refuses the audit's stacking, not attention. Each part's output (and weights, where
        every part gives them) joined along the batch; None where the batch is no such stack or a part raises too
        (then the layer refuses more than a batch size). The first such refusal is kept (`batch_refused`) for
        `runs` to say. Only where a row alone comes out as in a part (`_rows_alone_agree`)."""
        n, said = query.shape[0], exception_text(error)
        # an exception is the same one only for the layer held the same way: a hint's copy in another convention
        # raises the batch limit's exception too, where its parts raise for the convention
        seen = (subject.form, str(subject.mask_convention), subject.convention_by, said)
        if n <= self.BATCH or n % self.BATCH or any(x.shape[0] != n for x in (key, value)) or (
                allowed is not None and allowed.shape[0] != n) or isinstance(error, ProbeNotTaken):
            return None
        # no parts where a row alone already came out otherwise, or where this exception's parts raised before (a
        # layer broken on every call pays one call for the tries, one more for each other exception it raises)
        if self._rows_agree is False or seen in self._parts_raised or self._base is not None and not self._base.ok:
            return None  # (a layer that raised on the standard probe's own batch: its parts would raise alike)
        parts = []
        try:
            for rows in range(0, n, self.BATCH):
                self.passes += 1
                with torch.no_grad():
                    parts.append(subject(*_rows_of(query, key, value, allowed, slice(rows, rows + self.BATCH))))
        except Exception:  # noqa: BLE001 -- the rows raise too: the whole batch's exception stands
            self._parts_raised.add(seen)
            return None
        outs = [p.out for p in parts]
        if any(o.dim() == 0 or o.shape[0] != self.BATCH or o.shape[1:] != outs[0].shape[1:] for o in outs):
            return None
        if not self._rows_alone_agree(subject, query, key, value, allowed, outs[0]):
            return None
        weights = [p.weights for p in parts]
        joined = (torch.cat(weights) if all(w is not None and w.dim() > 0 and w.shape[0] == self.BATCH
                                            and w.shape[1:] == weights[0].shape[1:] for w in weights) else None)
        if self.batch_refused is None:
            self.batch_refused = (n, said)
        return Output(torch.cat(outs), joined)

    def _rows_alone_agree(self, subject: Subject, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None,
                          part: Tensor) -> bool:
        """Whether the first row of a part, called alone (a batch of one), comes out as it did in the part: what makes
        parts stand for the whole batch (a batch size written into the layer as a constant runs at that size only and
        reshapes any other into nonsense). Equal outputs agree whatever they hold (zeros from a zero-initialised
        output projection, NaN from a broken softmax, which no change can be measured against); others within the
        dtype's "unchanged" tolerance. One call, the first time a stack is made in parts; the answer is kept."""
        if self._rows_agree is None:
            self._rows_agree = False
            self.passes += 1
            try:
                with torch.no_grad():
                    alone = subject(*_rows_of(query, key, value, allowed, slice(0, 1))).out
            except Exception:  # noqa: BLE001 -- a layer that refuses a batch of one: its parts stand for nothing
                return False
            if alone.shape == part[:1].shape:
                row = part[:1]
                same = torch.equal(alone.isnan(), row.isnan()) and torch.equal(alone.nan_to_num(), row.nan_to_num())
                change = None if same else relative_change(alone, row, centred=True)
                self._rows_agree = same or (change is not None
                                            and float(change.max()) <= tolerance(UNCHANGED, self.subject.dtype))
        return self._rows_agree

    def batch_refused_text(self) -> str:
        """The words for a layer that refused the audit's stacked batch and ran it `BATCH` rows at a time."""
        if self.batch_refused is None:
            return ""
        n, error = self.batch_refused
        return (f"it refused a call that stacks {n // self.BATCH} copies of the standard probe's batch ({error}), so "
                f"every such call it refused was made {self.BATCH} rows of the probe at a time")

    def _only_self_attention(self, call: Call) -> bool:
        """A call that raised with Tq != Tk on a layer not declared cross-attention, which runs the standard probe
        (Tq = Tk): a self-attention layer that takes q, k and v separately but needs equal lengths (windowed
        attention, a causal buffer of fixed length). Its cross-length probes are skipped, visibly, not failed."""
        t = self.subject.time_dim
        if self.cross or call.query.shape[t] == call.key.shape[t] or self.detector == "base":
            return False
        if not self.base().ok:
            return False
        self.self_only = self.self_only or call
        return True

    def self_only_text(self) -> str:
        """The skip's words for a cross-length probe of a self-attention-only layer."""
        call = self.self_only
        t = self.subject.time_dim
        shape = f"Tq={call.query.shape[t]}, Tk={call.key.shape[t]}" if call is not None else "Tq != Tk"
        error = f" ({call.describe_error()})" if call is not None else ""
        cross = self.options.get("cross", "cross=True")
        return (f"self-attention only: the layer runs with Tq = Tk but raised with {shape}{error}; declare {cross} "
                f"to audit it as cross-attention")

    def not_taken_text(self) -> str:
        """The skip's words for the probes the layer as held could not be given (`ProbeNotTaken`)."""
        call = self.not_taken
        if call is None:
            return ""
        error = call.error
        cause = f" (it raised {exception_text(error.__cause__)})" if error.__cause__ is not None else ""
        return f"{error.reason}{cause}"

    def _log(self, call: Call) -> None:
        t = self.subject.time_dim
        shape = ProbeShape(call.label or "a probe", call.query.shape[0], call.query.shape[t], call.key.shape[t],
                           None if call.allowed is None else call.allowed.cpu(),
                           call.query is call.key and call.key is call.value,
                           "" if call.ok else call.describe_error(), parts=call.parts, not_taken=call.not_taken)
        if not any(s is shape for s in self.shapes[self.detector]):
            self.shapes[self.detector].append(shape)
        if not call.ok and not call.self_only and not call.not_taken and not call.reading:
            self.raised.append((self.detector, shape))
            self.failed_calls.append(call)

    def base(self) -> Call:
        """The standard run: batch 2, seq_len tokens, no mask beyond the causal one; observed. Shared by
        the detectors that use it, and logged under each of them."""
        if self._base is None:
            # drawn as "base" also when first asked for inside a shared probe, whose draws are seeded from its name
            (asking, self.detector), (stream, self._stream) = (self.detector, "base"), (self._stream, None)
            q, k, v = self.streams(self.BATCH, self.t)
            self._base = self.call(q, k, v, self.allowed(self.BATCH, self.t, self.t),
                                   label=f"the standard probe (B={self.BATCH}, T={self.t})", observe=True)
            self.detector, self._stream = asking, stream
        base_shape = self.shapes["base"][0]
        if self.detector != "base" and base_shape not in self.shapes[self.detector]:
            self.shapes[self.detector].append(base_shape)
            if not self._base.ok:
                self.raised.append((self.detector, base_shape))
        return self._base

    def shared(self, name: str, make):
        """What `make()` returns (calls and what was read from them), made once per audit for every detector that
        asks: its draws are seeded from `name`, not from the detector asking, so that each reads the same numbers
        whichever detectors run and whichever asks first (`audit(detectors=[...])`); its calls are logged under
        each. An exception `make` raised is raised again to each."""
        if name not in self._shared:
            shapes, raised = len(self.shapes[self.detector]), len(self.raised)
            outer, self._stream = self._stream, name
            try:
                made, error = make(), None
            except Exception as caught:  # noqa: BLE001 -- raised again below, to every detector that asks
                made, error = None, caught
            finally:
                self._stream = outer
            counted = {id(shape) for _, shape in self.raised[raised:]}
            self._shared[name] = (made, error, [(shape, id(shape) in counted)
                                                for shape in self.shapes[self.detector][shapes:]])
        made, error, calls = self._shared[name]
        for shape, counted in calls:
            if not any(s is shape for s in self.shapes[self.detector]):
                self.shapes[self.detector].append(shape)
                if counted:
                    self.raised.append((self.detector, shape))
        if error is not None:
            raise error
        return made

    def release(self) -> None:
        """Drop the standard probe's observed record (copies of (B, H, T, T) scores and weights) once the report has
        its weights: the sites, found later by fresh traces of each finding's own inputs, never need it."""
        if self._base is not None:
            self._base.record = None

    # ---- attention weights -----------------------------------------------------------------------------
    def weights(self, call: Call) -> tuple[Tensor | None, str]:
        """The attention weights of `call`, (B, [H,] Tq, Tk + the keys a layer appends of its own): returned by the
        layer, if what it returns is a distribution's candidate (see `_subject.not_weights`: a tensor with
        negative entries beside an observed softmax is its scores, not its weights); else the last observed
        softmax over (Tq, Tk) scores; else recomputed from the inputs of an observed fused attention call. The
        source says which was read, and why a returned tensor was not."""
        observed, source = self._observed(call)
        returned = call.output.weights if call.output is not None else None
        if returned is not None:
            why = not_weights(returned, observed) if call.record is not None else self.returned_not_weights()
            if why is None:
                return returned, "returned weights"
            if observed is None:
                return None, ""
            return observed, f"{source}; {why}, so the weights were read from the softmax"
        return observed, source

    def returned_not_weights(self) -> str | None:
        """Why the second output of the standard probe is not the layer's weights (None: it may be), for calls
        not observed, which have no softmax of their own to compare with."""
        if "returned_not_weights" not in self.memo:  # read once: a pass over (B, H, T, T) weights
            base, why = self.base(), None
            if base.ok and base.output.weights is not None and base.record is not None:
                observed, _ = self._observed(base)
                why = not_weights(base.output.weights, observed)
            self.memo["returned_not_weights"] = why
        return self.memo["returned_not_weights"]

    def _observed(self, call: Call) -> tuple[Tensor | None, str]:
        """The weights the observed record of `call` shows: its last softmax over (Tq, Tk), else its fused call's. A
        layer with queries of its own (a class token's, a pooling head's: `Subject.own_queries`) over those
        queries first, then over every token's (one that attends them all and returns the class token's row)."""
        t = self.subject.time_dim
        t_q, t_k = call.query.shape[t], call.key.shape[t] + appended_keys(self.subject.layer)
        own = self.subject.own_queries
        for queries in ((own, t_q) if own else (t_q,)):
            weights, source = self._observed_over(call, queries, t_k)
            if weights is not None:
                return weights, source
        return None, ""

    def observed_over(self, call: Call, t_q: int, t_k: int) -> Tensor | None:
        """The weights over (t_q, t_k) that the observed record of `call` shows (a softmax over them, a fused
        attention call), or None."""
        return self._observed_over(call, t_q, t_k)[0]

    def _observed_over(self, call: Call, t_q: int, t_k: int) -> tuple[Tensor | None, str]:
        if call.record is not None:
            fused = any(f.q.shape[-2] == t_q and f.k.shape[-2] == t_k for f in call.record.fused)
            for sm in reversed(call.record.softmaxes):
                # a softmax over another axis than the keys beside a fused attention call over (Tq, Tk) is not its
                # weights: GLM-5-Next's indexer pools (B, P, pool, d) keys by a softmax over each pool's tokens, and
                # at 16 tokens, pools of 16 and d = 16 its last two axes are (Tq, Tk) by coincidence; the attention
                # is the fused call. Without a fused call it is read (a softmax over the wrong axis of the scores)
                over_keys = sm.dim in (-1, sm.output.dim() - 1)
                if tuple(sm.output.shape[-2:]) == (t_q, t_k) and (over_keys or not fused):
                    parts = weights_in_parts(call.record, sm)
                    if parts is not None:  # normalised a part of the batch at a time: the whole the values meet
                        whole, c, n = parts
                        return whole, (f"observed softmax output (dim={sm.dim}), part {c + 1} of {n} of the weights "
                                       f"the values meet, read whole")
                    return sm.output, f"observed softmax output (dim={sm.dim})"
            for f in reversed(call.record.fused):
                if f.q.shape[-2] == t_q and f.k.shape[-2] == t_k:
                    return fused_weights(f), "weights of the observed fused attention call (recomputed from its inputs)"
            for sm in reversed(call.record.softmaxes):  # over blocks; over their queries too, as above
                over_keys = sm.dim in (-1, sm.output.dim() - 1)
                over_queries = sm.dim in (-2, sm.output.dim() - 2)
                if (over_keys or (over_queries and not fused)) and \
                        (whole := block_diagonal(sm.output, t_q, t_k)) is not None and \
                        self._blocks_hold(call, sm, t_q, t_k):
                    said = blocks_said(sm.output, sm.output.shape[-1])
                    return whole, f"observed softmax output (dim={sm.dim}), {said}"
            for f in reversed(call.record.fused):
                if (whole := block_diagonal(fused_weights(f), t_q, t_k)) is not None:
                    return whole, ("weights of the observed fused attention call (recomputed from its inputs), "
                                   + blocks_said(f.q, f.k.shape[-2]))
        return None, ""

    def _tagged(self, call: Call, t_q: int, t_k: int) -> tuple[Tensor | None, str]:
        """Weights over blocks of the layer's own partition of the tokens (`_layout`): each row and column matched to
        its token by tagging the tokens of `call`'s inputs, one observed call per bit of their numbers and one that
        checks the reading; the layout read once per input shape and mask."""
        s, t = self.subject, self.subject.time_dim
        found = partition(call.record, t_q, t_k)
        B = call.query.shape[0]
        if found is None or s.own_queries or call.query.shape[t] != t_q or call.key.shape[t] != t_k or \
                B * max(t_q, t_k) > MAX_TOKENS:
            return None, ""
        key = ("tagged", tuple(call.query.shape), tuple(call.key.shape), None if call.allowed is None
               else id(call.allowed))
        if key not in self.memo:
            self.memo[key] = self._tag(call, t_q, t_k)
        layout = self.memo[key]
        if layout is None:
            return None, ""
        whole = laid_out(found.softmax.output, layout, B, t_q, t_k, tolerance(ROW_SUM, s.dtype))
        if whole is None:
            return None, ""
        blocks, n, m = found.queries.shape[0], found.queries.shape[1], found.values.shape[1]
        return whole, (f"observed softmax output (dim={found.softmax.dim}), over {blocks} blocks of {n} queries and {m} "
                       f"keys the layer makes of its tokens, each weight placed at its query's and its key's token "
                       f"(read by tagging the tokens: {bits(B, max(t_q, t_k)) + 1} calls)")

    def _tag(self, call: Call, t_q: int, t_k: int) -> TokenLayout | None:
        B = call.query.shape[0]
        numbers_q, numbers_k = numbers(B, t_q), numbers(B, t_k)
        reads = [self._tagged_call(call, (numbers_q >> c) & 1 == 1, (numbers_k >> c) & 1 == 1,
                                   f"tokens tagged by bit {c} of their numbers", t_q, t_k)
                 for c in range(bits(B, max(t_q, t_k)))]
        checked = self._tagged_call(call, CHECKED(numbers_q), CHECKED(numbers_k),
                                    "tokens tagged by a pattern that checks the reading", t_q, t_k)
        base = partition(call.record, t_q, t_k)
        if base is None or checked is None or any(r is None for r in reads):
            return None
        every_q, every_k = CHECKED(torch.arange(B * t_q + 1)), CHECKED(torch.arange(B * t_k + 1))
        every_q[0] = every_k[0] = False  # number 0: no token
        return decode(base, reads, checked, every_q, every_k, B * t_q, B * t_k)

    def _tagged_call(self, call: Call, chosen_q: Tensor, chosen_k: Tensor, label: str, t_q: int, t_k: int):
        """`call`'s inputs with the tokens `chosen_q` (B, Tq) and `chosen_k` (B, Tk) moved by about their size (one
        draw per stream, the same in every tagged call of it), observed: its `partition`, or None."""
        t, B = self.subject.time_dim, call.query.shape[0]
        streams: dict = {}
        for x, chosen in ((call.query, chosen_q), (call.key, chosen_k), (call.value, chosen_k)):
            if id(x) in streams:
                continue
            unit = self.memo.get(("tag noise", tuple(x.shape)))
            if unit is None:  # one draw per shape: every tagged call of a reading moves a token alike
                unit = self.memo[("tag noise", tuple(x.shape))] = torch.randn(x.shape, generator=self.generator())
            noise = (unit * x.detach().float().pow(2).mean().sqrt()).to(dtype=x.dtype, device=x.device)
            where = chosen.reshape([B] + [x.shape[t] if i == t else 1 for i in range(1, x.dim())]).to(x.device)
            streams[id(x)] = torch.where(where, x + noise, x)
        q, k, v = (streams[id(x)] for x in (call.query, call.key, call.value))
        got = self.call(q, k, v, call.allowed, label=label, observe=True)
        return partition(got.record, t_q, t_k) if got.ok else None

    def _blocks_hold(self, call: Call, sm, t_q: int, t_k: int) -> bool:
        """Whether weights over blocks, (..., n_blocks, n, m), are blocks of consecutive tokens as `block_diagonal`
        reads them (block j's rows the tokens j x n + r, the outermost axis the batch): one observed call with a
        pattern of tokens moved must move exactly the rows of queries and values that reading predicts. Heads as
        many as the blocks a probe's tokens make (ScalableViT's windows of 6 on 12 x 12 with 4 heads) were read as
        blocks. True where the layer's record gives no one weighted sum to check it by (read as before)."""
        found = partition(call.record, t_q, t_k)
        n_blocks, n, m = sm.output.shape[-3:]
        if found is None or found.softmax is not sm or n != m or n_blocks * n != t_q or t_q != t_k:
            return True  # no one weighted sum to check by, or blocks of pooled queries (Hiera's mask units)
        key = ("blocks hold", tuple(call.query.shape), tuple(call.key.shape), None if call.allowed is None
               else id(call.allowed))
        if key not in self.memo:
            B = call.query.shape[0]
            numbers_q, numbers_k = numbers(B, t_q), numbers(B, t_k)
            checked = self._tagged_call(call, CHECKED(numbers_q), CHECKED(numbers_k),
                                        "tokens tagged by a pattern that checks the blocks' reading", t_q, t_k)
            blocks = found.queries.shape[0]

            def predicted(rows: int, length: int) -> Tensor:  # (L, rows): whether each row's token was moved
                lead = torch.arange(blocks).unsqueeze(1)
                b, j = lead // n_blocks // max(1, blocks // n_blocks // B), lead % n_blocks
                return CHECKED(b * length + j * rows + torch.arange(rows).unsqueeze(0) + 1)

            self.memo[key] = checked is not None and blocks % (n_blocks * B) == 0 and \
                torch.equal(moved_rows(found.queries, checked.queries), predicted(n, t_q)) and \
                torch.equal(moved_rows(found.values, checked.values), predicted(m, t_k))
        return self.memo[key]

    def own_reach(self) -> Tensor | None:
        """(Tq, Tk) bool, the standard probe's: the keys some query gives a nonzero weight in some batch row and head,
        for a layer whose weights (`weights`, else `recovered_weights`) hold exact zeros of its own making (a local
        attention's window: local-attention's buckets with their look-around, each query reaching its own bucket and
        its neighbours). A query with no key the audit's mask allows within its reach is, for the layer, a query with
        no key to attend, whatever the audit's mask says: its output is `fully_masked_rows`' to judge, not the mask's.
        None where no weights were read, where the standard probe was given a mask (zeros of the audit's making), or
        where every query reaches every key."""
        if "own_reach" not in self.memo:
            asking, self.detector = self.detector, "base"  # read for the asking detector, not one of its probes
            try:
                base, reach = self.base(), None
                own = base.ok and base.allowed is None  # zeros the audit's own mask (causal, a pattern) made are not its
                weights = self.weights(base)[0] if own else None
                if weights is None and own:
                    weights = self.recovered_weights()[0]
            finally:
                self.detector = asking
            T = self.t
            if weights is not None and weights.dim() >= 3 and tuple(weights.shape[-2:]) == (T, T):
                seen = (weights.detach() != 0).reshape(-1, T, T).any(0).cpu()  # (Tq, Tk)
                reach = None if bool(seen.all()) else seen
            self.memo["own_reach"] = reach
        return self.memo["own_reach"]

    def within_reach(self, allowed: Tensor) -> Tensor:
        """`allowed` (..., Tq, Tk), True = may attend, narrowed to the keys each query reaches (`own_reach`), where the
        layer's weights show a reach of its own and the shapes agree; else as it is."""
        reach = self.own_reach()
        if reach is None or tuple(allowed.shape[-2:]) != tuple(reach.shape):
            return allowed
        return allowed & reach.to(allowed.device)

    def recovered_weights(self) -> tuple[Tensor | None, str]:
        """For a layer given its values apart (a function f(q, k, v), a module given query, key and value) that
        exposes no weights and whose softmax, if any, is not over (Tq, Tk) scores (local attention's buckets,
        (windows, W, look-around)): weights read through the values. A function is first called with the identity
        as values (v[j] = e_j, d_v = Tk), so that its output *is* its weights; a layer that needs values of their
        own width is called once per key with that key's value row all ones and the others zero
        (`_through_one_hot_values`). None if the layer refuses, or if its output is not those weights applied to
        its values."""
        if self._recovered is None:
            asking, self.detector = self.detector, "base"
            form = self.subject.form
            try:
                self._recovered = (self._through_identity() if form == "function" else (None, ""))
                if self._recovered[0] is None and form in ("function", "qkv_module"):
                    self._recovered = self._through_one_hot_values()
                if self._recovered[0] is None and form == "self_module":
                    self._recovered = self._through_value_projection()
                if self._recovered[0] is None:  # weights over the layer's own partition of the tokens
                    base = self.base()
                    t = self.subject.time_dim
                    if base.ok:
                        self._recovered = self._tagged(base, base.query.shape[t], base.key.shape[t])
            finally:
                self.detector = asking
        return self._recovered

    def _through_identity(self) -> tuple[Tensor | None, str]:
        base, B, T = self.base(), self.BATCH, self.t
        eye = torch.eye(T, dtype=self.subject.dtype, device=self.subject.device)  # (Tk, Tk)
        v = eye.expand(B, base.key.shape[1], T, T).contiguous()  # (B, H, Tk, d_v = Tk)
        # values as wide as the keys are many: a layer that takes them as wide as q and k raises, no failure of its
        # (sinkhorn-transformer's LocalAttention reshapes v by q's width); the reading goes on one key at a time
        call = self.call(base.query, base.key, v, base.allowed, label="the standard probe with identity values",
                         reading=True)
        ok = call.ok and tuple(call.output.out.shape) == tuple(base.query.shape[:-1]) + (T,)
        return (call.output.out, "weights read through identity values (v = I)") if ok else (None, "")

    def _through_one_hot_values(self) -> tuple[Tensor | None, str]:
        """Weights read one key at a time: with value row j all ones and the others zero, output column c at query
        i is the weight of key j in the row of c's head, (..., Tq, C) for each j (see `_one_hot_reading`)."""
        base, t = self.base(), self.subject.time_dim
        if not base.ok or t != base.value.dim() - 2 or base.output.out.shape != base.query.shape[:-1] + \
                base.value.shape[-1:] or base.value.shape[t] > ONE_HOT_KEYS_MAX:
            return None, ""

        def attended(values: Tensor, label: str) -> Tensor | None:
            call = self.call(base.query, base.key, values, base.allowed, label=label)
            return call.output.out.detach() if call.ok else None

        weights = self._one_hot_reading(attended, base.value.detach(), base.output.out.detach())
        n = base.value.shape[t]
        return (weights, f"weights read through the values, one key at a time ({n} calls)") if weights is not None \
            else (None, "")

    def _through_value_projection(self) -> tuple[Tensor | None, str]:
        """For a module given one stream (linear attention, whose weights are never formed): the same reading, with
        the output of its value projection (`value_projection`) replaced, and what its output projection is given
        read as the attended values."""
        found = self.value_projection()
        if found is None or self.base().query.shape[1] > ONE_HOT_KEYS_MAX:  # one call per key
            return None, ""

        def attended(one_hot: Tensor, label: str) -> Tensor | None:
            return self.with_values(lambda values: one_hot.to(values.dtype), f"{label} (the output of {found.name})")

        weights = self._one_hot_reading(attended, found.values, found.attended)
        n = self.base().query.shape[1]
        return (weights, f"weights read through the values, the output of {found.name}, one key at a time ({n} "
                         f"calls)") if weights is not None else (None, "")

    def value_projection(self, nth: int = 0) -> ValueProjection | None:
        """A module given one stream: its value projection, an nn.Linear called before the last one whose output (or
        the last part of it, a half or a third: a fused `to_kv` or `to_qkv`, chunked k, v or q, k, v), doubled,
        doubles what the output projection is given (the weights do not depend on the values; on q or k they do). The
        output projection (the last nn.Linear whose output has the queries' rows: a joint layer's image projection,
        its text's left empty; PAG's, called on each chunk) is never taken, nor a call whose output is the layer's or
        a part of it; what it is given is read where its output is the layer's, else the layer's output. None where
        none is. Read once (cached), in one call per candidate, at any length (the weights read one key at a time
        through it, `_through_value_projection`, stop at ONE_HOT_KEYS_MAX keys; keys_matter's move does not).
        `nth`: the nth such projection in the order they are tried (keys_matter tries another where the first moved
        no other row: a linear gate, `out = attn * g(x)`, also doubles the output)."""
        found = self.memo.setdefault("value_projections", [])
        search = self.memo.setdefault("value_search", self._value_projections())
        asking, self.detector = self.detector, "base"  # read for the asking detector, not one of its probes
        try:
            while len(found) <= nth and (more := next(search, None)) is not None:
                found.append(more)
        finally:
            self.detector = asking
        return found[nth] if nth < len(found) else None

    def _value_projections(self):
        layer, base = getattr(self.subject, "layer", None), self.base()
        if not isinstance(layer, torch.nn.Module) or not base.ok or \
                not any(isinstance(m, torch.nn.Linear) for m in layer.modules()):
            return
        attended_base, calls = self._linear_run({}, "the standard probe, what its output projection is given")
        if attended_base is None:
            return
        width, names = attended_base.shape[-1], {m: name for name, m in layer.named_modules()}
        wide = torch.float64 if self.subject.dtype == torch.float64 else torch.float32
        scale = float(attended_base.to(wide).pow(2).mean().sqrt()) or 1.0
        shaped = [m for m, _, out in calls if tuple(out.shape) == tuple(base.query.shape[:-1]) + (width,)]
        last = shaped[-1] if shaped else calls[-1][0]  # the output projection: the last that makes the queries' rows
        # one the layer names its values first (v_proj, value, to_v), then in call order, never one it names its
        # queries', keys' or a gate's: where the weights are linear in q and k too (no softmax), doubling q doubles
        # the output as well, and q's projection, called first, was taken for the values (BERT's and ViT's no-softmax
        # twins "read their own value only"); so does a linear gate's
        for module, _, output in sorted(calls[:-1], key=lambda c: _names_role(names[c[0]]) != "values"):
            if module is last or _names_role(names[module]) == "not the values":
                continue
            n = output.shape[-1]
            if output.shape[:-1] != base.query.shape[:-1] or n not in (width, 2 * width, 3 * width) or \
                    _slice_of(output, attended_base) or _slice_of(output, base.output.out.detach()):
                continue  # the output itself, or a part of it (an output projection called on each chunk), is none
            part = slice(n - width, n)  # the whole output, or its last half or third (v of k, v or q, k, v)
            doubled, _ = self._linear_run({module: part_replaced(part, lambda out: 2 * out)},
                                          f"the standard probe with {names[module]}'s output doubled")
            if doubled is not None and doubled.shape == attended_base.shape and float(
                    (doubled.to(wide) - 2 * attended_base.to(wide)).abs().max()) / scale <= tolerance(
                    ROW_SUM, self.subject.dtype):
                share = {1: "", 2: " (its last half, the values)", 3: " (its last third, the values)"}[n // width]
                yield ValueProjection(module, part, names[module] + share, output[..., part], attended_base)

    def with_values(self, values, label: str, found: ValueProjection | None = None) -> Tensor | None:
        """What the output projection is given (or the layer's output) on the standard probe's inputs with the value
        projection's output (`found`, else `value_projection`'s first) replaced by `values(its output)`; None where
        the call raised."""
        found = found or self.value_projection()
        return self._linear_run({found.module: part_replaced(found.part, values)}, label)[0]

    def _linear_run(self, replace: dict, label: str) -> tuple[Tensor | None, list]:
        """The standard probe's inputs called once, forward hooks on the layer's nn.Linear modules, `replace` mapping
        a module to a function of its output that gives the output it returns instead: (what the last nn.Linear
        whose output is the layer's is given (its output projection: a joint layer projects the image's tokens, then
        the text's, left empty), else the layer's output; (module, input, output) of every nn.Linear call, in order),
        or (None, those calls) where the call raised."""
        base, seen = self.base(), []

        def hook(module, args, output):
            seen.append((module, args[0].detach() if args and isinstance(args[0], Tensor) else None, output.detach()))
            return replace[module](output) if module in replace else None

        handles = [m.register_forward_hook(hook) for m in self.subject.layer.modules()
                   if isinstance(m, torch.nn.Linear)]
        try:
            call = self.call(base.query, base.key, base.value, base.allowed, label=label)
        finally:
            for h in handles:
                h.remove()
        if not call.ok or not seen:
            return None, seen
        for module, given, out in reversed(seen):  # the output projection: the last whose output is the layer's
            if out.shape == call.output.out.shape and torch.equal(out, call.output.out.detach()) and \
                    given is not None and module not in replace:
                return given, seen
        return call.output.out.detach(), seen

    def _one_hot_reading(self, attended, values: Tensor, out: Tensor) -> Tensor | None:
        """(..., H, Tq, Tk) weights from `attended(v, label)`, what the layer makes of values `v` (..., Tk, C) as
        it made `out` (..., Tq, C) of `values`: value row j all ones and the others zero gives, in column c at
        query i, the weight of key j in the row of c's head. Taken only if the columns of one head agree (all C,
        or each of num_heads slices) and `out` is these weights applied to `values` (the output is linear in the
        values, with weights that do not depend on them: no projection after the weighted sum); else None."""
        s = self.subject
        per_key = []
        for j in range(values.shape[-2]):
            v = torch.zeros_like(values)
            v[..., j, :] = 1  # key j's value row all ones
            got = attended(v, f"the standard probe with key {j}'s values ones, the others zero")
            if got is None or got.shape != out.shape:
                return None
            per_key.append(got)
        w = torch.stack(per_key, -1)  # (..., Tq, C, Tk): the weight of key j for output column c
        wide = torch.float64 if s.dtype == torch.float64 else torch.float32
        out = out.to(wide)
        scale = float(out.pow(2).mean().sqrt()) or 1.0
        # the row-sum bound: the rebuilt output is the read rows' sums of products. Measured (5 seeds of
        # tests/test_layer_causes.py's BucketedLocalAttention): float64 5.1e-16, float32 2.7e-7 (margin 366x), float16
        # 1.1e-3 (4.5x), bfloat16 1.35e-2 (2.2x); the columns of one head agree exactly; with an output projection: 5.4
        tol = tolerance(ROW_SUM, s.dtype)
        rebuilt = (w.to(wide) * values.to(wide).transpose(-2, -1).unsqueeze(-3)).sum(-1)  # (..., Tq, C)
        if float((rebuilt - out).abs().max()) / scale > tol:
            return None
        C = w.shape[-2]
        for heads in dict.fromkeys((1, s.num_heads)):
            if not heads or C % heads:
                continue
            grouped = w.unflatten(-2, (heads, C // heads))  # (..., Tq, H, C/H, Tk)
            if float((grouped - grouped[..., :1, :]).abs().max()) <= tol:
                return grouped[..., 0, :].movedim(-2, -3)  # (..., H, Tq, Tk)
        return None


@dataclass(frozen=True)
class ValueProjection:
    """A one-stream module's value projection (`Probe.value_projection`): the nn.Linear, the part of its output that
    is the values (all of it, or the last half or third of a fused one), how the report names it, those values on the
    standard probe, and what the output projection was given there."""

    module: torch.nn.Module
    part: slice
    name: str
    values: Tensor
    attended: Tensor


NOT_VALUE_WORDS = frozenset(("q", "query", "queries", "xq", "wq", "wk", *KEY_NAMES, "g", "gate", "gates", "gating"))
"""Words of a module's name that say it makes no values: a query's, a key's or a gate's."""


def _names_role(name: str) -> str:
    """What a module's name says it makes: "values" where a word of its name (any part: `q_proj.0`, PEFT's
    `v_proj.base_layer`) is one of VALUE_NAMES (v_proj, value, to_v, w_v), "not the values" where one is a query's,
    a key's or a gate's (q_proj, query, to_k, wq, gate, g_proj), else ""."""
    words = set(name.lower().replace(".", "_").split("_"))
    return "values" if words & {*VALUE_NAMES, "wv"} else "not the values" if words & NOT_VALUE_WORDS else ""


def _slice_of(part: Tensor, whole: Tensor) -> bool:
    """Whether `part` is `whole`, or `whole` narrowed along its first or second axis (an output projection called on
    each of a batch's chunks, PAG's, and the chunks' outputs concatenated)."""
    if part.dim() != whole.dim() or part.shape[2:] != whole.shape[2:]:
        return False
    for dim in (0, 1):
        if part.shape[1 - dim] != whole.shape[1 - dim]:
            continue
        for start in range(whole.shape[dim] - part.shape[dim] + 1):
            if torch.equal(whole.narrow(dim, start, part.shape[dim]), part.to(whole.dtype)):
                return True
    return False


def part_replaced(part: slice, values):
    """A forward hook's replacement: the output with its `part` (of the last axis) made `values(that part)`."""
    def replaced(out: Tensor) -> Tensor:
        out = out.clone()
        out[..., part] = values(out[..., part])
        return out
    return replaced


ONE_HOT_KEYS_MAX = 64
"""The most keys weights are read one key at a time for (one call per key): the standard probe has 16."""


def appended_keys(layer) -> int:
    """Keys a layer appends of its own, which no input reaches: nn.MultiheadAttention's add_bias_kv and
    add_zero_attn add one each."""
    if isinstance(layer, torch.nn.MultiheadAttention):
        return int(layer.bias_k is not None) + int(bool(layer.add_zero_attn))
    return 0
