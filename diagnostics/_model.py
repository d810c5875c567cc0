"""audit_model(): every attention layer of a model audited in place, plus the properties only a model has.

1. **Find** the attention modules: torch's `nn.MultiheadAttention`, timm's and Hugging Face's attention classes
   (by class), and any module that runs a softmax over (Tq, Tk) scores or a fused SDPA call in one observed
   forward (the innermost such module with parameters).
2. **Capture** what the model really passes each of them (forward pre-hooks with kwargs), at the audit's length
   T and at T - 1: the arguments whose sizes follow the sequence (masks, rotary tables, position biases) are
   those that change, and are cut to the prefix a probe needs. Each module is then audited by `audit()` through
   a wrapper `forward(x)` that replaces only its hidden-state input (and key/value where they are that same
   tensor) and keeps the model's masks, position embeddings and other arguments: the model's call is the
   convention.
3. **Model-level detectors** (`MODEL_DETECTORS`), on the model's own outputs: prefix causality (with the first
   layer a future perturbation reaches), cache parity through the model's own cache, padding invariance (right,
   and left with position ids), batch invariance, backend parity (Hugging Face eager / sdpa), gradient flow,
   and the sliding window each layer declares. Parity tolerances follow the float64-golden rule of PyTorch's own
   tests: the tested path's error against a float64 copy of the model may be at most `FUDGE` times the error of
   the same-dtype reference path (`FUDGE_BY_DTYPE` for bfloat16), plus a floor (see `GOLDEN_FLOOR`).

The model, its modes, parameters, buffers, gradients, attention implementation and the global RNG are left as
they were. A model that raises is a finding (`model_runs`), never a crash of the audit.

Plain (non-Hugging Face) models take part in padding, position and cache checks through the same keyword
protocol as Hugging Face's: `forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None,
use_cache=False)` with `attention_mask` (B, T) 1 = real token, returning logits, or `(logits, cache)` when
`use_cache=True`; each check that a model's forward cannot take says so in a skip.
"""

from __future__ import annotations

import contextlib
import copy
import html
import inspect
import math
import re
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ._errors import AuditUsageError, expect
from ._guard import untouched
from ._result import DetectorResult
from ._thresholds import UNCHANGED, dtype_name, tolerance

# ---- thresholds -------------------------------------------------------------------------------------------

# Parity checks (cache, padding, batch, backend): error of the tested path against a float64 copy of the model
# <= FUDGE x the error of the same-dtype full pass against it, + GOLDEN_FLOOR[dtype] (relative to the RMS of the
# float64 outputs). PyTorch's FlexAttention tests use 10 for float32. `python benchmarks/model_audit_cost.py
# --margins --seeds 3` (24 correct float32 models: TinyGPT, ProtocolGPT, torch's encoder, ten Hugging Face
# families in eager and sdpa mode): cache, padding, batch and backend parity reached at most 7.1e-2 of their
# threshold (1.2e-6 against 1.7e-5: margin 14x); the bugs of tests/test_model_audit.py measure errors of 1e-2 and
# more (the rotary cache offset: 4e-2 to 7.5e-2 of the logits' RMS), over a thousand times the threshold.
#
# bfloat16 gets its own, measured factor: there the same-dtype full pass is itself 1.4e-2 to 2.4e-2 of the logits'
# RMS off the float64 copy, so 10 x that allowed about 0.19 and the rotary cache-offset bug (7.6e-2 to 0.15 of
# the RMS; ProtocolGPT, seeds 0-7) passed. `python benchmarks/model_audit_cost.py --margins --seeds 3 --dtype
# bfloat16` (the same 24 correct models, 3 seeds, CPU): the tested path's error reached at most 1.31 x the full
# pass's own (padding, T5 sdpa; cache 1.28 x, Qwen2 sdpa), and with 2 x + the floor value / threshold at most 0.47
# (margin 2.1x); the rotary bug fails by 1.48x to 2.8x (7.6e-2 against 5.2e-2 at its mildest seed), localised to
# its layer. float16 keeps 10 x: its full pass is 1.8e-3 to 2.4e-3 off, and the same bug fails by 2.9x or more
# (seeds 0-7).
# Measured on CPU only: GPU kernels that round the cached and full paths differently may need more.
FUDGE = 10.0
FUDGE_BY_DTYPE = {torch.bfloat16: 2.0}
GOLDEN_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

MODEL_DETECTORS = {
    "model_runs": "the model runs on the audit's inputs (the example, its prefixes, the padded and cached calls)",
    "prefix_causality": "for a causal model, changing tokens after t leaves every output at and before t "
                        "unchanged; the first layer a future change reaches is reported",
    "cache_parity": "prefill plus steps of 1, 3 and an uneven split through the model's own cache give the "
                    "full forward's logits",
    "padding_invariance": "right padding, and left padding with the position ids it needs, leave the outputs "
                          "at real tokens unchanged, whatever the padded tokens contain",
    "batch_invariance": "a sequence alone gives what it gives inside a batch of sequences of other lengths",
    "backend_parity": "Hugging Face attention implementations (eager, sdpa) agree",
    "gradient_flow": "every attention parameter gets a finite non-zero gradient; for a causal model, no output "
                     "sends gradient to later input embeddings",
    "sliding_window": "a layer that declares a sliding window w sees exactly the last w positions",
}

FIXES = {
    "model_runs": "make the model accept the inputs shown (or pass example= in the form it takes)",
    "prefix_causality": "build the causal mask for every attention layer (and for every path: padding, "
                        "cached and uncached), aligned bottom-right",
    "cache_parity": "keep the causal mask when a cache is attached (prefill of several tokens too), offset "
                    "positions (rotary, learned) by the cache length, and align the mask bottom-right",
    "padding_invariance": "combine the padding mask with the causal mask (AND), and derive position ids from the "
                          "attention mask under left padding: position_ids = attention_mask.cumsum(-1) - 1",
    "batch_invariance": "make each sequence's computation independent of the others (masks and positions per "
                        "row, no statistics over the batch)",
    "backend_parity": "give every attention implementation the same mask, in its own convention, and the same "
                      "scale and causality",
    "gradient_flow": "compute attention with autograd on (no .detach(), no torch.no_grad()), and keep the causal "
                     "mask in the backward path",
    "sliding_window": "allow keys j with i - w < j <= i: mask (i - j) >= w, not > w",
}

TORCH_ATTENTION = (nn.MultiheadAttention,)
HIDDEN_NAMES = ("hidden_states", "x", "query", "q", "tgt", "src", "inputs", "input", "hidden", "h")
CACHE_NAMES = ("past_key_value", "past_key_values", "layer_past", "kv_cache", "cache", "past")
MAIN_INPUT_NAMES = ("input_ids", "idx", "tokens", "ids", "x", "src", "tgt", "inputs_embeds", "pixel_values",
                    "input", "inputs")
# An example's entries aligned with the tested sequence: the checks cut and pad the sequence, and build these
ALIGNED_NAMES = ("attention_mask", "position_ids", "token_type_ids", "decoder_attention_mask", "decoder_position_ids",
                 "cache_position")
