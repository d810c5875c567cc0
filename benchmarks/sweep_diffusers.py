"""diffusers for `python benchmarks/sweep.py diffusers`: the layer audit on every attention diffusers defines.

diffusers has no registry of attention layers to enumerate but its own modules: the population is every attention
processor class of `diffusers.models.attention_processor`, each on that module's `Attention`
("Attention+<processor>"), and every nn.Module class named *Attention defined in a `diffusers.models` module, with
the processor it sets itself or, where it leaves that to the model, the `_default_processor_cls` it declares
("<module>:<class>"). Each is built small from its constructor's own parameter names (`TINY`: 32 wide, 4 heads of
8; `REQUIRED` only where the constructor has no default; a required parameter it cannot fill is a row "not built"
saying which; a fused processor's Attention gets `fuse_projections()`, as diffusers asks), must run a plain forward
on (1, 16, 32) hidden states, or with encoder_hidden_states of 8 tokens beside them where it takes that and cannot
run without (else "not built" with the error: the population is what runs on the audit's inputs), and is audited
zero-config with `diagnostics.audit(layer)`. An inconclusive audit that names a declaration is audited once more
with it, and the row says what that gave (the rate "passed with the one declaration its report names").

Bugs go in through torch's SDPA, the one interface every processor that calls it shares (directly, or through
diffusers' `attention_dispatch`, which calls `torch.nn.functional.scaled_dot_product_attention` by its full name):
in the sweep's forked child it is replaced by `_attend` of tests/test_model_audit.py, the explicit attention the
transformers sweep injects with, first with nothing broken ("reference": the audit must still pass, and the
replacement must have been called, else no bug is judged), then with each of the sweep's `BUGS`. A layer is one
layer, so caught is the audit failing. A mask bug is not applicable where no call reached SDPA with a mask.

`KNOWN`: failures confirmed outside the audit by a plain script (tests/test_sweep_diffusers.py), each with its reason
and source line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import traceback

D, HEADS, WIDTH, T = 32, 4, 8, 16
# a constructor parameter of one of these names gets the value: the layer built small whatever it calls them
TINY = {
    **dict.fromkeys(("query_dim", "dim", "hidden_size", "embed_dim", "in_channels", "channels", "d_model",
                     "inner_dim", "num_channels", "hidden_dim", "hidden_channels", "model_dim", "n_state"), D),
    **dict.fromkeys(("heads", "num_heads", "num_attention_heads", "n_heads", "attention_heads", "n_head"), HEADS),
    **dict.fromkeys(("dim_head", "head_dim", "attention_head_dim"), WIDTH),
}
# a parameter of one of these names gets the value only where the constructor has no default for it: a default
# (no added context projections, as many key/value heads as queries) is the layer as its class makes it
REQUIRED = {
    **dict.fromkeys(("width", "q_dim", "in_dim", "out_channels", "context_dim", "added_kv_proj_dim",
                     "ip_hidden_states_dim"), D),
    **dict.fromkeys(("num_key_value_heads", "kv_heads"), HEADS // 2), "d_kv": WIDTH,
}
PROCESSOR_TINY = {"hidden_size": D, "cross_attention_dim": D, "slice_size": 2}  # what a processor's __init__ needs
DIFFUSERS = "diffusers 0.42.1, diffusers/models/"
_MASK_UNUSED = ("the processor takes attention_mask and never applies it ({}); a mask blocking half the keys leaves "
                "the output exactly as it is without one")
_OUTPUT_DEAD = ("built as the class's defaults allow (pre_only=False, added_kv_proj_dim=None), the processor applies "
                "to_out only where encoder_hidden_states is given ({}), and given it raises for want of to_add_out: "
                "without it the output projection is dead (changing to_out leaves the output unchanged); diffusers' "
                "own blocks build the class with pre_only=True or with added_kv_proj_dim")
KNOWN = {  # row name -> why it fails: a problem of diffusers' own, confirmed by a plain script (the docstring)
    "Attention+JointAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:1434 the parameter, :1484 SDPA called without attn_mask"),
    "Attention+AuraFlowAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:2101 taken by **kwargs, :2154 SDPA called without attn_mask"),
    "Attention+FusedAuraFlowAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:2195 taken by **kwargs, :2251 SDPA called without attn_mask"),
    "Attention+SanaLinearAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:5351 the parameter, never read"),
    "transformers.transformer_anyflow_far:AnyFlowAttention":
        f"called without a mask (attention_mask=None, its default) the processor pads the sequence with zero keys "
        f"and values to a multiple of 128 and attends them: only the BlockMask its model passes keeps them out "
        f"({DIFFUSERS}transformers/transformer_anyflow_far.py:176 the padding, :198 dispatched with that mask); "
        f"with every value row the same vector the outputs differ from it",
    **{name: _OUTPUT_DEAD.format(f"{DIFFUSERS}transformers/{where}") for name, where in (
        ("transformers.transformer_flux:FluxAttention", "transformer_flux.py:132-136"),
        ("transformers.transformer_bria:BriaAttention", "transformer_bria.py:175-179"),
        ("transformers.transformer_bria_fibo:BriaFiboAttention", "transformer_bria_fibo.py:121-125"),
        ("transformers.transformer_longcat_image:LongCatImageAttention", "transformer_longcat_image.py:122-126"),
        ("transformers.transformer_ovis_image:OvisImageAttention", "transformer_ovis_image.py:122-126"))},
}


def diffusers_types() -> list[str]:
    """Every processor class of attention_processor ("Attention+<name>") and every *Attention nn.Module class of
    a diffusers.models module ("<module>:<name>", the module relative to diffusers.models)."""
    import torch
    from diffusers import models
    from diffusers.models import attention_processor as ap

    names = sorted(f"Attention+{n}" for n, c in vars(ap).items()
                   if inspect.isclass(c) and c.__module__ == ap.__name__ and "Processor" in n)
    for info in pkgutil.walk_packages(models.__path__, models.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: its classes are not in this installation's population
            continue
        for n, c in vars(module).items():
            if inspect.isclass(c) and c.__module__ == module.__name__ and n.endswith("Attention") \
                    and issubclass(c, torch.nn.Module):
                names.append(f"{module.__name__[len(models.__name__) + 1:]}:{n}")
    return names


def _filled(cls: type, table: dict, required: dict | None = None) -> dict:
    """Keyword arguments for constructing `cls` from `table` by parameter name, and from `required` for a parameter
    without a default; a parameter without a default in neither raises TypeError naming it."""
    kw = {}
    for name, p in inspect.signature(cls).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in table:
            kw[name] = table[name]
        elif p.default is p.empty and name in (required or {}):
            kw[name] = required[name]
        elif p.default is p.empty:
            raise TypeError(f"needs {name}=, which the sweep cannot choose")
    return kw


def diffusers_build(name: str):
    """The layer `name` names, built small, in eval mode, after a plain forward on (1, T, D) hidden states."""
    import torch
    from diffusers.models import attention_processor as ap

    torch.manual_seed(0)
    if name.startswith("Attention+"):
        proc = getattr(ap, name.split("+", 1)[1])
        extra = {"added_kv_proj_dim": D} if "AddedKV" in name else {}  # those processors read the added projections
        layer = ap.Attention(D, heads=HEADS, dim_head=WIDTH, **extra, processor=proc(**_filled(proc, PROCESSOR_TINY)))
    else:
        module, cls_name = name.split(":")
        cls = getattr(importlib.import_module(f"diffusers.models.{module}"), cls_name)
        layer = cls(**_filled(cls, TINY, REQUIRED))
        default = getattr(cls, "_default_processor_cls", None)  # diffusers' AttentionModuleMixin declares it
        if getattr(layer, "processor", 0) is None and default is not None:  # the model passes it; the class names it
            layer.set_processor(default())
    if name.startswith("Attention+Fused"):
        layer.fuse_projections()  # what a fused processor runs on (diffusers: "use with fuse_projections()")
    _load_own_copies(layer)
    layer.eval()
    with torch.no_grad():
        try:
            layer(torch.randn(1, T, D))
        except Exception:  # a layer that needs its second stream: it runs with one, or it is not built
            if "encoder_hidden_states" not in inspect.signature(layer.forward).parameters:
                raise
            layer(torch.randn(1, T, D), encoder_hidden_states=torch.randn(1, T // 2, D))
    return layer


def _load_own_copies(layer) -> None:
    """A processor that holds its own copy of a projection of the layer (`to_k_custom_diffusion` beside `to_k`: a
    parameter `<child>_<anything>.<rest>` beside the layer's `<child>.<rest>`, of the same shape) loaded from it, as
    diffusers' training script loads Custom Diffusion's (examples/custom_diffusion/train_custom_diffusion.py: weights
    ["to_k_custom_diffusion.weight"] = st[layer_name + ".to_k.weight"], ... load_state_dict(weights)): the layer as
    it is first used, not with random copies that no model holds."""
    import torch

    proc = getattr(layer, "processor", None)
    if not isinstance(proc, torch.nn.Module):
        return
    own = dict(layer.named_parameters())
    children = [n for n, _ in layer.named_children() if n != "processor"]
    with torch.no_grad():
        for name, param in proc.named_parameters():
            head, _, rest = name.partition(".")
            base = next((own[f"{c}.{rest}"] for c in children if head.startswith(f"{c}_") and f"{c}.{rest}" in own
                         and own[f"{c}.{rest}"].shape == param.shape), None)
            if base is not None:
                param.copy_(base)


def _declared(report) -> dict:
    """The declaration an inconclusive report names ("mask='additive:B,Tq,Tk'", "call=lambda layer, x: ...") as
    keyword arguments: a literal read as one, a lambda (the call the report writes out) evaluated."""
    call = ast.parse(f"f({report.declaration})", mode="eval").body
    return {k.arg: eval(compile(ast.Expression(k.value), "<declaration>", "eval"), {})  # noqa: S307 -- our own text
            if isinstance(k.value, ast.Lambda) else ast.literal_eval(k.value) for k in call.keywords}


class _Routed:
    """torch's SDPA replaced, while in use, by `_attend` with `kind` broken ("reference": nothing broken); counts
    its calls and those given a mask or is_causal. Only in the sweep's forked child."""

    def __init__(self, kind: str):
        self.kind, self.calls, self.masked = kind, 0, 0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        import torch
        from test_model_audit import _attend

        self.calls += 1
        self.masked += attn_mask is not None or bool(is_causal)
        flat = query.dim() == 3  # (B*H, T, d): one head a row
        if flat:
            query, key, value = query[:, None], key[:, None], value[:, None]
            attn_mask = None if attn_mask is None or attn_mask.dim() != 3 else attn_mask[:, None]
        Tq, Tk = query.shape[-2], key.shape[-2]
        allowed, bias = None, None
        if self.kind == "mask_ignored":  # the mask given, and is_causal, never applied
            attn_mask, is_causal = None, False
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                allowed = attn_mask
            else:  # additive: a blocked entry is very negative (-inf, the dtype's minimum, -10000)
                allowed = attn_mask > -1e4 / 2
                bias = attn_mask.masked_fill(~allowed, 0)
        if is_causal:
            square = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril()
            allowed = square if allowed is None else allowed & square
        scaling = scale if scale is not None else query.shape[-1] ** -0.5
        out = _attend(self.kind, query, key, value, allowed, scaling, bias=bias, causal=bool(is_causal),
                      dropout=dropout_p).transpose(1, 2)  # (B, H, Tq, d), as SDPA returns
        return out[:, 0] if flat else out

    def __enter__(self):
        import torch

        self.saved = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc):
        import torch

        torch.nn.functional.scaled_dot_product_attention = self.saved


