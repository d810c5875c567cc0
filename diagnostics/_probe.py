"""The probing session: inputs from a private generator, masks in one convention, calls that never raise.

Every detector asks the `Probe` for inputs and calls; the probe counts forward passes (the audit's cost
is a constant number of them, independent of the sequence length) and caches the standard run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._observe import Observer, Record
from ._subject import Output, Subject


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

    @property
    def ok(self) -> bool:
        return self.output is not None

    def describe_error(self) -> str:
        text = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
        return f"{type(self.error).__name__}: {text[:160]}"


class Probe:
    BATCH = 2

    def __init__(self, subject: Subject, *, causal: bool, scale: float | None, seq_len: int, seed: int):
        self.subject, self.causal, self.scale, self.seed = subject, causal, scale, seed
        self.t = seq_len
        self.passes = 0
        # A layer that takes a mask and does not declare its own causality is made causal by the mask.
        self.pass_causal_mask = causal and subject.takes_mask and not subject.builtin_causal
        self._base: Call | None = None

    # ---- inputs ----------------------------------------------------------------------------------------
    def generator(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + salt)

    def make(self, salt: int, batch: int, t: int, **kw) -> Tensor:
        return self.subject.make(self.generator(salt), batch, t, **kw)

    def streams(self, salt: int, batch: int, t_q: int, t_k: int | None = None, *, cross: bool | None = None,
                **kw) -> tuple[Tensor, Tensor, Tensor]:
        """(query, key, value). Self forms and causal audits get one stream (x, x, x); otherwise the query
        is a separate tensor from the memory, which is both key and value (a function gets three)."""
        t_k = t_q if t_k is None else t_k
        cross = (self.subject.separate_kv and not self.causal) if cross is None else cross
        if not cross:
            x = self.make(salt, batch, t_q, **kw)
            return x, x, x
        q = self.make(salt, batch, t_q, **kw)
        k = self.make(salt + 1, batch, t_k, **kw)
        v = self.make(salt + 2, batch, t_k, **kw) if self.subject.form == "function" else k
        return q, k, v

    def allowed(self, batch: int, t_q: int, t_k: int, extra: Tensor | None = None) -> Tensor | None:
        """The mask to pass, (B, Tq, Tk) True = may attend: `extra` and, when the audit makes the layer
        causal through its mask, the bottom-right causal mask."""
        mask = extra
        if self.pass_causal_mask:
            i = torch.arange(t_q).unsqueeze(-1)  # (Tq, 1)
            j = torch.arange(t_k)  # (Tk,)
            causal = (j <= i + t_k - t_q).expand(batch, t_q, t_k)  # (B, Tq, Tk)
            mask = causal if mask is None else mask & causal
        return None if mask is None else mask.to(self.subject.device)

    def padding(self, batch: int, t_q: int, t_k: int) -> Tensor:
        """(B, Tq, Tk): batch row b keeps its first `lengths[b]` keys, at least one, at most Tk - 1."""
        g = self.generator(97)
        lengths = torch.randint(max(1, t_k // 2), max(t_k, 2), (batch,), generator=g).clamp(max=max(t_k - 1, 1))
        return (torch.arange(t_k) < lengths.view(batch, 1, 1)).expand(batch, t_q, t_k).clone()

    # ---- calls -----------------------------------------------------------------------------------------
    def call(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor | None = None, *,
             observe: bool = False) -> Call:
        """Call the layer; exceptions become part of the `Call`. With `observe`, record its internals
        (under grad mode, so that torch's fused inference fast paths, which hide them, are not taken)."""
        self.passes += 1
        record = None
        try:
            if observe:
                observer = Observer()
                with torch.enable_grad(), observer:
                    output = self.subject(query, key, value, allowed)
                record = observer.record
            else:
                with torch.no_grad():
                    output = self.subject(query, key, value, allowed)
            return Call(query, key, value, allowed, output, None, record)
        except Exception as error:  # a broken layer is a finding, never a crash of the audit
            return Call(query, key, value, allowed, None, error, record)

    def base(self) -> Call:
        """The standard run: batch 2, seq_len tokens, no mask beyond the causal one; observed."""
        if self._base is None:
            q, k, v = self.streams(0, self.BATCH, self.t)
            self._base = self.call(q, k, v, self.allowed(self.BATCH, self.t, self.t), observe=True)
        return self._base


def batched(*tensors: Tensor) -> Tensor:
    """Stack probe variants along the batch so that one forward pass evaluates all of them."""
    return torch.cat(tensors, dim=0)


def perturb(x: Tensor, positions: Tensor, time_dim: int, gen: torch.Generator) -> Tensor:
    """A copy of `x` with new random values where `positions` is True, the same elsewhere. `positions`
    is bool over time, (T,), or over batch and time, (B, T)."""
    draw = torch.float64 if x.dtype == torch.float64 else torch.float32
    noise = torch.randn(x.shape, generator=gen, dtype=draw).to(device=x.device, dtype=x.dtype)
    shape = [1] * x.dim()
    shape[time_dim] = x.shape[time_dim]
    if positions.dim() == 2:
        shape[0] = x.shape[0]
    where = positions.to(x.device).view(shape)
    return torch.where(where, noise, x)
