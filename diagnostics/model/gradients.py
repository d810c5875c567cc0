"""gradient_flow: every attention parameter gets a finite non-zero gradient of the sum of (out ** 2).sum() over
every tensor the model returns (the logits or hidden states, and a pooled output or a second head's beside them:
a pooling head's attention feeds only the pooled output); for a causal model, no output sends gradient to later
input embeddings (taken as a leaf at the token embedding's output).

A parameter whose module's own output gets no gradient from the model's output is not judged: what comes after
the module discards it at this initialisation (SwinV2's post-norms start at weight 0, a zero-initialised gate), so
no attention computed with autograd could give it one; the result says which modules, and each layer's in-place
audit (`gradients`) still checks the layer's own backward."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._guard import seed_rng
from .._registry import Need, detector
from .._result import DetectorResult
from ._context import ModelContext
from ._runner import device_dtype, first_tensor, output_tensors

ID = "gradient_flow"
FIX = ("compute attention with autograd on (no .detach(), no torch.no_grad()), and keep the causal mask in the "
       "backward path")


def trainable(ctx: ModelContext) -> list:
    """[(name, parameter)] of the attention modules' trainable parameters."""
    return [(f"{p}.{n}", w) for p, m in ctx.modules.items() for n, w in m.named_parameters() if w.requires_grad]


TRAINABLE = Need("trainable attention parameters", lambda c: bool(trainable(c)),
                 "the attention modules have no trainable parameters")


def input_embedding(model: nn.Module, *, decoder: bool = False) -> nn.Module | None:
    """The model's token embedding: `get_input_embeddings()` (Hugging Face's), else its first nn.Embedding. With
    `decoder`, an encoder-decoder's decoder's own (Marian's decoder has an embedding of its own: the model's is
    the encoder's, whose every position the decoder sees through cross-attention)."""
    if decoder:
        get_decoder = getattr(model, "get_decoder", None)
        try:
            inner = get_decoder() if callable(get_decoder) else None
        except Exception:  # a getter that is not implemented: the model's own embedding
            inner = None
        if isinstance(inner, nn.Module) and inner is not model:
            found = input_embedding(inner)
            if found is not None:
                return found
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
            if isinstance(emb, nn.Module):
                return emb
        except Exception:  # a model whose getter is not implemented: look for an nn.Embedding instead
            pass
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


@detector(ID, "every attention parameter gets a finite non-zero gradient; for a causal model, no output sends "
              "gradient to later input embeddings", fix=FIX, needs=(TRAINABLE,), scope="model",
          unlocated="names the first attention layer with a parameter that gets no gradient (its `layer`), whose "
                    "own in-place audit (gradients) points at the line")
def check_gradient_flow(ctx: ModelContext) -> DetectorResult:
    runner = ctx.runner
    params = trainable(ctx)
    seq = runner.inputs[:1]
    emb = input_embedding(ctx.model, decoder=runner.encoder_decoder) if runner.tokens else None
    leaf = {}

    def hook(m, args, out):  # the token embeddings (B, T, D) as a leaf: gradients w.r.t. each position
        if isinstance(out, Tensor) and out.is_floating_point() and out.shape[:2] == seq.shape[:2]:
            x = out.detach().requires_grad_(True)
            leaf["x"] = x
            return x.clone()  # not the leaf itself: a model may scale its embeddings in place (CTRL's *= sqrt(D))
        return None

    handle = emb.register_forward_hook(hook) if emb is not None else None
    outputs: dict = {}  # attention module -> its output (the first call's): does the model send it any gradient?

    def keep(path):
        def output_hook(m, args, out):
            o = first_tensor(out)
            if path not in outputs and isinstance(o, Tensor) and o.requires_grad:
                outputs[path] = o
        return output_hook

    kept = [m.register_forward_hook(keep(p)) for p, m in ctx.modules.items()]
    returned: list = []  # every tensor the model returned, not only the one the runner reads
    kept.append(ctx.model.register_forward_hook(lambda m, args, out: returned.extend(output_tensors(out))))
    try:
        if emb is None and seq.is_floating_point():
            leaf["x"] = seq.detach().clone().requires_grad_(True)
            seq = leaf["x"].clone()  # as above: the model may edit its input in place
        seed_rng(ctx.seed, device_dtype(ctx.model)[0])
        out, _ = runner(seq, grad=True)
        paths = list(outputs)
        total = sum((t.float() ** 2).sum() for t in returned if t.requires_grad and t is not out)
        grads = torch.autograd.grad((out.float() ** 2).sum() + total, [w for _, w in params] +
                                    [outputs[p] for p in paths], allow_unused=True, retain_graph=True)
        grads, to_outputs = grads[:len(params)], grads[len(params):]
        # modules whose output the model sends no gradient to: cut off after them (a zero-initialised post-norm or
        # gate), so their parameters cannot get one whatever the attention does; not judged, and said so
        # (a gradient of exactly 0, not None: an output the graph does not reach was detached, which is judged)
        cut = {p for p, g in zip(paths, to_outputs) if g is not None and not bool(g.abs().sum() > 0)}
        # a parameter's module: the innermost attention module holding it (an attention block may hold one)
        owner = lambda n: max((p for p in ctx.modules if n.startswith(p + ".")), key=len, default=None)  # noqa: E731
        missing = [n for (n, _), g in zip(params, grads) if (g is None or not bool(g.abs().sum() > 0))
                   and owner(n) not in cut]
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
        for h in kept:
            h.remove()
    if nonfinite:
        return DetectorResult(ID, "fail", "attention parameters get non-finite gradients",
                              evidence=", ".join(nonfinite[:6]), fix=FIX)
    if missing:
        owners = sorted({n.rsplit(".", 1)[0] for n in missing})
        layer = next((p for p in ctx.order if any(n.startswith(p + ".") for n in missing)), None)
        return DetectorResult(ID, "fail", f"{len(missing)} of {len(params)} attention parameters get no gradient",
                              value=float(len(missing)), threshold=0.0, fix=FIX, layer=layer,
                              evidence=f"zero or missing gradient of the outputs' (out ** 2).sum(): {', '.join(missing[:8])}"
                                       f"{' ...' if len(missing) > 8 else ''} (in {', '.join(owners[:4])})")
    if leak:
        return DetectorResult(ID, "fail", "the gradient lets the future in: past outputs send gradient to later "
                                          "inputs", evidence=leak, fix=FIX)
    unjudged = [p for p in ctx.order if p in cut] or sorted(cut)  # in call order
    judged = sum(owner(n) not in cut for n, _ in params)
    not_judged = (f"; not judged: the parameters of {len(unjudged)} modules whose output the model sends no gradient "
                  f"at this initialisation (what follows them multiplies it by 0: a zero-initialised norm or gate), "
                  f"{', '.join(unjudged[:4])}{' ...' if len(unjudged) > 4 else ''}" if unjudged else "")
    if unjudged and not judged:
        return DetectorResult(ID, "skip", f"not measured{not_judged.replace('; not judged', '')}")
    return DetectorResult(ID, "pass", f"all {judged} attention parameters get finite non-zero gradients"
                          + (" and no output sends gradient to later input embeddings" if ctx.causal and "x" in leaf
                             else "") + not_judged)
