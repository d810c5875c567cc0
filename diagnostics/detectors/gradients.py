"""`gradients`: autograd's directional derivative matches finite differences on a float64 copy, and masked
or future keys receive no gradient.

Where the layer is not differentiable at the probe point along the direction (a ReLU at exactly 0: SwinV2's
position-bias MLP, whose zero-initialised bias puts every unit on the kink at offset 0), there is no derivative to
compare: the parts of the direction (the inputs, each parameter) along which the one-sided derivatives differ are
left out, named, and the check is made along the rest. A wrong backward is smooth: its one-sided derivatives agree."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from .._core import skip
from .._frames import frame_kind, user_frames
from .._probe import Probe
from .._registry import detector
from .._result import DetectorResult, Site
from .._tracing import GradientCut, declared_mask, mask_sites, site, stream_sites, trace_call, weights_origin
from ._common import float64_copy_or_skip, grad_of, gradient_probe, graph_call, pack, result

PARAMETER_ENTRIES = 512  # knob: entries per parameter the finite differences move: a cost (x10, x0.1: no verdict moves)
"""The finite differences move at most this many entries of each parameter tensor (all of a smaller one). A cost
knob: at 51 and at 5,120 the suite's gradient tests and the kill matrix give the same verdicts (2026-12-03): a
detached or wrong backward is wrong at almost every entry, so a few hundred places find it."""

GRADIENT_AGREEMENT = 1e-9
"""|autograd - finite difference| / (|grad| |direction|) for the directional derivative of (out ** 2).sum() in
float64 (Richardson-extrapolated central differences at eps 1e-4 and 5e-5), on tokens scaled by `gradient_gain`.
Measured with that gain (the reference and a detached softmax, heads x head_dim in 1x1, 1x2, 2x1, 3x3, 4x8,
float32/bfloat16/float16, torch's and GPT-2's init, 8 seeds, T 3-7): correct layers at most 1.4e-12 at torch's
init and 2.9e-10 at GPT-2's 4x8 (margin 3.4x), where the smaller sizes' finite-difference noise raises the limit
(30x that noise, up to 6.5e-7, correct layers 2.3e-8 under it); a detached softmax at least 1.1e-5, 17x over
the largest limit. Without the gain a detached softmax at d_model 1 and GPT-2's init measured 4.6e-10, under."""


KINK_STEADY = 2.0
"""A kink at the probe point: the jump of the directional derivative (`jump`) read at steps eps / 4, eps / 8 and
eps / 16 stays within this factor. Measured (float64 copies): a ReLU at exactly 0 within 1.2x (SwinV2's cpb_mlp.0.bias
at its zero init in swinv2_base_window8_256, beside kinks crossed within the step; 1.00001x alone in the twin of
tests/test_timm_causes.py); where the layer is smooth what is left shrinks 8x a halving (a detached softmax in
bfloat16 at GPT-2's init: 2.4e-8 then 3.1e-9 of |grad| |u|, 64x over the three), and a kink crossed within the step
only comes and goes (cpb_mlp.0.weight there: 1.2e-3, 6.0e-4, 3.7e-10)."""


@dataclass(frozen=True)
class GradientReplay:
    """What the gradient verdict was computed on: the float64 copy, its very inputs and mask, and what failed:
    `through_masks` when gradient reached keys the mask (or causality) blocks, else the backward itself."""

    twin: object  # the float64 copy of the subject
    inputs: tuple  # the float64 inputs (query[, key[, value]]), detached
    allowed: Tensor | None
    through_masks: bool = False

    @property
    def consequence_of(self) -> tuple[str, ...]:
        """Detectors whose failure explains this one: gradient that reaches blocked keys follows from a forward
        that lets them in (fix that first)."""
        return ("future_leakage", "mask_honoured") if self.through_masks else ()


def gradient_sites(probe, result: DetectorResult) -> list[Site]:
    replay = result.replay
    if replay is None:
        return []
    return mask_gradient_sites(probe, replay) if replay.through_masks else backward_sites(probe, replay)


