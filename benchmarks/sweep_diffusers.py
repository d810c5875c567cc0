"""diffusers for `python benchmarks/sweep.py diffusers`: the layer audit on every attention diffusers defines.

diffusers has no registry of attention layers to enumerate but its own modules: the population is every attention
processor class of `diffusers.models.attention_processor`, each on that module's `Attention`
("Attention+<processor>"), and every nn.Module class named *Attention defined in a `diffusers.models` module, with
the processor it sets itself or, where it leaves that to the model, the `_default_processor_cls` it declares
("<module>:<class>"). Each is built small, as diffusers' own models build it:
- sizes by the constructor's own parameter names (`TINY`: 32 wide, 4 heads of 8; key/value heads as many as the
  queries' where the class defaults both alike; `REQUIRED` only where the constructor has no default);
- a required argument the sweep cannot size, from the first call of the class in diffusers.models' source that
  passes it (`Site`: the call's expressions read with the sweep's sizes, the enclosing __init__'s literal defaults
  and, a parameter without one, the arguments its own class's callers pass: Mochi's `added_kv_proj_dim`, a VAE
  block's `kernel_size`); a processor every such call passes (CosmosCausalAttention's);
- a processor on the layer a model sets it on (`_candidates`): the call of an attention class whose `processor=`
  names it (or the class its constructor returns: the deprecated Flux names), with that call's arguments, calls of
  a layer without a second stream's projections first; else attention_processor's Attention; else where its twin is
  set (PAG's and the fused processors' plain one: the PAG pipelines set theirs on those layers); else the class
  that declares it (`_default_processor_cls`, `_available_processors`); a fused processor's layer gets
  `fuse_projections()`, as diffusers asks;
- rotary tables a forward requires, computed as its model computes them for the length (`_positioned`), and a
  processor that takes its batch as PAG's guidance parts given them (`_Guided`).
It must run a plain forward on (1, 16, 32) hidden states, or with its second stream of 8 tokens, a required stream
(the same tokens for a key or a value), a mask that keeps every key where it raises without one (`_ran`; else
"not built" with the error: the population is what runs on the audit's inputs), and is audited
zero-config with `diagnostics.audit(layer)`. An inconclusive audit that names a declaration is audited once more
with it, and the row says what that gave (the rate "passed with the one declaration its report names").

Bugs go in through torch's SDPA, the one interface every processor that calls it shares (directly, or through
diffusers' `attention_dispatch`, which calls `torch.nn.functional.scaled_dot_product_attention` by its full name):
in the sweep's forked child it is replaced by `_attend` of tests/test_model_audit.py, the explicit attention the
transformers sweep injects with, first with nothing broken ("reference": the audit must still pass, and the
replacement must have been called, else no bug is judged), then with each of the sweep's `BUGS`. A layer is one
layer, so caught is the audit failing. A mask bug is not applicable where no call reached SDPA with a mask that blocks a key, or is_causal.

`KNOWN`: failures confirmed outside the audit by a plain script (tests/test_sweep_diffusers.py), each with its reason
and source line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

D, HEADS, WIDTH, T = 32, 4, 8, 16
# a constructor parameter of one of these names gets the value: the layer built small whatever it calls them
TINY = {
    **dict.fromkeys(("query_dim", "dim", "hidden_size", "embed_dim", "in_channels", "channels", "d_model",
                     "inner_dim", "num_channels", "hidden_dim", "hidden_channels", "model_dim", "n_state"), D),
    **dict.fromkeys(("heads", "num_heads", "num_attention_heads", "n_heads", "attention_heads", "n_head"), HEADS),
    **dict.fromkeys(("dim_head", "head_dim", "attention_head_dim", "dim_heads"), WIDTH),
    "kv_dim": D,
}
KV_HEADS = ("kv_heads", "num_key_value_heads")  # as many as the queries' where the class defaults both alike
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
        f"{DIFFUSERS}attention_processor.py:5351 the parameter, never read") + (
        f"; and, built as Sana builds it (transformers/sana_transformer.py:215, bias=True), a query whose ReLU "
        f"features are all zero gets no weight on any key: its normaliser is 0, and 0 / (0 + 1e-15) leaves the "
        f"head's output 0 where a softmax's weights sum to 1 (attention_processor.py:5371 the ReLU, :5380)"),
    # inconclusive zero-config (it needs mask='allowed:Tq,Tk'), it fails runs under that declaration for this problem
    "Attention+CustomDiffusionAttnProcessor2_0":
        f"at batch 2 any attention_mask raises: the processor hands SDPA prepare_attention_mask's (B x heads, 1, Tk) "
        f"mask ({DIFFUSERS}attention_processor.py:3940, :3980) without the view to (B, heads, 1, Tk) that "
        f"AttnProcessor2_0 makes (:2737), so 'The size of tensor a (4) must match the size of tensor b (8)'; at batch "
        f"1 it runs",
    # joint processors: inconclusive zero-config (they need encoder_hidden_states), they fail mask_honoured under the
    # declaration their report names, for this problem of their own
    "Attention+FusedJointAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:1841 the parameter, :1883 SDPA called without attn_mask"),
    "Attention+PAGJointAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:1522 the parameter, :1567 and :1631 SDPA called without attn_mask"),
    "Attention+PAGCFGJointAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:1678 the parameter, :1732 and :1796 SDPA called without attn_mask"),
    "Attention+PAGCFGSanaLinearAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:5403 the parameter, never read"),
    "Attention+PAGIdentitySanaLinearAttnProcessor2_0": _MASK_UNUSED.format(
        f"{DIFFUSERS}attention_processor.py:5458 the parameter, never read"),
    "Attention+MochiVaeAttnProcessor2_0":
        f"built as Mochi's VAE builds it ({DIFFUSERS}autoencoders/autoencoder_kl_mochi.py:173-180: is_causal=True, "
        f"qk_norm='l2', dim_head=32), the processor takes attention_mask and raises on any: it passes the mask to SDPA "
        f"together with is_causal=attn.is_causal (attention_processor.py:2929 the mask prepared, :2971-2972 SDPA "
        f"given both; torch: 'Explicit attn_mask should not be set when is_causal=True'); and q and k reach SDPA "
        f"L2-normalised (attention_processor.py:214-216, LpNorm) under SDPA's default 1/sqrt(32), so every logit lies "
        f"within +-0.354 and no key can get more than e^0.71 = 2.0 times another's weight: attention near uniform "
        f"whatever the weights (whether Genmo's original does the same was not checked)",
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
    _calls()  # read once here, in the sweep's parent: every forked child has them
    return names


def _filled(cls: type, table: dict, required: dict | None = None, *, site: Site | None = None) -> dict:
    """Keyword arguments for constructing `cls` from `table` by parameter name; then, where `site` is given, every
    other argument diffusers' own call there passes (`Site.arguments`); then from `required` for a parameter without
    a default, else from the first call site of diffusers' that passes it; a parameter without a default in none of
    them raises TypeError naming it. A class that takes only **kwargs gets the site's arguments."""
    kw, given = {}, {} if site is None else site.arguments(cls)
    params = {n: p for n, p in inspect.signature(cls).parameters.items() if p.kind not in (p.VAR_POSITIONAL,
                                                                                           p.VAR_KEYWORD)}
    if not params and site is None and any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values()):
        site = next(iter(_sites(cls.__name__)), None)  # forwards everything (to Attention): as diffusers calls it
        given = {} if site is None else site.arguments(cls)
    for name in given.keys() - params.keys() if not params else ():
        kw[name] = table.get(name, given[name])
    heads = next((p.default for n, p in params.items() if n in TINY and TINY[n] == HEADS), None)
    for name, p in params.items():
        if name in table:
            kw[name] = table[name]
        elif name in KV_HEADS and p.default == heads and table is TINY:
            kw[name] = HEADS
        elif name in given:
            kw[name] = given[name]
        elif p.default is p.empty and name in (required or {}):
            kw[name] = required[name]
        elif p.default is p.empty or (name == "processor" and _sites(cls.__name__) and all(
                name in s.arguments(cls) for s in _sites(cls.__name__))):
            # required, or a processor every model passes (CosmosCausalAttention declares none and raises without)
            passed = next((s.arguments(cls)[name] for s in _sites(cls.__name__) if name in s.arguments(cls)), _NONE)
            if passed is _NONE:
                raise TypeError(f"needs {name}=, which the sweep cannot choose")
            kw[name] = passed
    return kw