CONTEXT_NAMES = ("block_size", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length")


class ModelAuditError(AssertionError):
    """Raised by `ModelReport.raise_for_findings()` unless the model audit passed."""


@dataclass(frozen=True)
class ModelFinding:
    """A warning or failure of the model audit: of one attention layer (`layer`, its module path) or of the
    model as a whole (`layer` None)."""

    detector: str
    verdict: str
    message: str
    evidence: str = ""
    fix: str = ""
    layer: str | None = None
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class FoundModule:
    path: str
    cls: str
    how: str
    called: bool = True


@dataclass
class ModelReport:
    model: str
    status: str
    status_reason: str
    causal: bool
    causal_source: str
    seq_len: int
    dtype: str
    found: list[FoundModule]
    layers: dict  # {module path: AuditReport}
    results: list[DetectorResult]  # the model-level detectors
    result_layers: dict = field(default_factory=dict)  # {model-level detector: the layer it localised to}
    readings: dict = field(default_factory=dict)  # per-detector numbers for reports (reach per layer, cache errors)
    model_forwards: int = 0
    layer_calls: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def findings(self) -> list[ModelFinding]:
        out = [ModelFinding(r.detector, r.verdict, r.message, r.evidence, r.fix, self.result_layers.get(r.detector),
                            r.value, r.threshold) for r in self.results if r.fired]
        for path, rep in self.layers.items():
            out += [ModelFinding(r.detector, r.verdict, r.message, r.evidence, r.fix, path, r.value, r.threshold)
                    for r in rep.findings]
        return out

    def result(self, detector: str) -> DetectorResult:
        for r in self.results:
            if r.detector == detector:
                return r
        raise AuditUsageError(f"expected a model-level detector this audit ran ({', '.join(r.detector for r in self.results)}); "
                              f"got {detector!r}. Fix: check the spelling; per-layer results are in report.layers")

    def fired(self) -> dict:
        """{(layer path or None, detector): verdict} for every warning and failure."""
        return {(f.layer, f.detector): f.verdict for f in self.findings}

    def raise_for_findings(self) -> None:
        __tracebackhide__ = True
        if not self.passed:
            raise ModelAuditError(str(self))

    def __str__(self) -> str:
        lines = [f"model audit of {self.model}: {self.status.upper()} ({'causal' if self.causal else 'not causal'}"
                 f" ({self.causal_source}), seq_len={self.seq_len}, {self.dtype}, {len(self.layers)} attention "
                 f"layers, {self.model_forwards} model forwards + {self.layer_calls} layer calls, {self.seconds:.2f} s)"]
        if self.status_reason:
            lines.append(f"  {self.status_reason}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += ["", "attention modules found:"]
        lines += [f"  {f.path}  {f.cls}  ({f.how}{'' if f.called else '; not called by the forward: not audited'})"
                  for f in self.found] or ["  none"]
        if self.results:
            width = max(len(r.detector) for r in self.results)
            lines += ["", "model-level:"]
            for r in self.results:
                at = self.result_layers.get(r.detector)
                lines.append(f"  {r.detector:<{width}}  {r.verdict.upper():<5}  {r.message}" + (f"  [at {at}]" if at else ""))
        if self.layers:
            width = max(len(p) for p in self.layers)
            lines += ["", "layers (audited in place):"]
            for path, rep in self.layers.items():
                fired = ", ".join(f"{r.detector} {r.verdict}" for r in rep.results if r.fired or r.verdict == "error")
                lines.append(f"  {path:<{width}}  {rep.status.upper():<12}  {fired}")
        for f in self.findings:
            where = f" at {f.layer}" if f.layer else ""
            lines += ["", f"{f.verdict.upper()} {f.detector}{where}: {f.message}"]
            if f.evidence:
                lines.append(f"  evidence: {f.evidence}")
            if f.fix:
                lines.append(f"  fix:      {f.fix}")
        for path, rep in self.layers.items():
            if rep.status == "inconclusive":
                lines += ["", f"INCONCLUSIVE {path}: {rep.status_reason}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "status": self.status, "status_reason": self.status_reason, "passed": self.passed,
            "causal": self.causal, "causal_source": self.causal_source, "seq_len": self.seq_len, "dtype": self.dtype,
            "model_forwards": self.model_forwards, "layer_calls": self.layer_calls, "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            "found": [{"path": f.path, "class": f.cls, "how": f.how, "called": f.called} for f in self.found],
            "results": [{"detector": r.detector, "verdict": r.verdict, "message": r.message, "value": r.value,
                         "threshold": r.threshold, "evidence": r.evidence, "fix": r.fix,
                         "layer": self.result_layers.get(r.detector)} for r in self.results],
            "layers": {p: rep.to_dict() for p, rep in self.layers.items()},
            "findings": [{"detector": f.detector, "verdict": f.verdict, "message": f.message, "evidence": f.evidence,
                          "fix": f.fix, "layer": f.layer} for f in self.findings],
        }

    def to_html(self, path) -> None:
        """A self-contained page: status, modules found, model-level results, the per-layer table, findings."""
        from pathlib import Path

        Path(path).write_text(model_report_html(self), encoding="utf-8")


def model_report_html(report: ModelReport, *, standalone: bool = True) -> str:
    e = html.escape
    colour = {"pass": "#d8f0d8", "warn": "#fff0c0", "fail": "#f8c8c8", "skip": "#eeeeee", "error": "#f0d0f0",
              "passed": "#d8f0d8", "failed": "#f8c8c8", "inconclusive": "#fff0c0"}
    rows = "".join(f"<tr><td><code>{e(f.path)}</code></td><td>{e(f.cls)}</td><td>{e(f.how)}</td></tr>"
                   for f in report.found)
    model_rows = "".join(
        f"<tr style='background:{colour.get(r.verdict, '#fff')}'><td>{e(r.detector)}</td><td>{e(r.verdict)}</td>"
        f"<td>{e(r.message)}</td><td>{e(report.result_layers.get(r.detector) or '')}</td><td>{e(r.evidence)}</td></tr>"
        for r in report.results)
    layer_rows = "".join(
        f"<tr style='background:{colour.get(rep.status, '#fff')}'><td><code>{e(p)}</code></td><td>{e(rep.status)}</td>"
        f"<td>{e(', '.join(f'{r.detector} {r.verdict}' for r in rep.results if r.fired or r.verdict == 'error'))}"
        f"</td></tr>" for p, rep in report.layers.items())
    findings = "".join(
        f"<li><b>{e(f.verdict.upper())} {e(f.detector)}</b>{' at <code>' + e(f.layer) + '</code>' if f.layer else ''}: "
        f"{e(f.message)}<br><small>evidence: {e(f.evidence)}</small><br><small>fix: {e(f.fix)}</small></li>"
        for f in report.findings)
    body = (f"<h2>Model audit of {e(report.model)}: {e(report.status.upper())}</h2>"
            f"<p>{e(report.status_reason)}</p><p>{'causal' if report.causal else 'not causal'} ({e(report.causal_source)}), "
            f"seq_len {report.seq_len}, {e(report.dtype)}, {report.model_forwards} model forwards, "
            f"{report.seconds:.2f} s</p>"
            f"<h3>Attention modules found</h3><table border=1 cellpadding=3><tr><th>module</th><th>class</th>"
            f"<th>how</th></tr>{rows}</table>"
            f"<h3>Model-level detectors</h3><table border=1 cellpadding=3><tr><th>detector</th><th>verdict</th>"
            f"<th>message</th><th>layer</th><th>evidence</th></tr>{model_rows}</table>"
            f"<h3>Layers, audited in place</h3><table border=1 cellpadding=3><tr><th>layer</th><th>status</th>"
            f"<th>findings</th></tr>{layer_rows}</table>"
            f"<h3>Findings</h3><ul>{findings or '<li>none</li>'}</ul>")
    if not standalone:
        return body
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>model audit</title></head>"
            f"<body style='font-family:sans-serif'>{body}</body></html>")


# ---- calling the model -----------------------------------------------------------------------------------


def _first_tensor(x):
    if isinstance(x, Tensor):
        return x
    for name in ("logits", "last_hidden_state", "prediction_logits"):
        value = getattr(x, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(x, dict):
        for value in x.values():
            if isinstance(value, Tensor):
                return value
    if isinstance(x, (tuple, list)):
        for value in x:
            if isinstance(value, Tensor):
                return value
    return None


def _cache_of(x):
    for name in ("cache", "past_key_values"):  # transformers 5 names it `cache`, earlier versions past_key_values
        value = x.get(name) if isinstance(x, dict) else getattr(x, name, None)
        if value is not None and not isinstance(value, Tensor):
            return value
    if isinstance(x, (tuple, list)) and len(x) >= 2 and not isinstance(x[1], Tensor):
        return x[1]
    return None


def _is_hf(model) -> bool:
    return type(model).__module__.startswith("transformers.") and getattr(model, "config", None) is not None


def _context(model) -> int | None:
    found = []
    for holder in (model, getattr(model, "config", None)):
        for name in CONTEXT_NAMES:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(value)
    return min(found) if found else None


class Runner:
    """Calls the model by keyword with a main sequence input (token ids or embeddings, (B, T[, D])) and the
    options its forward takes; counts the forwards; returns the output tensor (logits or hidden states)."""

    def __init__(self, model: nn.Module, example, *, seq_len: int | None, seed: int):
        self.model = model
        try:
            self.params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            self.params = {}
        self.takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in self.params.values())
        self.forwards = 0
        self.hf = _is_hf(model)
        self.encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        self.fixed: dict = {}
        self.dropped: list[str] = []  # the example's per-position entries, which the checks build themselves
        self.main, inputs = self._example(example, seq_len, seed)
        self.inputs = inputs  # (B, T[, D]) or images
        self.sequence = self.main not in ("pixel_values",) and inputs.dim() in (2, 3) and (
            inputs.dim() == 2 or inputs.is_floating_point())
        self.tokens = not inputs.is_floating_point()
        self.vocab = self._vocab()
        torch_kind = isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder))
        self.causal_mask_name = None
        if torch_kind:
            self.causal_mask_name = "mask" if isinstance(model, nn.TransformerEncoder) else "tgt_mask"
        self.padding_name = ("decoder_attention_mask" if self.main == "decoder_input_ids" and
                             self.takes("decoder_attention_mask") else
                             "attention_mask" if self.takes("attention_mask") and self.main != "decoder_input_ids" else
                             "src_key_padding_mask" if isinstance(model, nn.TransformerEncoder) else
                             "tgt_key_padding_mask" if isinstance(model, nn.TransformerDecoder) else None)
        self.takes_positions = self.takes("position_ids") and self.main != "decoder_input_ids"
        self.cache_name = next((n for n in ("cache", "past_key_values") if self.takes(n)), None)
        self.takes_cache = self.cache_name is not None and (self.takes("use_cache") or self.hf)
        self.pass_causal = False  # set by audit_model: torch's stacks get the causal mask from the caller

    def takes(self, name: str) -> bool:
        return name in self.params

    def _vocab(self) -> int | None:
        if not self.tokens:
            return None
        config = getattr(self.model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
        emb = next((m for m in self.model.modules() if isinstance(m, nn.Embedding)), None)
        return emb.num_embeddings if emb is not None else int(self.inputs.max()) + 1

    def _example(self, example, seq_len, seed):
        model = self.model
        gen = torch.Generator().manual_seed(seed + 1000003)
        names = [n for n in self.params if self.params[n].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                                          inspect.Parameter.VAR_POSITIONAL)]
        first = names[0] if names else "input_ids"
        device, dtype = _device_dtype(model)
        if isinstance(example, Tensor):
            return first, example.to(device)
        if isinstance(example, dict):
            expect(example, "a non-empty dict of the model's inputs", "{}", "pass e.g. {'input_ids': ids}")
            main = next((n for n in ("decoder_input_ids",) if n in example and self.encoder_decoder), None) or \
                next((n for n in MAIN_INPUT_NAMES if n in example), None) or next(iter(example))
            for name, value in example.items():
                aligned = name in ALIGNED_NAMES and (name.startswith("decoder_") or main != "decoder_input_ids")
                if aligned:  # per position of the tested sequence: the audit builds the ones each check needs
                    self.dropped.append(name)
                elif name != main:
                    self.fixed[name] = value
            expect(isinstance(example[main], Tensor), f"a tensor for {main!r}", type(example[main]).__name__,
                   "pass token ids (B, T) or embeddings (B, T, D)")
            return main, example[main].to(device)
        expect(example is None, "example: token ids (B, T), embeddings (B, T, D) or a dict of the model's inputs",
               type(example).__name__, "pass e.g. example=torch.randint(vocab_size, (2, 16))")
        config = getattr(model, "config", None)
        T = seq_len or min(16, _context(model) or 16)
        if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
            D = model.layers[0].self_attn.embed_dim
            first_layer = model.layers[0]
            shape = (2, T, D) if first_layer.self_attn.batch_first else (T, 2, D)
            expect(first_layer.self_attn.batch_first, "torch transformer layers built with batch_first=True",
                   "batch_first=False", "build the layers with batch_first=True, or pass example= and audit "
                                        "through a module of your own that takes (B, T, D)")
            if isinstance(model, nn.TransformerDecoder):
                self.fixed["memory"] = torch.randn(2, T, D, generator=gen).to(device, dtype)
            return first, torch.randn(*shape, generator=gen).to(device, dtype)
        if config is not None and getattr(config, "vocab_size", None) and not hasattr(config, "image_size"):
            ids = torch.randint(config.vocab_size, (2, T), generator=gen).to(device)
            if self.encoder_decoder:
                self.fixed["input_ids"] = torch.randint(config.vocab_size, (2, T), generator=gen).to(device)
                return "decoder_input_ids", ids
            return "input_ids", ids
        size = getattr(config, "image_size", None) if config is not None else None
        if size is None and type(model).__module__.startswith("timm."):
            size = getattr(getattr(model, "patch_embed", None), "img_size", None)
        if size is not None:
            h, w = (size, size) if isinstance(size, int) else tuple(size)
            channels = getattr(config, "num_channels", 3) if config is not None else 3
            name = "pixel_values" if config is not None else first
            return name, torch.randn(2, channels, h, w, generator=gen).to(device, dtype)
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        expect(emb is not None, "example=..., or a model whose inputs can be built (a Hugging Face config, an "
               "nn.Embedding for token ids, torch's TransformerEncoder/Decoder, a timm vision model)",
               f"{type(model).__name__} with none of these", "pass example=torch.randint(vocab, (2, 16)) or a dict "
               "of the model's inputs")
        return first, torch.randint(emb.num_embeddings, (2, T), generator=gen).to(device)

    def __call__(self, seq: Tensor, *, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                 past=None, use_cache: bool | None = None, grad: bool = False, model: nn.Module | None = None):
        """(output tensor, cache or None). `attention_mask` (B, T) 1 = real token, in the model's spelling."""
        model = model or self.model
        kwargs = {}
        for name, value in self.fixed.items():
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] >= 1:
                # the example's first row for every sequence: rows compared with each other share it
                value = value[:1].expand(seq.shape[0], *value.shape[1:])
            kwargs[name] = value
        kwargs[self.main] = seq
        if attention_mask is not None:
            if self.padding_name in ("attention_mask", "decoder_attention_mask"):
                kwargs[self.padding_name] = attention_mask
            else:
                kwargs[self.padding_name] = attention_mask == 0  # torch's: True = padding
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self.pass_causal and self.causal_mask_name:
            T = seq.shape[1]
            kwargs[self.causal_mask_name] = nn.Transformer.generate_square_subsequent_mask(T, device=seq.device,
                                                                                            dtype=_float_dtype(model))
        if self.takes("use_cache") or self.takes_kwargs and self.hf:
            kwargs["use_cache"] = bool(use_cache)
        if past is not None:
            kwargs[self.cache_name] = past
        if isinstance(model, nn.TransformerDecoder) or isinstance(model, nn.TransformerEncoder):
            kwargs = {k: (v.to(_float_dtype(model)) if isinstance(v, Tensor) and v.is_floating_point() and
                          k not in ("src_key_padding_mask", "tgt_key_padding_mask") else v) for k, v in kwargs.items()}
        elif seq.is_floating_point():
            kwargs[self.main] = seq.to(_float_dtype(model))
        self.forwards += 1
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            result = model(**kwargs)
        out = _first_tensor(result)
        if out is None:
            raise TypeError(f"the model returned {type(result).__name__} with no tensor in it")
        return out, (_cache_of(result) if use_cache else None)

    def other_tokens(self, seq: Tensor, gen: torch.Generator) -> Tensor:
        """Every position changed: another token (ids), or a fresh draw pushed 1000x (embeddings)."""
        if self.tokens:
            shift = torch.randint(1, max(self.vocab, 2), seq.shape, generator=gen).to(seq.device)
            return (seq + shift) % self.vocab
        return torch.randn(seq.shape, generator=gen, dtype=torch.float32).to(seq.device, seq.dtype) * 1000