def backward_sites(probe, replay: GradientReplay) -> list[Site]:
    """On the float64 copy and the very inputs the check used: a `.detach()` (or no_grad block) on the way, else a
    hand-written backward that ran."""
    sub = replay.twin
    inputs = [x.detach().clone().requires_grad_(True) for x in replay.inputs]
    probe.seed_layer_rng()
    called = []

    def profile(frame, event, arg):
        if event == "return" and frame_kind(frame.f_code) == 0:
            called.append(user_frames(frame))

    try:
        with torch.enable_grad():
            cut = GradientCut()
            with cut:
                out = graph_call(sub, *pack(inputs), replay.allowed)
            if cut.cut:
                return [site(cut.cut, "detached", "the output of this call does not require grad though its input "
                                                  "does: no gradient flows back through here",
                             "remove the .detach() (or the torch.no_grad() block, or the .data) here: the weights "
                             "before it need their gradient")]
            old = sys.getprofile()
            sys.setprofile(profile)
            try:
                grad_of((out ** 2).sum(), inputs)
            finally:
                sys.setprofile(old)
    except Exception:
        return []
    hand = [f for f in called if f]
    if hand:
        return [site(hand[0], "backward", "a hand-written backward ran here: check it with torch.autograd.gradcheck",
                     "fix this backward to return the true derivative (torch.autograd.gradcheck(fn, float64 inputs) "
                     "checks it), or drop the autograd.Function and let autograd differentiate the forward")]
    return []


def mask_gradient_sites(probe, replay: GradientReplay) -> list[Site]:
    """Gradient reaching keys a mask blocks (or the future): on the check's very inputs (in the layer's own
    dtype) and mask, the masks, else the streams, else what made the weights (a second softmax gives blocked keys
    weight back)."""
    s = probe.subject
    q, k, v = pack([x.detach().to(s.dtype) for x in replay.inputs])
    B, T, t_k = q.shape[0], q.shape[s.time_dim], k.shape[s.time_dim]
    allowed = replay.allowed
    trace = trace_call(s, q, k, v, allowed, seed=probe.seed)
    if trace.output is None:
        return []
    declared = declared_mask(probe, B, T, t_k, allowed)
    return (mask_sites(trace, declared, B, T, t_k) or (stream_sites(trace, s) if q is not k else [])
            or weights_origin(probe, trace, allowed, T, t_k))


@detector("gradients", "gradients are right: autograd's directional derivative of (out ** 2).sum() matches finite "
          "differences in float64; for a causal layer no gradient flows from outputs to earlier positions' future "
          "inputs, and keys a padding mask blocks get none",
          targets=("detached softmax or attention under torch.no_grad()", "a custom autograd.Function with a wrong "
                   "backward", "a backward that lets the future in", "gradient reaching masked keys"),
          fix="compute attention with autograd on (no .detach(), no torch.no_grad()); check a custom backward with "
              "torch.autograd.gradcheck", locate=gradient_sites)