_NONE = object()


ROTARY = re.compile(r"rot|rope", re.I)  # a parameter that takes rotary tables: `rotary_emb`, `rope`


def _width(name: str) -> bool:
    """A name that says it is a width (`pooled_projection_dim`, `out_channels`)."""
    return name.endswith(("_dim", "channels")) and not name.endswith(("head_dim", "heads_dim"))


@dataclass(frozen=True)
class Site:
    """One call `Class(...)` in diffusers.models' source: what a model of diffusers builds a layer with."""
    module: str  # diffusers.models.<...>
    call: ast.Call
    function: ast.FunctionDef  # the function that makes the call, whose parameters its expressions may name
    owner: str = ""  # the class whose method that is ("" for a module-level function)

    def arguments(self, cls: type, depth: int = 3) -> dict:
        """The arguments the call passes that can be read without running the model: each expression evaluated
        with the sweep's sizes for names of `TINY` (`dim_head=dim // num_heads` is 8), the enclosing function's
        literal defaults for its other parameters (`qk_norm='rms_norm' if qk_norm else None`), a parameter without
        one as the first call of the enclosing class passes it (`depth` calls up: a block's `kernel_size` as its
        model's __init__ defaults it), and the module's processor classes (`processor=FluxAttnProcessor()`); an
        argument that needs more (`self.inner_dim`, a config read at run time) is left out. Positional arguments
        by `cls`'s parameters in order."""
        args = self.function.args
        defaults = dict(zip([a.arg for a in args.args][len(args.args) - len(args.defaults):], args.defaults))
        defaults.update((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
        names = {n: c for n, c in vars(importlib.import_module(self.module)).items()
                 if inspect.isclass(c) and "Processor" in n}
        order = [n for n, p in inspect.signature(cls).parameters.items() if p.kind in (p.POSITIONAL_ONLY,
                                                                                         p.POSITIONAL_OR_KEYWORD)]
        pairs = list(zip(order, self.call.args)) + [(k.arg, k.value) for k in self.call.keywords if k.arg]
        out = {}
        for name, node in pairs:
            for _ in range(8):  # each round resolves one more name the expression reads
                try:  # diffusers' own source, evaluated on literals and the names resolved here alone
                    out[name] = eval(compile(ast.Expression(node), "<diffusers>", "eval"),  # noqa: S307
                                     {"__builtins__": {}}, names)
                    break
                except NameError as exc:
                    if not self._resolve(exc.name, names, defaults, depth):
                        break
                except Exception:  # noqa: BLE001 -- needs the model's state: left to the class's default
                    break
        return out

    def _resolve(self, name: str, names: dict, defaults: dict, depth: int) -> bool:
        """`names[name]` set from the sweep's sizes, the enclosing function's literal default, or the first call of
        the enclosing class that passes it; False where none does."""
        if name in TINY or _width(name):  # a width the model defaults at its full size: the sweep's
            names[name] = TINY.get(name, WIDTH if ROTARY.search(name) else D)  # a rotary one rotates a head
            return True
        if name in defaults:
            try:
                names[name] = ast.literal_eval(defaults[name])
                return True
            except ValueError:
                return False
        owner = getattr(importlib.import_module(self.module), self.owner, None)
        if depth <= 0 or self.function.name != "__init__" or not inspect.isclass(owner) or \
                name not in [a.arg for a in (*self.function.args.args, *self.function.args.kwonlyargs)]:
            return False
        for site in _sites(self.owner):
            try:
                passed = site.arguments(owner, depth - 1)
            except Exception:  # noqa: BLE001, S112 -- a call it cannot read
                continue
            if name in passed:
                names[name] = passed[name]
                return True
        return False

    def names(self, processor: str) -> bool:
        """Whether the call sets `processor`: its `processor=` argument names the class, directly or through a
        variable the enclosing function assigns (`processor = AttnAddedKVProcessor2_0() if ... else ...`)."""
        value = next((k.value for k in self.call.keywords if k.arg == "processor"), None)
        if value is None:
            return False
        texts = [ast.unparse(value)]
        if isinstance(value, ast.Name):
            texts += [ast.unparse(n.value) for n in ast.walk(self.function) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == value.id for t in n.targets)]
        return any(re.search(rf"\b{processor}\b", text) for text in texts)


_SITES: dict = {}  # called name -> its Sites, read once (`_calls`)


def _calls() -> dict:
    """Every call in diffusers.models' source by the name it calls, each a Site, in file and line order; read once
    (the sweep's parent reads them before it forks, `diffusers_types`, so every child has them)."""
    if not _SITES:
        from diffusers import models

        root, seen = Path(models.__path__[0]), set()
        for path in sorted(root.rglob("*.py")):
            module = ".".join((models.__name__, *path.relative_to(root).with_suffix("").parts))
            tree = ast.parse(path.read_text())
            owners = {id(f): c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
            for function in ast.walk(tree):
                if not isinstance(function, ast.FunctionDef):
                    continue
                for node in ast.walk(function):
                    called = isinstance(node, ast.Call) and (getattr(node.func, "id", None)
                                                             or getattr(node.func, "attr", None))
                    if called and id(node) not in seen:  # a nested function's calls: once, in the outer one
                        seen.add(id(node))
                        _SITES.setdefault(called, []).append(Site(module, node, function,
                                                                  owners.get(id(function), "")))
    return _SITES


def _sites(cls_name: str) -> list[Site]:
    """Every call of `cls_name` in diffusers.models' source, in file and line order."""
    return _calls().get(cls_name, [])


def _candidates(proc: type):
    """The layers a processor `proc` may be set on, in order, each built when asked for: first where a model of
    diffusers sets it (or the class its constructor returns, a deprecated name's `__new__`), a call site of an
    attention class whose `processor=` names it, built with that call's arguments (`Site.arguments`); then
    attention_processor's Attention as it stands (with added projections for a processor named AddedKV, which reads
    them); then where a model sets its twin (PAG's and the fused processors' unperturbed, unfused one: the pipeline
    sets PAG's on those layers); then the attention class that declares it (`_default_processor_cls`,
    `_available_processors`), built as the sweep builds that class."""
    from diffusers import models
    from diffusers.models import attention_processor as ap

    made = proc(**_filled(proc, PROCESSOR_TINY))
    names = {proc.__name__, type(made).__name__}
    twins = {re.sub(r"^(Fused|PAG(CFG)?(Identity)?)", "", n) for n in names} - names
    fresh = lambda: proc(**_filled(proc, PROCESSOR_TINY))  # noqa: E731
    for called, site in _named_sites(names):
        yield lambda called=called, site=site: _with(_built(getattr(importlib.import_module(site.module), called),
                                                            site), fresh, made)
    extra = {"added_kv_proj_dim": D} if "AddedKV" in proc.__name__ else {}
    yield lambda: ap.Attention(D, heads=HEADS, dim_head=WIDTH, **extra, processor=fresh())
    for called, site in _named_sites(twins):
        yield lambda called=called, site=site: _with(_built(getattr(importlib.import_module(site.module), called),
                                                            site), fresh, made)
    for info in pkgutil.walk_packages(models.__path__, models.__name__ + "."):
        module = _imported(info.name)
        for n, cls in vars(module or {}).items():
            if inspect.isclass(cls) and n.endswith("Attention") and cls.__module__ == info.name and type(made) in (
                    getattr(cls, "_default_processor_cls", None), *(getattr(cls, "_available_processors", None) or ())):
                yield lambda cls=cls: _with(_built(cls), fresh, made)


def _with(layer, fresh, made):
    """`layer` with the processor `fresh()` makes, unless its build set one of that class already."""
    if type(getattr(layer, "processor", None)) is not type(made):
        layer.set_processor(fresh())
    return layer


def _named_sites(names: set) -> list:
    """(class name, site) of every call of an attention class whose `processor=` names one of `names`; those whose
    layer holds no projections of a second stream first (no `added_kv_proj_dim`: the audit gives one stream, which
    would leave them unused), each in file and line order."""
    found = []
    for called, sites in _calls().items():
        if called.endswith("Attention"):
            for site in sites:
                cls = getattr(importlib.import_module(site.module), called, None)
                if inspect.isclass(cls) and any(site.names(n) for n in names):
                    found.append((site.arguments(cls).get("added_kv_proj_dim") is not None, site.module,
                                  site.call.lineno, called, site))
    return [(called, site) for *_, called, site in sorted(found, key=lambda f: f[:3])]


def _imported(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 -- an optional dependency missing: not in this installation
        return None


def diffusers_build(name: str):
    """The layer `name` names, built small, in eval mode, after a plain forward on (1, T, D) hidden states."""
    from diffusers.models import attention_processor as ap

    if name.startswith("Attention+"):
        first = None
        for build in _candidates(getattr(ap, name.split("+", 1)[1])):
            try:
                return _prepared(name, build)
            except Exception as exc:  # noqa: BLE001 -- not there: the next, else the first one's error says why
                first = first or exc
        raise first
    module, cls_name = name.split(":")
    cls = getattr(importlib.import_module(f"diffusers.models.{module}"), cls_name)
    return _prepared(name, lambda: _built(cls))


def _prepared(name: str, build):
    """`build()`, from seed 0, fused where the row's processor is (diffusers: "use with fuse_projections()"), its
    processor's own copies loaded (`_load_own_copies`), in eval mode, after a plain forward (`_ran`)."""
    torch.manual_seed(0)
    layer = build()
    if name.startswith("Attention+Fused"):
        layer.fuse_projections()
    _load_own_copies(layer)
    layer.eval()
    return _ran(layer)


def _built(cls, site=None):
    """`cls` built small: `TINY` by parameter name, then (where `site` is given) every argument diffusers' own call
    `site` passes, then `REQUIRED`, then a required argument from the first call site of diffusers' that passes it;
    the processor it sets, or the `_default_processor_cls` it declares where it leaves that to the model."""
    layer = cls(**_filled(cls, TINY, REQUIRED, site=site))
    default = getattr(cls, "_default_processor_cls", None)  # diffusers' AttentionModuleMixin declares it
    if getattr(layer, "processor", 0) is None and default is not None:  # the model passes it; the class names it
        layer.set_processor(default())
    return layer


def _ran(layer):
    """`layer` after a plain forward on (1, T, D) hidden states: alone, else with its second stream (a forward
    parameter named *encoder_hidden_states) of T // 2 tokens, else also with a mask that keeps every key where it
    raises without one (ones: every key kept, read as bool, as kept keys or as an additive mask alike), else at a
    guidance batch (`_Guided`). A required parameter besides the query is given the same tokens where it is a key or
    a value, else the second stream."""
    layer = _positioned(layer) or layer
    x, memory = torch.randn(1, T, D), torch.randn(1, T // 2, D)
    params = list(inspect.signature(layer.forward).parameters.values())
    required = {p.name: x if p.name in ("key", "value") else memory for p in params[1:]
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    stream = next((p.name for p in params if p.name.endswith("encoder_hidden_states") and p.name not in required),
                  None)
    mask = next((p.name for p in params if "mask" in p.name and p.name not in required), None)
    tries = [{}] + ([{stream: memory}] if stream else [])
    tries += [{**kw, mask: torch.ones(1, T // 2 if kw else T)} for kw in tries] if mask else []
    first = None
    with torch.no_grad():
        for copies in (1, 2, 3):
            for kw in tries:
                try:
                    (layer if copies == 1 else _Guided(layer, copies))(x, **required, **kw)
                    return layer if copies == 1 else _Guided(layer, copies)
                except Exception as exc:  # noqa: BLE001 -- not so: the last error at batch 1 says why it does not run
                    first = exc if copies == 1 else first
    raise first


def _positioned(layer):
    """`layer` given the rotary tables its model computes where its forward requires them (a parameter without a
    default named for them: `rotary_emb`, `rope`), as `_Positioned`: the model's line `name = self.attr(x.shape[1],
    x.device)` in the layer's module, with the class its __init__ assigns to `self.attr`, built with the arguments
    that call passes (`Site.arguments`: its widths the sweep's heads'); None where the layer requires none, or its
    model computes them from more than the length."""
    params = list(inspect.signature(layer.forward).parameters.values())[1:]
    wanted = next((p.name for p in params if p.default is p.empty and ROTARY.search(p.name)), None)
    if wanted is None or any(p.default is p.empty and p.name != wanted for p in params):
        return None
    module = importlib.import_module(type(layer).__module__)
    tree = ast.parse(inspect.getsource(module))
    made = {}  # self.<attr> = <Class>(...) in an __init__: attr -> the call
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", "") == "self":
                    made[target.attr] = node.value
    for node in ast.walk(tree):  # table = self.<attr>(<x>.shape[1], <x>.device)
        call = node.value if isinstance(node, ast.Assign) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in made
                and len(call.args) == 2 and ast.unparse(call.args[0]).endswith(".shape[1]")
                and ast.unparse(call.args[1]).endswith(".device")):
            continue
        built = made[call.func.attr]
        cls = getattr(module, built.func.id, None)
        site = next((s for s in _sites(built.func.id) if s.module == module.__name__
                     and s.call.lineno == built.lineno), None)
        if inspect.isclass(cls) and site is not None:
            return _Positioned(layer, wanted, cls(**site.arguments(cls)))
    return None


class _Positioned(torch.nn.Module):
    """A layer given the rotary tables `rope(T, device)` its model computes for the length of the hidden states, as
    `name`; nothing else (a layer whose forward takes a mask takes it as `attention_mask`: `_PositionedMasked`)."""

    def __init__(self, layer, name: str, rope):
        super().__init__()
        self.layer, self.name, self.rope = layer, name, rope

    def __new__(cls, layer, name, rope):
        takes_mask = "attention_mask" in inspect.signature(layer.forward).parameters
        return super().__new__(_PositionedMasked if takes_mask and cls is _Positioned else cls)

    def forward(self, hidden_states):
        return self.layer(hidden_states, **{self.name: self.rope(hidden_states.shape[1], hidden_states.device)})


class _PositionedMasked(_Positioned):
    def forward(self, hidden_states, attention_mask=None):
        return self.layer(hidden_states, attention_mask=attention_mask,
                          **{self.name: self.rope(hidden_states.shape[1], hidden_states.device)})


class _Guided(torch.nn.Module):
    """A processor that takes its batch as guidance parts (PAG's: `hidden_states.chunk(2)` into the prompt's and the
    perturbed path's, `chunk(3)` with classifier-free guidance's unconditioned part first) given `copies` copies of
    its input along the batch, as the pipeline that sets it does, and read at the first part: attention, where the
    perturbed path (the last part) attends no keys and returns its values. The mask reaches the attention path,
    every part but the last, once per part (diffusers prepares it for that path's batch)."""

    def __init__(self, layer, copies: int):
        super().__init__()
        self.layer, self.copies = layer, copies

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B = hidden_states.shape[0]  # batch
        parts = lambda t, n: None if t is None else t.repeat(n, *[1] * (t.dim() - 1))  # noqa: E731
        out = self.layer(parts(hidden_states, self.copies), encoder_hidden_states=parts(encoder_hidden_states,
                         self.copies), attention_mask=parts(attention_mask, self.copies - 1))
        return out[:B] if torch.is_tensor(out) else tuple(o[:B] for o in out)  # (copies x B, T, D): the first part
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


CAUSAL = "causal=True"


def masks_the_future(report) -> bool:
    """Whether the report's `undeclared_causality` hint says the layer masks the future itself, suggesting `causal=True`
    (the declaration a user then adds: a zero-config audit checks no causality), read from the finding's data."""
    return any(f.detector == "undeclared_causality" and f.verdict == "warn"
               and f.extras.get("suggests") == {"causal": True} for f in report.findings)


def _declared(report) -> dict:
    """The declaration an inconclusive report names ("mask='additive:B,Tq,Tk'", "call=lambda layer, x: ...") as
    keyword arguments: a literal read as one, a lambda (the call the report writes out) evaluated."""
    call = ast.parse(f"f({report.declaration})", mode="eval").body
    return {k.arg: eval(compile(ast.Expression(k.value), "<declaration>", "eval"), {})  # noqa: S307 -- our own text
            if isinstance(k.value, ast.Lambda) else ast.literal_eval(k.value) for k in call.keywords}


NO_MASK = "not applicable: no call reached SDPA with a mask that blocks a key, or is_causal"
BLOCKS = -50.0
"""An additive mask's entry at or below this blocks its key: exp(-50) < 2e-22, far under float32's resolution of a weight
beside 1 (Swin's shifted-window mask writes -100, others -10000, the dtype's minimum or -inf); above it, a bias (BEiT's
and Swin's relative position bias, handed to SDPA as attn_mask, are a few units)."""


class _Routed:
    """torch's SDPA replaced, while in use, by `_attend` with `kind` broken ("reference": nothing broken); counts
    its calls and those given a mask that blocks a key or is_causal, and keeps the scales given. Only in the sweep's
    forked child."""

    def __init__(self, kind: str):
        self.kind, self.calls, self.masked, self.scales = kind, 0, 0, []

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        import torch
        from test_model_audit import _attend

        self.calls += 1
        # a mask that blocks a key (a False, a very negative entry, or is_causal): a float mask of finite biases only
        # (BEiT's and Swin's relative position bias handed to SDPA as attn_mask) blocks nothing, and a mask bug there
        # would only drop or move a position bias
        self.masked += bool(is_causal) or attn_mask is not None and bool(
            (~attn_mask).any() if attn_mask.dtype == torch.bool else (attn_mask <= BLOCKS).any())
        self.scales.append(scale)  # None: SDPA's own 1/sqrt(d)
        flat = query.dim() == 3  # (B*H, T, d): one head a row
        if flat:
            query, key, value = query[:, None], key[:, None], value[:, None]
            attn_mask = None if attn_mask is None or attn_mask.dim() != 3 else attn_mask[:, None]
        # (B, H, blocks, T, d): NesT's, every axis but the last two a batch as SDPA reads them, kept as they come
        # (`_attend` reads the third from last as the heads), so that the weights have the layer's call's shape
        Tq, Tk = query.shape[-2], key.shape[-2]
        allowed, bias = None, None
        if self.kind == "mask_ignored":  # the mask given, and is_causal, never applied
            attn_mask, is_causal = None, False
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                allowed = attn_mask
            else:  # additive: a blocked entry is very negative (-inf, the dtype's minimum, -10000, Swin's -100)
                allowed = attn_mask > BLOCKS
                bias = attn_mask.masked_fill(~allowed, 0)
        if is_causal:
            square = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril()
            allowed = square if allowed is None else allowed & square
        scaling = scale if scale is not None else query.shape[-1] ** -0.5
        out = _attend(self.kind, query, key, value, allowed, scaling, bias=bias, causal=bool(is_causal),
                      dropout=dropout_p).transpose(-3, -2)  # (B, H, Tq, d), as SDPA returns
        return out[:, 0] if flat else out

    def __enter__(self):
        self.saved = swap_sdpa(self)
        return self

    def __exit__(self, *exc):
        swap_sdpa(self.saved)


def swap_sdpa(replacement):
    """torch's `scaled_dot_product_attention` replaced by `replacement` (the sweep's explicit attention, or torch's own
    back again); returns the one it replaced."""
    import torch

    saved = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = replacement
    return saved


def inject(row, declared: dict, injected: tuple, mask_bugs: tuple, build=None) -> None:
    """The sweep's bugs (`injected`; those in `mask_bugs` only where a mask reached SDPA) through SDPA (`_Routed`),
    each audit of a fresh build (`build(name)`, diffusers' by default), into row.bugs. Where every SDPA call stated
    one scale and the reference (SDPA written out, nothing broken) passes with it declared, or fails without, the
    reference and the bugs are audited with that scale declared: the layer's words to SDPA, which the written-out
    attention cannot state (before, only where the reference did not pass: a cosine attention's stated 8, dropped,
    reads as a cosine times 1, a temperature a correct layer may have, so titans' MemoryAttention's missing scale
    passed)."""
    import diagnostics

    name, make = row.model_type, build or diffusers_build

    with _Routed("reference") as routed:
        rep = diagnostics.audit(make(name), progress=False, **declared)
    if not routed.calls:
        row.why += "; no bug injected: the layer does not call torch's scaled_dot_product_attention"
        return
    stated = set(routed.scales)
    if "scale" not in declared and len(stated) == 1 and None not in stated:
        # the scale the layer states to SDPA (NaViT's `scale=1` after RMS-normalised q and k) is its own words, which
        # the explicit reference cannot state: declared, as the user who wrote that attention out would declare it,
        # where the reference passes with it or fails without it (a layer that scales q itself and hands SDPA 1 states
        # no whole factor there: it passes undeclared, and fails under 1)
        with _Routed("reference") as again:
            stating = diagnostics.audit(make(name), progress=False, **declared, scale=next(iter(stated)))
        if not again.calls:  # the layer no longer reached SDPA: nothing written out was audited
            row.why += "; no bug injected: the layer did not call torch's scaled_dot_product_attention again"
            return
        if stating.status == "passed" or rep.status != "passed":
            rep, declared = stating, {**declared, "scale": next(iter(stated))}
            row.why += (f"; the explicit reference audited with scale={declared['scale']:g}, the scale the layer "
                        f"states to SDPA")
    if rep.status != "passed":
        row.bugs["reference"] = f"reference {rep.status}: {rep.status_reason[:120]}"
        return
    for bug in injected:
        if bug in mask_bugs and not routed.masked:
            row.bugs[bug] = NO_MASK
            continue
        if bug == "missing_scale" and all(scale == 1.0 for scale in routed.scales):  # nViT: q and k scaled before
            row.bugs[bug] = "not applicable: the layer scales q and k itself and hands SDPA a scale of 1, nothing to drop"
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
        elif report.status == "passed" and masks_the_future(report):
            # the hint the report gives, followed as a user would: a layer that masks the future itself is audited as
            # causal, so that its bugs (a causal mask dropped) are measured against that promise
            again = diagnostics.audit(make(name), progress=False, causal=True)
            row.declared = f"{CAUSAL}: {again.status}"
            if again.status == "passed":
                declared = {"causal": True}
            else:
                row.findings = sorted(f.detector + ("" if f.verdict == "fail" else f" ({f.verdict})")
                                      for f in again.findings)
        passed = report.status == "passed" or row.declared.endswith(": passed")
        if bugs and passed:
            inject(row, declared, injected, mask_bugs, make)
    except AuditUsageError as exc:
        row.judged("usage error", str(exc))
        if exc.adapter == "image":  # the fix it names, adapters.image(layer), followed as a user would
            length = diagnostics.adapters.image_seq_len(make(name))
            try:
                again = diagnostics.audit(diagnostics.adapters.image(make(name)), progress=False,
                                          **({"seq_len": length} if length else {}))
                row.declared = f"adapters.image(layer){f', seq_len={length}' if length else ''}: {again.status}"
                row.findings = sorted(f.detector + ("" if f.verdict == "fail" else f" ({f.verdict})")
                                      for f in again.findings)
            except Exception as again_exc:
                row.declared = f"adapters.image(layer): raised {type(again_exc).__name__}"
    except Exception as exc:
        row.verdict = "crashed"
        row.why = f"{type(exc).__name__}: {str(exc)[:200]} | " + traceback.format_exc().splitlines()[-3][:200]
    return row