def _float_dtype(model: nn.Module) -> torch.dtype:
    return _device_dtype(model)[1]


def _device_dtype(model: nn.Module):
    counts: dict = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[(p.device, p.dtype)] = counts.get((p.device, p.dtype), 0) + p.numel()
    if not counts:
        return torch.device("cpu"), torch.float32
    return max(counts, key=counts.get)


def _pad_tokens(runner: Runner, shape, gen) -> Tensor:
    if runner.tokens:
        return torch.randint(max(runner.vocab, 1), shape, generator=gen).to(runner.inputs.device)
    return torch.randn(shape, generator=gen).to(runner.inputs.device, runner.inputs.dtype)


# ---- finding the attention modules ------------------------------------------------------------------------


def _class_kind(module: nn.Module) -> str | None:
    if isinstance(module, TORCH_ATTENTION):
        return "torch nn.MultiheadAttention"
    mod, name = type(module).__module__, type(module).__name__
    if mod.startswith("timm.") and name.endswith("Attention"):
        return "timm attention class"
    if mod.startswith("transformers.") and re.search(r"Attention$", name) and "Output" not in name:
        return "Hugging Face attention class"
    return None


def _innermost(paths: list[str]) -> list[str]:
    return [p for p in paths if not any(q != p and q.startswith(p + ".") for q in paths)]


def _observe_attention(runner: Runner) -> tuple[dict, str | None]:
    """{module path: how} for modules running a softmax over (.., Tq, Tk) scores or a fused SDPA call in one
    observed forward (innermost modules with parameters), and the model's error if it raised."""
    from ._observe import Observer

    model = runner.model
    counts: dict = {}
    stack: list = []
    observer = Observer()
    handles = []
    named = dict(model.named_modules())
    paths = {id(m): p for p, m in named.items()}

    def pre(m, args):
        stack.append((m, len(observer.record.softmaxes), len(observer.record.fused)))

    def post(m, args, out):
        if stack and stack[-1][0] is m:
            _, s0, f0 = stack.pop()
            soft = [s for s in observer.record.softmaxes[s0:] if s.output.dim() >= 3 and s.output.shape[-1] >= 2
                    and s.dim in (-1, s.output.dim() - 1)]
            fused = observer.record.fused[f0:]
            entry = counts.setdefault(paths[id(m)], [0, 0])
            entry[0] += len(soft)
            entry[1] += len(fused)

    for m in named.values():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    error, raised_in = None, None
    seq = runner.inputs[:1]
    if runner.sequence and seq.shape[1] > 8:
        seq = seq[:, :8]  # finding needs the ops, not the length: the observer records every one of them
    try:
        with observer:
            runner(seq, grad=True)
    except Exception as exc:  # a model that raises is a finding, reported by model_runs
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        # the modules whose forward did not return: the innermost one with parameters is where it raised
        inside = [paths[id(m)] for m, _, _ in stack if paths[id(m)] and any(True for _ in m.parameters())]
        raised_in = inside[-1] if inside else None
    finally:
        for h in handles:
            h.remove()
    if error is not None:
        try:  # the model, or the observer? Without the observer, a model that runs was not the one that raised
            runner(seq, grad=True)
        except Exception:
            pass
        else:
            return {}, None, None, f"observing the forward failed ({error}): modules found by class only"
    candidates = [p for p, (s, f) in counts.items()
                  if (s or f) and p and any(True for _ in named[p].parameters())]
    found = {}
    for p in _innermost(candidates):
        s, f = counts[p]
        found[p] = ("observed fused scaled_dot_product_attention" if f and not s
                    else "observed softmax over (Tq, Tk) scores")
    return found, error, raised_in, None


def find_attention(model: nn.Module, observed: dict) -> list[FoundModule]:
    """Class-recognised modules (innermost), and observed modules not inside or around one of them."""
    named = dict(model.named_modules())
    by_class = _innermost([p for p, m in named.items() if p and _class_kind(m)])
    found = {p: f"{_class_kind(named[p])}" + (f", {observed[p]}" if p in observed else "") for p in by_class}
    for p, how in observed.items():
        if not any(p == q or p.startswith(q + ".") or q.startswith(p + ".") for q in by_class):
            found[p] = how
    # A module in the place attention has in the other blocks (h.1.attn beside h.0.attn and h.2.attn) is audited
    # too, even where nothing it ran looked like attention: a layer without a softmax is a finding, not a skip.
    places = {re.sub(r"\\.\d+\\.", r"\\.\\d+\\.", re.escape(p)) for p in found if re.search(r"\.\d+\.", p)}
    for p, m in named.items():
        if p and p not in found and any(re.fullmatch(place, p) for place in places) and \
                any(True for _ in m.parameters()) and not any(p.startswith(q + ".") or q.startswith(p + ".") for q in found):
            found[p] = "in the place attention has in the other blocks; no softmax or fused attention observed in it"
    order = list(named)
    return [FoundModule(p, type(named[p]).__name__, found[p], True) for p in sorted(found, key=order.index)]


# ---- capturing each module's call -------------------------------------------------------------------------