def check_gradients(probe: Probe) -> DetectorResult:
    det = "gradients"
    sub = float64_copy_or_skip(probe, det)
    if isinstance(sub, DetectorResult):
        return sub
    made = gradient_probe(probe, sub)  # the forward and backward parameters_used reads too
    if made.failed == "forward":
        error = made.error
        return skip(det, f"the layer does not run as a float64 copy ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:160] if str(error) else ''}), and finite differences need "
                         f"float64; if it raises in its own dtype too, see `runs`")
    inputs, allowed, padded, out = list(made.inputs), made.allowed, made.padded, made.out
    B, T = inputs[0].shape[0], inputs[0].shape[sub.time_dim]
    gen = probe.generator()
    qkv = pack

    def replay(through_masks: bool = False) -> GradientReplay:
        return GradientReplay(sub, tuple(x.detach() for x in inputs), allowed, through_masks)

    params = [p for _, p in made.params]
    probe.passes += 4  # four forwards for the finite differences (six when they disagree, more at a kink)
    try:
        if out.grad_fn is None:
            if params:
                return result(det, "fail", "no gradient reaches the output: attention runs without autograd",
                               value=0.0, threshold=0.0, evidence=f"the output has no grad_fn although the layer "
                               f"has {len(params)} trainable parameters (torch.no_grad() or .detach() inside)", replay=replay())
            return DetectorResult(det, "skip", "not applicable: the layer has no trainable parameters and no "
                                               "differentiable path")
        if made.failed == "backward":
            raise made.error
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs + params, made.grads)]
        # finite everywhere iff the sum is (a NaN or inf entry makes it NaN or inf; float64 finite values overflow
        # only past 1e308), one pass each and no temporary: squaring first allocated 13 MB of float64 per audit of
        # a 512-wide layer, 2.6 ms of its 20. The output too: a NaN written over an output value has gradient 0, so
        # the gradients can all be finite while the finite differences read NaN, and `rel > limit` is False for NaN
        grads_finite = math.isfinite(float(sum(g.sum() for g in grads)))
        if not grads_finite or not math.isfinite(float(out.detach().sum())):
            given = " with a padding mask" if padded else ""
            if not bool(torch.isfinite(out).all()):
                also = "" if grads_finite else ", and so are its gradients"
                return result(det, "fail", f"the output is NaN or inf on an ordinary input{given}{also}",
                               value=math.inf, threshold=0.0,
                               evidence=f"float64 copy, B={B}, T={T}{given}: {int((~torch.isfinite(out)).sum())} "
                                        f"non-finite output values", replay=replay())
            return result(det, "fail", f"gradients are NaN or inf on an ordinary input{given}", value=math.inf,
                           threshold=0.0, evidence="(out ** 2).sum() has a non-finite gradient w.r.t. the inputs or "
                                                   "parameters", replay=replay())
        # causal: the second backward, through the graph the first one kept, before the finite differences change
        # the parameters in place (autograd refuses a graph whose saved tensors have changed); judged after them
        leak = _future_gradient(probe, sub, inputs, qkv, allowed, out) if probe.causal and T >= 2 else ""
        # inputs: Gaussian draws over every entry; parameters: Gaussian draws at up to PARAMETER_ENTRIES entries
        # of each tensor, at pseudo-random places (a million-entry direction costs more than the whole check,
        # and a detached or wrong backward is wrong at almost every entry of the weights it misses)
        u_in = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device) for x in inputs]
        picks = []  # per parameter: (flat indices, direction there)
        with torch.no_grad():
            for p in params:
                if not p.is_contiguous():  # the float64 copy's own tensor: entries addressable through a flat view
                    p.data = p.data.contiguous()
        for p in params:
            k = min(p.numel(), PARAMETER_ENTRIES)
            # a low-discrepancy sequence of places (a permutation of a million entries costs more than the check)
            spread = torch.arange(k, dtype=torch.float64).mul_(0.6180339887498949).add_(float(torch.rand((), generator=gen)))
            index = spread.frac_().mul_(p.numel()).long().unique() if k < p.numel() else torch.arange(k)
            picks.append((index.to(p.device), torch.randn(len(index), generator=gen, dtype=torch.float64).to(p.device)))
        originals = [p.detach().reshape(-1)[i].clone() for p, (i, _) in zip(params, picks)]

        groups = ["the inputs"] + [name for name, _ in made.params]  # the direction's parts: 0 the inputs, 1.. params
        every = frozenset(range(len(groups)))
        losses: dict = {}  # (eps, the groups moved) -> loss: the kink check reuses the central differences' points

        def loss_at(eps: float, moved: frozenset = every) -> float:
            moved = moved if eps else every  # nothing moves at 0
            if (eps, moved) in losses:
                return losses[eps, moved]
            # under grad mode, like the autograd call: torch's layers take fused fast paths without it
            probe.seed_layer_rng()
            with torch.no_grad():
                for j, (p, p0, (i, d)) in enumerate(zip(params, originals, picks), 1):
                    if j in moved:
                        p.view(-1)[i] = p0 + eps * d  # the float64 copy's own parameters, never the user's
            try:
                step = eps if 0 in moved else 0.0
                with torch.enable_grad():
                    out = sub(*qkv([(x + step * d).detach() for x, d in zip(inputs, u_in)]), allowed).out
                losses[eps, moved] = float((out ** 2).sum())
                return losses[eps, moved]
            finally:
                with torch.no_grad():
                    for p, p0, (i, _) in zip(params, originals, picks):
                        p.view(-1)[i] = p0

        def central(eps: float, moved: frozenset = every) -> float:
            return (loss_at(eps, moved) - loss_at(-eps, moved)) / (2 * eps)

        # the gradient along the direction: every entry of the inputs', the picked entries of the parameters'
        g_dir = grads[:len(inputs)] + [g.reshape(-1)[i] for g, (i, _) in zip(grads[len(inputs):], picks)]
        direction = u_in + [d for _, d in picks]
        owner = [0] * len(inputs) + list(range(1, len(groups)))  # the part of the direction each tensor of it is in
        eps = 1e-4

        def along(moved: frozenset) -> tuple[float, float, float]:
            """(autograd's, the finite differences', |grad| |u|) along the direction's parts `moved`."""
            # Richardson extrapolation of two central differences: error O(eps^4), so that a sharp softmax (an
            # unscaled T5-style layer: 1.6e-3 off with one difference at eps 1e-5) is measured to ~1e-10
            fd = (4 * central(eps / 2, moved) - central(eps, moved)) / 3
            gs = [g for g, j in zip(g_dir, owner) if j in moved]
            u = [d for d, j in zip(direction, owner) if j in moved]
            ad = float(sum((g * d).sum() for g, d in zip(gs, u)))
            # relative to |grad| |u| on the direction's support, the most the directional derivative can be (it
            # may be small by cancellation)
            scale = max(math.sqrt(float(sum((g * g).sum() for g in gs)) * float(sum((d * d).sum() for d in u))), 1e-300)
            return ad, fd, scale

        def jump(moved: frozenset, steady: bool = True) -> float:
            """How much the directional derivative jumps at the point: the second difference over the step,
            (f(h) - 2 f(0) + f(-h)) / h, is h f'' where the layer is smooth and the jump f'(0+) - f'(0-) at a kink;
            extrapolated from h and h / 2 the h f'' cancels. `steady`: 0 unless the same from h / 2 and h / 4
            (`KINK_STEADY`): a kink at the point keeps its jump at every step; what is left where the layer is
            smooth shrinks as h^3 (or is rounding), and a kink crossed within the step moves with it."""
            def second(h):
                return (loss_at(h, moved) - 2 * loss_at(0.0, every) + loss_at(-h, moved)) / h

            def extrapolated(h):
                return 2 * second(h / 2) - second(h)
            if not steady:
                return extrapolated(eps)
            # at steps under eps / 4: a kink crossed within the step (not at the point) is rarer the smaller it is,
            # and where it is crossed at only some of them the jump read from it comes and goes
            reads = [abs(extrapolated(eps / 2 ** i)) for i in (2, 3, 4)]
            return reads[0] if min(reads) > 0 and max(reads) <= KINK_STEADY * min(reads) else 0.0

        ad, fd, scale = along(every)
        rel = abs(fd - ad) / scale
        limit = GRADIENT_AGREEMENT
        if rel > limit:
            # a layer that computes inside in float32 (a softmax upcast to float32 is common) makes the finite
            # differences themselves noisy: two extrapolations from different step sizes disagree by that noise
            fd_fine = (4 * central(eps / 4) - central(eps / 2)) / 3
            limit = max(GRADIENT_AGREEMENT, 30 * abs(fd_fine - fd) / scale)
        # enough digits that two numbers which disagree are printed differently (6 made a failure read like a pass)
        digits = max(6, min(17, 2 - math.floor(math.log10(rel))) if rel > 0 else 6)
        evidence = (f"along a pseudo-random direction of the inputs and parameters, autograd gives {ad:.{digits}g} and "
                    f"extrapolated central differences {fd:.{digits}g}: disagreement {rel:.2g} of |grad| |direction| (up to {limit:.2g} "
                    f"allowed: {GRADIENT_AGREEMENT:.0e}, or 30x the finite differences' own noise)")
        if rel > limit:
            kinked: list[int] = []
            # a jump, not the finite differences' noise (which a kink crossed within the step raises past it)
            jumped = abs(jump(every, steady=False)) > GRADIENT_AGREEMENT * scale
            if jumped:
                # not differentiable at the point along the direction (a ReLU at exactly 0: Swin v2's position-bias
                # MLP at offset 0, its bias zero-initialised; or a kink crossed within the step), so there is no
                # one derivative to compare: the parts of the direction (the inputs, each parameter) with a kink of
                # their own are left out, named, and the check is made again along the rest
                for j, name in enumerate(groups):
                    size = along(frozenset({j}))[2]  # the jump reuses its four points
                    if abs(jump(frozenset({j}))) > GRADIENT_AGREEMENT * size:
                        kinked.append(j)
                probe.passes += 1 + 12 * len(groups) + 6
                rest = every - frozenset(kinked)
                told = (f"; not differentiable at this point along {', '.join(groups[j] for j in kinked)} (its "
                        f"one-sided derivatives differ: a kink such as a ReLU at exactly 0)")
                if not rest:
                    return DetectorResult(det, "skip", "not measured: the layer is not differentiable at the probe "
                                          "point along any part of the direction (kinks such as a ReLU at exactly 0), "
                                          "so finite differences cannot check autograd there", evidence=evidence + told)
            if kinked:  # else no part has a kink of its own at the point: the disagreement stands
                ad, fd, scale = along(rest)
                rel = abs(fd - ad) / scale
                fd_fine = (4 * central(eps / 4, rest) - central(eps / 2, rest)) / 3
                limit = max(GRADIENT_AGREEMENT, 30 * abs(fd_fine - fd) / scale)
                evidence += (f"{told}; without {'it' if len(kinked) == 1 else 'them'}, autograd gives "
                             f"{ad:.{digits}g} and extrapolated central differences {fd:.{digits}g}: disagreement "
                             f"{rel:.2g} (up to {limit:.2g} allowed)")
            if rel > limit and jumped:
                # kinks crossed within the step (not at the point: a ReLU's input near 0, SwinV2-CR's position MLP)
                # are rarer the smaller the step: the same check at steps 16x smaller, where a wrong backward
                # disagrees as much as at eps
                moved = every - frozenset(kinked)
                small = (4 * central(eps / 32, moved) - central(eps / 16, moved)) / 3
                small_fine = (4 * central(eps / 64, moved) - central(eps / 32, moved)) / 3
                probe.passes += 6
                rel_small = abs(small - ad) / scale
                limit_small = max(GRADIENT_AGREEMENT, 30 * abs(small_fine - small) / scale)
                evidence += (f"; at steps 16x smaller (a kink crossed within the step is rarer there), extrapolated "
                             f"central differences {small:.{digits}g}: disagreement {rel_small:.2g} (up to "
                             f"{limit_small:.2g} allowed)")
                if rel_small <= limit_small:
                    rel, limit = rel_small, limit_small
            if rel > limit:
                return result(det, "fail", "autograd's gradient disagrees with the layer's own finite differences "
                               "(a detached or hand-written backward)", value=rel, threshold=limit,
                               evidence=evidence, replay=replay())
        if leak:
            return result(det, "fail", "the gradient lets the future in: past outputs send gradient to later "
                          "inputs", value=1.0, threshold=0.0, evidence=leak + "; " + evidence,
                          replay=replay(through_masks=True))
        checked = ""
        if padded:
            leak, checked = _masked_key_gradient(sub, inputs, grads[1:len(inputs)], allowed)
            if leak:
                return result(det, "fail", "masked keys receive gradient: the mask is applied after the softmax "
                               "normalised over them, or not at all", value=1.0, threshold=0.0,
                              evidence=leak + "; " + evidence, replay=replay(through_masks=True))
        evidence += checked
    except Exception as error:  # the layer raised on float64 or in backward: a finding about its gradients
        return result(det, "fail", f"the backward pass (or the float64 copy) raised: {type(error).__name__}",
                       value=None, evidence=str(error).splitlines()[0][:200] if str(error) else "",
                       fix="make the layer differentiable in float64 (the check that catches wrong backwards)", replay=replay())
    return result(det, "pass", "gradients agree with finite differences" + (" and do not flow from the past to "
                   "the future" if probe.causal else ""), value=rel, threshold=limit, evidence=evidence)