def inject(row, declared: dict, injected: tuple, mask_bugs: tuple, build=None) -> None:
    """The sweep's bugs (`injected`; those in `mask_bugs` only where a mask reached SDPA) through SDPA (`_Routed`),
    each audit of a fresh build (`build(name)`, diffusers' by default), into row.bugs."""
    import diagnostics

    name, make = row.model_type, build or diffusers_build

    with _Routed("reference") as routed:
        rep = diagnostics.audit(make(name), progress=False, **declared)
    if not routed.calls:
        row.why += "; no bug injected: the layer does not call torch's scaled_dot_product_attention"
        return
    if rep.status != "passed":
        row.bugs["reference"] = f"reference {rep.status}: {rep.status_reason[:120]}"
        return
    for bug in injected:
        if bug in mask_bugs and not routed.masked:
            row.bugs[bug] = "not applicable: no call reached SDPA with a mask or is_causal"
            continue
        with _Routed(bug):
            try:
                rep = diagnostics.audit(make(name), progress=False, **declared)
            except Exception as exc:
                row.bugs[bug] = f"raised {type(exc).__name__}"
                continue
        row.bugs[bug] = "caught" if rep.status == "failed" else f"missed ({rep.status})"


def run(row, *, bugs: bool, injected: tuple, mask_bugs: tuple, build=None):
    """The sweep's row for the layer `row.model_type` names (benchmarks/sweep.py's Row, filled in here), built by
    `build(name)` (diffusers' by default; benchmarks/sweep_packages.py passes its own)."""
    import diagnostics
    from diagnostics import AuditUsageError

    name, make = row.model_type, build or diffusers_build
    try:
        layer = make(name)
    except Exception as exc:
        said = str(exc).splitlines()[0][:200] if str(exc) else ""
        row.verdict, row.why = "not built", f"{type(exc).__name__}: {said}"
        return row
    row.cls, row.built = type(layer).__name__, True
    try:
        report = diagnostics.audit(layer, progress=False)
        row.judged(report.status, report.status_reason)
        row.findings = sorted(f.detector + ("" if f.verdict == "fail" else f" ({f.verdict})") for f in report.findings)
        declared = {}
        if report.status == "inconclusive" and report.declaration:
            declared = _declared(report)
            again = diagnostics.audit(make(name), progress=False, **declared)
            row.declared = f"{report.declaration}: {again.status}"
            if again.status == "failed":
                row.findings = sorted(f.detector + ("" if f.verdict == "fail" else f" ({f.verdict})")
                                      for f in again.findings)
        passed = report.status == "passed" or row.declared.endswith(": passed")
        if bugs and passed:
            inject(row, declared, injected, mask_bugs, make)
    except AuditUsageError as exc:
        row.judged("usage error", str(exc))
    except Exception as exc:
        row.verdict = "crashed"
        row.why = f"{type(exc).__name__}: {str(exc)[:200]} | " + traceback.format_exc().splitlines()[-3][:200]
    return row
