"""What the model-level detectors are judged on: `ModelContext` (the model, how it is called, its attention
modules and their in-place wrappers, the float64 copy parity checks compare with), and the `Need`s a model
detector declares on it, which `_registry.run()` evaluates before calling the check.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._guard import cut_from
from .._registry import Need
from ._runner import Runner


@dataclass
class ModelContext:
    model: nn.Module
    runner: Runner
    causal: bool
    seed: int
    dtype: torch.dtype
    modules: dict  # {path: module} of every attention module the forward calls, in place or not
    wrappers: dict  # {path: InPlace} of those that could be wrapped for an in-place audit
    time_dims: dict  # {path: the sequence dimension of the module's hidden states} (0: sequence-first)
    order: list  # the modules' paths in call order
    runs: list = field(default_factory=list)  # why the model did not run on the audit's inputs (model_runs)
    raised_in: str | None = None  # the attention module the model raised inside, if it did
    readings: dict = field(default_factory=dict)  # per-detector numbers for reports (reach per layer, cache errors)
    layer_calls: int = 0
    packed: bool | None = None  # audit_model's `packed`: the model separates packed documents (None: watch for it)
    full: tuple | None = None  # (inputs, output) of the plain full forward, shared by the checks
    by_design: dict = field(default_factory=dict)  # parameter -> why it gets no gradient (gradients.ByDesign) or None
    _twin: object = None
    _twin_failed: bool = False
    _golden_seen: list = field(default_factory=list)  # [(inputs, options, output)]: one float64 forward per input

    @property
    def T(self) -> int:
        """The audit's sequence length (0 where the input is no sequence)."""
        return self.runner.inputs.shape[1] if self.runner.sequence else 0

    def twin64(self) -> nn.Module | None:
        """The model's float64 copy (made once, in eval mode), or None where the model is float64 already or cannot
        be copied."""
        if self.dtype == torch.float64:
            return None
        if self._twin is None and not self._twin_failed:
            try:
                self._twin = eager_experts(model_copy(self.model, dtype=torch.float64).eval())
            except Exception:  # a model that cannot be copied
                self._twin_failed = True
        return self._twin

    def float64_output(self, seq: Tensor, **kw) -> Tensor | None:
        """The float64 copy's output on a call (the full pass `golden` keeps, or a tested call that `Golden.judge64`
        judges), or None where no copy can be made or it does not run so."""
        if self.twin64() is None:
            return None
        try:
            out, _ = self.runner(seq, model=self._twin, **kw)
        except Exception:  # the copy does not run so: the judgement at the model's own dtype stands
            return None
        return out

    def golden(self, seq: Tensor, **kw) -> Tensor | None:
        """The float64 copy's output on the same inputs, or None where no copy can be made."""
        if self.twin64() is None:  # float64 already, or a model that cannot be copied: parity against its own pass
            return None
        for seen, options, out in self._golden_seen:
            if seen.shape == seq.shape and torch.equal(seen, seq) and options.keys() == kw.keys() and \
                    all(torch.equal(options[k], kw[k]) for k in kw):
                return out
        out = self.float64_output(seq, **kw)
        if out is not None:  # None: the copy does not run, parity against the same-dtype pass
            self._golden_seen.append((seq, kw, out))
        return out


def model_copy(model: nn.Module, *, dtype: torch.dtype | None = None) -> nn.Module:
    """A deep copy of the model (its modules, buffers and config its own) for forwards under no_grad. dtype None: the
    parameters are the model's own tensors, not copies (a forward without autograd does not change them, and the
    audit's guard restores any that would); a dtype: each floating parameter converted straight to it, not cloned
    first and converted after, the same values as `copy.deepcopy(model).to(dtype)` without the transient copy (a
    12-layer, 256-wide GPT-2 holds 40 MB of float32 parameters). Tied parameters stay tied (one entry per tensor)."""
    memo: dict = {}
    for p in model.parameters():
        if dtype is None:
            memo[id(p)] = p
        elif p.is_floating_point() and type(p).__deepcopy__ is nn.Parameter.__deepcopy__:
            memo[id(p)] = type(p)(p.detach().to(dtype), p.requires_grad)  # what Parameter.__deepcopy__ builds
    twin = cut_from(copy.deepcopy(model, memo), model)
    return twin if dtype is None else twin.to(dtype)


def eager_experts(model: nn.Module) -> nn.Module:
    """`model` with its mixture-of-experts layers computed expert by expert (transformers' "eager" experts), where it
    dispatches them otherwise: transformers 5's default `grouped_mm` takes float32, bfloat16 and float16 only, so a
    float64 copy of any MoE model (Jamba, Mixtral, Qwen3-MoE) raised, and its parity checks fell back to a bare 1e-5
    floor against its own float32 pass, whatever that pass's own rounding. The same function: the experts' sum, in
    another order of operations."""
    setter = getattr(model, "set_experts_implementation", None)
    # the model's own config, or a submodel's (a speech or vision LM whose experts are its language model's:
    # Nemotron 3.5 Transcribe's Nemotron-H, whose float64 copy raised while the top config names no experts)
    configs = [getattr(m, "config", None) for m in model.modules()]
    if callable(setter) and any(getattr(c, "_experts_implementation", None) not in (None, "eager") for c in configs):
        setter("eager")
    return model


SEQUENCE = Need("a sequence input", lambda c: c.runner.sequence, "the input is not a sequence")
CAUSAL_MODEL = Need("{causal}", lambda c: c.causal, "the model is not causal (pass {causal} if it is)")


def at_least(n: int) -> Need:
    """The audit's sequence is `n` positions or longer."""
    return Need(f"seq_len >= {n}", lambda c: c.T >= n, f"seq_len < {n}")


__all__ = ["CAUSAL_MODEL", "SEQUENCE", "ModelContext", "at_least", "model_copy"]