def _masked_key_gradient(sub, inputs, grads, allowed) -> tuple[str, str]:
    """('', what was checked) if the key and value inputs got exactly zero gradient at the keys `allowed` blocks
    for every query; else (the evidence, '')."""
    t_dim = sub.time_dim
    B, T = inputs[1].shape[0], inputs[1].shape[t_dim]
    blocked = ~allowed.cpu().any(1)  # (B, Tk): keys no query may attend
    if not bool(blocked.any()):
        return "", ""
    for name, g in zip(("key", "value") if len(inputs) == 3 else ("key/value input",), grads):
        at = g.movedim(t_dim, -2).abs().amax(-1) if g.dim() > t_dim + 1 else g.abs()  # (B, [H,] Tk)
        at = at.reshape(B, -1, T).amax(1)  # (B, Tk)
        worst = float(at[blocked.to(g.device)].max())
        if worst > 1e-12 * max(float(g.abs().max()), 1e-300):
            return (f"(out ** 2).sum() has gradient up to {worst:.3g} w.r.t. {name} positions a padding mask blocks "
                    f"for every query ({int(blocked.sum())} of them; must be exactly 0)"), ""
    return "", f"; {int(blocked.sum())} keys a padding mask blocks get exactly zero gradient"


def _future_gradient(probe: Probe, sub, inputs, qkv, allowed, out: Tensor) -> str:
    """'' if outputs up to the middle send no gradient to later inputs, else the evidence. Through the graph of
    `out` that the first backward kept; a backward that cannot run twice on one graph (one that frees what it saved)
    gets a forward of its own."""
    t_dim = sub.time_dim
    T = inputs[0].shape[t_dim]
    c = (T - 1) // 2
    probe.passes += 2  # a backward
    try:
        with torch.enable_grad():
            grads = grad_of((out.narrow(t_dim, 0, c + 1) ** 2).sum(), inputs)
    except Exception:  # noqa: BLE001 -- not this graph, then: a fresh one, whose own failure is a finding
        probe.passes += 1
        probe.seed_layer_rng()
        with torch.enable_grad():
            out = graph_call(sub, *qkv(inputs), allowed)
            grads = grad_of((out.narrow(t_dim, 0, c + 1) ** 2).sum(), inputs)
    for name, x, g in zip(("query", "key", "value") if len(inputs) == 3 else ("input",), inputs, grads):
        if g is None:
            continue
        later = g.narrow(t_dim, c + 1, T - c - 1).abs().max()
        if float(later) > 1e-12 * max(float(g.abs().max()), 1e-300):
            return (f"(out[:, :{c + 1}] ** 2).sum() has gradient up to {float(later):.3g} w.r.t. {name} positions "
                    f"after t={c} (must be exactly 0)")
    return ""
