"""Libraries of attention layers for `python benchmarks/sweep.py PACKAGE`: every attention class a package defines.

    python benchmarks/sweep.py {x_transformers,vit_pytorch,open_clip,whisper} [--no-bugs] [--jobs N] ...

The layer audit's population on code nobody here wrote and nobody here chose: every nn.Module class whose name ends
in "Attention" defined in any module of the package (walked with pkgutil; a module that does not import in this
installation, for an optional dependency, is left out and its classes are not in the population; a `__main__` is
not imported), named
"<module>:<class>" with the module relative to the package. Each is built small from its constructor's own parameter
names, as the diffusers sweep builds its classes (`TINY`: 32 wide, 4 heads of 8; `REQUIRED` only where the
constructor has no default; a required parameter it cannot fill is a row "not built" saying which), must run a plain
forward on (1, 16, 32) tokens, given as every stream the forward requires (q, k and v, a context) (else "not built"
with the error: the population is what runs on the audit's inputs), and is audited zero-config with
`diagnostics.audit(layer)`; an inconclusive audit that names a declaration is audited once more with it, and the row says what that gave (benchmarks/sweep_diffusers.py's `run`). Bugs go in
through torch's SDPA where the layer calls it (most of these layers write their attention out with einsum: then the
row says no bug was injected).

The packages are those of the `zoo` extra (pyproject.toml pins their versions); the sweep needs it installed. Any other
installed package is swept the same way by its import name (`python benchmarks/sweep.py local_attention`).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from sweep_diffusers import D, REQUIRED, TINY, WIDTH, T, _filled, run

PACKAGES = {"x_transformers": "x-transformers", "vit_pytorch": "vit-pytorch", "open_clip": "open-clip-torch",
            "whisper": "openai-whisper"}  # import name -> distribution (its version names the results file)


# row name -> why it fails: a problem of the package's own, confirmed by a plain script outside the audit
# (tests/test_sweep_packages.py), as sweep.py's KNOWN for transformers
KNOWN = {
    "model:MultiHeadAttention": "openai-whisper 20250625, whisper/model.py:125: on its SDPA path (the default) the "
                                "mask is read as a flag, `is_causal=mask is not None and n_ctx > 1`, its values never "
                                "read: a padding mask gives the causal output, and the same call on the explicit path "
                                "(`use_sdpa = False`, line 132, which adds the mask) differs. Whisper itself passes "
                                "only its causal mask, so its own models are right; a caller's other mask is not",
    # packages beyond the zoo's, swept by name (2026-12-06); each confirmed by tests/test_sweep_packages.py's plain
    # script where the package is installed
    "linear_attention_transformer:SelfAttention":
        "linear-attention-transformer 0.19.1, linear_attention_transformer.py:217: `q = q * dim ** -0.5` after "
        "`q.softmax(dim=-1)` in `linear_attn`: every row of the kernel sums to 1/sqrt(d_head), not 1 (values all ones "
        "come out 0.354 at d_head = 8); efficient attention (Shen et al.) normalises both feature maps and no more",
    "adaptive_attention:AdaptiveAttention":
        "mmdit 0.3.0, adaptive_attention.py: each head's output projected to the full width by `to_out_weights` "
        "(heads, dim_head, dim) and the heads then concatenated, `b h n d -> b n (h d)`: the output is heads x dim "
        "wide, so `x + attn(x)` raises; the heads' projections are to be summed",
    **dict.fromkeys(("nTransformer:Attention", "nGPTExperimental:Attention"),
                    "nGPT-pytorch 0.2.16: causal by default, the layer passes `attn_mask` and `is_causal=self.causal` "
                    "to SDPA together, which refuses both: any mask raises (Explicit attn_mask should not be set when "
                    "is_causal=True)"),
    "sinkhorn_transformer:SinkhornSelfAttention":
        "sinkhorn-transformer 0.11.4, sinkhorn_transformer.py:276: the sort net routes each query bucket by the mean "
        "of every key bucket, `sk = b_k.mean(dim=2)`, padded keys included (the mask, `input_mask`, reaches the "
        "attention scores only): keys the mask blocks move the kept tokens' outputs (0.18 where the outputs reach "
        "0.64, the padded tokens x1000), so in no convention is its mask honoured: `runs` names mask='key_keep', the "
        "convention it runs in that its name suggests, and under it mask_honoured fails",
    "experimental:LinearAttention":
        "perceiver-pytorch 0.11.0, perceiver_pytorch/experimental.py:42: `context = einsum('b n d, b n e -> b d e', "
        "q, k)` then `out = einsum('b d e, b n d -> b n e', context, v)`: the context is q^T k, not k^T v, so each "
        "output row is its own token's value times one matrix (keys_matter: token 5's values changed move row 5 "
        "only); its mask, filled into k of shape (B x H, T, d) after k's softmax, takes a form no convention of the "
        "audit's expresses (runs)",
    "routing_transformer:SelfAttention":
        "routing-transformer 1.6.1, routing_transformer.py, KmeansAttention.forward: tokens go to clusters by the "
        "k-means distances of every token, padded ones included (the mask, `input_mask`, reaches the scores within a "
        "cluster only): padded tokens redrawn move every kept token's output (up to 0.28 where the outputs reach "
        "0.49), so in no convention is its mask honoured: `runs` names mask='key_keep', the convention it runs in that "
        "its name suggests, and under it mask_honoured fails; and a token no cluster takes gets an output of zeros "
        "(weight_row_sums)",
    **dict.fromkeys(("transformers.primer_ez:MultiDConvHeadAttention",
                     "transformers.primer_ez.variations:MultiDPHConvHeadAttention",
                     "transformers.primer_ez.variations:MultiDSharedConvHeadAttention",
                     "transformers.primer_ez.efficient:MultiDConvHeadAttention"),
                    "labml-nn 0.5.1, labml_nn/transformers/primer_ez/__init__.py:96 (SpatialDepthWiseConvolution, a "
                    "depthwise convolution of kernel 3 along the sequence; efficient.py:37 writes it as shifted "
                    "slices) runs over the keys and values before the mask reaches the scores "
                    "(transformers/mha.py:187): a key the mask blocks is carried into the next two, so left padding (or "
                    "any mask that blocks a key before an allowed one) moves the kept tokens' outputs (mask_honoured, "
                    "and relative_positions as its consequence); a causal mask and padding at the end, Primer's own "
                    "uses, are honoured"),
    "nystrom_attention:NystromAttention":
        "nystrom-attention 0.0.14, nystrom_attention.py:19: the pseudo-inverse's start, `x.T / (torch.max(col) * "
        "torch.max(row))`, takes the maxima over the whole batch, so one sequence's output moves when only another "
        "changes (batch_independence; 0.3% of its largest value at std-1 inputs)",
}


def package_version(package: str) -> str:
    """The version of the distribution that installs `package` (PACKAGES', or the one the metadata names)."""
    from importlib.metadata import packages_distributions, version

    return version(PACKAGES.get(package) or packages_distributions().get(package, [package])[0])


def package_types(package: str) -> list[str]:
    """Every *Attention nn.Module class defined in a module of `package` ("<module>:<class>"), sorted."""
    import torch

    root = importlib.import_module(package)
    names = []
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        if info.name.endswith(".__main__"):  # a command line (whisper's), run on import
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: not in this installation's population
            continue
        for n, c in vars(module).items():
            if inspect.isclass(c) and c.__module__ == module.__name__ and n.endswith("Attention") \
                    and issubclass(c, torch.nn.Module):
                names.append(f"{module.__name__[len(root.__name__) + 1:]}:{n}")
    return sorted(names)


WINDOW = 4
LORA_RANK = 4  # a low-rank adapter's rank (labml-nn's LoRA GPT-2 attention takes it with no default)
"""The size a window, bucket, segment or cluster count takes where the constructor has no default for it: a divisor of
the sweep's T tokens, so that windowed, bucketed and segmented attentions run on them."""
PACKAGE_REQUIRED = {**REQUIRED, **dict.fromkeys(("window_size", "bucket_size", "segment_len", "sliding_window_size",
                                                 "block_size", "chunk_size", "local_window_size",
                                                 "compress_block_size", "selection_block_size"), WINDOW),
                    "num_clusters": WINDOW // 2, "num_selected_blocks": 2, "compress_block_sliding_stride": WINDOW // 2,
                    "local_attn_heads": 0, "depth": 1, "max_seq_len": 4 * T,
                    "dropout_prob": 0.0, "d_k": WIDTH, "d_head": WIDTH, "d_cond": D, "r": LORA_RANK,
                    "is_causal": False}
"""REQUIRED (benchmarks/sweep_diffusers.py), and the sizes layers of these packages need with no default: local,
bucketed (Reformer's, Sinkhorn's), segmented (Titans'), clustered (Routing Transformer's) and block-sparse (native
sparse attention's) attentions, a maximum length of 4 T; labml-nn's dropout, head width, conditioning width and LoRA
rank, and a causal flag it asks for with no default (False: the sweep audits zero-config, bidirectionally)."""


def package_build(package: str, name: str):
    """The class `name` names, built small from its constructor's parameter names, in eval mode, after a plain
    forward on (1, T, D) tokens."""
    import torch

    module, cls_name = name.split(":")
    cls = getattr(importlib.import_module(f"{package}.{module}"), cls_name)
    torch.manual_seed(0)
    layer = cls(**_filled(cls, TINY, PACKAGE_REQUIRED)).eval()
    x = torch.randn(1, T, D)
    with torch.no_grad():  # every stream it requires the tokens: q, k and v (local-attention's), a context (CoCa's),
        # by keyword where forward takes them so (labml-nn's forward(*, query, key, value))
        layer(*(x,) * max(0 if required_streams(layer, keyword=True) else 1, len(required_streams(layer))),
              **dict.fromkeys(required_streams(layer, keyword=True), x))
    return layer


def required_streams(layer, *, keyword: bool = False) -> list[str]:
    """The parameters of the layer's forward that have no default, positional (or, `keyword`, keyword-only): the
    streams it cannot run without."""

    from diagnostics._subject import _forward_parameters

    kinds = (inspect.Parameter.KEYWORD_ONLY,) if keyword else (inspect.Parameter.POSITIONAL_ONLY,
                                                                inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in _forward_parameters(layer) if p.default is p.empty and p.kind in kinds]


def run_package(package: str, row, *, bugs: bool, injected: tuple, mask_bugs: tuple):
    """The sweep's row for `row.model_type` of `package`: the diffusers sweep's audit with this package's build."""
    return run(row, bugs=bugs, injected=injected, mask_bugs=mask_bugs,
               build=lambda name: package_build(package, name))