def _clone(x):
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def capture_calls(runner: Runner, modules: dict, seq: Tensor) -> tuple[dict, str | None]:
    """{path: (args, kwargs)} of the first call of each module in one forward of `seq`."""
    calls: dict = {}
    handles = []

    def hook_for(path):
        def hook(m, args, kwargs):
            if path not in calls:
                calls[path] = (args, kwargs, _clone(args), _clone(kwargs))
        return hook

    for path, m in modules.items():
        handles.append(m.register_forward_pre_hook(hook_for(path), with_kwargs=True))
    error = None
    try:
        runner(seq, grad=True)  # grad mode: torch's fused inference fast paths would bypass the modules
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        for h in handles:
            h.remove()
    return calls, error


def _leaves(x, path=()):
    if isinstance(x, Tensor):
        yield path, x
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _leaves(v, path + (i,))
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, path + (k,))


def _get(x, path):
    for p in path:
        try:
            x = x[p]
        except (KeyError, IndexError, TypeError):
            return None
    return x


class InPlace(nn.Module):
    """`forward(x)`: the wrapped module called as its model called it, with only the hidden-state input (and key /
    value where the model passed that same tensor) replaced by x (B, t, D), t <= the captured length; the
    model's other arguments cut to the first t positions along their sequence dimensions and repeated along
    the batch. Audited by `audit()` like any self-attention module."""

    def __init__(self, module: nn.Module, path: str, sig: inspect.Signature, arguments: dict, hidden: str,
                 same: tuple[str, ...], time_dims: dict, hidden_time_dim: int, length: int, num_heads: int | None,
                 note: str = ""):
        super().__init__()
        self.inner = module
        self.audit_name = f"{path} ({type(module).__name__}, in place)"
        self._sig, self._arguments, self._hidden, self._same = sig, arguments, hidden, same
        self._time_dims, self._hidden_time_dim = time_dims, hidden_time_dim
        self._contiguous = arguments[hidden].is_contiguous()
        self.d_model = int(arguments[hidden].shape[-1])
        self.block_size = length
        if num_heads:
            self.num_heads = num_heads
        self._note = note

    def _adapt(self, value, path, t: int, batch: int, dtype):
        if isinstance(value, Tensor):
            dims = self._time_dims.get(path, ())
            for d in dims:
                value = value.narrow(d, 0, min(t, value.shape[d]))
            if value.dim() >= 2 and value.shape[0] == 1 and batch > 1 and 0 not in dims:
                value = value.expand(batch, *value.shape[1:])
            if value.is_floating_point() and value.dtype != dtype and value.dtype == self._captured_dtype:
                value = value.to(dtype)
            return value
        if isinstance(value, tuple):
            return tuple(self._adapt(v, path + (i,), t, batch, dtype) for i, v in enumerate(value))
        if isinstance(value, list):
            return [self._adapt(v, path + (i,), t, batch, dtype) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {k: self._adapt(v, path + (k,), t, batch, dtype) for k, v in value.items()}
        return value

    @property
    def _captured_dtype(self):
        return self._arguments[self._hidden].dtype

    def forward(self, x):
        B, t = x.shape[0], x.shape[1]  # batch, sequence length
        h = x.transpose(0, 1) if self._hidden_time_dim == 0 else x  # the module's own layout
        if self._contiguous:  # as the model passes it: GPT-2's Conv1D views its input, harmless in the model
            h = h.contiguous()
        arguments = {}
        for name, value in self._arguments.items():
            if name == self._hidden or name in self._same:
                arguments[name] = h
            elif name in CACHE_NAMES:
                arguments[name] = None  # a cache would grow from call to call
            else:
                arguments[name] = self._adapt(value, (name,), t, B, x.dtype)
        bound = inspect.BoundArguments(self._sig, arguments)
        result = self.inner(*bound.args, **bound.kwargs)
        # the output alone: what else a module returns (T5's position bias, a cache) could pass for weights;
        # the weights are read from the observed softmax or fused attention
        out = _first_tensor(result)
        if out is None:
            return result  # not an attention output: the audit says so
        return out.transpose(0, 1) if self._hidden_time_dim == 0 else out


def build_in_place(path: str, module: nn.Module, long_call, short_call) -> InPlace:
    """The wrapper for one module from its calls at length T (and T - 1, which tells the sequence dims)."""
    sig = inspect.signature(module.forward)
    args, kwargs = long_call[2], long_call[3]
    raw_args, raw_kwargs = long_call[0], long_call[1]
    bound = sig.bind(*args, **kwargs)
    raw = sig.bind(*raw_args, **raw_kwargs).arguments
    arguments = dict(bound.arguments)
    hidden = next((n for n in HIDDEN_NAMES if isinstance(arguments.get(n), Tensor)
                   and arguments[n].is_floating_point() and arguments[n].dim() == 3), None)
    if hidden is None:
        hidden = next((n for n, v in arguments.items() if isinstance(v, Tensor) and v.is_floating_point()
                       and v.dim() == 3), None)
    if hidden is None:
        raise AuditUsageError(f"expected {path} ({type(module).__name__}) to take its hidden states as a (B, T, D) "
                              f"tensor; got arguments {sorted(arguments)}")
    same = tuple(n for n, v in raw.items() if n != hidden and v is raw[hidden])
    short = None
    if short_call is not None:
        try:
            short = dict(sig.bind(*short_call[2], **short_call[3]).arguments)
        except TypeError:
            short = None
    H = arguments[hidden]
    note = ""
    if short is not None and isinstance(short.get(hidden), Tensor) and short[hidden].shape != H.shape:
        changed = [d for d in range(H.dim()) if H.shape[d] != short[hidden].shape[d]]
        hidden_time_dim = changed[0]
        T = H.shape[hidden_time_dim]
        time_dims = {}
        for name, value in arguments.items():
            for leaf, tensor in _leaves(value, (name,)):
                other = _get(short, leaf)
                if isinstance(other, Tensor) and other.dim() == tensor.dim():
                    dims = tuple(d for d in range(tensor.dim()) if tensor.shape[d] == T and other.shape[d] == T - 1)
                    if dims:
                        time_dims[leaf] = dims
    else:  # one capture only (inputs of fixed length, e.g. images): sequence dims are those of the hidden's length
        hidden_time_dim = 1 if H.shape[0] == 1 or H.shape[1] != 1 else 0
        T = H.shape[hidden_time_dim]
        time_dims = {}
        for name, value in arguments.items():
            if name == hidden:
                continue
            for leaf, tensor in _leaves(value, (name,)):
                dims = tuple(d for d in range(tensor.dim()) if tensor.shape[d] == T)
                if dims:
                    time_dims[leaf] = dims
        note = "fixed-length input: arguments' sequence dimensions taken to be those of the hidden states' length"
    heads = None
    for holder in (module, getattr(module, "config", None)):
        for name in ("num_heads", "n_head", "n_heads", "num_attention_heads", "nhead", "heads"):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and heads is None:
                heads = value
    D = H.shape[-1]
    if heads is not None and D % heads:
        heads = None
    return InPlace(module, path, sig, arguments, hidden, same, time_dims, hidden_time_dim, int(T), heads, note)


UNSCALED_FAMILIES = ("t5", "mt5", "umt5", "longt5", "gpt_neo", "switch_transformers")  # q·k multiplied by 1


def declared_scale(module: nn.Module) -> tuple[float | None, str]:
    """The softmax scale a module declares: its `scaling` attribute (Hugging Face's), or 1 for the families
    that fold the scale into their initialisation (T5) or use none (GPT-Neo); None: 1/sqrt(d_k)."""
    value = getattr(module, "scaling", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value), f"scale {float(value):.4g} from {type(module).__name__}.scaling"
    family = getattr(getattr(module, "config", None), "model_type", None)
    if family in UNSCALED_FAMILIES:
        return 1.0, f"scale 1 ({family} multiplies q·k by nothing)"
    return None, ""


def _is_self_attention(wrapper: InPlace) -> bool:
    """No key/value/memory stream other than the hidden states."""
    for name, value in wrapper._arguments.items():
        if name in ("key", "value", "k", "v", "key_value_states", "encoder_hidden_states", "memory", "context") and \
                isinstance(value, Tensor) and name not in wrapper._same:
            return False
    return True


# ---- the model-level detectors -----------------------------------------------------------------------------


def _rel(new: Tensor, old: Tensor, scale: float) -> float:
    """max |new - old| / scale, NaN in both at the same place no change, non-finite in one only infinite."""
    new, old = new.double(), old.double()
    same = (new == old) | (torch.isnan(new) & torch.isnan(old))
    diff = torch.where(same, torch.zeros_like(old), (new - old).abs()).nan_to_num(nan=math.inf)
    return float(diff.max()) / scale if diff.numel() else 0.0


def _rms(x: Tensor) -> float:
    x = x.double()
    x = x[torch.isfinite(x)]
    if not x.numel():
        return 0.0
    return float(((x - x.mean()) ** 2).mean().sqrt()) or float((x ** 2).mean().sqrt())


def _result(det: str, verdict: str, message: str, **kw) -> DetectorResult:
    fix = FIXES.get(det, "") if verdict in ("fail", "warn") else ""
    return DetectorResult(det, verdict, message, fix=fix, **kw)


def _skip(det: str, why: str) -> DetectorResult:
    return DetectorResult(det, "skip", why)


@dataclass
class Golden:
    """Parity against a float64 copy: error of the tested path <= FUDGE (FUDGE_BY_DTYPE) x error of the same-dtype
    full pass + floor."""

    golden: Tensor | None  # float64 copy's output, or None (the same-dtype full pass is then the reference)
    reference: Tensor
    dtype: torch.dtype

    def judge(self, test: Tensor, where: str) -> tuple[bool, float, float, str]:
        target = self.golden if self.golden is not None else self.reference
        scale = _rms(target) or 1.0
        err_ref = _rel(self.reference, target, scale) if self.golden is not None else 0.0
        err = _rel(test, target, scale)
        fudge = FUDGE_BY_DTYPE.get(self.dtype, FUDGE)
        allowed = fudge * err_ref + tolerance(GOLDEN_FLOOR, self.dtype)
        text = (f"{where}: error {err:.3g} of the outputs' RMS against the float64 copy, the full pass's own "
                f"{err_ref:.3g} (allowed {fudge:g} x that + {tolerance(GOLDEN_FLOOR, self.dtype):.0e})"
                if self.golden is not None else
                f"{where}: differs by {err:.3g} of the outputs' RMS (allowed {tolerance(GOLDEN_FLOOR, self.dtype):.0e}; "
                f"no float64 copy of the model could be made)")
        return err <= allowed, err, allowed, text


class LayerTap:
    """Forward hooks on the attention modules: each call's first output tensor, batch-first."""

    def __init__(self, modules: dict, time_dims: dict):
        self.modules, self.time_dims = modules, time_dims
        self.outputs: dict = {p: [] for p in modules}
        self.handles = []
        self.finished: list[str] = []  # the order in which the modules first returned

    def __enter__(self):
        for p, m in self.modules.items():
            def hook(m, args, out, p=p):
                t = _first_tensor(out)
                if t is not None and t.dim() == 3:
                    self.outputs[p].append((t.transpose(0, 1) if self.time_dims.get(p) == 0 else t).detach())
                    if p not in self.finished:
                        self.finished.append(p)
            self.handles.append(m.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def joined(self, p: str) -> Tensor | None:
        outs = self.outputs[p]
        if not outs:
            return None
        try:
            return torch.cat(outs, dim=1)
        except RuntimeError:
            return None


def _first_layer(order: list[str], taps_a: LayerTap, taps_b: LayerTap, select, tol: float, *, select_b=None):
    """The first attention layer (in call order) whose outputs differ between two runs at the selected
    positions (`select_b` for the second run, if it differs), and {layer: number of positions that moved}."""
    first, moved = None, {}
    for p in order:
        a, b = taps_a.joined(p), taps_b.joined(p)
        if a is None or b is None:
            continue
        a, b = select(a), (select_b or select)(b)
        if a.shape != b.shape:
            continue
        scale = _rms(a) or 1.0
        change = ((b.double() - a.double()).abs().nan_to_num(nan=math.inf).amax(-1) / scale)  # (B, T)
        moved[p] = int((change > tol).sum())
        if first is None and moved[p] > 0:
            first = p
    return first, moved


_NO_POSITIONS = ("not applicable: the model's output {shape} has no sequence dimension (one output per position "
                 "is what this check compares)")


def _per_position(out: Tensor, T: int) -> bool:
    return out.dim() >= 2 and out.shape[1] == T


def _blocks(model: nn.Module, modules: dict) -> dict:
    """{path: block module} for the blocks that hold the attention modules: the deepest ancestor of each that
    is an item of an nn.ModuleList or nn.Sequential (`h.1` for `h.1.attn`). Each has `.attention`, the paths
    of the attention modules inside it."""
    named = dict(model.named_modules())
    found: dict = {}
    for p in modules:
        parts = p.split(".")
        for n in range(len(parts) - 1, 0, -1):
            parent, path = ".".join(parts[:n - 1]), ".".join(parts[:n])
            holder = named.get(parent) if parent else model
            if isinstance(holder, (nn.ModuleList, nn.Sequential)) and path in named and path not in modules:
                found.setdefault(path, []).append(p)
                break
    blocks = {}
    for path, inside in found.items():
        block = named[path]
        blocks[path] = _Tagged(block, inside)
    return blocks


class _Tagged:
    """A block and the attention modules inside it; LayerTap hooks `.register_forward_hook` of the block."""

    def __init__(self, module: nn.Module, attention: list):
        self.module, self.attention = module, attention

    def register_forward_hook(self, hook):
        return self.module.register_forward_hook(hook)


def check_prefix_causality(ctx) -> DetectorResult:
    det, runner = "prefix_causality", ctx.runner
    seq = runner.inputs[:1]
    T = seq.shape[1]
    if T < 2:
        return _skip(det, "not applicable: seq_len < 2")
    cuts = sorted({0, T // 2, T - 2})
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    other = runner.other_tokens(seq, gen)
    rows = [seq]
    for c in cuts:
        row = seq.clone()
        row[:, c + 1:] = other[:, c + 1:]
        rows.append(row)
    batch = torch.cat(rows)  # (1 + cuts, T)
    blocks = _blocks(ctx.model, ctx.modules)  # a leak outside attention (an MLP, a norm over time) shows there
    with LayerTap({**ctx.modules, **blocks}, ctx.time_dims) as taps:
        out, _ = runner(batch)
    if not _per_position(out, T):
        return _skip(det, _NO_POSITIONS.format(shape=tuple(out.shape)))
    base, tol = out[:1], tolerance(UNCHANGED, ctx.dtype)
    scale = _rms(base) or 1.0
    worst, where, moved_own, reach = 0.0, None, True, {}
    bad = 0
    total = 0
    for i, c in enumerate(cuts, start=1):
        change = (out[i:i + 1].double() - base.double()).abs().nan_to_num(nan=math.inf).amax(-1)[0] / scale  # (T,)
        past = change[:c + 1]
        total += c + 1
        bad += int((past > tol).sum())
        if float(past.max()) > worst:
            worst, where = float(past.max()), (c, int(past.argmax()))
        moved_own = moved_own and bool((change[c + 1:] > tol).any())
    # per layer: how many past positions a change after the middle cut reaches; the first module to return a
    # moved past position (attention modules and their blocks, in the order they finished) is where it starts
    c = cuts[len(cuts) // 2]
    first, block_reach = None, {}
    for p in taps.finished:
        layer_out = taps.joined(p)
        if layer_out is None or layer_out.shape[0] != batch.shape[0] or layer_out.shape[1] != T:
            continue
        ref = layer_out[:1]
        s = _rms(ref) or 1.0
        i = cuts.index(c) + 1
        ch = (layer_out[i:i + 1].double() - ref.double()).abs().nan_to_num(nan=math.inf).amax(-1)[0] / s
        (block_reach if p in blocks else reach)[p] = int((ch[:c + 1] > tol).sum())
        if first is None and int((ch[:c + 1] > tol).sum()) > 0:
            first = p
        for j, cj in enumerate(cuts, start=1):
            chj = (layer_out[j:j + 1].double() - ref.double()).abs().nan_to_num(nan=math.inf).amax(-1)[0] / s
            if first is None and bool((chj[:cj + 1] > tol).any()):
                first = p
    ctx.readings["prefix_reach"] = {"cut": c, "positions": c + 1, "reach": reach, "blocks": block_reach}
    if bad:
        where_text = ""
        if first in blocks:
            where_text = (f"; the change first appears at the output of {first}, whose attention "
                          f"({', '.join(blocks[first].attention)}) did not move: the leak is outside attention")
        elif first:
            where_text = f"; the change first appears at {first}"
        if first:
            ctx.result_layers[det] = first
        return _result(det, "fail", f"outputs see the future: changing tokens after t moves outputs at or before t"
                       + where_text, value=worst, threshold=tol,
                       evidence=f"{bad} / {total} past outputs changed; greatest change {worst:.3g} of the outputs' "
                                f"RMS at t={where[1]} when only t>{where[0]} was changed (up to {tol:.0e} allowed for "
                                f"{dtype_name(ctx.dtype)}); past positions reached per layer (cut {c}): "
                                + ", ".join(f"{p}: {n}/{c + 1}" for p, n in reach.items()))
    if not moved_own:
        return _skip(det, "not measured: changing the later tokens did not move the later outputs")
    return _result(det, "pass", f"no output moves when later tokens change (cuts {', '.join(map(str, cuts))})",
                   value=worst, threshold=tol)


def _chunks(T: int) -> dict:
    """Three schedules: a prefill then steps of 1, the same prefill then steps of 3 (one prefill serves both,
    through a copy of its cache), and an uneven split."""
    plans = {}
    prefill = T - 6 if T >= 7 else T - 3
    if T >= 4:
        plans["steps of 1"] = [prefill] + [1] * (T - prefill)
    if T >= 7:
        plans["steps of 3"] = [prefill, 3, 3]
    if T >= 5:
        a = max(1, T // 3 + 1)
        b = max(1, (T - a) // 3 + 1)
        plans["uneven"] = [a, b, T - a - b] if T - a - b > 0 else [a, T - a]
    return plans


def check_cache_parity(ctx) -> DetectorResult:
    det, runner = "cache_parity", ctx.runner
    if not ctx.causal:
        return _skip(det, "not applicable: the model is not causal (pass causal=True if it is)")
    if not runner.takes_cache:
        return _skip(det, "not applicable: the model's forward takes no past_key_values and use_cache (the "
                          "Hugging Face protocol; see the module docstring for plain models)")
    seq = runner.inputs[:1]
    T = seq.shape[1]
    plans = _chunks(T)
    if not plans:
        return _skip(det, "not applicable: seq_len < 4")
    with LayerTap(ctx.modules, ctx.time_dims) as full_taps:
        full, _ = runner(seq)
    ctx.full = (seq, full)
    if not _per_position(full, T):
        return _skip(det, _NO_POSITIONS.format(shape=tuple(full.shape)))
    golden = Golden(ctx.golden(seq), full, ctx.dtype)
    readings, failed, texts = {}, [], []
    first = None
    shared = None  # (first chunk's length, its output, its cache, its layer taps)
    for name, plan in plans.items():
        outs, past, start = [], None, 0
        with LayerTap(ctx.modules, ctx.time_dims) as taps:
            for i, n in enumerate(plan):
                if i == 0 and shared is not None and shared[0] == n:
                    try:
                        past = copy.deepcopy(shared[2])  # the prefill's cache, untouched by the other schedule
                        out = shared[1]
                        for p, calls in shared[3].outputs.items():
                            taps.outputs[p].extend(calls)
                        outs.append(out)
                        start += n
                        continue
                    except Exception:  # a cache that cannot be copied: prefill again
                        past = None
                out, past = runner(seq[:, start:start + n], past=past, use_cache=True)
                if past is None:
                    return _skip(det, "not measured: the model returned no cache with use_cache=True")
                if i == 0 and shared is None:
                    prefill_taps = LayerTap(ctx.modules, ctx.time_dims)
                    prefill_taps.outputs = {p: list(calls) for p, calls in taps.outputs.items()}
                    try:
                        shared = (n, out, copy.deepcopy(past), prefill_taps)
                    except Exception:
                        shared = None
                outs.append(out)
                start += n
        cached = torch.cat(outs, dim=1)
        if cached.shape != full.shape:
            return _result(det, "fail", f"cached decoding returns {tuple(cached.shape)} where the full pass returns "
                           f"{tuple(full.shape)}", evidence=f"schedule {name} {plan}")
        ok, err, allowed, text = golden.judge(cached, f"{name} {plan}")
        readings[name] = {"plan": plan, "error": err, "allowed": allowed,
                          "per_position": ((cached.double() - full.double()).abs().amax(-1)[0] /
                                           (_rms(full) or 1.0)).tolist()}
        texts.append(text)
        if not ok:
            failed.append(name)
            if first is None:
                layer, _ = _first_layer(ctx.order, full_taps, taps, lambda x: x, tolerance(GOLDEN_FLOOR, ctx.dtype))
                first = layer
    ctx.readings["cache_parity"] = readings
    if failed:
        if first:
            ctx.result_layers[det] = first
        worst = max(readings[n]["error"] for n in failed)
        return _result(det, "fail", f"decoding through the cache differs from the full forward ({', '.join(failed)})"
                       + (f"; first at {first}" if first else ""), value=worst,
                       threshold=min(readings[n]["allowed"] for n in failed), evidence="; ".join(texts))
    return _result(det, "pass", f"prefill + {', '.join(plans)} through the model's cache match the full forward",
                   value=max(r["error"] for r in readings.values()),
                   threshold=min(r["allowed"] for r in readings.values()), evidence="; ".join(texts))


def check_padding_invariance(ctx) -> DetectorResult:
    det, runner = "padding_invariance", ctx.runner
    if runner.padding_name is None or not runner.sequence:
        return _skip(det, "not applicable: the model's forward takes no attention_mask (padding mask)")
    seq = runner.inputs[:1]
    T = seq.shape[1]
    if T < 3:
        return _skip(det, "not applicable: seq_len < 3")
    P = max(1, T // 4)
    L = T - P
    real = seq[:, :L]
    gen = torch.Generator().manual_seed(ctx.seed + 23)
    with LayerTap(ctx.modules, ctx.time_dims) as ref_taps:
        ref, _ = runner(real)
    if not _per_position(ref, L):
        return _skip(det, _NO_POSITIONS.format(shape=tuple(ref.shape)))
    golden = Golden(ctx.golden(real), ref, ctx.dtype)
    pads = torch.cat([_pad_tokens(runner, (1, P) + tuple(seq.shape[2:]), gen) for _ in range(2)])  # two contents
    ones, zeros = torch.ones(1, L, dtype=torch.long), torch.zeros(1, P, dtype=torch.long)
    # rows: right padding with either pad contents; left padding with the position ids it needs (one call)
    rows = [torch.cat([real, pads[:1]], 1), torch.cat([real, pads[1:]], 1)]
    masks = [torch.cat([ones, zeros], 1)] * 2
    left = runner.takes_positions
    if left:
        rows.append(torch.cat([pads[:1], real], 1))
        masks.append(torch.cat([zeros, ones], 1))
    mask = torch.cat(masks).to(seq.device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0) if left else None  # real tokens at 0 .. L-1 in every row
    with LayerTap(ctx.modules, ctx.time_dims) as taps:
        out, _ = runner(torch.cat(rows), attention_mask=mask, position_ids=positions)
    cases = [(0, slice(0, L), "right padding, pad contents 1"), (1, slice(0, L), "right padding, pad contents 2")]
    if left:
        cases.append((2, slice(P, T), "left padding with position_ids = cumsum(mask) - 1"))
    texts, failed, first, worst = [], [], None, (0.0, 1.0)
    for row, where, label in cases:
        ok, err, allowed, text = golden.judge(out[row:row + 1, where], label)
        worst = max(worst, (err, allowed), key=lambda e: e[0] / e[1])
        texts.append(text)
        if not ok:
            failed.append(label.split()[0])
            first = first or _first_layer(ctx.order, ref_taps, taps, lambda x: x[:, :L],
                                          tolerance(GOLDEN_FLOOR, ctx.dtype),
                                          select_b=lambda x, r=row, w=where: x[r:r + 1, w])[0]
    if not left:
        texts.append("left padding not checked: the forward takes no position_ids, so left-padded tokens would sit "
                     "at other positions")
    if failed:
        if first:
            ctx.result_layers[det] = first
        return _result(det, "fail", f"padding changes the outputs at real tokens ({', '.join(sorted(set(failed)))} "
                       f"padding)" + (f"; first at {first}" if first else ""), value=worst[0], threshold=worst[1],
                       evidence="; ".join(texts))
    return _result(det, "pass", f"outputs at the {L} real tokens unchanged by {P} padding tokens (right, two "
                   f"contents{', and left' if left else ''})", value=worst[0], threshold=worst[1],
                   evidence="; ".join(texts))


def check_batch_invariance(ctx) -> DetectorResult:
    det, runner = "batch_invariance", ctx.runner
    seq = runner.inputs[:1]
    gen = torch.Generator().manual_seed(ctx.seed + 31)
    if ctx.full is not None and torch.equal(ctx.full[0], seq):
        alone = ctx.full[1]  # the same forward, already made by cache_parity
    else:
        alone, _ = runner(seq)
    golden = Golden(ctx.golden(seq), alone, ctx.dtype)
    if runner.sequence and runner.padding_name is not None and seq.shape[1] >= 3:
        T = seq.shape[1]
        others = runner.other_tokens(torch.cat([seq, seq]), gen)
        batch = torch.cat([others[:1], seq, others[1:]])
        mask = torch.ones(3, T, dtype=torch.long)
        mask[0, T - T // 3:] = 0  # rows of other lengths around it
        mask[2, T - 1:] = 0
        out, _ = runner(batch, attention_mask=mask.to(seq.device))
        how = "between two sequences of other lengths (right-padded)"
    else:
        others = runner.other_tokens(torch.cat([seq, seq]), gen) if runner.sequence else \
            torch.randn(torch.cat([seq, seq]).shape, generator=gen).to(seq.device, seq.dtype)
        batch = torch.cat([others[:1], seq, others[1:]])
        out, _ = runner(batch)
        how = "between two other inputs"
    ok, err, allowed, text = golden.judge(out[1:2], f"the sequence {how}")
    if not ok:
        return _result(det, "fail", "a sequence's output depends on the other sequences of its batch",
                       value=err, threshold=allowed, evidence=text)
    return _result(det, "pass", f"a sequence alone gives its output {how}", value=err, threshold=allowed,
                   evidence=text)


def check_backend_parity(ctx) -> DetectorResult:
    det, runner, model = "backend_parity", ctx.runner, ctx.model
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if not runner.hf or current not in ("eager", "sdpa"):
        return _skip(det, "not applicable: the model cannot switch attention implementation (Hugging Face eager / sdpa)")
    other = "sdpa" if current == "eager" else "eager"
    try:
        twin = copy.deepcopy(model)
        twin.set_attn_implementation(other)
    except Exception as exc:
        return _skip(det, f"not applicable: the model does not switch to {other} ({type(exc).__name__}: {exc})")
    seq = runner.inputs[:2]
    T = seq.shape[1] if runner.sequence else None
    kwargs = {}
    if runner.sequence and runner.padding_name is not None and T >= 3:
        mask = torch.ones(seq.shape[0], T, dtype=torch.long)
        mask[-1, T - max(1, T // 4):] = 0
        kwargs["attention_mask"] = mask.to(seq.device)
    mine, _ = runner(seq, **kwargs)
    theirs, _ = runner(seq, model=twin, **kwargs)
    golden = Golden(ctx.golden(seq, **kwargs), mine, ctx.dtype)
    keep = kwargs["attention_mask"].bool() if kwargs else torch.ones(mine.shape[:2], dtype=torch.bool)
    golden2 = Golden(None if golden.golden is None else (golden.golden[keep] if keep.shape == mine.shape[:2]
                                                         else golden.golden), mine[keep] if keep.shape == mine.shape[:2]
                     else mine, ctx.dtype)
    ok, err, allowed, text = golden2.judge(theirs[keep] if keep.shape == mine.shape[:2] else theirs,
                                           f"{other} against {current} (the model's), unmasked positions")
    if not ok:
        return _result(det, "fail", f"attention implementations disagree: {other} against {current}", value=err,
                       threshold=allowed, evidence=text)
    return _result(det, "pass", f"{current} and {other} agree", value=err, threshold=allowed, evidence=text)


def _input_embedding(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
            if isinstance(emb, nn.Module):
                return emb
        except Exception:
            pass
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def check_gradient_flow(ctx) -> DetectorResult:
    det, runner = "gradient_flow", ctx.runner
    params = [(f"{p}.{n}", w) for p, m in ctx.modules.items() for n, w in m.named_parameters() if w.requires_grad]
    if not params:
        return _skip(det, "not applicable: the attention modules have no trainable parameters")
    seq = runner.inputs[:1]
    emb = _input_embedding(ctx.model) if runner.tokens else None
    leaf = {}

    def hook(m, args, out):  # the token embeddings (B, T, D) as a leaf: gradients w.r.t. each position
        if isinstance(out, Tensor) and out.is_floating_point() and out.shape[:2] == seq.shape[:2]:
            x = out.detach().requires_grad_(True)
            leaf["x"] = x
            return x
        return None

    handle = emb.register_forward_hook(hook) if emb is not None else None
    try:
        if emb is None and seq.is_floating_point():
            seq = seq.detach().clone().requires_grad_(True)
            leaf["x"] = seq
        torch.manual_seed(ctx.seed)
        out, _ = runner(seq, grad=True)
        grads = torch.autograd.grad((out.float() ** 2).sum(), [w for _, w in params], allow_unused=True,
                                    retain_graph=True)
        missing = [n for (n, _), g in zip(params, grads) if g is None or not bool(g.abs().sum() > 0)]
        nonfinite = [n for (n, _), g in zip(params, grads) if g is not None and not bool(torch.isfinite(g).all())]
        leak = ""
        if ctx.causal and "x" in leaf and runner.sequence and out.shape[1] == seq.shape[1] and seq.shape[1] >= 2:
            T = seq.shape[1]
            c = (T - 1) // 2
            g = torch.autograd.grad((out[:, :c + 1].float() ** 2).sum(), leaf["x"], allow_unused=True)[0]
            if g is not None:
                later = float(g[:, c + 1:].abs().max())
                if later > 1e-12 * max(float(g.abs().max()), 1e-300):
                    leak = (f"(out[:, :{c + 1}] ** 2).sum() has gradient up to {later:.3g} w.r.t. input embeddings "
                            f"after t={c} (must be exactly 0)")
    finally:
        if handle is not None:
            handle.remove()
    if nonfinite:
        return _result(det, "fail", "attention parameters get non-finite gradients", evidence=", ".join(nonfinite[:6]))
    if missing:
        owners = sorted({n.rsplit(".", 1)[0] for n in missing})
        ctx.result_layers[det] = next((p for p in ctx.order if any(n.startswith(p + ".") for n in missing)), None)
        return _result(det, "fail", f"{len(missing)} of {len(params)} attention parameters get no gradient",
                       value=float(len(missing)), threshold=0.0,
                       evidence=f"zero or missing gradient of (out ** 2).sum(): {', '.join(missing[:8])}"
                                f"{' ...' if len(missing) > 8 else ''} (in {', '.join(owners[:4])})")
    if leak:
        return _result(det, "fail", "the gradient lets the future in: past outputs send gradient to later inputs",
                       evidence=leak)
    return _result(det, "pass", f"all {len(params)} attention parameters get finite non-zero gradients"
                   + (" and no output sends gradient to later input embeddings" if ctx.causal and "x" in leaf else ""))


def _declared_window(module: nn.Module) -> int | None:
    """The sliding window a layer declares: its own `sliding_window` attribute where it has one (None there: a
    full-attention layer, as in Gemma 2's alternating layers), else its config's (unless `use_sliding_window`
    is False, Qwen2's switch)."""
    if hasattr(module, "sliding_window"):
        value = module.sliding_window
    else:
        config = getattr(module, "config", None)
        value = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            value = None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_sliding_window(ctx) -> DetectorResult:
    """In place, per layer that declares a window w (an attribute `sliding_window`, or its config's): with the
    hidden state changed at position s only, outputs at t >= s + w must not move, and t = s + w - 1 must."""
    det = "sliding_window"
    layers = {p: w for p, w in ((p, _declared_window(m)) for p, m in ctx.modules.items()) if w is not None}
    if not layers:
        return _skip(det, "not applicable: no attention layer declares a sliding window")
    checked, bad = [], []
    for p, w in layers.items():
        wrapper = ctx.wrappers.get(p)
        if wrapper is None:
            continue
        T = wrapper.block_size
        if T < w + 1:
            checked.append(f"{p}: window {w} >= seq_len {T}, not measured")
            continue
        s = 0
        gen = torch.Generator().manual_seed(ctx.seed + 41)
        device, dtype = _device_dtype(wrapper.inner)
        x = torch.randn(1, T, wrapper.d_model, generator=gen).to(device, dtype)
        y = x.clone()
        y[:, s] = torch.randn(wrapper.d_model, generator=gen).to(device, dtype) * 1000
        try:
            with torch.no_grad(), _eval(wrapper):
                a, b = _first_tensor(wrapper(x)), _first_tensor(wrapper(y))
        except Exception as exc:
            checked.append(f"{p}: raised {type(exc).__name__}")
            continue
        ctx.layer_calls += 2
        change = (b.double() - a.double()).abs().amax(-1)[0] / (_rms(a) or 1.0)  # (T,)
        tol = tolerance(UNCHANGED, dtype)
        outside = change[s + w:]
        edge = float(change[s + w - 1])
        if bool((outside > tol).any()):
            t = int((outside > tol).nonzero()[0]) + s + w
            bad.append((p, f"{p} declares sliding_window={w}, yet changing position {s} moved the output at t={t} "
                           f"by {float(outside.max()):.3g} of the RMS (t - s >= w must not move; up to {tol:.0e})"))
        elif not edge > tol:
            bad.append((p, f"{p} declares sliding_window={w}, yet changing position {s} did not move the output at "
                           f"t={s + w - 1} ({edge:.3g}): the window is narrower than declared"))
        else:
            checked.append(f"{p}: window {w} exact")
    if bad:
        ctx.result_layers[det] = bad[0][0]
        return _result(det, "fail", f"a sliding window is not the declared width ({', '.join(p for p, _ in bad)})",
                       evidence="; ".join(t for _, t in bad))
    if not any("exact" in c for c in checked):
        return _skip(det, "not measured: " + "; ".join(checked))
    return _result(det, "pass", f"every declared sliding window is exact ({len(checked)} layers)",
                   evidence="; ".join(checked))


@contextlib.contextmanager
def _eval(module: nn.Module):
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


MODEL_CHECKS = {
    "prefix_causality": check_prefix_causality,
    "cache_parity": check_cache_parity,
    "padding_invariance": check_padding_invariance,
    "batch_invariance": check_batch_invariance,
    "backend_parity": check_backend_parity,
    "gradient_flow": check_gradient_flow,
    "sliding_window": check_sliding_window,
}


# ---- the audit --------------------------------------------------------------------------------------------


@dataclass
class _Context:
    model: nn.Module
    runner: Runner
    causal: bool
    seed: int
    dtype: torch.dtype
    modules: dict
    wrappers: dict
    time_dims: dict
    order: list
    readings: dict = field(default_factory=dict)
    result_layers: dict = field(default_factory=dict)
    layer_calls: int = 0
    _twin: object = None
    _twin_failed: bool = False
    full: tuple | None = None  # (inputs, output) of the plain full forward, shared by the checks
    _golden_seen: list = field(default_factory=list)  # [(inputs, options, output)]: one float64 forward per input

    def golden(self, seq: Tensor, **kw) -> Tensor | None:
        """The float64 copy's output on the same inputs, or None where no copy can be made."""
        if self.dtype == torch.float64:
            return None
        if self._twin is None and not self._twin_failed:
            try:
                self._twin = copy.deepcopy(self.model).to(torch.float64).eval()
            except Exception:
                self._twin_failed = True
        if self._twin is None:
            return None
        for seen, options, out in self._golden_seen:
            if seen.shape == seq.shape and torch.equal(seen, seq) and options.keys() == kw.keys() and \
                    all(torch.equal(options[k], kw[k]) for k in kw):
                return out
        try:
            out, _ = self.runner(seq, model=self._twin, **kw)
        except Exception:
            return None
        self._golden_seen.append((seq, kw, out))
        return out


def _infer_causal(model, causal, runner) -> tuple[bool, str]:
    if causal is not None:
        expect(isinstance(causal, bool), "causal=True, False or None", f"causal={causal!r}", "pass a bool")
        return causal, "as given"
    name = type(model).__name__
    config = getattr(model, "config", None)
    if re.search(r"CausalLM|LMHeadModel", name):
        return True, f"inferred: {name} is a causal LM"
    if config is not None and getattr(config, "is_decoder", False):
        return True, "inferred: config.is_decoder"
    if runner.encoder_decoder:
        return True, "inferred: an encoder-decoder, whose decoder is causal (the decoder inputs are what changes)"
    for attr in ("causal", "is_causal"):
        if getattr(model, attr, None) is True:
            return True, f"inferred: model.{attr} is True"
    return False, "assumed: nothing says the model is causal; pass causal=True if it is"


def _status(results, layers, found, *, layers_chosen: bool = True, causal: bool = False,
            unaudited: tuple = ()) -> tuple[str, str]:
    failed = [r.detector for r in results if r.verdict == "fail"]
    failed_layers = [p for p, rep in layers.items() if rep.status == "failed"]
    if failed or failed_layers:
        per_layer = [f"{p} ({', '.join(r.detector for r in rep.results if r.verdict == 'fail')})"
                     for p, rep in layers.items() if rep.status == "failed"]
        return "failed", "failed: " + ", ".join(failed + per_layer)
    if not found:
        return "inconclusive", ("inconclusive: no attention module was found (no torch, timm or Hugging Face attention "
                                "class, and no softmax over (Tq, Tk) scores or fused attention observed)")
    if unaudited and layers_chosen:
        return "inconclusive", f"inconclusive: {', '.join(unaudited)} could not be audited in place (see the notes)"
    if not layers and layers_chosen:
        return "inconclusive", "inconclusive: no attention module was audited"
    if not layers_chosen and not any(r.measured for r in results if r.detector != "model_runs"):
        return "inconclusive", "inconclusive: no chosen detector could measure the model (every one skipped)"
    errors = [r.detector for r in results if r.verdict == "error"]
    if errors:
        return "inconclusive", f"inconclusive: {', '.join(errors)} crashed (an internal error of diagnostics)"
    open_layers = [p for p, rep in layers.items() if rep.status == "inconclusive"]
    if open_layers:
        return "inconclusive", f"inconclusive: {', '.join(open_layers)} could not be measured"
    prefix = next((r for r in results if r.detector == "prefix_causality"), None)
    if causal and prefix is not None and not prefix.measured:
        return "inconclusive", f"inconclusive: the model is causal, but its causality was not measured ({prefix.message})"
    return "passed", ""


def audit_model(model, example=None, *, causal: bool | None = None, seq_len: int | None = None, seed: int = 0,
                detectors: list[str] | None = None, progress=None) -> ModelReport:
    """Audit a whole model: find its attention modules, audit each in place with the arguments the model passes
    it, and run the model-level detectors (`MODEL_DETECTORS`). Returns a `ModelReport` (status "passed",
    "failed" or "inconclusive"; `findings` each with `.layer`, the module path, or None for the model).

    `example`: token ids (B, T), embeddings (B, T, D), or a dict of the model's inputs; None builds one from the
    model (a Hugging Face config's `vocab_size` or image size, an nn.Embedding, torch's transformer stacks).
    `causal`: None infers it (a causal-LM class, `config.is_decoder`, an encoder-decoder's decoder, a truthy
    `model.causal`), else the report says it assumed non-causal. `seq_len`: the audit's length (default: the
    example's, else min(16, the model's context)). `detectors`: ids from `MODEL_DETECTORS` and the layer
    detectors (`DETECTORS`); None runs all. `progress`: callable(stage, index, total)."""
    from ._audit import audit
    from ._detectors import DETECTORS

    expect(isinstance(model, nn.Module), "an nn.Module (the whole model)", type(model).__name__,
           "pass the model instance; to audit one layer, use diagnostics.audit(layer)")
    expect(seq_len is None or (isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 2),
           "seq_len an int >= 2 or None", f"seq_len={seq_len!r}", "pass e.g. seq_len=16")
    expect(detectors is None or (isinstance(detectors, (list, tuple)) and all(isinstance(d, str) for d in detectors)),
           "detectors: a list of detector ids", f"detectors={detectors!r}", "e.g. detectors=['prefix_causality']")
    known = set(MODEL_DETECTORS) | set(DETECTORS)
    unknown = [d for d in (detectors or []) if d not in known]
    expect(not unknown, f"detector ids from {sorted(known)}", f"{unknown}", "check the spelling")
    chosen = set(known if detectors is None else detectors)
    started = time.perf_counter()
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None) if config is not None else None
    context = _context(model)
    if seq_len is not None and context is not None:
        expect(seq_len <= context, f"seq_len <= {context}, the model's context", f"seq_len={seq_len}",
               f"pass seq_len={context} or less")
    runner = Runner(model, example, seq_len=seq_len, seed=seed)
    if seq_len is not None and runner.sequence and example is not None and runner.inputs.shape[1] != seq_len:
        runner.inputs = runner.inputs[:, :seq_len]
    T = runner.inputs.shape[1] if runner.sequence else 0
    expect(not runner.sequence or T >= 2, "an example of at least 2 positions", f"length {T}", "pass a longer example")
    causal_, source = _infer_causal(model, causal, runner)
    runner.pass_causal = causal_ and runner.causal_mask_name is not None
    dtype = _float_dtype(model)
    results: list[DetectorResult] = []
    layers: dict = {}
    notes: list[str] = []
    if runner.dropped:
        notes.append(f"the example's {', '.join(runner.dropped)} not passed: each check builds the masks and positions "
                     f"it needs (token_type_ids: the model's default)")

    def tick(stage, i, n):
        if progress is not None:
            progress(stage, i, n)

    with untouched(model, _device_dtype(model)[0]):
        tick("discover", 0, 1)
        observed, error, raised_in, observe_note = _observe_attention(runner)
        if observe_note:
            notes.append(observe_note)
        found = find_attention(model, observed)
        named = dict(model.named_modules())
        modules = {f.path: named[f.path] for f in found}
        runs_msgs, run_layer = [], None
        if error:
            if raised_in is not None:
                run_layer = next((p for p in modules if raised_in == p or raised_in.startswith(p + ".")), raised_in)
                error = f"raised inside {run_layer} ({type(named[run_layer]).__name__}): {error}"
            runs_msgs.append(f"the example: {error}")
        long_calls, error = capture_calls(runner, modules, runner.inputs[:1]) if modules else ({}, None)
        if error and not runs_msgs:
            runs_msgs.append(f"the example: {error}")
        short_calls = {}
        if runner.sequence and T >= 3 and modules:
            short_calls, error = capture_calls(runner, modules, runner.inputs[:1, :T - 1])
            if error:
                runs_msgs.append(f"the example's first {T - 1} positions: {error}")
        found = [FoundModule(f.path, f.cls, f.how, f.path in long_calls) for f in found]
        modules = {p: m for p, m in modules.items() if p in long_calls}
        wrappers, time_dims = {}, {}
        for p, m in modules.items():
            try:
                wrappers[p] = build_in_place(p, m, long_calls[p], short_calls.get(p))
                time_dims[p] = wrappers[p]._hidden_time_dim
                if wrappers[p]._note and wrappers[p]._note not in notes:
                    notes.append(wrappers[p]._note)
            except (AuditUsageError, TypeError) as exc:
                notes.append(f"{p} not audited in place: {exc}")
        modules = {p: modules[p] for p in wrappers}
        if runs_msgs:
            results.append(_result("model_runs", "fail", "the model raised on the audit's inputs"
                                   + (f" (inside {run_layer})" if run_layer else ""), evidence="; ".join(runs_msgs)))
        else:
            results.append(_result("model_runs", "pass", "the model runs on the example and its prefix"))
        order = [p for p in long_calls if p in modules]  # the capture's hooks fired in call order
        order += [p for p in modules if p not in order]
        ctx = _Context(model, runner, causal_, seed, dtype, modules, wrappers, time_dims, order)
        if run_layer:
            ctx.result_layers["model_runs"] = run_layer
        layer_ids = [d for d in DETECTORS if d in chosen]
        for i, p in enumerate(order):
            if not layer_ids:
                break
            tick(f"layer {p}", i, len(order))
            w = wrappers[p]
            layer_causal = causal_ and _is_self_attention(w) and (not runner.encoder_decoder or ".decoder." in f".{p}.")
            scale, said = declared_scale(w.inner)
            if said and said not in notes and "scaling" not in said:
                notes.append(said)
            try:
                rep = audit(w, causal=layer_causal, seq_len=w.block_size, seed=seed, detectors=layer_ids, scale=scale)
            except AuditUsageError as exc:
                notes.append(f"{p} not audited in place: {exc}")
                continue
            except Exception as exc:  # an internal error of diagnostics: the layer stays unaudited (inconclusive)
                notes.append(f"{p} not audited in place: the audit raised {type(exc).__name__}: {exc} (an internal "
                             f"error of diagnostics; please report it)")
                continue
            layers[p] = rep
            ctx.layer_calls += rep.forward_passes
        if not runs_msgs:
            applicable = {
                "prefix_causality": (causal_ and runner.sequence,
                                     "not applicable: the model is not causal (pass causal=True if it is)"
                                     if not causal_ else "not applicable: the input is not a sequence"),
                "cache_parity": (runner.sequence, "not applicable: the input is not a sequence"),
                "padding_invariance": (runner.sequence, "not applicable: the input is not a sequence"),
                "batch_invariance": (True, ""),
                "backend_parity": (True, ""),
                "gradient_flow": (True, ""),
                "sliding_window": (runner.sequence, "not applicable: the input is not a sequence"),
            }
            ids = [d for d in MODEL_CHECKS if d in chosen]
            for i, d in enumerate(ids):
                tick(d, i, len(ids))
                ok, why = applicable[d]
                if not ok:
                    results.append(_skip(d, why))
                    continue
                try:
                    torch.manual_seed(seed)
                    results.append(MODEL_CHECKS[d](ctx))
                except Exception as exc:  # the model raised on a detector's inputs: a finding about the model
                    results.append(_result(d, "fail", f"the model raised on this detector's inputs: "
                                           f"{type(exc).__name__}", evidence=str(exc).splitlines()[0][:200]
                                           if str(exc) else ""))
        result_layers, readings = ctx.result_layers, ctx.readings
        layer_calls = ctx.layer_calls
    if implementation is not None and getattr(config, "_attn_implementation", None) != implementation:
        config._attn_implementation = implementation
    results = [r for r in results if r.detector in chosen or r.detector == "model_runs"]
    unaudited = tuple(f.path for f in found if f.called and f.path not in layers)
    status, reason = _status(results, layers, found, layers_chosen=bool(set(DETECTORS) & chosen), causal=causal_,
                             unaudited=unaudited)
    if not T and wrappers:
        T = next(iter(wrappers.values())).block_size  # images: the tokens the attention layers see
    return ModelReport(model=type(model).__qualname__, status=status, status_reason=reason, causal=causal_,
                       causal_source=source, seq_len=T, dtype=dtype_name(dtype), found=found, layers=layers,
                       results=results, result_layers=result_layers, readings=readings,
                       model_forwards=runner.forwards, layer_calls=layer_calls,
                       seconds=time.perf_counter() - started, notes=notes)


__all__ = ["FUDGE", "FUDGE_BY_DTYPE", "GOLDEN_FLOOR", "MODEL_DETECTORS", "ModelAuditError", "ModelFinding", "ModelReport",
           "audit_model"]
